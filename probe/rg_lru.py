"""Griffin's recurrent block, the token mixer of RecurrentGemma's "recurrent" layers (De et al. 2024, "Griffin"), every
intermediate hooked; its parts under transformers' names (blocks.L.recurrent: linear_x, linear_y, conv_1d, rg_lru,
linear_out), so the state dict reads as the file's temporal_block.

Two projections of the normalised residual, `width` channels each: y = gelu(linear_y(x)) is the gate; linear_x(x)
passes a causal depthwise convolution and then the real-gated linear recurrent unit (RG-LRU). With the input gate
i_t = sigmoid(x_t W_i + b_i) and the recurrence gate r_t = sigmoid(x_t W_a + b_a) (both block-diagonal: n_blocks
blocks of width // n_blocks), and c = 8:

    log a_t = -c r_t softplus(Lambda)                       (hook_a: a_t)
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t)           (hook_state: h_t, accumulated in float32)

except at a sequence's first position (position 0), where h_t = i_t x_t: the state restarts and the input is not
scaled down. The block writes linear_out(h * y). Its memory across positions is the state h and the convolution's
window, which a cache carries."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from probe.activations import ACTIVATIONS
from probe.blocks import LinearAttentionBlock
from probe.config import DecoderConfig
from probe.config_rg_lru import RGLRU
from probe.hooks import HookPoint
from probe.kv_cache import LayerKV

DECAY_SCALE = 8.0  # Griffin's c: a_t runs from exp(-c softplus(Lambda)) (r_t = 1) to 1 (r_t = 0)


class RealGatedLRU(nn.Module):
    """The RG-LRU (transformers' RecurrentGemmaRglru): gates, decay and the float32 scan, parameters under its names."""

    def __init__(self, spec: RGLRU):
        super().__init__()
        n, bw = spec.n_blocks, spec.block_width
        self.n_blocks = n
        self.recurrent_param = nn.Parameter(torch.zeros(spec.width))  # Lambda: each channel's decay rate
        self.input_gate_weight = nn.Parameter(torch.zeros(n, bw, bw))  # [block in out]
        self.input_gate_bias = nn.Parameter(torch.zeros(n, bw))
        self.recurrent_gate_weight = nn.Parameter(torch.zeros(n, bw, bw))
        self.recurrent_gate_bias = nn.Parameter(torch.zeros(n, bw))
        self.hook_input_gate = HookPoint()  # [batch pos width]: i_t
        self.hook_recurrence_gate = HookPoint()  # [batch pos width]: r_t
        # [batch pos width]: a_t, the state's decay (where it restarts, h_{t-1} is dropped); an edit here reaches the
        # scan, not the input's sqrt(1 - a_t^2) scale, which transformers computes from log a_t
        self.hook_a = HookPoint()
        self.hook_scan_in = HookPoint()  # [batch pos width]: sqrt(1 - a_t^2) i_t x_t (i_t x_t at a restart)
        self.hook_state = HookPoint()  # [batch pos width]: h_t, in the input's dtype

    def gate(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """sigmoid(x W + b), W block-diagonal [block in out]: x [batch pos width] -> [batch pos width]. One baddbmm
        per block, bias inside, as transformers rounds it in bfloat16."""
        blocks = x.reshape(-1, self.n_blocks, x.shape[-1] // self.n_blocks).transpose(0, 1)  # [block batch*pos in]
        out = torch.baddbmm(bias[:, None, :], blocks, weight)  # [block batch*pos out]
        return torch.sigmoid(out.transpose(0, 1).reshape(x.shape))

    def forward(self, x: torch.Tensor, reset: torch.Tensor, state: Optional[torch.Tensor] = None):
        """(h [batch pos width], the last state [batch width] float32) from x [batch pos width], `reset` [batch pos]
        (True where the state restarts) and the state before them (None: zeros)."""
        input_gate = self.hook_input_gate(self.gate(x, self.input_gate_weight, self.input_gate_bias))
        recurrence_gate = self.hook_recurrence_gate(self.gate(x, self.recurrent_gate_weight, self.recurrent_gate_bias))
        log_a = -DECAY_SCALE * recurrence_gate * F.softplus(self.recurrent_param)
        a = self.hook_a(torch.exp(log_a))
        reset = reset[..., None]
        # (exp(2 log a), not a * a, as transformers rounds it)
        multiplier = torch.where(reset, torch.ones_like(log_a), torch.sqrt(1 - torch.exp(2 * log_a)))
        scan_in = self.hook_scan_in(x * input_gate * multiplier.to(x.dtype))
        a = (a * ~reset).float()
        h = torch.zeros_like(scan_in[:, 0], dtype=torch.float32) if state is None else state
        out = []
        for t in range(x.shape[1]):
            h = a[:, t] * h + scan_in[:, t].float()
            out.append(h.to(x.dtype))
        return self.hook_state(torch.stack(out, dim=1)), h


class RecurrentMixer(nn.Module):
    """Griffin's recurrent block (transformers' RecurrentGemmaRecurrentBlock); see the module docstring."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        spec = cfg.rg_lru
        self.kernel = spec.conv_kernel
        self.linear_y = nn.Linear(cfg.d_model, spec.width)
        self.linear_x = nn.Linear(cfg.d_model, spec.width)
        self.act_fn = ACTIVATIONS[cfg.activation]()  # the model's (the MLP's) activation, as transformers'
        self.conv_1d = nn.Conv1d(spec.width, spec.width, spec.conv_kernel, groups=spec.width)  # one filter per channel
        self.rg_lru = RealGatedLRU(spec)
        self.linear_out = nn.Linear(spec.width, cfg.d_model)
        self.hook_y = HookPoint()  # [batch pos width]: gelu(linear_y(x)), the gate branch
        self.hook_x = HookPoint()  # [batch pos width]: linear_x(x), what the convolution reads
        self.hook_conv_out = HookPoint()  # [batch pos width]: the convolution's output, what the RG-LRU reads
        self.hook_gated = HookPoint()  # [batch pos width]: h * y, what linear_out reads

    @property
    def out_proj(self) -> nn.Linear:
        """The block's write to the residual, under the name processing reads a recurrent layer's by."""
        return self.linear_out

    def forward(self, x: torch.Tensor, positions: torch.Tensor, past: Optional[LayerKV] = None):
        """x [batch pos d_model]; `positions` [batch pos]: the state restarts where one is 0 (a sequence's first real
        token; left padding, at position 0 too, passes the convolution as transformers lets it); `past` carries the
        convolution's window and the state between passes."""
        y = self.hook_y(self.act_fn(self.linear_y(x)))
        xs = self.hook_x(self.linear_x(x))
        earlier = past.conv_window if past is not None and past.conv_window is not None else xs.new_zeros(
            x.shape[0], self.kernel - 1, xs.shape[-1])
        window = torch.cat([earlier, xs], dim=1)  # [batch kernel-1+pos width]
        conv = self.hook_conv_out(self.conv_1d(window.mT).mT)
        h, state = self.rg_lru(conv, positions == 0, None if past is None else past.state)
        if past is not None:
            past.carry(window[:, window.shape[1] - (self.kernel - 1):], state, x.shape[1])
        return self.linear_out(self.hook_gated(h * y))


class RecurrentBlock(LinearAttentionBlock):
    """A pre-norm block whose token mixer is Griffin's recurrent block (RecurrentGemma's "recurrent" layers):
    h = x + recurrent(ln1(x)); y = h + mlp(ln2(h)). The mixer reads the tokens' positions (its state restarts at 0)."""

    mixer_name = "recurrent"
    kind = "recurrent (Griffin RG-LRU)"

    @staticmethod
    def make_mixer(cfg: DecoderConfig) -> nn.Module:
        return RecurrentMixer(cfg)

    def forward(self, resid_pre, positions=None, allowed=None, past=None, qk_pos=None):
        resid_pre = self.hook_resid_pre(resid_pre)
        attn_out = self.hook_attn_out(self.recurrent(self.ln1(resid_pre), positions, past))
        resid_mid = self.hook_resid_mid(resid_pre + attn_out)
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(self.hook_mlp_in(resid_mid))))
        return self.hook_resid_post(resid_mid + mlp_out)
