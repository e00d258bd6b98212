"""ActivationCache: a read-only mapping from hook name to a detached activation."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Optional, Union

import torch

from probe.hooks.names import unknown_name_error


class ActivationCache(Mapping[str, torch.Tensor]):
    """Activations of one forward pass, keyed by hook name.

    Holds plain detached tensors and no reference to the model, so keeping a cache alive never
    keeps the model (or its autograd graph) alive.
    """

    _aliases: Mapping[str, str] = MappingProxyType({})  # (class defaults: caches pickled before aliases had none)
    _lists_aliases = False

    def __init__(self, activations: Mapping[str, torch.Tensor], aliases: Optional[Mapping[str, str]] = None,
                 lists_aliases: bool = False):
        self._acts = dict(activations)
        # {alias: name}: another library's names for the cached points answer too (transformer-lens 4's bridge names);
        # `lists_aliases` also lists them among the keys, once per alias of a cached point, as the bridge's cache does
        self._aliases = aliases or {}
        self._lists_aliases = lists_aliases

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._acts[name]
        except KeyError:
            pass
        if self._aliases.get(name) in self._acts:
            return self._acts[self._aliases[name]]
        raise unknown_name_error(name, list(self._acts), what="cached activation") from None

    def __iter__(self) -> Iterator[str]:
        yield from self._acts
        if self._lists_aliases:
            yield from (alias for alias, name in self._aliases.items() if name in self._acts)

    def __len__(self) -> int:
        return len(self._acts) + (sum(name in self._acts for name in self._aliases.values()) if self._lists_aliases else 0)

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
