"""Head ablation: replace heads' outputs (hook_z) with zeros, a reference mean, or a resampled reference.

A metric here is `metric(logits [batch pos vocab], tokens [batch pos], attention_mask [batch pos]) ->
[batch]`, one value per row. Batched analyses stack several interventions along the batch
dimension, so a metric may see the prompts repeated (copy-major: row i is prompt i % n_prompts);
`loss_metric` and `logit_diff_metric` handle that, and per-prompt data in a custom metric should be
tiled the same way (see `logit_diff_metric`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch
from einops import einsum

from probe.analyses.architecture import refuse_bidirectional, refuse_next_token_metric, require_attention_heads
from probe.analyses.common import AnalysisInput, TableDisplay, check_id_tensor, is_int, resolve_positions, token_id, tokens_and_mask
from probe.analyses.common import model_mask as _model_mask
from probe.analyses.labels import head_grid, head_label, plotly_text
from probe.analyses.metric_reads import LogitReads, evaluate_output, metric_stop
from probe import HookedDecoder
from probe.names import act_name

Metric = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
AblationMethod = Literal["zero", "mean", "resample"]
METHODS = ("zero", "mean", "resample")
# Stacked forwards are chunked so their logits stay under about this many floats: small enough to stay
# cache-friendly (measured: 8 stacked rows of 128 x 4096 beat 32), large enough to amortise each forward.
LOGIT_BUDGET = 2**22


def loss_metric(logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[batch]: mean next-token cross-entropy of each row over the positions whose next token is real."""
    logprobs = logits[:, :-1].float().log_softmax(dim=-1)
    nll = -logprobs.gather(-1, tokens[:, 1:, None])[..., 0]
    real = attention_mask[:, 1:].to(nll.dtype) * attention_mask[:, :-1].to(nll.dtype)
    if bool((real.sum(dim=1) == 0).any()):
        raise ValueError("the loss needs prompts of at least two tokens (BOS plus one)")
    return (nll * real).sum(dim=1) / real.sum(dim=1)


loss_metric.label = "loss"
loss_metric.next_token = True  # refused on a bidirectional model (analyses.architecture.refuse_next_token_metric)


def _token_ids(model: HookedDecoder, value, what: str) -> torch.Tensor:
    values = value if isinstance(value, (list, tuple)) else [value]
    if isinstance(value, torch.Tensor):
        values = check_id_tensor(value, what).flatten().tolist()
    return torch.tensor([token_id(model, v, what) for v in values], device=model.device)


def logit_diff_metric(model: HookedDecoder, answer, counterfactual, position: int = -1) -> Metric:
    """A metric: logit of `answer` minus logit of `counterfactual` at `position`, counted among each
    prompt's real tokens whatever the padding (default -1: each prompt's last real token), as in
    `direct_logit_attribution`. Each is a token id, a one-token string, or one of those per prompt."""
    if position is None:  # the old spelling of the default
        position = -1
    if not is_int(position):
        raise TypeError(f"position={position!r} must be an int")
    answer_ids = _token_ids(model, answer, "answer")
    counter_ids = _token_ids(model, counterfactual, "counterfactual")
    if len(answer_ids) != len(counter_ids):
        raise ValueError(f"{len(answer_ids)} answers but {len(counter_ids)} counterfactuals; give one of each per prompt")

    built: dict = {}  # (rows, device) -> columns: analyses ask for the same ones call after call

    def columns(rows: int, device) -> torch.Tensor:  # [rows 2]: (answer, counterfactual), the prompts tiled
        if rows % len(answer_ids):
            raise ValueError(f"{len(answer_ids)} answers do not match a batch of {rows} prompts")
        key = (rows, str(device))
        if key not in built:
            reps = rows // len(answer_ids)
            built[key] = torch.stack([answer_ids.to(device).repeat(reps), counter_ids.to(device).repeat(reps)], dim=1)
        return built[key]

    def positions(attention_mask: torch.Tensor) -> torch.Tensor:
        return resolve_positions(attention_mask, int(position))

    def difference(values: torch.Tensor) -> torch.Tensor:  # [batch 2] float -> [batch]
        return values[:, 0] - values[:, 1]

    def metric(logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        rows = logits.shape[0]
        read = columns(rows, logits.device)
        pos = positions(attention_mask.to(logits.device))
        at = logits[torch.arange(rows, device=logits.device), pos].float()  # float first: a bf16 difference rounds
        return difference(at.gather(-1, read))

    # two columns at one position: analyses compute it from the final residual, without the full logits
    metric.reads = LogitReads(positions=positions, columns=columns, combine=difference)
    metric.label = "logit difference"
    return metric


def metric_name(metric: Metric) -> str:
    """A metric's name for figures, escaped for plotly (a lambda is called `<lambda>`, which plotly would parse as a tag)."""
    name = getattr(metric, "label", None) or getattr(metric, "__name__", "metric")
    return plotly_text("metric" if name == "<lambda>" else str(name))


def _check_heads(model: HookedDecoder, heads) -> list[tuple[int, int]]:
    heads = list(heads)
    ok = all(isinstance(h, (tuple, list)) and len(h) == 2 and all(is_int(i) for i in h) for h in heads)
    bad = [h for h in heads if not ok or not (0 <= h[0] < model.cfg.n_layers and 0 <= h[1] < model.cfg.layer_heads(h[0]))]
    if not ok or bad or not heads:
        raise ValueError(
            f"heads must be a non-empty list of (layer, head) ints with layer < {model.cfg.n_layers} and "
            f"head < the layer's head count ({model.cfg.n_heads} unless pruned); got {bad or heads!r}"
        )
    return [(int(l), int(h)) for l, h in heads]


@torch.no_grad()
def _replacements(
    model: HookedDecoder, method: str, tokens: torch.Tensor, mask: torch.Tensor,
    layers: Sequence[int], reference: Optional[AnalysisInput], seed: int,
) -> dict[int, torch.Tensor]:
    """For each layer, what replaces hook_z, broadcastable to [batch pos head d_head]."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not an ablation; choose one of: {', '.join(METHODS)}")
    if method == "zero":
        return {l: torch.zeros((), device=model.device) for l in layers}
    if reference is None:
        if tokens.shape[0] == 1:
            raise ValueError(
                f"{method} ablation over the input itself needs more than one prompt; pass reference= "
                "other prompts (text or token ids) to take the mean or the samples from"
            )
        ref_tokens, ref_mask = tokens, mask
    else:
        ref_tokens, ref_mask = tokens_and_mask(model, reference)
    n = tokens.shape[1]
    if ref_tokens.shape[1] < n:
        raise ValueError(
            f"the reference has {ref_tokens.shape[1]} positions but the input has {n}; ablations replace each "
            "position with the reference's at the same position, so give a reference at least as long"
        )
    if bool(ref_mask[:, n:].any()):  # a causal position p sees tokens <= p only, so a longer reference is cut to fit
        refuse_bidirectional(model, f"{method} ablation with a reference of {ref_tokens.shape[1]} positions for an input "
                             f"of {n}", "every position sees every token of its prompt, and the reference's first "
                             f"{n} positions also read its tokens past them, which the input does not have",
                             f"give reference prompts of the same length as the input ({n} positions)")
    names = [act_name("z", l) for l in layers]
    _, cache = model.run_with_cache(ref_tokens, attention_mask=_model_mask(ref_mask), names=names)
    ref_mask = ref_mask[:, :n].to(torch.float32)
    out = {}
    if method == "mean":
        weight = ref_mask / ref_mask.sum(dim=0).clamp(min=1)  # padded reference positions do not count
        for l, name in zip(layers, names):
            out[l] = einsum(weight.to(cache[name].dtype), cache[name][:, :n],
                            "batch pos, batch pos head d_head -> pos head d_head")[None]
    else:
        # A prompt may only take its sample from a reference prompt that is real wherever it is: a
        # shorter (padded) reference would hand it the activations of padding tokens. A bidirectional
        # model's positions see their whole prompt, so there only a reference of the same real positions
        # computed comparable activations (a longer one's saw tokens the prompt does not have).
        real, ref_real = mask.bool()[:, None, :], ref_mask.bool()[None, :, :]
        covers = ((ref_real == real) if model.cfg.bidirectional else (ref_real | ~real)).all(dim=-1)  # [batch reference]
        short = (~covers.any(dim=1)).nonzero().flatten().tolist()
        if short:
            refuse_bidirectional(model, f"resample ablation of input prompt(s) {short}", "every position sees every "
                                 "token of its prompt, and no reference prompt has the same real positions (the same "
                                 "length) as these", "give reference prompts of the same lengths as the input's")
            raise ValueError(
                f"resample ablation: no reference prompt is as long as input prompt(s) {short}; give references "
                "at least as long as every prompt"
            )
        gen = torch.Generator().manual_seed(seed)
        rows = torch.multinomial(covers.float().cpu(), 1, generator=gen)[:, 0].to(model.device)
        for l, name in zip(layers, names):
            out[l] = cache[name][rows, :n]
    return out


@torch.no_grad()
def ablate_heads(
    model: HookedDecoder,
    input: AnalysisInput,
    heads: Sequence[tuple[int, int]],
    method: AblationMethod = "zero",
    reference: Optional[AnalysisInput] = None,
    seed: int = 0,
    *,
    attention_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Logits [batch pos vocab] with every head in `heads` ablated at once, through hook_z.

    zero: the head writes nothing (its b_O share stays, as b_O is not per head).
    mean: the head's output is its mean over the reference prompts, position by position.
    resample: each prompt gets the head's output on a reference prompt drawn at random (seeded).
    The reference defaults to the input batch itself; it may be longer than the input on a causal model (position
    p reads tokens <= p only), not on a bidirectional one, where resample also draws each prompt's sample from
    reference prompts of its own length. `attention_mask` [batch pos] marks the real tokens of padded token ids
    (text is padded and masked for you).
    """
    require_attention_heads(model, "ablate_heads")
    heads = _check_heads(model, heads)
    tokens, mask = tokens_and_mask(model, input, attention_mask)
    layers = sorted({l for l, _ in heads})
    repl = _replacements(model, method, tokens, mask, layers, reference, seed)

    def ablate(z: torch.Tensor, hook, layer: int) -> torch.Tensor:
        chosen = torch.zeros(z.shape[2], dtype=torch.bool, device=z.device)
        chosen[[h for l, h in heads if l == layer]] = True
        return torch.where(chosen[:, None], repl[layer].to(z.dtype), z)

    hooks = [(act_name("z", l), lambda z, hook, l=l: ablate(z, hook, l)) for l in layers]
    return model.run_with_hooks(tokens, attention_mask=_model_mask(mask), fwd_hooks=hooks)


@dataclass
class HeadAblationEffects(TableDisplay):
    """per_prompt: [layer head batch] the metric with that head alone ablated; baseline: [batch] unablated."""

    per_prompt: torch.Tensor
    baseline: torch.Tensor
    method: str
    metric_name: str

    @property
    def ablated(self) -> torch.Tensor:  # [layer head]
        return self.per_prompt.mean(dim=-1)

    @property
    def effects(self) -> torch.Tensor:  # [layer head]: metric ablated minus metric clean
        return self.ablated - self.baseline.mean()

    def to_frame(self) -> pd.DataFrame:
        n_layer, n_head = self.effects.shape
        layer, head = torch.meshgrid(torch.arange(n_layer), torch.arange(n_head), indexing="ij")
        keep = ~self.effects.isnan().flatten()  # pruned heads
        layer, head = layer.flatten()[keep], head.flatten()[keep]
        return pd.DataFrame({
            "layer": layer.numpy(), "head": head.numpy(),
            "label": [head_label(l, h) for l, h in zip(layer.tolist(), head.tolist())],
            "baseline": float(self.baseline.mean()), "ablated": self.ablated.flatten()[keep].numpy(),
            "effect": self.effects.flatten()[keep].numpy(),
        })

    def figure(self) -> go.Figure:
        effects = self.effects
        bound = float(effects.nan_to_num().abs().max()) or 1.0
        return head_grid(
            effects, f"Change in {self.metric_name} when one head is {self.method}-ablated"
                     f"<br><sup>baseline {self.metric_name} {float(self.baseline.mean()):.4f}</sup>",
            f"Δ {self.metric_name}", colorscale="RdBu_r", zmid=0, zmin=-bound, zmax=bound,
            extra=(self.ablated, f"{self.metric_name} ablated %{{customdata[1]:.5f}}"),
        )


def rows_per_forward(model: HookedDecoder, n_pos: int, max_rows: Optional[int]) -> int:
    if max_rows is not None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        return max_rows
    return max(1, LOGIT_BUDGET // (n_pos * model.cfg.d_vocab_out))


@torch.no_grad()
def head_ablation_effects(
    model: HookedDecoder,
    input: AnalysisInput,
    metric: Optional[Metric] = None,
    method: AblationMethod = "zero",
    reference: Optional[AnalysisInput] = None,
    seed: int = 0,
    max_rows: Optional[int] = None,
    *,
    attention_mask: Optional[torch.Tensor] = None,
) -> HeadAblationEffects:
    """The metric (default: loss on the input) with each head alone ablated, for every head.

    Ablating a head of layer l leaves layers < l unchanged, so each run restarts at layer l from the
    cached residual, and the ablations of one layer share a forward: the prompts are stacked once
    per ablated head along the batch (at most `max_rows` rows per forward; default: a memory budget).
    `attention_mask` [batch pos] marks the real tokens of padded token ids.
    """
    require_attention_heads(model, "head_ablation_effects")
    metric = loss_metric if metric is None else metric
    refuse_next_token_metric(model, metric, "head_ablation_effects")
    tokens, mask = tokens_and_mask(model, input, attention_mask)
    batch, n = tokens.shape
    n_layer, n_head = model.cfg.n_layers, model.cfg.n_heads
    repl = _replacements(model, method, tokens, mask, range(n_layer), reference, seed)
    # each layer's run restarts from a cached residual: its own, or an earlier layer's whose keys it reuses (Gemma 4)
    names = sorted({act_name("resid_pre", model.cfg.resume_layer(l)) for l in range(1, n_layer)} - {act_name("resid_pre", 0)})
    stop = metric_stop(model, metric)  # a metric reading a few logits runs to the final residual only
    out, cache = model.run_with_cache(tokens, attention_mask=_model_mask(mask), names=names, stop_at_layer=stop)
    baseline = evaluate_output(model, metric, out, tokens, mask).cpu()
    del out

    copies = max(1, rows_per_forward(model, n, max_rows) // batch)  # ablations per forward
    per_prompt = torch.full((n_layer, n_head, batch), float("nan"))  # NaN stays where pruning removed a head
    for layer in range(n_layer):
        resume = model.cfg.resume_layer(layer)
        start = tokens if resume == 0 else cache[act_name("resid_pre", resume)]
        layer_heads = model.cfg.layer_heads(layer)
        eye = torch.eye(layer_heads, dtype=torch.bool, device=model.device)
        for first in range(0, layer_heads, copies):
            chosen = eye[first: first + copies]  # [copy head]: copy k ablates head first + k
            k = chosen.shape[0]

            def ablate(z: torch.Tensor, hook, chosen=chosen, k=k, layer=layer) -> torch.Tensor:
                z = z.view(k, batch, *z.shape[1:])
                z = torch.where(chosen[:, None, None, :, None], repl[layer].to(z.dtype)[None], z)
                return z.flatten(0, 1)

            stacked_mask = mask.repeat(k, 1)
            out = model.run_with_hooks(
                start.repeat(k, *([1] * (start.dim() - 1))), attention_mask=_model_mask(stacked_mask),
                start_at_layer=None if resume == 0 else resume, stop_at_layer=stop, tokens=tokens.repeat(k, 1),
                fwd_hooks=[(act_name("z", layer), ablate)],
            )
            values = evaluate_output(model, metric, out, tokens.repeat(k, 1), stacked_mask)
            per_prompt[layer, first: first + k] = values.view(k, batch).cpu()
    return HeadAblationEffects(per_prompt=per_prompt, baseline=baseline, method=method, metric_name=metric_name(metric))
