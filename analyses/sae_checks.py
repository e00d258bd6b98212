"""Checks that a sparse autoencoder (or transcoder) fits a model, before any work: its hook points, their
widths, no SAE spliced in at them; and the feature ids an analysis is given."""
from __future__ import annotations

import math
from typing import Sequence, Union

import torch

from probe.analyses.architecture import check_block_point
from probe.analyses.common import unit_ids
from probe.hooks import UnknownNameError
from probe import HookedDecoder, SparseAutoencoder
from probe.shapes import hook_shapes

FeatureSpec = Union[int, Sequence[int], torch.Tensor]


def output_hook(sae: SparseAutoencoder) -> str:
    """The hook point whose activation the dictionary writes: hook_name_out for a transcoder, hook_name for an SAE."""
    return sae.cfg.hook_name_out if sae.cfg.is_transcoder else sae.cfg.hook_name


def check_sae(model: HookedDecoder, sae: SparseAutoencoder) -> str:
    """The SAE's hook name, once checked to fit the model: a hook point it has, one activation vector per
    position of the SAE's width there, and no SAE spliced in at it right now; for a transcoder, its output
    point the same way (of width d_out). Before any work."""
    if not isinstance(sae, SparseAutoencoder):
        raise TypeError(f"sae must be a probe.SparseAutoencoder (e.g. SparseAutoencoder.from_pretrained(directory)), "
                        f"got {type(sae).__name__}")
    name = sae.cfg.hook_name
    _check_point(model, name, sae.cfg.d_in, "reads")
    for point in {name, sae.cfg.written_hook_name}:
        if f"{point}.hook_sae_input" in model.hook_names:
            # the point then holds an SAE's output: features of a reconstruction, and a second splice would collide
            raise ValueError(f"an SAE is spliced into the model at {point!r} right now; call this outside the "
                             "`with spliced(...)` block (it runs the model with and without the SAE itself)")
    if sae.cfg.is_transcoder:
        _check_point(model, sae.cfg.hook_name_out, sae.cfg.d_out, "writes")
    return name


def _check_point(model: HookedDecoder, name: str, width: int, verb: str) -> None:
    """`name` is a hook point of the model holding one vector of `width` per position (hook_z: the heads flattened)."""
    # an MLP transcoder or an SAE on an MLP's output, given a model without MLPs: say so, not just "unknown name"
    check_block_point(model, name, f"the SAE {verb}", "use a dictionary trained on a point this model has (the "
                      "residual stream: hook_resid_pre / hook_resid_post; attention: hook_attn_out, attn.hook_z)")
    try:
        model.hook_point(name)
    except UnknownNameError as err:
        raise UnknownNameError(f"the SAE {verb} {name!r}, a hook point this model lacks (an SAE for another model?): "
                               f"{err}") from None
    shape = hook_shapes(model.cfg, 1, 1).get(name)  # for one position; an SAE on hook_z reads the heads flattened
    heads_flattened = name.endswith("hook_z")
    if shape is not None and (shape[:2] != (1, 1) or (len(shape) != 3 and not heads_flattened)):
        raise ValueError(f"the SAE {verb} one activation vector per position, but {name!r} is not one (its shape is "
                         f"[batch {' '.join(map(str, shape[1:]))}] for one position): an SAE for another hook point")
    if shape is not None and math.prod(shape[2:]) != width:  # one vector per position: its size
        raise ValueError(f"the SAE {verb} {width} dimensions, but the activation at {name!r} has "
                         f"{math.prod(shape[2:])}: it was trained for another model or hook point")


def feature_ids(sae: SparseAutoencoder, features: FeatureSpec) -> torch.Tensor:
    """[feature] int64 on the CPU, each checked to be one of the SAE's features, none twice."""
    return unit_ids(features, sae.cfg.d_sae, "feature", f"the SAE's features [0, d_sae={sae.cfg.d_sae})")
