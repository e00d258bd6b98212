"""The feed-forward sublayer: d_model -> d_mlp -> activation -> d_model."""
from __future__ import annotations

import torch
from torch import nn

from hooks import HookPoint
from probe.config import Activation, DecoderConfig

ACTIVATIONS = {
    Activation.GELU_TANH: lambda: nn.GELU(approximate="tanh"),
    Activation.GELU: lambda: nn.GELU(),
    Activation.RELU: lambda: nn.ReLU(),
}


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_mlp)  # rows are the FFN "keys"
        self.act = ACTIVATIONS[cfg.activation]()
        self.fc_out = nn.Linear(cfg.d_mlp, cfg.d_model)  # columns are the FFN "values"
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
