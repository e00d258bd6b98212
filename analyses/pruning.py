"""Head importance and head pruning (Michel, Levy & Neubig 2019, "Are Sixteen Heads Really Better than One?").

- `head_importance`: I_h = E_x |dL(x)/dxi_h|, the sensitivity of the loss to a gate xi_h that scales
  head h's output (`hook_z`), at xi = 1 (or at a given mask). The absolute value is taken per
  example (per sequence), as in the paper: the gate gets a batch dimension, and since an example's
  loss depends only on its own row of gates, one backward pass of the summed loss gives every
  example's gradient for every head at once.
- `prune_by_importance`: the iterative curve: mask the least important fraction of the remaining
  heads, re-estimate importance with the mask in place, evaluate; with random-order and
  single-head-ablation-order baselines on the same schedule.
- `prune_heads`: structural pruning; a new, smaller model whose outputs equal the original's with
  those heads zero-ablated. `save_pruned` / `load_pruned` keep its head map (see below) on disk.

Head indices. A structurally pruned model numbers each layer's remaining heads 0..k-1. `prune_heads`
takes heads by their index in the ORIGINAL (unpruned) model and records, on the model it returns,
`head_map`: per layer, the original index of each remaining head (`head_map[layer][i]` is the
original index of the pruned model's head i), so a pruned model can be pruned again with original
indices. The analyses (`head_importance`, `prune_by_importance`) work on any model and use its
current indices; `original_heads(model, heads)` translates them.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

import pandas as pd
import plotly.graph_objects as go
import torch
from einops import rearrange
from plotly.subplots import make_subplots

from analyses.common import evaluate_metric
from analyses.corpus import _encode_document, _iter_document_pieces
from probe import HELDOUT_TEXT, HookedDecoder
from probe.io import atomic_directory
from probe.names import act_name

Metric = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PruningData = Union[None, str, os.PathLike, Sequence[str], torch.Tensor, Iterable[torch.Tensor]]
HeadMap = tuple[tuple[int, ...], ...]
HEAD_MAP_FILE = "head_map.json"
# Stacked evaluation forwards are chunked so their logits stay under about this many floats.
LOGIT_BUDGET = 2**26


# ---- data ------------------------------------------------------------------------------------------
def token_batches(
    model: HookedDecoder,
    data: PruningData = None,
    batch_size: int = 8,
    seq_len: Optional[int] = None,
    max_windows: Optional[int] = None,
) -> list[torch.Tensor]:
    """The data as a list of token batches [batch pos] on the model's device.

    data: None (the bundled held-out Shakespeare, `probe.HELDOUT_TEXT`), a `pathlib.Path` to a UTF-8
    text file or to a folder of `*.txt` files (each one document), a string (the text itself), a list
    of strings, token ids [batch pos] (split into batches of `batch_size` rows), or an iterable of
    token batches (kept as given). Texts are tokenised into one stream, each document preceded by
    BOS, and cut into non-overlapping windows of BOS + seq_len - 1 tokens (default seq_len: n_ctx),
    the way the bundled model was trained; a ragged tail is dropped unless it is all there is.
    `max_windows` caps the number of rows (windows) used. Files are read and tokenised a piece at a
    time (`analyses.corpus`), and reading stops once `max_windows` windows are full.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1 or None, got {max_windows}")
    if data is None:
        data = Path(HELDOUT_TEXT)
    documents = None  # each document as consecutive text pieces
    if isinstance(data, os.PathLike):
        documents = (pieces for _, pieces in _iter_document_pieces(data))
    elif isinstance(data, str):
        documents = [(data,)]
    elif isinstance(data, (list, tuple)) and data and all(isinstance(t, str) for t in data):
        documents = [(text,) for text in data]
    if documents is not None:
        rows = _windows(model, documents, seq_len or model.cfg.n_ctx, max_windows)
        return [model.validate_tokens(b) for b in rows.split(batch_size)]
    if isinstance(data, torch.Tensor):
        rows = _check_length(model.validate_tokens(data))
        if max_windows is not None:
            rows = rows[:max_windows]
        return list(rows.split(batch_size))
    if not isinstance(data, Iterable):
        _not_tokens(data)
    batches = [_check_length(model.validate_tokens(b)) if isinstance(b, torch.Tensor) else _not_tokens(b) for b in data]
    if not batches:
        raise ValueError("the data is empty: give at least one text or one batch of token ids")
    if max_windows is not None:
        kept, left = [], max_windows
        for b in batches:
            if left <= 0:
                break
            kept.append(b[:left])
            left -= len(kept[-1])
        batches = kept
    return batches


def _not_tokens(value):
    raise TypeError(
        f"data must be None, a pathlib.Path, a string, a list of strings, token ids [batch pos] or an iterable "
        f"of token-id batches; got {type(value).__name__}"
    )


def _check_length(tokens: torch.Tensor) -> torch.Tensor:
    """Token ids with at least one next token to predict: a 1-token row has no loss, and would
    make the mean loss (and every importance) NaN."""
    if tokens.shape[-1] < 2:
        raise ValueError(
            f"token ids of shape {tuple(tokens.shape)} have fewer than 2 positions: the loss needs at least "
            f"one token after the first; pass longer sequences"
        )
    return tokens


def _windows(
    model: HookedDecoder, documents: Iterable[Iterable[str]], seq_len: int, max_windows: Optional[int]
) -> torch.Tensor:
    """[window seq_len]: BOS + the next seq_len - 1 ids of the stream of documents (each BOS +
    its ids), built a span at a time so only the windows and one span's ids are ever held. A
    tokenizer without a BOS (GPT-1's) gives windows of seq_len ids of the documents run together."""
    if not 2 <= seq_len <= model.cfg.n_ctx:
        raise ValueError(f"seq_len must be between 2 and n_ctx={model.cfg.n_ctx}, got {seq_len}")
    tokenizer = model._require_tokenizer()
    bos = tokenizer.bos_id
    body_len = seq_len if bos is None else seq_len - 1

    def spans():
        for pieces in documents:
            if bos is not None:
                yield [bos]
            yield from _encode_document(tokenizer, pieces)

    bodies: list[torch.Tensor] = []  # [n body_len] blocks of full windows, in stream order
    n_rows, carry = 0, []  # carry: ids after the last full window
    for span in spans():
        carry.extend(span)
        n = len(carry) // body_len
        if max_windows is not None:
            n = min(n, max_windows - n_rows)
        if n:
            bodies.append(torch.tensor(carry[: n * body_len], dtype=torch.long).view(n, body_len))
            carry, n_rows = carry[n * body_len:], n_rows + n
        if max_windows is not None and n_rows >= max_windows:
            break  # enough windows: the rest of the corpus is never read
    if n_rows == 0:
        if len(carry) < 2:
            raise ValueError("the text is empty (or one token): the loss needs at least two tokens, BOS included")
        return torch.tensor(carry, dtype=torch.long)[None]  # shorter than one window: use it whole
    body = torch.cat(bodies)
    if bos is None:
        return body
    return torch.cat([torch.full((n_rows, 1), bos, dtype=torch.long), body], dim=1)


# ---- the head gate --------------------------------------------------------------------------------
def present_heads(model: HookedDecoder) -> torch.Tensor:
    """[layer head] bool: which head slots exist (all of them unless the model was structurally pruned,
    where layer l has its first cfg.layer_heads(l) slots)."""
    cfg = model.cfg
    counts = torch.tensor([cfg.layer_heads(l) for l in range(cfg.n_layers)])
    return torch.arange(cfg.n_heads)[None, :] < counts[:, None]


def _gate_hooks(model: HookedDecoder, xi: torch.Tensor) -> list:
    """Hooks multiplying each head's z by its gate; xi is [layer head] or [batch layer head]."""

    def gate(z: torch.Tensor, hook, layer: int) -> torch.Tensor:
        g = xi[..., layer, : z.shape[2]].to(z.dtype)
        if g.dim() == 1:
            return z * rearrange(g, "head -> 1 1 head 1")
        return z * rearrange(g, "batch head -> batch 1 head 1")

    return [(act_name("z", l), lambda z, hook, l=l: gate(z, hook, l)) for l in range(model.cfg.n_layers)]


def _lm_loss(logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[batch]: mean next-token cross-entropy of each row."""
    logprobs = logits[:, :-1].float().log_softmax(dim=-1)
    return -logprobs.gather(-1, tokens[:, 1:, None])[..., 0].mean(dim=1)


_lm_loss.label = "loss"


def _check_mask(model: HookedDecoder, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The gate's value for every slot [layer head] (float, on the model's device): the mask where
    given, 0 in slots a structurally pruned model does not have."""
    present = present_heads(model).to(model.device)
    if mask is None:
        return present.float()
    shape = (model.cfg.n_layers, model.cfg.n_heads)
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != shape:
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a tensor [layer head] = {shape} (1 = kept, 0 = masked), got {got}")
    return mask.to(model.device, torch.float32) * present


# ---- importance -----------------------------------------------------------------------------------
def _ascending(scores: torch.Tensor) -> list[tuple[int, int]]:
    """(layer, head) of the non-NaN entries of scores [layer head], smallest first (ties: lower index)."""
    flat = scores.flatten()
    keep = ~flat.isnan()
    index = torch.nonzero(keep)[:, 0][flat[keep].argsort(stable=True)]
    n_head = scores.shape[1]
    return [(int(i) // n_head, int(i) % n_head) for i in index]


@dataclass
class HeadImportance:
    """scores: [layer head] the importance I_h (normalised within each layer when `normalized`);
    raw: [layer head] mean over examples of |dL/dxi_h| before normalising. NaN where a head is masked
    or (structurally pruned models) absent."""

    scores: torch.Tensor
    raw: torch.Tensor
    n_examples: int
    normalized: bool
    metric_name: str

    def to_frame(self) -> pd.DataFrame:
        n_layer, n_head = self.scores.shape
        layer, head = torch.meshgrid(torch.arange(n_layer), torch.arange(n_head), indexing="ij")
        return pd.DataFrame({
            "layer": layer.flatten().numpy(), "head": head.flatten().numpy(),
            "importance": self.scores.flatten().numpy(), "raw_importance": self.raw.flatten().numpy(),
        })

    def order(self) -> list[tuple[int, int]]:
        """The unmasked heads, least important first."""
        return _ascending(self.scores)

    def figure(self) -> go.Figure:
        n_layer, n_head = self.scores.shape
        what = "importance (L2-normalised per layer)" if self.normalized else "importance"
        fig = go.Figure(go.Heatmap(
            z=self.scores.numpy(), x=list(range(n_head)), y=list(range(n_layer)),
            colorscale="Viridis", zmin=0, colorbar=dict(title="importance"), customdata=self.raw.numpy(),
            hovertemplate="layer %{y} head %{x}<br>importance %{z:.5f}<br>mean |dL/dξ| %{customdata:.5g}<extra></extra>",
        ))
        fig.update_layout(
            title=f"Head {what}: mean |d {self.metric_name} / d head gate| over {self.n_examples} sequences",
            width=180 + 45 * n_head, height=160 + 45 * n_layer,
        )
        fig.update_xaxes(title="head", dtick=1)
        fig.update_yaxes(title="layer", dtick=1, autorange="reversed")
        return fig


def head_importance(
    model: HookedDecoder,
    data: PruningData = None,
    *,
    metric: Optional[Metric] = None,
    normalize: bool = True,
    mask: Optional[torch.Tensor] = None,
    batch_size: int = 8,
    seq_len: Optional[int] = None,
    max_windows: Optional[int] = None,
    progress: bool = True,
) -> HeadImportance:
    """Importance of every head: I_h = mean over sequences x of |dL(x)/dxi_h|, xi the head gates.

    metric(logits, tokens, attention_mask) -> [batch] is the loss L of each sequence (default: mean
    next-token cross-entropy; `analyses.loss_metric` and `logit_diff_metric` fit). The gradient is
    taken at xi = `mask` ([layer head], default all ones); masked heads get NaN. `normalize` divides
    each layer's scores by their L2 norm over its unmasked heads, as in the paper, so that layers
    compare. Data: see `token_batches`. Only the gates get gradients: the model's parameters'
    `.grad` is left untouched.
    """
    metric = _lm_loss if metric is None else metric
    batches = token_batches(model, data, batch_size, seq_len, max_windows)
    base = _check_mask(model, mask)
    total = torch.zeros_like(base)
    n_examples = 0
    from tqdm.auto import tqdm

    for tokens in tqdm(batches, desc="head importance", unit="batch", disable=not progress or len(batches) < 2):
        # one gate row per sequence: that sequence's loss depends on its row only, so the gradient of
        # the summed loss holds each sequence's own dL/dxi, whose absolute value is taken per sequence
        xi = base.expand(tokens.shape[0], *base.shape).clone().requires_grad_(True)
        with torch.enable_grad():
            logits = model.run_with_hooks(tokens, fwd_hooks=_gate_hooks(model, xi))
            values = evaluate_metric(metric, logits, tokens, torch.ones_like(tokens))
            (grad,) = torch.autograd.grad(values.sum(), xi)
        total += grad.abs().sum(dim=0).float()
        n_examples += tokens.shape[0]
    raw = (total / n_examples).cpu()
    raw[base.cpu() == 0] = float("nan")
    scores = raw.clone()
    if normalize:
        norm = raw.nan_to_num(0.0).norm(dim=1, keepdim=True)
        scores = raw / torch.where(norm > 0, norm, torch.ones_like(norm))
    name = getattr(metric, "label", getattr(metric, "__name__", "metric"))
    return HeadImportance(scores=scores, raw=raw, n_examples=n_examples, normalized=normalize, metric_name=name)


# ---- evaluation under masks -----------------------------------------------------------------------
@torch.no_grad()
def evaluate_masks(
    model: HookedDecoder, batches: Sequence[torch.Tensor], masks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss and accuracy [mask] over every predicted position of `batches`, with the model's
    heads gated by each mask of `masks` [mask layer head] in turn (0 = zero-ablated). The masks are
    stacked along the batch dimension, several per forward."""
    masks = masks.to(model.device, torch.float32)
    n_masks = masks.shape[0]
    nll_sum = torch.zeros(n_masks, dtype=torch.float64)
    correct = torch.zeros(n_masks, dtype=torch.float64)
    count = 0
    for tokens in batches:
        batch, n = _check_length(tokens).shape
        per_forward = max(1, LOGIT_BUDGET // (batch * n * model.cfg.d_vocab))
        for first in range(0, n_masks, per_forward):
            chunk = masks[first: first + per_forward]
            k = chunk.shape[0]
            xi = chunk.repeat_interleave(batch, dim=0)  # row i: mask i // batch, tokens i % batch
            stacked = tokens.repeat(k, 1)
            logits = model.run_with_hooks(stacked, fwd_hooks=_gate_hooks(model, xi))[:, :-1].float()
            target = stacked[:, 1:]
            nll = -logits.log_softmax(dim=-1).gather(-1, target[..., None])[..., 0]
            hit = (logits.argmax(dim=-1) == target).double()
            nll_sum[first: first + k] += nll.double().view(k, -1).sum(dim=1).cpu()
            correct[first: first + k] += hit.view(k, -1).sum(dim=1).cpu()
        count += batch * (n - 1)
    return (nll_sum / count).float(), (correct / count).float()


# ---- iterative pruning ----------------------------------------------------------------------------
METHOD_IMPORTANCE, METHOD_RANDOM, METHOD_ABLATION = "importance", "random", "single-head ablation"


@dataclass
class PruningCurve:
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
        chosen = _ascending(scores)[: target - n_pruned[-1]]
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
        effect, _ = evaluate_masks(model, batches, single)
        orders.append(slots[effect.argsort(stable=True)])
    masks = present.float()[None, None].repeat(len(orders), len(n_pruned), 1, 1)  # [order step layer head]
    for o, order in enumerate(orders):
        for s, n in enumerate(n_pruned):
            masks[o, s, order[:n, 0], order[:n, 1]] = 0.0
    if orders:
        base_loss, base_acc = evaluate_masks(model, eval_batches, masks.flatten(0, 1))
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


# ---- structural pruning ---------------------------------------------------------------------------
def head_map_of(model: HookedDecoder, head_map: Optional[Sequence[Sequence[int]]] = None) -> HeadMap:
    """The original index of each remaining head, per layer: `head_map` if given, else the one
    `prune_heads` / `load_pruned` attached to the model, else the identity for an unpruned model."""
    cfg = model.cfg
    if head_map is None:
        head_map = getattr(model, "head_map", None)
    if head_map is None:
        if cfg.heads_per_layer is not None:
            raise ValueError(
                "this model was structurally pruned, but which original heads remain is unknown (a model loaded "
                "with from_pretrained does not carry it): load it with analyses.load_pruned (saved with "
                "save_pruned), or pass head_map= (per layer, the original index of each remaining head)"
            )
        return tuple(tuple(range(cfg.n_heads)) for _ in range(cfg.n_layers))
    head_map = tuple(tuple(int(h) for h in layer) for layer in head_map)
    counts = [cfg.layer_heads(l) for l in range(cfg.n_layers)]
    if len(head_map) != cfg.n_layers or [len(layer) for layer in head_map] != counts or any(
        len(set(layer)) != len(layer) or not all(0 <= h < cfg.n_heads for h in layer) for layer in head_map
    ):
        raise ValueError(
            f"head_map must give, for each of the {cfg.n_layers} layers, the distinct original indices (< n_heads="
            f"{cfg.n_heads}) of its remaining heads (counts {counts}); got {head_map!r}"
        )
    return head_map


def original_heads(model: HookedDecoder, heads: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(layer, current index) pairs of a pruned model translated to (layer, original index)."""
    head_map = head_map_of(model)
    return [(l, head_map[l][h]) for l, h in heads]


def prune_heads(
    model: HookedDecoder,
    heads: Iterable[tuple[int, int]],
    head_map: Optional[Sequence[Sequence[int]]] = None,
) -> HookedDecoder:
    """A new model without `heads` (layer, ORIGINAL head index): their q/k/v rows of the fused qkv
    projection (weight and bias) and their columns of the output projection are removed, and each
    layer's remaining head count goes into `cfg.heads_per_layer`. Its outputs equal the original's
    with those heads' outputs zero-ablated (their share of the output bias b_O stays, as b_O is not
    per head). The input model is not changed and shares no storage with the result.

    The result carries `head_map` (see the module docstring). The input's head map is `head_map`,
    else its own `head_map` attribute, else the identity for an unpruned model. Save with
    `save_pruned` to keep the map; `save_pretrained` / `from_pretrained` keep the model but not it.
    """
    cfg = model.cfg
    if cfg.n_kv_heads != cfg.n_heads:
        raise ValueError(
            f"prune_heads needs one key/value head per query head, but n_kv_heads={cfg.n_kv_heads} < n_heads="
            f"{cfg.n_heads}: a grouped key/value head serves several query heads and cannot go with one"
        )
    current = head_map_of(model, head_map)
    heads = list(heads)
    remove: list[set[int]] = [set() for _ in range(cfg.n_layers)]
    for pair in heads:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(i, int) for i in pair)):
            raise ValueError(f"heads must be (layer, head) pairs of ints; got {pair!r}")
        layer, head = pair
        if not 0 <= layer < cfg.n_layers or not 0 <= head < cfg.n_heads:
            raise ValueError(f"head {pair} is outside the model: layer < {cfg.n_layers}, head < {cfg.n_heads} (original indices)")
        if head not in current[layer]:
            raise ValueError(
                f"head {pair} was already pruned from this model (layer {layer} keeps original heads "
                f"{list(current[layer])}); heads are given by their index in the original model"
            )
        remove[layer].add(current[layer].index(head))
    keep = [[i for i in range(len(current[l])) if i not in remove[l]] for l in range(cfg.n_layers)]
    new_cfg = replace(cfg, heads_per_layer=tuple(len(k) for k in keep))

    d_head = cfg.d_head
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    for l, kept in enumerate(keep):
        n_l = cfg.layer_heads(l)
        within = torch.arange(d_head)
        idx = torch.tensor(kept, dtype=torch.long)[:, None] * d_head + within  # [kept d_head] rows of each kept head
        rows = torch.cat([idx.flatten() + part * n_l * d_head for part in range(3)])  # q | k | v
        prefix = f"blocks.{l}.attn"
        state[f"{prefix}.qkv.weight"] = state[f"{prefix}.qkv.weight"][rows.to(model.device)].contiguous()
        if f"{prefix}.qkv.bias" in state:
            state[f"{prefix}.qkv.bias"] = state[f"{prefix}.qkv.bias"][rows.to(model.device)].contiguous()
        state[f"{prefix}.out.weight"] = state[f"{prefix}.out.weight"][:, idx.flatten().to(model.device)].contiguous()
    with torch.device(model.device), warnings.catch_warnings():
        # a layer left with no heads has empty projections, whose initialisation torch warns is a no-op
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        pruned = HookedDecoder(new_cfg, tokenizer=model.tokenizer)
    pruned.to(dtype=model.embed.W_E.dtype)
    pruned.load_state_dict(state, strict=True)
    pruned.train(model.training)
    pruned.head_map = tuple(tuple(current[l][i] for i in kept) for l, kept in enumerate(keep))
    return pruned


def save_pruned(model: HookedDecoder, directory: Union[str, Path], overwrite: bool = False) -> Path:
    """`save_pretrained` plus `head_map.json` (the model's head map), written to a temporary sibling
    and renamed into place, so the directory appears complete or not at all."""
    head_map = head_map_of(model)
    with atomic_directory(directory, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp, overwrite=True)
        (tmp / HEAD_MAP_FILE).write_text(json.dumps({"head_map": [list(layer) for layer in head_map]}) + "\n")
    return Path(directory).expanduser()


def load_pruned(
    directory: Union[str, Path], device: Optional[Union[str, torch.device]] = None, dtype: Optional[torch.dtype] = None
) -> HookedDecoder:
    """`HookedDecoder.from_pretrained` plus the head map from `head_map.json` when the directory has one."""
    return attach_head_map(HookedDecoder.from_pretrained(directory, device=device, dtype=dtype), directory)


def attach_head_map(model: HookedDecoder, directory: Union[str, Path]) -> HookedDecoder:
    """Set `model.head_map` from `directory/head_map.json` (written by `save_pruned`) when there is one,
    for a model loaded from that directory some other way; returns the model."""
    path = Path(directory).expanduser() / HEAD_MAP_FILE
    if path.is_file():
        try:
            head_map = json.loads(path.read_text())["head_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{path} is not a head map written by save_pruned ({type(err).__name__}: {err})") from err
        model.head_map = head_map_of(model, head_map)
    return model
