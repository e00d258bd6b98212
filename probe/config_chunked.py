"""Llama 4's attention choices (DecoderConfig.chunked_attention): chunked rope layers, a weightless q/k norm after
their rotation, and temperature-tuned queries in the layers without positions (NoPE). probe.llama4_attention builds
the layers; probe.inputs masks the chunks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Chunk:
    """The mask key of a chunked layer (probe.blocks.mask_keys): a query sees the earlier keys of its own chunk of
    `size` positions, the chunks counted from the first real token (transformers counts them past the left padding
    too), where another layer's key is its sliding window (an int, or None for every earlier key)."""

    size: int


@dataclass(frozen=True)
class ChunkedAttention:
    """Llama 4's attention (transformers' attention_chunk_size, use_qk_norm, attn_temperature_tuning).

    `layers` says which layers attend in chunks (transformers' layer_types "chunked_attention": the rope layers);
    there a query sees only the keys of its own chunk of `size` positions (positions 0..size-1, size..2 size-1, ...),
    the others every earlier key. `qk_norm`: each head's q and k in the rotary layers divided by their RMS over d_head
    after the rotation (eps: the model's), with no weight (transformers' Llama4TextL2Norm). `floor_scale`: the queries
    of the layers without positions times 1 + attn_scale * log(1 + floor((pos + 1) / floor_scale)) at position pos
    (counted in real tokens, as the chunks are); None: no tuning (attn_temperature_tuning false)."""

    size: Optional[int]
    layers: tuple[bool, ...]
    qk_norm: bool = False
    floor_scale: Optional[int] = None
    attn_scale: float = 0.1

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        if not all(isinstance(x, bool) for x in layers):
            raise ValueError(f"ChunkedAttention.layers={self.layers!r} must give each layer True (chunked) or False")
        if any(layers) and not _positive_int(self.size):
            raise ValueError(f"ChunkedAttention.size must be a positive int where some layer is chunked, got "
                             f"{self.size!r}")
        if self.floor_scale is not None and not _positive_int(self.floor_scale):
            raise ValueError(f"ChunkedAttention.floor_scale must be a positive int or None, got {self.floor_scale!r}")
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"ChunkedAttention.qk_norm must be a bool, got {self.qk_norm!r}")
        if not isinstance(self.attn_scale, (int, float)) or isinstance(self.attn_scale, bool):
            raise ValueError(f"ChunkedAttention.attn_scale must be a number, got {self.attn_scale!r}")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "size", self.size if any(layers) else None)  # one spelling of "no chunks"

    def mask_key(self, layer: int) -> Optional[Chunk]:
        """`layer`'s chunk (the key of its mask), or None where it sees every earlier key."""
        return Chunk(self.size) if self.layers[layer] else None

    @classmethod
    def of(cls, value, cfg) -> "Optional[ChunkedAttention]":
        """DecoderConfig.chunked_attention as given (a ChunkedAttention, its fields as a dict, or None), checked
        against `cfg`."""
        spec = cls(**value) if isinstance(value, dict) else value
        if spec is None:
            return None
        if not isinstance(spec, cls):
            raise ValueError(f"chunked_attention must be a ChunkedAttention (or its fields as a dict), got {value!r}")
        if len(spec.layers) != cfg.n_layers:
            raise ValueError(f"chunked_attention.layers gives {len(spec.layers)} layers; the model has n_layers="
                             f"{cfg.n_layers}: give each layer True or False")
        others = {"positions": cfg.positions.value != "rotary", "sliding_window": cfg.sliding_window is not None,
                  "qk_norm": cfg.qk_norm, "bidirectional": cfg.bidirectional,
                  "latent_attention": cfg.latent_attention is not None, "global_layers": cfg.global_layers is not None,
                  "shared_kv": cfg.shared_kv is not None}
        names = [name for name, bad in others.items() if bad]
        if names:
            raise ValueError(f"Llama 4's chunked attention is built on rotary, causal, full-width heads with its own "
                             f"weightless q/k norm and no sliding window; these settings differ: {', '.join(names)}")
        return spec


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
