"""The residual stream as a sum of component writes, and each write's direct effect on the logits (Elhage et al. 2021).

Components, in order: `embed`, `pos_embed`, then per layer l every head `L{l}H{h}` (its
`hook_result`, without b_O), `L{l} attn bias` (b_O) and `L{l} mlp`. Their sum is the final
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

from analyses.common import AnalysisInput, check_id_tensor, escape_token, is_int, token_decoder, token_id
from analyses.lens import (
    _final_norm, _forward_mask, _resolve_positions, has_final_scale, has_resid_mid, lens_sites, position_labels,
    site_label, tokens_and_mask,
)
from probe import HookedDecoder
from probe.config import Norm, NormPlacement
from probe.names import act_name

TokenSpec = Union[int, str, Sequence[Union[int, str]], torch.Tensor]


@dataclass(frozen=True)
class Components:
    """Names and coordinates of the component axis; `layer`/`head` are None where they do not apply."""

    names: list[str]
    kinds: list[str]  # embed, pos_embed, head, attn_bias, mlp
    layers: list[Optional[int]]
    heads: list[Optional[int]]

    @classmethod
    def for_model(cls, model: HookedDecoder) -> "Components":
        names, kinds = ["embed"], ["embed"]
        if _has_pos_embed(model):
            names, kinds = names + ["pos_embed"], kinds + ["pos_embed"]
        layers, heads = [None] * len(names), [None] * len(names)
        for layer, block in enumerate(model.blocks):
            n_heads = block.attn.n_heads  # per layer: pruned models keep different numbers
            bias = [f"L{layer} attn bias"] if block.attn.b_O is not None else []
            names += [f"L{layer}H{h}" for h in range(n_heads)] + bias + [f"L{layer} mlp"]
            kinds += ["head"] * n_heads + ["attn_bias"] * len(bias) + ["mlp"]
            layers += [layer] * (n_heads + len(bias) + 1)
            heads += list(range(n_heads)) + [None] * len(bias) + [None]
        return cls(names, kinds, layers, heads)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame({
            "component": self.names, "kind": self.kinds,
            "layer": pd.array(self.layers, dtype="Int64"), "head": pd.array(self.heads, dtype="Int64"),
        })

    def written(self, n_layers: int, include_mid: bool, device=None) -> torch.Tensor:
        """[layer component]: 1 where the component is already in the residual read at lens site `layer`
        (embed, L0, L1, ... or, with include_mid, embed, L0 attn, L0, L1 attn, ...)."""
        depth = self.depth().to(device)
        if not include_mid:  # sites embed, L0, L1, ...: a component of layer l is in from site l + 1 on
            depth = torch.where(depth == 0, 0, (depth + 1) // 2)
        sites = torch.arange(len(lens_sites(n_layers, include_mid)), device=device)
        return (depth[None, :] <= sites[:, None]).float()

    def depth(self) -> torch.Tensor:
        """[component]: index of the first lens site (embed, L0 attn, L0, L1 attn, ...) that includes the component."""
        depth = [0 if layer is None else 2 * layer + (1 if kind in ("head", "attn_bias") else 2)
                 for layer, kind in zip(self.layers, self.kinds)]
        return torch.tensor(depth)


def _has_pos_embed(model: HookedDecoder) -> bool:
    return "hook_pos_embed" in model.hook_names  # models with rotary positions write no position embedding


def _check_pre_norm(model: HookedDecoder) -> None:
    placement = model.cfg.norm_placement
    if placement is NormPlacement.POST:
        raise ValueError("this model normalises after each sublayer (post-norm), so its residual stream is not a sum of "
                         "component writes; residual decomposition and direct logit attribution need a pre-norm model")
    if placement is NormPlacement.SANDWICH and model.cfg.norm is Norm.LAYER:
        raise ValueError("sandwich blocks are decomposed with RMSNorm write norms (Gemma 2); with LayerNorm ones the "
                         "split into heads is not implemented")


def _stack_components(model: HookedDecoder, cache, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[batch pos component d_model] in `Components.for_model` order, from a cache of `_component_hooks`;
    with `positions` [batch], only each prompt's one position: [batch component d_model]."""
    def pick(t: torch.Tensor) -> torch.Tensor:  # [batch pos ...] -> [batch ...] before stacking, to keep memory small
        return t if positions is None else t[torch.arange(t.shape[0], device=t.device), positions]

    embed = pick(cache["hook_embed"])
    parts = [embed.unsqueeze(-2)]
    if _has_pos_embed(model):
        parts.append(pick(cache["hook_pos_embed"]).unsqueeze(-2))
    for layer, block in enumerate(model.blocks):
        heads = pick(cache[act_name("result", layer)])  # [batch (pos) head d_model]
        bias = None if block.attn.b_O is None else block.attn.b_O.detach().to(embed.dtype).expand_as(embed).unsqueeze(-2)
        if hasattr(block, "ln1_post"):
            # a sandwich block normalises the attention's write; with that norm's scale frozen at its value in
            # this forward (as the final norm's is), x -> x * w / scale is linear, so each head's share of
            # hook_attn_out is its result through the same map, and the shares add up to it exactly
            through = (block.ln1_post.w.detach() / pick(cache[act_name("scale", layer, "ln1_post")])).unsqueeze(-2)
            heads = (heads * through).to(embed.dtype)
            bias = None if bias is None else (bias * through).to(embed.dtype)
        parts += [heads] + ([] if bias is None else [bias])
        parts.append(pick(cache[act_name("mlp_out", layer)]).unsqueeze(-2))  # a sandwich block's is already normalised
    return torch.cat(parts, dim=-2)


def _component_hooks(model: HookedDecoder) -> list[str]:
    names = ["hook_embed"] + (["hook_pos_embed"] if _has_pos_embed(model) else [])
    for layer in range(model.cfg.n_layers):
        names += [act_name("result", layer), act_name("mlp_out", layer)]
        if model.cfg.norm_placement is NormPlacement.SANDWICH:
            names.append(act_name("scale", layer, "ln1_post"))
    return names


# ---- residual decomposition -------------------------------------------------------------------------
@dataclass
class ResidualDecomposition:
    """The final residual stream at every position as a sum over components: `components.sum(2)` is
    `blocks.{n_layers-1}.hook_resid_post`. Dimensions `batch pos component d_model`."""

    tokens: torch.Tensor  # [batch pos]
    mask: torch.Tensor  # [batch pos] bool
    components: torch.Tensor  # [batch pos component d_model]
    index: Components
    n_layers: int
    position_labels: list[list[str]]
    token_strings: Callable[[list[int]], list[str]] = field(repr=False)
    has_mid: bool = True  # a residual between attention and MLP exists (not in parallel blocks)

    def total(self) -> torch.Tensor:
        """[batch pos d_model]: the sum of every component, the final residual stream."""
        return self.components.sum(dim=2)

    def accumulated(self, include_mid: bool = False) -> torch.Tensor:
        """[batch layer pos d_model]: the residual after the embedding and after each block (and each
        attention sublayer with include_mid), i.e. the sum of the components written so far."""
        if include_mid and not self.has_mid:
            raise ValueError("include_mid=True reads the residual between attention and MLP; this model's blocks are "
                             "parallel (both read the residual entering the block), so there is none")
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
        pos = int(_resolve_positions(self.mask[prompt:prompt + 1], position)[0])
        norm = self.components[prompt, pos].float().norm(dim=-1).cpu()
        names = self.index.names
        fig = go.Figure(go.Bar(x=names, y=norm.numpy(), hovertext=[f"{n}: |write| = {v:.5g}" for n, v in zip(names, norm.tolist())],
                               hoverinfo="text"))
        fig.update_layout(title=f"Residual stream at {self.position_labels[prompt][pos]}: norm of each component's write",
                          xaxis_title="component", yaxis_title="L2 norm", xaxis_type="category")
        return fig


@torch.no_grad()
def residual_decomposition(
    model: HookedDecoder, input: AnalysisInput, *, attention_mask: Optional[torch.Tensor] = None
) -> ResidualDecomposition:
    """Split the final residual stream at every position into embedding, position embedding, every
    head's write, each layer's attention bias and each MLP's output."""
    _check_pre_norm(model)
    tokens, mask = tokens_and_mask(model, input, attention_mask)
    _, cache = model.run_with_cache(tokens, attention_mask=_forward_mask(mask), names=_component_hooks(model))
    return ResidualDecomposition(
        tokens=tokens, mask=mask, components=_stack_components(model, cache),
        index=Components.for_model(model), n_layers=model.cfg.n_layers,
        position_labels=position_labels(model, tokens), token_strings=token_decoder(model), has_mid=has_resid_mid(model),
    )


# ---- direct logit attribution -----------------------------------------------------------------------
@dataclass
class LogitAttribution:
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
    has_mid: bool = True  # `accumulated` reads after each attention sublayer too (not in parallel blocks)

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
        a = f"logit({escape_token(answer[0])})" if same else "logit(answer)"
        if self.counterfactual is None:
            return a
        cf = self.token_strings(self.counterfactual.tolist())
        same = len(set(self.counterfactual.tolist())) == 1
        return f"{a} − " + (f"logit({escape_token(cf[0])})" if same else "logit(counterfactual)")

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
        where = f"mean over {self.contributions.shape[0]} prompts" if prompt is None else \
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
        fig.update_layout(title=f"{title}<br>top {len(shown)} of {len(names)} rows; all rows sum to {float(pick(self.actual)):.4f}",
                          xaxis_title="contribution (logits)", yaxis_title="component", yaxis_type="category")
        return fig

    def _heads(self, heads: torch.Tensor, title: str) -> go.Figure:
        layers = [f"L{l}" for l in range(self.n_layers)]
        names = [f"H{h}" for h in range(self.n_heads)]
        hover = [[f"L{l}H{h}: {heads[l, h]:+.6f}" for h in range(self.n_heads)] for l in range(self.n_layers)]
        fig = go.Figure(go.Heatmap(z=heads.numpy(), x=names, y=layers, colorscale="RdBu", zmid=0.0,
                                   hovertext=hover, hoverinfo="text", colorbar=dict(title="logits")))
        fig.update_layout(title=f"{title}: per head", xaxis_title="head", yaxis_title="layer",
                          xaxis_type="category", yaxis_type="category")
        return fig

    def _accumulated(self, pick, title: str) -> go.Figure:
        labels = [site_label(s) for s in self.sites]
        values = pick(self.accumulated).cpu()
        fig = go.Figure(go.Scatter(x=labels, y=values.numpy(), mode="lines+markers",
                                   hovertext=[f"after {l}: {v:+.6f}" for l, v in zip(labels, values.tolist())], hoverinfo="text"))
        fig.update_layout(title=f"{title}: accumulated over layers (final scale frozen)",
                          xaxis_title="residual stream after", yaxis_title="logit (difference)")
        return fig


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
    _check_pre_norm(model)
    tokens, mask = tokens_and_mask(model, input, attention_mask)
    batch = tokens.shape[0]
    answer_ids = _token_ids(model, answer, batch, "answer")
    cf_ids = None if counterfactual is None else _token_ids(model, counterfactual, batch, "counterfactual")
    positions = _resolve_positions(mask, position)
    frozen = has_final_scale(model)
    capped = model.cfg.logit_softcap is not None
    final_name = act_name("resid_post", model.cfg.n_layers - 1)
    names = _component_hooks(model) + (["ln_final.hook_scale"] if frozen else []) + ([final_name] if capped else [])
    logits, cache = model.run_with_cache(tokens, attention_mask=_forward_mask(mask), names=names)
    rows = torch.arange(batch, device=tokens.device)
    explained = logits[rows, positions]  # [batch vocab]
    if capped:  # the components add up to the logits before the cap (a monotone squash), so those are explained
        final = cache[final_name][rows, positions][:, None]  # [batch 1 d_model]
        explained = model.unembed.uncapped(model.ln_final(final))[:, 0]
    comps = _stack_components(model, cache, positions)  # [batch component d_model]
    scale = cache["ln_final.hook_scale"][rows, positions][:, None, :] if frozen else None  # [batch 1 1]

    # With its scale frozen at the forward pass's value the final norm is affine, N(x) = L(x) + N(0):
    # a component's row is L(component), and N(0) (the norm's bias) is a row of its own. In float32
    # whatever the model's dtype: N(c) - N(0) rounded to bfloat16 would lose a small component's
    # digits to the bias it cancels (a 1% error), where float32 keeps the forward's own activations exact.
    zero = torch.zeros_like(comps[:, :1])
    normed = _final_norm(model, torch.cat([comps, zero], dim=1).float(), frozen_scale=scale).float()
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
        n_layers=model.cfg.n_layers, n_heads=max(block.attn.n_heads for block in model.blocks),
        position_labels=position_labels(model, tokens), token_strings=token_decoder(model), has_mid=has_resid_mid(model),
    )
