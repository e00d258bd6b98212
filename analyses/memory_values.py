"""The tokens each FFN value vector promotes and suppresses when read through the unembedding (v_i W_U)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch

from probe.analyses.common import PromotedTokens, token_strings
from probe.analyses.memory_units import layer_list, neuron_tensor
from probe.analyses.vocab_projection import top_value_tokens
from probe import HookedDecoder


@dataclass
class ValueTokens(PromotedTokens):
    """The tokens each value vector promotes and suppresses when read through the unembedding."""

    layer: int
    neurons: torch.Tensor  # [neuron]
    top_ids: torch.Tensor  # [neuron k], most promoted first
    top_logits: torch.Tensor  # [neuron k]
    bottom_ids: torch.Tensor  # [neuron k], most suppressed first
    bottom_logits: torch.Tensor  # [neuron k]
    token_strings: list[list[str]]  # [neuron] of k promoted strings then k suppressed strings
    through_final_norm: bool

    def to_frame(self) -> pd.DataFrame:
        """One row per (neuron, direction, rank): the token, its id and its logit v_i W_U."""
        return self._promoted_frame({"layer": [self.layer] * len(self.neurons), "neuron": self.neurons.tolist()})

    def figure(self, max_neurons: int = 20) -> go.Figure:
        """Heatmaps of the promoted (left) and suppressed (right) tokens' logits, tokens written in the cells."""
        norm = " through the final norm" if self.through_final_norm else ""
        return self._promoted_figure([f"L{self.layer} N{int(m)}" for m in self.neurons[:max_neurons]],
                                     f"Tokens promoted and suppressed by layer {self.layer}'s values (v W_U{norm})")


def value_tokens(
    model: HookedDecoder,
    layer: int,
    neurons: Optional[Sequence[int]] = None,
    k: int = 10,
    *,
    through_final_norm: bool = False,
) -> ValueTokens:
    """The top-k promoted and suppressed tokens of v_i W_U for each neuron of `layer` (None = all).

    `through_final_norm=True` reads what the final norm does to the direction before the
    unembedding instead of v_i: (v_i - mean(v_i)) * ln_final.w for a LayerNorm, v_i * ln_final.w for
    an RMSNorm (Geva et al. read the raw v_i).
    """
    (layer,) = layer_list(model, layer, "value_tokens")
    ids = neuron_tensor(model, neurons)
    if not isinstance(k, int) or not 0 < k <= model.cfg.d_vocab:
        raise ValueError(f"k={k!r} must be an integer in [1, d_vocab={model.cfg.d_vocab}]")
    top_logits, top_ids, bottom_logits, bottom_ids = top_value_tokens(model, layer, ids, k, through_final_norm)
    strings = [token_strings(model, top_ids[i].tolist() + bottom_ids[i].tolist()) for i in range(len(ids))]
    return ValueTokens(layer, ids, top_ids, top_logits, bottom_ids, bottom_logits, strings, through_final_norm)
