"""Random weights for the toy-model tests, as a trained model's are: every path matters, norm weights near 1."""
from __future__ import annotations

import torch

from probe import HookedDecoder


def randomised(model: HookedDecoder, seed: int) -> HookedDecoder:
    """`model` in eval mode with fresh weights: norm weights 1 + 0.2 N(0, 1) (a dropped norm would show), the rest
    0.3 N(0, 1), large enough that attention is sharp."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if name.endswith(".w") else 0.3 * noise)
    return model.eval()
