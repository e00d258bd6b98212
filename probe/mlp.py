"""The feed-forward sublayer: plain (d_model -> d_mlp -> act -> d_model) or gated (SwiGLU)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from probe.hooks import HookPoint
from probe.config import Activation, DecoderConfig

ACTIVATIONS = {
    Activation.GELU_TANH: lambda: nn.GELU(approximate="tanh"),
    Activation.GELU: lambda: nn.GELU(),
    Activation.RELU: lambda: nn.ReLU(),
    Activation.SILU: lambda: nn.SiLU(),
}


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)  # rows are the FFN "keys"
        self.act = ACTIVATIONS[cfg.activation]()
        self.fc_out = nn.Linear(cfg.d_mlp, cfg.d_model, bias=cfg.mlp_bias)  # columns are the FFN "values"
        self.hook_pre = HookPoint()  # [batch pos d_mlp]
        self.hook_post = HookPoint()  # [batch pos d_mlp]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.hook_pre(self.fc_in(x))
        post = self.hook_post(self.act(pre))
        return self.fc_out(post)

    @property
    def W_in(self) -> torch.Tensor:  # [d_model d_mlp]
        return self.fc_in.weight.T

    @property
    def W_out(self) -> torch.Tensor:  # [d_mlp d_model]
        return self.fc_out.weight.T

    @property
    def b_in(self) -> Optional[torch.Tensor]:  # [d_mlp], None without MLP biases
        return self.fc_in.bias

    @property
    def b_out(self) -> Optional[torch.Tensor]:  # [d_model]
        return self.fc_out.bias


class GatedMLP(MLP):
    """act(gate(x)) * up(x) -> down (SwiGLU with SiLU). `fc_in` is the up projection, `fc_out` the down."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__(cfg)
        self.gate = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)
        self.hook_pre_linear = HookPoint()  # [batch pos d_mlp]: the up projection
        # hook_pre is the gate's pre-activation; hook_post is act(gate) * up, what the down projection reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.hook_pre(self.gate(x))
        pre_linear = self.hook_pre_linear(self.fc_in(x))
        post = self.hook_post(self.act(pre) * pre_linear)
        return self.fc_out(post)

    @property
    def W_gate(self) -> torch.Tensor:  # [d_model d_mlp]
        return self.gate.weight.T


def make_mlp(cfg: DecoderConfig) -> nn.Module:
    return GatedMLP(cfg) if cfg.gated_mlp else MLP(cfg)
