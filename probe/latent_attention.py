"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, Youtu; DeepSeek-AI 2024), every intermediate hooked
under transformer-lens 4's names (its MLAAttentionBridge: `blocks.L.attn.hook_q_latent`, `hook_kv_latent`, ...).

    q = W_qb norm(W_qa x)  (or W_q x)           [head d_qk]: d_nope dimensions, then d_rope rotated ones
    latent, k_rope = W_kva x                    latent [kv_rank] normalised (hook_kv_latent); k_rope [d_rope], rotated
    k_nope, v = W_kvb latent                    per head: [d_nope] and [d_head]
    k = k_nope ++ k_rope                        k_rope the same for every head

then causal softmax attention with scale d_qk^-1/2 (times YaRN's mscale^2) and W_O over each head's z, as in
probe.attention. The keys and values kept between passes are the expanded ones, per head, so hook_k and hook_v see
only the new positions, as elsewhere.

While heads read their own inputs (hook_q_input / hook_k_input / hook_v_input, transformer-lens's
use_split_qkv_input), each head computes its query, key and value latents from its own copy of the residual: the
latents gain a head axis, hook_rot_k has one per head, and hook_kv_latent is not called (keys and values no longer
share one latent)."""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import nn

from probe.attention import PerHeadInputs, attention_softmax, visible_keys
from probe.config import DecoderConfig
from probe.rotary import AdjacentRotary, Rotary
from probe.hooks import HookPoint, observed
from probe.kv_cache import LayerKV
from probe.norm import RMSNorm
from probe.tl_weights import WritableWeights, bias_view, weight_view


def masked(scores: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    """`scores` [batch head query_pos key_pos] under `mask`: a bool one hides its False keys (set to `fill`), a float one
    (a sparse indexer's, probe.sparse_indexer) is added."""
    return scores.masked_fill(~mask, fill) if mask.dtype == torch.bool else scores + mask


def rows_per_head(linear: nn.Linear, x: torch.Tensor, heads: int, width: int) -> torch.Tensor:
    """[batch pos head width]: `linear` (bias-free) with its output rows split into `heads` blocks of `width`, applied
    to x [batch pos d_in], or head h's block to x[:, :, h] where x [batch pos head d_in] has a head axis."""
    if x.dim() == 3:
        return rearrange(linear(x), "batch pos (head width) -> batch pos head width", head=heads)
    w = linear.weight.view(heads, width, -1)
    return einsum(x, w, "batch pos head d_in, head width d_in -> batch pos head width")


class LatentAttention(WritableWeights, nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__()
        spec = cfg.latent_attention
        self.n_heads = self.n_kv_heads = self.hooked_kv_heads = cfg.n_heads  # every head its own keys and values
        self.d_head, self.d_nope, self.d_rope, self.kv_rank = cfg.d_head, spec.d_nope, spec.d_rope, spec.kv_rank
        self.window, self.n_ctx = None, cfg.n_ctx
        d_qk = spec.d_qk
        if spec.q_rank is None:
            self.q_proj = nn.Linear(cfg.d_model, self.n_heads * d_qk, bias=False)
        else:  # the queries' own low-rank path
            self.q_a_proj = nn.Linear(cfg.d_model, spec.q_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(spec.q_rank, spec.latent_eps, ends=True)  # (ends: the bridge's names)
            self.q_b_proj = nn.Linear(spec.q_rank, self.n_heads * d_qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.d_model, spec.kv_rank + spec.d_rope, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(spec.kv_rank, spec.latent_eps, ends=True)
        self.kv_b_proj = nn.Linear(spec.kv_rank, self.n_heads * (spec.d_nope + cfg.d_head), bias=False)
        self.out = nn.Linear(self.n_heads * cfg.d_head, cfg.d_model, bias=cfg.out_bias)
        self.scale = d_qk ** -0.5 * spec.mscale ** 2
        self.rotary = (AdjacentRotary if cfg.rotary_adjacent_pairs else Rotary)(spec.d_rope, *cfg.layer_rotary(layer))
        self.deinterleaved = spec.deinterleaved
        self.masked_score = float("-inf")
        self.hook_q_latent = HookPoint() if spec.q_rank is not None else nn.Identity()  # [batch pos q_rank], normed
        self.hook_kv_latent = HookPoint()  # [batch pos kv_rank]: the normed latent keys and values are read from
        self.hook_rot_q = HookPoint()  # [batch pos head d_rope]: the queries' rotated part
        self.hook_rot_k = HookPoint()  # [batch pos 1 d_rope]: the keys' rotated part, one for every head
        self.hook_q = HookPoint()  # [batch pos head d_qk]: nope ++ rotated, what the scores read
        self.hook_k = HookPoint()  # [batch pos head d_qk]
        self.hook_v = HookPoint()  # [batch pos head d_head]
        self.hook_attn_scores = HookPoint()  # [batch head query_pos key_pos]: scaled, masked, pre-softmax
        self.hook_pattern = HookPoint()  # [batch head query_pos key_pos]
        self.hook_z = HookPoint()  # [batch pos head d_head]: pattern-weighted values
        self.hook_result = HookPoint(opt_in=True)  # [batch pos head d_model]: each head's write, without b_O

    def forward(self, x: Union[torch.Tensor, PerHeadInputs], positions: Optional[torch.Tensor] = None,
                allowed: Optional[torch.Tensor] = None, past: Optional[LayerKV] = None,
                qk_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As probe.attention.Attention's forward (x [batch pos d_model] or each head's own inputs); no shortformer
        positions (qk_pos), which the config refuses with latent attention."""
        q_in, k_in, v_in = (x, x, x) if isinstance(x, torch.Tensor) else x
        q_latent = self._query_latent(q_in)
        q_nope, q_rope = self._queries(q_latent).split([self.d_nope, self.d_rope], dim=-1)
        k_nope, k_rope, v = self._keys_values(k_in, v_in)
        q_rope, k_rope = self.hook_rot_q(self.rotate(q_rope, positions)), self.hook_rot_k(self.rotate(k_rope, positions))
        q = self.hook_q(torch.cat([q_nope, q_rope], dim=-1))
        k = self.hook_k(torch.cat([k_nope, k_rope.expand(*k_nope.shape[:-1], -1)], dim=-1))
        v = self.hook_v(v)
        if past is not None:
            k, v, _ = past.append(k, v)
        allowed = self.keys_read(x, q_latent, positions, allowed, past)
        if observed(self.hook_attn_scores) or observed(self.hook_pattern):
            scores = einsum(q, k, "batch query_pos head d_qk, batch key_pos head d_qk -> batch head query_pos key_pos")
            visible = visible_keys(allowed, True, q.shape[1], q.device)
            scores = self.hook_attn_scores(masked(scores * self.scale, visible, self.masked_score))
            pattern = self.hook_pattern(attention_softmax(scores, None))
            z = einsum(pattern, v, "batch head query_pos key_pos, batch key_pos head d_head -> batch query_pos head d_head")
        else:
            z = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=allowed, is_causal=allowed is None,
                                               scale=self.scale).transpose(1, 2)
        z = self.hook_z(z)
        if observed(self.hook_result):
            result = self.hook_result(
                einsum(z, self.W_O, "batch pos head d_head, head d_head d_model -> batch pos head d_model"))
            return result.sum(dim=2) + (self.out.bias if self.out.bias is not None else 0.0)
        return self.out(rearrange(z, "batch pos head d_head -> batch pos (head d_head)"))

    def keys_read(self, x, q_latent: torch.Tensor, positions: Optional[torch.Tensor], allowed: Optional[torch.Tensor],
                  past: Optional[LayerKV]) -> Optional[torch.Tensor]:
        """The mask of the keys each query reads: `allowed` as the model gave it (every visible key); a sparse
        indexer's subclass (probe.sparse_indexer) narrows it."""
        return allowed

    def _query_latent(self, x: torch.Tensor) -> torch.Tensor:
        """The normed query latent [batch pos q_rank] from x [batch pos d_model] (or, per head, [... head q_rank]);
        x itself where the queries are read straight from the residual (no q_rank)."""
        if hasattr(self, "q_proj"):
            return x
        return self.hook_q_latent(self.q_a_layernorm(self.q_a_proj(x)))

    def _queries(self, latent: torch.Tensor) -> torch.Tensor:
        """[batch pos head d_qk] from the query latent (or x itself: _query_latent)."""
        return rows_per_head(getattr(self, "q_proj", None) or self.q_b_proj, latent, self.n_heads,
                             self.d_nope + self.d_rope)

    def _keys_values(self, k_in: torch.Tensor, v_in: torch.Tensor):
        """(k_nope [batch pos head d_nope], k_rope [batch pos 1 d_rope] or, from per-head inputs, [... head d_rope],
        v [batch pos head d_head]): from one latent, or from the keys' and values' own inputs per head."""
        shared = k_in.dim() == 3  # one input for all: x itself, not per-head copies
        latent, k_rope = self.kv_a_proj_with_mqa(k_in).split([self.kv_rank, self.d_rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        width = self.d_nope + self.d_head
        if shared:  # one up-projection gives both: each head's key rows, then its value rows (slices, not split(),
            # so a hook may edit hook_v in place, as in probe.attention)
            kv = rows_per_head(self.kv_b_proj, self.hook_kv_latent(latent), self.n_heads, width)
            return kv[..., :self.d_nope], k_rope.unsqueeze(2), kv[..., self.d_nope:]
        k_nope = rows_per_head(self.kv_b_proj, latent, self.n_heads, width)[..., :self.d_nope]
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(v_in)[..., :self.kv_rank])  # the values' own inputs
        v = rows_per_head(self.kv_b_proj, latent, self.n_heads, width)[..., self.d_nope:]
        return k_nope, k_rope, v

    def rotate(self, x: torch.Tensor, positions: Optional[torch.Tensor]) -> torch.Tensor:
        """x [batch pos head d_rope] rotated by its positions, laid out as the checkpoint's keys are."""
        rotated = self.rotary(x, positions)
        # DeepSeek-V3 writes each rotated pair (2i, 2i + 1) back evens first, then odds: the same scores, but the
        # layout its keys (and the bridge's hooks) hold
        return torch.cat([rotated[..., 0::2], rotated[..., 1::2]], dim=-1) if self.deinterleaved else rotated

    @property
    def readers(self) -> list[nn.Linear]:
        """The layers that read the normed residual (what fold_ln folds ln1 into)."""
        return [getattr(self, "q_proj", None) or self.q_a_proj, self.kv_a_proj_with_mqa]

    @weight_view
    def W_O(self) -> torch.Tensor:  # [head d_head d_model]
        return self.out.weight.t().unflatten(0, (-1, self.d_head))

    @bias_view(lambda attn: attn.out.weight.shape[:1])
    def b_O(self) -> torch.Tensor:  # [d_model], zeros without an output bias
        return self.out.bias

    def __getattr__(self, name: str):
        if name in ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "QK", "OV", "qkv"):
            raise AttributeError(f"latent attention has no {name}: its queries, keys and values are read through "
                                 "normalised low-rank latents (q_a_proj, kv_a_proj_with_mqa, kv_b_proj), not one linear "
                                 "map per head; read the activations (hook_q, hook_k, hook_v) or those projections")
        return super().__getattr__(name)
