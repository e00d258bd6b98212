"""Rotary positions (Su et al. 2021): the half-split layout (Llama, GPT-NeoX), the interleaved one (GPT-J), LongRoPE's two
regimes, and the long-context rescalings of the frequencies (linear, llama3, YaRN, proportional)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from probe.config import DecoderConfig, RotaryScaling

class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021) in the half-split layout Llama and GPT-NeoX checkpoints
    use, on each head's first `dim` dimensions (all of them in Llama; a quarter in Pythia), the rest
    passing through: dimension i is paired with i + dim/2, and the pair is rotated by
    position * base^(-2i/dim)."""

    def __init__(self, dim: int, base: float, scaling: Optional[RotaryScaling] = None):
        super().__init__()
        self.dim, self.base, self.scaling = dim, base, scaling
        # YaRN multiplies the rotated dimensions (cos and sin) by its attention factor; 1 otherwise
        self.amplitude = scaling.attention_factor if scaling is not None and scaling.kind == "yarn" else 1.0
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.build_buffers()

    def build_buffers(self) -> None:
        """(Re)compute the frequencies; buffers are derived, never stored in checkpoints."""
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device="cpu") / self.dim
        device = self.inv_freq.device if not self.inv_freq.is_meta else "cpu"
        self.inv_freq = _rescaled(1.0 / (self.base**exponents), self.scaling, self.base).to(device)

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) would round the frequencies to 8 bits, turning the angle at position 1000
        # by radians; recompute them in float32 on the new device instead (what transformers keeps)
        super()._apply(fn, recurse)
        if not self.inv_freq.is_meta:
            self.build_buffers()
        return self

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """[... dim]: each position's rotation angles, in the half-split layout (Llama's; TL's rotary tables')."""
        angles = positions[..., None].float() * self.inv_freq  # [... dim/2]
        return torch.cat([angles, angles], dim=-1)

    def amplitude_at(self, positions: torch.Tensor):
        """What cos and sin are multiplied by for a call at `positions` (a float, or LongRopeRotary's 0-d tensor)."""
        return self.amplitude

    @staticmethod
    def quarter_turn(x: torch.Tensor) -> torch.Tensor:
        """Each pair (a, b) -> (-b, a): what the sines multiply. Pairs are (i, i + dim/2) here."""
        first, second = x.chunk(2, dim=-1)
        return torch.cat([-second, first], dim=-1)

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [batch pos head d_head], positions [batch pos] (None: 0, 1, ... for a block called on its own, as
        `model.blocks[l](resid)`) -> x rotated by its position."""
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)[None]
        angles = self.angles(positions)[:, :, None, :]  # [batch pos 1 dim]
        cos, sin = angles.cos(), angles.sin()
        amplitude = self.amplitude_at(positions)
        if isinstance(amplitude, torch.Tensor) or amplitude != 1.0:  # YaRN's and LongRoPE's: none for other models
            cos, sin = cos * amplitude, sin * amplitude
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rotating, passing = x[..., : self.dim], x[..., self.dim :]
        rotated = rotating * cos + self.quarter_turn(rotating) * sin
        # the whole head rotates in most models: no second copy to append an empty remainder
        return rotated if passing.shape[-1] == 0 else torch.cat([rotated, passing], dim=-1)


class AdjacentRotary(Rotary):
    """Rotary positions in the interleaved layout GPT-J and transformer-lens 4's native models use: dimension 2i is
    paired with 2i + 1 (TL's rotary_adjacent_pairs)."""

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """[... dim]: each position's rotation angles, each repeated for its pair (TL's rotary tables' layout)."""
        return (positions[..., None].float() * self.inv_freq).repeat_interleave(2, dim=-1)

    @staticmethod
    def quarter_turn(x: torch.Tensor) -> torch.Tensor:
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


class ClockwiseRotary(Rotary):
    """Half-split pairs turned the other way, by -angle (NanoChat's rotate_half, whose signs are Llama's flipped): the
    angles are negated, so TL's rotary_sin tables show the turn the forward makes."""

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        return -super().angles(positions)


class LongRopeRotary(Rotary):
    """LongRoPE (Ding et al. 2024; Phi-3's long-context models, PhiMoE): two sets of frequencies, pair i's divided by
    short_factor[i] while a call's positions stay within the pretraining context (original_n_ctx) and by
    long_factor[i] once any of them reaches past it, and cos and sin times that regime's attention factor. The regime
    is the whole call's, as transformers' (torch.max(position_ids) + 1), so a batch switches together; torch.where
    picks it, so the GPU is not waited for. A key/value cache keeps the keys rotated as their own pass was: a pass
    that crosses the threshold rotates its new keys the long way and leaves the cached ones short, as transformers'
    forward does (generation restarts the cache there, as transformers' does: probe.generation)."""

    def __init__(self, dim: int, base: float, scaling: RotaryScaling):
        super().__init__(dim, base, scaling)
        self.amplitude = scaling.attention_factor
        self.long_amplitude = (scaling.attention_factor if scaling.long_attention_factor is None
                               else scaling.long_attention_factor)

    def build_buffers(self) -> None:
        """Both regimes' frequencies, float32, as transformers' 1 / (factor * base^(2i/dim))."""
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device="cpu") / self.dim
        device = self.inv_freq.device if not self.inv_freq.is_meta else "cpu"
        short, long = (torch.tensor(f, dtype=torch.float32, device="cpu")
                       for f in (self.scaling.short_factor, self.scaling.long_factor))
        self.inv_freq = (1.0 / (short * self.base**exponents)).to(device)
        long_inv_freq = (1.0 / (long * self.base**exponents)).to(device)
        if "long_inv_freq" in self._buffers:
            self.long_inv_freq = long_inv_freq
        else:
            self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)

    def beyond(self, positions: torch.Tensor) -> torch.Tensor:
        """A 0-d bool: whether the call reaches past the pretraining context (the long regime)."""
        return positions.max() + 1 > self.scaling.original_n_ctx

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        inv_freq = torch.where(self.beyond(positions), self.long_inv_freq, self.inv_freq)
        angles = positions[..., None].float() * inv_freq  # [... dim/2]
        return torch.cat([angles, angles], dim=-1)

    def amplitude_at(self, positions: torch.Tensor):
        if self.long_amplitude == self.amplitude:
            return self.amplitude
        return torch.where(self.beyond(positions), self.long_amplitude, self.amplitude)


def make_rotary(cfg: DecoderConfig, layer: int) -> Optional[Rotary]:
    """`layer`'s rotary positions (its base and rescaling: cfg.layer_rotary), in the config's pairing; None unless
    positions are rotary and the layer rotates (cfg.rotary_layers)."""
    if not cfg.layer_rotates(layer):
        return None
    dim = cfg.layer_rotary_dim(layer)  # (global_layers' wider heads rotate whole, Laguna's windowed layers their own)
    base, scaling = cfg.layer_rotary(layer)
    if scaling is not None and scaling.kind == "longrope":
        return LongRopeRotary(dim, base, scaling)
    return (AdjacentRotary if cfg.rotary_adjacent_pairs else ClockwiseRotary if cfg.rotary_clockwise else Rotary)(
        dim, base, scaling)


def _rescaled(inv_freq: torch.Tensor, scaling: Optional[RotaryScaling], base: float) -> torch.Tensor:
    """Frequencies [dim/2] after a long-context checkpoint's rescaling (see RotaryScaling)."""
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "proportional":  # transformers counts the turning pairs as int(fraction * dim // 2)
        turning = int(scaling.rotated_fraction * (2 * inv_freq.shape[0]) // 2)
        return torch.cat([inv_freq[:turning], torch.zeros_like(inv_freq[turning:])]) / scaling.factor
    if scaling.kind == "yarn":
        return _yarn(inv_freq, scaling, base)
    if scaling.kind == "longrope":
        raise ValueError("longrope frequencies depend on the positions: rotate with LongRopeRotary (make_rotary)")
    # llama3: slow rotations (long wavelengths, which pretraining never saw complete) are slowed by
    # `factor`; fast ones kept; between, a linear blend in (pretraining context / wavelength)
    cycles = scaling.original_n_ctx * inv_freq / (2 * math.pi)  # turns within the pretraining context
    blend = ((cycles - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0, 1)
    return (1 - blend) * inv_freq / scaling.factor + blend * inv_freq


def _yarn(inv_freq: torch.Tensor, scaling: RotaryScaling, base: float) -> torch.Tensor:
    """YaRN's frequencies [dim/2]: a dimension pair i that turns fewer than beta_slow times within the pretraining
    context is interpolated (divided by factor), one turning more than beta_fast times kept, and between them a
    linear ramp in i (transformers' _compute_yarn_parameters)."""
    half = inv_freq.shape[0]
    dim = 2 * half

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times in original_n_ctx
        return dim * math.log(scaling.original_n_ctx / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    pairs = torch.arange(half, dtype=torch.float32, device=inv_freq.device)
    kept = 1 - ((pairs - low) / ((high + 0.001 if low == high else high) - low)).clamp(0, 1)  # 1: keeps its frequency
    return inv_freq / scaling.factor * (1 - kept) + inv_freq * kept
