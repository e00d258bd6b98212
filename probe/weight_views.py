"""The model's weights in transformer-lens's names and shapes, stacked over layers (read-only copies), and the
circuits transformer-lens builds from them: `model.OV`, `model.QK`, composition scores, unembedding directions."""
from __future__ import annotations

import numbers
from typing import Callable, Literal, Optional, Union

import torch

from probe.config import NormPlacement
from probe.factored import FactoredMatrix


def _per_head(w: torch.Tensor) -> tuple[int, ...]:  # [head d_model d_head] -> [head d_head]
    return (w.shape[0], w.shape[-1])


def _last(w: torch.Tensor) -> tuple[int, ...]:  # [... d_out] -> [d_out]
    return (w.shape[-1],)


def _stacked(path: str, shape: str, bias_of: Optional[tuple[str, Callable]] = None) -> property:
    """Every block's `path` (e.g. "attn.W_Q") stacked over layers, [layer ...]: a copy, to read. A bias the
    checkpoint lacks is zeros, as transformer-lens has it, so `z @ model.W_O[l] + model.b_O[l]` runs on every
    family (the blocks' own `attn.b_O` stays None); `bias_of` is (the weight it biases, its shape from the weight)."""
    sublayer, name = path.split(".")

    def get(self: "WeightViews") -> torch.Tensor:
        if sublayer == "mlp" and self.cfg.sublayers is not None:  # (NemotronH's: one sublayer per layer)
            raise ValueError(f"model.{name}: this model's layers hold one sublayer each, so only some have an MLP and "
                             f"{name} does not stack over layers; read model.blocks[layer].{path} for an MLP layer")
        if sublayer == "mlp" and self.cfg.attn_only:
            # a ValueError, not an AttributeError: nn.Module would swap the latter for a bare "no attribute W_in"
            raise ValueError(f"model.{name}: this attention-only model has no MLPs")
        if sublayer == "mlp" and self.cfg.experts is not None:
            refuse_experts(f"model.{name}")
        if sublayer == "mlp" and self.cfg.rwkv is not None:
            raise ValueError(f"model.{name}: this model's MLPs are RWKV channel mixes (blocks.L.channel_mix: key, value "
                             f"and receptance weights), which have no {name}")
        attention = [l for l in range(self.cfg.n_layers) if self.cfg.layer_has_attention(l)]
        if sublayer == "attn" and len(attention) < self.cfg.n_layers:  # (every recurrent kind, NemotronH's MLP layers)
            cfg = self.cfg
            kind = f"state-space ({cfg.state_space.label})" if cfg.state_space is not None else cfg.recurrent_kind
            raise ValueError(f"model.{name}: this {'hybrid ' if attention else ''}model's {kind} layers have no "
                             f"attention heads, so {name} does not stack over layers" + (
                                 f"; read model.blocks[layer].{path} for an attention layer ({attention})" if attention
                                 else " (it has no attention layer)"))
        if sublayer == "attn" and name[-1] in "KV" and self.cfg.shared_kv is not None:  # (Gemma 4's last layers)
            shared = [l for l in range(self.cfg.n_layers) if self.cfg.layer_kv_source(l) is not None]
            raise ValueError(f"model.{name}: layers {shared} compute no keys or values (they attend over earlier "
                             f"layers'), so {name} does not stack over layers; read model.blocks[layer].{path}")
        values = []
        for block in self.blocks:
            try:
                value = getattr(getattr(block, sublayer), name)
            except AttributeError as missing:  # (else nn.Module's lookup gives a bare "no attribute W_Q" for the model)
                raise ValueError(f"model.{name}: {missing}") from None
            part = getattr(block, sublayer)
            if value is None:
                weight = getattr(part, bias_of[0])
                value = weight.new_zeros(bias_of[1](weight))
            values.append(value)
        if len({tuple(v.shape) for v in values}) > 1:
            raise ValueError(f"{name} has a different shape in each layer (structurally pruned heads, or Gemma 4's "
                             f"wider full-attention heads and MLPs), so it does not stack; read model.blocks[layer].{path}")
        return torch.stack(values)

    get.__doc__ = f"{shape}: every block's {path}, stacked" + (" (zeros where the model has no such bias)"
                                                                  if bias_of else "")
    return property(get)


def refuse_experts(what: str) -> None:
    """A mixture of experts has no one MLP per layer for `what` to read (neither has transformer-lens's)."""
    raise ValueError(f"{what}: this model's MLPs are mixtures of experts, with no one W_in / W_out per layer; read an "
                     "expert's nn.Linear layers, model.blocks[layer].mlp.experts[e].W_in.weight (W_gate, W_out; "
                     "[out in]), and the router's, model.blocks[layer].mlp.W_gate.weight [experts d_model]")


class WeightViews:
    """Mixed into HookedDecoder: `model.W_Q` [layer head d_model d_head] and the rest, as transformer-lens names them."""

    W_Q = _stacked("attn.W_Q", "[layer head d_model d_head]")
    W_K = _stacked("attn.W_K", "[layer kv_head d_model d_head]")
    W_V = _stacked("attn.W_V", "[layer kv_head d_model d_head]")
    W_O = _stacked("attn.W_O", "[layer head d_head d_model]")
    b_Q = _stacked("attn.b_Q", "[layer head d_head]", ("W_Q", _per_head))
    b_K = _stacked("attn.b_K", "[layer kv_head d_head]", ("W_K", _per_head))
    b_V = _stacked("attn.b_V", "[layer kv_head d_head]", ("W_V", _per_head))
    b_O = _stacked("attn.b_O", "[layer d_model]", ("W_O", _last))
    W_in = _stacked("mlp.W_in", "[layer d_model d_mlp]")
    W_out = _stacked("mlp.W_out", "[layer d_mlp d_model]")
    b_in = _stacked("mlp.b_in", "[layer d_mlp]", ("W_in", _last))
    b_out = _stacked("mlp.b_out", "[layer d_model]", ("W_out", _last))

    @property
    def W_gate(self) -> Optional[torch.Tensor]:  # [layer d_model d_mlp]; None without a gated MLP, as transformer-lens's
        if not self.cfg.gated_mlp:
            return None
        if self.cfg.experts is not None:
            refuse_experts("model.W_gate")
        return torch.stack([block.mlp.W_gate for block in self.blocks])

    @property
    def W_E(self) -> torch.Tensor:  # [vocab d_model]: the table; Gemma's residual receives it times embed.scale
        return self.embed.W_E

    @property
    def W_pos(self) -> torch.Tensor:  # [n_ctx d_model]
        if self.pos_embed is None:
            raise ValueError("this model has rotary positions, which rotate q and k inside attention: no W_pos")
        return self.pos_embed.W_pos

    @property
    def W_U(self) -> torch.Tensor:  # [d_model vocab]
        return self.unembed.W_U

    @property
    def b_U(self) -> torch.Tensor:  # [vocab]: zeros without an unembedding bias, as transformer-lens's
        return self.unembed.b_U

    @property
    def W_E_pos(self) -> torch.Tensor:  # [vocab + n_ctx, d_model]: the token and position tables, one after the other
        return torch.cat([self.W_E, self.W_pos], dim=0)

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> torch.Tensor:
        """[d_model]: what the biases alone have added to the residual stream before block `layer` (every earlier
        attention's b_O, and the MLPs' b_out unless include_mlp_biases=False), or before its MLP with
        mlp_input=True, as transformer-lens's. Refused where biases do not simply add up in the residual: post-norm
        and sandwich blocks (a norm sits between each write and the residual), and mlp_input=True in a parallel
        block (its MLP reads resid_pre, which holds no bias of its own layer's attention)."""
        n_layers = len(self.blocks)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= n_layers:
            raise ValueError(f"accumulated_bias: layer={layer!r} must be an int in [0, n_layers={n_layers}]")
        placement = self.cfg.norm_placement
        if placement in (NormPlacement.POST, NormPlacement.SANDWICH):
            raise ValueError(f"accumulated_bias: this model's blocks are {placement.value}-norm, so a norm lies between "
                             "each bias and the residual stream and the biases do not add up there")
        if mlp_input and (layer == n_layers or placement is NormPlacement.PARALLEL or self.cfg.attn_only):
            why = ("layer=n_layers has no MLP" if layer == n_layers else "this attention-only model has no MLPs"
                   if self.cfg.attn_only else
                   "in a parallel block the MLP reads resid_pre, so accumulated_bias(layer) is its input already")
            raise ValueError(f"accumulated_bias: mlp_input=True: {why}")
        b_O = self.b_O  # each read stacks every layer: once
        with_mlps = include_mlp_biases and not self.cfg.attn_only
        total = b_O[:layer].sum(0) + (self.b_out[:layer].sum(0) if with_mlps else 0.0)
        return total + b_O[layer] if mlp_input else total

    # ---- circuits, as transformer-lens defines them -------------------------------------------------------
    def _per_query_head(self, kv: torch.Tensor) -> torch.Tensor:
        """[layer kv_head ...] -> [layer head ...]: query head h reads key/value head h // (n_heads // n_kv_heads)."""
        n_heads = self.blocks[0].attn.n_heads
        return kv if kv.shape[1] == n_heads else kv.repeat_interleave(n_heads // kv.shape[1], dim=1)

    @property
    def OV(self) -> FactoredMatrix:
        """[layer head d_model d_model], mdim d_head: W_V @ W_O per head, transformer-lens's `model.OV`.

        The weights as they are: no biases, and no norm weights, though Gemma 2's write norm (ln1_post) scales what
        a head writes; `analyses.ov_circuit` includes it. A grouped-query key/value head is repeated for each query
        head it serves. transformer-lens's `from_pretrained` folds the norms in first: `probe.process_weights`."""
        return FactoredMatrix(self._per_query_head(self.W_V), self.W_O)

    @property
    def QK(self) -> FactoredMatrix:
        """[layer head d_model d_model], mdim d_head: W_Q @ W_K^T per head, transformer-lens's `model.QK`: the
        bilinear form before the 1/sqrt(d_head) scale, rotary positions and biases. Qwen3's per-head q/k norm
        weights are left out, as transformer-lens's bridge leaves them (`analyses.qk_circuit` includes them)."""
        return FactoredMatrix(self.W_Q, self._per_query_head(self.W_K).mT)

    def all_composition_scores(self, mode: Literal["Q", "K", "V"]) -> torch.Tensor:
        """[layer head layer head]: how much head (l2, h2) reads, through its queries ("Q"), keys ("K") or values
        ("V"), what head (l1, h1) writes: ||OV1 @ R2||_F / (||OV1||_F ||R2||_F) with R2 = QK2, QK2^T or OV2
        (Elhage et al. 2021), transformer-lens's definition on this model's weights as they are. 0 where l2 <= l1,
        which cannot compose, as in transformer-lens. `analyses.composition_scores` gives NaN there, folds the norms
        in first and includes the norm weights of `analyses.ov_circuit`. With gradients on, the graph keeps every
        pair's [head head d_head d_head] product: call it under torch.no_grad() on a large model."""
        if mode not in ("Q", "K", "V"):
            raise ValueError(f"mode={mode!r} is not one of 'Q', 'K', 'V' (queries, keys or values of the later head)")
        writer = self.OV
        reader = writer if mode == "V" else (self.QK if mode == "Q" else self.QK.T)
        # ||U1 S1 V1^T U2 S2 V2^T|| = ||(S1 V1^T)(U2 S2)||: the orthonormal outer factors drop out, leaving d_head-sized
        left, right = writer.collapse_l(), reader.collapse_r()  # [layer head k d_model], [layer head d_model k]
        left_norm, right_norm = left.norm(dim=(-2, -1)), right.norm(dim=(-2, -1))  # [layer head]
        n_layers, n_heads = writer.shape[:2]
        scores = torch.zeros(n_layers, n_heads, n_layers, n_heads, dtype=left.dtype, device=left.device)
        for early in range(n_layers):
            for late in range(early + 1, n_layers):  # a pair of layers at a time: [head head k k] in memory
                product = torch.einsum("hkd,gdj->hgkj", left[early], right[late])
                scores[early, :, late] = product.norm(dim=(-2, -1)) / (left_norm[early][:, None] * right_norm[late])
        return scores

    @property
    def all_head_labels(self) -> "HeadLabels":
        """["L0H0", "L0H1", ...]: every head, layer by layer (the order of a flattened [layer head] tensor)."""
        return HeadLabels(f"L{layer}H{head}" for layer, block in enumerate(self.blocks)
                          for head in range(block.attn.n_heads))

    def tokens_to_residual_directions(self, tokens: Union[str, int, torch.Tensor]) -> torch.Tensor:
        """The unembedding direction W_U[:, token] [d_model] of a token (an id, a 0-d or one-element tensor, or a
        string that is one token), or [... d_model] for a tensor of ids [...], as transformer-lens has it.

        The unembedding as it is: the final norm's weight scales the residual before W_U, so without
        `probe.process_weights` (which folds it in) a direction is not quite what the logit reads."""
        w_u = self.W_U
        if isinstance(tokens, str):
            return w_u[:, self.to_single_token(tokens)]
        if isinstance(tokens, numbers.Integral) and not isinstance(tokens, bool):
            return w_u[:, self._checked_ids(torch.tensor(int(tokens)))]
        if not isinstance(tokens, torch.Tensor):
            hint = "; for a list of ids pass torch.tensor(ids)" if isinstance(tokens, (list, tuple)) else ""
            raise TypeError(f"tokens must be a token id, a string that is one token or a tensor of ids, got "
                            f"{type(tokens).__name__}{hint}")
        ids = self._checked_ids(tokens)
        if ids.numel() == 1:  # [d_model] whatever the tensor's shape, as transformer-lens returns it
            return w_u[:, ids.reshape(())]
        return w_u[:, ids].movedim(0, -1)

    def _checked_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"token ids must be an integer tensor, got {ids.dtype}; use model.to_tokens(text) or "
                            ".long()")
        if ids.numel() == 0:
            raise ValueError("tokens is an empty tensor: give at least one token id")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.cfg.d_vocab:
            raise ValueError(f"token id {low if low < 0 else high} is outside the vocabulary [0, {self.cfg.d_vocab})")
        return ids.to(self.W_U.device)


class HeadLabels(list):
    """A list of head labels that may also be called: `model.all_head_labels` is a property in transformer-lens's
    bridge and a method in its HookedTransformer, and code written for either should run."""

    def __call__(self) -> "HeadLabels":
        return self
