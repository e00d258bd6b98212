"""Gated DeltaNet, the linear attention of Qwen3.5's, Qwen3-Next's and OLMo-Hybrid's hybrid layers (Yang et al.
2024), every intermediate hooked under transformer-lens 4's names (its GatedDeltaNetBridge:
`blocks.L.linear_attn.hook_q`, ...).

Each value head h keeps a state S [d_key_head d_value_head]. At each position t, after a causal depthwise convolution
over q, k and v and an L2 norm of q and k:

    S <- exp(g_t) S                                  g_t < 0: the decay (hook_log_decay)
    S <- S + beta_t k_t (v_t - S^T k_t)^T            beta_t in (0, 1): how far S moves to v_t along k_t (hook_beta;
                                                     OLMo-Hybrid's in (0, 2), LinearAttention.beta_scale)
    o_t = S^T q_t / sqrt(d_key_head)                 (hook_recurrence_out)

then each head's o is RMS-normalised, gated by silu(z) (hook_z: what out_proj reads, per head) and projected back to
the residual. The recurrence runs in float32, as the reference does, by chunks of positions (gated_delta_rule; its
definition, one position at a time, is gated_delta_rule_stepwise)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import nn

from probe.config import DecoderConfig
from probe.hooks import HookPoint
from probe.kv_cache import LayerKV


class GatedRMSNorm(nn.Module):
    """Each head's output RMS-normalised over d_value_head (in float32, w applied after rounding, as Llama's) and
    multiplied by silu(gate)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.w = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = self.w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


def gated_delta_rule_stepwise(q, k, v, beta, log_decay, state):
    """The recurrence as written in the module docstring, one position at a time: o [batch pos v_head d_value_head]
    and the final state [batch v_head d_key_head d_value_head], from q and k [batch pos v_head d_key_head] (normed),
    v, beta and log_decay [batch pos v_head], and the state before them. The definition gated_delta_rule computes
    by chunks."""
    q = q / q.shape[-1] ** 0.5
    out = []
    for t in range(q.shape[1]):
        state = state * log_decay[:, t].exp()[..., None, None]
        read = einsum(state, k[:, t], "batch head d_key d_value, batch head d_key -> batch head d_value")
        delta = (v[:, t] - read) * beta[:, t, :, None]
        state = state + einsum(k[:, t], delta, "batch head d_key, batch head d_value -> batch head d_key d_value")
        out.append(einsum(state, q[:, t], "batch head d_key d_value, batch head d_key -> batch head d_value"))
    return torch.stack(out, dim=1), state


def gated_delta_rule(q, k, v, beta, log_decay, state, chunk: int = 64):
    """gated_delta_rule_stepwise's result, `chunk` positions at a time with matmuls (the WY / UT form of Yang et al.):
    within a chunk, with g_t the decay summed from its start and S the state before it, the writes
    u = beta (v - read) solve the unit lower-triangular system (I + A) u = beta v - beta exp(g) k S, where
    A[t, s] = beta_t exp(g_t - g_s) k_t.k_s for s < t; then o_t = exp(g_t) S^T q_t + sum_{s<=t} exp(g_t - g_s) (q_t.k_s)
    u_s, and the state after the chunk is exp(g_last) S + sum_s exp(g_last - g_s) k_s u_s^T. Exact up to rounding."""
    batch, n, heads, d_key = q.shape
    chunk = min(chunk, n)
    pad = -n % chunk  # padded positions write nothing (beta 0) and decay nothing (log decay 0)
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q / d_key ** 0.5, k, v))
    beta, log_decay = (F.pad(t, (0, 0, 0, pad)) for t in (beta, log_decay))
    split = "batch (chunk pos) head d -> batch head chunk pos d"
    q, k, v = (rearrange(t, split, pos=chunk) for t in (q, k, v))
    beta, g = (rearrange(t, "batch (chunk pos) head -> batch head chunk pos", pos=chunk) for t in (beta, log_decay))
    g = g.cumsum(dim=-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [t, s]: exp(g_t - g_s)
    system = torch.eye(chunk, device=q.device) + (beta[..., :, None] * (k @ k.mT) * decay).tril(-1)
    writes = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, (beta * g.exp())[..., None] * k, upper=False, unitriangular=True)
    scores = (q @ k.mT) * decay
    out = []
    for c in range(q.shape[2]):
        u = writes[:, :, c] - reads[:, :, c] @ state
        out.append(g[:, :, c, :, None].exp() * (q[:, :, c] @ state) + scores[:, :, c] @ u)
        last = g[:, :, c, -1:]
        state = last[..., None].exp() * state + ((last - g[:, :, c]).exp()[..., None] * k[:, :, c]).mT @ u
    out = rearrange(torch.stack(out, dim=2), "batch head chunk pos d -> batch (chunk pos) head d")
    return out[:, :n], state


def l2_normed(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)  # the reference's eps, inside the root


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        linear = cfg.linear_attention
        self.key_heads, self.value_heads = linear.key_heads, linear.value_heads
        self.d_key, self.d_value = linear.d_key_head, linear.d_value_head
        self.sizes = [self.key_heads * self.d_key] * 2 + [self.value_heads * self.d_value]  # q, k, v
        width = sum(self.sizes)
        # the checkpoints' own names, so the state dict reads as transformers' (blocks.L.linear_attn.A_log, ...)
        self.in_proj_qkv = nn.Linear(cfg.d_model, width, bias=False)
        self.in_proj_z = nn.Linear(cfg.d_model, self.sizes[2], bias=False)  # the output gate
        self.in_proj_b = nn.Linear(cfg.d_model, self.value_heads, bias=False)  # beta's logit
        self.in_proj_a = nn.Linear(cfg.d_model, self.value_heads, bias=False)  # the decay's step
        self.conv1d = nn.Conv1d(width, width, linear.conv_kernel, groups=width, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))  # each head's decay rate, log A
        self.dt_bias = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.d_value, cfg.eps if linear.norm_eps is None else linear.norm_eps)
        self.beta_scale = linear.beta_scale
        self.out_proj = nn.Linear(self.sizes[2], cfg.d_model, bias=False)
        self.hook_q_pre_conv = HookPoint()  # [batch pos key_head d_key_head]
        self.hook_k_pre_conv = HookPoint()  # [batch pos key_head d_key_head]
        self.hook_v_pre_conv = HookPoint()  # [batch pos v_head d_value_head]
        self.hook_q = HookPoint()  # [batch pos key_head d_key_head]: after the convolution and its silu
        self.hook_k = HookPoint()  # [batch pos key_head d_key_head]
        self.hook_v = HookPoint()  # [batch pos v_head d_value_head]
        self.hook_beta_logit = HookPoint()  # [batch pos v_head]
        self.hook_beta = HookPoint()  # [batch pos v_head]: the write strength, sigmoid of the logit (times beta_scale)
        self.hook_log_decay = HookPoint()  # [batch pos v_head]: g, negative; the state is multiplied by exp(g)
        self.hook_recurrence_out = HookPoint()  # [batch pos v_head d_value_head]
        self.hook_gate_input = HookPoint()  # [batch pos v_head d_value_head]: z, before its silu
        self.hook_z = HookPoint()  # [batch pos v_head d_value_head]: normed and gated, what out_proj reads

    def forward(self, x: torch.Tensor, real: Optional[torch.Tensor] = None, past: Optional[LayerKV] = None):
        """x [batch pos d_model]; `real` [batch pos] is False at padding, which writes nothing into the state (its
        input zeroed, as the reference does); `past` carries the convolution's window and the state between passes."""
        if real is not None:
            x = x * real[..., None].to(x.dtype)
        batch = x.shape[0]
        q, k, v = self.in_proj_qkv(x).split(self.sizes, dim=-1)
        q = self.hook_q_pre_conv(q.unflatten(-1, (self.key_heads, self.d_key)))
        k = self.hook_k_pre_conv(k.unflatten(-1, (self.key_heads, self.d_key)))
        v = self.hook_v_pre_conv(v.unflatten(-1, (self.value_heads, self.d_value)))
        mixed = torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)
        kernel = self.conv1d.kernel_size[0]
        earlier = past.conv_window if past is not None and past.conv_window is not None else mixed.new_zeros(
            batch, kernel - 1, mixed.shape[-1])
        window = torch.cat([earlier, mixed], dim=1)
        conv = F.silu(self.conv1d(rearrange(window, "batch pos channel -> batch channel pos")))
        q, k, v = rearrange(conv, "batch channel pos -> batch pos channel").split(self.sizes, dim=-1)
        q = self.hook_q(q.unflatten(-1, (self.key_heads, self.d_key)))
        k = self.hook_k(k.unflatten(-1, (self.key_heads, self.d_key)))
        v = self.hook_v(v.unflatten(-1, (self.value_heads, self.d_value)))
        beta = self.hook_beta(self.hook_beta_logit(self.in_proj_b(x)).sigmoid() * self.beta_scale)
        log_decay = self.hook_log_decay(-self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias))
        group = self.value_heads // self.key_heads  # each query/key head serves `group` adjacent value heads
        q, k = (l2_normed(t.float()).repeat_interleave(group, dim=2) for t in (q, k))
        state = past.state if past is not None and past.state is not None else q.new_zeros(
            batch, self.value_heads, self.d_key, self.d_value)
        out, state = gated_delta_rule(q, k, v.float(), beta.float(), log_decay, state)
        if past is not None:
            past.carry(window[:, window.shape[1] - (kernel - 1):], state, x.shape[1])
        out = self.hook_recurrence_out(out.to(x.dtype))
        gate = self.hook_gate_input(self.in_proj_z(x).unflatten(-1, (self.value_heads, self.d_value)))
        z = self.hook_z(self.norm(out, gate))
        return self.out_proj(z.flatten(-2))
