"""A mixture of attention heads in place of each layer's attention (DecoderConfig.mixture_of_attention: JetMoE's MoA,
Shen et al. 2024): a router picks `per_token` of `n` experts for each token; each expert has its own query and output
projections for cfg.n_kv_heads heads, and every expert shares one key and value projection. The model's n_heads are
the chosen slots' heads, per_token * n_kv_heads of them (probe.mixture_of_attention)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, kw_only=True)
class MixtureOfAttention:
    n: int  # attention experts (JetMoE's num_local_experts)
    per_token: int  # experts each token runs (num_experts_per_tok)

    def __post_init__(self) -> None:
        for name in ("n", "per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MixtureOfAttention.{name} must be a positive int, got {value!r}")
        if self.per_token > self.n:
            raise ValueError(f"MixtureOfAttention(per_token={self.per_token}) picks more experts than there are "
                             f"(n={self.n})")

    @classmethod
    def of(cls, value, cfg) -> Optional["MixtureOfAttention"]:
        """DecoderConfig.mixture_of_attention as given (a MixtureOfAttention, its fields as a dict, or None), checked
        against `cfg`."""
        spec = cls(**value) if isinstance(value, dict) else value
        if spec is None:
            return None
        if not isinstance(spec, cls):
            raise ValueError(f"mixture_of_attention must be a MixtureOfAttention (or its fields as a dict), got {value!r}")
        if cfg.n_heads != spec.per_token * cfg.n_kv_heads:
            raise ValueError(f"a mixture of attention heads has per_token * n_kv_heads heads (each chosen expert's "
                             f"queries over the shared keys): set n_heads={spec.per_token * cfg.n_kv_heads}, not "
                             f"{cfg.n_heads}")
        others = {"positions": cfg.positions.value != "rotary", "qkv_bias": cfg.qkv_bias,
                  "qk_norm": cfg.qk_norm, "value_norm": cfg.value_norm, "attn_output_gate": cfg.attn_output_gate,
                  "attn_sinks": cfg.attn_sinks, "attn_softcap": cfg.attn_softcap is not None,
                  "latent_attention": cfg.latent_attention is not None, "heads_per_layer": cfg.heads_per_layer is not None,
                  "chunked_attention": cfg.chunked_attention is not None, "shared_kv": cfg.shared_kv is not None,
                  "bidirectional": cfg.bidirectional, "clip_qkv": cfg.clip_qkv is not None,
                  "linear_attention": cfg.linear_attention is not None, "state_space": cfg.state_space is not None,
                  "short_conv": cfg.short_conv is not None, "attn_only": cfg.attn_only,
                  "sliding_window": cfg.sliding_window is not None}
        names = [name for name, bad in others.items() if bad]
        if names:
            raise ValueError(f"JetMoE's mixture of attention heads is causal, rotary, full-width attention in "
                             f"every layer with bias-free projections and a bias on the output alone; these settings "
                             f"differ: {', '.join(names)}")
        return spec
