"""transformer-lens's and SAELens's model class names, for code that changes only its import:

    # from transformer_lens import HookedTransformer        # transformer-lens 3
    from probe import HookedTransformer                     # probe
    model = HookedTransformer.from_pretrained("gpt2")       # folded and centred, as TL's

The class is HookedDecoder with TL 3's loading defaults. TL's bare `from_pretrained(name)` processes the weights
(fold_ln, center_writing_weights, center_unembed, fold_value_biases); HookedDecoder's keeps the checkpoint's own, so
that its activations are the ones `transformers` computes. Code written for TL computes on processed weights (a
centred W_U in logit tables, SAEs trained on a processed model's activations), and with this import gets them.
SAELens's HookedSAETransformer loads as TL's class does: the same class under its name. Everything else is
HookedDecoder's; `isinstance(model, transformer_lens.HookedTransformer)` stays False (docs/from_transformer_lens.md).
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

from probe.model import HookedDecoder
from probe.processing import TL_PROCESSING_DEFAULTS


class HookedTransformer(HookedDecoder):
    """HookedDecoder whose `from_pretrained(name)` processes the weights as transformer-lens 3's does by default;
    a processing keyword given wins, and `from_pretrained_no_processing` keeps the checkpoint's weights. A negative
    token id counts from the end of the vocabulary, as TL 3's embedding reads it (probe/inputs.py)."""

    negative_ids_from_the_end = True

    @classmethod
    def from_pretrained(cls, name_or_path: Union[str, Path], **keywords) -> "HookedTransformer":
        return super().from_pretrained(name_or_path, **{**TL_PROCESSING_DEFAULTS, **keywords})


HookedSAETransformer = HookedTransformer
