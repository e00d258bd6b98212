"""transformer-lens's caching hooks: hooks that store activations in a dict of the caller's, attached by the caller
(`get_caching_hooks`) or left attached until `reset_hooks()` (`add_caching_hooks`, `cache_all`, `cache_some`).
probe's own `run_with_cache` needs none of them."""
from __future__ import annotations

from typing import Any, Optional, Union

import torch

from probe.hooks.hook_point import HookFn, HookPoint


class CachingHooks:
    """Mixed into HookedRootModule, whose `select_hook_names`, `add_hook` and `slice_cached_positions` it uses."""

    def get_caching_hooks(self, names_filter: Optional[Any] = None, incl_bwd: bool = False,
                          device: Optional[Union[str, torch.device]] = None, remove_batch_dim: bool = False,
                          cache: Optional[dict] = None, pos_slice: Any = None) -> tuple[dict, list, list]:
        """transformer-lens's `(cache, fwd_hooks, bwd_hooks)`, for the caller to attach (`with model.hooks(fwd, bwd)`,
        or `run_with_hooks`): each forward hook stores its point's activation in `cache` under its name, each
        backward hook the gradient there under name + "_grad", detached (on `device`, at `pos_slice`, without the
        batch dimension when asked). Nothing is attached here."""
        cache = {} if cache is None else cache

        def storing(suffix: str) -> HookFn:
            def store(tensor: torch.Tensor, hook: HookPoint) -> None:
                kept = {hook.name: tensor.detach()}
                if pos_slice is not None:
                    kept = self.slice_cached_positions(kept, pos_slice)
                value = kept[hook.name][0] if remove_batch_dim else kept[hook.name]
                cache[hook.name + suffix] = value if device is None else value.to(device)
            return store

        names = self.select_hook_names(names_filter)
        return (cache, [(name, storing("")) for name in names],
                [(name, storing("_grad")) for name in names] if incl_bwd else [])

    def add_caching_hooks(self, names_filter: Optional[Any] = None, incl_bwd: bool = False,
                          device: Optional[Union[str, torch.device]] = None, remove_batch_dim: bool = False,
                          cache: Optional[dict] = None) -> dict:
        """transformer-lens's: `get_caching_hooks`' hooks attached as persistent ones (`persistent_hooks()` lists them,
        `reset_hooks()` removes them), filling the returned dict on every pass until then."""
        cache, fwd, bwd = self.get_caching_hooks(names_filter, incl_bwd, device, remove_batch_dim, cache)
        for direction, hooks in (("fwd", fwd), ("bwd", bwd)):
            for name, fn in hooks:
                self.add_hook(name, fn, dir=direction)
        return cache

    def cache_all(self, cache: Optional[dict], incl_bwd: bool = False, device=None, remove_batch_dim: bool = False):
        self.add_caching_hooks(None, incl_bwd, device, remove_batch_dim, cache)

    def cache_some(self, cache: Optional[dict], names: Any, incl_bwd: bool = False, device=None,
                   remove_batch_dim: bool = False):
        self.add_caching_hooks(names, incl_bwd, device, remove_batch_dim, cache)
