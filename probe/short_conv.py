"""LFM2's gated short convolution, the token mixer of its layers without attention (Liquid AI's LFM2, LFM2-MoE), every
intermediate hooked; the mixer and its parts under transformers' names (blocks.L.conv: in_proj, conv, out_proj), as
transformer-lens 4's Lfm2ShortConvBridge names them.

One projection gives, per position, three vectors of d_model channels, B, C and x. B * x passes a causal depthwise
convolution: each channel c at position t reads its own last `conv_kernel` inputs,

    conv_t[c] = sum_{j < kernel} w[c, j] (B x)_{t - kernel + 1 + j}[c]  (+ b[c])

with no activation after it; C gates the result, C * conv, and out_proj writes it back to the residual. The only
memory across positions is the convolution's window, so a cache carries its last kernel - 1 inputs."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from probe.config import DecoderConfig
from probe.hooks import HookPoint
from probe.kv_cache import LayerKV


class ShortConvMixer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        d, spec = cfg.d_model, cfg.short_conv
        self.kernel = spec.conv_kernel
        self.in_proj = nn.Linear(d, 3 * d, bias=spec.bias)
        self.conv = nn.Conv1d(d, d, spec.conv_kernel, groups=d, bias=spec.bias)  # depthwise: one filter per channel
        self.out_proj = nn.Linear(d, d, bias=spec.bias)
        self.hook_in_proj = HookPoint()  # [batch pos 3*d_model]: B, then C, then x
        self.hook_B = HookPoint()  # [batch pos d_model]: the input gate
        self.hook_C = HookPoint()  # [batch pos d_model]: the output gate
        self.hook_x = HookPoint()  # [batch pos d_model]
        self.hook_conv_in = HookPoint()  # [batch pos d_model]: B * x, what the convolution reads
        # [batch pos d_model]: the convolution's output (the bridge's hook_conv is its module's, [batch channel pos])
        self.hook_conv_out = HookPoint()
        self.hook_gated = HookPoint()  # [batch pos d_model]: C * conv, what out_proj reads

    def forward(self, x: torch.Tensor, real: Optional[torch.Tensor] = None, past: Optional[LayerKV] = None):
        """x [batch pos d_model]; `real` [batch pos] is False at padding, whose input is zeroed (as transformers does:
        with biases a padded position still writes the biases' product into the window); `past` carries the
        convolution's window between passes."""
        if real is not None:
            x = x * real[..., None].to(x.dtype)
        B, C, xs = self.hook_in_proj(self.in_proj(x)).chunk(3, dim=-1)
        conv_in = self.hook_conv_in(self.hook_B(B) * self.hook_x(xs))
        earlier = past.conv_window if past is not None and past.conv_window is not None else conv_in.new_zeros(
            x.shape[0], self.kernel - 1, x.shape[-1])
        window = torch.cat([earlier, conv_in], dim=1)  # [batch kernel-1+pos d_model]
        conv = self.hook_conv_out(self.conv(window.mT).mT)
        if past is not None:
            past.carry(window[:, window.shape[1] - (self.kernel - 1):], None, x.shape[1])
        return self.out_proj(self.hook_gated(self.hook_C(C) * conv))
