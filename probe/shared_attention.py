"""Attention layers that project fewer of q, k and v (Gemma 4): values that are the keys' projection
(attention_k_eq_v), and layers that reuse an earlier layer's keys and values (num_kv_shared_layers), projecting
queries alone. Both keep Attention's hook points for what they compute and drop the rest, as the bridge has them."""
from __future__ import annotations

from typing import Optional

import torch
from einops import einsum

from probe.attention import Attention
from probe.llama4_attention import Llama4Attention
from probe.mixture_of_attention import MixtureOfAttention
from probe.config import DecoderConfig
from probe.kv_cache import LayerKV
from probe.tl_weights import bias_view, weight_view


class KeyValueAttention(Attention):
    """Values are the key projection's output (before k's norm and rotary), each then normalised on its own path:
    one projection, W_K, where other layers have W_K and W_V. hook_v holds the values as they leave the projection
    (the keys' hook_k tensor: an edit made there in place reaches both; a tensor returned there reaches the keys)."""

    projects = (True, False)

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__(cfg, layer)
        del self.v  # no value projection, so no input of its own (the bridge has none either)

    def project(self, x):
        if isinstance(x, torch.Tensor):
            q, k, _ = super().project(x)
            return q, k, k
        return super().project(x)  # each head's own inputs: W_V below is W_K, applied to the values' inputs

    @weight_view
    def W_V(self) -> torch.Tensor:  # [kv_head d_model d_head]: the keys' projection
        return self.W_K

    @bias_view(lambda attn: (attn.n_kv_heads, attn.d_head))
    def b_V(self) -> torch.Tensor:
        return self._qkv_bias(1)


def keys_elsewhere(name: str) -> property:
    """A weight view a layer without keys and values lacks: reading it raises AttributeError (which SharedKVAttention's
    __getattr__ then words)."""
    def view(attn):
        raise AttributeError(name)
    return property(view)


class SharedKVAttention(Attention):
    """Queries of its own over the keys and values of an earlier layer, `source`, from this pass and the cache: no
    k or v projection, norms or hook points (hook_q, its norm and rotation, the scores, pattern, z and result
    remain). The model hands the block the source's LayerKV as `past` (probe.kv_cache.layer_caches)."""

    projects = (False, False)

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__(cfg, layer)
        self.source = cfg.layer_kv_source(layer)
        for name in ("k", "v", "hook_k", "hook_v", "k_norm", "hook_k_normed", "v_norm", "hook_v_normed", "hook_rot_k"):
            # (what the bridge has none of on these layers)
            if hasattr(self, name):
                delattr(self, name)

    def forward(self, x, positions=None, allowed=None, past: Optional[LayerKV] = None, qk_pos=None) -> torch.Tensor:
        q = self.hook_q(self.project_queries(x))
        q = self.hook_q_normed(self.q_norm(q))
        if self.rotary is not None:
            q = self.hook_rot_q(self.rotary(q, positions))
        if past is None or past.latest is None:
            raise ValueError(f"this layer attends over layer {self.source}'s keys and values (shared_kv), which this "
                             f"pass did not compute: run from a layer at or before {self.source} (start_at_layer), "
                             "or call the model rather than this block alone")
        k, v, key_positions = past.latest
        return self.attend(x, q, k, v, positions, key_positions, allowed)

    def project_queries(self, x) -> torch.Tensor:
        """q [batch pos head d_head] from the layer's input, or from each head's own (PerHeadInputs)."""
        if isinstance(x, torch.Tensor):
            return super().project(x)[0]
        q = einsum(x.q, self.W_Q, "batch pos head d_model, head d_model d_head -> batch pos head d_head")
        return q if self.qkv.bias is None else q + self.qkv.bias.view(-1, self.d_head)

    # the base class's views of the (empty) key and value rows, replaced by an error naming the source layer (raised
    # again by __getattr__, which nn.Module calls when a property raises AttributeError)
    W_K, W_V, b_K, b_V = (keys_elsewhere(name) for name in ("W_K", "W_V", "b_K", "b_V"))

    def __getattr__(self, name: str):
        if name in ("W_K", "W_V", "b_K", "b_V"):
            raise AttributeError(f"{name}: this layer computes no keys or values; it attends over layer "
                                 f"{self.source}'s (shared_kv): read model.blocks[{self.source}].attn.{name}")
        return super().__getattr__(name)


def attention_class(cfg: DecoderConfig, layer: int) -> type:
    """The Attention (sub)class of `layer`: JetMoE's mixture of attention heads, one that reuses an earlier layer's
    keys and values, Llama 4's, one whose values are its keys' projection, or the ordinary one."""
    if cfg.mixture_of_attention is not None:  # JetMoE's
        return MixtureOfAttention
    if cfg.layer_kv_source(layer) is not None:
        return SharedKVAttention
    if cfg.chunked_attention is not None:  # Llama 4's
        return Llama4Attention
    return KeyValueAttention if cfg.layer_values_from_keys(layer) else Attention
