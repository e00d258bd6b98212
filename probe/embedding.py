"""Token embeddings, the absolute position schemes (learned, sinusoidal) and ALiBi, and the unembedding; rotary
positions are probe.rotary's."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from probe.config import DecoderConfig, Norm, Positions
from probe.hooks import HookPoint
from probe.norm import NORMS, make_norm
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
    """Token embeddings through a norm of their own, `embed.ln` (Bloom's word_embeddings_layernorm, transformer-lens's
    post_embedding_ln; NanoChat's weightless RMSNorm): hook_embed holds its output, as in transformer-lens."""

    def __init__(self, d_vocab: int, d_model: int, norm: nn.Module):
        super().__init__(d_vocab, d_model)
        self.ln = norm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.ln(super().forward(tokens))


def make_embed(cfg: DecoderConfig) -> Embed:
    """The token embedding: scaled (Gemma), or through a norm of its own (cfg.embed_norm: a learned LayerNorm whatever
    the blocks' norms, as Bloom and transformer-lens build it, or a weightless one of the kind named), or plain."""
    if cfg.embed_norm is True:
        return NormedEmbed(cfg.d_vocab, cfg.d_model, make_norm(cfg, ends=True, kind=Norm.LAYER))
    if cfg.embed_norm:
        return NormedEmbed(cfg.d_vocab, cfg.d_model, NORMS[cfg.embed_norm](cfg.d_model, cfg.eps, learned=False, ends=True))
    return Embed(cfg.d_vocab, cfg.d_model, cfg.embed_scale)


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

    def w_u_input(self, x: torch.Tensor) -> torch.Tensor:
        """What W_U multiplies when the unembedding reads x: x itself (a prediction head's output: prediction_head)."""
        return x

    @weight_view
    def W_U(self) -> torch.Tensor:  # [d_model vocab]
        return self.weight.T

    @property
    def b_U(self) -> torch.Tensor:  # [vocab]: zeros without an unembedding bias, as transformer-lens's
        return self.weight.new_zeros(self.weight.shape[0]) if self.bias is None else self.bias
