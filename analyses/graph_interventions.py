"""Interventions on an attribution graph's features: set or scale a transcoder feature at a position and see the
logits change (circuit-tracer's feature_intervention).

The run is a real forward with every transcoder spliced in and its error term added back (probe.sae.spliced,
use_error_term=True), so without an edit it is the model itself; an edit changes the edited MLP's output by
exactly the edit's decoded difference, and every later MLP (its transcoder's features recomputed, its error
recomputed) and every norm responds as the model would. With `freeze_attention=True` every head's pattern is
held at its value on the unedited prompt, so the edit reaches later positions only through the values the
heads move, as in the graph; with False the patterns respond too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import pandas as pd
import torch

from probe.analyses.common import AnalysisInput, TableDisplay, as_tokens, is_int, token_decoder, top_count
from probe.analyses.replacement_model import TranscoderSpec, load_transcoders
from probe import HookedDecoder
from probe.sae import spliced


@dataclass(frozen=True)
class FeatureEdit:
    """Feature `feature` of layer `layer`'s transcoder at position `pos` set to `value`, or multiplied by `scale`."""

    layer: int
    pos: int
    feature: int
    value: Optional[float] = None
    scale: Optional[float] = None

    def __post_init__(self):
        if (self.value is None) == (self.scale is None):
            raise ValueError(f"{self}: give exactly one of value= (set the activation) and scale= (multiply it)")

    def apply(self, acts: torch.Tensor) -> None:
        """In place on a copy of the features [batch pos d_sae]."""
        old = acts[:, self.pos, self.feature]
        acts[:, self.pos, self.feature] = old * self.scale if self.value is None else torch.full_like(old, self.value)


@dataclass
class Intervention(TableDisplay):
    clean: torch.Tensor  # [pos vocab]: the model's logits
    edited: torch.Tensor  # [pos vocab]: with the edits
    edits: tuple[FeatureEdit, ...]
    freeze_attention: bool
    decode: object = None

    @property
    def change(self) -> torch.Tensor:
        """[pos vocab]: edited - clean."""
        return self.edited - self.clean

    def to_frame(self, k: Optional[int] = None, pos: int = -1) -> pd.DataFrame:
        """The k tokens (default 10, or the output vocabulary if smaller) whose logit at `pos` rose most and the k
        that fell most, with both probabilities."""
        change = self.change[pos]
        k = top_count(k, change.shape[-1], "d_vocab_out", 10)
        probs = self.clean[pos].softmax(-1), self.edited[pos].softmax(-1)
        rows = []
        for direction, ids in (("up", change.topk(k).indices), ("down", (-change).topk(k).indices)):
            for rank, (token, string) in enumerate(zip(ids.tolist(), self.decode(ids.tolist())), start=1):
                rows.append(dict(direction=direction, rank=rank, token=string, token_id=token,
                                 logit_change=float(change[token]), clean_prob=float(probs[0][token]),
                                 edited_prob=float(probs[1][token])))
        return pd.DataFrame(rows)


def intervene(model: HookedDecoder, transcoders: TranscoderSpec, prompt: AnalysisInput, edits: Sequence[FeatureEdit],
              *, freeze_attention: bool = True) -> Intervention:
    """The logits of one prompt with `edits` applied; see the module docstring."""
    tokens = as_tokens(model, prompt)
    if tokens.shape[0] != 1:
        raise ValueError(f"intervene takes one prompt; got a batch of {tokens.shape[0]}")
    transcoders = load_transcoders(model, transcoders)
    edits = (edits,) if isinstance(edits, FeatureEdit) else tuple(edits)
    if not edits:
        raise ValueError("no edits given: pass FeatureEdit(layer, pos, feature, value=... or scale=...)")
    for edit in edits:
        if not isinstance(edit, FeatureEdit):
            raise TypeError(f"edits must be FeatureEdit objects, got {type(edit).__name__}")
        if edit.layer not in transcoders:
            raise ValueError(f"{edit}: no transcoder for layer {edit.layer} (layers with one: {sorted(transcoders)})")
        if not (is_int(edit.pos) and -tokens.shape[1] <= edit.pos < tokens.shape[1]):
            raise ValueError(f"{edit}: position {edit.pos} is outside the prompt's {tokens.shape[1]} tokens")
        d_sae = transcoders[edit.layer].cfg.d_sae
        if not (is_int(edit.feature) and 0 <= edit.feature < d_sae):
            raise ValueError(f"{edit}: feature {edit.feature} is outside [0, d_sae={d_sae})")
    with torch.no_grad():
        if freeze_attention:
            names = [n for n in model.hook_names if n.endswith(".hook_pattern")]
            clean, cache = model.run_with_cache(tokens, names=names)
            patterns = {n: cache[n] for n in names}
        else:
            clean, patterns = model(tokens), {}

        def freeze(pattern: torch.Tensor, hook) -> torch.Tensor:
            return patterns[hook.name]

        def edit_layer(layer: int):
            def edit(acts: torch.Tensor, hook) -> torch.Tensor:
                acts = acts.clone()
                for e in edits:
                    if e.layer == layer:
                        e.apply(acts)
                return acts
            return edit

        hooks = [(name, freeze) for name in patterns] + [
            (f"{transcoders[layer].cfg.written_hook_name}.hook_sae_acts_post", edit_layer(layer))
            for layer in sorted({e.layer for e in edits})]
        with spliced(model, list(transcoders.values()), use_error_term=True):
            edited = model.run_with_hooks(tokens, fwd_hooks=hooks)
    return Intervention(clean=clean[0], edited=edited[0], edits=edits, freeze_attention=freeze_attention,
                        decode=token_decoder(model))
