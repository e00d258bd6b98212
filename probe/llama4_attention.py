"""Llama 4's attention layers (DecoderConfig.chunked_attention): in the rotary layers q and k are normalised after
their rotation by their RMS over d_head, with no weight; in the layers without positions (NoPE) the queries are scaled
up with the position (attention temperature tuning, Nakanishi 2025), so that scores stay sharp over long contexts.
Which keys a layer sees (its chunk, or every earlier one) is its mask's business (probe.inputs.allowed_keys)."""
from __future__ import annotations

from typing import Optional

import torch

from probe.attention import Attention
from probe.config import DecoderConfig
from probe.hooks import HookPoint
from probe.norm import RMSNorm


class Llama4Attention(Attention):
    """Attention's hook points, and: on a rotary layer with the q/k norm, hook_q_normed / hook_k_normed after
    hook_rot_q / hook_rot_k (each norm's hook_scale and hook_normalized inside, q_norm and k_norm); on a NoPE layer
    with temperature tuning, hook_q_scaled, the queries times each position's temperature, what the scores read."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__(cfg, layer)
        spec = cfg.chunked_attention
        rotates = cfg.layer_rotates(layer)
        if spec.qk_norm and rotates:  # (transformers' one weightless module, applied to each)
            self.q_norm, self.k_norm = (RMSNorm(self.d_head, cfg.eps, learned=False) for _ in "qk")
            self.hook_q_normed = HookPoint()  # [batch pos head d_head]
            self.hook_k_normed = HookPoint()  # [batch pos kv_head d_head]
            self.norm_after_rope = True
        self.floor_scale = None if rotates else spec.floor_scale
        self.attn_scale = spec.attn_scale
        if self.floor_scale is not None:
            self.hook_q_scaled = HookPoint()  # [batch pos head d_head]: the queries times their position's temperature

    def attend(self, x, q, k, v, positions, key_positions, allowed) -> torch.Tensor:
        if self.floor_scale is not None:
            q = self.hook_q_scaled((q * self.temperature(positions, q)).to(q.dtype))
        return super().attend(x, q, k, v, positions, key_positions, allowed)

    def temperature(self, positions: Optional[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
        """[batch pos 1 1]: 1 + attn_scale * log(1 + floor((pos + 1) / floor_scale)) at each query's position, in
        float32 as transformers computes it (1 below position floor_scale - 1)."""
        if positions is None:
            positions = torch.arange(q.shape[1], device=q.device).expand(q.shape[0], -1)
        steps = torch.floor((positions.float() + 1.0) / self.floor_scale)
        return (torch.log1p(steps) * self.attn_scale + 1.0)[:, :, None, None]
