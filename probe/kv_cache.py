"""Keys and values kept between passes, so generation processes each new token once."""
from __future__ import annotations

from typing import Optional

import torch


class LayerKV:
    """One layer's keys and values so far, [batch pos kv_head d_head] each."""

    def __init__(self) -> None:
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1)
        self.k, self.v = k, v
        return k, v


class KVCache:
    """Every layer's keys and values, plus the attention mask of all positions seen so far."""

    def __init__(self, n_layers: int) -> None:
        self.layers = [LayerKV() for _ in range(n_layers)]
        self.attention_mask: Optional[torch.Tensor] = None  # [batch pos]: 1 = real token

    @property
    def length(self) -> int:
        k = self.layers[0].k
        return 0 if k is None else k.shape[1]

    def extend_mask(self, new_mask: torch.Tensor) -> torch.Tensor:
        """Append the new tokens' mask; returns the mask of every position, old and new."""
        if self.attention_mask is not None:
            new_mask = torch.cat([self.attention_mask, new_mask], dim=1)
        self.attention_mask = new_mask
        return new_mask
