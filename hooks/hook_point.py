"""HookPoint: an identity module that lets callers read or replace the tensor passing through it,
and the gradient flowing back through it."""
from __future__ import annotations

import contextvars
import functools
import inspect
import threading
from contextlib import contextmanager
from functools import partial
from typing import Callable, Optional

import torch
from torch import nn

from probe.hooks.lens_handle import TorchHandleView, module_hook

HookFn = Callable[[torch.Tensor, "HookPoint"], Optional[torch.Tensor]]


# Who attached a scoped hook: one object per thread (and per asyncio task, which copies its creator's context).
# A `with model.hooks(...)` block, run_with_hooks and run_with_cache attach hooks that only their own context
# sees, so a model shared by threads runs one thread's hooks in that thread's forward passes alone; hooks
# attached to stay (add_hook, reset_hooks_end=False) belong to the model and every thread sees them.
_OWNER: contextvars.ContextVar[Optional[object]] = contextvars.ContextVar("probe_hook_owner", default=None)


def current_owner() -> object:
    owner = _OWNER.get()
    if owner is None:
        owner = object()
        _OWNER.set(owner)
    return owner


# Compiled code (torch.compile) cannot read a context variable: each would be a graph break. A compiled call names
# its context's owner here instead, under a lock so that two threads' compiled calls take turns; the compiler guards
# on the object, so a call from another context compiles its own version rather than running this one's hooks.
_COMPILED_OWNER: Optional[object] = None
_COMPILED_LOCK = threading.RLock()  # re-entrant: a compiled call may run inside another's (eager) hook


@contextmanager
def compiled_scope():
    """Around a call of compiled code that runs hook points: the hooks it runs are those of this context."""
    global _COMPILED_OWNER
    with _COMPILED_LOCK:
        previous, _COMPILED_OWNER = _COMPILED_OWNER, current_owner()
        try:
            yield
        finally:
            _COMPILED_OWNER = previous


class Store:
    """A hook that keeps each activation it sees under its point's name in `into` (detached from autograd, or with
    `detach=False` in its graph, for a gradient taken with respect to it later) and changes nothing: what a cache
    attaches. HookPoint runs it inline, without the checks a replacing hook needs."""

    __slots__ = ("into", "detach")

    def __init__(self, into: dict, detach: bool = True):
        self.into, self.detach = into, detach

    def __call__(self, x: torch.Tensor, hook: "HookPoint") -> None:
        self.into[hook.name] = x.detach() if self.detach and x.requires_grad else x


def _backward(dir: str) -> bool:
    if dir not in ("fwd", "bwd"):
        raise ValueError(f"dir must be 'fwd' or 'bwd', got {dir!r}")
    return dir == "bwd"


class HookHandle:
    """One attachment of a hook function to a HookPoint; `remove()` detaches exactly that one, and
    removing twice is harmless. The same function attached twice gets two handles, so an inner
    `with` block that re-attaches a function leaves the outer block's hooks in their order.

    `persistent` handles (transformer-lens's `add_hook`) stay until removed or `reset_hooks()`;
    `permanent` ones survive `reset_hooks()` too unless it is told `including_permanent=True`."""

    def __init__(self, registry: list["HookHandle"], fn: HookFn, backward: bool = False, persistent: bool = False,
                 permanent: bool = False):
        self.registry, self.fn, self.backward = registry, fn, backward
        self.persistent, self.permanent = persistent or permanent, permanent
        self.by_keyword = type(fn) is not Store and takes_hook_by_keyword(fn)
        # a scoped hook runs only in the context (thread) that attached it; a persistent one everywhere
        self.owner = None if self.persistent else current_owner()
        self.seen_as: Optional[PointUnderName] = None  # what the hook gets as `hook` when attached by an alias

    @property
    def direction(self) -> str:
        return "bwd" if self.backward else "fwd"

    # what transformer-lens code reads off its LensHandle (hooks/lens_handle.py)
    @property
    def hook(self) -> TorchHandleView:
        return TorchHandleView(self)

    @functools.cached_property
    def module_hook(self) -> Callable:
        return module_hook(self.fn)

    @property
    def is_permanent(self) -> bool:
        return self.permanent

    @property
    def user_hook(self) -> HookFn:
        return self.fn

    context_level = None  # TL's level of nested hook contexts; probe's scoped hooks need none

    def remove(self) -> None:
        try:
            self.registry.remove(self)  # by identity: handles define no equality
        except ValueError:  # removed already
            pass


class PointUnderName:
    """A hook point under another of its names (an alias, such as transformer-lens 4's bridge names): what a hook
    attached by that name sees, and what the name reaches as an attribute (`model.blocks[0].hook_out`). `name` is the
    alias, so a hook that stores what it sees under `hook.name` stores it where its caller will look, and hooks added
    through it see the alias too. Everything else (`ctx`, `layer()`, `remove_hooks`, ...) is the point's own."""

    __slots__ = ("point", "name")

    def __init__(self, point: "HookPoint", name: str):
        self.point, self.name = point, name

    def __getattr__(self, attribute: str):
        if attribute in PointUnderName.__slots__ or attribute.startswith("__"):  # unset while copying or unpickling
            raise AttributeError(attribute)
        return getattr(self.point, attribute)

    def add(self, fn: HookFn, backward: bool = False, **keywords) -> "HookHandle":
        return self.point.add(fn, backward, **{"as_name": self.name, **keywords})

    def add_hook(self, hook: HookFn, dir: str = "fwd", is_permanent: bool = False, level=None,
                 prepend: bool = False) -> "HookHandle":
        return self.point.add_hook(hook, dir, is_permanent, level, prepend, as_name=self.name)

    def __repr__(self) -> str:
        return f"HookPoint(name={self.name!r}, also {self.point.name!r})"


def takes_hook_by_keyword(fn: Callable) -> bool:
    """Whether `fn` takes the hook point only as the keyword `hook` (`def fn(x, *, hook)`, as transformer-lens 4's own
    hooks are written: TL calls fn(x, hook=point)). Every other hook gets it second, positionally, whatever it
    calls it."""
    code = getattr(fn, "__code__", None)
    if code is not None and not hasattr(fn, "__self__"):  # a plain function: its code object says it all
        return _code_takes_hook_by_keyword(code)
    if type(fn) is partial and callable(fn.func):  # partial(hook_fn, head=h), made once per patched site
        return _partial_takes_hook_by_keyword(fn.func, len(fn.args), frozenset(fn.keywords))
    return _signature_takes_hook_by_keyword(fn)


@functools.lru_cache(maxsize=4096)
def _partial_takes_hook_by_keyword(func: Callable, n_args: int, keywords: frozenset) -> bool:
    return _signature_takes_hook_by_keyword(partial(func, *([None] * n_args), **dict.fromkeys(keywords)))


def _signature_takes_hook_by_keyword(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: positional, as always
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    return len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in positional) and any(
        (p.kind is p.KEYWORD_ONLY and p.name == "hook") or p.kind is p.VAR_KEYWORD for p in params)


@functools.lru_cache(maxsize=4096)
def _code_takes_hook_by_keyword(code) -> bool:
    # hooks are made by the thousand from a few definitions (closures share their code): decide once per code
    takes_varargs = bool(code.co_flags & inspect.CO_VARARGS)
    keyword_only = code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]
    takes_kwargs = bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return code.co_argcount < 2 and not takes_varargs and ("hook" in keyword_only or takes_kwargs)


def _owner() -> Optional[object]:
    """Whose scoped hooks run here: this context's (None when it attached none), or inside compiled code the owner
    its compiled_scope named (asked only while one is open: the check costs more than the rest of the lookup)."""
    if _COMPILED_OWNER is not None and torch.compiler.is_compiling():
        return _COMPILED_OWNER
    return _OWNER.get()


def _visible(handles: list[HookHandle]) -> list[HookHandle]:
    """The handles the current context runs: its own scoped hooks and every persistent one."""
    owner = _owner()
    return [h for h in handles if h.owner is None or h.owner is owner]


class HookPoint(nn.Module):
    """Identity on its input, except for the hook functions attached to it.

    A hook is `fn(activation, hook) -> Tensor | None`; returning a tensor replaces the activation.
    The replacement must keep the activation's shape, so a mistake surfaces here, named, rather
    than as a broadcasting error layers later. A backward hook is `fn(grad, hook) -> Tensor | None`,
    called with the gradient reaching this point during a backward pass (d output / d activation);
    returning a tensor replaces the gradient that flows on. It runs only for a forward made while
    it was attached, and only while it still is.

    `opt_in` marks points whose activation costs extra work to compute (per-head results): the
    model computes them only while something is attached, and a cache of "everything" skips them.
    `by_name` opt-in points also change how the model computes (per-head inputs give each head its own norm):
    while opt-in, only their exact name selects them, never a predicate.
    `copies` points hand their forward hooks a copy of the activation, so an edit made in place reaches only
    what reads the point, not the tensor it was copied from (transformer-lens hooks a copy at hook_mlp_in, whose
    input is also the residual stream that flows on).
    `bridge_only` points are named only by transformer-lens 4's TransformerBridge (a norm's input and output, the
    token ids), not by HookedTransformer: a cache of everything and name predicates leave them out, so HookedTransformer
    code sees the points it knows, unless the model names its hooks as the bridge does (`bridge_names`).
    `unlisted` points are named by neither (a model without norms keeps its identity norms' `hook_scale`, which
    probe's analyses read): only their exact name reaches them.
    """

    def __init__(self, opt_in: bool = False, by_name: bool = False, copies: bool = False, bridge_only: bool = False,
                 unlisted: bool = False):
        super().__init__()
        self.by_name = by_name
        self.copies = copies
        self.bridge_only = bridge_only
        self.unlisted = unlisted
        self.name: str = "<unnamed>"  # set by HookedRootModule.setup_hooks
        self.ctx: dict = {}  # scratch space for hook functions (transformer-lens's hook.ctx); cleared by reset_hooks
        self.opt_in = opt_in
        # the last dimension's size, where the owner knows it but the model's shape table cannot (a lent SAE
        # point): what a cache-size estimate needs
        self.width: Optional[int] = None
        self._fns: list[HookHandle] = []  # in the order the hooks run
        self._bwd_fns: list[HookHandle] = []

    @property
    def active(self) -> bool:
        """Something this context sees is attached: the model must materialise this activation (opt-in or
        explicit paths). Another thread's scoped hooks do not count."""
        if not (self._fns or self._bwd_fns):  # the hook-free forward stops here
            return False
        return bool(_visible(self._fns) or _visible(self._bwd_fns))

    def add(self, fn: HookFn, backward: bool = False, *, persistent: bool = False, permanent: bool = False,
            prepend: bool = False, as_name: Optional[str] = None) -> HookHandle:
        """Attach `fn` and return its handle; it runs until `handle.remove()` (what `hooks()` blocks do on exit)
        or, for any hook but a permanent one, the owning model's `reset_hooks()`. Prefer `model.hooks(...)`,
        which removes it for you; `persistent=True` marks a hook meant to stay (listed by `model.persistent_hooks()`).
        `as_name`: another name of this point (an alias) the hook was attached by, which it then sees as `hook.name`."""
        if not callable(fn):
            what = "grad" if backward else "activation"
            raise TypeError(f"hook for {self.name!r} must be callable as fn({what}, hook), got {type(fn).__name__}")
        handle = HookHandle(self._bwd_fns if backward else self._fns, fn, backward, persistent, permanent)
        if as_name is not None and as_name != self.name:
            handle.seen_as = PointUnderName(self, as_name)
        handle.registry.insert(0 if prepend else len(handle.registry), handle)
        return handle

    # ---- transformer-lens's hook-point surface ------------------------------------------------
    def listed(self, bridge_names: bool) -> bool:
        """Whether listings (hook_dict, mod_dict), caches of everything and name predicates include this point."""
        return not self.unlisted and (bridge_names or not self.bridge_only)

    def add_hook(self, hook: HookFn, dir: str = "fwd", is_permanent: bool = False, level=None,
                 prepend: bool = False, as_name: Optional[str] = None) -> HookHandle:
        """transformer-lens's `HookPoint.add_hook`: attach `hook(tensor, hook)` until `remove_hooks()` or the model's
        `reset_hooks()` (permanent hooks: until `including_permanent=True`). `level` (TL's context level) is ignored."""
        return self.add(hook, backward=_backward(dir), persistent=True, permanent=is_permanent, prepend=prepend,
                        as_name=as_name)

    def add_perma_hook(self, hook: HookFn, dir: str = "fwd") -> HookHandle:
        """transformer-lens's `HookPoint.add_perma_hook`: `add_hook(hook, dir, is_permanent=True)`, a hook that
        `reset_hooks()` keeps (`model.reset_hooks(including_permanent=True)` removes it; see persistent_hooks())."""
        return self.add_hook(hook, dir=dir, is_permanent=True)

    def remove_hooks(self, dir: str = "fwd", including_permanent: bool = False, level=None) -> None:
        """Remove this point's hooks in direction `dir` ("fwd", "bwd" or "both"), keeping permanent ones unless asked."""
        for registry in self._registries(dir):
            for handle in [h for h in registry if including_permanent or not h.permanent]:
                handle.remove()

    def has_hooks(self, dir: str = "both", including_permanent: bool = True, level=None) -> bool:
        """transformer-lens 3.9's `has_hooks`: whether hooks this context sees are attached in direction `dir` ("fwd",
        "bwd" or "both"), permanent ones counted unless `including_permanent=False`. `level` is ignored, as in
        `add_hook`."""
        return any(including_permanent or not h.permanent for registry in self._registries(dir) for h in _visible(registry))

    def _registries(self, dir: str) -> list[list[HookHandle]]:
        registries = {"fwd": [self._fns], "bwd": [self._bwd_fns], "both": [self._fns, self._bwd_fns]}
        if dir not in registries:
            raise ValueError(f"dir must be 'fwd', 'bwd' or 'both', got {dir!r}")
        return registries[dir]

    def clear_context(self) -> None:
        self.ctx = {}

    def layer(self) -> int:
        """The block index in this point's name (`blocks.3.attn.hook_z` -> 3), as transformer-lens's `hook.layer()`."""
        parts = self.name.split(".")
        if len(parts) < 2 or parts[0] != "blocks" or not parts[1].isdigit():
            raise ValueError(f"hook point {self.name!r} is not inside a block, so it has no layer")
        return int(parts[1])

    @property
    def handles(self) -> list[HookHandle]:
        """Every attached hook, forward then backward, in the order they run."""
        return self._fns + self._bwd_fns

    @property
    def fwd_hooks(self) -> list[HookHandle]:
        """transformer-lens's `hook_point.fwd_hooks`: the forward hooks this context sees, in the order they run (a
        copy: remove one with its handle's `remove()`, or `remove_hooks()`)."""
        return list(_visible(self._fns))

    @property
    def bwd_hooks(self) -> list[HookHandle]:
        """The same for backward hooks (transformer-lens's `hook_point.bwd_hooks`)."""
        return list(_visible(self._bwd_fns))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # nn.Module.__call__'s dispatch costs several times what an unhooked point does: go straight to forward
        # unless torch's own module hooks are attached to this point
        if self._forward_hooks or self._forward_pre_hooks or self._backward_hooks or self._backward_pre_hooks:
            return super().__call__(x)
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fns:
            if self.copies and any(type(h.fn) is not Store for h in self._fns):  # a cache's store edits nothing
                x = x.clone()
            owner = _owner()
            for handle in [h for h in self._fns if h.owner is None or h.owner is owner]:  # a snapshot: hooks may add hooks
                fn = handle.fn
                if type(fn) is Store:  # a cache's store: nothing to check, nothing replaced
                    fn.into[self.name] = x.detach() if fn.detach and x.requires_grad else x
                else:
                    x = self._apply_hook(handle, x, "activation")
        if self._bwd_fns and x.requires_grad and torch.is_grad_enabled() and _visible(self._bwd_fns):
            # Hook a fresh autograd node, not x itself: the same tensor often passes two points
            # (resid_post of block l is resid_pre of block l+1), and hooks on one tensor run in the
            # order they were registered, so the earlier point would see the gradient before the
            # later point's hook could replace it. It also keeps hooks off the caller's leaf tensors.
            # The hooks attached now belong to this forward's graph: a backward pass through it runs them, also
            # after their block ended, as transformer-lens's do (torch binds a module's backward hooks when it
            # runs forward); a forward after the block carries none.
            x = x.view_as(x)
            x.register_hook(partial(self._backward, _visible(self._bwd_fns)))
        return x

    def _backward(self, handles: list[HookHandle], grad: torch.Tensor) -> torch.Tensor:
        for handle in handles:
            grad = self._apply_hook(handle, grad, "gradient")
        return grad

    def _apply_hook(self, handle: HookHandle, x: torch.Tensor, what: str) -> torch.Tensor:
        """The hook's replacement for x, checked, or x itself when it returns None."""
        fn, point = handle.fn, handle.seen_as or self
        try:
            out = fn(x, hook=point) if handle.by_keyword else fn(x, point)
        except Exception as err:
            if hasattr(err, "add_note"):  # Python 3.11+: say where the user's hook failed, keep its type
                err.add_note(f"raised by the hook {getattr(fn, '__name__', fn)!r} on {self.name!r}")
            raise
        if out is None or out is x:  # nothing replaced (an in-place edit is the hook's own, as with None)
            return x
        if what == "gradient" and isinstance(out, tuple) and len(out) == 1:
            out = out[0]  # torch's backward-hook convention, (grad,), which transformer-lens's backward hooks accept
            if out is None or out is x:
                return x
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"hook on {self.name!r} returned {type(out).__name__}; return a Tensor or None")
        if out.shape != x.shape:
            raise ValueError(
                f"hook on {self.name!r} returned shape {tuple(out.shape)}, but the {what} has shape "
                f"{tuple(x.shape)}; a hook must return a tensor of the same shape (or None)"
            )
        if out.dtype != x.dtype or out.device != x.device:
            raise ValueError(
                f"hook on {self.name!r} returned a {out.dtype} tensor on {out.device}, but the {what} is "
                f"{x.dtype} on {x.device}; convert it with .to({what})"
            )
        # a view of x's own memory holds x's values (an in-place edit is the hook's own, as with None): not checked
        if out.is_floating_point() and out.data_ptr() != x.data_ptr() and bool(torch.isnan(out).any()):
            # -inf stays allowed: masking attention scores by hook is a legitimate edit
            raise ValueError(f"hook on {self.name!r} returned a tensor containing NaN")
        return out

    def __getstate__(self) -> dict:
        # hooks belong to the call or `with` block that attached them: a copy of the model
        # (copy.deepcopy inside a block, process_weights) must not keep them after the block ends
        state = self.__dict__.copy()
        state["_fns"], state["_bwd_fns"], state["ctx"] = [], [], {}
        return state

    def extra_repr(self) -> str:  # transformer-lens's: the name once named, then how many hooks of each kind
        counts = [f"{len(fns)} {kind}" for fns, kind in ((self._fns, "fwd"), (self._bwd_fns, "bwd")) if fns]
        return ", ".join(([f"name={self.name!r}"] if self.name != "<unnamed>" else []) + counts)
