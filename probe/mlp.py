"""The feed-forward sublayer: plain (d_model -> d_mlp -> act -> d_model), gated (SwiGLU), normed (SoLU, then a
LayerNorm over d_mlp, before W_out; BitNet's gated one, then an RMSNorm); a mixture of gated experts is probe.moe's."""
from __future__ import annotations

import torch
from torch import nn

from probe.activations import ACTIVATIONS
from probe.hooks import HookPoint
from probe.config import DecoderConfig
from probe.norm import LayerNorm, RMSNorm
from probe.tl_weights import WritableWeights, bias_view, weight_view


class MLP(WritableWeights, nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)  # rows are the FFN "keys"
        self.act_fn = ACTIVATIONS[cfg.activation]()  # TL's name (xIELU's parameters live in it)
        self.fc_out = nn.Linear(cfg.d_mlp, cfg.d_model, bias=cfg.mlp_bias)  # columns are the FFN "values"
        self.hook_pre = HookPoint()  # [batch pos d_mlp]
        self.hook_post = HookPoint()  # [batch pos d_mlp]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.hook_pre(self.fc_in(x))
        post = self.hook_post(self.act_fn(pre))
        return self.fc_out(post)

    @weight_view
    def W_in(self) -> torch.Tensor:  # [d_model d_mlp]
        return self.fc_in.weight.T

    @weight_view
    def W_out(self) -> torch.Tensor:  # [d_mlp d_model]
        return self.fc_out.weight.T

    @bias_view(lambda mlp: mlp.fc_in.weight.shape[:1])
    def b_in(self) -> torch.Tensor:  # [d_mlp], zeros without MLP biases (fc_in.bias is None)
        return self.fc_in.bias

    @bias_view(lambda mlp: mlp.fc_out.weight.shape[:1])
    def b_out(self) -> torch.Tensor:  # [d_model]
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
        post = self.hook_post(self.act_fn(pre) * pre_linear)
        return self.fc_out(post)

    @weight_view
    def W_gate(self) -> torch.Tensor:  # [d_model d_mlp]
        return self.gate.weight.T


class NormedMLP(MLP):
    """act, then a LayerNorm over d_mlp, then W_out (SoLU's MLP: transformer-lens's act_fn="solu_ln").

    hook_mid is act(hook_pre); hook_post, what W_out reads, is ln(hook_mid), so a neuron's write is still
    hook_post * its row of W_out, but hook_post is no function of its own neuron's pre-activation alone."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__(cfg)
        self.hook_mid = HookPoint()  # [batch pos d_mlp]
        # fixed w and b (LNPre) after folding (into W_out and b_out, with the other norms), or beside other norm kinds
        self.ln = LayerNorm(cfg.d_mlp, cfg.eps, learned=cfg.mlp_norm_learned)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.hook_pre(self.fc_in(x))
        mid = self.hook_mid(self.act_fn(pre))
        post = self.hook_post(self.ln(mid))
        return self.fc_out(post)


class SubNormedGatedMLP(GatedMLP):
    """act(gate(x)) * up(x), then an RMSNorm over d_mlp with a learned w, then down (BitNet's ffn_sub_norm, `mlp.ln`).
    hook_mid is act(gate) * up; hook_post, what W_out reads, is ln(hook_mid), as in NormedMLP."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__(cfg)
        self.hook_mid = HookPoint()  # [batch pos d_mlp]
        self.ln = RMSNorm(cfg.d_mlp, cfg.eps, learned=cfg.norm_weights)  # (fixed ones once folded into W_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mid = self.hook_mid(self.act_fn(self.hook_pre(self.gate(x))) * self.hook_pre_linear(self.fc_in(x)))
        return self.fc_out(self.hook_post(self.ln(mid)))


def make_dense_mlp(cfg: DecoderConfig) -> nn.Module:
    """One MLP (a mixture of experts is probe.moe's make_mlp)."""
    if cfg.gated_mlp:
        return SubNormedGatedMLP(cfg) if cfg.sub_norms else GatedMLP(cfg)
    return NormedMLP(cfg) if cfg.activation.normed else MLP(cfg)
