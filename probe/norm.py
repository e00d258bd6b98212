"""Normalisation layers with their scale and normalised input exposed as hook points."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from probe.hooks import HookPoint
from probe.config import DecoderConfig, Norm


class LayerNorm(nn.Module):
    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.eps = eps
        self.w = nn.Parameter(torch.ones(d_model))
        self.b = nn.Parameter(torch.zeros(d_model))
        self.hook_scale = HookPoint()  # [batch pos 1]: sqrt(var + eps), what the centred input is divided by
        self.hook_normalized = HookPoint()  # [batch pos d_model]: centred / scale, before w and b (as TransformerLens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.hook_scale.active or self.hook_normalized.active):
            return F.layer_norm(x, self.w.shape, self.w, self.b, self.eps)  # fused: nothing to observe
        # in float32 whatever the model's dtype, as the fused kernel computes: float16 squares overflow
        # past 256, so a cached scale would otherwise turn a float16 model's output into garbage. The
        # hooks still see (and may replace) tensors in the model's dtype.
        x32 = x.float()
        centred = x32 - x32.mean(-1, keepdim=True)
        scale = self.hook_scale((centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt().to(x.dtype))
        normalized = self.hook_normalized((centred / scale.float()).to(x.dtype))
        return (normalized.float() * self.w.float() + self.b.float()).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.eps = eps
        self.w = nn.Parameter(torch.ones(d_model))
        self.hook_scale = HookPoint()  # [batch pos 1] float32: sqrt(mean(x^2) + eps)
        self.hook_normalized = HookPoint()  # [batch pos d_model] float32: x / scale, before w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in float32 whatever the model's dtype, as Llama does: low-precision squares overflow or lose digits
        x32 = x.float()
        scale = self.hook_scale((x32.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.w * self.hook_normalized(x32 / scale).to(x.dtype)


class RMSNormFloat32(RMSNorm):
    """Gemma's RMSNorm: w multiplies in float32 and the product is rounded once (Llama rounds first), and w itself
    stays float32 in a bfloat16 model: Gemma stores w - 1, and 1 + w rounded to 8 bits would lose its digits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        scale = self.hook_scale((x32.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return (self.hook_normalized(x32 / scale) * self.w.float()).to(x.dtype)

    def _apply(self, fn, recurse=True):
        exact = self.w.detach().float()
        super()._apply(fn, recurse)
        self.w.data = exact.to(self.w.device)  # follow a move, not a cast
        return self


# the norms whose hook_scale / hook_normalized hold float32 whatever the model's dtype (they compute in it)
FLOAT32_HOOK_NORMS = frozenset({Norm.RMS, Norm.RMS_FLOAT32})


def make_norm(cfg: DecoderConfig, dim: Optional[int] = None) -> nn.Module:
    """The config's norm over the last `dim` (default d_model) dimensions."""
    return {Norm.LAYER: LayerNorm, Norm.RMS: RMSNorm, Norm.RMS_FLOAT32: RMSNormFloat32}[cfg.norm](dim or cfg.d_model, cfg.eps)
