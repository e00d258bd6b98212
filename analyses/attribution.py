"""The residual stream as a sum of component writes, and each write's direct effect on the logits (Elhage et al. 2021).

Components, in order: `embed`, `pos_embed`, then per layer l every head `L{l}H{h}` (its
`hook_result`, without b_O), `L{l} attn bias` (b_O) and `L{l} mlp` (none in an attention-only model; no
`pos_embed` where positions stay out of the residual: rotary, shortformer); a hybrid model's linear-attention layer
(Qwen3.5) has no heads, and its write is one component, `L{l} linear_attn`. Their sum is the final
residual stream exactly. Direct logit attribution pushes each component through the final norm
with the scale frozen at its value in the forward pass, so the attribution is linear and, with
the norm's bias (and any unembedding bias) as extra rows, adds up to the model's logit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, Sequence, Union

import pandas as pd
import plotly.graph_objects as go
import torch
from einops import einsum

from probe.analyses.architecture import refuse_prediction_head
from probe.analyses.common import AnalysisInput, TableDisplay, check_id_tensor, is_int, model_mask, resolve_positions, token_decoder, token_id, tokens_and_mask
from probe.analyses.labels import count, figure_token, head_grid, titled
from probe.analyses.lens_sites import final_norm, has_final_scale, has_resid_mid, lens_sites, position_labels, site_label
from probe.analyses.residual_components import Components, check_pre_norm, component_hooks, stack_components
from probe import HookedDecoder
from probe.names import act_name

TokenSpec = Union[int, str, Sequence[Union[int, str]], torch.Tensor]


# ---- residual decomposition -------------------------------------------------------------------------
@dataclass
class ResidualDecomposition(TableDisplay):
    """The final residual stream at every position as a sum over components: `components.sum(2)` is
    `blocks.{n_layers-1}.hook_resid_post`. Dimensions `batch pos component d_model`."""

    tokens: torch.Tensor  # [batch pos]
    mask: torch.Tensor  # [batch pos] bool
    components: torch.Tensor  # [batch pos component d_model]
    index: Components
    n_layers: int
    position_labels: list[list[str]]
    token_strings: Callable[[list[int]], list[str]] = field(repr=False)
    has_mid: bool = True  # a residual between attention and MLP exists (not in parallel / attention-only blocks)

    def total(self) -> torch.Tensor:
        """[batch pos d_model]: the sum of every component, the final residual stream."""
        return self.components.sum(dim=2)

    def accumulated(self, include_mid: bool = False) -> torch.Tensor:
        """[batch layer pos d_model]: the residual after the embedding and after each block (and each
        attention sublayer with include_mid), i.e. the sum of the components written so far."""
        if include_mid and not self.has_mid:
            # the index knows which: an attention-only model's components hold no MLP
            why = ("this attention-only model has no MLPs, so each block's output is the residual after its attention"
                   if "mlp" not in self.index.kinds else
                   "this model's blocks are parallel (both read the residual entering the block)")
            raise ValueError(f"include_mid=True reads the residual between attention and MLP; {why}, so there is none: "
                             "leave include_mid=False")
        written = self.index.written(self.n_layers, include_mid, self.components.device).to(self.components.dtype)
        return einsum(self.components, written, "batch pos component d_model, layer component -> batch layer pos d_model")

    def to_frame(self) -> pd.DataFrame:
        """One row per (prompt, position, component): the component's norm and its dot product with the
        final residual (projection weight; rows sum to |resid|^2 over components)."""
        batch, n_pos, n_comp, _ = self.components.shape
        comps = self.components.float()
        norm = comps.norm(dim=-1)  # [batch pos component]
        dot = einsum(comps, self.total().float(), "batch pos component d_model, batch pos d_model -> batch pos component")
        b, p, c = torch.cartesian_prod(torch.arange(batch), torch.arange(n_pos), torch.arange(n_comp)).unbind(-1)
        real = self.mask.cpu()[b, p]
        b, p, c = b[real], p[real], c[real]
        meta = self.index.frame().iloc[c.numpy()].reset_index(drop=True)
        frame = pd.DataFrame({
            "prompt": b.numpy(), "position": p.numpy(), "token": self.token_strings(self.tokens.cpu()[b, p].tolist()),
        })
        frame = pd.concat([frame, meta], axis=1)
        frame["norm"] = norm.cpu()[b, p, c].numpy()
        frame["dot_with_resid"] = dot.cpu()[b, p, c].numpy()
        return frame

    def figure(self, prompt: int = 0, position: int = -1) -> go.Figure:
        """Bar chart of each component's norm at one position."""
        if not 0 <= prompt < self.components.shape[0]:
            raise ValueError(f"prompt={prompt} is outside the batch of {self.components.shape[0]}")
        pos = int(resolve_positions(self.mask[prompt:prompt + 1], position)[0])
        norm = self.components[prompt, pos].float().norm(dim=-1).cpu()
        names = self.index.names
        fig = go.Figure(go.Bar(x=names, y=norm.numpy(), hovertext=[f"{n}: |write| = {v:.5g}" for n, v in zip(names, norm.tolist())],
                               hoverinfo="text"))
        fig.update_layout(xaxis_title="component", yaxis_title="L2 norm", xaxis_type="category",
                          width=max(720, 140 + 18 * len(names)), height=480)
        return titled(fig, f"Residual stream at {self.position_labels[prompt][pos]}: norm of each component's write",
                      max(720, 140 + 18 * len(names)))


@torch.no_grad()
def residual_decomposition(
    model: HookedDecoder, input: AnalysisInput, *, attention_mask: Optional[torch.Tensor] = None
) -> ResidualDecomposition:
    """Split the final residual stream at every position into embedding, position embedding, every
    head's write, each layer's attention bias and each MLP's output."""
    check_pre_norm(model)
    tokens, mask = tokens_and_mask(model, input, attention_mask)
    _, cache = model.run_with_cache(tokens, attention_mask=model_mask(mask), names=component_hooks(model))
    return ResidualDecomposition(
        tokens=tokens, mask=mask, components=stack_components(model, cache),
        index=Components.for_model(model), n_layers=model.cfg.n_layers,
        position_labels=position_labels(model, tokens), token_strings=token_decoder(model), has_mid=has_resid_mid(model),
    )


# ---- direct logit attribution -----------------------------------------------------------------------
@dataclass
class LogitAttribution(TableDisplay):
    """Each component's direct contribution to logit(answer) [- logit(counterfactual)], per prompt.

    `contributions` [batch component] plus `ln_bias` [batch] (and `unembed_bias` [batch], zero for
    GPT-2) add up to `actual` [batch], the model's own logit (difference), within float error.
    `accumulated` [batch layer] is the same quantity read from the residual after the embedding
    and after each sublayer (sites embed, L0 attn, L0, ...; parallel blocks: embed, L0, ...), the
    final scale still frozen.
    """

    tokens: torch.Tensor  # [batch pos]
    positions: torch.Tensor  # [batch] the position attributed in each prompt
    answer: torch.Tensor  # [batch] token ids
    counterfactual: Optional[torch.Tensor]  # [batch] token ids, or None for the plain logit
    contributions: torch.Tensor  # [batch component]
    ln_bias: torch.Tensor  # [batch]
    unembed_bias: torch.Tensor  # [batch]
    actual: torch.Tensor  # [batch]
    accumulated: torch.Tensor  # [batch layer]
    index: Components
    n_layers: int
    n_heads: int  # the most heads any layer has
    position_labels: list[list[str]]
    token_strings: Callable[[list[int]], list[str]] = field(repr=False)
    has_mid: bool = True  # `accumulated` reads after each attention sublayer too (not parallel or attn-only blocks)

    @property
    def total(self) -> torch.Tensor:
        """[batch]: the sum of every row of the table, equal to `actual`."""
        return self.contributions.sum(-1) + self.ln_bias + self.unembed_bias

    @property
    def sites(self) -> list[str]:
        return lens_sites(self.n_layers, include_mid=self.has_mid)

    def head_contributions(self) -> torch.Tensor:
        """[batch layer head]; NaN for heads a (pruned) layer does not have."""
        head_cols = [i for i, kind in enumerate(self.index.kinds) if kind == "head"]
        # long even when empty (every head pruned): an empty float index tensor cannot index
        layers = torch.tensor([self.index.layers[i] for i in head_cols], dtype=torch.long, device=self.contributions.device)
        heads = torch.tensor([self.index.heads[i] for i in head_cols], dtype=torch.long, device=self.contributions.device)
        out = self.contributions.new_full((self.contributions.shape[0], self.n_layers, self.n_heads), float("nan"))
        out[:, layers, heads] = self.contributions[:, head_cols]  # NaN where a pruned layer has no such head
        return out

    def _quantity(self) -> str:
        answer = self.token_strings(self.answer.tolist())
        same = len(set(self.answer.tolist())) == 1
        a = f"logit({figure_token(answer[0])})" if same else "logit(answer)"
        if self.counterfactual is None:
            return a
        cf = self.token_strings(self.counterfactual.tolist())
        same = len(set(self.counterfactual.tolist())) == 1
        return f"{a} − " + (f"logit({figure_token(cf[0])})" if same else "logit(counterfactual)")

    def to_frame(self, mean: bool = False) -> pd.DataFrame:
        """One row per (prompt, component), bias terms included; `mean=True`: one row per component,
        averaged over prompts (with the standard deviation)."""
        names = self.index.names + ["ln_final bias", "unembed bias"]
        meta = pd.concat([self.index.frame(), pd.DataFrame({
            "component": ["ln_final bias", "unembed bias"], "kind": ["ln_bias", "unembed_bias"],
            "layer": pd.array([None, None], dtype="Int64"), "head": pd.array([None, None], dtype="Int64"),
        })], ignore_index=True)
        values = torch.cat([self.contributions, self.ln_bias[:, None], self.unembed_bias[:, None]], dim=1).float().cpu()
        if mean:
            meta["contribution"] = values.mean(0).numpy()
            meta["std"] = values.std(0).numpy() if values.shape[0] > 1 else float("nan")
            meta["prompts"] = values.shape[0]
            return meta
        batch = values.shape[0]
        frame = pd.concat([meta] * batch, ignore_index=True)
        frame.insert(0, "prompt", torch.arange(batch).repeat_interleave(len(names)).numpy())
        frame["contribution"] = values.flatten().numpy()
        frame["position"] = self.positions.cpu().repeat_interleave(len(names)).numpy()
        frame["answer"] = self.token_strings(self.answer.cpu().repeat_interleave(len(names)).tolist())
        if self.counterfactual is not None:
            frame["counterfactual"] = self.token_strings(self.counterfactual.cpu().repeat_interleave(len(names)).tolist())
        return frame

    def figure(self, kind: Literal["bar", "heads", "accumulated"] = "bar", prompt: Optional[int] = None, top: int = 15) -> go.Figure:
        """`bar`: the `top` components by |contribution|; `heads`: a layer x head heatmap; `accumulated`:
        the logit (difference) read after each sublayer. `prompt=None` averages over the batch."""
        if prompt is not None and not 0 <= prompt < self.contributions.shape[0]:
            raise ValueError(f"prompt={prompt} is outside the batch of {self.contributions.shape[0]}")
        pick = (lambda t: t.float().mean(0)) if prompt is None else (lambda t: t[prompt].float())
        where = f"mean over {count(self.contributions.shape[0], 'prompt')}" if prompt is None else \
            f"prompt {prompt} at {self.position_labels[prompt][int(self.positions[prompt])]}"
        title = f"Direct logit attribution to {self._quantity()}, {where}"
        if kind == "bar":
            return self._bar(pick, title, top)
        if kind == "heads":
            return self._heads(pick(self.head_contributions()).cpu(), title)
        if kind == "accumulated":
            return self._accumulated(pick, title)
        raise ValueError(f"kind={kind!r} is not one of: bar, heads, accumulated")

    def _bar(self, pick, title: str, top: int) -> go.Figure:
        names = self.index.names + ["ln_final bias", "unembed bias"]
        values = pick(torch.cat([self.contributions, self.ln_bias[:, None], self.unembed_bias[:, None]], dim=1)).cpu()
        order = values.abs().argsort(descending=True)[:top].flip(0)  # largest on top of a horizontal bar chart
        shown = [names[i] for i in order.tolist()]
        fig = go.Figure(go.Bar(
            x=values[order].numpy(), y=shown, orientation="h",
            marker_color=["#2166ac" if v >= 0 else "#b2182b" for v in values[order].tolist()],
            hovertext=[f"{n}: {v:+.6f}" for n, v in zip(shown, values[order].tolist())], hoverinfo="text",
        ))
        fig.update_layout(xaxis_title="contribution (logits)", yaxis_title="component", yaxis_type="category",
                          width=760, height=200 + 24 * len(shown))
        return titled(fig, f"{title}<br>top {len(shown)} of {len(names)} rows; all rows sum to {float(pick(self.actual)):.4f}", 760)

    def _heads(self, heads: torch.Tensor, title: str) -> go.Figure:
        return head_grid(heads, f"{title}: per head", "logits", hover_format="+.6f", colorscale="RdBu", zmid=0.0)

    def _accumulated(self, pick, title: str) -> go.Figure:
        labels = [site_label(s) for s in self.sites]
        values = pick(self.accumulated).cpu()
        fig = go.Figure(go.Scatter(x=labels, y=values.numpy(), mode="lines+markers",
                                   hovertext=[f"after {l}: {v:+.6f}" for l, v in zip(labels, values.tolist())], hoverinfo="text"))
        fig.update_layout(xaxis_title="residual stream after", yaxis_title="logit (difference)", width=760, height=460)
        return titled(fig, f"{title}: accumulated over layers (final scale frozen)", 760)


def _token_ids(model: HookedDecoder, spec: TokenSpec, batch: int, what: str) -> torch.Tensor:
    """[batch] ids from an id, a single-token string, a list of either (one per prompt) or a tensor."""
    if isinstance(spec, torch.Tensor):
        if spec.dim() > 1:
            raise ValueError(f"{what} as a tensor must be a scalar or [batch], got shape {tuple(spec.shape)}")
        ids = check_id_tensor(spec, what).flatten().tolist()
    elif isinstance(spec, str) or is_int(spec):
        ids = [spec]
    elif isinstance(spec, (list, tuple)):
        ids = list(spec)
    else:
        raise TypeError(f"{what} must be a token id, a string, a list of them or a tensor, got {type(spec).__name__}")
    ids = [token_id(model, t, what) for t in ids]
    if len(ids) == 1:
        ids = ids * batch
    if len(ids) != batch:
        raise ValueError(f"{what} has {len(ids)} entries for a batch of {batch} prompts; give one, or one per prompt")
    return torch.tensor(ids, dtype=torch.long, device=model.device)


@torch.no_grad()
def direct_logit_attribution(
    model: HookedDecoder,
    input: AnalysisInput,
    answer: TokenSpec,
    counterfactual: Optional[TokenSpec] = None,
    position: int = -1,
    *,
    attention_mask: Optional[torch.Tensor] = None,
) -> LogitAttribution:
    """Each component's direct contribution to logit(answer), or to logit(answer) - logit(counterfactual).

    `answer`/`counterfactual`: a token id or a string that is exactly one token (a multi-token
    string raises ValueError naming its tokens; give its first token explicitly if that is what you
    mean), or a list/tensor with one per prompt. `position` counts each prompt's real tokens (-1 =
    its last token, whatever the padding). With a logit soft cap (Gemma 2), `actual` is the logit
    (difference) before the cap, which is what the components add up to; the cap only squashes it.
    """
    check_pre_norm(model)
    refuse_prediction_head(model, "direct_logit_attribution")
    tokens, mask = tokens_and_mask(model, input, attention_mask)
    batch = tokens.shape[0]
    answer_ids = _token_ids(model, answer, batch, "answer")
    cf_ids = None if counterfactual is None else _token_ids(model, counterfactual, batch, "counterfactual")
    positions = resolve_positions(mask, position)
    frozen = has_final_scale(model)
    capped = model.cfg.logit_softcap is not None
    final_name = act_name("resid_post", model.cfg.n_layers - 1)
    names = component_hooks(model) + (["ln_final.hook_scale"] if frozen else []) + ([final_name] if capped else [])
    logits, cache = model.run_with_cache(tokens, attention_mask=model_mask(mask), names=names)
    rows = torch.arange(batch, device=tokens.device)
    explained = logits[rows, positions]  # [batch vocab]
    if capped:  # the components add up to the logits before the cap (a monotone squash), so those are explained
        final = cache[final_name][rows, positions][:, None]  # [batch 1 d_model]
        explained = model.unembed.uncapped(model.ln_final(final))[:, 0]
    comps = stack_components(model, cache, positions, dtype=torch.float32)  # [batch component d_model]
    scale = cache["ln_final.hook_scale"][rows, positions][:, None, :] if frozen else None  # [batch 1 1]

    # With its scale frozen at the forward pass's value the final norm is affine, N(x) = L(x) + N(0):
    # a component's row is L(component), and N(0) (the norm's bias) is a row of its own. In float32
    # whatever the model's dtype: N(c) - N(0) rounded to bfloat16 would lose a small component's
    # digits to the bias it cancels (a 1% error), where float32 keeps the forward's own activations exact.
    zero = torch.zeros_like(comps[:, :1])
    normed = final_norm(model, torch.cat([comps, zero], dim=1).float(), frozen_scale=scale).float()
    linear, at_zero = normed[:, :-1] - normed[:, -1:], normed[:, -1]

    W_U = model.unembed.W_U.float()
    direction = W_U[:, answer_ids].T  # [batch d_model]
    actual = explained[rows, answer_ids].float()
    bias = getattr(model.unembed, "bias", None)
    unembed_bias = torch.zeros(batch, device=tokens.device) if bias is None else bias.float()[answer_ids]
    if cf_ids is not None:
        direction = direction - W_U[:, cf_ids].T
        actual = actual - explained[rows, cf_ids].float()
        if bias is not None:
            unembed_bias = unembed_bias - bias.float()[cf_ids]
    contributions = einsum(linear, direction, "batch component d_model, batch d_model -> batch component")
    ln_bias = einsum(at_zero, direction, "batch d_model, batch d_model -> batch")

    index = Components.for_model(model)
    written = index.written(model.cfg.n_layers, include_mid=has_resid_mid(model), device=tokens.device)
    accumulated = einsum(contributions, written, "batch component, layer component -> batch layer") + (ln_bias + unembed_bias)[:, None]
    return LogitAttribution(
        tokens=tokens, positions=positions, answer=answer_ids, counterfactual=cf_ids, contributions=contributions,
        ln_bias=ln_bias, unembed_bias=unembed_bias, actual=actual, accumulated=accumulated, index=index,
        n_layers=model.cfg.n_layers, n_heads=max(model.cfg.layer_heads(l) for l in range(model.cfg.n_layers)),
        position_labels=position_labels(model, tokens), token_strings=token_decoder(model), has_mid=has_resid_mid(model),
    )
