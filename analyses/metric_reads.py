"""What a metric reads of the logits, so that an analysis can compute it without the [batch pos vocab] logits.

A metric (analyses.ablation) maps logits [batch pos vocab] to [batch]. Most metrics of circuit work read
a few vocabulary columns at one position per row: a logit difference reads two. Such a metric says so
by carrying `metric.reads = LogitReads(positions, columns, combine)`; an analysis then stops its
forward at the final residual (`stop_at_layer=metric_stop(model, metric)`), applies the final norm at
the read positions only and multiplies by the read columns of W_U only (`evaluate_output`), so
neither the forward nor a backward through it touches a vocabulary-sized tensor. The value equals
the metric on the full logits up to float rounding. A metric without `reads` (any user's function)
is evaluated on the full logits, as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from probe.analyses.common import evaluate_metric
from probe import HookedDecoder


@dataclass(frozen=True)
class LogitReads:
    """metric(logits, tokens, mask) == combine(logits[row, positions(mask)[row], columns(rows)[row]].float()).

    positions(attention_mask [batch pos]) -> [batch] long: the one position each row reads.
    columns(rows, device) -> [rows c] long: the vocabulary columns each row reads there; a batch
        stacking several runs tiles its prompts copy-major (row i is prompt i % n_prompts).
    combine(values [rows c] float32) -> [rows]: the metric from those logits.
    """

    positions: Callable[[torch.Tensor], torch.Tensor]
    columns: Callable[[int, torch.device], torch.Tensor]
    combine: Callable[[torch.Tensor], torch.Tensor]


def logit_reads(metric) -> Optional[LogitReads]:
    """The metric's `LogitReads`, or None when it may read any logit (then it needs the full logits)."""
    reads = getattr(metric, "reads", None)
    return reads if isinstance(reads, LogitReads) else None


def metric_stop(model: HookedDecoder, metric) -> Optional[int]:
    """`stop_at_layer` for a forward whose output feeds `evaluate_output`: n_layers (the final residual,
    before the final norm) when the metric declares its reads, else None (the logits)."""
    return model.cfg.n_layers if logit_reads(metric) is not None else None


def read_logits(model: HookedDecoder, final_resid: torch.Tensor, positions: torch.Tensor,
                columns: torch.Tensor) -> torch.Tensor:
    """[batch c]: `model.unembed(model.ln_final(final_resid))[row, positions[row], columns[row]]`, computed from
    the residual entering the final norm [batch pos d_model] at those positions and columns only.

    The norm acts on each position alone, so normalising only the read positions gives the same
    values; the unembedding bias and a logit soft cap (Gemma 2) apply column by column.
    """
    rows = torch.arange(final_resid.shape[0], device=final_resid.device)
    # kept [batch 1 d_model]: the norm's hooks see the [batch pos ...] shape they always see
    unembed = model.unembed  # (through ModernBERT's prediction head, where the model has one)
    normed = unembed.w_u_input(model.ln_final(final_resid[rows, positions.to(final_resid.device)][:, None]))[:, 0]
    columns = columns.to(final_resid.device)
    # [batch c d_model] @ [batch d_model 1]: a plain bmm (einsum's parsing costs more than this product)
    logits = torch.bmm(unembed.weight[columns], normed[:, :, None])[..., 0]
    if unembed.bias is not None:
        logits = logits + unembed.bias[columns]
    return unembed.cap(logits)


def evaluate_output(model: HookedDecoder, metric, output: torch.Tensor, tokens: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """[batch] float: the metric on the output of a forward run with `stop_at_layer=metric_stop(model, metric)`:
    the logits (checked as analyses.common.evaluate_metric checks them), or the final residual."""
    reads = logit_reads(metric)
    if reads is None:
        return evaluate_metric(metric, output, tokens, mask)
    rows = output.shape[0]
    positions = reads.positions(mask.to(output.device))
    values = reads.combine(read_logits(model, output, positions, reads.columns(rows, output.device)).float())
    if tuple(values.shape) != (rows,):
        raise ValueError(f"LogitReads.combine returned shape {tuple(values.shape)}; it must return one value per row, "
                         f"shape ({rows},)")
    if torch.is_grad_enabled() and output.requires_grad and not values.requires_grad:
        # a caller evaluating in a graph wants the metric's gradient (edge attribution, attribution patching); without
        # this check the backward failed with torch's bare "element 0 of tensors does not require grad"
        raise ValueError("the metric's LogitReads.combine does not depend on the logits through differentiable "
                         "operations (no autograd graph); a gradient method needs its gradient: compute it with torch "
                         "operations on the values, not .item(), argmax or .detach()")
    return values.float()

