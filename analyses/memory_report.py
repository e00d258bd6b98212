"""A self-contained HTML page with one card per FFN neuron: its top trigger prefixes (trigger token
highlighted) next to the tokens its value promotes and suppresses.

Every string from the corpus or the vocabulary is HTML-escaped before it reaches the page (tokens with
their whitespace visible, partial UTF-8 characters as `<0xE2>`: analyses.labels); the page
has no scripts and loads nothing, so it can be opened from disk or attached to an issue.
"""
from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Optional, Sequence, Union

from probe.analyses.common import token_strings
from probe.analyses.labels import html_text, html_token, text_of
from probe.analyses.memory_agreement import require_mlp
from probe.analyses.memory_units import require_ffn
from probe.analyses.trigger_results import PAD, TopTriggers
from probe.analyses.vocab_projection import top_value_tokens
from probe import HookedDecoder
from probe.io import atomic_file

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; background: #fafafa; color: #222; }
h1 { font-size: 1.3em; }
.meta { color: #666; font-size: 0.9em; }
.cards { display: flex; flex-wrap: wrap; gap: 1em; }
.card { background: white; border: 1px solid #ddd; border-radius: 6px; padding: 0.8em 1em; width: 46em; }
.card h2 { font-size: 1.05em; margin: 0 0 0.4em 0; }
.tokens { margin: 0.2em 0; font-size: 0.9em; }
.tok { font-family: ui-monospace, monospace; border-radius: 3px; padding: 0 0.25em; margin-right: 0.25em; }
.up { background: #d9f2d9; }
.down { background: #f7d9d9; }
table { border-collapse: collapse; width: 100%; font-size: 0.85em; margin-top: 0.5em; }
td { border-top: 1px solid #eee; padding: 0.2em 0.3em; vertical-align: top; }
td.act { text-align: right; font-family: ui-monospace, monospace; white-space: nowrap; }
td.prefix { font-family: ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }
mark { background: #ffd54f; font-weight: bold; }
.next { color: #1565c0; }
.hit { outline: 2px solid #2e7d32; }
"""


def _tokens_html(model: HookedDecoder, ids, logits, css: str) -> str:
    strings = token_strings(model, ids.tolist())
    return "".join(f'<span class="tok {css}" title="logit {v:.4g}">{html_token(s)}</span>'
                   for s, v in zip(strings, logits.tolist()))


def _card(model: HookedDecoder, triggers: TopTriggers, li: int, ni: int, value_tokens, n_examples: int) -> str:
    """One neuron's card; `value_tokens` = (top_logits, top_ids, bottom_logits, bottom_ids), each [k]."""
    layer, neuron = triggers.layers[li], int(triggers.neurons[ni])
    top_logits, top_ids, bottom_logits, bottom_ids = value_tokens
    rows = []
    for r in range(min(n_examples, triggers.k)):
        doc = int(triggers.docs[li, ni, r])
        if doc < 0:
            break
        ctx = [t for t in triggers.contexts[li, ni, r].tolist() if t != PAD]
        strings = token_strings(model, ctx)
        position = int(triggers.positions[li, ni, r])
        cut = "…" if position + 1 > len(ctx) else ""  # the document goes on before the stored context
        prefix = cut + html_text(text_of(model.tokenizer, ctx[:-1]))
        trigger = html_token(strings[-1])
        nxt = int(triggers.next_tokens[li, ni, r])
        hit = nxt >= 0 and nxt == int(top_ids[0])
        after = ""
        if nxt >= 0:
            shown = html_token(token_strings(model, [nxt])[0])
            after = f'<span class="next{" hit" if hit else ""}" title="next token">{shown}</span>'
        where = html.escape(triggers.doc_names.get(doc, f"doc {doc}"))
        rows.append(
            f'<tr><td class="act">{float(triggers.activations[li, ni, r]):.4f}</td>'
            f'<td class="prefix">{prefix}<mark>{trigger}</mark>{after}</td>'
            f'<td class="meta">{where}:{position}</td></tr>'
        )
    body = "".join(rows) or '<tr><td class="meta">no trigger examples</td></tr>'
    return (
        f'<div class="card" id="L{layer}N{neuron}"><h2>layer {layer}, neuron {neuron}</h2>'
        f'<div class="tokens">promotes: {_tokens_html(model, top_ids, top_logits, "up")}</div>'
        f'<div class="tokens">suppresses: {_tokens_html(model, bottom_ids, bottom_logits, "down")}</div>'
        f'<table>{body}</table></div>'
    )


def memory_report(
    model: HookedDecoder,
    triggers: TopTriggers,
    path: Union[str, os.PathLike, None] = None,
    *,
    neurons: Optional[Sequence[tuple[int, int]]] = None,
    n_examples: int = 10,
    n_tokens: int = 8,
    through_final_norm: bool = False,
    max_cards: int = 500,
    overwrite: bool = False,
    title: str = "FFN memories: top triggers and value tokens",
    show_more: str = "raise max_cards= or pass neurons=",
) -> str:
    """The HTML page (a string) with a card per (layer, neuron) of `triggers` (or the `neurons` pairs
    given, at most `max_cards`; `show_more` says how to see the rest, in the caller's terms: a command
    passes its flags); with `path`, also written there atomically, refusing to replace a file unless `overwrite`.

    A card lists the value's `n_tokens` most promoted and suppressed tokens (v W_U) and the top
    `n_examples` trigger prefixes, activation first, the trigger token highlighted and the actual
    next token after it in blue (outlined in green when it is the value's top token).
    """
    require_ffn(model, "memory_report")
    require_mlp(triggers, "memory_report")  # cards read FFN value vectors; an SAE scan has none
    if path is not None and Path(path).exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it or choose another path")
    pairs = [(l, int(n)) for l in triggers.layers for n in triggers.neurons] if neurons is None else list(neurons)
    shown = pairs[:max_cards]
    index = [triggers.index(l, n) for l, n in shown]
    cards = []
    for li in sorted({li for li, _ in index}):
        layer = triggers.layers[li]
        tokens = top_value_tokens(model, layer, triggers.neurons, n_tokens, through_final_norm)
        for li2, ni in index:
            if li2 == li:
                cards.append(_card(model, triggers, li, ni, [t[ni] for t in tokens], n_examples))
    status = "" if triggers.complete else " (interrupted scan: partial results)"
    if len(pairs) > len(shown):
        status += f"; showing the first {len(shown)} of {len(pairs)} neurons ({show_more})"
    page = (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        f'<p class="meta">{triggers.n_tokens} tokens scanned{html_text(status)}; top {triggers.k} triggers kept per neuron.</p>'
        f'<div class="cards">{"".join(cards)}</div></body></html>'
    )
    if path is not None:
        with atomic_file(path, overwrite=overwrite) as tmp:
            tmp.write_text(page, encoding="utf-8")
    return page
