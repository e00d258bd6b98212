"""Multi-head causal self-attention with every intermediate exposed as a hook point."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import nn

from hooks import HookPoint
from probe.config import DecoderConfig


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.n_heads, self.d_head = cfg.n_heads, cfg.d_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.n_heads * cfg.d_head)  # q, k, v of every head in one matmul
        self.out = nn.Linear(cfg.n_heads * cfg.d_head, cfg.d_model)
        self.scale = cfg.d_head**-0.5
        self.hook_q = HookPoint()  # [batch pos head d_head]
        self.hook_k = HookPoint()  # [batch pos head d_head]
        self.hook_v = HookPoint()  # [batch pos head d_head]
        self.hook_attn_scores = HookPoint()  # [batch head query_pos key_pos]: scaled, masked (-inf), pre-softmax
        self.hook_pattern = HookPoint()  # [batch head query_pos key_pos]
        self.hook_z = HookPoint()  # [batch pos head d_head]: pattern-weighted values
        self.hook_result = HookPoint(opt_in=True)  # [batch pos head d_model]: each head's write, without b_O

    def forward(self, x: torch.Tensor, allowed: Optional[torch.Tensor]) -> torch.Tensor:
        """`allowed` [batch 1 query_pos key_pos] says which keys each query may see; None means causal only."""
        q, k, v = rearrange(
            self.qkv(x), "batch pos (three head d_head) -> three batch pos head d_head", three=3, head=self.n_heads
        )
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        if self.hook_attn_scores.active or self.hook_pattern.active:
            z = self._attend_explicitly(q, k, v, allowed)
        else:  # nothing observes the pattern: let the fused kernel avoid materialising it
            z = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=allowed, is_causal=allowed is None, scale=self.scale,
            ).transpose(1, 2)
        z = self.hook_z(z)
        if self.hook_result.active:
            result = self.hook_result(
                einsum(z, self.W_O, "batch pos head d_head, head d_head d_model -> batch pos head d_model")
            )
            return result.sum(dim=2) + self.out.bias
        return self.out(rearrange(z, "batch pos head d_head -> batch pos (head d_head)"))

    def _attend_explicitly(self, q, k, v, allowed):
        scores = einsum(q, k, "batch query_pos head d_head, batch key_pos head d_head -> batch head query_pos key_pos")
        if allowed is None:
            n = q.shape[1]
            allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = self.hook_attn_scores((scores * self.scale).masked_fill(~allowed, float("-inf")))
        pattern = self.hook_pattern(scores.softmax(dim=-1))
        return einsum(pattern, v, "batch head query_pos key_pos, batch key_pos head d_head -> batch query_pos head d_head")

    # Per-head views of the weights, in the shapes interpretability code expects.
    def _qkv_weight(self, index: int) -> torch.Tensor:
        w = rearrange(self.qkv.weight, "(three head d_head) d_model -> three head d_model d_head", three=3, head=self.n_heads)
        return w[index]

    @property
    def W_Q(self) -> torch.Tensor:  # [head d_model d_head]
        return self._qkv_weight(0)

    @property
    def W_K(self) -> torch.Tensor:  # [head d_model d_head]
        return self._qkv_weight(1)

    @property
    def W_V(self) -> torch.Tensor:  # [head d_model d_head]
        return self._qkv_weight(2)

    @property
    def W_O(self) -> torch.Tensor:  # [head d_head d_model]
        return rearrange(self.out.weight, "d_model (head d_head) -> head d_head d_model", head=self.n_heads)

    @property
    def b_O(self) -> torch.Tensor:  # [d_model]
        return self.out.bias
