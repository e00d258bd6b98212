"""HookedRootModule: gives any nn.Module built from HookPoints named hooks, scoped hooking and caching."""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Optional, Union

import torch
from torch import nn

from probe.hooks.cache import ActivationCache, stored_tensor
from probe.hooks.hook_point import HookFn, HookPoint, Store
from probe.hooks.names import NameFilter, UnknownNameError, unknown_name_error
from probe.hooks.persistent_hooks import PersistentHooks
from probe.hooks.tree_setup import TreeSetup


def _the_output(out: torch.Tensor) -> torch.Tensor:
    return out


class CacheTooLargeError(MemoryError):
    """A cache that would exceed the allowed size; raised before the forward pass starts."""


class HookedRootModule(PersistentHooks, TreeSetup, nn.Module):
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

    # transformer-lens 4's TransformerBridge lets name predicates and a cache of everything see its own names beside the
    # classic ones; HookedTransformer code expects the classic ones alone. True: the bridge's way (see select_hook_names)
    bridge_names: bool = False

    def setup_hooks(self, aliases: Optional[dict[str, str]] = None, left_out: Optional[dict[str, str]] = None) -> None:
        """Name every HookPoint submodule. `aliases` ({other name: point name}) are names that hooks may also
        use for a point (another library's spelling); caches and name filters know the point by its own name.
        `left_out` ({name: why}) are another library's names this model has no point for: asking for one says why."""
        self._hook_points: dict[str, HookPoint] = {}
        self._lent_points: dict[str, HookPoint] = {}  # another module's, for a `lent_hook_points` block
        self._aliases: dict[str, str] = dict(aliases or {})
        self._aliases_of: dict[str, tuple[str, ...]] = {}
        for alias, name in self._aliases.items():
            self._aliases_of[name] = (*self._aliases_of.get(name, ()), alias)
        self._left_out: dict[str, str] = dict(left_out or {})
        for name, module in self.named_modules():
            if not name or not isinstance(getattr(module, "name", None), (str, type(None))):
                continue  # the root has no path; a module whose own attribute is called `name` keeps it
            module.name = name  # every module's path, as transformer-lens code reads it (model.ln_final.name)
            if isinstance(module, HookPoint):
                self._hook_points[name] = module
        clashes = sorted(set(self._aliases) & set(self._hook_points))
        if clashes:  # a name must mean one point
            raise ValueError(f"aliases that are also hook points' own names: {', '.join(clashes)}")

    @property
    def hook_aliases(self) -> dict[str, str]:
        """{alias: point name} for every other name a point answers to (read it; `setup_hooks` sets it)."""
        return self._aliases

    def __getstate__(self) -> dict:
        # a copy made inside a lent_hook_points block (deepcopy, process_weights) must not keep the lent points:
        # the block that would take them back only knows the original
        state = self.__dict__.copy()
        state["_lent_points"] = {}
        return state

    @property
    def _all_points(self) -> dict[str, HookPoint]:
        return {**self._hook_points, **self._lent_points} if self._lent_points else self._hook_points

    @property
    def _listed_points(self) -> dict[str, HookPoint]:
        # HookedTransformer never had the bridge's own points (a norm's ends): TL 3 code that lists every point
        # (hook_dict, mod_dict, a cache of everything) and hooks each must not meet them unless booted as the bridge
        return {name: point for name, point in self._all_points.items() if point.listed(self.bridge_names)}

    @property
    def hook_names(self) -> list[str]:
        return list(self._all_points)

    def hook_point(self, name: str) -> HookPoint:
        # the two registries never share a name: look in each rather than merging them for every lookup
        name = self._aliases.get(name, name)
        point = self._hook_points.get(name) or self._lent_points.get(name)
        if point is None:
            if name in self._left_out:
                raise UnknownNameError(f"no hook point {name!r}: {self._left_out[name]}")
            raise unknown_name_error(name, self._listed_points) from None
        return point

    def select_hook_names(self, names: Optional[NameFilter] = None) -> list[str]:
        """Resolve a name filter: None = every point except opt-in ones, a name (or alias), a list of them, or a
        predicate (which skips opt-in points that only their name selects).

        None and predicates leave out `bridge_only` points, and predicates see each point's own name only, unless
        the model's `bridge_names` is True: then, as on transformer-lens 4's bridge, they include those points and a
        predicate selects a point when it accepts any of its names (once, however many it accepts)."""
        if names is None:
            return [n for n, p in self._listed_points.items() if not p.opt_in]
        if isinstance(names, str):
            return [self.hook_point(names).name]
        if callable(names):
            if not self.bridge_names:
                return [n for n, p in self._listed_points.items() if names(n) and not (p.opt_in and p.by_name)]
            return [n for n, p in self._listed_points.items() if not (p.opt_in and p.by_name)
                    and any(names(known) for known in self._names_of(n))]
        return [self.hook_point(name).name for name in names]

    @contextmanager
    def lent_hook_points(self, points: dict[str, HookPoint]) -> Iterator["HookedRootModule"]:
        """For the block, `points` (another module's hook points, e.g. a spliced-in SAE's) are this model's too,
        under the given names: hooks, caches and name filters see them. Their names are restored after."""
        taken = [name for name in points if name in self._all_points]
        if taken:
            raise ValueError(f"hook point names already in use: {', '.join(taken)}")
        previous = {name: point.name for name, point in points.items()}
        try:
            for name, point in points.items():
                self._lent_points[name] = point
                point.name = name
            yield self
        finally:
            for name, point in points.items():
                if self._lent_points.get(name) is point:
                    del self._lent_points[name]
                point.name = previous[name]

    @contextmanager
    def hooks(
        self, fwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (), bwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        reset_hooks_end: bool = True, clear_contexts: bool = False,
    ) -> Iterator["HookedRootModule"]:
        """Attach hooks for the duration of the block; they are removed on exit, whatever happens.

        Backward hooks `fn(grad, hook)` see the gradient at their point in a backward pass through a
        forward made inside the block, inside it or after it (they belong to that forward's graph, as in
        transformer-lens); a forward after the block carries none.

        `reset_hooks_end=False` (transformer-lens's keyword) keeps them after the block, as persistent hooks
        that `reset_hooks()` removes and `persistent_hooks()` lists; `clear_contexts` empties every hook's
        `ctx` on exit.
        """
        handles, succeeded = [], False
        try:
            for hook_list, backward in ((fwd_hooks, False), (bwd_hooks, True)):
                for names, fn in hook_list:
                    for name in self.names_to_attach(names):
                        handles.append(self.hook_point(name).add(fn, backward=backward, persistent=not reset_hooks_end,
                                                                 as_name=name))
            yield self
            succeeded = True
        finally:
            # a failed block leaves nothing behind; whether it failed is its own outcome, not sys.exc_info(), which
            # also names an error the caller is handling around a block that succeeded
            if reset_hooks_end or not succeeded:
                for handle in reversed(handles):
                    handle.remove()
            if clear_contexts:
                self.clear_contexts()

    # with bridge_names on, which name a hook that a predicate attaches sees as hook.name: the bridge's own (as its
    # hooks do) or, in its compatibility mode, the classic one
    bridge_names_first: bool = True

    def names_to_attach(self, names: Optional[NameFilter]) -> list[str]:
        """The names a filter attaches hooks by, one per point, which each hook sees as `hook.name`: as written where
        the filter names points (an alias stays an alias), each point's own name where a predicate selects it; with
        `bridge_names` on, the first name of the point's the predicate accepts, its bridge names first unless
        `bridge_names_first` is off."""
        if names is None or callable(names):
            selected = self.select_hook_names(names)
            if not self.bridge_names:
                return selected
            accepts = names or (lambda name: True)
            return [next(name for name in self._names_of(own) if accepts(name)) for own in selected]
        written = [names] if isinstance(names, str) else list(names)
        for name in written:
            self.hook_point(name)  # an unknown name fails here, before anything is attached
        return written

    def names_to_list(self, names: Optional[NameFilter], selected: list[str], stored: Iterable[str]) -> Optional[list[str]]:
        """The names a cache of the `selected` points lists, given the filter that selected them: the names a filter
        gave, as given; those a predicate accepted; every name of every point for a cache of everything, in the
        order their activations arrived in `stored`, as transformer-lens's caches list them. None: the points' own
        names (all there are without `bridge_names`, for predicates and caches of everything)."""
        if isinstance(names, str):
            return [names]
        if names is not None and not callable(names):
            return list(dict.fromkeys(names))
        if not self.bridge_names:
            return None
        chosen = set(selected)
        return [name for own in stored if own in chosen for name in self._names_of(own) if names is None or names(name)]

    def _names_of(self, own: str) -> tuple[str, ...]:
        """Every name of the point called `own`, in the order a hook would see them (names_to_attach)."""
        aliases = self._aliases_of.get(own, ())
        # a point already called by the bridge's name (after its module: `ln1.hook_out`, `unembed.hook_in`) lists
        # that name before its classic aliases (`hook_unembed`)
        first = self.bridge_names_first and not own.endswith((".hook_in", ".hook_out"))
        return (*aliases, own) if first else (own, *aliases)


    @property
    def hook_dict(self) -> dict[str, HookPoint]:
        """Every hook point by name (transformer-lens's `hook_dict`), and again under its aliases: all of them when
        `bridge_names` is on (as transformer-lens 4's bridge lists its own names beside the classic ones), otherwise
        only those of points that only their name selects (the per-head inputs, which TL 4's analysis tools look up
        by the bridge's spelling), so that HookedTransformer code attaching a hook to every entry attaches it once."""
        points = self._listed_points
        return {**points, **{alias: points[name] for alias, name in self._aliases.items() if name in points
                             and (self.bridge_names or points[name].by_name)}}

    def hook_points(self) -> list[HookPoint]:
        """Every hook point (transformer-lens's `hook_points()`, the values of `hook_dict`)."""
        return list(self._listed_points.values())

    def all_hook_points(self) -> list[HookPoint]:
        """Every hook point, the bridge's own ones included whatever `bridge_names` says: what may hold a hook."""
        return list(self._all_points.values())

    @property
    def mod_dict(self) -> dict[str, nn.Module]:
        """Every submodule by name, hook points included (transformer-lens's `mod_dict`): the bridge's own points
        only when `bridge_names` is on, as in hook_dict."""
        return {name: module for name, module in self.named_modules()
                if name and not (isinstance(module, HookPoint) and not module.listed(self.bridge_names))}

    def run_with_hooks(
        self, *args: Any, fwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        bwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (), reset_hooks_end: bool = True,
        clear_contexts: bool = False, **kwargs: Any,
    ) -> Any:
        """Run the model with the hooks attached for this call only: `bwd_hooks` run in a backward pass through this
        call's output, after the call too (they belong to its graph, as in transformer-lens). With
        `reset_hooks_end=False` the hooks stay attached until `reset_hooks()`."""
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end=reset_hooks_end, clear_contexts=clear_contexts):
            return self(*args, **kwargs)

    def run_with_cache(
        self,
        *args: Any,
        names: Optional[NameFilter] = None,
        device: Optional[Union[str, torch.device]] = None,
        dtype: Optional[torch.dtype] = None,
        fwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        max_cache_bytes: Optional[float] = None,
        grads_of: Optional[Callable[[Any], torch.Tensor]] = None,
        names_filter: Optional[NameFilter] = None,
        remove_batch_dim: bool = False,
        incl_bwd: bool = False,
        return_cache_object: bool = True,
        pos_slice: Any = None,
        **kwargs: Any,
    ) -> tuple[Any, ActivationCache]:
        """Run the model and return `(output, cache)`.

        `names` selects what to store (see `select_hook_names`); `device` and `dtype` say where and
        in which precision to store it, e.g. on the CPU in bfloat16 while the model runs on a GPU.
        `fwd_hooks` run before caching, so the cache shows the edited activations. A cache estimated
        above `max_cache_bytes` (default: the model's `max_cache_bytes`, 8 GiB) is refused before
        anything runs.

        `grads_of(output) -> scalar` also caches the gradient of that scalar with respect to each
        stored activation, under `name + "_grad"` (transformer-lens's key). The gradients come from
        `torch.autograd.grad`, so the parameters' `.grad` are left alone and frozen weights work too;
        that uses up the graph, so the output comes back detached.

        transformer-lens's keywords work too: `names_filter` (= `names`), `incl_bwd=True` (the gradient of the
        output itself, which must then be a scalar such as `return_type="loss"`: `grads_of=lambda out: out`),
        `remove_batch_dim=True` (a batch of one, stored without its batch dimension),
        `return_cache_object=False` (a plain dict) and `pos_slice=` (store only those positions; see the model's
        `slice_cached_positions`).
        """
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            # an integer or bool cache would hold truncated activations without a word
            raise TypeError(f"run_with_cache(dtype={dtype!r}): activations are stored in a floating-point dtype "
                            "(torch.float32, torch.bfloat16, torch.float16, ...), or dtype=None to keep the model's")
        if names_filter is not None:
            if names is not None:
                raise ValueError("pass names= or names_filter= (transformer-lens's spelling), not both")
            names = names_filter
        if incl_bwd:
            if grads_of is not None:
                raise ValueError("incl_bwd=True differentiates the output itself; with grads_of=... pass only that")
            grads_of = _the_output
        for unsupported, fix in (("reset_hooks_end", "use add_hook/reset_hooks for hooks that outlive the call"),
                                 ("clear_contexts", "call model.clear_contexts()")):
            if unsupported in kwargs:
                raise TypeError(f"run_with_cache does not take {unsupported}= (a transformer-lens keyword): {fix}; "
                                f"see docs/from_transformer_lens.md")
        store: dict[str, torch.Tensor] = {}
        live: dict[str, torch.Tensor] = {}  # with grads_of: the activations themselves, in the graph

        # id -> (weak reference, stored copy): one tensor passing two points (resid_post of block l is
        # resid_pre of block l + 1) is converted once, so dtype=/device= storage keeps one copy of it
        converted: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

        def save(activation: torch.Tensor, hook: HookPoint) -> Optional[torch.Tensor]:
            seen = converted.get(id(activation))
            if seen is not None and seen[0]() is activation:
                store[hook.name] = seen[1]
            else:
                store[hook.name] = stored_tensor(activation, device, dtype)
                if device is not None or dtype is not None:
                    converted[id(activation)] = (weakref.ref(activation), store[hook.name])
            if grads_of is None:
                return None
            # differentiate to a node of this point's own, as a backward hook does: the tensor itself may be read
            # elsewhere too (hook_mlp_in is resid_mid's tensor, which the residual sum also reads), and this point's
            # gradient is that of what flows on from it. Nothing before it needing a gradient (frozen weights), the
            # node is a leaf. The next point it reaches (as the same tensor) reuses what is stored for it.
            own = live[hook.name] = (activation.view_as(activation) if activation.requires_grad
                                     else activation.detach().requires_grad_(True))
            converted[id(own)] = (weakref.ref(own), store[hook.name])
            return own

        if grads_of is not None and torch.is_inference_mode_enabled():
            # enable_grad cannot reach out of inference mode: the scalar would have no graph
            raise RuntimeError("run_with_cache(grads_of=...) needs autograd, which torch.inference_mode() turns off; "
                               "call it outside the inference_mode block (torch.no_grad() around it is fine)")
        selected = self.select_hook_names(names)
        limit = self.max_cache_bytes if max_cache_bytes is None else max_cache_bytes
        estimate = self.estimate_cache_bytes(selected, dtype, *args, **kwargs)
        if estimate is not None and grads_of is not None:
            estimate *= 2  # a gradient per activation
        if estimate is not None and estimate > limit:
            raise CacheTooLargeError(
                f"caching {len(selected)} activations would take about {estimate / 2**30:.2f} GiB, over the limit of "
                f"{limit / 2**30:.2f} GiB. Cache fewer (names=...), store them in lower precision (dtype=torch.bfloat16) "
                f"or on the CPU (device='cpu'), use a shorter input, or raise the limit (max_cache_bytes=...)"
            )
        # the common cache (no conversion, no gradients) stores tensors as they pass, without save's bookkeeping
        keep = Store(store) if device is None and dtype is None and grads_of is None else save
        with torch.enable_grad() if grads_of is not None else nullcontext():
            with self.hooks(list(fwd_hooks) + [(selected, keep)]):
                out = self(*args, **kwargs)
            if grads_of is not None:
                out = self._cache_gradients(out, grads_of, live, store, device, dtype)
        if pos_slice is not None:
            store = self.slice_cached_positions(store, pos_slice)
        if remove_batch_dim:
            batches = {t.shape[0] for t in store.values()}
            if batches - {1}:
                raise ValueError(f"remove_batch_dim=True needs a batch of one prompt, got batch sizes {sorted(batches)}")
            store = {name: t[0] for name, t in store.items()}
        cache = self.make_cache(store, has_batch_dim=not remove_batch_dim, listed=self.names_to_list(names, selected, store))
        return out, (cache if return_cache_object else dict(cache.items()))

    def slice_cached_positions(self, store: dict[str, torch.Tensor], pos_slice: Any) -> dict[str, torch.Tensor]:
        """run_with_cache(pos_slice=...): the model knows where each activation's position axis is."""
        raise TypeError(f"{type(self).__name__}.run_with_cache does not take pos_slice=: this model does not say where "
                        "its activations' position axes are; slice the cached tensors afterwards")

    def make_cache(self, activations: dict[str, torch.Tensor], has_batch_dim: bool = True,
                   listed: Optional[list[str]] = None) -> ActivationCache:
        """The cache object run_with_cache returns (models override this to give theirs more methods); `listed`: the
        names it lists (see `names_to_list`)."""
        return ActivationCache(activations, self._aliases, listed)

    @staticmethod
    def _cache_gradients(out: Any, grads_of: Callable[[Any], torch.Tensor], live: dict[str, torch.Tensor],
                         store: dict[str, torch.Tensor], device, dtype) -> Any:
        value = grads_of(out)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"grads_of must return a scalar tensor to differentiate (e.g. a mean), got {got}")
        if not live:  # nothing selected was reached: no activations, so no gradients either
            return out.detach() if isinstance(out, torch.Tensor) else out
        if not value.requires_grad:
            raise ValueError("grads_of returned a scalar that depends on no cached activation (it has no autograd "
                             "graph); compute it from the output with differentiable operations, not .detach(), "
                             ".item() or argmax")
        names = list(live)
        # an activation the scalar does not depend on has gradient zero (materialize_grads)
        grads = torch.autograd.grad(value.squeeze(), [live[n] for n in names], allow_unused=True, materialize_grads=True)
        stored: dict[int, torch.Tensor] = {}  # one tensor at two points has one gradient: stored once
        for name, grad in zip(names, grads):
            if id(grad) not in stored:
                stored[id(grad)] = stored_tensor(grad, device, dtype)
            store[f"{name}_grad"] = stored[id(grad)]
        return out.detach() if isinstance(out, torch.Tensor) else out
