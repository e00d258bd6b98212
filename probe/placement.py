"""Placing one model across several devices: what each part weighs (counted on the meta device, so planning a
70B model allocates nothing), a plan that fills the devices in layer order, and dispatch, which moves each part
to its device and the residual stream with it.

The parts are the embedding (token and position embeddings), each block, and the head (final norm and
unembedding). A model with tied embeddings keeps its head beside the embedding, whose matrix it shares: the
residual goes back to the first device for the logits.

    plan = HookedDecoder.plan_device_map(cfg, {"cuda:0": "40GiB", "cuda:1": "40GiB"}, dtype=torch.bfloat16)
    model = HookedDecoder.from_pretrained(path, device_map=plan)   # or device_map="auto"

The model class is always passed in (the functions here never import it): the model imports this module.

Moving the residual is done by forward pre-hooks on the parts (torch's, not hook points: they are plumbing, not
analysis), listed in `model.placement` and removed by `model.placement.remove()`; the forward itself does not
know about devices. Hook points see activations on their block's device, and a cache holds each one there.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

import torch
from torch import nn

from probe.config import DecoderConfig

DeviceMap = Mapping[Union[str, int], Union[str, torch.device]]
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class PartSizes:
    """Bytes of parameters and buffers of each part, in the dtype asked for."""

    embed: int
    blocks: tuple[int, ...]
    head: int  # without the unembedding matrix when it is the embedding's (tied)
    tied: bool

    @property
    def total(self) -> int:
        return self.embed + sum(self.blocks) + self.head


def part_names(n_layers: int) -> list[str]:
    return ["embed", *(f"blocks.{layer}" for layer in range(n_layers)), "head"]


def part_sizes(model_class: type, cfg: DecoderConfig, dtype: torch.dtype = torch.float32) -> PartSizes:
    """Each part's bytes, from a `model_class(cfg)` built on the meta device (no memory, a second for 70B)."""
    with torch.device("meta"):
        model = model_class(cfg)
    itemsize = dtype.itemsize
    seen: set[int] = set()

    def size(*modules: Optional[nn.Module]) -> int:
        total = 0
        for module in filter(None, modules):
            for tensor in [*module.parameters(), *module.buffers()]:
                if id(tensor) not in seen:  # a tied matrix counts where it is first met: the embedding
                    seen.add(id(tensor))
                    total += tensor.numel() * (itemsize if tensor.is_floating_point() else tensor.element_size())
        return total

    embed = size(model.embed, model.pos_embed)
    blocks = tuple(size(block) for block in model.blocks)
    return PartSizes(embed, blocks, size(model.ln_final, model.unembed), cfg.tied_embeddings)


def parse_bytes(amount: Union[int, float, str]) -> int:
    """`40GiB`, `40 GB`, `512MiB` or a number of bytes."""
    if isinstance(amount, (int, float)) and not isinstance(amount, bool):
        return int(amount)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?I?B)\s*", str(amount).upper())
    if match is None:
        raise ValueError(f"memory amount {amount!r} is not understood; write it like '40GiB', '512MB' or 1073741824")
    return int(float(match[1]) * _UNITS[match[2]])


def available_memory(reserve: float = 0.1) -> dict[str, int]:
    """What device_map="auto" fills: each CUDA device's free memory less `reserve` of it for activations, or,
    with no CUDA device, the host's available memory."""
    if torch.cuda.is_available():
        return {f"cuda:{i}": int(torch.cuda.mem_get_info(i)[0] * (1 - reserve)) for i in range(torch.cuda.device_count())}
    try:
        import psutil

        return {"cpu": int(psutil.virtual_memory().available * (1 - reserve))}
    except ImportError:
        import os

        return {"cpu": int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * (1 - reserve))}


def plan_device_map(model_class: type, cfg: DecoderConfig, max_memory: Optional[Mapping[str, Union[int, str]]] = None,
                    dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """{part: device}: the embedding, then the blocks in order, filling each device of `max_memory` (in its order)
    before the next; the head goes where the last block is (with tied embeddings: beside the embedding).
    A part never straddles two devices; the error says by how much the model does not fit."""
    budgets = {str(device): parse_bytes(amount) for device, amount in (max_memory or available_memory()).items()}
    if not budgets:
        raise ValueError("max_memory names no device; give e.g. {'cuda:0': '40GiB', 'cuda:1': '40GiB'}")
    sizes = part_sizes(model_class, cfg, dtype)
    devices, left, plan = list(budgets), dict(budgets), {}
    current = 0
    parts = [("embed", sizes.embed), *((f"blocks.{i}", b) for i, b in enumerate(sizes.blocks)), ("head", sizes.head)]
    for name, need in parts:
        if name == "head" and sizes.tied:
            device = plan["embed"]
            if left[device] < need:
                raise ValueError(f"the final norm ({need / 2**30:.2f} GiB) does not fit beside the tied embedding on {device}")
            plan[name], left[device] = device, left[device] - need
            continue
        while left[devices[current]] < need:
            current += 1
            if current == len(devices):
                short = sizes.total - sum(budgets.values())
                raise ValueError(
                    f"the model needs {sizes.total / 2**30:.2f} GiB in {dtype} but max_memory gives "
                    f"{sum(budgets.values()) / 2**30:.2f} GiB ({name} of {need / 2**30:.2f} GiB does not fit"
                    + (f"; {short / 2**30:.2f} GiB short" if short > 0 else ", parts cannot be split") +
                    "): add a device, raise its budget, or load in a smaller dtype")
        plan[name], left[devices[current]] = devices[current], left[devices[current]] - need
    return plan


def normalise_device_map(device_map: DeviceMap, n_layers: int) -> dict[str, str]:
    """{part: device} from a plan, or from {layer: device} (the embedding then goes with layer 0, the head with
    the last layer); every part must be placed."""
    placed: dict[str, str] = {}
    for key, device in device_map.items():
        name = f"blocks.{key}" if isinstance(key, int) and not isinstance(key, bool) else str(key)
        if name not in part_names(n_layers):
            raise ValueError(f"device_map key {key!r} is not a part of this model; use layer numbers 0..{n_layers - 1} "
                             "or the names 'embed', 'blocks.N', 'head'")
        placed[name] = str(torch.device(device))
    missing = [f"blocks.{layer}" for layer in range(n_layers) if f"blocks.{layer}" not in placed]
    if missing:
        raise ValueError(f"device_map places no device for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    placed.setdefault("embed", placed["blocks.0"])
    placed.setdefault("head", placed[f"blocks.{n_layers - 1}"])
    return placed


def _move_inputs(device: torch.device):
    def pre_hook(module, args, kwargs):
        move = lambda x: x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x  # noqa: E731
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}

    return pre_hook


@dataclass
class Placement:
    """Where each part of a dispatched model lives, and the pre-hooks that move the residual between them."""

    device_map: dict[str, str]
    handles: list = field(default_factory=list, repr=False)

    @property
    def devices(self) -> list[str]:
        return list(dict.fromkeys(self.device_map.values()))

    def remove(self) -> None:
        """Take the pre-hooks off (the parts stay where they are)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def dispatch(model, device_map: Union[str, DeviceMap], max_memory: Optional[Mapping[str, Union[int, str]]] = None):
    """Move each part of `model` to its device and make the residual follow; `device_map="auto"` plans one from
    the free memory (or `max_memory`). Returns the model, with `model.placement` saying where everything is."""
    cfg = model.cfg
    if isinstance(device_map, str):
        if device_map != "auto":
            raise ValueError(f"device_map={device_map!r}: pass 'auto', a plan from plan_device_map, or {{layer: device}}")
        device_map = plan_device_map(type(model), cfg, max_memory, dtype=model.embed.W_E.dtype)
    placed = normalise_device_map(device_map, cfg.n_layers)
    if cfg.tied_embeddings and placed["head"] != placed["embed"]:
        raise ValueError("with tied embeddings the head shares the embedding matrix: put 'head' on the embedding's "
                         f"device ({placed['embed']}), not {placed['head']}")
    previous = getattr(model, "placement", None)
    if previous is not None:
        previous.remove()
    parts = {"embed": [model.embed, model.pos_embed], "head": [model.ln_final, model.unembed],
             **{f"blocks.{i}": [block] for i, block in enumerate(model.blocks)}}
    placement = Placement(placed)
    for name, modules in parts.items():
        device = torch.device(placed[name])
        for module in filter(None, modules):
            module.to(device)
            placement.handles.append(module.register_forward_pre_hook(_move_inputs(device), with_kwargs=True))
    model.placement = placement
    return model
