"""Drawing an attribution graph on its layers x positions grid: a plotly figure, and an interactive page.

Rows, bottom to top: the embeddings, each layer's features and error nodes, the logits; columns: positions.
A node's area follows its influence on the logits; an edge's width its |weight|, blue positive, red negative.
The page (one self-contained HTML file, no script from elsewhere) shows an edge's weight on hover, a node's
strongest edges in and out when the pointer rests on it, and a feature's details on a click: its activation,
influence, the tokens its decoder row promotes and, when `feature_links` gives one, a link to its dashboard.
"""
from __future__ import annotations

import json
import math
import re
from typing import Optional

import plotly.graph_objects as go

from probe.analyses.labels import figure_token, html_text, plotly_text, shown_token

COLOURS = {"feature": "#e8a33d", "error": "#9b9b9b", "embedding": "#6a9f5b", "logit": "#7b68c8"}
POSITIVE, NEGATIVE = "#2166ac", "#b2182b"
PER_ROW = 4  # nodes side by side in one cell before a cell wraps
MAX_EDGES = 600  # the strongest edges drawn; the CSV has them all


def layout(graph, col_w: float = 64.0, row_h: float = 120.0) -> list[tuple[float, float]]:
    """(x, y) in pixels of each node, y growing downwards (logits at the top)."""
    kinds = [("feature", "error", "embedding", "logit")[k] for k in graph.kind.tolist()]
    cells: dict[tuple[int, int], list[int]] = {}
    for i, (layer, pos) in enumerate(zip(graph.layer.tolist(), graph.pos.tolist())):
        cells.setdefault((layer, pos), []).append(i)
    top_row = graph.n_layers + 1
    out = [(0.0, 0.0)] * graph.n_nodes
    for (layer, pos), members in cells.items():
        # the most influential at the bottom centre of the cell; logits fan out leftwards in one row above the
        # last position; a crowded cell packs more nodes per line, and closer, to stay inside its row
        members.sort(key=lambda i: (kinds[i] != "feature", -float(graph.influence[i])))
        if kinds[members[0]] == "logit":
            for k, i in enumerate(members):
                out[i] = (60 + (pos + 0.5) * col_w - k * 30.0, 40 + row_h - 18)
            continue
        lines = max(1, int((row_h - 24) // 12))
        per_row = min(max(PER_ROW, math.ceil(len(members) / lines)), per_line_cap(col_w))
        step_x = min(16.0, (col_w - 6) / per_row)
        step_y = min(14.0, (row_h - 24) / max(1, math.ceil(len(members) / per_row)))
        base = 40 + (top_row - (layer + 1)) * row_h + row_h - 18
        for k, i in enumerate(members):
            line, slot = divmod(k, per_row)
            in_line = min(per_row, len(members) - line * per_row)
            out[i] = (60 + (pos + 0.5) * col_w + (slot - (in_line - 1) / 2) * step_x, base - line * step_y)
    return out


def per_line_cap(col_w: float) -> int:
    """The most nodes one line of a cell holds (7 px apart at the closest)."""
    return max(PER_ROW, int((col_w - 6) // 7))


def row_height(graph, col_w: float) -> float:
    """Pixels per row: room for the most crowded cell's lines, 110 at least."""
    crowd = {}
    for layer, pos, kind in zip(graph.layer.tolist(), graph.pos.tolist(), graph.kind.tolist()):
        if kind != 3:
            crowd[layer, pos] = crowd.get((layer, pos), 0) + 1
    lines = math.ceil(max(crowd.values(), default=1) / per_line_cap(col_w))
    return float(min(420, max(110, 30 + 12 * lines)))


def _radius(graph) -> list[float]:
    top = max(float(graph.influence.max()) if graph.n_nodes else 0.0, 1e-12)
    radii = []
    for i in range(graph.n_nodes):
        kind = int(graph.kind[i])
        share = float(graph.logit_weights[i - (graph.n_nodes - len(graph.logit_weights))]) if kind == 3 \
            else float(graph.influence[i]) / top
        radii.append(3.0 + 9.0 * math.sqrt(max(share, 0.0)))
    return radii


def _edges(graph, limit: int = MAX_EDGES):
    target, source = graph.adjacency.nonzero(as_tuple=True)
    weight = graph.adjacency[target, source]
    order = weight.abs().argsort(descending=True)[:limit]
    return target[order].tolist(), source[order].tolist(), weight[order].tolist()


def _describe(graph, i: int) -> dict:
    kind = ("feature", "error", "embedding", "logit")[int(graph.kind[i])]
    pos = int(graph.pos[i])
    return dict(kind=kind, layer=int(graph.layer[i]), pos=pos, feature=int(graph.feature[i]),
                at=shown_token(graph.token_strings[pos]), token=shown_token(graph.node_strings[i]),
                activation=float(graph.activation[i]), influence=float(graph.influence[i]),
                promoted=[[shown_token(s), round(v, 3)] for s, v in graph.promoted.get(i, [])])


def graph_figure(graph) -> go.Figure:
    """A plotly drawing: nodes on the grid (hover for their details), the strongest edges as lines."""
    xy = layout(graph)
    radii = _radius(graph)
    labels = graph.labels()
    fig = go.Figure()
    targets, sources, weights = _edges(graph, limit=300)
    top = max([abs(w) for w in weights] + [1e-12])
    for sign, colour in ((1, POSITIVE), (-1, NEGATIVE)):
        for level in range(1, 5):
            xs, ys = [], []
            for t, s, w in zip(targets, sources, weights):
                if (w > 0) == (sign > 0) and min(4, 1 + int(4 * abs(w) / top)) == level:
                    xs += [xy[s][0], xy[t][0], None]
                    ys += [-xy[s][1], -xy[t][1], None]
            if xs:
                fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", hoverinfo="skip", showlegend=False,
                                         line=dict(color=colour, width=0.5 * level), opacity=0.25 + 0.15 * level))
    for kind, colour in COLOURS.items():
        members = [i for i in range(graph.n_nodes) if _describe(graph, i)["kind"] == kind]
        if not members:
            continue
        hover = []
        for i in members:
            d = _describe(graph, i)
            text = f"{plotly_text(labels[i])}<br>at {figure_token(graph.token_strings[d['pos']])}<br>" \
                   f"activation {d['activation']:.3g}, influence {d['influence']:.3g}"
            if d["promoted"]:
                text += "<br>promotes " + ", ".join(plotly_text(s) for s, _ in d["promoted"])
            hover.append(text)
        fig.add_trace(go.Scatter(x=[xy[i][0] for i in members], y=[-xy[i][1] for i in members], mode="markers",
                                 name=kind, hovertext=hover, hoverinfo="text",
                                 marker=dict(size=[2 * radii[i] for i in members], color=colour,
                                             line=dict(width=0.5, color="#333"))))
    n_pos = len(graph.token_strings)
    rows = ["embeddings"] + [f"L{layer}" for layer in range(graph.n_layers)] + ["logits"]
    fig.update_layout(
        title=plotly_text("attribution graph: " + "".join(shown_token(t) for t in graph.token_strings)[:110]),
        plot_bgcolor="white", height=160 + 120 * len(rows),
        width=max(1000, 120 + 64 * n_pos),
        xaxis=dict(tickvals=[60 + (p + 0.5) * 64 for p in range(n_pos)], tickangle=-60,
                   ticktext=[f"{figure_token(s)} ({p})" for p, s in enumerate(graph.token_strings)], showgrid=False),
        yaxis=dict(tickvals=[-(40 + (len(rows) - 1 - r) * 120 + 120 - 18) for r in range(len(rows))], ticktext=rows,
                   showgrid=False, zeroline=False))
    return fig


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font: 13px system-ui, sans-serif; margin: 0; color: #222; }
header { padding: 8px 14px; border-bottom: 1px solid #ddd; }
header h1 { font-size: 16px; margin: 0 0 4px 0; }
#main { display: flex; height: calc(100vh - 64px); }
#canvas { flex: 1; overflow: auto; }
#side { width: 290px; border-left: 1px solid #ddd; padding: 10px; overflow: auto; }
#tip { position: fixed; pointer-events: none; background: #fffff4; border: 1px solid #999; padding: 4px 6px;
       font-size: 12px; display: none; max-width: 420px; white-space: pre; }
.edge { fill: none; }
.dim .edge { opacity: 0.04 !important; }
.dim .edge.on { opacity: 0.95 !important; }
.node { cursor: pointer; stroke: #333; stroke-width: 0.6; }
.node.sel { stroke: #000; stroke-width: 2.5; }
.axis { font-size: 11px; fill: #444; }
table { border-collapse: collapse; } td { padding: 1px 6px 1px 0; vertical-align: top; }
.tok { font-family: ui-monospace, monospace; background: #f3f3f3; padding: 0 2px; }
</style></head><body>
<header><h1>__TITLE__</h1><div id="summary"></div></header>
<div id="main"><div id="canvas"></div><div id="side"><p>Rest the pointer on a node for its strongest edges;
click a feature for its details. Blue edges excite, red inhibit; a node's area follows its influence on the
logits.</p><div id="detail"></div></div></div>
<div id="tip"></div>
<script type="application/json" id="graph-data">__DATA__</script>
<script>
"use strict";
const G = JSON.parse(document.getElementById("graph-data").textContent);
const NS = "http://www.w3.org/2000/svg";
const tip = document.getElementById("tip");
function el(tag, attrs, parent) { const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]); if (parent) parent.appendChild(e); return e; }
function html(tag, text, parent) { const e = document.createElement(tag); if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e); return e; }
function fmt(v) { return (Math.abs(v) >= 100 || Math.abs(v) < 0.01) ? v.toExponential(2) : v.toFixed(3); }
document.getElementById("summary").textContent = G.summary;
const svg = el("svg", {width: G.width, height: G.height}, document.getElementById("canvas"));
G.rows.forEach((name, r) => { const y = G.rowY[r] + G.rowH - 18;
  const t = el("text", {x: 4, y: y + 4, class: "axis"}, svg); t.textContent = name;
  el("line", {x1: 56, x2: G.width, y1: y, y2: y, stroke: "#e4e4e4"}, svg); });
G.tokens.forEach((tok, p) => { const x = G.colX[p], y = G.height - 6;
  const t = el("text", {x: x, y: y, class: "axis", transform: `rotate(-55 ${x} ${y})`}, svg); t.textContent = tok + " (" + p + ")"; });
const edgeLayer = el("g", {}, svg), nodeLayer = el("g", {}, svg);
const maxW = Math.max(1e-12, ...G.edges.map(e => Math.abs(e[2])));
const byNode = G.nodes.map(() => ({ins: [], outs: []}));
const edgeEls = G.edges.map(([t, s, w], k) => {
  const a = G.nodes[s], b = G.nodes[t], midY = (a.y + b.y) / 2;
  const path = el("path", {d: `M${a.x},${a.y} C${a.x},${midY} ${b.x},${midY} ${b.x},${b.y}`, class: "edge",
    stroke: w > 0 ? "#2166ac" : "#b2182b", "stroke-width": 0.4 + 4 * Math.abs(w) / maxW,
    opacity: 0.15 + 0.6 * Math.abs(w) / maxW}, edgeLayer);
  const title = el("title", {}, path); title.textContent = `${a.label} \u2192 ${b.label}: ${fmt(w)}`;
  byNode[s].outs.push(k); byNode[t].ins.push(k); return path; });
function strongest(list, n) { return list.slice().sort((i, j) => Math.abs(G.edges[j][2]) - Math.abs(G.edges[i][2])).slice(0, n); }
function edgeLines(node) {
  const i = G.nodes.indexOf(node), lines = [node.label + "  (" + node.kind + " at " + node.at + ")"];
  lines.push(`activation ${fmt(node.activation)}, influence ${fmt(node.influence)}`);
  const ins = strongest(byNode[i].ins, 6), outs = strongest(byNode[i].outs, 6);
  if (ins.length) { lines.push("from:"); ins.forEach(k => lines.push(`  ${fmt(G.edges[k][2])}  ${G.nodes[G.edges[k][1]].label}`)); }
  if (outs.length) { lines.push("to:"); outs.forEach(k => lines.push(`  ${fmt(G.edges[k][2])}  ${G.nodes[G.edges[k][0]].label}`)); }
  return lines.join("\\n"); }
let selected = null;
G.nodes.forEach((node, i) => {
  const c = el(node.kind === "error" ? "rect" : "circle", node.kind === "error"
      ? {x: node.x - node.r, y: node.y - node.r, width: 2 * node.r, height: 2 * node.r, fill: G.colours[node.kind], class: "node"}
      : {cx: node.x, cy: node.y, r: node.r, fill: G.colours[node.kind], class: "node"}, nodeLayer);
  c.addEventListener("mouseenter", ev => { highlight(i, true); tip.textContent = edgeLines(node); tip.style.display = "block"; });
  c.addEventListener("mousemove", ev => { tip.style.left = (ev.clientX + 14) + "px"; tip.style.top = (ev.clientY + 10) + "px"; });
  c.addEventListener("mouseleave", () => { highlight(i, false); tip.style.display = "none"; });
  c.addEventListener("click", () => { if (selected) selected.classList.remove("sel"); selected = c; c.classList.add("sel"); show(node, i); });
});
function highlight(i, on) { svg.classList.toggle("dim", on);
  edgeEls.forEach(e => e.classList.remove("on"));
  if (on) byNode[i].ins.concat(byNode[i].outs).forEach(k => edgeEls[k].classList.add("on")); }
// #node=L2.F17@5 in the address selects that node, so a link can point at one
const wanted = decodeURIComponent(location.hash.replace(/^#node=/, ""));
G.nodes.forEach((node, i) => { if (location.hash.startsWith("#node=") && node.label === wanted) {
  const c = nodeLayer.children[i]; selected = c; c.classList.add("sel"); show(node, i); highlight(i, true); } });
function show(node, i) {
  const d = document.getElementById("detail"); d.textContent = "";
  html("h3", node.label, d);
  const t = html("table", undefined, d);
  const row = (k, v) => { const r = html("tr", undefined, t); html("td", k, r); html("td", v, r); };
  row("kind", node.kind); if (node.layer >= 0 && node.kind !== "logit") row("layer", "L" + node.layer);
  row("position", node.pos + "  " + node.at); if (node.feature >= 0) row("feature", String(node.feature));
  row(node.kind === "logit" ? "demeaned logit" : node.kind === "feature" ? "activation" : "norm", fmt(node.activation));
  row("influence", fmt(node.influence));
  if (node.promoted.length) { html("h4", "promotes (its decoder row through the unembedding)", d);
    const p = html("div", undefined, d); node.promoted.forEach(([tok, v]) => { html("span", tok, p).className = "tok";
      p.appendChild(document.createTextNode(" " + fmt(v) + "  ")); }); }
  if (node.link) { const a = html("a", "feature dashboard", html("p", undefined, d)); a.setAttribute("href", node.link); }
  for (const [name, list, end] of [["strongest inputs", byNode[i].ins, 1], ["strongest outputs", byNode[i].outs, 0]]) {
    if (!list.length) continue; html("h4", name, d); const tb = html("table", undefined, d);
    strongest(list, 12).forEach(k => { const r = html("tr", undefined, tb); html("td", fmt(G.edges[k][2]), r);
      html("td", G.nodes[G.edges[k][end]].label, r); }); }
}
</script></body></html>
"""


def _json_for_script(data) -> str:
    """JSON that cannot end its <script> element or start markup: <, > and & as \\u escapes."""
    return json.dumps(data, ensure_ascii=True).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def graph_page(graph, title: Optional[str] = None, feature_links: Optional[dict] = None) -> str:
    """The interactive page as one HTML string. `feature_links`: {(layer, feature): url} of dashboards (relative
    or http(s) addresses only)."""
    col_w = max(34.0, min(80.0, 940.0 / max(len(graph.token_strings), 1)))
    row_h = row_height(graph, col_w)
    xy = layout(graph, col_w=col_w, row_h=row_h)
    radii = _radius(graph)
    labels = graph.labels()
    nodes = []
    for i in range(graph.n_nodes):
        d = _describe(graph, i)
        link = (feature_links or {}).get((d["layer"], d["feature"])) if d["kind"] == "feature" else None
        if link is not None and not (str(link).startswith(("http://", "https://")) or ":" not in str(link)):
            raise ValueError(f"feature link {link!r} must be a relative or http(s) address")
        label = f"logit {shown_token(graph.node_strings[i])}" if d["kind"] == "logit" else labels[i]
        nodes.append(dict(d, label=label, x=round(xy[i][0], 1),
                          y=round(xy[i][1], 1), r=round(radii[i], 2), link=link))
    targets, sources, weights = _edges(graph)
    n_rows = graph.n_layers + 2
    rows = ["logits"] + [f"L{layer}" for layer in reversed(range(graph.n_layers))] + ["embeddings"]
    summary = (f"{graph!r}. Prompt: " + "".join(shown_token(s) for s in graph.token_strings)
               + (f". Pruning kept {graph.shares[0]:.1%} of the feature and error nodes' influence and "
                  f"{graph.shares[1]:.1%} of the edge score" if graph.shares else "")
               + f"; {min(len(weights), MAX_EDGES)} strongest edges drawn.")
    data = dict(nodes=nodes, edges=[[t, s, w] for t, s, w in zip(targets, sources, weights)],
                tokens=[shown_token(s) for s in graph.token_strings], colours=COLOURS, rows=rows, rowH=row_h,
                rowY=[40 + r * row_h for r in range(n_rows)],
                colX=[60 + (p + 0.5) * col_w for p in range(len(graph.token_strings))],
                width=int(80 + col_w * len(graph.token_strings)), height=int(40 + n_rows * row_h + 110), summary=summary)
    # one pass over the template: replacing one placeholder after the other spliced the data into a title that
    # held "__DATA__"
    fill = {"__TITLE__": html_text(title or "attribution graph"), "__DATA__": _json_for_script(data)}
    return re.sub("__TITLE__|__DATA__", lambda match: fill[match.group(0)], PAGE)
