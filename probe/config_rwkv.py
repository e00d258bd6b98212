"""Rwkv: DecoderConfig's choice of RWKV-4's layers (Peng et al. 2023, "RWKV: Reinventing RNNs for the Transformer Era"),
every layer a time mix in place of attention and a channel mix in place of the MLP (probe.rwkv)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Rwkv:
    """RWKV-4's layers in every layer: a time mix of `d_attention` channels (the file's attention_hidden_size; d_model
    in every release) and a channel mix of cfg.d_mlp (its intermediate_size), in pre-norm LayerNorm blocks after a
    LayerNorm of the embedding (cfg.embed_norm: the file's blocks.0.pre_ln)."""

    d_attention: int

    def __post_init__(self) -> None:
        if not isinstance(self.d_attention, int) or isinstance(self.d_attention, bool) or self.d_attention <= 0:
            raise ValueError(f"Rwkv.d_attention must be a positive int (the time mix's width), got "
                             f"{self.d_attention!r}")

    @classmethod
    def of(cls, value, cfg) -> "Optional[Rwkv]":
        """DecoderConfig.rwkv as given (an Rwkv, its fields as a dict, or None), checked against `cfg`."""
        spec = cls(**value) if isinstance(value, dict) else value
        if spec is None:
            return None
        if not isinstance(spec, cls):
            raise ValueError(f"rwkv must be an Rwkv (or its fields as a dict), got {value!r}")
        others = {"norm": cfg.norm.value != "layer", "norm_placement": cfg.norm_placement.value != "pre",
                  "embed_norm": cfg.embed_norm is not True, "norm_weights": not cfg.norm_weights,
                  "attn_only": cfg.attn_only, "gated_mlp": cfg.gated_mlp, "mlp_bias": cfg.mlp_bias,
                  "bidirectional": cfg.bidirectional, "heads_per_layer": cfg.heads_per_layer is not None}
        # every other choice of mixer or MLP
        others.update({name: getattr(cfg, name, None) is not None for name in (
            "experts", "linear_attention", "state_space", "latent_attention", "short_conv", "sublayers",
            "parallel_state_space", "shared_blocks", "rg_lru")})
        names = [name for name, bad in others.items() if bad]
        if names:
            raise ValueError(f"RWKV layers are built in pre-norm blocks of learned LayerNorms after a normed embedding "
                             f"(embed_norm=True), each with a time mix and a channel mix and nothing else; these "
                             f"settings differ: {', '.join(names)} (set norm='layer', embed_norm=True, mlp_bias=False, "
                             "and the others to their defaults)")
        return spec
