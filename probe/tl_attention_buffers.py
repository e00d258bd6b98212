"""transformer-lens 3's attention buffers, read off probe's attention: `attn.attn_type`, `attn.mask`,
`attn.rotary_sin`, `attn.rotary_cos`.

probe computes which keys a query sees, and the rotary angles, from the config at each forward, and keeps no such
buffers. These give them in TL's shapes for code that reads them, or that shares one tensor among the layers to
save memory (circuit-tracer's ReplacementModel points every layer's at the first layer's): assigning the value a
layer has already is taken, anything else refused, since probe would not read it."""
from __future__ import annotations

from typing import Optional

import torch


class TLAttentionBuffers:
    """Mixed into Attention, which sets `n_ctx`, `window` (None: every earlier key) and `rotary`."""

    n_ctx: int
    window: Optional[int]

    @property
    def attn_type(self) -> str:
        return "global" if self.window is None else "local"

    @property
    def mask(self) -> torch.Tensor:
        """Empty, as transformer-lens 3.9's (it masks at each forward, as probe does, and keeps the buffer for its
        state dict: what probe's state_dict() writes too)."""
        return torch.empty((0, 0), dtype=torch.bool, device=self.qkv.weight.device)

    @mask.setter
    def mask(self, value: torch.Tensor) -> None:
        self._take_if_unchanged("mask", value, "hook its attn_scores (masked_fill with -inf) to hide keys")

    @property
    def rotary_sin(self) -> torch.Tensor:  # [pos rotary_dim], laid out as the model pairs dimensions (as TL's)
        return (self._angles().sin() * self._amplitude()).to(self.qkv.weight.dtype)

    @rotary_sin.setter
    def rotary_sin(self, value: torch.Tensor) -> None:
        self._take_if_unchanged("rotary_sin", value, "its positions come from the config (rotary_base, rotary_dim)")

    @property
    def rotary_cos(self) -> torch.Tensor:
        return (self._angles().cos() * self._amplitude()).to(self.qkv.weight.dtype)

    @rotary_cos.setter
    def rotary_cos(self, value: torch.Tensor) -> None:
        self._take_if_unchanged("rotary_cos", value, "its positions come from the config (rotary_base, rotary_dim)")

    def _angles(self) -> torch.Tensor:
        if self.rotary is None:
            raise AttributeError("rotary_sin / rotary_cos: this model's positions are not rotary")
        return self.rotary.angles(self._positions())

    def _amplitude(self):
        return self.rotary.amplitude_at(self._positions())

    def _positions(self) -> torch.Tensor:  # every position: a long-context rope's tables are those of a full context
        return torch.arange(self.n_ctx, device=self.rotary.inv_freq.device)

    def _take_if_unchanged(self, name: str, value: torch.Tensor, instead: str) -> None:
        current = getattr(self, name)
        if not (isinstance(value, torch.Tensor) and value.shape == current.shape
                and torch.equal(value.to(current.device, current.dtype), current)):
            raise ValueError(f"attn.{name}: probe computes it from the config at every forward and would not read "
                             f"another value; to change attention, {instead}")
