"""Head importance (Michel et al. 2019): I_h = E_x |dL(x)/dxi_h| for a gate xi_h on each head's output, and the
loss and accuracy of a model under head masks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch
from einops import rearrange

from probe.analyses.architecture import refuse_bidirectional, refuse_next_token_metric
from probe.analyses.common import TableDisplay, evaluate_metric
from probe.analyses.labels import count, head_grid, head_label, plotly_text
from probe.analyses.pruning_data import PruningData, check_length, token_batches
from probe import HookedDecoder
from probe.names import act_name

Metric = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Stacked evaluation forwards are chunked so their logits stay under about this many floats.
LOGIT_BUDGET = 2**26


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
_lm_loss.next_token = True  # refused on a bidirectional model


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
def ascending_heads(scores: torch.Tensor) -> list[tuple[int, int]]:
    """(layer, head) of the non-NaN entries of scores [layer head], smallest first (ties: lower index)."""
    flat = scores.flatten()
    keep = ~flat.isnan()
    index = torch.nonzero(keep)[:, 0][flat[keep].argsort(stable=True)]
    n_head = scores.shape[1]
    return [(int(i) // n_head, int(i) % n_head) for i in index]


@dataclass
class HeadImportance(TableDisplay):
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
            "label": [head_label(l, h) for l, h in zip(layer.flatten().tolist(), head.flatten().tolist())],
            "importance": self.scores.flatten().numpy(), "raw_importance": self.raw.flatten().numpy(),
        })

    def order(self) -> list[tuple[int, int]]:
        """The unmasked heads, least important first."""
        return ascending_heads(self.scores)

    def figure(self) -> go.Figure:
        what = "importance (L2-normalised per layer)" if self.normalized else "importance"
        return head_grid(
            self.scores, f"Head {what}: mean |d {plotly_text(self.metric_name)} / d head gate| over "
                         f"{count(self.n_examples, 'sequence')}", "importance", hover_format=".5f",
            extra=(self.raw, "mean |dL/dξ| %{customdata[1]:.5g}"), colorscale="Viridis", zmin=0,
        )


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
    refuse_next_token_metric(model, metric, "head_importance")
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
def refuse_next_token_evaluation(model: HookedDecoder, what: str) -> None:
    """The evaluation under masks is next-token loss and accuracy: refused on a bidirectional model."""
    refuse_bidirectional(model, what, "every position already sees the token after it, and the pruning curve's next-token "
                         "loss and accuracy measure nothing the model computes",
                         "rank heads with head_importance(model, data, metric=...) and a metric of what it outputs "
                         "(e.g. logit_diff_metric), then prune_heads")


@torch.no_grad()
def evaluate_masks(
    model: HookedDecoder, batches: Sequence[torch.Tensor], masks: torch.Tensor, *, desc: Optional[str] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss and accuracy [mask] over every predicted position of `batches`, with the model's
    heads gated by each mask of `masks` [mask layer head] in turn (0 = zero-ablated). The masks are
    stacked along the batch dimension, several per forward. With `desc`, a progress bar of that name
    (stderr) counts the forwards."""
    refuse_next_token_evaluation(model, "evaluate_masks")
    from tqdm.auto import tqdm

    masks = masks.to(model.device, torch.float32)
    n_masks = masks.shape[0]
    nll_sum = torch.zeros(n_masks, dtype=torch.float64)
    correct = torch.zeros(n_masks, dtype=torch.float64)
    count = 0
    per_batch = [max(1, LOGIT_BUDGET // (t.numel() * model.cfg.d_vocab_out)) for t in batches]  # masks per forward
    bar = tqdm(total=sum(-(-n_masks // k) for k in per_batch), desc=desc, unit="forward", disable=desc is None)
    for tokens, per_forward in zip(batches, per_batch):
        batch, n = check_length(tokens).shape
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
            bar.update(1)
        count += batch * (n - 1)
    bar.close()
    return (nll_sum / count).float(), (correct / count).float()
