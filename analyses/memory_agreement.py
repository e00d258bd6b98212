"""Geva's agreement statistic: how often an FFN memory's top value token is the next token after its triggers."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go
import torch

from probe.analyses.architecture import refuse_bidirectional
from probe.analyses.memory_units import require_ffn
from probe.analyses.trigger_results import MLP_SOURCE, TopTriggers
from probe.analyses.vocab_projection import top_value_tokens
from probe import HookedDecoder
from probe.analyses.common import TableDisplay


def require_mlp(triggers: TopTriggers, what: str) -> None:
    """Refuse an SAE scan where FFN value vectors are read: its ids are features, not neurons, and
    its layer may not even be a block (-1)."""
    if triggers.source != MLP_SOURCE:
        raise ValueError(f"{what} reads FFN value vectors (W_out rows) and needs a scan of MLP neurons; this one "
                         f"scanned the features of the SAE at {triggers.source!r} (for what a feature writes, see "
                         "probe.analyses.feature_logits)")


@dataclass
class Agreement(TableDisplay):
    """Per layer, how often a memory's top value token is the actual next token after its triggers."""

    layers: list[int]
    matches: torch.Tensor  # [layer]: trigger examples whose next token is the value's top token
    examples: torch.Tensor  # [layer]: trigger examples with a next token
    baseline_matches: torch.Tensor  # [layer]: the same with each neuron's top token taken from another neuron

    @property
    def rate(self) -> torch.Tensor:
        return self.matches / self.examples.clamp(min=1)

    @property
    def baseline_rate(self) -> torch.Tensor:
        return self.baseline_matches / self.examples.clamp(min=1)

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(dict(layer=self.layers, agreement=self.rate.tolist(), matches=self.matches.tolist(),
                                 examples=self.examples.tolist(), baseline=self.baseline_rate.tolist()))

    def figure(self) -> go.Figure:
        x = [f"layer {l}" for l in self.layers]
        fig = go.Figure([
            go.Bar(name="value's top token = next token", x=x, y=self.rate.tolist(),
                   hovertext=[f"{int(m)} of {int(e)} trigger examples" for m, e in zip(self.matches, self.examples)],
                   hoverinfo="text+y"),
            go.Bar(name="baseline: another neuron's top token", x=x, y=self.baseline_rate.tolist(),
                   hovertext=[f"{int(m)} of {int(e)}" for m, e in zip(self.baseline_matches, self.examples)],
                   hoverinfo="text+y"),
        ])
        fig.update_layout(title="Agreement between memories' values and their triggers' next tokens (Geva et al. 2021)",
                          yaxis_title="fraction of trigger examples", barmode="group")
        return fig


@torch.no_grad()
def agreement(model: HookedDecoder, triggers: TopTriggers, *, through_final_norm: bool = False) -> Agreement:
    """Geva's agreement statistic per layer over the trigger examples of `triggers`.

    The baseline pairs each neuron's triggers with the top token of the next scanned neuron's
    value (a cyclic shift), which keeps the token distribution and breaks the neuron's identity.
    """
    require_ffn(model, "agreement")  # a scan of another model's neurons: this one has no values to read them by
    refuse_bidirectional(model, "agreement", "its output at a trigger is no prediction of the next token, and Geva's "
                         "statistic (a value's top token against the token after its triggers) measures nothing it does",
                         "compare value_tokens with the model's own outputs at the trigger positions (memory_lookup)")
    require_mlp(triggers, "agreement")
    matches, examples, baseline = [], [], []
    for li, layer in enumerate(triggers.layers):
        top = top_value_tokens(model, layer, triggers.neurons, 1, through_final_norm)[1][:, 0]  # [neuron]
        nxt = triggers.next_tokens[li]  # [neuron k]
        has = (nxt >= 0) & (triggers.docs[li] >= 0)
        matches.append(((nxt == top[:, None]) & has).sum())
        baseline.append(((nxt == top.roll(1)[:, None]) & has).sum())
        examples.append(has.sum())
    return Agreement(list(triggers.layers), torch.stack(matches), torch.stack(examples), torch.stack(baseline))
