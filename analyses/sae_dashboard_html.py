"""The markup of a feature dashboard: one self-contained HTML page (inline CSS, SVG, a few lines of vanilla JS).

Every string from the model, the corpus or the user is escaped for where it lands (html.escape in text and in
quoted attributes), and token strings show their whitespace as `analyses.labels` writes it everywhere (⏎
newline, ⇥ tab, <0xE2> a partial character); in token lists a space is ␣ too (in running contexts it stays a
space, so a context reads as text).
"""
from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, Optional

from probe.analyses.labels import html_text, html_token, shown_text

if TYPE_CHECKING:
    from probe.analyses.common import PromotedTokens
    from probe.analyses.sae_dashboard import FeatureDashboard

HIGHLIGHT = (255, 140, 0)  # a context token's background: this colour at alpha = activation / the feature's largest

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0; color: #222; }
header { padding: 12px 20px; border-bottom: 1px solid #ddd; background: #fafafa; }
header h1 { font-size: 20px; margin: 0 0 4px; }
header p { margin: 2px 0; color: #555; }
.layout { display: flex; align-items: flex-start; }
nav { position: sticky; top: 0; width: 230px; flex: none; max-height: 100vh; overflow-y: auto; padding: 12px;
      border-right: 1px solid #ddd; box-sizing: border-box; }
nav input { width: 100%; box-sizing: border-box; padding: 5px; font-size: 14px; }
nav ul { list-style: none; padding: 0; margin: 8px 0; }
nav li { padding: 2px 0; }
nav li a { text-decoration: none; color: #0645ad; font-weight: 600; }
nav li span { color: #666; font-size: 12px; }
main { flex: 1; min-width: 0; padding: 0 20px 40px; }
section.feature { border-bottom: 1px solid #ddd; padding: 14px 0; }
section.feature h2 { font-size: 17px; margin: 0 0 4px; }
.stats { color: #444; margin-bottom: 8px; }
.views { display: flex; flex-wrap: wrap; gap: 24px; margin-bottom: 8px; }
.views h3, section.feature h3 { font-size: 13px; margin: 4px 0; color: #333; }
table.tokens { border-collapse: collapse; font-size: 13px; }
table.tokens td { padding: 1px 6px; white-space: pre; }
table.tokens td.num { text-align: right; color: #555; font-variant-numeric: tabular-nums; }
td.up { color: #1a5fb4; } td.down { color: #b31b1b; }
ol.contexts { margin: 0; padding-left: 28px; }
ol.contexts li { margin: 2px 0; }
.ctx { font-family: ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }
.ctx span { border-radius: 2px; }
.ctx span.trigger { outline: 2px solid #c05000; }
.val { display: inline-block; min-width: 56px; color: #555; font-variant-numeric: tabular-nums; }
.where { color: #888; font-size: 12px; }
.note { color: #8a5a00; }
svg text { font: 10px system-ui, sans-serif; fill: #555; }
"""

SCRIPT = """
(function () {
  var box = document.getElementById("search");
  var count = document.getElementById("count");
  var cards = Array.prototype.slice.call(document.querySelectorAll("section.feature"));
  var entries = {};
  Array.prototype.forEach.call(document.querySelectorAll("#index li"), function (li) {
    entries[li.getAttribute("data-feature")] = li;
  });
  // "17" or "F17": that feature; any other text: the features whose contexts or token lists contain it
  function matches(card, query) {
    if (!query) return true;
    var id = /^f?(\\d+)$/.exec(query);
    if (id) return card.getAttribute("data-feature") === String(Number(id[1]));
    return card.getAttribute("data-search").indexOf(query) >= 0;
  }
  function apply() {
    var query = box.value.trim().toLowerCase(), shown = 0;
    cards.forEach(function (card) {
      var on = matches(card, query);
      card.hidden = !on;
      entries[card.getAttribute("data-feature")].hidden = !on;
      if (on) shown += 1;
    });
    count.textContent = shown + " of " + cards.length + " features";
  }
  box.addEventListener("input", apply);
  var asked = new URLSearchParams(window.location.search).get("q");
  if (asked !== null) box.value = asked;
  apply();
})();
"""


def visible(token: str, spaces: bool = True) -> str:
    """A token string as HTML text, its whitespace shown (`analyses.labels`): in token lists a space is ␣ too,
    in running contexts it stays a space; an empty string as ∅."""
    if not token:
        return "∅"
    return html_token(token) if spaces else html_text(shown_text(token))


def _number(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.4g}"


def _histogram_svg(counts: list[int], width: float) -> str:
    """Bars of the non-empty range of a feature's histogram, bins [i width, (i + 1) width)."""
    used = max((i + 1 for i, c in enumerate(counts) if c), default=0)
    if not used:
        return '<p class="note">never active</p>'
    w, h, top = 300, 90, max(counts)
    bar = w / used
    bars = []
    for i, c in enumerate(counts[:used]):
        height = h * c / top
        bars.append(f'<rect x="{i * bar:.2f}" y="{h - height + 12:.2f}" width="{max(bar - 1, 0.5):.2f}" '
                    f'height="{height:.2f}" fill="#e07b00"><title>[{_number(i * width)}, {_number((i + 1) * width)}): '
                    f'{c} token{"s" if c != 1 else ""}</title></rect>')
    axis = (f'<text x="0" y="{h + 24}">0</text><text x="{w}" y="{h + 24}" text-anchor="end">{_number(used * width)}</text>'
            f'<text x="0" y="9">{top} token{"s" if top != 1 else ""}</text>')
    return f'<svg width="{w}" height="{h + 28}" role="img" aria-label="activation histogram">{"".join(bars)}{axis}</svg>'


def _view(heading: str, where: str, body: str) -> str:
    return f'<div><h3>{html.escape(heading)}</h3><div class="where">{html.escape(where)}</div>{body}</div>'


def _token_table(view: "PromotedTokens", i: int, heads: tuple[str, str]) -> str:
    k = view.k
    rows = [f"<tr><th colspan=2>{heads[0]}</th><th colspan=2>{heads[1]}</th></tr>"]
    for r in range(k):
        rows.append(f'<tr><td class="up">{visible(view.token_strings[i][r])}</td>'
                    f'<td class="num">{float(view.top_logits[i, r]):+.3f}</td>'
                    f'<td class="down">{visible(view.token_strings[i][k + r])}</td>'
                    f'<td class="num">{float(view.bottom_logits[i, r]):+.3f}</td></tr>')
    return f'<table class="tokens">{"".join(rows)}</table>'


def _contexts(dashboard: "FeatureDashboard", fi: int) -> str:
    scan = dashboard.scan
    largest = float(scan.top_activations[fi, 0])
    items = []
    for r in range(scan.k):
        doc = int(scan.top_docs[fi, r])
        if doc < 0:
            break
        spans = []
        for c, token in enumerate(scan.context_ids[fi, r].tolist()):
            if token < 0:
                continue
            value = float(scan.context_activations[fi, r, c])
            alpha = min(max(value / largest, 0.0), 1.0) if largest > 0 else 0.0
            style = f' style="background:rgba({HIGHLIGHT[0]},{HIGHLIGHT[1]},{HIGHLIGHT[2]},{alpha:.2f})"' if alpha > 0 else ""
            trigger = ' class="trigger"' if c == scan.before else ""
            spans.append(f'<span{trigger}{style} title="{_number(value)}">'
                         f'{visible(scan.context_strings[fi][r][c], spaces=False)}</span>')
        name = html.escape(scan.doc_names.get(doc, f"doc {doc}"), quote=True)
        items.append(f'<li><span class="val">{float(scan.top_activations[fi, r]):.4g}</span> '
                     f'<span class="ctx">{"".join(spans)}</span> '
                     f'<span class="where">{name}, token {int(scan.top_positions[fi, r])}</span></li>')
    if not items:
        return '<p class="note">no context: the feature was never active on the scanned tokens</p>'
    return f'<ol class="contexts">{"".join(items)}</ol>'


def _search_text(dashboard: "FeatureDashboard", fi: int) -> str:
    """What the search box matches a feature by: its contexts' text and its views' tokens, lowercased."""
    scan = dashboard.scan
    pieces = ["".join(strings) for strings in scan.context_strings[fi]]
    for view in (dashboard.logits, dashboard.inputs):
        if view is not None:
            pieces += view.token_strings[fi]
    return html.escape("\n".join(pieces).lower(), quote=True)


def _card(dashboard: "FeatureDashboard", fi: int) -> str:
    scan = dashboard.scan
    feature = int(scan.features[fi])
    active, density = int(scan.active[fi]), float(scan.density[fi])
    mean = float(scan.active_sum[fi]) / active if active else math.nan
    stats = (f"density {density:.3%} ({active} of {scan.n_tokens} tokens) · mean when active {_number(mean)} · "
             f"largest {_number(float(scan.max_activation[fi]))}")
    views = [f'<div><h3>Activation histogram (active tokens)</h3>'
             f'{_histogram_svg(scan.histogram[fi].tolist(), float(scan.bin_width[fi]))}</div>']
    transcoder = dashboard.is_transcoder
    if dashboard.inputs is not None:
        views.append(_view("Input view: embeddings that excite / inhibit it", f"read at {scan.hook_name}",
                           _token_table(dashboard.inputs, fi, ("excite", "inhibit"))))
    if dashboard.logits is not None:
        written = scan.hook_name_out if transcoder else scan.hook_name
        views.append(_view(f"{'Output view: l' if transcoder else 'L'}ogit effects of its decoder row",
                           f"written at {written}", _token_table(dashboard.logits, fi, ("promotes", "suppresses"))))
    return (f'<section class="feature" id="F{feature}" data-feature="{feature}" data-search="{_search_text(dashboard, fi)}">'
            f'<h2>Feature {feature}</h2><div class="stats">{stats}</div><div class="views">{"".join(views)}</div>'
            f'<h3>Top {scan.k} contexts (the trigger outlined; each token shaded by the activation there, '
            f'relative to the largest; hover for the value)</h3>{_contexts(dashboard, fi)}</section>')


def _index_entry(dashboard: "FeatureDashboard", fi: int, first: Optional[str]) -> str:
    feature = int(dashboard.scan.features[fi])
    hint = f" {visible(first)}" if first is not None else ""
    return (f'<li data-feature="{feature}"><a href="#F{feature}">F{feature}</a> '
            f'<span>{float(dashboard.scan.density[fi]):.2%}{hint}</span></li>')


def render_dashboard(dashboard: "FeatureDashboard") -> str:
    """The whole page as a string."""
    scan = dashboard.scan
    n = len(scan.features)
    firsts = [dashboard.logits.token_strings[i][0] if dashboard.logits is not None else None for i in range(n)]
    index = "".join(_index_entry(dashboard, i, firsts[i]) for i in range(n))
    cards = "".join(_card(dashboard, i) for i in range(n))
    notes = "".join(f'<p class="note">{html.escape(note)}</p>' for note in dashboard.notes)
    title = html.escape(f"Feature dashboard: {dashboard.title}")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head><body>'
        f'<header><h1>{title}</h1>'
        f'<p>{n} features over {scan.n_tokens} tokens of {html.escape(dashboard.corpus)}</p>{notes}</header>'
        f'<div class="layout"><nav><input id="search" type="search" placeholder="F17, or text in contexts / tokens" '
        f'aria-label="search features"><p id="count">{n} of {n} features</p><ul id="index">{index}</ul></nav>'
        f'<main>{cards}</main></div><script>{SCRIPT}</script></body></html>\n'
    )
