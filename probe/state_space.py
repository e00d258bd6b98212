"""The Mamba-2 mixer, the state-space layer of hybrid models (IBM's Granite 4.0-H: GraniteMoeHybrid; Dao and Gu 2024,
"Transformers are SSMs"), every intermediate hooked, its points named for transformer-lens 4's SSM2MixerBridge.

One projection gives the output gate z, the convolved channels (x, B, C) and the step dt of each head. After a causal
depthwise convolution and its silu, x splits into heads of d_head, and B and C into groups of d_state shared by
adjacent heads. Each head h keeps a state S [d_head d_state]; at each position t, with dt_t = softplus(dt + dt_bias)
(clamped to the checkpoint's limits) and A_h = -exp(A_log_h):

    S <- exp(dt_t A_h) S + dt_t x_t B_t^T             (hook_dt: dt_t per head)
    y_t = S C_t + D_h x_t                             (hook_scan_out)

then y is multiplied by silu(z), RMS-normalised per group of channels (the gated norm, hook_inner_norm: what
out_proj reads; Falcon-H1's normalise before the gate, or not at all: StateSpace.inner_norm) and projected back to the
residual. The recurrence runs in float32 by chunks of positions
(state_space_scan; its definition, one position at a time, is state_space_scan_stepwise)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import nn

from probe.config import DecoderConfig, StateSpace
from probe.hooks import HookPoint
from probe.kv_cache import LayerKV


def state_space_scan_stepwise(x, dt, A, B, C, state):
    """The recurrence of the module docstring, one position at a time, without the D skip: y [batch pos head d_head]
    and the final state [batch head d_head d_state], from x [batch pos head d_head], dt [batch pos head], A [head], B
    and C [batch pos head d_state] (each head's group's), and the state before them."""
    out = []
    for t in range(x.shape[1]):
        decay = (dt[:, t] * A).exp()[..., None, None]
        write = einsum(x[:, t] * dt[:, t, :, None], B[:, t], "batch head p, batch head n -> batch head p n")
        state = decay * state + write
        out.append(einsum(state, C[:, t], "batch head p n, batch head n -> batch head p"))
    return torch.stack(out, dim=1), state


def state_space_scan(x, dt, A, B, C, state, chunk: int = 64):
    """state_space_scan_stepwise's result, `chunk` positions at a time (the state space duality): within a chunk, with
    a_t the log decay summed from its start and S the state before it,
    y_t = exp(a_t) S C_t + sum_{s<=t} exp(a_t - a_s) (C_t . B_s) dt_s x_s, and the state after it is
    exp(a_last) S + sum_s exp(a_last - a_s) dt_s x_s B_s^T. Exact up to rounding."""
    n = x.shape[1]
    chunk = min(chunk, n)
    pad = -n % chunk  # padded positions write nothing (dt 0) and decay nothing
    x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
    dt = F.pad(dt, (0, 0, 0, pad))
    split = "batch (chunk pos) head d -> batch head chunk pos d"
    x, B, C = (rearrange(t, split, pos=chunk) for t in (x * dt[..., None], B, C))  # x carries its step dt_s
    a = rearrange(dt * A, "batch (chunk pos) head -> batch head chunk pos", pos=chunk).cumsum(dim=-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = (a[..., :, None] - a[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [t, s]: exp(a_t - a_s)
    within = (C @ B.mT) * decay  # [batch head chunk t s]
    out = []
    for c in range(x.shape[2]):
        out.append(a[:, :, c, :, None].exp() * (C[:, :, c] @ state.mT) + within[:, :, c] @ x[:, :, c])
        last = a[:, :, c, -1:]
        state = last[..., None].exp() * state + (x[:, :, c] * (last - a[:, :, c]).exp()[..., None]).mT @ B[:, :, c]
    out = rearrange(torch.stack(out, dim=2), "batch head chunk pos d -> batch (chunk pos) head d")
    return out[:, :n], state


class GroupedGatedRMSNorm(nn.Module):
    """y * silu(z), RMS-normalised over each of `groups` equal slices of the channels (in float32), times w."""

    def __init__(self, width: int, groups: int, eps: float):
        super().__init__()
        self.w = nn.Parameter(torch.ones(width))
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        gated = (y.float() * F.silu(gate.float())).unflatten(-1, (self.groups, -1))
        normed = (gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return self.w * normed.to(y.dtype)


class GroupedRMSNormThenGate(GroupedGatedRMSNorm):
    """y RMS-normalised over each of `groups` equal slices (in float32), times w, then times silu(z): the norm before
    the gate (Falcon-H1's mamba_norm_before_gate)."""

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        grouped = y.float().unflatten(-1, (self.groups, -1))
        normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (self.w * normed * F.silu(gate.float())).to(y.dtype)


class SiluGate(nn.Module):
    """y * silu(z) without a norm (Falcon-H1's mamba_rms_norm false): nothing learned."""

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return y * F.silu(gate)


# StateSpace.inner_norm -> the gated norm's module
INNER_NORMS = {"after_gate": GroupedGatedRMSNorm, "before_gate": GroupedRMSNormThenGate, None: SiluGate}


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: DecoderConfig, spec: Optional[StateSpace] = None):
        """`spec`: the mixer's StateSpace, where it is not cfg.state_space (Falcon-H1's, beside attention)."""
        super().__init__()
        spec = cfg.state_space if spec is None else spec
        self.heads, self.d_head, self.groups, self.d_state = spec.n_heads, spec.d_head, spec.n_groups, spec.d_state
        self.inner = spec.n_heads * spec.d_head
        self.conv_channels = self.inner + 2 * spec.n_groups * spec.d_state  # x, B, C
        self.dt_limits = (spec.dt_min, spec.dt_max)
        # the checkpoints' own names, so the state dict reads as transformers' (blocks.L.mixer.A_log, ...)
        self.in_proj = nn.Linear(cfg.d_model, self.inner + self.conv_channels + self.heads, bias=spec.proj_bias)
        self.conv1d = nn.Conv1d(self.conv_channels, self.conv_channels, spec.conv_kernel, groups=self.conv_channels,
                                bias=spec.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))  # each head's decay rate, log(-A)
        self.D = nn.Parameter(torch.ones(self.heads))  # each head's skip from x to y
        gated_norm = INNER_NORMS[spec.inner_norm]
        self.norm = gated_norm() if gated_norm is SiluGate else gated_norm(self.inner, spec.n_groups, cfg.eps)
        out_bias = spec.proj_bias if spec.out_bias is None else spec.out_bias
        self.out_proj = nn.Linear(self.inner, cfg.d_model, bias=out_bias)
        self.hook_in_proj = HookPoint()  # [batch pos inner+conv_channels+head]: z, then x B C, then dt (before its bias)
        self.hook_conv = HookPoint()  # [batch pos conv_channels]: x, B, C after the convolution and its silu
        self.hook_dt = HookPoint()  # [batch pos head] float32: the step, softplus(dt + dt_bias), clamped
        self.hook_scan_out = HookPoint()  # [batch pos head d_head]: y = S C + D x, before the gate
        self.hook_inner_norm = HookPoint()  # [batch pos inner]: y gated and normed (or only gated), what out_proj reads

    def forward(self, x: torch.Tensor, real: Optional[torch.Tensor] = None, past: Optional[LayerKV] = None):
        """x [batch pos d_model]; `real` [batch pos] is False at padding, which writes nothing into the state (its
        input and its convolved channels zeroed, as the reference does); `past` carries the convolution's window and
        the state between passes."""
        keep = None if real is None else real[..., None].to(x.dtype)
        if keep is not None:
            x = x * keep
        batch = x.shape[0]
        gate, channels, dt = self.hook_in_proj(self.in_proj(x)).split([self.inner, self.conv_channels, self.heads], -1)
        kernel = self.conv1d.kernel_size[0]
        earlier = past.conv_window if past is not None and past.conv_window is not None else channels.new_zeros(
            batch, kernel - 1, channels.shape[-1])
        window = torch.cat([earlier, channels], dim=1)
        conv = self.hook_conv(F.silu(self.conv1d(window.mT)).mT)
        if keep is not None:
            conv = conv * keep
        xs, B, C = conv.split([self.inner, self.groups * self.d_state, self.groups * self.d_state], dim=-1)
        dt = self.hook_dt(F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limits))
        per_group = self.heads // self.groups  # each group's B and C serve that many adjacent heads
        B, C = (t.float().unflatten(-1, (self.groups, self.d_state)).repeat_interleave(per_group, dim=2) for t in (B, C))
        xs = xs.unflatten(-1, (self.heads, self.d_head))
        state = past.state if past is not None and past.state is not None else xs.new_zeros(
            batch, self.heads, self.d_head, self.d_state, dtype=torch.float32)
        y, state = state_space_scan(xs.float(), dt, -self.A_log.float().exp(), B, C, state)
        if past is not None:
            past.carry(window[:, window.shape[1] - (kernel - 1):], state, x.shape[1])
        y = self.hook_scan_out((y + self.D.float()[:, None] * xs.float()).to(x.dtype))
        return self.out_proj(self.hook_inner_norm(self.norm(y.flatten(-2), gate)))
