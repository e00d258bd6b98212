"""A sparse mixture of experts in place of a layer's MLP (Mixtral, OLMoE), in transformer-lens 3's layout and names.

The router (`mlp.W_gate`, an nn.Linear as TL names it) scores every expert for each token; the `per_token` experts
with the largest softmax weights run on that token, and their outputs are summed with those weights (plus, in
Qwen2-MoE, a shared expert every token runs, `mlp.shared_expert`, a gated MLP with its points, times a sigmoid gate,
`hook_shared_expert_gate`). The routing points hold every token of the batch in one row each, as TL's do: `hook_expert_weights` [batch*pos experts] (the
softmax over every expert, before the choice; an edit there changes which experts run) and `hook_expert_indices`
[batch*pos per_token]. Each expert's points (`mlp.experts.{e}.hook_gate`, `hook_pre`, `hook_post`) hold only the
rows routed to it, [routed d_mlp]: the tokens that chose it first, then those that chose it second, as TL orders
them.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from probe.activations import ACTIVATIONS
from probe.config import DecoderConfig
from probe.hooks import HookPoint
from probe.mlp import GatedMLP, make_dense_mlp


class Expert(nn.Module):
    """One expert: W_out(act(W_gate x) * W_in x), transformer-lens's MoEGatedMLP (nn.Linear layers under its names)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.W_gate = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)
        self.W_in = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)  # the up projection
        self.W_out = nn.Linear(cfg.d_mlp, cfg.d_model, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.activation]()
        self.hook_gate = HookPoint()  # [routed d_mlp]: the gate's pre-activation
        self.hook_pre = HookPoint()  # [routed d_mlp]: the up projection
        self.hook_post = HookPoint()  # [routed d_mlp]: act(gate) * up, what W_out reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [routed d_model] -> [routed d_model]
        gate, up = self.hook_gate(self.W_gate(x)), self.hook_pre(self.W_in(x))
        return self.W_out(self.hook_post(self.act(gate) * up))


class MoEMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        experts = cfg.experts
        self.per_token, self.renormalize = experts.per_token, experts.renormalize
        self.W_gate = nn.Linear(cfg.d_model, experts.n, bias=cfg.mlp_bias)  # the router
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(experts.n))
        self.hook_expert_weights = HookPoint()  # [batch*pos experts]: the router's softmax, in float32
        self.hook_expert_indices = HookPoint()  # [batch*pos per_token]: the chosen experts, largest weight first
        if experts.shared is not None:  # Qwen2-MoE: a gated MLP every token runs, weighed by a sigmoid gate
            self.shared_expert = GatedMLP(dataclasses.replace(cfg, d_mlp=experts.shared, experts=None))
            self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=cfg.mlp_bias)
            self.hook_shared_expert_gate = HookPoint()  # [batch*pos 1]: the sigmoid the shared expert's output is times

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch pos d_model] -> [batch pos d_model]
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.hook_expert_weights(F.softmax(self.W_gate(tokens), dim=-1, dtype=torch.float32))
        weights, chosen = probs.topk(self.per_token, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        chosen = self.hook_expert_indices(chosen)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            slot, rows = self.routing(chosen, index)
            written = expert(tokens[rows]) * weights[rows, slot, None].to(x.dtype)
            out = out.index_add(0, rows, written)
        if hasattr(self, "shared_expert"):
            gate = self.hook_shared_expert_gate(torch.sigmoid(self.shared_expert_gate(tokens)))
            out = out + gate * self.shared_expert(tokens)
        return out.view(x.shape)

    @staticmethod
    def routing(chosen: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rank, row) of each token row (of batch*pos) that expert `index` runs on, from hook_expert_indices `chosen`,
        in the order its points hold them: the tokens that chose it first, then second, ..., as transformer-lens."""
        return torch.where((chosen == index).T)


def make_mlp(cfg: DecoderConfig) -> nn.Module:
    """A block's MLP: a mixture of experts (cfg.experts), or one MLP."""
    return MoEMLP(cfg) if cfg.experts is not None else make_dense_mlp(cfg)
