"""Which experts a mixture-of-experts model (Mixtral, OLMoE, Qwen3-MoE, GPT-OSS, GLM-4.5) sends each token to, layer by
layer (its sparse layers, where dense ones sit among them): the router's scores over every expert, the experts chosen
and the weights their outputs are summed with, and how often each expert is used over a prompt."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from probe import HookedDecoder
from probe.analyses.common import AnalysisInput, TableDisplay, as_tokens, token_strings
from probe.analyses.labels import position_labels, titled

WIDTH_PX = 900


@dataclass
class ExpertRouting(TableDisplay):
    """One prompt's routing.

    probs:   [layer pos expert] the router's scores over every expert (hook_expert_weights: the softmax, or each
             expert's sigmoid before any selection bias; GPT-OSS, which chooses by logit first: the softmax over the
             chosen experts, 0 for the others; PhiMoE's sparsemixer: each chosen expert's weight, 0 for the others).
    chosen:  [layer pos per_token] the experts that ran, the best choice first (hook_expert_indices).
    weights: [layer pos per_token] what each chosen expert's output was multiplied by (renormalised and scaled
             where the model does; its input, where the experts scale their inputs: Llama 4).
    strings: each token's raw string (for frames and CSV, not HTML).
    layers:  the model's layer of each row of `layer` (its sparse ones); None: 0, 1, ...
    """

    probs: torch.Tensor
    chosen: torch.Tensor
    weights: torch.Tensor
    strings: list[str]
    layers: Optional[list[int]] = None

    @property
    def layer_numbers(self) -> list[int]:
        return list(range(self.probs.shape[0])) if self.layers is None else list(self.layers)

    @property
    def usage(self) -> torch.Tensor:
        """[layer expert]: the fraction of the prompt's tokens each expert ran on."""
        n_layers, n_pos, n_experts = self.probs.shape
        counts = torch.zeros(n_layers, n_experts).scatter_add_(1, self.chosen.flatten(1), torch.ones(n_layers, self.chosen[0].numel()))
        return counts / n_pos

    def to_frame(self) -> pd.DataFrame:
        """One row per (layer, position, chosen expert): `rank` 1 is the best choice; `prob` the router's score for
        that expert, `weight` what its output was summed with."""
        n_layers, n_pos, k = self.chosen.shape
        layer, pos, rank = torch.meshgrid(torch.arange(n_layers), torch.arange(n_pos), torch.arange(k), indexing="ij")
        expert = self.chosen.flatten()
        return pd.DataFrame({
            "layer": torch.tensor(self.layer_numbers)[layer.flatten()].numpy(), "position": pos.flatten().numpy(),
            "token": pd.Series(self.strings)[pos.flatten().numpy()].to_numpy(), "rank": rank.flatten().numpy() + 1,
            "expert": expert.numpy(), "prob": self.probs.gather(-1, self.chosen).flatten().numpy(),
            "weight": self.weights.flatten().numpy(),
        })

    def figure(self) -> go.Figure:
        """Each layer's weights by token (rows) and expert (columns): what each chosen expert's output was summed
        with, 0 where an expert did not run; beside it, each expert's share of the tokens."""
        n_layers, n_pos, n_experts = self.probs.shape
        used = torch.zeros_like(self.probs).scatter(-1, self.chosen, self.weights)
        labels = position_labels(self.strings)
        fig = make_subplots(rows=n_layers, cols=2, column_widths=[0.78, 0.22], horizontal_spacing=0.08,
                            vertical_spacing=min(0.08, 0.3 / max(n_layers, 1)),
                            subplot_titles=[t for layer in self.layer_numbers
                                            for t in (f"L{layer}: weights by token", f"L{layer}: share of tokens")])
        experts = [f"E{e}" for e in range(n_experts)]
        usage = self.usage
        for layer in range(n_layers):
            fig.add_trace(go.Heatmap(z=used[layer].numpy(), x=experts, y=labels, coloraxis="coloraxis",
                                     hovertemplate="%{y} -> %{x}: weight %{z:.3f}<extra></extra>"), row=layer + 1, col=1)
            fig.add_trace(go.Bar(x=experts, y=usage[layer].numpy(), showlegend=False, marker_color="#4c72b0",
                                 hovertemplate="%{x}: %{y:.0%} of tokens<extra></extra>"), row=layer + 1, col=2)
            fig.update_yaxes(autorange="reversed", row=layer + 1, col=1)
            fig.update_yaxes(range=[0, 1], tickformat=".0%", row=layer + 1, col=2)
        top = max(1.0, float(self.weights.max()))  # (scaled weights, DeepSeek's and GLM-4.5's, may pass 1)
        fig.update_layout(coloraxis=dict(colorscale="Blues", cmin=0, cmax=top, colorbar=dict(title="weight")),
                          height=max(300, n_layers * (60 + 16 * n_pos)), width=WIDTH_PX)
        titled(fig, "Expert routing: the experts each token ran through, by weight, and each expert's share of the "
                    "tokens", WIDTH_PX)
        return fig


def expert_routing(model: HookedDecoder, input: AnalysisInput) -> ExpertRouting:
    """The routing of every layer's mixture of experts on one prompt (a string or token ids [pos] / [1 pos])."""
    experts = model.cfg.experts
    if experts is None:
        raise ValueError("expert_routing: this model's MLPs are not mixtures of experts (cfg.experts is None), so "
                         "nothing routes its tokens; read its MLP neurons instead (memory_lookup, top_triggers)")
    tokens = as_tokens(model, input)
    if tokens.shape[0] != 1:
        raise ValueError(f"expert_routing takes one prompt, got a batch of {tokens.shape[0]}; pass one string or ids [pos]")
    layers = [layer for layer in range(model.cfg.n_layers) if model.cfg.layer_sparse(layer)]
    names = [f"blocks.{layer}.mlp.hook_expert_{kind}" for layer in layers for kind in ("weights", "indices")]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names=names)
    probs = torch.stack([cache[f"blocks.{l}.mlp.hook_expert_weights"] for l in layers]).float().cpu()
    chosen = torch.stack([cache[f"blocks.{l}.mlp.hook_expert_indices"] for l in layers]).cpu()
    # as probe.moe weighs them, renormalised where the experts say (never the selection bias: it decides the choice
    # alone)
    weights = model.blocks[layers[0]].mlp.normalize(probs.gather(-1, chosen))
    return ExpertRouting(probs=probs, chosen=chosen, weights=weights * experts.scaling,
                         strings=token_strings(model, tokens[0].tolist()),
                         layers=None if len(layers) == model.cfg.n_layers else layers)
