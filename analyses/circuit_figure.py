"""An interactive drawing of a circuit: the embedding on top, each layer's heads (or its recurrent mixer, a hexagon)
then its MLP (if it has one) below, the logits at the bottom; an edge's width and colour show its score, and its dash (and the side of the head
it enters) which input it feeds: q solid from the left, k dashed in the middle, v dotted from the right."""
from __future__ import annotations

from typing import Optional

import plotly.graph_objects as go
import torch

from probe.analyses.common import escape_token
from probe.analyses.labels import LINE_PX, TITLE_TOP_PX, title_lines, titled, wrap

INPUT_STYLE = {"q": ("solid", -0.22), "k": ("dash", 0.0), "v": ("dot", 0.22), "mixer": ("solid", 0.0), "mlp": ("solid", 0.0),
               "logits": ("solid", 0.0)}
POSITIVE, NEGATIVE = "rgba(33, 102, 172, {a})", "rgba(178, 24, 43, {a})"
WIDTH_BINS = 5
MAX_TITLE_TOKENS = 40
MODE_BAR_GAP = 14  # px between plotly's mode bar and the title


def _positions(graph) -> dict[int, tuple[float, float]]:
    """node index -> (x, row); rows count down the page."""
    width = max(max(graph.heads, default=0), 1)  # (a model of mixers alone has no heads)
    centre = (width - 1) / 2
    per_layer = 2.0 if graph.mlps else 1.0  # rows: the heads, then the MLP (attention-only models: the heads)
    out = {}
    for i, (kind, layer, head) in enumerate(zip(graph.writer_kind, graph.writer_layer, graph.writer_head)):
        if kind == "embed":
            out[i] = (centre, 0.0)
        elif kind == "head":
            out[i] = (float(head), per_layer * layer + 1)
        elif kind == "mixer":  # where its layer's heads would be
            out[i] = (centre, per_layer * layer + 1)
        else:
            out[i] = (centre, per_layer * layer + 2)
    out[len(graph.writers)] = (centre, per_layer * graph.n_layers + 1)
    return out


def _curve(x0, y0, x1, y1, bend: float, points: int = 14):
    """A quadratic Bezier from (x0, y0) to (x1, y1) bowed sideways by `bend`, so long edges do not all overlap."""
    cx, cy = (x0 + x1) / 2 + bend, (y0 + y1) / 2
    t = torch.linspace(0, 1, points)
    xs = (1 - t) ** 2 * x0 + 2 * (1 - t) * t * cx + t ** 2 * x1
    ys = (1 - t) ** 2 * y0 + 2 * (1 - t) * t * cy + t ** 2 * y1
    return xs.tolist(), ys.tolist()


def circuit_figure(circuit, title: Optional[str] = None) -> go.Figure:
    graph = circuit.graph
    pos = _positions(graph)
    writers, readers = graph.edge_writer[circuit.edges].tolist(), graph.edge_reader[circuit.edges].tolist()
    scores = circuit.scores.float().tolist() if circuit.scores is not None else [1.0] * len(writers)
    top = max([abs(s) for s in scores] + [1e-30])
    present = set(writers)
    groups: dict[tuple, tuple[list, list]] = {}
    mid_x, mid_y, mid_text = [], [], []
    for w, r, s in zip(writers, readers, scores):
        kind = graph.reader_kind[r]
        dash, offset = INPUT_STYLE[kind]
        # a shared key/value input enters each head of its group that is drawn (all of them if none is)
        targets = graph.reader_nodes[r].nonzero()[:, 0].tolist()
        shown = [t for t in targets if t in present or t == len(graph.writers)] or targets
        level = min(WIDTH_BINS - 1, int(abs(s) / top * WIDTH_BINS))
        key = (kind, s >= 0, level)
        xs_all, ys_all = groups.setdefault(key, ([], []))
        x0, y0 = pos[w]
        for t in shown:
            x1, y1 = pos[t]
            y1 -= 0.18 if kind in ("q", "k", "v") else 0.0
            span = y1 - y0
            bend = 0.0 if abs(x1 + offset - x0) > 0.5 or span <= 1.5 else 0.12 * span * (1 if (w % 2) else -1)
            xs, ys = _curve(x0, y0, x1 + offset, y1, bend)
            xs_all += xs + [None]
            ys_all += ys + [None]
            mid_x.append(xs[len(xs) // 2])
            mid_y.append(ys[len(ys) // 2])
            mid_text.append(f"{graph.writers[w]} → {graph.readers[r]}<br>score {s:+.5g}")
    fig = go.Figure()
    for (kind, positive, level), (xs, ys) in sorted(groups.items(), key=lambda item: item[0][2]):
        alpha = 0.35 + 0.6 * (level + 1) / WIDTH_BINS
        colour = (POSITIVE if positive else NEGATIVE).format(a=f"{alpha:.2f}")
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", hoverinfo="skip", legendgroup=kind, showlegend=False,
                                 line=dict(width=1 + 2 * level, color=colour, dash=INPUT_STYLE[kind][0])))
    # the legend shows the input kinds in a neutral colour: colour means sign, not kind
    for kind in [k for k in INPUT_STYLE if any(g[0] == k for g in groups)]:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", legendgroup=kind, line=dict(color="#555", width=2, dash=INPUT_STYLE[kind][0]),
                                 name={"q": "into a query (enters left)", "k": "into a key (centre)", "v": "into a value (right)",
                                       "mixer": "into a recurrent mixer", "mlp": "into an MLP",
                                       "logits": "into the logits"}[kind]))
    fig.add_trace(go.Scatter(x=mid_x, y=mid_y, mode="markers", marker=dict(size=9, color="rgba(0,0,0,0)"),
                             hovertext=mid_text, hoverinfo="text", showlegend=False))
    nodes = sorted(present | {len(graph.writers)} | {t for r in readers for t in graph.reader_nodes[r].nonzero()[:, 0].tolist()
                                                      if graph.reader_nodes[r].sum() == 1})
    symbols = {"embed": "diamond", "head": "circle", "mixer": "hexagon", "mlp": "square"}
    fig.add_trace(go.Scatter(
        x=[pos[n][0] for n in nodes], y=[pos[n][1] for n in nodes], mode="markers+text",
        text=[graph.nodes[n] for n in nodes], textposition="middle right", textfont=dict(size=11),
        marker=dict(size=16, color="white", line=dict(width=2, color="#333"),
                    symbol=[symbols.get(graph.writer_kind[n], "diamond") if n < len(graph.writers) else "diamond" for n in nodes]),
        hovertext=[graph.nodes[n] for n in nodes], hoverinfo="text", showlegend=False))
    if title is None:
        prompt = ""
        if circuit.labels:
            shown = (" " if circuit.labels_are_ids else "").join(escape_token(t) for t in circuit.labels[:MAX_TITLE_TOKENS])
            prompt = f"<br><sup>corrupted prompt: {shown}{' …' if len(circuit.labels) > MAX_TITLE_TOKENS else ''}</sup>"
        # the circuit's own node count: the drawing always places the logits, an empty circuit has no node
        title = (f"Circuit: {circuit.n_edges} edges, {len(circuit.nodes)} nodes ({circuit.method}; blue raises the "
                 f"{circuit.metric_name}, red lowers it){prompt}")
    parts = ("attn", "mlp") if graph.mlps else ("attn",)
    rows = len(parts) * graph.n_layers + 2
    most_heads = max(max(graph.heads, default=0), 1)
    width = max(700, 130 * most_heads + 200)
    labels = ["embed"] + [f"L{l} {'mixer' if part == 'attn' and graph.is_mixer(l) else part}"
                          for l in range(graph.n_layers) for part in parts] + ["logits"]
    fig.update_yaxes(autorange="reversed", tickvals=list(range(rows)), ticktext=labels, showgrid=True, zeroline=False)
    fig.update_xaxes(showticklabels=False, showgrid=False, zeroline=False, range=[-0.8, most_heads + 0.8])
    # plotly never wraps a title: a long prompt ran off the right edge; each line past the usual two gets its height
    extra = max(0, title_lines(wrap(title, width - 40)) - 2) * LINE_PX
    height = max(500, 70 * rows + 160) + extra
    fig.update_layout(width=width, height=height, plot_bgcolor="white", legend=dict(orientation="h", y=-0.05),
                      hovermode="closest")
    titled(fig, title, width, top=MODE_BAR_GAP)
    # the first line spans most of a narrow figure, so it starts clear of the mode bar's icons, not just at their foot
    fig.update_layout(title_y=1 - (TITLE_TOP_PX + MODE_BAR_GAP) / height)
    return fig
