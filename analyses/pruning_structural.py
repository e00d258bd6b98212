"""Structural head pruning: a smaller model without the pruned heads (outputs equal to the original's with them
zero-ablated), its head map back to the original indices, and saving and loading it with that map."""
from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import torch

from probe.analyses.architecture import require_head_weights
from probe.analyses.common import is_int
from probe import HookedDecoder
from probe.io import atomic_directory

HeadMap = tuple[tuple[int, ...], ...]
HEAD_MAP_FILE = "head_map.json"


def head_map_of(model: HookedDecoder, head_map: Optional[Sequence[Sequence[int]]] = None) -> HeadMap:
    """The original index of each remaining head, per layer: `head_map` if given, else the one
    `prune_heads` / `load_pruned` attached to the model, else the identity for an unpruned model."""
    cfg = model.cfg
    if head_map is None:
        head_map = getattr(model, "head_map", None)
    if head_map is None:
        if cfg.heads_per_layer is not None:
            raise ValueError(
                "this model was structurally pruned, but which original heads remain is unknown (a model loaded "
                "with from_pretrained does not carry it): load it with analyses.load_pruned (saved with "
                "save_pruned), or pass head_map= (per layer, the original index of each remaining head)"
            )
        return tuple(tuple(range(cfg.n_heads)) for _ in range(cfg.n_layers))
    head_map = tuple(tuple(int(h) for h in layer) for layer in head_map)
    counts = [cfg.layer_heads(l) for l in range(cfg.n_layers)]
    if len(head_map) != cfg.n_layers or [len(layer) for layer in head_map] != counts or any(
        len(set(layer)) != len(layer) or not all(0 <= h < cfg.n_heads for h in layer) for layer in head_map
    ):
        raise ValueError(
            f"head_map must give, for each of the {cfg.n_layers} layers, the distinct original indices (< n_heads="
            f"{cfg.n_heads}) of its remaining heads (counts {counts}); got {head_map!r}"
        )
    return head_map


def original_heads(model: HookedDecoder, heads: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(layer, current index) pairs of a pruned model translated to (layer, original index)."""
    head_map = head_map_of(model)
    return [(l, head_map[l][h]) for l, h in heads]


def prune_heads(
    model: HookedDecoder,
    heads: Iterable[tuple[int, int]],
    head_map: Optional[Sequence[Sequence[int]]] = None,
) -> HookedDecoder:
    """A new model without `heads` (layer, ORIGINAL head index): their q/k/v rows of the fused qkv
    projection (weight and bias) and their columns of the output projection are removed, and each
    layer's remaining head count goes into `cfg.heads_per_layer`. Its outputs equal the original's
    with those heads' outputs zero-ablated (their share of the output bias b_O stays, as b_O is not
    per head). The input model is not changed and shares no storage with the result.

    The result carries `head_map` (see the module docstring). The input's head map is `head_map`,
    else its own `head_map` attribute, else the identity for an unpruned model. Save with
    `save_pruned` to keep the map; `save_pretrained` / `from_pretrained` keep the model but not it.
    """
    cfg = model.cfg
    require_head_weights(model, "prune_heads")
    if cfg.qk_norm_over_heads or cfg.sub_norms:
        what = "every head's z before W_O (BitNet)" if cfg.sub_norms else "q and k over all its heads together (OLMo 2)"
        raise ValueError(f"prune_heads: this model normalises {what}, so removing a head would change how the others "
                         "are normalised, not just zero its output; ablate heads instead (probe.analyses.ablation)")
    if cfg.n_kv_heads != cfg.n_heads:
        raise ValueError(
            f"prune_heads needs one key/value head per query head, but n_kv_heads={cfg.n_kv_heads} < n_heads="
            f"{cfg.n_heads}: a grouped key/value head serves several query heads and cannot go with one"
        )
    current = head_map_of(model, head_map)
    heads = list(heads)
    remove: list[set[int]] = [set() for _ in range(cfg.n_layers)]
    for pair in heads:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(is_int(i) for i in pair)):
            raise ValueError(f"heads must be (layer, head) pairs of ints; got {pair!r}")
        layer, head = pair
        if not 0 <= layer < cfg.n_layers or not 0 <= head < cfg.n_heads:
            raise ValueError(f"head {pair} is outside the model: layer < {cfg.n_layers}, head < {cfg.n_heads} (original indices)")
        if head not in current[layer]:
            raise ValueError(
                f"head {pair} was already pruned from this model (layer {layer} keeps original heads "
                f"{list(current[layer])}); heads are given by their index in the original model"
            )
        remove[layer].add(current[layer].index(head))
    keep = [[i for i in range(len(current[l])) if i not in remove[l]] for l in range(cfg.n_layers)]
    new_cfg = replace(cfg, heads_per_layer=tuple(len(k) for k in keep))

    # the state dict is transformer-lens's layout (probe.tl_state_dict): per-head tensors, indexed by the kept heads
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    for l, kept in enumerate(keep):
        idx = torch.tensor(kept, dtype=torch.long, device=model.device)
        for name in ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "W_O", "sinks"):
            key = f"blocks.{l}.attn.{name}"
            if key in state:  # (sinks: only in a model with them)
                state[key] = state[key][idx].contiguous()
    with torch.device(model.device), warnings.catch_warnings():
        # a layer left with no heads has empty projections, whose initialisation torch warns is a no-op
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        pruned = HookedDecoder(new_cfg, tokenizer=model.tokenizer)
    pruned.to(dtype=model.embed.W_E.dtype)
    pruned.load_state_dict(state, strict=True)
    pruned.train(model.training)
    pruned.head_map = tuple(tuple(current[l][i] for i in kept) for l, kept in enumerate(keep))
    return pruned


def save_pruned(model: HookedDecoder, directory: Union[str, Path], overwrite: bool = False) -> Path:
    """`save_pretrained` plus `head_map.json` (the model's head map), written to a temporary sibling
    and renamed into place, so the directory appears complete or not at all."""
    head_map = head_map_of(model)
    with atomic_directory(directory, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp, overwrite=True)
        (tmp / HEAD_MAP_FILE).write_text(json.dumps({"head_map": [list(layer) for layer in head_map]}) + "\n")
    return Path(directory).expanduser()


def load_pruned(
    directory: Union[str, Path], device: Optional[Union[str, torch.device]] = None, dtype: Optional[torch.dtype] = None
) -> HookedDecoder:
    """`HookedDecoder.from_pretrained` plus the head map from `head_map.json` when the directory has one."""
    return attach_head_map(HookedDecoder.from_pretrained(directory, device=device, dtype=dtype), directory)


def attach_head_map(model: HookedDecoder, directory: Union[str, Path]) -> HookedDecoder:
    """Set `model.head_map` from `directory/head_map.json` (written by `save_pruned`) when there is one,
    for a model loaded from that directory some other way; returns the model."""
    path = Path(directory).expanduser() / HEAD_MAP_FILE
    if path.is_file():
        try:
            head_map = json.loads(path.read_text())["head_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{path} is not a head map written by save_pruned ({type(err).__name__}: {err})") from err
        model.head_map = head_map_of(model, head_map)
    return model
