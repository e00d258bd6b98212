"""Token embeddings, the position schemes (learned, sinusoidal, rotary, ALiBi), and the unembedding."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from probe.config import DecoderConfig, Norm, Positions, RotaryScaling
from probe.hooks import HookPoint
from probe.norm import make_norm
from probe.softcap import make_softcap
from probe.tl_weights import WritableWeights, weight_view


class Embed(nn.Module):
    """Token embeddings; `scale` (Gemma: sqrt(d_model)) multiplies them, rounded to the weights' dtype as Gemma does."""

    def __init__(self, d_vocab: int, d_model: int, scale: Optional[float] = None):
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(d_vocab, d_model))
        self.scale = scale
        self.hook_in = HookPoint(bridge_only=True)  # [batch pos] token ids, as transformer-lens 4's embed.hook_in

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [batch pos] -> [batch pos d_model]
        embedded = F.embedding(self.hook_in(tokens), self.W_E)
        if self.scale is None:
            return embedded
        return embedded * torch.tensor(self.scale, dtype=embedded.dtype, device=embedded.device)


class NormedEmbed(Embed):
    """Token embeddings through a LayerNorm of their own, `embed.ln` (Bloom's word_embeddings_layernorm;
    transformer-lens's post_embedding_ln): hook_embed holds its output, as in transformer-lens."""

    def __init__(self, d_vocab: int, d_model: int, norm: nn.Module):
        super().__init__(d_vocab, d_model)
        self.ln = norm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.ln(super().forward(tokens))


def make_embed(cfg: DecoderConfig) -> Embed:
    """The token embedding: scaled (Gemma), or through a LayerNorm whatever the blocks' norms (cfg.embed_norm: Bloom;
    transformer-lens builds a LayerNorm there too), or plain."""
    if cfg.embed_norm:
        return NormedEmbed(cfg.d_vocab, cfg.d_model, make_norm(cfg, ends=True, kind=Norm.LAYER))
    return Embed(cfg.d_vocab, cfg.d_model, math.sqrt(cfg.d_model) if cfg.scale_embed else None)


def check_shortformer_pos_embed(cfg, given: Optional[torch.Tensor], from_tokens: bool, batch_pos) -> Optional[torch.Tensor]:
    """A run's shortformer_pos_embed (transformer-lens's keyword), checked against `cfg` and the run; None if not given."""
    if given is None:
        return None
    if cfg.positions is not Positions.SHORTFORMER:
        raise ValueError(f"shortformer_pos_embed is for shortformer models; this one's positions are "
                         f"{cfg.positional_embedding_type!r}: leave it out")
    if from_tokens:
        raise ValueError("shortformer_pos_embed goes with start_at_layer (a run from a residual); from tokens the "
                         "model computes its positions itself: leave it out")
    want = (*batch_pos, cfg.d_model)
    if tuple(given.shape) != want:
        raise ValueError(f"shortformer_pos_embed has shape {tuple(given.shape)}; this run needs {list(want)} "
                         f"[batch pos d_model]")
    return given


class AbsolutePositions(nn.Module):
    """What the absolute schemes share: each token adds W_pos [n_ctx d_model] at its position."""

    def __init__(self):
        super().__init__()
        # [batch pos] position ids, as transformer-lens 4's pos_embed.hook_in ([1 pos] there when nothing is padded)
        self.hook_in = HookPoint(bridge_only=True)

    def place(self, resid: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(the residual entering block 0, what every layer adds to its queries' and keys' inputs): these schemes
        add the positions to the residual stream."""
        return resid + pos, None

    def forward(self, tokens: torch.Tensor, past_kv_pos_offset: int = 0, attention_mask: Optional[torch.Tensor] = None,
                *, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[batch pos] -> [batch pos d_model]. The model passes each token's `positions`. Called as transformer-lens
        code calls it (`model.pos_embed(tokens)`), positions count from `past_kv_pos_offset`, or along the real tokens
        of `attention_mask` ([batch past+pos], 1 = real), and padding gets zeros, as TL's PosEmbed gives."""
        if positions is not None:
            return F.embedding(self.hook_in(positions), self.W_pos)
        batch, n = tokens.shape[:2]
        window = slice(past_kv_pos_offset, past_kv_pos_offset + n)
        if attention_mask is None:  # a lookup, not a slice of W_pos: the caller may edit what it gets
            at = torch.arange(window.start, window.stop, device=self.W_pos.device).expand(batch, n)
            return F.embedding(self.hook_in(at), self.W_pos)
        attention_mask = attention_mask.to(self.W_pos.device)
        at = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)[:, window]
        real = attention_mask[:, window].bool()[..., None]
        return torch.where(real, F.embedding(self.hook_in(at), self.W_pos), 0.0)


class PosEmbed(AbsolutePositions):
    """Learned absolute positions: one trained vector per position."""

    def __init__(self, n_ctx: int, d_model: int):
        super().__init__()
        self.W_pos = nn.Parameter(torch.empty(n_ctx, d_model))


class ShortformerPosEmbed(PosEmbed):
    """Learned positions that every attention layer adds to its queries' and keys' inputs, after ln1; the residual
    stream and the values never hold them (Press et al. 2021; transformer-lens's "shortformer")."""

    def place(self, resid: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return resid, pos


class SinusoidalPosEmbed(AbsolutePositions):
    """Fixed absolute positions (Vaswani et al. 2017): sin on even dimensions, cos on odd ones."""

    def __init__(self, n_ctx: int, d_model: int):
        super().__init__()
        self.n_ctx, self.d_model = n_ctx, d_model
        self.register_buffer("W_pos", torch.empty(n_ctx, d_model), persistent=False)
        self.build_buffers()

    def build_buffers(self) -> None:
        """(Re)compute the table; buffers are derived, never stored in checkpoints."""
        n_ctx, d_model = self.n_ctx, self.d_model
        position = torch.arange(n_ctx, dtype=torch.float64, device="cpu")[:, None]
        frequency = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64, device="cpu") * (-math.log(10000.0) / d_model))
        table = torch.zeros(n_ctx, d_model, dtype=torch.float64, device="cpu")
        table[:, 0::2] = torch.sin(position * frequency)
        table[:, 1::2] = torch.cos(position * frequency)[:, : d_model // 2]
        device = self.W_pos.device if not self.W_pos.is_meta else "cpu"
        self.W_pos = table.to(device=device, dtype=torch.float32)


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
    # a layer with heads of its own width (global_layers) rotates whole heads as the others do
    dim = cfg.layer_d_head(layer) if cfg.rotary_dim == cfg.d_head else cfg.rotary_dim
    base, scaling = cfg.layer_rotary(layer)
    if scaling is not None and scaling.kind == "longrope":
        return LongRopeRotary(dim, base, scaling)
    return (AdjacentRotary if cfg.rotary_adjacent_pairs else Rotary)(dim, base, scaling)


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


class Alibi(nn.Module):
    """ALiBi (Press et al. 2022): head h adds slope_h * (key position - query position) to its scores, so attention
    fades with distance at a rate of its own. The slopes are Bloom's (Press et al.'s reference code): for 2^k heads
    2^(-8/2^k), its square, its cube, ...; otherwise those of the largest power of two below n_heads, then every other
    one of twice as many heads. Positions count real tokens (padding skipped, a KV cache continued); a later key's
    distance reads 0, as transformer-lens clamps it (causal attention never sees it)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.register_buffer("slopes", torch.empty(n_heads), persistent=False)  # [head]
        self.build_buffers()

    def build_buffers(self) -> None:  # derived, never stored in checkpoints
        device = self.slopes.device if not self.slopes.is_meta else "cpu"
        self.slopes = torch.tensor(alibi_slopes(self.n_heads), dtype=torch.float32, device=device)

    def _apply(self, fn, recurse=True):  # kept in float32, as transformers' Bloom computes its bias
        super()._apply(fn, recurse)
        if not self.slopes.is_meta:
            self.build_buffers()
        return self

    def forward(self, query_positions: Optional[torch.Tensor], key_positions: Optional[torch.Tensor],
                n_query: int, n_key: int) -> torch.Tensor:
        """[batch head query_pos key_pos] (batch 1 without positions: the last n_query of 0 .. n_key - 1)."""
        if key_positions is None:
            key_positions = torch.arange(n_key, device=self.slopes.device)[None]
        if query_positions is None:
            query_positions = key_positions[:, n_key - n_query:]
        distance = (key_positions[:, None, :] - query_positions[:, :, None]).clamp(max=0)  # [batch query_pos key_pos]
        return self.slopes[:, None, None] * distance[:, None].float()


def alibi_slopes(n_heads: int) -> list[float]:
    """Each head's ALiBi slope (see Alibi), computed as transformers' build_alibi_tensor computes them."""
    def series(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    below = 2 ** int(math.floor(math.log2(n_heads)))
    return series(below) + series(2 * below)[0::2][: n_heads - below]


def make_alibi(cfg: DecoderConfig, n_heads: int) -> Optional[Alibi]:
    return Alibi(n_heads) if cfg.positions is Positions.ALIBI else None


def make_pos_embed(cfg: DecoderConfig) -> nn.Module | None:
    """The absolute position embedding added at the input; None when positions act inside attention (rotary, ALiBi)."""
    return {
        Positions.LEARNED: lambda: PosEmbed(cfg.n_ctx, cfg.d_model),
        Positions.SINUSOIDAL: lambda: SinusoidalPosEmbed(cfg.n_ctx, cfg.d_model),
        Positions.ROTARY: lambda: None,
        Positions.ALIBI: lambda: None,
        Positions.SHORTFORMER: lambda: ShortformerPosEmbed(cfg.n_ctx, cfg.d_model),
    }[cfg.positions]()


class Unembed(WritableWeights, nn.Module):
    """Logits = x @ W_U. Stores W_U transposed ([vocab d_model]) so it can share the embedding's tensor."""

    def __init__(self, d_vocab: int, d_model: int, bias: bool = False, softcap: Optional[float] = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_vocab, d_model))
        self.bias = nn.Parameter(torch.zeros(d_vocab)) if bias else None  # [vocab]
        self.cap = make_softcap(softcap)  # Gemma 2 caps its logits; everything that unembeds gets the same logits
        # transformer-lens 3.9's and the bridge's points (a cache of everything holds them there too)
        self.hook_in = HookPoint()  # [batch pos d_model]: what the unembedding reads, after the final norm
        self.hook_out = HookPoint()  # [batch pos vocab]: the logits before a soft cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch pos d_model] -> [batch pos vocab]
        return self.cap(self.hook_out(self.uncapped(self.hook_in(x))))

    def uncapped(self, x: torch.Tensor) -> torch.Tensor:
        """The logits before a soft cap: linear in x, what direct attributions add up to."""
        return F.linear(x, self.weight, self.bias)

    @weight_view
    def W_U(self) -> torch.Tensor:  # [d_model vocab]
        return self.weight.T

    @property
    def b_U(self) -> torch.Tensor:  # [vocab]: zeros without an unembedding bias, as transformer-lens's
        return self.weight.new_zeros(self.weight.shape[0]) if self.bias is None else self.bias
