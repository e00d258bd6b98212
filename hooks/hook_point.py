"""HookPoint: an identity module that lets callers read or replace the tensor passing through it."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

HookFn = Callable[[torch.Tensor, "HookPoint"], Optional[torch.Tensor]]


class HookHandle:
    """One attachment of a hook function to a HookPoint; `remove()` detaches exactly that one, and
    removing twice is harmless. The same function attached twice gets two handles, so an inner
    `with` block that re-attaches a function leaves the outer block's hooks in their order."""

    def __init__(self, point: "HookPoint", fn: HookFn):
        self.point, self.fn = point, fn

    def remove(self) -> None:
        handles = self.point._fns
        for i, registered in enumerate(handles):
            if registered is self:
                del handles[i]
                return


class HookPoint(nn.Module):
    """Identity on its input, except for the hook functions attached to it.

    A hook is `fn(activation, hook) -> Tensor | None`; returning a tensor replaces the activation.
    The replacement must keep the activation's shape, so a mistake surfaces here, named, rather
    than as a broadcasting error layers later.

    `opt_in` marks points whose activation costs extra work to compute (per-head results): the
    model computes them only while something is attached, and a cache of "everything" skips them.
    """

    def __init__(self, opt_in: bool = False):
        super().__init__()
        self.name: str = "<unnamed>"  # set by HookedRootModule.setup_hooks
        self.opt_in = opt_in
        self._fns: list[HookHandle] = []  # in the order the hooks run

    @property
    def active(self) -> bool:
        return bool(self._fns)

    def add(self, fn: HookFn) -> HookHandle:
        if not callable(fn):
            raise TypeError(f"hook for {self.name!r} must be callable as fn(activation, hook), got {type(fn).__name__}")
        handle = HookHandle(self, fn)
        self._fns.append(handle)
        return handle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fn in [handle.fn for handle in self._fns]:
            try:
                out = fn(x, self)
            except Exception as err:
                if hasattr(err, "add_note"):  # Python 3.11+: say where the user's hook failed, keep its type
                    err.add_note(f"raised by the hook {getattr(fn, '__name__', fn)!r} on {self.name!r}")
                raise
            if out is None:
                continue
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"hook on {self.name!r} returned {type(out).__name__}; return a Tensor or None")
            if out.shape != x.shape:
                raise ValueError(
                    f"hook on {self.name!r} returned shape {tuple(out.shape)}, but the activation has shape "
                    f"{tuple(x.shape)}; a hook must return a tensor of the same shape (or None)"
                )
            if out.dtype != x.dtype or out.device != x.device:
                raise ValueError(
                    f"hook on {self.name!r} returned a {out.dtype} tensor on {out.device}, but the activation is "
                    f"{x.dtype} on {x.device}; convert it with .to(activation)"
                )
            if out.is_floating_point() and bool(torch.isnan(out).any()):
                # -inf stays allowed: masking attention scores by hook is a legitimate edit
                raise ValueError(f"hook on {self.name!r} returned a tensor containing NaN")
            x = out
        return x

    def extra_repr(self) -> str:
        return f"name={self.name!r}"
