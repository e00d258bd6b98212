"""The FFN memories that fire at one position of one prompt, ranked by sub-update size |m_i| ||v_i||."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go
import torch
from einops import einsum
from plotly.subplots import make_subplots

from probe.analyses.common import AnalysisInput, TableDisplay, as_tokens, is_int, token_strings
from probe.analyses.labels import TICK_CHAR_PX, figure_token, plain_length, titled
from probe.analyses.architecture import refuse_prediction_head
from probe.analyses.memory_units import Layers, layer_list, require_ffn
from probe.analyses.vocab_projection import top_value_tokens, value_directions
from probe import HookedDecoder
from probe.names import act_name


@dataclass
class MemoryLookup(TableDisplay):
    """The memories active at one position: every coefficient, and the top-k sub-updates per layer."""

    tokens: torch.Tensor  # [pos]
    position: int
    layers: list[int]
    coefficients: torch.Tensor  # [layer d_mlp]: m_i, equal to mlp.hook_post at the position
    value_norms: torch.Tensor  # [layer d_mlp]: ||v_i|| (a sandwich block: of v_i * ln2_post.w / its scale, what it writes)
    neurons: torch.Tensor  # [layer k]: ranked by sub-update size, largest first
    sizes: torch.Tensor  # [layer k]: |m_i| ||v_i||
    prediction_effect: torch.Tensor  # [layer k]: direct effect of m_i v_i on the predicted token's logit
    top_token_ids: torch.Tensor  # [layer k n_tokens]: the value's most promoted tokens
    top_token_strings: list[list[list[str]]]
    predicted_token: int  # the model's argmax next token at the position
    predicted_string: str
    token_string: str  # the token at the position

    @property
    def sub_update_sizes(self) -> torch.Tensor:
        """[layer d_mlp]: |m_i| ||v_i|| for every neuron."""
        return self.coefficients.abs() * self.value_norms

    def to_frame(self) -> pd.DataFrame:
        """One row per (layer, rank) of the top memories; rank 1 is the largest sub-update."""
        rows = []
        for li, layer in enumerate(self.layers):
            for r in range(self.neurons.shape[1]):
                n = int(self.neurons[li, r])
                rows.append(dict(
                    layer=layer, rank=r + 1, neuron=n, coefficient=float(self.coefficients[li, n]),
                    value_norm=float(self.value_norms[li, n]), size=float(self.sizes[li, r]),
                    top_tokens=list(self.top_token_strings[li][r]),
                    prediction_effect=float(self.prediction_effect[li, r]),
                    pushes_prediction=bool(self.prediction_effect[li, r] > 0),
                ))
        return pd.DataFrame(rows)

    def figure(self) -> go.Figure:
        """Per layer, the top sub-updates' sizes, labelled by neuron and top tokens; green bars push the
        model's predicted next token up (direct effect through the final norm), red bars push it down."""
        n_layers, k = len(self.layers), self.neurons.shape[1]
        labels = [[f"N{int(self.neurons[li, r])}: " + " ".join(figure_token(s) for s in self.top_token_strings[li][r][:3])
                   for r in range(k)] for li in range(n_layers)]
        # the rotated neuron labels hang below each panel: the gap to the next panel's title is their length
        label_px = max(plain_length(l) for row in labels for l in row) * TICK_CHAR_PX + 12
        panel, gap = 200, label_px + 48
        paper = n_layers * panel + (n_layers - 1) * gap
        fig = make_subplots(rows=n_layers, cols=1, subplot_titles=[f"layer {l}" for l in self.layers],
                            vertical_spacing=gap / paper if n_layers > 1 else 0.0)
        predicted = figure_token(self.predicted_string)
        for li, layer in enumerate(self.layers):
            hover = []
            for r in range(k):
                n = int(self.neurons[li, r])
                hover.append(
                    f"layer {layer} neuron {n}<br>coefficient m = {float(self.coefficients[li, n]):.5g}"
                    f"<br>|m| ||v|| = {float(self.sizes[li, r]):.5g}"
                    f"<br>effect on logit of {predicted} = {float(self.prediction_effect[li, r]):.5g}"
                    f"<br>promotes: {' '.join(figure_token(s) for s in self.top_token_strings[li][r])}"
                )
            colours = ["#2ca02c" if e > 0 else "#d62728" for e in self.prediction_effect[li].tolist()]
            fig.add_trace(go.Bar(x=labels[li], y=self.sizes[li].tolist(), marker_color=colours, hovertext=hover,
                                 hoverinfo="text", showlegend=False), row=li + 1, col=1)
            fig.update_yaxes(title_text="|m| ||v||", row=li + 1, col=1)
        width = max(640, 140 + 70 * k)
        fig.update_xaxes(tickangle=-90, tickfont=dict(size=10), type="category")
        fig.update_layout(width=width, height=int(paper + 90 + label_px + 40), margin=dict(b=int(label_px + 30)))
        return titled(fig, f"Memories firing at position {self.position} ({figure_token(self.token_string)}); "
                           f"prediction {predicted} (green: pushed up, red: pushed down)", width)


@torch.no_grad()
def memory_lookup(
    model: HookedDecoder,
    input: AnalysisInput,
    position: int = -1,
    layer: Layers = None,
    k: int = 10,
    *,
    n_tokens: int = 5,
    through_final_norm: bool = False,
) -> MemoryLookup:
    """The memories that fire at `position` of one prompt, ranked by sub-update size |m_i| ||v_i||.

    For each chosen layer (None = all) the top-k neurons, each with its coefficient, its value's
    `n_tokens` most promoted tokens, and its direct effect on the logit of the model's own next-token
    prediction at that position (through the final norm, at this prompt's scale there).
    """
    tokens = as_tokens(model, input)
    if tokens.shape[0] != 1:
        raise ValueError(
            f"memory_lookup takes one prompt, got a batch of {tokens.shape[0]}; pass one string or ids [pos]"
        )
    n_pos = tokens.shape[1]
    if not is_int(position) or not -n_pos <= position < n_pos:
        raise ValueError(f"position {position!r} is outside the prompt's {n_pos} tokens")
    position %= n_pos
    refuse_prediction_head(model, "memory_lookup (each memory's direct effect on the predicted logit)")
    layers = layer_list(model, layer, "memory_lookup")
    if not isinstance(k, int) or not 0 < k <= model.cfg.d_mlp:
        raise ValueError(f"k={k!r} must be an integer in [1, d_mlp={model.cfg.d_mlp}]")
    # (per layer: a hybrid's linear-attention blocks are pre-norm beside sandwich attention blocks, OLMo-Hybrid's)
    post_scales = [act_name("scale", l, "ln2_post") for l in layers if hasattr(model.blocks[l], "ln2_post")]
    names = [act_name("post", l) for l in layers] + (["ln_final.hook_scale"] if model.cfg.final_norm else []) + post_scales
    logits, cache = model.run_with_cache(tokens, names=names)
    predicted = int(logits[0, position].argmax())
    scale = cache["ln_final.hook_scale"][0, position] if model.cfg.final_norm else torch.ones(1, device=model.device)
    unembed_predicted = model.unembed.W_U[:, predicted].float()  # [d_model]

    coefficients = torch.stack([cache[act_name("post", l)][0, position] for l in layers]).float()
    # what each memory writes per unit coefficient: v_i, or in a sandwich block v_i * ln2_post.w / ln2_post's scale
    # (frozen at this position, so the sub-updates still add up to the block's hook_mlp_out)
    write_scale = torch.stack([cache[act_name("scale", l, "ln2_post")][0, position, 0].float()
                               if hasattr(model.blocks[l], "ln2_post") else torch.ones((), device=coefficients.device)
                               for l in layers])
    all_neurons = torch.arange(model.cfg.d_mlp)
    value_norms = torch.stack([value_directions(model, l, all_neurons, through_final_norm=False).norm(dim=-1)
                               for l in layers]) / write_scale[:, None]
    sizes, neurons = (coefficients.abs() * value_norms).topk(k, dim=-1)
    effects, top_ids = [], []
    for li, l in enumerate(layers):
        directions = value_directions(model, l, neurons[li], through_final_norm=True) / write_scale[li]
        effect = coefficients[li, neurons[li]] * (directions @ unembed_predicted) / scale.float()
        effects.append(effect)
        top_ids.append(top_value_tokens(model, l, neurons[li], n_tokens, through_final_norm)[1])
    top_ids = torch.stack(top_ids)
    strings = [[token_strings(model, top_ids[li, r].tolist()) for r in range(k)] for li in range(len(layers))]
    return MemoryLookup(
        tokens=tokens[0].cpu(), position=position, layers=layers, coefficients=coefficients.cpu(),
        value_norms=value_norms.cpu(), neurons=neurons.cpu(), sizes=sizes.cpu(),
        prediction_effect=torch.stack(effects).cpu(), top_token_ids=top_ids, top_token_strings=strings,
        predicted_token=predicted, predicted_string=token_strings(model, [predicted])[0],
        token_string=token_strings(model, [int(tokens[0, position])])[0],
    )


def sub_updates(model: HookedDecoder, layer: int, coefficients: torch.Tensor) -> torch.Tensor:
    """[d_mlp d_model]: every memory's sub-update m_i v_i for coefficients [d_mlp] of `layer`."""
    require_ffn(model, "sub_updates")
    W_out = model.blocks[layer].mlp.W_out.detach()
    return einsum(coefficients.to(W_out), W_out, "d_mlp, d_mlp d_model -> d_mlp d_model")
