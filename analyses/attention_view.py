"""An interactive, token-labelled attention view: hover a token to see where it attends, or what attends to it.

One self-contained piece of HTML (vanilla JavaScript, no network): pick a layer and a head, then hover
a token of the prompt; every token is shaded by its attention weight, and a heatmap of the head's
pattern marks the row (or column) hovered. It is what circuitsvis's attention view gives
TransformerLens users, for `probe attention`'s output, the report's attention section, and Jupyter
(`_repr_html_`).

The data travel as JSON in a `<script type="application/json">` element: token strings never pass
through innerHTML (the script sets textContent), and `</` inside the JSON is written `<\\/`, so no
token can end the script element early. Weights are rounded to `DIGITS` decimals.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from probe.analyses.attention import AttentionPatterns, attention_patterns
from probe.analyses.common import AnalysisInput
from probe.analyses.labels import head_label, html_text, shown_token
from probe import HookedDecoder

DIGITS = 4  # decimals kept of each weight: 1e-4 is below what a shade or a hover shows


@dataclass
class AttentionView:
    """Attention weights of one prompt, ready to draw. rows[layer][head][query] is the query position's
    weights over keys 0..query, or over every key when `causal` is False (a bidirectional model), None for a head a
    pruned layer does not have."""

    tokens: list[str]  # the tokens as written, whitespace visible (␣, ⏎), one per position
    layers: list[int]
    heads: list[int]
    rows: list[list[Optional[list[list[float]]]]]
    causal: bool = True

    @classmethod
    def from_patterns(cls, patterns: AttentionPatterns) -> "AttentionView":
        pattern = patterns.pattern.float()  # [layer head query_pos key_pos], NaN for a missing head
        n = pattern.shape[-1]
        rows = []
        for l in range(pattern.shape[0]):
            per_head = []
            for h in range(pattern.shape[1]):
                p = pattern[l, h]
                per_head.append(None if bool(p.isnan().any()) else
                                [[round(float(w), DIGITS) for w in p[q, :q + 1 if patterns.causal else n]]
                                 for q in range(n)])
            rows.append(per_head)
        return cls(tokens=[shown_token(s) for s in patterns.strings], layers=list(patterns.layers),
                   heads=list(patterns.heads), rows=rows, causal=patterns.causal)

    def data(self) -> dict:
        """What the page's script reads: tokens, layer and head numbers, the weights, the head labels, and whether
        a query's row stops at itself (causal) or covers every key."""
        labels = [[head_label(l, h) for h in self.heads] for l in self.layers]
        return dict(tokens=self.tokens, layers=self.layers, heads=self.heads, labels=labels, rows=self.rows,
                    causal=self.causal)

    def to_html(self, *, full_html: bool = False, title: str = "Attention, token by token") -> str:
        """The view as an HTML fragment (or, with `full_html`, a page): markup, its data, its script."""
        root = f"probe-attn-{uuid.uuid4().hex[:10]}"
        payload = json.dumps(self.data(), ensure_ascii=False, separators=(",", ":")).replace("</", "<\\/")
        fragment = (f'<div class="probe-attn" id="{root}">'
                    f'<style>{_CSS}</style>'
                    f'<div class="pa-title">{html_text(title)}</div>'
                    '<div class="pa-controls">'
                    '<label>layer <select class="pa-layer"></select></label> '
                    '<label>head <select class="pa-head"></select></label> '
                    '<label>show <select class="pa-mode"><option value="to">where the hovered token attends'
                    '</option><option value="from">what attends to the hovered token</option></select></label>'
                    '</div>'
                    '<div class="pa-info">hover a token</div>'
                    '<div class="pa-tokens"></div>'
                    '<canvas class="pa-grid"></canvas>'
                    '<div class="pa-note">the head\'s pattern: a row per query (attending) position, a column per key '
                    'position, position 0 at the top left; hover a cell for its weight</div>'
                    f'<script type="application/json" class="pa-data">{payload}</script>'
                    f'<script>{_JS}\nprobeAttentionView(document.getElementById("{root}"));</script>'
                    '</div>')
        if not full_html:
            return fragment
        return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html_text(title)}</title></head>'
                f'<body>{fragment}</body></html>')

    def _repr_html_(self) -> str:  # Jupyter
        return self.to_html()

    def write_html(self, path) -> Path:
        """The view as a page of its own (written under a temporary name, then renamed)."""
        from probe.io import atomic_file

        path = Path(path)
        with atomic_file(path, overwrite=True) as tmp:
            tmp.write_text(self.to_html(full_html=True), encoding="utf-8")
        return path


@torch.no_grad()
def attention_view(model: HookedDecoder, input: AnalysisInput, layers: Optional[Sequence[int]] = None,
                   heads: Optional[Sequence[int]] = None) -> AttentionView:
    """The interactive view of one prompt's attention (a string or the token ids of one sequence), in the
    chosen layers and heads (default: all)."""
    return AttentionView.from_patterns(attention_patterns(model, input, layers=layers, heads=heads))


_CSS = """
.probe-attn{font:13px/1.5 system-ui,sans-serif;max-width:100%;margin:8px 0}
.probe-attn .pa-title{font-weight:600;margin-bottom:4px}
.probe-attn .pa-controls label{margin-right:10px}
.probe-attn .pa-info{margin:6px 0;color:#333;min-height:1.5em}
.probe-attn .pa-tokens{display:flex;flex-wrap:wrap;gap:2px;margin-bottom:8px}
.probe-attn .pa-tok{font-family:ui-monospace,monospace;padding:1px 4px;border:1px solid #ccc;border-radius:3px;
  cursor:default;white-space:pre}
.probe-attn .pa-tok.pa-here{outline:2px solid #d62728}
.probe-attn canvas{border:1px solid #ddd}
.probe-attn .pa-note{color:#666;font-size:12px}
"""

# One function for every view on the page: it reads its data, fills the menus, draws on hover.
_JS = r"""
window.probeAttentionView = window.probeAttentionView || function (root) {
  var data = JSON.parse(root.querySelector(".pa-data").textContent);
  var layerMenu = root.querySelector(".pa-layer"), headMenu = root.querySelector(".pa-head");
  var modeMenu = root.querySelector(".pa-mode"), info = root.querySelector(".pa-info");
  var strip = root.querySelector(".pa-tokens"), canvas = root.querySelector(".pa-grid");
  var n = data.tokens.length, spans = [], hovered = null;
  data.layers.forEach(function (layer, i) {
    var o = document.createElement("option"); o.value = i; o.textContent = "L" + layer; layerMenu.appendChild(o);
  });
  function fillHeads() {
    var keep = headMenu.value; headMenu.textContent = "";
    data.heads.forEach(function (head, j) {
      var o = document.createElement("option"); o.value = j; o.textContent = data.labels[layerMenu.value][j];
      if (data.rows[layerMenu.value][j] === null) { o.disabled = true; o.textContent += " (pruned)"; }
      headMenu.appendChild(o);
    });
    if (keep !== "" && data.rows[layerMenu.value][keep]) headMenu.value = keep;
    else { var first = data.rows[layerMenu.value].findIndex(function (r) { return r !== null; }); headMenu.value = Math.max(first, 0); }
  }
  function rows() { return data.rows[layerMenu.value][headMenu.value]; }
  function seen(q, k) { return !data.causal || k <= q; }  // a bidirectional query sees every key
  function weight(q, k) { var r = rows(); return (r && seen(q, k)) ? r[q][k] : 0; }
  data.tokens.forEach(function (text, i) {
    var s = document.createElement("span"); s.className = "pa-tok"; s.textContent = text;
    s.title = "position " + i; s.dataset.position = i;
    s.addEventListener("mouseenter", function () { hovered = i; draw(); });
    strip.appendChild(s); spans.push(s);
  });
  var cell = Math.max(3, Math.min(18, Math.floor(480 / Math.max(n, 1))));
  canvas.width = canvas.height = cell * n;
  canvas.addEventListener("mousemove", function (e) {
    var box = canvas.getBoundingClientRect(), q = Math.floor((e.clientY - box.top) / cell), k = Math.floor((e.clientX - box.left) / cell);
    if (q >= 0 && q < n && k >= 0 && k < n)
      canvas.title = data.tokens[q] + " (" + q + ") \u2192 " + data.tokens[k] + " (" + k + "): " + weight(q, k).toFixed(4);
  });
  function draw() {
    var ctx = canvas.getContext("2d"), r = rows(), to = modeMenu.value === "to";
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    for (var q = 0; q < n; q++) for (var k = 0; k < n && seen(q, k); k++) {
      var w = weight(q, k); ctx.fillStyle = "rgba(31,119,180," + w + ")"; ctx.fillRect(k * cell, q * cell, cell, cell);
    }
    if (hovered !== null) {
      ctx.strokeStyle = "#d62728"; ctx.lineWidth = 2;
      if (to) ctx.strokeRect(1, hovered * cell + 1, canvas.width - 2, cell - 2);
      else ctx.strokeRect(hovered * cell + 1, 1, cell - 2, canvas.height - 2);
    }
    var best = -1, bestW = -1;
    spans.forEach(function (s, i) {
      var w = hovered === null ? 0 : (to ? weight(hovered, i) : weight(i, hovered));
      s.dataset.weight = w.toFixed(DIGITS);
      s.style.background = "rgba(" + (to ? "31,119,180," : "255,127,14,") + w + ")";
      s.classList.toggle("pa-here", i === hovered);
      if (hovered !== null && w > bestW && (to ? seen(hovered, i) : seen(i, hovered))) { best = i; bestW = w; }
    });
    var label = data.labels[layerMenu.value][headMenu.value];
    if (!r) info.textContent = label + " is pruned";
    else if (hovered === null) info.textContent = label + ": hover a token";
    else info.textContent = label + ": " + (to ? "\u201c" + data.tokens[hovered] + "\u201d (" + hovered + ") attends most to \u201c"
      : "\u201c" + data.tokens[hovered] + "\u201d (" + hovered + ") is attended to most by \u201c")
      + data.tokens[best] + "\u201d (" + best + "), weight " + bestW.toFixed(DIGITS);
  }
  layerMenu.addEventListener("change", function () { fillHeads(); draw(); });
  headMenu.addEventListener("change", draw); modeMenu.addEventListener("change", draw);
  fillHeads(); draw();
};
""".replace("DIGITS", str(DIGITS))
