"""A running top-k over a stream of batches, exact and on the device: no host synchronisation.

The corpus scans (`analyses.trigger_scanner`, `analyses.feature_scan`) keep, for every unit (an FFN neuron,
an SAE feature), its k highest activations ordered by (activation descending, corpus order). Each batch
is folded in with fixed shapes only, so a GPU never waits for the host: no `.item()`, no `nonzero`, no
boolean indexing, no `bincount` (CUDA's reads the maximum back to size its output).

`torch.topk` finds the k largest values exactly, but which of several equal values it returns at the
k-th slot is unspecified. `candidates` therefore finds the earliest rows tied with the k-th value from a
running count of the ties (`searchsorted` of 1..k in it); `fold` merges those candidates into the kept
top-k with one stable sort, the kept entries (earlier in the corpus) winning ties.
"""
from __future__ import annotations

import math

import torch


def candidates(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [unit row] (rows in corpus order; an entry that must not count is -inf) -> values, rows [unit 2k']
    with k' = min(k, row): every row of each unit's top-k by (value descending, row ascending), plus filler
    entries of value -inf. One top-k and one running count over x, whatever the ties."""
    n_rows = x.shape[-1]
    k = min(k, n_rows)
    values, rows = x.topk(k, dim=-1)  # the k largest values; among ties at the k-th, arbitrary rows
    kth = values[..., -1:]
    # every value above the k-th is in the top-k; of those equal to it, the earliest rows are: the j-th
    # of them is the first row where the running count of ties reaches j
    ties = torch.eq(x, kth, out=torch.empty(x.shape, dtype=torch.int32, device=x.device)).cumsum_(dim=-1)  # [unit row]
    nth = torch.arange(1, k + 1, dtype=torch.int32, device=x.device).expand(*ties.shape[:-1], k).contiguous()
    tied_rows = torch.searchsorted(ties, nth).clamp_(max=n_rows - 1)  # past the last row: fewer ties than j
    tied = torch.where(nth <= ties[..., -1:], x.gather(-1, tied_rows), -math.inf)  # x's own: -0.0 stays -0.0
    above = torch.where(values > kth, values, -math.inf)  # also drops NaN, which never enters a top-k
    return torch.cat([above, tied], dim=-1), torch.cat([rows, tied_rows], dim=-1)


def fold(kept: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, k: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge a batch's `candidates` (values, rows [... m]) into the kept top-k values [... k] (ordered by value,
    ties in corpus order, empty slots -inf), the batch coming after everything kept.

    Returns (values [... k], from_kept [... k] bool, index [... k]): each slot's value, and where it comes
    from: the kept slot `index` where from_kept, else the batch row `index`."""
    order = rows.argsort(dim=-1, stable=True)  # the batch's candidates in corpus order
    values, rows = values.gather(-1, order), rows.gather(-1, order)
    both = torch.cat([kept, values], dim=-1)
    top = (-both).argsort(dim=-1, stable=True)[..., :k]  # stable: ties keep corpus order, -inf (empty) last
    n_kept = kept.shape[-1]
    from_kept = top < n_kept
    index = torch.where(from_kept, top, rows.gather(-1, (top - n_kept).clamp(min=0)))
    return both.gather(-1, top), from_kept, index
