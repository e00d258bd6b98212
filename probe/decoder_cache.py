"""DecoderCache: a decoder's activation cache with transformer-lens's ActivationCache methods."""
from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from hooks import ActivationCache


class DecoderCache(ActivationCache):
    """An ActivationCache that knows which decoder made it (by weak reference: the cache never keeps the model
    alive) and whether its tensors still have their batch dimension."""

    def __init__(self, activations: Mapping[str, torch.Tensor], model=None, has_batch_dim: bool = True):
        super().__init__(activations)
        self._model = None if model is None else weakref.ref(model)
        self.has_batch_dim = has_batch_dim
