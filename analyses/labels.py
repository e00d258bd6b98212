"""How every figure, page and table writes heads, layers, ranks and tokens: one notation, kept in one place.

- Heads are `L2H0` (layer 2, head 0) in titles, axes, hovers, notes and the CSVs' `label` columns;
  `parse_head` also reads `2.0` and `a2.0`, the notations other tools print.
- Layer 0 is at the bottom of every heatmap and grid with a layer axis, as the residual stream is
  drawn: the embeddings below, the output above (`LAYER_AXIS` sets a plotly axis that way).
- Ranks are 1-based everywhere: rank 1 is the top token (hovers, CSVs, the lens's target plot).
- Tokens show their whitespace (`␣` space, `⏎` newline, `⇥` tab); bytes that are not a whole UTF-8
  character show as `<0xE2>` rather than U+FFFD; other invisible characters as `<U+200B>`.
- Escaping depends on where the text goes. Plotly text is not HTML: plotly.js reads `<...>` as its
  own tags and decodes only a few entities (`&amp;`, `&lt;`, `&gt;`, numeric ones), so `&quot;` would
  show as written. `plotly_text` escapes exactly `&`, `<` and `>`, which shows every string as
  written and runs nothing. HTML pages use `html_text` (full escaping, quotes included).
"""
from __future__ import annotations

import html
import re
import textwrap
from typing import Optional, Sequence

# ---- heads, layers, counts --------------------------------------------------------------------------
# plotly axis settings that put layer 0 at the bottom of a heatmap whose rows are layers (first row first)
LAYER_AXIS = dict(autorange=True)


def head_label(layer: int, head: int) -> str:
    """`L2H0`: the one way heads are written."""
    return f"L{int(layer)}H{int(head)}"


def layer_label(layer: int) -> str:
    return f"L{int(layer)}"


_HEAD = re.compile(r"^\s*(?:[Ll](\d+)\s*[Hh](\d+)|[Aa]?(\d+)\.(\d+))\s*$")


def parse_head(text: str) -> tuple[int, int]:
    """(layer, head) from `L2H0`, `2.0` or `a2.0`."""
    found = _HEAD.match(str(text))
    if found is None:
        raise ValueError(f"{text!r} is not a head: write layer 2 head 0 as L2H0 (or 2.0, or a2.0)")
    numbers = [g for g in found.groups() if g is not None]
    return int(numbers[0]), int(numbers[1])


def count(n: int, noun: str, plural: Optional[str] = None) -> str:
    """`1 prompt`, `2 prompts`."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"


# ---- tokens -----------------------------------------------------------------------------------------
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


_BYTE_OF = _byte_level_alphabet()


def bytes_text(data: bytes) -> str:
    """UTF-8 text, with each byte that does not start a whole character written `<0xE2>`."""
    out, i = [], 0
    while i < len(data):
        for width in (1, 2, 3, 4):
            try:
                out.append(data[i:i + width].decode("utf-8"))
            except UnicodeDecodeError:
                continue
            i += width
            break
        else:
            out.append(f"<0x{data[i]:02X}>")
            i += 1
    return "".join(out)


def vocab_bytes(entry: str) -> Optional[bytes]:
    """The bytes a byte-level BPE vocabulary entry (`Ġthe`) stands for; None for an entry outside that
    alphabet (an added token such as `<|endoftext|>` is inside it and reads as itself)."""
    try:
        return bytes(_BYTE_OF[c] for c in entry)
    except KeyError:
        return None


def token_texts(tokenizer, ids: Sequence[int]) -> list[str]:
    """Each id's text, decoded on its own; a token holding part of a UTF-8 character (which decodes to
    U+FFFD) is read from its bytes instead: `<0xE2>`, or `é<0xE2>` for a whole character and a part.
    `tokenizer` is probe's (byte-level BPE); None gives each id as a string."""
    ids = [int(i) for i in ids]
    if tokenizer is None:
        return [str(i) for i in ids]
    decoded = tokenizer.token_strings(ids)
    out = []
    for i, text in zip(ids, decoded):
        if "\ufffd" in text:
            data = vocab_bytes(tokenizer.convert_ids_to_tokens(i))
            text = text if data is None else bytes_text(data)
        out.append(text)
    return out


def text_of(tokenizer, ids: Sequence[int]) -> str:
    """The text of a run of ids decoded together (characters split across tokens join up), bytes left
    over at either end (a window cut inside a character) written `<0xE2>`."""
    ids = [int(i) for i in ids]
    if tokenizer is None:
        return " ".join(str(i) for i in ids)
    parts = [vocab_bytes(entry) for entry in tokenizer.convert_ids_to_tokens(ids)]
    if any(p is None for p in parts):
        return tokenizer.decode(ids)
    return bytes_text(b"".join(parts))


_VISIBLE = {"\n": "⏎", "\t": "⇥", "\r": "␍"}


def shown_text(text: str) -> str:
    """Text as figures show it: `⏎` newline, `⇥` tab, `␍` carriage return (a hover or a label has no line
    breaks of its own), other unprintable characters as `<0x07>` / `<U+200B>` (plotly.js fails on some)."""
    out = []
    for c in text:
        if c in _VISIBLE:
            out.append(_VISIBLE[c])
        elif c.isprintable() or c == " ":
            out.append(c)
        else:
            out.append(f"<0x{ord(c):02X}>" if ord(c) < 0x100 else f"<U+{ord(c):04X}>")
    return "".join(out)


def shown_token(token: str) -> str:
    """A token as figures and pages show it: `shown_text`, and `␣` for each space (a leading space is
    most of what tells ` the` from `the`)."""
    return shown_text(token).replace(" ", "␣")


def plotly_text(text: str) -> str:
    """Any string made safe for plotly (titles, axis labels, cell text, hovers) without changing what it
    shows: `&`, `<`, `>` become the entities plotly.js decodes; quotes stay quotes."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def html_text(text: str) -> str:
    """Any string made safe for HTML (element text and quoted attributes)."""
    return html.escape(str(text), quote=True)


def figure_token(token: str) -> str:
    """A token for a plotly figure: whitespace visible, escaped for plotly."""
    return plotly_text(shown_token(token))


def html_token(token: str) -> str:
    """A token for an HTML page: whitespace visible, HTML-escaped."""
    return html_text(shown_token(token))


def position_labels(strings: Sequence[str]) -> list[str]:
    """One plotly axis label per position: the token shown, then its position (`␣the (3)`), so equal
    tokens stay apart (plotly merges equal categories)."""
    return [f"{figure_token(s)} ({pos})" for pos, s in enumerate(strings)]


def plain_length(label: str) -> int:
    """How many characters a plotly label shows (its entities count one each)."""
    return len(html.unescape(re.sub(r"<[^<>]*>", "", label)))


# ---- sizes --------------------------------------------------------------------------------------------
CHAR_PX = 6.6  # a character of plotly's default font at 11 px, on average (digits and lower case)
TITLE_CHAR_PX = 8.6  # at the 17 px title font
LINE_PX = 24  # one line of title
TITLE_TOP_PX = 30  # the title starts below plotly's mode bar


def fitted(text: str, cell_px: float, char_px: float = CHAR_PX) -> str:
    """`text` (plotly-escaped) if it fits in `cell_px`, else its head and `…`, or nothing when even that
    does not fit: cell text only where it can be read; the hover keeps all of it."""
    room = int((cell_px - 4) // char_px)
    plain = html.unescape(text)
    if len(plain) <= room:
        return text
    return plotly_text(plain[:room - 1]) + "…" if room >= 3 else ""


def wrap(text: str, width_px: float, char_px: float = TITLE_CHAR_PX) -> str:
    """A plotly title broken into lines (`<br>`) that fit `width_px`: plotly never wraps a title and
    cuts off what does not fit. Lines given as `<br>` are kept; a `<sup>...</sup>` line is wrapped at
    its smaller size, inside its tags; a line with other tags is left whole. Text is plotly-escaped."""
    lines = []
    for line in text.split("<br>"):
        sup = line.startswith("<sup>") and line.endswith("</sup>")
        inner = line[5:-6] if sup else line
        if "<" in inner:
            lines.append(line)
            continue
        room = max(12, int(width_px / (char_px * (0.7 if sup else 1.0))))
        pieces = [plotly_text(p) for p in textwrap.wrap(html.unescape(inner), room, break_long_words=True)] or [""]
        lines += [f"<sup>{p}</sup>" if sup else p for p in pieces]
    return "<br>".join(lines)


def title_lines(text: str) -> int:
    return text.count("<br>") + 1


def titled(fig, title: str, width_px: float, *, top: float = 0.0):
    """Set `title` wrapped to the figure's width, below the mode bar, with a top margin that has room for
    its lines (plus `top` more, e.g. for tick labels drawn above the plot). The figure's height is set."""
    text = wrap(title, width_px - 40)
    height = fig.layout.height or 450
    fig.update_layout(title=dict(text=text, x=0.01, xanchor="left", yref="container", y=1 - TITLE_TOP_PX / height,
                                 yanchor="top"),
                      margin=dict(t=int(TITLE_TOP_PX + 12 + LINE_PX * title_lines(text) + top)))
    return fig

TICK_CHAR_PX = 6.2  # a character of a 10-11 px tick label


def grid_layout(fig, title: str, *, x_labels: Sequence[str], y_labels: Sequence[str], cell_w: float, cell_h: float,
                x_title: str, y_title: str, x_rotated: bool = True, x_top: bool = False, right: int = 110,
                min_width: int = 420, extra_top: int = 0):
    """Size a heatmap so every cell is `cell_w` x `cell_h` px whatever the number of cells (the page scrolls
    sideways instead of squeezing), with margins from the tick labels' lengths and the title wrapped
    to the width. `x_top` draws the x labels above the plot (then the title sits over them); `extra_top`
    leaves more room under the title (for subplot titles)."""
    y_room = max((plain_length(y) for y in y_labels), default=1) * TICK_CHAR_PX
    x_room = max((plain_length(x) for x in x_labels), default=1) * TICK_CHAR_PX if x_rotated else 18
    left = int(y_room + 50)
    width = max(min_width, int(left + cell_w * len(x_labels) + right))
    text = wrap(title, width - 40)
    head = TITLE_TOP_PX + 12 + LINE_PX * title_lines(text)
    top = head + extra_top + (x_room + 40 if x_top else 0)
    bottom = 30 if x_top else x_room + 50
    height = int(top + cell_h * len(y_labels) + bottom)
    fig.update_layout(title=dict(text=text, x=0.01, xanchor="left", yref="container", y=1 - TITLE_TOP_PX / height,
                                 yanchor="top"),
                      width=width, height=height, autosize=False,
                      margin=dict(l=left, r=right, t=int(top), b=int(bottom)))
    fig.update_xaxes(title=dict(text=x_title, standoff=8), tickangle=-90 if x_rotated else 0, automargin=True,
                     side="top" if x_top else "bottom", tickfont=dict(size=10))
    fig.update_yaxes(title=dict(text=y_title, standoff=8), automargin=True, tickfont=dict(size=10))
    return fig


def head_grid(values, title: str, what: str, *, extra=None, hover_format: str = ".4f", cell_px: float = 46, **colors):
    """A layer x head heatmap of `values` [layer head] (NaN: a pruned head, left blank): layer 0 at the bottom,
    every head written `L2H0` in its hover, cells `cell_px` square, the title wrapped. `extra` = (a second
    [layer head] tensor, a hover line using `%{customdata[1]...}` for it); `colors` go to go.Heatmap."""
    import plotly.graph_objects as go

    n_layer, n_head = values.shape
    names = [[head_label(l, h) for h in range(n_head)] for l in range(n_layer)]
    custom = names if extra is None else [[[names[l][h], float(extra[0][l, h])] for h in range(n_head)] for l in range(n_layer)]
    name = "%{customdata}" if extra is None else "%{customdata[0]}"
    line = "" if extra is None else "<br>" + extra[1]
    fig = go.Figure(go.Heatmap(
        z=values.float().cpu().numpy(), x=list(range(n_head)), y=list(range(n_layer)), customdata=custom,
        colorbar=dict(title=dict(text=wrap(what, 90, TICK_CHAR_PX))),
        hovertemplate=f"{name}<br>{what} %{{z:{hover_format}}}{line}<extra></extra>", **colors,
    ))
    grid_layout(fig, title, x_labels=[str(h) for h in range(n_head)], y_labels=[str(l) for l in range(n_layer)],
                cell_w=cell_px, cell_h=cell_px, x_title="head", y_title="layer", x_rotated=False, min_width=460)
    fig.update_xaxes(dtick=1)
    fig.update_yaxes(dtick=1, **LAYER_AXIS)
    return fig
