"""Attention patterns of one prompt, with figures: one head, one layer's heads, every head at a glance."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch
import torch.nn.functional as F
from plotly.subplots import make_subplots

from probe.analyses.common import AnalysisInput, TableDisplay, as_tokens, is_int, token_strings
from probe.analyses.labels import grid_layout, head_label, position_labels, titled
from probe import HookedDecoder
from probe.names import act_name

# Beyond this many tokens a single-head heatmap drops its tick labels (the figure would be over
# 3,500 px a side); the hover still names both tokens. The bundled model's n_ctx (256) stays labelled.
MAX_LABELLED_TOKENS = 256
CELL_PX = 14  # pixels per token while labels are shown: the figure (and its HTML page) grows and scrolls
# Grids of many heads are drawn at most this many cells a side per head (max-pooled blocks), so
# a 1024-token prompt does not put millions of cells per head into the HTML.
GRID_CELLS = 64


@dataclass
class AttentionPatterns(TableDisplay):
    """Attention weights of one prompt.

    pattern: [layer head query_pos key_pos], for `layers` x `heads` (indices into the model).
    labels:  one escaped, position-suffixed label per token (safe to put into HTML).
    strings: each token's raw string (for frames and CSV, not HTML).
    causal:  whether each query saw only itself and earlier keys; a bidirectional model's see every key, so its
             frames and figures keep the weights above the diagonal too.
    """

    pattern: torch.Tensor
    layers: list[int]
    heads: list[int]
    tokens: torch.Tensor  # [pos]
    labels: list[str]
    strings: list[str]
    causal: bool = True

    def to_frame(self) -> pd.DataFrame:
        """One row per (layer, head, query_pos, key_pos) the model's mask allows (every pair when bidirectional)."""
        n_layer, n_head, n, _ = self.pattern.shape
        layer, head, query, key = torch.meshgrid(
            torch.tensor(self.layers), torch.tensor(self.heads), torch.arange(n), torch.arange(n), indexing="ij"
        )
        keep = ((key <= query) | (not self.causal)).flatten() & ~self.pattern.isnan().flatten()
        query, key = query.flatten()[keep], key.flatten()[keep]
        strings = pd.Series(self.strings)
        return pd.DataFrame({
            "layer": layer.flatten()[keep].numpy(),
            "head": head.flatten()[keep].numpy(),
            "query_pos": query.numpy(),
            "key_pos": key.numpy(),
            "query_token": strings[query.numpy()].to_numpy(),
            "key_token": strings[key.numpy()].to_numpy(),
            "weight": self.pattern.flatten()[keep].float().numpy(),
        })

    def _index(self, layer: int, head: Optional[int] = None) -> tuple[int, Optional[int]]:
        if layer not in self.layers:
            raise ValueError(f"layer {layer} was not computed; these were: {self.layers}")
        if head is not None and head not in self.heads:
            raise ValueError(f"head {head} was not computed; these were: {self.heads}")
        return self.layers.index(layer), None if head is None else self.heads.index(head)

    def figure(self, layer: Optional[int] = None, head: Optional[int] = None) -> go.Figure:
        """One head (layer and head given), one layer's heads (layer only), or every head (neither)."""
        if layer is None and head is not None:
            raise ValueError("give the layer as well as the head, e.g. figure(layer=1, head=3)")
        if layer is None:
            return self._overview()
        li, hi = self._index(layer, head)
        if hi is None:
            return self._layer_grid(li)
        if self.pattern[li, hi].isnan().all():
            raise ValueError(f"layer {layer} has no head {head} (it was pruned)")
        return self._head(li, hi)

    def _head(self, li: int, hi: int) -> go.Figure:
        n = self.pattern.shape[-1]
        z = _masked(self.pattern[li, hi], self.causal).float().numpy()
        name = head_label(self.layers[li], self.heads[hi])
        fig = go.Figure(go.Heatmap(
            z=z, x=self.labels, y=self.labels, coloraxis="coloraxis",
            hovertemplate=f"{name}<br>query %{{y}}<br>key %{{x}}<br>weight %{{z:.4f}}<extra></extra>",
        ))
        labelled = n <= MAX_LABELLED_TOKENS
        cell = CELL_PX if labelled else 900 / n  # unlabelled: a fixed 900 px square
        shown = self.labels if labelled else ["x"]
        fig.update_layout(plot_bgcolor="white", coloraxis=dict(colorscale="Blues", cmin=0, cmax=1, colorbar=dict(title="weight")))
        grid_layout(fig, f"Attention pattern of {name}", x_labels=shown, y_labels=shown, cell_w=cell, cell_h=cell,
                    x_title="key token", y_title="query token", x_top=True, min_width=0)
        fig.update_xaxes(showticklabels=labelled, type="category", showgrid=False, zeroline=False)
        fig.update_yaxes(showticklabels=labelled, autorange="reversed", type="category", showgrid=False, zeroline=False)
        return fig

    def _layer_grid(self, li: int) -> go.Figure:
        n_head = len(self.heads)
        cols = min(n_head, 4)
        rows = math.ceil(n_head / cols)
        fig = make_subplots(rows=rows, cols=cols, subplot_titles=[head_label(self.layers[li], h) for h in self.heads],
                            horizontal_spacing=0.03, vertical_spacing=0.06)
        for i in range(n_head):
            self._add_pooled(fig, self.pattern[li, i], rows=i // cols + 1, cols=i % cols + 1,
                             name=head_label(self.layers[li], self.heads[i]))
        return _style_grid(fig, f"Attention patterns of layer {self.layers[li]} (query down, key across)",
                           width=260 * cols + 120, height=260 * rows + 100)

    def _overview(self) -> go.Figure:
        n_layer, n_head = len(self.layers), len(self.heads)
        # layer 0 in the bottom row, as on every figure with a layer axis (analyses.labels)
        order = [(li, hi) for li in reversed(range(n_layer)) for hi in range(n_head)]
        fig = make_subplots(rows=n_layer, cols=n_head, horizontal_spacing=0.012, vertical_spacing=0.03,
                            subplot_titles=[head_label(self.layers[li], self.heads[hi]) for li, hi in order])
        fig.update_annotations(font_size=11)
        for li in range(n_layer):
            for hi in range(n_head):  # one trace per head: plotly has no batched subplot API
                self._add_pooled(fig, self.pattern[li, hi], rows=n_layer - li, cols=hi + 1,
                                 name=head_label(self.layers[li], self.heads[hi]), cells=min(GRID_CELLS, 32))
        first, last = self.layers[0], self.layers[-1]
        which = (f"layer {first} (" if len(self.layers) == 1 else f"layers {first}-{last} (the first at the bottom; "
                 if self.layers == list(range(first, last + 1)) else f"layers {self.layers} (the first at the bottom; ")
        return _style_grid(fig, f"Attention patterns of {which}query down, key across)",
                           width=96 * n_head + 160, height=104 * n_layer + 140)

    def _add_pooled(self, fig, pattern: torch.Tensor, rows: int, cols: int, name: str, cells: Optional[int] = None):
        z, spans = _pool(pattern, GRID_CELLS if cells is None else cells, self.causal)
        span_labels = [self.labels[a] if a == b else f"{self.labels[a]} … {self.labels[b]}" for a, b in spans]
        fig.add_trace(go.Heatmap(
            z=z.float().numpy(), x=list(range(len(spans))), y=list(range(len(spans))), coloraxis="coloraxis",
            customdata=[[[q, k] for k in span_labels] for q in span_labels],
            hovertemplate=f"{name}<br>query %{{customdata[0]}}<br>key %{{customdata[1]}}<br>weight %{{z:.4f}}<extra></extra>",
        ), row=rows, col=cols)


def _masked(pattern: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """NaN above the diagonal, so the causal mask shows as an empty triangle (a bidirectional pattern as it is)."""
    if not causal:
        return pattern
    n = pattern.shape[-1]
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    return pattern.masked_fill(future, float("nan"))


def _pool(pattern: torch.Tensor, cells: int, causal: bool = True) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """[query_pos key_pos] max-pooled to at most `cells` a side (NaN where every cell is masked: above the
    diagonal when `causal`), with the first and last position of each block."""
    n = pattern.shape[-1]
    if n <= cells:
        return _masked(pattern, causal), [(i, i) for i in range(n)]
    size = math.ceil(n / cells)
    pad = size * math.ceil(n / size) - n
    # a block's max shows any sharp attention inside it; the mean would smear a one-token spike
    pooled = F.max_pool2d(F.pad(pattern[None, None].float(), (0, pad, 0, pad)), size)[0, 0]
    blocks = pooled.shape[0]
    starts = torch.arange(blocks) * size
    # a block is entirely in the future when its first key comes after its last query
    future = starts[None, :] > (starts[:, None] + size - 1).clamp(max=n - 1)
    future &= causal  # a bidirectional query sees every key: nothing is blank
    spans = [(int(s), min(int(s) + size - 1, n - 1)) for s in starts]
    return pooled.masked_fill(future, float("nan")), spans


def _check_indices(values: Optional[Sequence[int]], count: int, what: str) -> list[int]:
    if values is None:
        return list(range(count))
    values = [values] if is_int(values) else list(values)
    bad = [v for v in values if not is_int(v) or not 0 <= v < count]
    if bad or not values:
        raise ValueError(f"{what}={values!r}: each must be an int in [0, {count}) and at least one is needed")
    return values


def _style_grid(fig: go.Figure, title: str, width: int, height: int) -> go.Figure:
    """Small multiples of patterns: one shared colour scale, no tick labels, query rows downwards."""
    fig.update_layout(width=width, height=height, plot_bgcolor="white",  # the mask's triangle shows blank
                      coloraxis=dict(colorscale="Blues", cmin=0, cmax=1, colorbar=dict(title="weight")))
    titled(fig, title, width)
    fig.update_xaxes(showticklabels=False, showgrid=False, zeroline=False)
    fig.update_yaxes(showticklabels=False, showgrid=False, zeroline=False, autorange="reversed")
    return fig


@torch.no_grad()
def attention_patterns(
    model: HookedDecoder,
    input: AnalysisInput,
    layers: Optional[Sequence[int]] = None,
    heads: Optional[Sequence[int]] = None,
) -> AttentionPatterns:
    """The attention weights of one prompt (a string or token ids of one sequence) in the chosen
    layers and heads (default: all; a hybrid model's attention layers), with the prompt's token strings for labelling."""
    attending = [l for l in range(model.cfg.n_layers) if model.cfg.layer_has_attention(l)]
    layers = _check_indices(attending if layers is None else layers, model.cfg.n_layers, "layers")
    linear = [l for l in layers if l not in attending]  # a hybrid's linear-attention layers (Qwen3.5)
    if linear:
        kind = "linear-attention" if all(map(model.cfg.layer_has_mixer, linear)) else "linear-attention or MLP-only"
        raise ValueError(f"attention_patterns: layers {linear} are {kind} layers, which have no attention "
                         f"patterns; this hybrid model's attention layers are {attending}")
    heads = _check_indices(heads, model.cfg.n_heads, "heads")
    if not isinstance(input, (str, torch.Tensor)):
        raise ValueError("attention_patterns shows one prompt: pass a string or the token ids of one sequence")
    tokens = as_tokens(model, input)
    if tokens.shape[0] != 1:
        raise ValueError(
            f"attention_patterns shows one prompt, got a batch of {tokens.shape[0]}; pass tokens[i] for the one you want"
        )
    names = [act_name("pattern", l) for l in layers]
    _, cache = model.run_with_cache(tokens, names=names, device="cpu", dtype=torch.float32)
    n = tokens.shape[1]
    # NaN marks heads a (structurally pruned) layer does not have
    pattern = torch.full((len(layers), len(heads), n, n), float("nan"))
    for i, (layer, name) in enumerate(zip(layers, names)):
        present = [j for j, h in enumerate(heads) if h < model.cfg.layer_heads(layer)]
        pattern[i, present] = cache[name][0, [heads[j] for j in present]]
    strings = token_strings(model, tokens[0].tolist())
    return AttentionPatterns(pattern=pattern, layers=layers, heads=heads, tokens=tokens[0].cpu(),
                             labels=position_labels(strings), strings=strings, causal=not model.cfg.bidirectional)
