"""Gemma 4 26B-A4B's experts, which run beside each layer's dense MLP rather than in its place: the router reads the
residual itself (normalised without a weight, times a learned scale and d_model^-0.5), the experts read it through a
norm of their own (pre_feedforward_layernorm_2), and each chosen expert's weight is its renormalised softmax score
times a learned per-expert scale. The block normalises the two outputs apart and adds them (probe.per_layer_block)."""
from __future__ import annotations

import torch
from torch import nn

from probe.config import DecoderConfig
from probe.moe import MoEMLP
from probe.norm import NORMS


class ExpertsBeside(MoEMLP):
    """MoEMLP's experts and routing points (hook_expert_weights: the softmax over every expert, [batch*pos
    experts]; hook_expert_indices), routed from `resid` rather than from what the experts read."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__(cfg)
        self.router_norm = NORMS[cfg.norm](cfg.d_model, cfg.eps, learned=False)
        self.router_scale = nn.Parameter(torch.ones(cfg.d_model))  # the router's `scale`
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.experts.n))
        self.d_model = cfg.d_model

    def forward(self, x: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum [batch pos d_model] on `x` (their norm's output), routed by `resid`."""
        tokens = resid.reshape(-1, resid.shape[-1])
        logits = self.W_gate(self.router_norm(tokens) * self.router_scale * self.d_model**-0.5)
        weights, chosen = self.route(logits)
        weights = weights * self.per_expert_scale[chosen]
        return self.weighted_experts(x.reshape(-1, x.shape[-1]), weights, chosen).view(x.shape)
