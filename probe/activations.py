"""The MLP non-linearities, by the config's Activation: what the dense MLPs (probe.mlp) and the experts (probe.moe)
apply."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from probe.config import Activation


class SoLU(nn.Module):
    """x * softmax(x) over d_mlp (Elhage et al. 2022): the largest pre-activations pass, the rest are suppressed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.softmax(x, dim=-1)


class XIELU(nn.Module):
    """xIELU (Huang et al. 2024, arXiv 2411.13010): a learned quadratic above 0, a learned ELU-like curve below.

    alpha_p and alpha_n are stored as softplus inverses (the slopes are softplus(alpha_p) and beta + softplus(alpha_n),
    so both stay positive while trained), beta and eps as buffers: transformers' and transformer-lens's parameters,
    under the names both use, initialised as both do."""

    def __init__(self, alpha_p: float = 0.8, alpha_n: float = 0.8, beta: float = 0.5, eps: float = -1e-6):
        super().__init__()
        # computed in float32, as transformers and transformer-lens do, so a fresh model holds their very values
        self.alpha_p = nn.Parameter(torch.tensor(alpha_p, dtype=torch.float32).expm1().log())
        self.alpha_n = nn.Parameter(torch.tensor(alpha_n - beta, dtype=torch.float32).expm1().log())
        self.register_buffer("beta", torch.tensor(beta))
        self.register_buffer("eps", torch.tensor(eps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p, alpha_n = F.softplus(self.alpha_p), self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n + self.beta * x)


class ReLUSquared(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).square()


ACTIVATIONS = {
    Activation.GELU_TANH: lambda: nn.GELU(approximate="tanh"),
    Activation.GELU: lambda: nn.GELU(),
    Activation.RELU: lambda: nn.ReLU(),
    Activation.SILU: lambda: nn.SiLU(),
    Activation.SOLU: SoLU,
    Activation.SOLU_LN: SoLU,  # its LayerNorm is the MLP's own module (NormedMLP.ln)
    Activation.XIELU: XIELU,
    Activation.RELU2: ReLUSquared,
}
