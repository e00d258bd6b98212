"""ActivationCache: a read-only mapping from hook name to a detached activation."""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
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
    _listed: Optional[tuple[str, ...]] = None

    def __init__(self, activations: Mapping[str, torch.Tensor], aliases: Optional[Mapping[str, str]] = None,
                 listed: Optional[Sequence[str]] = None):
        self._acts = dict(activations)
        # {alias: name}: another library's names for the cached points (transformer-lens 4's bridge names) answer too
        self._aliases = aliases or {}
        # the names the cache lists, as its caller selected the points by them (aliases among them); None: their own
        self._listed = None if listed is None else tuple(listed)

    def own_name(self, name: str) -> Optional[str]:
        """The stored name `name` stands for (itself, or the point an alias names; `<alias>_grad` its gradient's), or
        None when nothing under it is stored."""
        if name in self._acts:
            return name
        target = self._aliases.get(name)
        if target is None and isinstance(name, str) and name.endswith("_grad"):
            target = self._aliases.get(name[:-len("_grad")])
            target = None if target is None else target + "_grad"
        return target if target in self._acts else None

    def __getitem__(self, name: str) -> torch.Tensor:
        own = self.own_name(name)
        if own is None:
            raise unknown_name_error(name, list(self), what="cached activation")
        return self._acts[own]

    def __iter__(self) -> Iterator[str]:
        if self._listed is None:
            yield from self._acts
            return
        listed = [name for name in self._listed if self.own_name(name) is not None]
        yield from listed
        yield from (name + "_grad" for name in listed if self.own_name(name + "_grad") is not None)

    def __len__(self) -> int:
        return len(self._acts) if self._listed is None else sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} activations, {self.nbytes / 2**20:.1f} MiB)"

    @property
    def cache_dict(self) -> dict[str, torch.Tensor]:
        """The name -> tensor dict itself, as transformer-lens's `cache.cache_dict` (an edit shows in the cache); for
        a cache that lists other names than the points' own (bridge names), a dict of what it lists."""
        return self._acts if self._listed is None else dict(self.items())

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
