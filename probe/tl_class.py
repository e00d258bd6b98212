"""transformer-lens's and SAELens's model class names, for code that changes only its import:

    # from transformer_lens import HookedTransformer        # transformer-lens 3
    from probe import HookedTransformer                     # probe
    model = HookedTransformer.from_pretrained("gpt2")       # folded and centred, as TL's

The class is HookedDecoder with TL 3's loading defaults. TL's bare `from_pretrained(name)` processes the weights
(fold_ln, center_writing_weights, center_unembed, fold_value_biases); HookedDecoder's keeps the checkpoint's own, so
that its activations are the ones `transformers` computes. Code written for TL computes on processed weights (a
centred W_U in logit tables, SAEs trained on a processed model's activations), and with this import gets them.
Three more of TL 3's readings live here, where they cannot surprise HookedDecoder's users: a negative token id counts
from the end of the vocabulary, Gemma's sqrt(d_model) is baked into W_E, and the TinyStories and Gemma 3 models get
TL 3.9's context length. SAELens's HookedSAETransformer loads as
TL's class does: the same class under its name. Everything else is HookedDecoder's;
`isinstance(model, transformer_lens.HookedTransformer)` stays False (docs/from_transformer_lens.md).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Union

import torch
from torch import nn

from probe.loading import SHORT_NAMES
from probe.model import HookedDecoder
from probe.processing import TL_PROCESSING_DEFAULTS


class HookedTransformer(HookedDecoder):
    """HookedDecoder whose `from_pretrained(name)` processes the weights as transformer-lens 3's does by default;
    a processing keyword given wins, and `from_pretrained_no_processing` keeps the checkpoint's weights. A negative
    token id counts from the end of the vocabulary, as TL 3's embedding reads it (probe/inputs.py). Gemma's
    sqrt(d_model) is in `W_E`, as TL 3's weight conversion puts it (see `bake_embedding_scale`)."""

    negative_ids_from_the_end = True

    @classmethod
    def from_pretrained(cls, name_or_path: Union[str, Path], **keywords) -> "HookedTransformer":
        model = super().from_pretrained(name_or_path, **{**TL_PROCESSING_DEFAULTS, **keywords})
        bake_embedding_scale(model)
        narrow_to_tl_context(model, str(name_or_path))
        print(f"Loaded pretrained model {name_or_path} into HookedTransformer")  # TL 3's line, notebooks' output
        return model


# TL 3.9's n_ctx for some hub repositories, where it overrides the checkpoint's config: the TinyStories models were
# trained on 512 tokens (its position table is cut to them) and Gemma 3 gets a "safe default" of 8192
TL_CONTEXT = {"roneneldan/TinyStories": 512, "google/gemma-3-": 8192}


@torch.no_grad()
def narrow_to_tl_context(model: HookedDecoder, name: str) -> None:
    """The context TL 3.9 gives a model loaded by this hub name or short name (TL_CONTEXT): `cfg.n_ctx`, and for
    learned positions the table itself, cut as TL cuts it, so code sizing its data by `model.cfg.n_ctx` and a state
    dict's `W_pos` are TL 3's. A local directory keeps its config's."""
    repo = SHORT_NAMES.get(name, name)
    n_ctx = next((n for prefix, n in TL_CONTEXT.items() if repo.startswith(prefix)), None)
    if n_ctx is None or n_ctx >= model.cfg.n_ctx:
        return
    if model.pos_embed is not None:
        model.pos_embed.W_pos = nn.Parameter(model.pos_embed.W_pos[:n_ctx].clone())
    for block in model.blocks:
        block.attn.n_ctx = n_ctx  # the rows of TL's rotary tables (block.attn.rotary_sin / rotary_cos)
    model.cfg = dataclasses.replace(model.cfg, n_ctx=n_ctx)


@torch.no_grad()
def bake_embedding_scale(model: HookedDecoder) -> None:
    """Gemma multiplies its embeddings by sqrt(d_model); TL 3's conversion multiplies that into `W_E`, so TL 3 code
    reading `model.W_E[tokens]` (circuit-tracer's token nodes, a direct path `W_E @ W_U`) gets the embedding the
    residual receives. Done in the weights' dtype, as the forward rounds it; the unembedding, tied to the table in
    the checkpoint, keeps its own copy, as TL's always has. Such a model no longer fits a Gemma checkpoint, which
    `save_pretrained` then says; its state dict in TL's layout is TL 3's."""
    scale = model.embed.scale
    if scale is None:
        return
    model.untie_embeddings()
    model.embed.W_E.mul_(torch.tensor(scale, dtype=model.embed.W_E.dtype))
    model.embed.scale = None
    model.cfg = dataclasses.replace(model.cfg, scale_embed=False)


HookedSAETransformer = HookedTransformer
