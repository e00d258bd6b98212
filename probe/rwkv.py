"""RWKV-4's layers (Peng et al. 2023, "RWKV: Reinventing RNNs for the Transformer Era"; BlinkDL's RWKV-4 Pile and Raven
models), every intermediate hooked; the two mixers under transformer-lens 4's bridge names, `time_mix` (transformers'
`attention`) and `channel_mix` (its `feed_forward`), their parameters under transformers' names.

Both mixers read a token shift: at each position t, each input is mixed channel by channel with the previous
position's, x_t mu + x_{t-1} (1 - mu) (x_{-1} = 0), one learned mu per projection.

The time mix: k, v and r from the three mixes; the WKV recurrence per channel, with w = -exp(time_decay) and
u = time_first (the current token's bonus),

    wkv_t = (sum_{s<t} e^{(t-1-s) w + k_s} v_s + e^{u + k_t} v_t) / (sum_{s<t} e^{(t-1-s) w + k_s} + e^{u + k_t})

kept as a running numerator and denominator scaled by e^{-m}, m their largest exponent so far (transformers' CPU path,
rwkv_linear_attention_cpu, in float32), then sigmoid(r) * wkv through `output`.

The channel mix: sigmoid(r) * value(relu(key(x_k))^2).

A layer's state between passes: the last input of each token shift and the WKV numerator, denominator and exponent."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from probe.blocks import LinearAttentionBlock
from probe.config import DecoderConfig
from probe.hooks import HookPoint
from probe.kv_cache import LayerKV
from probe.norm import make_norm

EMPTY_EXPONENT = -1e38  # the running exponent before any token: e^{-1e38} weighs the empty sums at 0, as transformers


def empty_wkv_state(batch: int, channels: int, device=None) -> torch.Tensor:
    """The WKV state before any token [batch 3 channel] float32: numerator 0, denominator 0, exponent EMPTY_EXPONENT."""
    state = torch.zeros(batch, 3, channels, dtype=torch.float32, device=device)
    state[:, 2] = EMPTY_EXPONENT
    return state


def wkv_stepwise(w, u, k, v, state, real: Optional[torch.Tensor] = None):
    """The WKV recurrence of the module docstring, one position at a time as transformers' CPU path: wkv [batch pos
    channel] float32 and the state after it [batch 3 channel], from w = -exp(time_decay) and u [channel], k and v
    [batch pos channel] and the state before them (empty_wkv_state). `real` [batch pos]: False at padding, which
    leaves the state as it was."""
    num, den, top = state.float().unbind(1)
    k, v = k.float(), v.float()
    out = []
    for t in range(k.shape[1]):
        kt, vt = k[:, t], v[:, t]
        peak = torch.maximum(top, kt + u)  # the largest exponent of wkv_t's sums: the state's, or the bonus token's
        old, new = torch.exp(top - peak), torch.exp(kt + u - peak)
        out.append((old * num + new * vt) / (old * den + new))
        peak = torch.maximum(top + w, kt)  # the state decays by e^w, then takes the token without its bonus
        old, new = torch.exp(top + w - peak), torch.exp(kt - peak)
        step = (old * num + new * vt, old * den + new, peak)
        if real is not None:
            step = tuple(torch.where(real[:, t, None], s, before) for s, before in zip(step, (num, den, top)))
        num, den, top = step
    return torch.stack(out, dim=1), torch.stack([num, den, top], dim=1)


def token_shift(x: torch.Tensor, last: Optional[torch.Tensor]) -> torch.Tensor:
    """x_{t-1} for each position of x [batch pos d_model]: `last` [batch d_model] (the previous pass's last input,
    None: zeros) before the first."""
    first = x.new_zeros(x.shape[0], 1, x.shape[-1]) if last is None else last[:, None].to(x.dtype)
    return torch.cat([first, x[:, :-1]], dim=1)


def shift_mix(x: torch.Tensor, previous: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """x mu + x_{t-1} (1 - mu), channel by channel."""
    return x * mu + previous * (1 - mu)


class TimeMix(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        d, width = cfg.d_model, cfg.rwkv.d_attention
        self.time_decay = nn.Parameter(torch.zeros(width))  # w = -exp(time_decay): each channel's decay per step
        self.time_first = nn.Parameter(torch.zeros(width))  # u: the current token's bonus
        self.time_mix_key, self.time_mix_value, self.time_mix_receptance = (
            nn.Parameter(torch.full((1, 1, d), 0.5)) for _ in range(3))
        self.key, self.value, self.receptance = (nn.Linear(d, width, bias=False) for _ in range(3))
        self.output = nn.Linear(width, d, bias=False)
        self.hook_key_in = HookPoint()  # [batch pos d_model]: the token-shift mix key reads
        self.hook_value_in = HookPoint()  # [batch pos d_model]: the one value reads
        self.hook_receptance_in = HookPoint()  # [batch pos d_model]: the one receptance reads
        self.hook_k = HookPoint()  # [batch pos d_attention]
        self.hook_v = HookPoint()  # [batch pos d_attention]
        self.hook_r = HookPoint()  # [batch pos d_attention]: the receptance before its sigmoid
        self.hook_wkv = HookPoint()  # [batch pos d_attention]: the recurrence's output
        self.hook_gated = HookPoint()  # [batch pos d_attention]: sigmoid(r) * wkv, what output reads

    def forward(self, x: torch.Tensor, last: Optional[torch.Tensor] = None, state: Optional[torch.Tensor] = None,
                real: Optional[torch.Tensor] = None):
        """(the write [batch pos d_model], the WKV state after it) from x [batch pos d_model] (ln1's output, zero at
        padding), the previous pass's last x [batch d_model] and WKV state [batch 3 d_attention] (None: none)."""
        previous = token_shift(x, last)
        k = self.hook_k(self.key(self.hook_key_in(shift_mix(x, previous, self.time_mix_key))))
        v = self.hook_v(self.value(self.hook_value_in(shift_mix(x, previous, self.time_mix_value))))
        r = self.hook_r(self.receptance(self.hook_receptance_in(shift_mix(x, previous, self.time_mix_receptance))))
        if state is None:
            state = empty_wkv_state(x.shape[0], k.shape[-1], x.device)
        wkv, state = wkv_stepwise(-torch.exp(self.time_decay.float()), self.time_first.float(), k, v, state, real)
        wkv = self.hook_wkv(wkv.to(x.dtype))
        return self.output(self.hook_gated(torch.sigmoid(r) * wkv)), state

    def _apply(self, fn, recurse=True):
        # the decay rates and bonuses follow a move, not a cast, as transformers keeps them (_keep_in_fp32_modules):
        # e^w compounds over every position, and bfloat16 would round time_decay to 8 bits
        exact = [param.detach().float() for param in (self.time_decay, self.time_first)]
        super()._apply(fn, recurse)
        for param, value in zip((self.time_decay, self.time_first), exact):
            param.data = value.to(param.device)
        return self


class ChannelMix(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        d = cfg.d_model
        self.time_mix_key, self.time_mix_receptance = (nn.Parameter(torch.full((1, 1, d), 0.5)) for _ in range(2))
        self.key = nn.Linear(d, cfg.d_mlp, bias=False)
        self.receptance = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(cfg.d_mlp, d, bias=False)
        self.hook_key_in = HookPoint()  # [batch pos d_model]: the token-shift mix key reads
        self.hook_receptance_in = HookPoint()  # [batch pos d_model]: the one receptance reads
        self.hook_pre = HookPoint()  # [batch pos d_mlp]: key's output
        self.hook_post = HookPoint()  # [batch pos d_mlp]: relu(key)^2, what value reads
        self.hook_value = HookPoint()  # [batch pos d_model]: value's output, before the gate
        self.hook_r = HookPoint()  # [batch pos d_model]: the receptance before its sigmoid

    def forward(self, x: torch.Tensor, last: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The write [batch pos d_model] from x [batch pos d_model] (ln2's output, zero at padding) and the previous
        pass's last x [batch d_model] (None: none)."""
        previous = token_shift(x, last)
        pre = self.hook_pre(self.key(self.hook_key_in(shift_mix(x, previous, self.time_mix_key))))
        value = self.hook_value(self.value(self.hook_post(torch.relu(pre).square())))
        r = self.hook_r(self.receptance(self.hook_receptance_in(shift_mix(x, previous, self.time_mix_receptance))))
        return torch.sigmoid(r) * value


class RwkvBlock(LinearAttentionBlock):
    """An RWKV-4 layer: h = x + time_mix(ln1(x)); y = h + channel_mix(ln2(h)). hook_attn_out is the time mix's write and
    hook_mlp_out the channel mix's, so the residual stream decomposes by layer as in every other block; there are no
    attention heads and no `mlp` (the channel mix's gate reads the token shift too). `allowed` is the new positions'
    padding mask [batch pos]: padding's mixer inputs are zeroed and it leaves the WKV state as it was, so a
    left-padded row computes what it computes alone (transformers reads no mask)."""

    mixer_name = "time_mix"
    kind = "RWKV time-mix"

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        nn.Module.__init__(self)
        self.ln1 = make_norm(cfg, foldable=True, ends=True)
        self.time_mix = TimeMix(cfg)
        self.ln2 = make_norm(cfg, foldable=True, ends=True)
        self.channel_mix = ChannelMix(cfg)
        self.hook_resid_pre = HookPoint()  # [batch pos d_model]
        self.hook_attn_out = HookPoint()  # [batch pos d_model]: the time mix's write
        self.hook_resid_mid = HookPoint()  # [batch pos d_model]
        self.hook_mlp_in = HookPoint(opt_in=True, copies=True)  # [batch pos d_model], as PreNormBlock's
        self.hook_mlp_out = HookPoint()  # [batch pos d_model]: the channel mix's write
        self.hook_resid_post = HookPoint()  # [batch pos d_model]

    def __getattr__(self, name: str):
        if name == "mlp":
            raise AttributeError("this block is an RWKV layer: its channel mix (blocks.L.channel_mix, hook points "
                                 "blocks.L.channel_mix.hook_*) gates its MLP by a receptance of the shifted input, so "
                                 "it has no `mlp` with W_in / W_out alone")
        return super().__getattr__(name)

    def forward(self, resid_pre, positions=None, allowed=None, past: Optional[LayerKV] = None, qk_pos=None):
        keep = (lambda x: x) if allowed is None else (lambda x: x * allowed[..., None].to(x.dtype))
        held = past is not None and past.state is not None
        # the shifts' last inputs [batch 2 d_model] (the time mix's, the channel mix's), kept where a convolution's are
        shifts, wkv = (past.conv_window.unbind(1), past.state) if held else ((None, None), None)
        resid_pre = self.hook_resid_pre(resid_pre)
        time_in = keep(self.ln1(resid_pre))
        attn_out, wkv = self.time_mix(time_in, shifts[0], wkv, allowed)
        resid_mid = self.hook_resid_mid(resid_pre + self.hook_attn_out(attn_out))
        channel_in = keep(self.ln2(self.hook_mlp_in(resid_mid)))
        mlp_out = self.hook_mlp_out(self.channel_mix(channel_in, shifts[1]))
        if past is not None:  # (each shift's last input: zero where the last position is padding, as it was read)
            past.carry(torch.stack([time_in[:, -1], channel_in[:, -1]], dim=1), wkv, resid_pre.shape[1])
        return self.hook_resid_post(resid_mid + mlp_out)
