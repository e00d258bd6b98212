"""Token and learned position embeddings, and the unembedding."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embed(nn.Module):
    def __init__(self, d_vocab: int, d_model: int):
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(d_vocab, d_model))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [batch pos] -> [batch pos d_model]
        return F.embedding(tokens, self.W_E)


class PosEmbed(nn.Module):
    def __init__(self, n_ctx: int, d_model: int):
        super().__init__()
        self.W_pos = nn.Parameter(torch.empty(n_ctx, d_model))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:  # [batch pos] -> [batch pos d_model]
        return F.embedding(positions, self.W_pos)


class Unembed(nn.Module):
    """Logits = x @ W_U. Stores W_U transposed ([vocab d_model]) so it can share the embedding's tensor."""

    def __init__(self, d_vocab: int, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_vocab, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch pos d_model] -> [batch pos vocab]
        return F.linear(x, self.weight)

    @property
    def W_U(self) -> torch.Tensor:  # [d_model vocab]
        return self.weight.T
