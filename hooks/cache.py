"""ActivationCache: a read-only mapping from hook name to a detached activation."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Optional, Union

import torch

from probe.hooks.names import unknown_name_error


class ActivationCache(Mapping[str, torch.Tensor]):
    """Activations of one forward pass, keyed by hook name.

    Holds plain detached tensors and no reference to the model, so keeping a cache alive never
    keeps the model (or its autograd graph) alive.
    """

    def __init__(self, activations: Mapping[str, torch.Tensor]):
        self._acts = dict(activations)

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._acts[name]
        except KeyError:
            raise unknown_name_error(name, list(self._acts), what="cached activation") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._acts)

    def __len__(self) -> int:
        return len(self._acts)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} activations, {self.nbytes / 2**20:.1f} MiB)"

    @property
    def cache_dict(self) -> dict[str, torch.Tensor]:
        """The name -> tensor dict itself, as transformer-lens's `cache.cache_dict` (an edit shows in the cache)."""
        return self._acts

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._acts.values())

    def to(self, device: Optional[Union[str, torch.device]] = None, dtype: Optional[torch.dtype] = None) -> "ActivationCache":
        """Every tensor moved (floating ones also cast when dtype is given), in place, and the cache returned: as
        transformer-lens's `cache.to(device)`, whose users write it as a statement (`cache.to("cpu")` frees the GPU)."""
        self._acts = {name: stored_tensor(t, device, dtype) for name, t in self._acts.items()}
        return self


def stored_tensor(t: torch.Tensor, device, dtype) -> torch.Tensor:
    """`t` detached, moved to `device` (None: where it is) and, if floating, cast to `dtype` (None: as it is)."""
    t = t.detach()
    if dtype is not None and t.is_floating_point():
        return t.to(device=device, dtype=dtype)
    return t.to(device=device) if device is not None else t
