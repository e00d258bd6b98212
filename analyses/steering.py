"""Steering: add a direction to the residual stream while the model runs (activation addition).

A contrastive steering vector (CAA, Rimsky et al. 2023; ActAdd is the one-pair case, Turner et al. 2023) is the
mean over prompt pairs of the activation difference positive - negative at one hook point of one layer.
`steer(model, vector, coefficient)` adds coefficient x direction there on every forward pass made inside a
`with` block, or inside a generation given `steering=`; outside it nothing is attached, so steering costs nothing
when it is off. An SAE feature steers by its decoder row: `steer(model, feature=(sae, index), coefficient=...)`.

Positions. "all" steers every position of every pass. "prompt" and "generated" cut the sequence where the first
forward pass made inside the block ends: that pass is the prompt, every later position is generated. A position
is its index in the sequence so far: its column, plus the KV cache's length when the pass continues a cache. So a
cached generation (the prompt in one pass, then one-token decode steps at index L, L + 1, ...) and an uncached
one (every step re-runs the whole sequence from index 0) steer the same positions, and the keys and values the
cache keeps for the prompt are those a full re-forward computes. Each block starts over, so use one block (one
`applied`) per generation, as `generate(..., steering=...)` does.

The vectors themselves (`SteeringVector`, `steering_vector`, their files) live in `analyses.steering_vectors`.
"""
from __future__ import annotations

import math
import numbers
import re
from contextlib import contextmanager
from typing import Iterator, Literal, Optional, Sequence, Union

import torch

from probe.analyses.architecture import refuse_bidirectional
from probe.analyses.common import is_int
from probe.analyses.sae_checks import check_sae
from probe.analyses.steering_vectors import SITES, Position, SteeringVector, site_name, steering_vector, vector_paths
from probe import HookedDecoder, SparseAutoencoder
from probe.hooks.hook_point import current_owner

__all__ = ["POSITIONS", "Position", "Positions", "SITES", "Steering", "SteeringVector", "site_name", "steer", "steering_vector", "vector_paths"]

Positions = Literal["all", "prompt", "generated"]
POSITIONS = ("all", "prompt", "generated")


class _PassSplit:
    """Where the prompt ends, for "prompt" / "generated": read from the first pass, and each pass's offset (the
    KV cache's length before it) from the model's forward arguments."""

    def __init__(self) -> None:
        self.offset = 0
        self.prompt_length: Optional[int] = None
        # the torch pre-hook sits on the model, so it sees every thread's passes, while the steering hooks run only
        # in this context's (probe's hooks are scoped): another thread's forward must not move this one's offset
        self.owner = current_owner()

    def before_pass(self, module, args, kwargs) -> None:
        if current_owner() is not self.owner:
            return
        cache = kwargs.get("kv_cache")
        self.offset = 0 if cache is None else cache.length  # read before layer 0 appends to it

    def cut(self, n: int) -> int:
        """The column of this pass's first generated position, in [0, n]."""
        if self.prompt_length is None:
            self.prompt_length = self.offset + n
        return min(max(self.prompt_length - self.offset, 0), n)


class Steering:
    """coefficient x direction added at `site` of each of `layers`, at `positions`, on every forward pass made
    inside `applied(model)`, or inside `with` this object (for the model `steer` was given)."""

    def __init__(self, model: HookedDecoder, direction: torch.Tensor, coefficient: float, layers: tuple[int, ...],
                 site: str, positions: str):
        self.model, self.direction, self.coefficient = model, direction, coefficient
        self.layers, self.site, self.positions = layers, site, positions
        self._entered: list = []  # one context per `with`, so the object nests and re-enters

    def __repr__(self) -> str:
        layers = ", ".join(f"L{layer}" for layer in self.layers)
        return (f"Steering({self.coefficient:g} x direction of norm {float(self.direction.norm()):.3g} at {self.site} of "
                f"{layers}, positions={self.positions!r})")

    def check(self, model: HookedDecoder) -> list[str]:
        """The hook names it steers in `model`, once checked to exist and to be as wide as the direction."""
        if self.direction.shape[0] != model.cfg.d_model:
            raise ValueError(f"the direction has d_model={self.direction.shape[0]}, but the model has "
                             f"d_model={model.cfg.d_model}: it was made for another model")
        if self.positions != "all":  # the split is a generation's: its prompt, then the tokens generated
            refuse_bidirectional(model, f"steering positions={self.positions!r}", "it does not generate (each new token "
                                 "would change what every earlier position sees), and a prompt/generated split means "
                                 "nothing", "steer positions='all' inside `with steer(...):` around forward passes")
        return [site_name(model, self.site, layer) for layer in self.layers]

    @contextmanager
    def applied(self, model: HookedDecoder) -> Iterator[HookedDecoder]:
        """Attach the steering to `model` for the block; everything is removed on exit, whatever happens."""
        names = self.check(model)
        if self.coefficient == 0:  # adds nothing: attach nothing, so the block is bit-identical to no block
            yield model
            return
        delta = (self.coefficient * self.direction.float()).to(model.device, model.W_E.dtype)
        split = None if self.positions == "all" else _PassSplit()
        steer_prompt = self.positions == "prompt"

        def add(x: torch.Tensor, hook) -> Optional[torch.Tensor]:
            d = delta if delta.dtype == x.dtype and delta.device == x.device else delta.to(x)
            if split is None:
                return x + d
            cut = split.cut(x.shape[1])
            lo, hi = (0, cut) if steer_prompt else (cut, x.shape[1])
            if lo == hi:
                return None  # a decode step outside the steered part: nothing to do
            if lo == 0 and hi == x.shape[1]:
                return x + d
            columns = torch.zeros(x.shape[1], 1, dtype=x.dtype, device=x.device)
            columns[lo:hi] = 1
            return x + columns * d

        add.__name__ = f"steering at {self.site}"
        handle = None
        try:
            if split is not None:
                handle = model.register_forward_pre_hook(split.before_pass, with_kwargs=True)
            with model.hooks([(names, add)]):
                yield model
        finally:
            if handle is not None:
                handle.remove()

    def __enter__(self) -> "Steering":
        context = self.applied(self.model)
        context.__enter__()
        self._entered.append(context)
        return self

    def __exit__(self, *exc) -> Optional[bool]:
        return self._entered.pop().__exit__(*exc)


def _layers(layers, default: int) -> tuple[int, ...]:
    if layers is None:
        return (default,)
    items = [layers] if is_int(layers) else list(layers) if isinstance(layers, (list, tuple, range)) else None
    if not items or not all(is_int(layer) for layer in items):
        raise ValueError(f"layers={layers!r} must be a layer index or a non-empty list of them")
    if len(set(map(int, items))) != len(items):
        raise ValueError(f"layers={layers!r} lists a layer twice; each listed layer gets the direction once")
    return tuple(int(layer) for layer in items)


def _feature_direction(model: HookedDecoder, feature) -> tuple[torch.Tensor, str, int]:
    """(decoder row, site, layer) of `feature` = (sae, index)."""
    if not (isinstance(feature, tuple) and len(feature) == 2):
        raise ValueError(f"feature must be (sae, index), got {feature!r}")
    sae, index = feature
    name = check_sae(model, sae)
    match = re.fullmatch(r"blocks\.(\d+)\.hook_(\w+)", name)
    if match is None or match.group(2) not in SITES:
        raise ValueError(f"the SAE reads {name!r}; a feature steers by its decoder row, added where the SAE reads, "
                         f"so the SAE must read a residual-width block point ({', '.join(SITES)})")
    if not is_int(index) or not 0 <= int(index) < sae.cfg.d_sae:
        raise ValueError(f"feature index {index!r} must be an int in [0, d_sae={sae.cfg.d_sae})")
    return sae.W_dec[int(index)].detach().float().cpu(), match.group(2), int(match.group(1))


def steer(model: HookedDecoder, vector: Union[SteeringVector, torch.Tensor, None] = None, coefficient: float = 1.0, *,
          feature: Optional[tuple[SparseAutoencoder, int]] = None, layers: Union[int, Sequence[int], None] = None,
          site: Optional[str] = None, positions: Positions = "all") -> Steering:
    """A Steering that adds `coefficient` x the direction: a SteeringVector's (at its site; layers default to its
    layer), a raw tensor [d_model] (site default resid_pre; give layers), or an SAE feature's decoder row
    (`feature=(sae, index)`, at the SAE's hook point). Use it as `with steer(...):` or
    `model.generate(..., steering=steer(...))`; see the module docstring for `positions`."""
    if isinstance(vector, tuple):  # steer(model, (sae, index), coefficient)
        if feature is not None:
            raise ValueError("give the SAE feature once: as feature=(sae, index) or in the vector's place, not both")
        vector, feature = None, vector
    if (vector is None) == (feature is None):
        raise ValueError("give exactly one of a vector (SteeringVector or tensor [d_model]) and feature=(sae, index)")
    if not isinstance(coefficient, numbers.Real) or isinstance(coefficient, bool) or not math.isfinite(coefficient):
        raise ValueError(f"coefficient={coefficient!r} must be a finite number")
    if positions not in POSITIONS:
        raise ValueError(f"positions={positions!r}; choose one of: {', '.join(POSITIONS)}")
    if feature is not None:
        direction, own_site, own_layer = _feature_direction(model, feature)
    elif isinstance(vector, SteeringVector):
        vector.check_fits(model)
        direction, own_site, own_layer = vector.direction.detach().float().cpu(), vector.site, vector.layer
    elif isinstance(vector, torch.Tensor):
        if vector.dim() != 1 or not vector.is_floating_point():
            raise ValueError(f"a direction tensor must be 1-D floating [d_model], got {tuple(vector.shape)} {vector.dtype}")
        if layers is None:
            raise ValueError("a raw direction tensor says nothing about where to add it: pass layers=")
        direction, own_site, own_layer = vector.detach().float().cpu(), "resid_pre", None
    else:
        raise TypeError(f"vector must be a SteeringVector or a tensor [d_model], got {type(vector).__name__}")
    steering = Steering(model, direction, float(coefficient), _layers(layers, own_layer), site or own_site, positions)
    steering.check(model)  # every layer and the width now, not at the first forward
    return steering
