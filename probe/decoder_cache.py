"""DecoderCache: a decoder's activation cache with transformer-lens's ActivationCache keys and methods.

The keys and housekeeping (remove_batch_dim, apply_slice_to_batch_dim; `to` is ActivationCache's) live here;
the stacks of the residual stream (accumulated_resid, decompose_resid, stack_head_results, logit_attrs, ...) in
probe.cache_stacks, over the arithmetic of probe.residual_stack.
"""
from __future__ import annotations

import copy
import re
import weakref
from collections.abc import Mapping, Sequence
from typing import Optional

import torch

import probe.residual_stack as rs
from probe.hooks import ActivationCache
from probe.hooks.names import UnknownNameError, unknown_name_error
from probe.cache_stacks import ModelGoneError, StackMethods
from probe.names import act_name
from probe.tl_surface import GUIDE

_SUBLAYERS = {"a": "attn", "attn": "attn", "attention": "attn", "m": "mlp", "mlp": "mlp", "b": "", "block": "",
              "blocks": "", "": ""}
_NORMS = ("ln1", "ln2", "ln1_post", "ln2_post")


__all__ = ["DecoderCache", "ModelGoneError"]


class DecoderCache(StackMethods, ActivationCache):
    """An ActivationCache that knows which decoder made it (by weak reference: the cache never keeps the model
    alive) and whether its tensors still have their batch dimension.

    Keys are full hook names or transformer-lens's short forms: `cache["pattern", 0]`, `cache["pattern", 0, "attn"]`,
    `cache["resid_post", -1]`, `cache["scale", 2, "ln1"]`, `cache["embed"]`, `cache["scale"]` (ln_final's), and
    gradients `cache["resid_pre_grad", 0]` as well as `cache["blocks.0.hook_resid_pre_grad"]`.
    """

    def __init__(self, activations: Mapping[str, torch.Tensor], model=None, has_batch_dim: bool = True,
                 listed: Optional[Sequence[str]] = None):
        super().__init__(activations, None if model is None else model.hook_aliases, listed)
        self._model = None if model is None else weakref.ref(model)
        self.has_batch_dim = has_batch_dim
        self._cfg = None if model is None else model.cfg  # frozen and tensor-free: the architecture, not the model

    def _like(self, activations: Mapping[str, torch.Tensor], has_batch_dim: bool) -> "DecoderCache":
        new = DecoderCache(activations, has_batch_dim=has_batch_dim)
        new._model, new._cfg = self._model, self._cfg
        new._from_file, new._aliases, new._listed = self._from_file, self._aliases, self._listed
        return new

    _from_file = False  # True once unpickled: the cache then has no model, and says why

    # ---- saving: torch.save(cache, f) as transformer-lens users write it --------------------------------------
    def __getstate__(self) -> dict:
        # a weak reference cannot be pickled, and a file is no place for the model: the activations, the config and
        # has_batch_dim are saved, and the methods that need the weights say so after torch.load
        return {**self.__dict__, "_model": None, "_from_file": True}

    def __deepcopy__(self, memo: dict) -> "DecoderCache":
        # a copy in memory still knows its model (weakly, as the original); only a file loses it
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update({k: v if k == "_model" else copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return new

    def _live_model(self, method: str):
        if self._from_file:
            raise ModelGoneError(f"{method} needs the model's weights, but this cache was loaded from a file "
                                 f"(torch.save keeps the activations, not the model); run the prompt again with "
                                 f"model.run_with_cache(...) for a cache whose methods can read the weights")
        return super()._live_model(method)

    def __repr__(self) -> str:
        return f"DecoderCache({len(self)} activations, {self.nbytes / 2**20:.1f} MiB, has_batch_dim={self.has_batch_dim})"

    # ---- keys -----------------------------------------------------------------------------------------
    def __getitem__(self, key) -> torch.Tensor:
        return self._acts[self._name(key)]

    def __contains__(self, key) -> bool:
        try:
            self._name(key)
        except KeyError:
            return False
        return True

    def _name(self, key) -> str:
        """The full hook name a key stands for, or an UnknownNameError saying what is wrong with it."""
        own = self.own_name(key) if isinstance(key, str) else None
        if own is not None:
            return own
        if isinstance(key, str):
            name, problem = self._short_name(key)
        elif isinstance(key, tuple) and 1 <= len(key) <= 3 and isinstance(key[0], str):
            name, problem = self._tuple_name(*key)
        else:
            raise UnknownNameError(f"cache keys are hook names (str) or (kind, layer[, sublayer]) tuples, got {key!r}")
        if problem is not None:
            raise UnknownNameError(f"cache[{key!r}]: {problem}")
        if name not in self._acts:
            error = unknown_name_error(name, list(self._acts), what="cached activation")
            if name.endswith("_grad"):
                error = UnknownNameError(f"{error}; gradients are cached by run_with_cache(..., incl_bwd=True) or "
                                         f"grads_of=...")
            raise error
        return name

    def _short_name(self, key: str) -> tuple[str, Optional[str]]:
        if "." in key or key.startswith("hook_"):
            return key, None  # a full name: the lookup reports the closest ones
        kind, grad = (key[:-5], "_grad") if key.endswith("_grad") else (key, "")
        try:
            return act_name(kind) + grad, None
        except ValueError as error:
            reason = str(error)
        # transformer-lens's shorthand, parsed as its get_act_name does: a word, the layer, then a sublayer or norm
        # ('k6', 'pattern3', 'k6a', 'scale4ln1'); a kind with an underscore is no word there, so 'resid_pre6' is no
        # shorthand in TL either, and is told the tuple instead
        shorthand = re.fullmatch(r"([a-z]+)(\d+)([a-z]?.*)", kind)
        if shorthand:
            return self._tuple_name(shorthand[1] + grad, int(shorthand[2]), shorthand[3] or None)
        spelled = re.fullmatch(r"([a-z_]+?)(\d+)", kind)
        if spelled:
            return key, f"transformer-lens reads no shorthand with an underscore; write cache[{spelled[1]!r}, {spelled[2]}]"
        try:
            act_name(kind, 0)
        except ValueError:
            return key, reason
        return key, f"{kind!r} is inside a block: give its layer, e.g. cache[{key!r}, 0]"

    def _tuple_name(self, kind: str, layer=None, sublayer: Optional[str] = None) -> tuple[str, Optional[str]]:
        kind, grad = (kind[:-5], "_grad") if kind.endswith("_grad") else (kind, "")
        if layer is not None:
            try:
                layer = int(layer.__index__())
            except (AttributeError, TypeError):
                return "", f"the layer must be an int, got {layer!r}"
            if layer < 0:
                if layer < -self._n_layers:
                    return "", f"layer {layer} counts back past the first of the {self._n_layers} layers"
                layer += self._n_layers
        norm = sublayer if sublayer in _NORMS else None
        try:
            name = act_name(kind, layer, norm) if layer is not None else act_name(kind, norm=norm)
        except ValueError as error:
            return "", str(error)
        if sublayer is not None and norm is None:
            where = name.split(".")[2] if name.count(".") == 3 else ""
            if sublayer not in _SUBLAYERS or _SUBLAYERS[sublayer] != where:
                return "", (f"{kind!r} is in {where or 'the block itself'}, not in {sublayer!r}; drop the third "
                            f"element or pass {where!r}")
        return name + grad, None

    @property
    def _n_layers(self) -> int:
        if self._cfg is not None:
            return self._cfg.n_layers
        layers = [int(n.split(".")[1]) for n in self._acts if n.startswith("blocks.") and n.split(".")[1].isdigit()]
        return max(layers) + 1 if layers else 0

    # ---- transformer-lens's housekeeping --------------------------------------------------------------
    def remove_batch_dim(self, batch_size: Optional[int] = None) -> "DecoderCache":
        """Drop the batch dimension of a one-prompt cache, in place (as transformer-lens), and return the cache.
        `batch_size`: transformer-lens 4's, the batch size the caller knows (it must be 1)."""
        if self.has_batch_dim:
            sizes = {t.shape[0] for t in self._acts.values() if t.dim() > 0} | ({batch_size} - {None})
            if sizes - {1}:
                raise ValueError(f"remove_batch_dim needs a cache of one prompt, got batch sizes {sorted(sizes)}; "
                                 f"take one with cache.apply_slice_to_batch_dim(i)")
            self._acts = {name: t[0] if t.dim() > 0 else t for name, t in self._acts.items()}
            self.has_batch_dim = False
        return self

    def apply_slice_to_batch_dim(self, batch_slice) -> "DecoderCache":
        """A new cache of some prompts (transformer-lens's slice inputs); an int drops the batch dimension."""
        if not self.has_batch_dim:
            raise ValueError("this cache has no batch dimension (remove_batch_dim) to slice")
        index = rs.to_index(batch_slice, "batch_slice")
        return self._like({n: rs.take(t, index, 0) for n, t in self._acts.items()}, not isinstance(index, int))

    def toggle_autodiff(self, mode: bool = False):
        """Refused: transformer-lens's flips torch's global autograd switch. A probe cache holds detached tensors, so
        there is no graph to free; call torch.set_grad_enabled(mode) (or use `with torch.no_grad():`) yourself."""
        raise RuntimeError("cache.toggle_autodiff is not supported: a probe cache already holds detached tensors, and "
                           f"flipping torch's global autograd from a cache surprises; call torch.set_grad_enabled({mode}) "
                           f"or use `with torch.no_grad():` instead (see {GUIDE})")
