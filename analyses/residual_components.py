"""The component axis of the residual stream: `embed`, `pos_embed`, then per layer l every head `L{l}H{h}` (its
`hook_result`, without b_O), `L{l} attn bias` (b_O) and `L{l} mlp`, whose writes add up to the final residual
stream of a pre-norm model; their names, the hooks that read them, and the writes stacked from a cache.

Only what the residual stream holds is a component: an attention-only model has no `L{l} mlp`, and a model whose
positions never enter the residual (rotary, shortformer) no `pos_embed`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pandas as pd
import torch

from probe.analyses.lens_sites import lens_sites
from probe import HookedDecoder
from probe.config import Norm, NormPlacement
from probe.names import act_name


@dataclass(frozen=True)
class Components:
    """Names and coordinates of the component axis; `layer`/`head` are None where they do not apply."""

    names: list[str]
    kinds: list[str]  # embed, pos_embed, head, attn_bias, linear_attn (a hybrid's recurrent layer, whole), mlp
    layers: list[Optional[int]]
    heads: list[Optional[int]]

    @classmethod
    def for_model(cls, model: HookedDecoder) -> "Components":
        names, kinds = ["embed"], ["embed"]
        if has_pos_embed(model):
            names, kinds = names + ["pos_embed"], kinds + ["pos_embed"]
        layers, heads = [None] * len(names), [None] * len(names)
        mlp = 0 if model.cfg.attn_only else 1
        for layer, block in enumerate(model.blocks):
            if model.cfg.layer_is_linear(layer):  # no heads: the layer's write is one component, named as its mixer
                names += [f"L{layer} {block.mixer_name}"] + [f"L{layer} mlp"] * mlp
                kinds += ["linear_attn"] + ["mlp"] * mlp
                layers += [layer] * (1 + mlp)
                heads += [None] * (1 + mlp)
                continue
            n_heads = block.attn.n_heads  # per layer: pruned models keep different numbers
            bias = [f"L{layer} attn bias"] if block.attn.out.bias is not None else []
            names += [f"L{layer}H{h}" for h in range(n_heads)] + bias + [f"L{layer} mlp"] * mlp
            kinds += ["head"] * n_heads + ["attn_bias"] * len(bias) + ["mlp"] * mlp
            layers += [layer] * (n_heads + len(bias) + mlp)
            heads += list(range(n_heads)) + [None] * (len(bias) + mlp)
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
        depth = [0 if layer is None else 2 * layer + (1 if kind in ("head", "attn_bias", "linear_attn") else 2)
                 for layer, kind in zip(self.layers, self.kinds)]
        return torch.tensor(depth)


def has_pos_embed(model: HookedDecoder) -> bool:
    """Whether `pos_embed` is a component: the model writes its positions into the residual stream (rotary and
    shortformer positions act inside attention; a shortformer's hook_pos_embed fires all the same)."""
    return model.cfg.positions_in_residual


def check_pre_norm(model: HookedDecoder) -> None:
    placement = model.cfg.norm_placement
    if placement is NormPlacement.POST:
        raise ValueError("this model normalises after each sublayer (post-norm), so its residual stream is not a sum of "
                         "component writes; residual decomposition and direct logit attribution need a pre-norm model")
    if placement is NormPlacement.SANDWICH and model.cfg.norm is Norm.LAYER:
        raise ValueError("sandwich blocks are decomposed with RMSNorm write norms (Gemma 2); with LayerNorm ones the "
                         "split into heads is not implemented")


def stack_components(model: HookedDecoder, cache, positions: Optional[torch.Tensor] = None,
                     dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """[batch pos component d_model] in `Components.for_model` order, from a cache of `component_hooks`;
    with `positions` [batch], only each prompt's one position: [batch component d_model]. `dtype` (default: the
    cache's) is the stack's: a sandwich block's head shares are computed, not cached, and float32 keeps their digits."""
    def pick(t: torch.Tensor) -> torch.Tensor:  # [batch pos ...] -> [batch ...] before stacking, to keep memory small
        return t if positions is None else t[torch.arange(t.shape[0], device=t.device), positions]

    embed = pick(cache["hook_embed"])
    dtype = embed.dtype if dtype is None else dtype
    embed = embed.to(dtype)
    parts = [embed.unsqueeze(-2)]
    if has_pos_embed(model):
        parts.append(pick(cache["hook_pos_embed"]).to(dtype).unsqueeze(-2))
    for layer, block in enumerate(model.blocks):
        if model.cfg.layer_is_linear(layer):  # a hybrid's linear-attention layer: its whole write, then its MLP's
            writes = ("attn_out",) if model.cfg.attn_only else ("attn_out", "mlp_out")  # (Mamba-2's: no MLP)
            parts += [pick(cache[act_name(name, layer)]).to(dtype).unsqueeze(-2) for name in writes]
            continue
        heads = pick(cache[act_name("result", layer)]).to(dtype)  # [batch (pos) head d_model]
        bias = None if block.attn.out.bias is None else block.attn.out.bias.detach().to(embed.dtype).expand_as(embed).unsqueeze(-2)
        if hasattr(block, "ln1_post"):
            # a sandwich block normalises the attention's write; with that norm's scale frozen at its value in
            # this forward (as the final norm's is), x -> x * w / scale is linear, so each head's share of
            # hook_attn_out is its result through the same map, and the shares add up to it exactly
            through = (block.ln1_post.w.detach() / pick(cache[act_name("scale", layer, "ln1_post")])).unsqueeze(-2)
            heads = (heads * through).to(embed.dtype)
            bias = None if bias is None else (bias * through).to(embed.dtype)
        parts += [heads] + ([] if bias is None else [bias])
        if not model.cfg.attn_only:  # a sandwich block's mlp_out is already normalised
            parts.append(pick(cache[act_name("mlp_out", layer)]).to(dtype).unsqueeze(-2))
    return torch.cat(parts, dim=-2)


def component_hooks(model: HookedDecoder) -> list[str]:
    names = ["hook_embed"] + (["hook_pos_embed"] if has_pos_embed(model) else [])
    for layer in range(model.cfg.n_layers):
        mixer = act_name("attn_out" if model.cfg.layer_is_linear(layer) else "result", layer)
        names += [mixer] + ([] if model.cfg.attn_only else [act_name("mlp_out", layer)])
        if model.cfg.norm_placement is NormPlacement.SANDWICH:
            names.append(act_name("scale", layer, "ln1_post"))
    return names

