"""Compiled forwards: a model's hook-free forward and its cache-everything forward through `torch.compile`.

At small shapes a forward costs mostly Python and kernel launches (a bundled-model forward on a GPU is 1.6-3.6 ms,
nearly all of it launching); compiling fuses the small kernels and, with `mode="reduce-overhead"` on a GPU, replays
the whole forward as one CUDA graph. Opt in, and measure (benchmark workload `compiled`): on a CPU, or at large
shapes, eager is often as fast, and the first call of each shape pays the compile.

    fast = compile_forwards(model, mode="reduce-overhead")   # on CUDA: CUDA graphs
    logits = fast(tokens)                                   # = model(tokens), hook-free
    logits, cache = fast.run_with_cache(tokens)             # = model.run_with_cache(tokens, names=...)

Hooks: the compiled forwards run the model's own hook points (the cache is what its hook points store), so they
refuse to run while this context has other hooks attached, rather than compile a version per hook set; hooked runs
belong to the eager model, which is unchanged by compiling.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from probe.hooks import ActivationCache, HookedRootModule, NameFilter
from probe.hooks.hook_point import Store, compiled_scope

# torch.compile modes that replay CUDA graphs: their outputs live in memory the next replay overwrites
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


class CompiledForwards:
    """`model`'s forward (`__call__`) and cache-everything forward (`run_with_cache`), compiled on first use.

    `names` picks what `run_with_cache` stores, as `model.run_with_cache(names=...)` does (default: every hook point
    but the opt-in ones); it is fixed here so that one compiled graph serves every call. `mode`, `backend` and
    `dynamic` go to `torch.compile`. Results equal the eager model's to float rounding."""

    def __init__(self, model: HookedRootModule, *, names: Optional[NameFilter] = None, mode: Optional[str] = None,
                 backend: str = "inductor", dynamic: Optional[bool] = None):
        if not isinstance(model, HookedRootModule):
            raise TypeError(f"compile_forwards needs a hooked model (a HookedDecoder), got {type(model).__name__}")
        self.model = model
        self.names = model.select_hook_names(names)  # resolved now: a misspelt name fails before any compiling
        self.mode, self.backend, self.dynamic = mode, backend, dynamic
        self._compiled = None  # made on first use: importing the compiler alone takes seconds
        # one store for every call: the compiled graph writes into this dict, and a new dict per call would not
        # match the graph's guards (a recompile per call)
        self._store: dict[str, torch.Tensor] = {}
        self._keep = Store(self._store)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output for these arguments (any the model's forward takes), without hooks."""
        self._refuse_hooks("__call__")
        with compiled_scope():
            out = self._compiled_model()(*args, **kwargs)
        return self._owned(out, {})

    def run_with_cache(self, *args: Any, **kwargs: Any) -> tuple[Any, ActivationCache]:
        """`(output, cache)`, as `model.run_with_cache(*args, names=self.names, **kwargs)` returns them."""
        self._refuse_hooks("run_with_cache")
        for keyword in ("names", "names_filter", "fwd_hooks", "grads_of", "incl_bwd", "device", "dtype"):
            if keyword in kwargs:
                raise TypeError(f"CompiledForwards.run_with_cache does not take {keyword}=: its names are fixed when "
                                f"compiling (compile_forwards(model, names=...)); for the rest use model.run_with_cache")
        self._store.clear()
        try:
            compiled = self._compiled_model()
            with compiled_scope(), self.model.hooks([(self.names, self._keep)]):
                out = compiled(*args, **kwargs)
            copies: dict[int, torch.Tensor] = {}  # one tensor at two points (resid_post, resid_pre) copied once
            store = {name: self._owned(t, copies) for name, t in self._store.items()}
        finally:
            self._store.clear()  # the model's activations are the caller's now, not this object's
        return self._owned(out, copies), self.model.make_cache(store)

    def _compiled_model(self):
        if self._compiled is None:
            self._compiled = torch.compile(self.model, mode=self.mode, backend=self.backend, dynamic=self.dynamic)
        return self._compiled

    def _owned(self, out: Any, copies: dict[int, torch.Tensor]) -> Any:
        """`out`, copied out of the CUDA graph's memory where the next replay would overwrite it."""
        if self.mode not in CUDA_GRAPH_MODES or not isinstance(out, torch.Tensor) or not out.is_cuda:
            return out
        if id(out) not in copies:
            copies[id(out)] = out.clone()
        return copies[id(out)]

    def _refuse_hooks(self, what: str) -> None:
        hooked = [name for name in self.model.hook_names if self.model.hook_point(name).active]
        if hooked:
            shown = ", ".join(hooked[:3]) + (f" and {len(hooked) - 3} more" if len(hooked) > 3 else "")
            raise RuntimeError(
                f"the compiled {what} runs without hooks, but hooks are attached to {shown}; run hooked calls on the "
                f"eager model (model.run_with_hooks, model.run_with_cache), or remove them first (model.reset_hooks() "
                f"for add_hook's)")

    def __repr__(self) -> str:
        return (f"CompiledForwards({type(self.model).__name__}, {len(self.names)} cached names, backend={self.backend!r}, "
                f"mode={self.mode!r})")


def compile_forwards(model: HookedRootModule, *, names: Optional[NameFilter] = None, mode: Optional[str] = None,
                     backend: str = "inductor", dynamic: Optional[bool] = None) -> CompiledForwards:
    """`model`'s hook-free and cache-everything forwards through `torch.compile` (see CompiledForwards).

    `mode="reduce-overhead"` on a GPU replays CUDA graphs (what small, launch-bound shapes want); the outputs are then
    copied out of the graph's memory, so a kept cache stays valid after the next call."""
    return CompiledForwards(model, names=names, mode=mode, backend=backend, dynamic=dynamic)
