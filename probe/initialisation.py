"""A new model's weights: GPT-2's initialisation, or HookedTransformer's own draw for a model built from a
HookedTransformerConfig, so a notebook that seeds torch gets TL's very weights and TL's generator state after."""
from __future__ import annotations

import math

import torch
from torch import nn


@torch.no_grad()
def init_weights(model: nn.Module) -> None:
    """GPT-2's initialisation, for training from scratch (loading overwrites all of it); HookedTransformer's
    draw for a model built from HookedTransformerConfig (`cfg.transformer_lens_init`)."""
    std, like_tl, draw = model.cfg.init_std, model.cfg.transformer_lens_init, model.cfg.init_weights
    for name, param in model.named_parameters():
        if param.is_meta:  # shapes only (a model built to plan its placement): nothing to fill
            continue
        if ".act_fn." in name:  # an activation's own parameters (xIELU's) keep the values it starts from
            continue
        if name.endswith((".w",)):
            param.fill_(1.0)
        elif name.endswith((".b", ".bias")) or like_tl or not draw:
            param.zero_()
        elif name.endswith(("attn.out.weight", "mlp.fc_out.weight")):
            param.normal_(0.0, std / math.sqrt(2 * model.cfg.n_layers))  # keeps the residual's variance flat in depth
        else:
            param.normal_(0.0, std)
    if like_tl and draw and not model.embed.W_E.is_meta:
        draw_like_transformer_lens(model)

def draw_like_transformer_lens(model: nn.Module) -> None:
    """HookedTransformer's "gpt2" init: torch reseeded with cfg.seed (if any), then every weight matrix (a name with
    "W_") drawn from N(0, initializer_range) in TL's layout and parameter order (an attention's W_Q, W_O, then its
    keys and values), so the weights and torch's generator afterwards are TL's."""
    if model.cfg.seed is not None:
        torch.manual_seed(model.cfg.seed)
    layout = model.state_dict()
    names = [name for name in layout if "W_" in name]
    for at, name in enumerate(names):  # TL's attention registers W_O before its key and value weights
        if name.endswith("attn.W_Q") and name[:-1] + "O" in names:
            names.insert(at + 1, names.pop(names.index(name[:-1] + "O")))
    for name in names:
        layout[name] = torch.empty(layout[name].shape, dtype=layout[name].dtype).normal_(0.0, model.cfg.init_std)
    if model.cfg.tied_embeddings:  # TL draws W_U all the same (its HookedTransformer never ties them)
        layout["unembed.W_U"] = layout["embed.W_E"].T
    model.load_state_dict(layout)
