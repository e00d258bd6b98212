"""Griffin's recurrent blocks (RecurrentGemma; De et al. 2024, "Griffin"), the config choice that puts them in place of
attention in some layers: frozen and validated as probe.config_mixers' choices."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RGLRU:
    """Griffin's recurrent blocks in place of attention in some layers (RecurrentGemma's "recurrent" block_types):
    `layers` says which (the others keep local attention). Two projections of the residual to `width` channels (the
    file's lru_width): one passes GELU (the gate branch), the other a causal depthwise convolution over `conv_kernel`
    positions (conv1d_width) and then the real-gated linear recurrent unit, whose input and recurrence gates are
    block-diagonal, `n_blocks` blocks of width // n_blocks (the file's num_attention_heads). Every projection, the
    convolution and both gates have biases, as transformers builds them."""

    layers: tuple[bool, ...]
    width: int
    n_blocks: int
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        for name in ("width", "n_blocks", "conv_kernel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"RGLRU.{name} must be a positive int, got {value!r}")
        if self.width % self.n_blocks:
            raise ValueError(f"RGLRU(width={self.width}) must be a multiple of n_blocks={self.n_blocks}: the gates' "
                             "blocks split the channels evenly")
        layers = tuple(self.layers)
        if not all(isinstance(x, bool) for x in layers) or not any(layers):
            raise ValueError(f"RGLRU.layers={self.layers!r} must say for each layer True (a recurrent block) or False "
                             "(attention), with at least one True (else leave rg_lru None)")
        object.__setattr__(self, "layers", layers)

    @property
    def block_width(self) -> int:
        """Each gate block's width: the channels one block-diagonal block reads and writes."""
        return self.width // self.n_blocks

    @classmethod
    def of(cls, value, cfg) -> "Optional[RGLRU]":
        """DecoderConfig.rg_lru as given (an RGLRU, its fields as a dict, or None), checked against `cfg`."""
        spec = cls(**value) if isinstance(value, dict) else value
        if spec is None:
            return None
        if not isinstance(spec, cls):
            raise ValueError(f"rg_lru must be an RGLRU (or its fields as a dict), got {value!r}")
        if len(spec.layers) != cfg.n_layers:
            raise ValueError(f"rg_lru.layers gives {len(spec.layers)} layers; the model has n_layers={cfg.n_layers}: "
                             "give each layer True or False")
        others = {"linear_attention": cfg.linear_attention is not None, "state_space": cfg.state_space is not None,
                  "short_conv": cfg.short_conv is not None, "latent_attention": cfg.latent_attention is not None,
                  "parallel_state_space": cfg.parallel_state_space is not None,
                  "norm_placement": cfg.norm_placement.value != "pre", "attn_only": cfg.attn_only,
                  "bidirectional": cfg.bidirectional, "heads_per_layer": cfg.heads_per_layer is not None,
                  "sublayers": cfg.sublayers is not None}
        names = [name for name, bad in others.items() if bad]
        if names:
            raise ValueError(f"Griffin's recurrent blocks are built in causal pre-norm blocks with an MLP, beside "
                             f"attention layers with every head and no other recurrent mixer; these settings differ: "
                             f"{', '.join(names)} (leave them at their defaults)")
        return spec


def bfloat16_rounded(x: float) -> float:
    """`x` rounded to the nearest bfloat16 (ties to even), as torch rounds it: RecurrentGemma's embedding scale is a
    bfloat16 buffer whatever the weights' dtype, so sqrt(2560) multiplies as 50.5."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]
