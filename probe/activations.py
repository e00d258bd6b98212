"""The MLP non-linearities, by the config's Activation: what the dense MLPs (probe.mlp) and the experts (probe.moe)
apply."""
from __future__ import annotations

import torch
from torch import nn

from probe.config import Activation


class SoLU(nn.Module):
    """x * softmax(x) over d_mlp (Elhage et al. 2022): the largest pre-activations pass, the rest are suppressed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.softmax(x, dim=-1)


ACTIVATIONS = {
    Activation.GELU_TANH: lambda: nn.GELU(approximate="tanh"),
    Activation.GELU: lambda: nn.GELU(),
    Activation.RELU: lambda: nn.ReLU(),
    Activation.SILU: lambda: nn.SiLU(),
    Activation.SOLU: SoLU,
    Activation.SOLU_LN: SoLU,  # its LayerNorm is the MLP's own module (NormedMLP.ln)
}
