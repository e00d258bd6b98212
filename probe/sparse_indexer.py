"""DeepSeek Sparse Attention's indexer (GLM-5; DeepSeek-AI 2025, "DeepSeek-V3.2"): latent attention whose queries read
only the `topk` earlier keys a small indexer scores highest, its points under transformer-lens 4's names (its
GlmMoeDsaAttentionBridge: `blocks.L.attn.hook_topk_indices`, `hook_dsa_mask`) and the indexer's own under
`blocks.L.attn.indexer.hook_*`.

    q_i = W_q^I latent_q                      [index_head d_index], latent_q the attention's normed query latent
    k_i = LayerNorm(W_k^I x)                  [d_index], one per position; the first d_rope dims of q_i and k_i rotated
    w = W_w x / sqrt(index_heads)             [index_head], each head's weight for the query
    score(query, key) = sum_h w_h relu(q_i[h] . k_i / sqrt(d_index))   over the keys the query may see

Each query keeps its topk best-scored keys (all of them while it sees no more); the attention adds 0 to their scores
and -inf to the others' (hook_dsa_mask), so the softmax and the values are those of the chosen keys. A layer marked
shared (GLM's indexer_types "shared") runs no indexer and reads the keys the layer before it read, as transformers
passes them on (`prev_topk_indices`): `share_key_choices` links the layers when the model is built. The indexer's keys
are kept in the KV cache (LayerKV.index_k) beside the attention's."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from einops import einsum, rearrange
from torch import nn

from probe.attention import visible_keys
from probe.config import DecoderConfig
from probe.hooks import HookPoint
from probe.kv_cache import LayerKV
from probe.latent_attention import LatentAttention

Rotate = Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


class Indexer(nn.Module):
    """Scores every visible key for each query and returns the topk best, [batch query_pos topk] (transformers'
    GlmMoeDsaIndexer; its tensors under the same names)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        spec = cfg.latent_attention
        self.n_heads, self.d_head, self.topk = spec.indexer.n_heads, spec.indexer.d_head, spec.indexer.topk
        self.d_rope = spec.d_rope
        self.wq_b = nn.Linear(spec.q_rank, self.n_heads * self.d_head, bias=False)
        self.wk = nn.Linear(cfg.d_model, self.d_head, bias=False)
        self.k_norm = nn.LayerNorm(self.d_head, eps=1e-6)  # (transformers' eps, whatever the model's)
        self.weights_proj = nn.Linear(cfg.d_model, self.n_heads, bias=False)
        self.scale = self.d_head ** -0.5
        self.hook_q = HookPoint()  # [batch pos index_head d_index]: after rotation
        self.hook_k = HookPoint()  # [batch pos d_index]: normed, after rotation; one for every index head
        self.hook_weights = HookPoint()  # [batch pos index_head]: each head's weight, times index_head^-1/2
        self.hook_scores = HookPoint()  # [batch query_pos key_pos]: float32, -inf at the keys a query cannot see

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, rotate: Rotate, positions: Optional[torch.Tensor],
                visible: torch.Tensor, past: Optional[LayerKV] = None) -> torch.Tensor:
        """The chosen keys [batch query_pos topk] (indices over every key, cached ones first) for x [batch pos
        d_model], the query latent [batch pos q_rank], the attention's `rotate` and the keys each query may see,
        `visible` [query_pos key_pos] or [batch 1 query_pos key_pos]."""
        q = rearrange(self.wq_b(q_latent), "batch pos (head d) -> batch pos head d", head=self.n_heads)
        q = self.hook_q(self._rotate_front(q, rotate, positions))
        k = self.hook_k(self._rotate_front(self.k_norm(self.wk(x))[:, :, None], rotate, positions)[:, :, 0])
        if past is not None:
            k = past.append_index_keys(k)
        # in float32 whatever the model's dtype, as transformers scores them
        per_head = einsum(q.float(), k.float(),
                          "batch query_pos head d, batch key_pos d -> batch query_pos head key_pos")
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        scores = einsum(self.hook_weights(weights), (per_head * self.scale).relu(),
                        "batch query_pos head, batch query_pos head key_pos -> batch query_pos key_pos")
        seen = visible if visible.dim() == 2 else visible[:, 0]
        scores = self.hook_scores(scores.masked_fill(~seen, float("-inf")))
        return scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices

    def _rotate_front(self, x: torch.Tensor, rotate: Rotate, positions: Optional[torch.Tensor]) -> torch.Tensor:
        """x [batch pos head d_index] with its first d_rope dimensions rotated (the indexer's rotated part leads)."""
        return torch.cat([rotate(x[..., :self.d_rope], positions), x[..., self.d_rope:]], dim=-1)


class ChoiceRelay:
    """The keys the last layer read, held for the shared layer after it within one pass (the pass's `positions`
    tensor says which pass), and let go once no layer after needs them."""

    def __init__(self) -> None:
        self.positions: Optional[torch.Tensor] = None
        self.chosen: Optional[torch.Tensor] = None

    def hand_on(self, positions: Optional[torch.Tensor], chosen: Optional[torch.Tensor]) -> None:
        self.positions, self.chosen = positions, chosen

    def take(self, positions: Optional[torch.Tensor], layer: int) -> torch.Tensor:
        if self.chosen is None or self.positions is not positions:
            raise ValueError(f"layer {layer} runs no indexer of its own: it reads the keys the layer before it chose "
                             f"in the same pass; run the model from an earlier layer that has an indexer "
                             f"(start_at_layer), or the blocks in order from there")
        return self.chosen


class SparseLatentAttention(LatentAttention):
    """Latent attention (probe.latent_attention) reading only the keys this layer's Indexer chooses."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__(cfg, layer)
        self.layer = layer
        self.make_chooser(cfg)
        self.relay = ChoiceRelay()  # one for the whole model where layers share (share_key_choices)
        self.passes_on = False  # whether the next layer reads this one's keys
        self.hook_topk_indices = HookPoint()  # [batch query_pos topk] int64: the keys each query's heads read
        self.hook_dsa_mask = HookPoint()  # [batch query_pos key_pos]: 0 at the chosen keys, -inf elsewhere; added

    def make_chooser(self, cfg: DecoderConfig) -> None:
        self.indexer = Indexer(cfg)

    def choose(self, x: torch.Tensor, q_latent: torch.Tensor, positions: Optional[torch.Tensor], visible: torch.Tensor,
               past: Optional[LayerKV]) -> torch.Tensor:
        return self.indexer(x, q_latent, self.rotate, positions, visible, past)

    def keys_read(self, x, q_latent: torch.Tensor, positions: Optional[torch.Tensor], allowed: Optional[torch.Tensor],
                  past: Optional[LayerKV]) -> torch.Tensor:
        """The additive mask [batch 1 query_pos key_pos]: 0 at the chosen keys a query may see, -inf elsewhere."""
        if not isinstance(x, torch.Tensor):
            raise ValueError("a sparse indexer chooses the keys of every head at once from one input, so heads cannot "
                             "read inputs of their own here (hook_attn_in / hook_q_input / hook_k_input / "
                             "hook_v_input, use_split_qkv_input); hook ln1.hook_out, or each head's hook_q / hook_k / "
                             "hook_v, instead")
        visible = visible_keys(allowed, True, x.shape[1], x.device)
        chosen = self.hook_topk_indices(self.choose(x, q_latent, positions, visible, past))
        self.relay.hand_on(positions, chosen if self.passes_on else None)
        batch, n_keys = x.shape[0], visible.shape[-1]
        dsa = x.new_full((batch, x.shape[1], n_keys), float("-inf")).scatter(-1, chosen, 0.0)
        return self.hook_dsa_mask(dsa)[:, None].masked_fill(~visible, self.masked_score)

    @property
    def readers(self) -> list[nn.Linear]:
        """The layers that read the normed residual (what fold_ln folds ln1 into): the indexer's key and weights too."""
        indexer = getattr(self, "indexer", None)
        return super().readers + ([] if indexer is None else [indexer.wk, indexer.weights_proj])


class SharedChoiceLatentAttention(SparseLatentAttention):
    """A layer without an indexer: it reads the keys the layer before it read (GLM's "shared" layers)."""

    def make_chooser(self, cfg: DecoderConfig) -> None:
        pass

    def choose(self, x: torch.Tensor, q_latent: torch.Tensor, positions: Optional[torch.Tensor], visible: torch.Tensor,
               past: Optional[LayerKV]) -> torch.Tensor:
        return self.relay.take(positions, self.layer)


def make_latent_attention(cfg: DecoderConfig, layer: int) -> LatentAttention:
    """`layer`'s latent attention: plain, with an indexer of its own, or reading the layer before's keys."""
    indexer = cfg.latent_attention.indexer
    if indexer is None:
        return LatentAttention(cfg, layer)
    return (SharedChoiceLatentAttention if indexer.layer_shared(layer) else SparseLatentAttention)(cfg, layer)


def share_key_choices(cfg: DecoderConfig, blocks) -> None:
    """Link the layers of `blocks` that read an earlier layer's keys to it: one relay, filled by each layer a shared
    one follows."""
    indexer = cfg.latent_attention.indexer if cfg.latent_attention is not None else None
    if indexer is None or not any(indexer.shared):
        return
    relay = ChoiceRelay()
    for layer, block in enumerate(blocks):
        block.attn.relay = relay
        block.attn.passes_on = layer + 1 < len(blocks) and indexer.shared[layer + 1]
