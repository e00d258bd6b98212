"""The component axis of the residual stream: `embed`, `pos_embed`, then per layer l every head `L{l}H{h}` (its
`hook_result`, without b_O), `L{l} attn bias` (b_O), `L{l} mamba` (Falcon-H1's mixer beside attention,
`hook_mixer_out`), `L{l} mlp` and `L{l} per_layer` (Gemma 4's per-layer input, `hook_per_layer_out`), whose writes
add up to the final residual stream of a pre-norm model; their names, the hooks that read them, and the writes
stacked from a cache. Gemma 4 multiplies the whole residual by each layer's scalar: each write is stacked as the
final residual holds it, times the scalars of its layer and every later one, and `written` weighs a lens site's
share by the scalars still to come (so the sum at each site is that site's residual, exactly).

Only what the residual stream holds is a component: an attention-only model has no `L{l} mlp`, and a model whose
positions never enter the residual (rotary, shortformer) no `pos_embed`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pandas as pd
import torch

from probe.analyses.architecture import refuse_shared_blocks
from probe.analyses.lens_sites import lens_sites
from probe import HookedDecoder
from probe.config import Norm, NormPlacement
from probe.names import act_name


@dataclass(frozen=True)
class Components:
    """Names and coordinates of the component axis; `layer`/`head` are None where they do not apply."""

    names: list[str]
    kinds: list[str]  # embed, pos_embed, head, attn_bias, linear_attn (a hybrid's recurrent layer, whole), mamba, mlp
    layers: list[Optional[int]]
    heads: list[Optional[int]]
    # Gemma 4's layer scalars, each block's output times its own; None: every block adds its writes as they are
    scalars: Optional[tuple[float, ...]] = None

    @classmethod
    def for_model(cls, model: HookedDecoder) -> "Components":
        names, kinds = ["embed"], ["embed"]
        if has_pos_embed(model):
            names, kinds = names + ["pos_embed"], kinds + ["pos_embed"]
        layers, heads = [None] * len(names), [None] * len(names)
        for layer, block in enumerate(model.blocks):
            mlp = int(model.cfg.layer_has_mlp(layer))  # (none in attn_only blocks, nor in a one-sublayer mixer layer)
            if not model.cfg.layer_has_mixer(layer):  # an MLP-only layer (NemotronH's): its MLP's write alone
                names, kinds, layers, heads = names + [f"L{layer} mlp"], kinds + ["mlp"], layers + [layer], heads + [None]
                continue
            if model.cfg.layer_is_linear(layer):  # no heads: the layer's write is one component, named as its mixer
                names += [f"L{layer} {block.mixer_name}"] + [f"L{layer} mlp"] * mlp
                kinds += ["linear_attn"] + ["mlp"] * mlp
                layers += [layer] * (1 + mlp)
                heads += [None] * (1 + mlp)
                continue
            n_heads = block.attn.n_heads  # per layer: pruned models keep different numbers
            bias = [f"L{layer} attn bias"] if write_bias(block.attn) is not None else []
            bias_kinds = ["attn_bias"] * len(bias)
            if model.cfg.layer_has_parallel_mixer(layer):  # Falcon-H1's Mamba-2 mixer, writing beside attention
                bias, bias_kinds = bias + [f"L{layer} mamba"], bias_kinds + ["mamba"]
            per_layer = int(model.cfg.per_layer_inputs is not None)  # (Gemma 4 E2B, E4B's: after the MLP)
            names += [f"L{layer}H{h}" for h in range(n_heads)] + bias + [f"L{layer} mlp"] * mlp + [f"L{layer} per_layer"] * per_layer
            kinds += ["head"] * n_heads + bias_kinds + ["mlp"] * mlp + ["per_layer"] * per_layer
            layers += [layer] * (n_heads + len(bias) + mlp + per_layer)
            heads += list(range(n_heads)) + [None] * (len(bias) + mlp + per_layer)
        scalars = tuple(float(block.layer_scalar) for block in model.blocks) if model.cfg.layer_scalars else None
        return cls(names, kinds, layers, heads, scalars)

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
        written = (depth[None, :] <= sites[:, None]).float()
        if self.scalars is None:
            return written
        # a site's residual holds each write times the scalars of the blocks finished by then; the components hold
        # it times all of them, so a site weighs them by the inverse of the scalars still to come
        done = sites // 2 if include_mid else sites  # blocks finished at each site
        after = scalar_products(self.scalars, device)  # [layer+1]: the product of the scalars from layer l on
        return written * after[done][:, None].float()

    def depth(self) -> torch.Tensor:
        """[component]: index of the first lens site (embed, L0 attn, L0, L1 attn, ...) that includes the component."""
        depth = [0 if layer is None else 2 * layer + (1 if kind in ("head", "attn_bias", "linear_attn", "mamba") else 2)
                 for layer, kind in zip(self.layers, self.kinds)]
        return torch.tensor(depth)


def scalar_products(scalars: tuple[float, ...], device=None) -> torch.Tensor:
    """[n_layers + 1] float64: 1 / the product of the scalars of layers l, l+1, ..., the last (1 at n_layers)."""
    products = torch.tensor(scalars + (1.0,), dtype=torch.float64, device=device).flip(0).cumprod(0).flip(0)
    return 1 / products


def has_pos_embed(model: HookedDecoder) -> bool:
    """Whether `pos_embed` is a component: the model writes its positions into the residual stream (rotary and
    shortformer positions act inside attention; a shortformer's hook_pos_embed fires all the same)."""
    return model.cfg.positions_in_residual


def check_pre_norm(model: HookedDecoder) -> None:
    refuse_shared_blocks(model, "residual decomposition and direct logit attribution")
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
        if model.cfg.layer_is_linear(layer) or not model.cfg.layer_has_mixer(layer):
            # whole writes: a hybrid's recurrent layer's, then its MLP's (Mamba-2's: none); an MLP-only layer's MLP's
            writes = ("attn_out",) * model.cfg.layer_has_mixer(layer) + ("mlp_out",) * model.cfg.layer_has_mlp(layer)
            parts += [pick(cache[act_name(name, layer)]).to(dtype).unsqueeze(-2) for name in writes]
            continue
        heads = pick(cache[act_name("result", layer)]).to(dtype)  # [batch (pos) head d_model]
        bias = write_bias(block.attn)
        bias = None if bias is None else bias.detach().to(embed.dtype).expand_as(embed).unsqueeze(-2)
        if hasattr(block, "ln1_post"):
            # a sandwich block normalises the attention's write; with that norm's scale frozen at its value in
            # this forward (as the final norm's is), x -> x * w / scale is linear, so each head's share of
            # hook_attn_out is its result through the same map, and the shares add up to it exactly
            through = (block.ln1_post.w.detach() / pick(cache[act_name("scale", layer, "ln1_post")])).unsqueeze(-2)
            heads = (heads * through).to(embed.dtype)
            bias = None if bias is None else (bias * through).to(embed.dtype)
        parts += [heads] + ([] if bias is None else [bias])
        if model.cfg.layer_has_parallel_mixer(layer):  # the Mamba-2 mixer's write beside attention's (Falcon-H1)
            parts.append(pick(cache[f"blocks.{layer}.hook_mixer_out"]).to(dtype).unsqueeze(-2))
        if model.cfg.layer_has_mlp(layer):  # a sandwich block's mlp_out is already normalised
            parts.append(pick(cache[act_name("mlp_out", layer)]).to(dtype).unsqueeze(-2))
        if model.cfg.per_layer_inputs is not None:  # Gemma 4's per-layer input, added after the MLP
            parts.append(pick(cache[f"blocks.{layer}.hook_per_layer_out"]).to(dtype).unsqueeze(-2))
        if model.cfg.layer_scalars:  # Gemma 4: the block's output, everything written so far, times its scalar
            parts = [part * block.layer_scalar.to(dtype) for part in parts]
    return torch.cat(parts, dim=-2)


def write_bias(attn) -> Optional[torch.Tensor]:
    """[d_model], the bias attention adds once to its heads' writes (b_O), None without one: its output projection's,
    or a mixture of attention heads' own (JetMoE's, which has no output projection shared by its heads)."""
    return attn.out.bias if hasattr(attn, "out") else attn.b_O


def component_hooks(model: HookedDecoder) -> list[str]:
    names = ["hook_embed"] + (["hook_pos_embed"] if has_pos_embed(model) else [])
    for layer in range(model.cfg.n_layers):
        mixer = act_name("attn_out" if model.cfg.layer_is_linear(layer) else "result", layer)
        names += [mixer] * model.cfg.layer_has_mixer(layer) + [act_name("mlp_out", layer)] * model.cfg.layer_has_mlp(layer)
        names += [f"blocks.{layer}.hook_mixer_out"] * model.cfg.layer_has_parallel_mixer(layer)  # (Falcon-H1's)
        if hasattr(model.blocks[layer], "ln1_post"):  # (a hybrid's linear-attention blocks are pre-norm)
            names.append(act_name("scale", layer, "ln1_post"))
        names += [f"blocks.{layer}.hook_per_layer_out"] * (model.cfg.per_layer_inputs is not None)  # (Gemma 4's)
    return names

