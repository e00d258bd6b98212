"""transformer-lens's hooks that outlive the call that attaches them: `add_hook` and `add_perma_hook` (until
`reset_hooks()`), listing them (`persistent_hooks`, `list_hooks`), and the caching hooks that fill a dict of the
caller's (`get_caching_hooks`, `add_caching_hooks`, `cache_all`, `cache_some`). probe's own calls attach hooks for one
call or one `with` block; these are for code written against transformer-lens."""
from __future__ import annotations

from typing import Any, Optional, Union

import torch

from probe.hooks.hook_point import HookFn, HookHandle, HookPoint
from probe.hooks.names import NameFilter


class PersistentHooks:
    """Mixed into HookedRootModule, whose `names_to_attach`, `select_hook_names`, `hook_point`, `all_hook_points` and
    `slice_cached_positions` it uses."""

    def add_hook(self, name: NameFilter, hook: HookFn, dir: str = "fwd", is_permanent: bool = False, level=None,
                 prepend: bool = False) -> None:
        """transformer-lens's `add_hook`: attach `hook` to a point (a name, a list of names or a predicate) until
        `reset_hooks()`; `is_permanent=True` keeps it through `reset_hooks()` too. Unlike `hooks()` and
        `run_with_hooks`, nothing removes it for you: `persistent_hooks()` lists what is attached."""
        for point_name in self.names_to_attach(name):
            self.hook_point(point_name).add_hook(hook, dir=dir, is_permanent=is_permanent, prepend=prepend,
                                                 as_name=point_name)

    def add_perma_hook(self, name: NameFilter, hook: HookFn, dir: str = "fwd") -> None:
        self.add_hook(name, hook, dir=dir, is_permanent=True)

    def reset_hooks(self, clear_contexts: bool = True, direction: str = "both", including_permanent: bool = False,
                    level=None) -> None:
        """Remove every hook (forward, backward or both) but permanent ones, including those of `with` blocks
        still open (they would be removed at the block's end anyway), as transformer-lens's `reset_hooks`."""
        for point in self.all_hook_points():
            point.remove_hooks(direction, including_permanent=including_permanent)
        if clear_contexts:
            self.clear_contexts()

    def remove_all_hook_fns(self, direction: str = "both", including_permanent: bool = False, level=None) -> None:
        self.reset_hooks(clear_contexts=False, direction=direction, including_permanent=including_permanent)

    def clear_contexts(self) -> None:
        for point in self.all_hook_points():
            point.clear_context()

    def persistent_hooks(self) -> list[tuple[str, str, HookFn, bool]]:
        """(point name, "fwd" or "bwd", fn, permanent) for every hook attached with `add_hook` (or kept by
        `reset_hooks_end=False`): what stays attached after the call that added it."""
        return [(point.name, handle.direction, handle.fn, handle.permanent)
                for point in self.all_hook_points() for handle in point.handles if handle.persistent]

    def list_hooks(self, name_filter: Optional[NameFilter] = None, dir: str = "both",
                   including_permanent: bool = True) -> dict[str, list[HookHandle]]:
        """transformer-lens's `list_hooks`: the hooks attached now (scoped, persistent and permanent ones), by point
        name, points without any left out; `dir` "fwd", "bwd" or "both"; `name_filter` as run_with_cache's names."""
        if dir not in ("fwd", "bwd", "both"):
            raise ValueError(f"dir must be 'fwd', 'bwd' or 'both', got {dir!r}")
        if name_filter is None or callable(name_filter):
            # with bridge_names on, as the bridge lists them: each point under every name its hook_dict has
            every = list(self.hook_dict) if self.bridge_names else self.hook_names
            names = [n for n in every if name_filter is None or name_filter(n)]
        else:
            names = [self.hook_point(n).name for n in ([name_filter] if isinstance(name_filter, str) else name_filter)]
        listed = {name: [h for h in self.hook_point(name).handles if dir in ("both", h.direction)
                         and (including_permanent or not h.permanent)] for name in names}
        return {name: handles for name, handles in listed.items() if handles}

    def get_caching_hooks(self, names_filter: Optional[NameFilter] = None, incl_bwd: bool = False,
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

        names = self.names_to_attach(names_filter)  # each stored under the name its hook sees
        return (cache, [(name, storing("")) for name in names],
                [(name, storing("_grad")) for name in names] if incl_bwd else [])

    def add_caching_hooks(self, names_filter: Optional[NameFilter] = None, incl_bwd: bool = False,
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

    def cache_some(self, cache: Optional[dict], names: NameFilter, incl_bwd: bool = False, device=None,
                   remove_batch_dim: bool = False):
        self.add_caching_hooks(names, incl_bwd, device, remove_batch_dim, cache)
