"""A sparse mixture of experts in place of a layer's MLP (Mixtral, OLMoE, GPT-OSS), in transformer-lens 3's layout and
names.

The router (`mlp.W_gate`, an nn.Linear as TL names it) scores every expert for each token; the `per_token` experts
with the largest softmax weights run on that token, and their outputs are summed with those weights (plus, in
Qwen2-MoE, a shared expert every token runs, `mlp.shared_expert`, a gated MLP with its points, times a sigmoid gate,
`hook_shared_expert_gate`). The routing points hold every token of the batch in one row each, as TL's do: `hook_expert_weights` [batch*pos experts] (the
softmax over every expert, before the choice, so an edit there changes which experts run; GPT-OSS chooses by logit
first and holds the softmax over the chosen ones, zeros elsewhere) and `hook_expert_indices`
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
from probe.config_choices import ClampedSwiGLU
from probe.hooks import HookPoint
from probe.mlp import GatedMLP, make_dense_mlp


class GLU(nn.Module):
    """act(gate) * up."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.act = act

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate) * up


class ClampedGLU(nn.Module):
    """GPT-OSS's: the gate clamped above and the up projection both ways at `limit`, then (up + 1) * g * sigmoid(alpha
    * g) (the clamps bound what a few huge pre-activations can write)."""

    def __init__(self, spec: ClampedSwiGLU):
        super().__init__()
        self.alpha, self.limit = spec.alpha, spec.limit

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


class Expert(nn.Module):
    """One expert: W_out(glu(W_gate x, W_in x)), transformer-lens's MoEGatedMLP (nn.Linear layers under its names; with
    GPT-OSS's clamped GLU, its GptOssExpert)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        # W_in is the up projection; built and registered in TL's order, which a HookedTransformerConfig model's
        # draws follow
        for name, shape in expert_projections(cfg):
            setattr(self, name, nn.Linear(*shape, bias=cfg.mlp_bias))
        clamped = cfg.experts.clamped_glu
        self.glu = GLU(ACTIVATIONS[cfg.activation]()) if clamped is None else ClampedGLU(clamped)
        self.hook_gate = HookPoint()  # [routed d_mlp]: the gate's pre-activation
        self.hook_pre = HookPoint()  # [routed d_mlp]: the up projection
        self.hook_post = HookPoint()  # [routed d_mlp]: glu(gate, up), what W_out reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [routed d_model] -> [routed d_model]
        gate, up = self.hook_gate(self.W_gate(x)), self.hook_pre(self.W_in(x))
        return self.W_out(self.hook_post(self.glu(gate, up)))


class MoEMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        experts = cfg.experts
        self.per_token, self.renormalize = experts.per_token, experts.renormalize
        self.route = self._softmax_then_choose if experts.softmax_over == "all" else self._choose_then_softmax
        # (the experts registered before the router, as TL registers them: HookedTransformerConfig models draw their
        # weights in that order)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(experts.n))
        self.W_gate = nn.Linear(cfg.d_model, experts.n, bias=cfg.mlp_bias)  # the router
        # [batch*pos experts]: the router's softmax, in float32 (softmax_over="chosen": the chosen experts' weights, 0
        # for the others)
        self.hook_expert_weights = HookPoint()
        self.hook_expert_indices = HookPoint()  # [batch*pos per_token]: the chosen experts, largest weight first
        if experts.shared is not None:  # Qwen2-MoE: a gated MLP every token runs, weighed by a sigmoid gate
            self.shared_expert = GatedMLP(dataclasses.replace(cfg, d_mlp=experts.shared, experts=None))
            self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=cfg.mlp_bias)
            self.hook_shared_expert_gate = HookPoint()  # [batch*pos 1]: the sigmoid the shared expert's output is times

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch pos d_model] -> [batch pos d_model]
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(self.W_gate(tokens))
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            slot, rows = self.routing(chosen, index)
            written = expert(tokens[rows]) * weights[rows, slot, None].to(x.dtype)
            out = out.index_add(0, rows, written)
        if hasattr(self, "shared_expert"):
            gate = self.hook_shared_expert_gate(torch.sigmoid(self.shared_expert_gate(tokens)))
            out = out + gate * self.shared_expert(tokens)
        return out.view(x.shape)

    def _softmax_then_choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, chosen) [batch*pos per_token]: the softmax over every expert, then its largest (Mixtral, OLMoE);
        an edit at hook_expert_weights changes which experts run."""
        probs = self.hook_expert_weights(F.softmax(logits, dim=-1, dtype=torch.float32))
        weights, chosen = probs.topk(self.per_token, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, self.hook_expert_indices(chosen)

    def _choose_then_softmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The largest logits chosen, then the softmax over them (GPT-OSS), as transformer-lens's GptOssMoE: the
        weights read at the (hooked) chosen experts from the (hooked) weights."""
        top, chosen = logits.topk(self.per_token, dim=-1)
        probs = torch.zeros_like(logits, dtype=torch.float32).scatter(1, chosen, F.softmax(top, dim=-1, dtype=torch.float32))
        probs = self.hook_expert_weights(probs)
        chosen = self.hook_expert_indices(chosen)
        return probs.gather(1, chosen), chosen

    @staticmethod
    def routing(chosen: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rank, row) of each token row (of batch*pos) that expert `index` runs on, from hook_expert_indices `chosen`,
        in the order its points hold them: the tokens that chose it first, then second, ..., as transformer-lens."""
        return torch.where((chosen == index).T)


def expert_projections(cfg: DecoderConfig) -> list[tuple[str, tuple[int, int]]]:
    """(name, (in, out)) of an expert's projections in the order transformer-lens builds them: W_in, W_out, W_gate
    (its MoEGatedMLP), or W_gate, W_in, W_out (its GptOssExpert)."""
    d, m = cfg.d_model, cfg.d_mlp
    shapes = {"W_gate": (d, m), "W_in": (d, m), "W_out": (m, d)}
    order = ("W_in", "W_out", "W_gate") if cfg.experts.clamped_glu is None else ("W_gate", "W_in", "W_out")
    return [(name, shapes[name]) for name in order]


def draw_as_transformer_lens_builds(cfg: DecoderConfig) -> None:
    """Draw from torch's generator what building transformer-lens's experts draws (each nn.Linear initialises itself
    as it is made: the experts, then the router, layer by layer), so a model from HookedTransformerConfig leaves the
    generator where TL's leaves it. Nothing for a model without experts (TL's other modules start empty)."""
    if cfg.experts is None:
        return
    linears = [shape for _, shape in expert_projections(cfg)] * cfg.experts.n + [(cfg.d_model, cfg.experts.n)]
    dtype = None if cfg.experts.clamped_glu is None else cfg.dtype  # (only TL's GPT-OSS layers take the config's)
    for _ in range(cfg.n_layers):
        for d_in, d_out in linears:
            torch.empty(d_out, d_in, dtype=dtype).uniform_()
            if cfg.mlp_bias:
                torch.empty(d_out, dtype=dtype).uniform_()


def make_mlp(cfg: DecoderConfig) -> nn.Module:
    """A block's MLP: a mixture of experts (cfg.experts), or one MLP."""
    return MoEMLP(cfg) if cfg.experts is not None else make_dense_mlp(cfg)
