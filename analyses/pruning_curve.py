"""Iterative head pruning: the curve of loss and accuracy as the least important heads are masked step by step,
with random-order and single-head-ablation-order baselines on the same schedule."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from probe.analyses.pruning_data import PruningData, token_batches
from probe.analyses.pruning_importance import (Metric, ascending_heads, evaluate_masks, head_importance, present_heads,
                                               refuse_next_token_evaluation)
from probe import HookedDecoder
from probe.analyses.common import TableDisplay

# ---- iterative pruning ----------------------------------------------------------------------------
METHOD_IMPORTANCE, METHOD_RANDOM, METHOD_ABLATION = "importance", "random", "single-head ablation"


@dataclass
class PruningCurve(TableDisplay):
    """The iterative pruning curve and its baselines, on one schedule of head counts.

    n_pruned: [step] heads masked after each step (0 first). loss / accuracy: [step] evaluation
    next-token loss and accuracy with the least important heads masked (importance re-estimated after
    every step). random_loss / random_accuracy: [seed step] masking in a random order per seed.
    ablation_loss / ablation_accuracy: [step] masking in the order of each head's single-head
    zero-ablation effect on the loss (smallest first, measured once on the unmasked model); None when
    not computed. pruned: for each step the heads (layer, head; current indices) the importance
    method masked in it. orders: the baselines' full orders, keyed "random (seed S)" and
    "single-head ablation"."""

    n_heads: int
    n_pruned: torch.Tensor
    loss: torch.Tensor
    accuracy: torch.Tensor
    random_loss: torch.Tensor
    random_accuracy: torch.Tensor
    seeds: tuple[int, ...]
    ablation_loss: Optional[torch.Tensor]
    ablation_accuracy: Optional[torch.Tensor]
    pruned: list[list[tuple[int, int]]]
    orders: dict[str, list[tuple[int, int]]]

    @property
    def fraction(self) -> torch.Tensor:  # [step]
        return self.n_pruned.double() / self.n_heads

    def heads_pruned(self, fraction: float = 1.0) -> list[tuple[int, int]]:
        """The heads the importance method had masked at the last step whose pruned fraction is at most
        `fraction`, in the order masked: pass them to `prune_heads`."""
        out = []
        for step, n in enumerate(self.n_pruned.tolist()):
            if n > fraction * self.n_heads + 1e-6:
                break
            out.extend(self.pruned[step])
        return out

    def to_frame(self) -> pd.DataFrame:
        """One row per (method, seed, step): method, seed (random order only), step, n_pruned,
        fraction_pruned, loss, accuracy."""
        rows = []

        def add(method, seed, loss, acc):
            for step, (n, f) in enumerate(zip(self.n_pruned.tolist(), self.fraction.tolist())):
                rows.append({"method": method, "seed": seed, "step": step, "n_pruned": n, "fraction_pruned": f,
                             "loss": float(loss[step]), "accuracy": float(acc[step])})

        add(METHOD_IMPORTANCE, None, self.loss, self.accuracy)
        for i, seed in enumerate(self.seeds):
            add(METHOD_RANDOM, seed, self.random_loss[i], self.random_accuracy[i])
        if self.ablation_loss is not None:
            add(METHOD_ABLATION, None, self.ablation_loss, self.ablation_accuracy)
        frame = pd.DataFrame(rows, columns=["method", "seed", "step", "n_pruned", "fraction_pruned", "loss", "accuracy"])
        frame["seed"] = frame["seed"].astype("Int64")  # missing for the deterministic orders
        return frame

    def figure(self) -> go.Figure:
        fig = make_subplots(rows=1, cols=2, subplot_titles=("evaluation loss (lower is better)", "next-token accuracy"),
                            horizontal_spacing=0.1)
        x = self.fraction.tolist()
        n = self.n_pruned.tolist()
        colors = {METHOD_IMPORTANCE: "#1f77b4", METHOD_RANDOM: "#7f7f7f", METHOD_ABLATION: "#d62728"}
        for col, (what, imp, rand, abl) in enumerate([
            ("loss", self.loss, self.random_loss, self.ablation_loss),
            ("accuracy", self.accuracy, self.random_accuracy, self.ablation_accuracy),
        ], start=1):
            first = col == 1
            hover = f"%{{customdata}} heads pruned (%{{x:.1%}})<br>{what} %{{y:.5f}}"
            if len(self.seeds):
                low, high, mean = rand.min(dim=0).values, rand.max(dim=0).values, rand.mean(dim=0)
                fig.add_trace(go.Scatter(x=x, y=high.tolist(), mode="lines", line=dict(width=0), showlegend=False,
                                         legendgroup="random", customdata=n, hovertemplate=hover + "<extra>random, max</extra>"),
                              row=1, col=col)
                fig.add_trace(go.Scatter(x=x, y=low.tolist(), mode="lines", line=dict(width=0), fill="tonexty",
                                         fillcolor="rgba(127,127,127,0.25)", legendgroup="random", showlegend=False,
                                         customdata=n, hovertemplate=hover + "<extra>random, min</extra>"),
                              row=1, col=col)
                fig.add_trace(go.Scatter(x=x, y=mean.tolist(), mode="lines+markers", line=dict(color=colors[METHOD_RANDOM], dash="dash"),
                                         name=f"random order (mean, min-max of {len(self.seeds)} seeds)", legendgroup="random",
                                         showlegend=first, customdata=n, hovertemplate=hover + "<extra>random, mean</extra>"),
                              row=1, col=col)
            if abl is not None:
                fig.add_trace(go.Scatter(x=x, y=abl.tolist(), mode="lines+markers", line=dict(color=colors[METHOD_ABLATION]),
                                         name="single-head ablation order", legendgroup="ablation", showlegend=first,
                                         customdata=n, hovertemplate=hover + "<extra>ablation order</extra>"),
                              row=1, col=col)
            fig.add_trace(go.Scatter(x=x, y=imp.tolist(), mode="lines+markers", line=dict(color=colors[METHOD_IMPORTANCE], width=3),
                                     name="importance (iterative)", legendgroup="importance", showlegend=first,
                                     customdata=n, hovertemplate=hover + "<extra>importance</extra>"),
                          row=1, col=col)
            fig.update_xaxes(title="fraction of heads pruned", tickformat=".0%", row=1, col=col)
            fig.update_yaxes(title=what, row=1, col=col)
        fig.update_layout(title=f"Pruning attention heads ({self.n_heads} in all): importance order vs baselines",
                          width=1100, height=460, legend=dict(orientation="h", y=-0.2))
        return fig


def pruning_schedule(n_heads: int, step: float, max_fraction: float = 1.0) -> list[int]:
    """Cumulative numbers of heads pruned after each step: each step masks round(step x remaining)
    heads, at least one, up to floor(max_fraction x n_heads)."""
    if not 0 < step <= 1:
        raise ValueError(f"step is the fraction of the remaining heads pruned per step, in (0, 1]; got {step}")
    if not 0 < max_fraction <= 1:
        raise ValueError(f"max_fraction must be in (0, 1], got {max_fraction}")
    limit = int(math.floor(max_fraction * n_heads + 1e-9))
    counts, done = [], 0
    while done < limit:
        done = min(limit, done + max(1, int(math.floor(step * (n_heads - done) + 0.5))))
        counts.append(done)
    return counts


def prune_by_importance(
    model: HookedDecoder,
    data: PruningData = None,
    eval_data: PruningData = None,
    *,
    step: float = 0.1,
    max_fraction: float = 1.0,
    stop_accuracy: Optional[float] = None,
    metric: Optional[Metric] = None,
    normalize: bool = True,
    seeds: Sequence[int] = (0, 1, 2),
    ablation_baseline: bool = True,
    batch_size: int = 8,
    seq_len: Optional[int] = None,
    max_windows: Optional[int] = None,
    progress: bool = True,
) -> PruningCurve:
    """Iterative pruning (Michel et al. 2019): mask (zero-ablate, via hook_z) the least important
    `step` fraction of the remaining heads, re-estimate importance on `data` with the mask in place,
    evaluate next-token loss and accuracy on `eval_data`; repeat until `max_fraction` of the heads
    are pruned, or until the accuracy falls below `stop_accuracy` x the unpruned accuracy (that step
    is kept). The model itself is never changed.

    Baselines on the same schedule: random orders (one per seed) and the order of single-head
    zero-ablation effects on `data`'s loss (smallest increase first). `eval_data` defaults to `data`;
    pass held-out text for an honest curve. Data: see `token_batches` (`max_windows` caps each).
    With `normalize` (the paper's per-layer L2 normalisation) a layer's last remaining head always
    scores 1, so near the end of the curve heads alone in their layers tie (broken by position).
    """
    refuse_next_token_evaluation(model, "prune_by_importance")
    if stop_accuracy is not None and not 0 < stop_accuracy <= 1:
        raise ValueError(f"stop_accuracy is a fraction of the unpruned accuracy, in (0, 1]; got {stop_accuracy}")
    batches = token_batches(model, data, batch_size, seq_len, max_windows)
    eval_batches = batches if eval_data is None else token_batches(model, eval_data, batch_size, seq_len, max_windows)
    present = present_heads(model)
    n_heads = int(present.sum())
    if n_heads == 0:
        raise ValueError("the model has no attention heads left to prune")
    counts = pruning_schedule(n_heads, step, max_fraction)
    from tqdm.auto import tqdm

    mask = present.float()
    loss0, acc0 = evaluate_masks(model, eval_batches, mask[None])
    losses, accs, pruned, n_pruned = [float(loss0)], [float(acc0)], [[]], [0]
    for target in tqdm(counts, desc="pruning", unit="step", disable=not progress):
        scores = head_importance(model, batches, metric=metric, normalize=normalize, mask=mask, progress=False).scores
        chosen = ascending_heads(scores)[: target - n_pruned[-1]]
        for l, h in chosen:
            mask[l, h] = 0.0
        loss, acc = evaluate_masks(model, eval_batches, mask[None])
        losses.append(float(loss))
        accs.append(float(acc))
        pruned.append(chosen)
        n_pruned.append(target)
        if stop_accuracy is not None and float(acc) < stop_accuracy * float(acc0):
            break

    slots = torch.nonzero(present)  # [n_heads 2]: the present (layer, head) pairs
    orders, names = [], [f"random (seed {int(s)})" for s in seeds] + ([METHOD_ABLATION] if ablation_baseline else [])
    for seed in seeds:
        gen = torch.Generator().manual_seed(int(seed))
        orders.append(slots[torch.randperm(n_heads, generator=gen)])
    if ablation_baseline:
        single = present.float()[None].repeat(n_heads, 1, 1)
        single[torch.arange(n_heads), slots[:, 0], slots[:, 1]] = 0.0  # mask i ablates head i alone
        effect, _ = evaluate_masks(model, batches, single, desc="baseline: single-head ablations" if progress else None)
        orders.append(slots[effect.argsort(stable=True)])
    masks = present.float()[None, None].repeat(len(orders), len(n_pruned), 1, 1)  # [order step layer head]
    for o, order in enumerate(orders):
        for s, n in enumerate(n_pruned):
            masks[o, s, order[:n, 0], order[:n, 1]] = 0.0
    if orders:
        base_loss, base_acc = evaluate_masks(model, eval_batches, masks.flatten(0, 1),
                                             desc="baselines: their pruning curves" if progress else None)
        base_loss, base_acc = base_loss.view(len(orders), -1), base_acc.view(len(orders), -1)
    else:  # no baselines asked for (seeds=(), ablation_baseline=False)
        base_loss = base_acc = torch.empty(0, len(n_pruned))
    n_random = len(seeds)
    return PruningCurve(
        n_heads=n_heads, n_pruned=torch.tensor(n_pruned), loss=torch.tensor(losses), accuracy=torch.tensor(accs),
        random_loss=base_loss[:n_random], random_accuracy=base_acc[:n_random], seeds=tuple(int(s) for s in seeds),
        ablation_loss=base_loss[n_random] if ablation_baseline else None,
        ablation_accuracy=base_acc[n_random] if ablation_baseline else None,
        pruned=pruned,
        orders={name: [(int(l), int(h)) for l, h in order.tolist()] for name, order in zip(names, orders)},
    )
