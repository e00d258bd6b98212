"""Which FFN layers and neurons an analysis of memories reads: the checked `layers` and `neurons` arguments."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from probe.analyses.architecture import require_mlps
from probe.analyses.common import is_int, unit_ids
from probe import HookedDecoder

Layers = Union[int, Sequence[int], None]


def layer_list(model: HookedDecoder, layers: Layers, what: str = "FFN memories") -> list[int]:
    """The FFN layers `layers` names (None: all), checked; `what` (the analysis) heads the refusal on a model
    without MLPs."""
    require_ffn(model, what)
    n = model.cfg.n_layers
    if layers is None:
        return list(range(n))
    chosen = [layers] if is_int(layers) else list(layers)
    if not chosen:
        raise ValueError("layers is empty: pass a layer index, a list of them, or None for all layers")
    for layer in chosen:
        if not is_int(layer) or not -n <= layer < n:
            raise ValueError(f"layer {layer!r} is outside the model's layers [0, {n})")
    resolved = [layer % n for layer in chosen]
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"layers {chosen} name a layer twice")
    return resolved


def require_ffn(model: HookedDecoder, what: str) -> None:
    instead = ("read its heads instead (direct_logit_attribution, attention_patterns, ov_circuit), or an SAE's "
               "features (top_triggers(..., sae=), feature_logits)")
    require_mlps(model, what, "no FFN neurons (mlp.hook_post) or value vectors (W_out) to read", instead)
    if model.cfg.experts is not None:
        some = "MLPs are" if model.cfg.experts.layers is None else "sparse layers' MLPs are"
        raise ValueError(f"{what}: this model's {some} mixtures of experts, whose neurons (mlp.experts.{{e}}."
                         f"hook_post) fire only on the tokens routed to their expert, with no one W_out per layer; "
                         f"{instead}")
    widths = sorted({model.cfg.layer_d_mlp(layer) for layer in range(model.cfg.n_layers)})
    if len(widths) > 1:  # (Gemma 4's double-wide MLPs in its last layers)
        raise ValueError(f"{what}: this model's MLPs differ in width between layers ({widths} neurons), and {what} "
                         f"reads every layer's neurons as one [layer d_mlp] table; {instead}")


def neuron_tensor(model: HookedDecoder, neurons: Optional[Sequence[int]]) -> torch.Tensor:
    d_mlp = model.cfg.d_mlp
    if neurons is None:
        return torch.arange(d_mlp)
    return unit_ids(neurons, d_mlp, "neuron", f"the layer's neurons [0, d_mlp={d_mlp})")
