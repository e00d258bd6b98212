"""The Mamba-1 mixer (Gu and Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces"), every
intermediate hooked, its points named for transformer-lens 4's SSMMixerBridge where it has them.

One projection gives the channels x and the output gate z (d_inner each). x passes a causal depthwise convolution and
its silu; a second projection of it (x_proj) gives the step's low-rank input, B and C [d_state] (FalconMamba first
RMS-normalises each of the three without weights, Jamba with a learned scale each: dt_layernorm, b_layernorm,
c_layernorm, their ends hooked as the bridge names them). The step dt = softplus(dt_proj(dt_low)) is one per channel, and
each channel c keeps a state h_c [d_state] with its own decay rates A_c = -exp(A_log_c):

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t          (hook_dt: dt_t per channel)
    y_t = h_t . C_t + D x_t                             (hook_scan_out)

then y * silu(z) (hook_gated, what out_proj reads). The recurrence runs in float32 by chunks of positions
(selective_scan; its definition, one position at a time, is selective_scan_stepwise)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import einsum
from torch import nn

from probe.config import DecoderConfig
from probe.hooks import HookPoint
from probe.kv_cache import LayerKV
from probe.norm import RMSNorm


def selective_scan_stepwise(x, dt, A, B, C, state):
    """The recurrence of the module docstring, one position at a time, without the D skip: y [batch pos d_inner] and
    the final state [batch d_inner d_state], from x and dt [batch pos d_inner], A [d_inner d_state], B and C
    [batch pos d_state], and the state before them."""
    out = []
    for t in range(x.shape[1]):
        decay = (dt[:, t, :, None] * A).exp()
        state = decay * state + (dt[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        out.append(einsum(state, C[:, t], "batch d_inner d_state, batch d_state -> batch d_inner"))
    return torch.stack(out, dim=1), state


def selective_scan(x, dt, A, B, C, state, chunk: int = 16):
    """selective_scan_stepwise's result, `chunk` positions at a time: within a chunk, with a_t the log decay summed
    from its start (per channel and state dimension) and h the state before it,
    h_t = exp(a_t) h + sum_{s<=t} exp(a_t - a_s) dt_s x_s B_s, read by C_t. Every exponent is <= 0 (A < 0), so
    nothing overflows; exact up to rounding."""
    out = []
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    for start in range(0, x.shape[1], chunk):
        xs, dts, Bs, Cs = (t[:, start:start + chunk] for t in (x, dt, B, C))
        n = xs.shape[1]
        a = (dts[..., None] * A).cumsum(dim=1)  # [batch t d_inner d_state]
        gap = (a[:, :, None] - a[:, None, :])  # [batch t s d_inner d_state]: a_t - a_s
        gap = gap.masked_fill(~causal[:n, :n, None, None], float("-inf"))
        writes = (dts * xs)[..., None] * Bs[:, :, None, :]  # [batch s d_inner d_state]
        states = a.exp() * state[:, None] + einsum(gap.exp(), writes, "b t s c n, b s c n -> b t c n")
        out.append(einsum(states, Cs, "b t c n, b t n -> b t c"))
        state = states[:, -1]
    return torch.cat(out, dim=1), state


def weightless_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """FalconMamba's norm of dt, B and C: x / rms(x) over the last dimension, in float32, back in x's dtype."""
    f = x.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class MambaMixer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        spec = cfg.state_space
        self.inner, self.d_state, self.dt_rank, self.norm_eps = spec.d_inner, spec.d_state, spec.dt_rank, spec.bcdt_norm_eps
        # the checkpoints' own names, so the state dict reads as transformers' (blocks.L.mixer.A_log, ...)
        self.in_proj = nn.Linear(cfg.d_model, 2 * self.inner, bias=spec.proj_bias)
        self.conv1d = nn.Conv1d(self.inner, self.inner, spec.conv_kernel, groups=self.inner, bias=spec.conv_bias)
        self.x_proj = nn.Linear(self.inner, self.dt_rank + 2 * self.d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.inner, self.d_state))  # each channel's decay rates, log(-A)
        self.D = nn.Parameter(torch.ones(self.inner))  # each channel's skip from x to y
        self.out_proj = nn.Linear(self.inner, cfg.d_model, bias=spec.proj_bias)
        self.learned_norms = spec.bcdt_norm_weights
        if self.learned_norms:  # Jamba's, under its names (the bridge's too)
            self.dt_layernorm, self.b_layernorm, self.c_layernorm = (
                RMSNorm(width, spec.bcdt_norm_eps, ends=True) for width in (self.dt_rank, self.d_state, self.d_state))
        self.hook_in_proj = HookPoint()  # [batch pos 2*d_inner]: x, then the gate z
        self.hook_conv = HookPoint()  # [batch pos d_inner]: x after the convolution and its silu
        self.hook_x_proj = HookPoint()  # [batch pos dt_rank+2*d_state]: the step's low-rank input, B, C (before norms)
        self.hook_dt = HookPoint()  # [batch pos d_inner] float32: the step, softplus(dt_proj(...))
        self.hook_scan_out = HookPoint()  # [batch pos d_inner]: y = h . C + D x, before the gate
        self.hook_gated = HookPoint()  # [batch pos d_inner]: y * silu(z), what out_proj reads

    def forward(self, x: torch.Tensor, real: Optional[torch.Tensor] = None, past: Optional[LayerKV] = None):
        """x [batch pos d_model]; `real` [batch pos] is False at padding, which writes nothing into the state (its
        input and its convolved channels zeroed, where transformers zeroes them); `past` carries the convolution's
        window and the state between passes."""
        keep = None if real is None else real[..., None].to(x.dtype)
        if keep is not None:
            x = x * keep
        batch = x.shape[0]
        channels, gate = self.hook_in_proj(self.in_proj(x)).chunk(2, dim=-1)
        kernel = self.conv1d.kernel_size[0]
        earlier = past.conv_window if past is not None and past.conv_window is not None else channels.new_zeros(
            batch, kernel - 1, self.inner)
        window = torch.cat([earlier, channels], dim=1)
        conv = self.hook_conv(F.silu(self.conv1d(window.mT)).mT)
        if keep is not None:
            conv = conv * keep
        dt, B, C = self.hook_x_proj(self.x_proj(conv)).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.norm_eps is not None:
            dt, B, C = self.normalize_bcdt(dt, B, C)
        # (the bias added in float32, after the matmul, as transformers does)
        dt = self.hook_dt(F.softplus(F.linear(dt, self.dt_proj.weight).float() + self.dt_proj.bias.float()))
        state = past.state if past is not None and past.state is not None else x.new_zeros(
            batch, self.inner, self.d_state, dtype=torch.float32)
        y, state = selective_scan(conv.float(), dt, -self.A_log.float().exp(), B.float(), C.float(), state)
        if past is not None:
            past.carry(window[:, window.shape[1] - (kernel - 1):], state, x.shape[1])
        y = self.hook_scan_out((y + self.D.float() * conv.float()).to(x.dtype))
        return self.out_proj(self.hook_gated((y.float() * F.silu(gate.float())).to(x.dtype)))

    def normalize_bcdt(self, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor):
        """The step's low-rank input, B and C each RMS-normalised: with their learned scales (Jamba's) or none
        (FalconMamba's)."""
        if self.learned_norms:
            return self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        return tuple(weightless_rms(t, self.norm_eps) for t in (dt, B, C))
