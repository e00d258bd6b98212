"""Where a lens reads the residual stream (its *sites*), their labels, and the model's final norm applied to a
residual read there (recomputed, or with the scale frozen at the forward pass's)."""
from __future__ import annotations

from typing import Optional

import torch

from probe.analyses.architecture import require_mlps
from probe.analyses.common import token_labels
from probe import HookedDecoder, NormPlacement
from probe.names import act_name


def lens_sites(n_layers: int, include_mid: bool = False) -> list[str]:
    """The residual-stream hook names a lens reads, shallow to deep; the last is the final residual."""
    sites = ["blocks.0.hook_resid_pre"]
    for layer in range(n_layers):
        if include_mid:
            sites.append(act_name("resid_mid", layer))
        sites.append(act_name("resid_post", layer))
    return sites


def has_resid_mid(model: HookedDecoder) -> bool:
    """Whether blocks have a residual between attention and MLP (none in parallel blocks; attention-only ones have no
    MLP; NemotronH's layers hold one sublayer each)."""
    return (not model.cfg.attn_only and model.cfg.norm_placement is not NormPlacement.PARALLEL
            and model.cfg.sublayers is None)


def require_resid_mid(model: HookedDecoder, what: str, instead: str) -> None:
    """Refuse `what`, a read of the residual between each block's attention and MLP (hook_resid_mid), on a model whose
    blocks have none, naming the reason: an attention-only block has no MLP, a parallel block's attention and MLP
    both read the residual entering it. "{what}: {reason}; {instead}"."""
    require_mlps(model, what, "its blocks have no residual between attention and MLP (hook_resid_mid; each block's "
                 "hook_resid_post is already the residual after its attention)", instead)
    if model.cfg.sublayers is not None:
        raise ValueError(f"{what}: each of this model's layers holds one sublayer (a mixer, attention or an MLP), so "
                         f"there is no residual between two (hook_resid_mid); each layer's hook_resid_post is already "
                         f"the residual after its one sublayer; {instead}")
    if not has_resid_mid(model):
        raise ValueError(f"{what}: this model has {model.cfg.norm_placement.value} blocks (attention and MLP both read "
                         f"hook_resid_pre), so there is no residual between them (hook_resid_mid); {instead}")


def model_lens_sites(model: HookedDecoder, include_mid: bool = False) -> list[str]:
    """`lens_sites` for this model; include_mid needs a residual between the sublayers, which attention-only and
    parallel blocks lack."""
    if include_mid:
        require_resid_mid(model, "include_mid=True", "leave include_mid=False")
    return lens_sites(model.cfg.n_layers, include_mid)


def site_label(site: str) -> str:
    """A short readable name: `embed`, `L3 attn` (after block 3's attention), `L3` (after block 3)."""
    if site == "blocks.0.hook_resid_pre":
        return "embed"
    layer, kind = site.split(".")[1], site.rsplit(".", 1)[1]
    return f"L{layer} attn" if kind == "hook_resid_mid" else f"L{layer}"




def position_labels(model: HookedDecoder, tokens: torch.Tensor) -> list[list[str]]:
    """Per prompt, one escaped label per position, suffixed with the position so equal tokens stay apart."""
    return [token_labels(model, row) for row in tokens]


def has_final_scale(model: HookedDecoder) -> bool:
    """False for a model without a final norm (its ln_final is the identity, so nothing to freeze)."""
    return "ln_final.hook_scale" in model.hook_names


def final_norm(model: HookedDecoder, resid: torch.Tensor, frozen_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The model's own final norm on residuals [... d_model]; `frozen_scale` (broadcastable to [... 1])
    replaces the scale it would compute, which makes the norm an affine map of `resid`."""
    if frozen_scale is None or not has_final_scale(model):
        return model.ln_final(resid)

    def freeze(scale: torch.Tensor, hook) -> torch.Tensor:
        return frozen_scale.to(scale.dtype).expand_as(scale)

    # through the module and its hook rather than re-deriving the formula, so any norm exposing hook_scale works
    with model.hooks([("ln_final.hook_scale", freeze)]):
        return model.ln_final(resid)
