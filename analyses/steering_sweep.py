"""How a steer's effect and its cost grow with its coefficient: a metric on prompts beside the next-token loss
on held-out text, per coefficient, so a user sees where steering helps and where it starts to break fluency.

A metric is `metric(logits [batch pos vocab], tokens [batch pos], attention_mask [batch pos]) -> [batch]`, one
value per prompt (as in `analyses.ablation`); the sweep reports its mean over the prompts, minus its mean over
`versus` prompts when given (e.g. how much more likely the steered model finds one character's lines than
another's). Prompts and held-out text are steered at every position.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from probe.analyses.ablation import Metric, loss_metric, metric_name
from probe.analyses.architecture import refuse_bidirectional
from probe.analyses.common import AnalysisInput, TableDisplay, evaluate_metric, is_int, model_mask, resolve_positions, token_id, tokens_and_mask
from probe.analyses.pruning import PruningData, token_batches
from probe.analyses.steering import SteeringVector, steer
from probe import HookedDecoder


def loglik_metric(logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[batch]: each prompt's mean next-token log-probability (minus its loss)."""
    return -loss_metric(logits, tokens, attention_mask)


loglik_metric.label = "log-likelihood"
loglik_metric.next_token = True  # refused on a bidirectional model


def target_logprob_metric(model: HookedDecoder, targets, position: int = -1) -> Metric:
    """A metric: the log of the total probability of the `targets` (token ids or one-token strings) at `position`,
    counted among each prompt's real tokens (default -1: the last), i.e. how likely the next token is one of them."""
    values = targets if isinstance(targets, (list, tuple)) else [targets]
    if not values:
        raise ValueError("targets is empty: give at least one token id or one-token string")
    # each token once: a target named twice (as text and as its id) would count its probability twice
    ids = torch.tensor(list(dict.fromkeys(token_id(model, v, "target") for v in values)), device=model.device)
    if not is_int(position):
        raise TypeError(f"position={position!r} must be an int")

    def metric(logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(logits.shape[0], device=logits.device)
        at = logits[rows, resolve_positions(attention_mask.to(logits.device), int(position))].float()
        return at.log_softmax(-1)[:, ids.to(logits.device)].logsumexp(-1)

    metric.label = "log p(targets)"
    return metric


@dataclass
class SteeringSweep(TableDisplay):
    """Per coefficient: `per_prompt` [coefficient prompt] the metric on each prompt (and `per_versus` [coefficient
    versus] on the versus prompts, or None), `heldout_loss` [coefficient] the mean next-token loss on held-out
    windows. `baseline_*` are the unsteered values (coefficient 0)."""

    coefficients: torch.Tensor
    per_prompt: torch.Tensor
    per_versus: Optional[torch.Tensor]
    heldout_loss: torch.Tensor
    baseline_metric: float
    baseline_loss: float
    metric_name: str
    label: str  # where it steers, e.g. "L2 resid_pre"

    @property
    def metric(self) -> torch.Tensor:  # [coefficient]
        value = self.per_prompt.mean(-1)
        return value if self.per_versus is None else value - self.per_versus.mean(-1)

    def fluency_limits(self, tolerance: float = 0.1) -> dict[str, Optional[float]]:
        """The smallest positive and the smallest-magnitude negative coefficient whose held-out loss exceeds the
        baseline by more than `tolerance` nats (None: none of the swept ones does)."""
        limits: dict[str, Optional[float]] = {"positive": None, "negative": None}
        over = (self.heldout_loss - self.baseline_loss) > tolerance
        for sign, key in ((1, "positive"), (-1, "negative")):
            found = [float(c) for c, bad in zip(self.coefficients, over) if bad and c * sign > 0]
            limits[key] = min(found, key=abs) if found else None
        return limits

    def to_frame(self) -> pd.DataFrame:
        frame = pd.DataFrame({"coefficient": self.coefficients.numpy(), "metric": self.metric.numpy(),
                              "metric_change": (self.metric - self.baseline_metric).numpy(),
                              "heldout_loss": self.heldout_loss.numpy(),
                              "loss_change": (self.heldout_loss - self.baseline_loss).numpy()})
        if self.per_versus is not None:
            frame.insert(2, "metric_prompts", self.per_prompt.mean(-1).numpy())
            frame.insert(3, "metric_versus", self.per_versus.mean(-1).numpy())
        return frame

    def figure(self, tolerance: float = 0.1) -> go.Figure:
        """The metric (left) and the held-out loss (right) against the coefficient; dotted: unsteered; dashed:
        where the held-out loss first climbs more than `tolerance` nats above it."""
        name = self.metric_name + (" (prompts - versus)" if self.per_versus is not None else "")
        fig = make_subplots(rows=1, cols=2, subplot_titles=(name, "next-token loss on held-out text"),
                            horizontal_spacing=0.12)
        x = self.coefficients.tolist()
        for col, y, base, what in ((1, self.metric, self.baseline_metric, name),
                                   (2, self.heldout_loss, self.baseline_loss, "held-out loss")):
            fig.add_trace(go.Scatter(x=x, y=y.tolist(), mode="lines+markers", name=what, showlegend=False,
                                     hovertemplate=f"coefficient %{{x:g}}<br>{what} %{{y:.4f}}<extra></extra>"),
                          row=1, col=col)
            fig.add_hline(y=base, line_dash="dot", line_color="grey", row=1, col=col)
        for limit in self.fluency_limits(tolerance).values():
            if limit is not None:
                for col in (1, 2):
                    fig.add_vline(x=limit, line_dash="dash", line_color="firebrick", row=1, col=col)
        fig.update_xaxes(title="coefficient")
        fig.update_layout(title=f"Steering at {self.label}: effect and fluency by coefficient"
                                f"<br><sup>dotted: unsteered; dashed: held-out loss first {tolerance:g} nats above it</sup>",
                          height=420)  # the page's width: it reads in a 1000 px window
        return fig


@torch.no_grad()
def _per_prompt(model, metric: Metric, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[prompt] the metric on each prompt, batch by batch."""
    values = [evaluate_metric(metric, model(tokens, attention_mask=model_mask(mask)), tokens, mask).cpu()
              for tokens, mask in batches]
    return torch.cat(values)


def _batches(model, prompts: AnalysisInput, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, torch.Tensor):
        tokens, mask = tokens_and_mask(model, prompts)
        return [(tokens[i:i + batch_size], mask[i:i + batch_size]) for i in range(0, tokens.shape[0], batch_size)]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    return [tokens_and_mask(model, prompts[i:i + batch_size]) for i in range(0, len(prompts), batch_size)]


def steering_sweep(model: HookedDecoder, vector: Union[SteeringVector, torch.Tensor, tuple], prompts: AnalysisInput,
                   coefficients: Sequence[float], metric: Optional[Metric] = None, *, versus: Optional[AnalysisInput] = None,
                   heldout: PruningData = None, heldout_windows: int = 8, layers=None, site: Optional[str] = None,
                   batch_size: int = 8, progress: bool = True) -> SteeringSweep:
    """The metric (default: each prompt's log-likelihood) on `prompts`, minus on `versus` when given, and the loss on
    `heldout` text (default: probe.HELDOUT_TEXT, its first `heldout_windows` windows of n_ctx tokens), with the
    model steered by `vector` (a SteeringVector, a tensor with `layers`, or (sae, index)) at each coefficient."""
    refuse_bidirectional(model, "steering_sweep", "every position already sees the token after it, and the sweep's "
                         "fluency cost (next-token loss on held-out text) measures nothing the model computes",
                         "measure the steer's effect with `with steer(model, vector, coefficient):` and a metric of "
                         "what the model outputs")
    metric = loglik_metric if metric is None else metric
    values = [float(c) for c in coefficients]
    if not values or not all(math.isfinite(c) for c in values):
        raise ValueError(f"coefficients={list(coefficients)!r} must be a non-empty list of finite numbers")
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    prompt_batches = _batches(model, prompts, batch_size)
    versus_batches = None if versus is None else _batches(model, versus, batch_size)
    heldout_batches = [(t, torch.ones_like(t, dtype=torch.bool))
                       for t in token_batches(model, heldout, batch_size=batch_size, max_windows=heldout_windows)]
    steering = steer(model, vector, 1.0, layers=layers, site=site)  # checked once, before any forward
    label = ", ".join(f"L{layer}" for layer in steering.layers) + f" {steering.site}"

    from tqdm.auto import tqdm

    per_prompt, per_versus, losses = {}, {}, {}
    swept = sorted(set(values) | {0.0}, key=abs)  # 0 first: the baseline
    for c in tqdm(swept, desc="steering sweep", unit="coefficient", disable=not progress or len(swept) < 2):
        with steer(model, steering.direction, c, layers=steering.layers, site=steering.site):
            per_prompt[c] = _per_prompt(model, metric, prompt_batches)
            if versus_batches is not None:
                per_versus[c] = _per_prompt(model, metric, versus_batches)
            losses[c] = float(_per_prompt(model, loss_metric, heldout_batches).mean())
    order = sorted(set(values))

    def stack(table):
        return torch.stack([table[c] for c in order]) if table else None

    baseline = per_prompt[0.0].mean() - (per_versus[0.0].mean() if per_versus else 0.0)
    return SteeringSweep(coefficients=torch.tensor(order), per_prompt=stack(per_prompt), per_versus=stack(per_versus),
                         heldout_loss=torch.tensor([losses[c] for c in order]), baseline_metric=float(baseline),
                         baseline_loss=losses[0.0], metric_name=metric_name(metric), label=label)
