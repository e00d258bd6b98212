"""HookedRootModule: gives any nn.Module built from HookPoints named hooks, scoped hooking and caching."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional, Union

import torch
from torch import nn

from hooks.cache import ActivationCache, _store
from hooks.hook_point import HookFn, HookPoint
from hooks.names import unknown_name_error

NameFilter = Union[str, Sequence[str], Callable[[str], bool]]


class CacheTooLargeError(MemoryError):
    """A cache that would exceed the allowed size; raised before the forward pass starts."""


class HookedRootModule(nn.Module):
    """Base class for a model whose intermediates pass through HookPoints.

    Call `setup_hooks()` at the end of `__init__`: it names every HookPoint by its module path.
    Hooks are attached only for the duration of one call (`run_with_hooks`, `run_with_cache`) or
    one `with model.hooks(...)` block, and are always removed on the way out.
    """

    # run_with_cache refuses caches estimated above this (bytes); raise it per call or on the model.
    max_cache_bytes: float = 8 * 2**30

    def estimate_cache_bytes(self, names: list[str], dtype: Optional[torch.dtype], *args: Any, **kwargs: Any) -> Optional[int]:
        """Bytes a cache of `names` would take for this input, or None if unknown (models override this)."""
        return None

    def setup_hooks(self) -> None:
        self._hook_points: dict[str, HookPoint] = {}
        for name, module in self.named_modules():
            if isinstance(module, HookPoint):
                module.name = name
                self._hook_points[name] = module

    @property
    def hook_names(self) -> list[str]:
        return list(self._hook_points)

    def hook_point(self, name: str) -> HookPoint:
        try:
            return self._hook_points[name]
        except KeyError:
            raise unknown_name_error(name, self._hook_points) from None

    def select_hook_names(self, names: Optional[NameFilter] = None) -> list[str]:
        """Resolve a name filter: None = every point except opt-in ones, a name, a list of names, or a predicate."""
        if names is None:
            return [n for n, p in self._hook_points.items() if not p.opt_in]
        if isinstance(names, str):
            self.hook_point(names)
            return [names]
        if callable(names):
            return [n for n in self._hook_points if names(n)]
        names = list(names)
        for name in names:
            self.hook_point(name)
        return names

    @contextmanager
    def hooks(self, fwd_hooks: Iterable[tuple[NameFilter, HookFn]] = ()) -> Iterator["HookedRootModule"]:
        """Attach hooks for the duration of the block; they are removed on exit, whatever happens."""
        handles = []
        try:
            for names, fn in fwd_hooks:
                for name in self.select_hook_names(names):
                    handles.append(self.hook_point(name).add(fn))
            yield self
        finally:
            for handle in reversed(handles):
                handle.remove()

    def run_with_hooks(self, *args: Any, fwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (), **kwargs: Any) -> Any:
        with self.hooks(fwd_hooks):
            return self(*args, **kwargs)

    def run_with_cache(
        self,
        *args: Any,
        names: Optional[NameFilter] = None,
        device: Optional[Union[str, torch.device]] = None,
        dtype: Optional[torch.dtype] = None,
        fwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        max_cache_bytes: Optional[float] = None,
        **kwargs: Any,
    ) -> tuple[Any, ActivationCache]:
        """Run the model and return `(output, cache)`.

        `names` selects what to store (see `select_hook_names`); `device` and `dtype` say where and
        in which precision to store it, e.g. on the CPU in bfloat16 while the model runs on a GPU.
        `fwd_hooks` run before caching, so the cache shows the edited activations. A cache estimated
        above `max_cache_bytes` (default: the model's `max_cache_bytes`, 8 GiB) is refused before
        anything runs.
        """
        store: dict[str, torch.Tensor] = {}

        def save(activation: torch.Tensor, hook: HookPoint) -> None:
            store[hook.name] = _store(activation, device, dtype)

        selected = self.select_hook_names(names)
        limit = self.max_cache_bytes if max_cache_bytes is None else max_cache_bytes
        estimate = self.estimate_cache_bytes(selected, dtype, *args, **kwargs)
        if estimate is not None and estimate > limit:
            raise CacheTooLargeError(
                f"caching {len(selected)} activations would take about {estimate / 2**30:.2f} GiB, over the limit of "
                f"{limit / 2**30:.2f} GiB. Cache fewer (names=...), store them in lower precision (dtype=torch.bfloat16) "
                f"or on the CPU (device='cpu'), use a shorter input, or raise the limit (max_cache_bytes=...)"
            )
        with self.hooks(list(fwd_hooks) + [(selected, save)]):
            out = self(*args, **kwargs)
        return out, ActivationCache(store)
