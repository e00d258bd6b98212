"""Soft capping (Gemma 2): x -> cap * tanh(x / cap), near the identity for |x| << cap, never past +-cap."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class SoftCap(nn.Module):
    def __init__(self, cap: float):
        super().__init__()
        self.cap = cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / self.cap) * self.cap

    def extra_repr(self) -> str:
        return f"cap={self.cap}"


def make_softcap(cap: Optional[float]) -> nn.Module:
    """A SoftCap, or the identity when the config has no cap."""
    return nn.Identity() if cap is None else SoftCap(cap)
