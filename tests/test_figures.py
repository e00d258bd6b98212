"""Figures read at any prompt length and speak one notation (analyses.labels): sizes, labels, ranks,
layer order and escaping asserted on the figure objects; the rendered page checked in headless Chromium."""
from __future__ import annotations

import html
import re
import shutil
import struct
import subprocess
import zlib

import pytest
import torch

import probe.analyses as A
from probe.analyses.labels import (CHAR_PX, TITLE_CHAR_PX, bytes_text, count, figure_token, parse_head, plain_length,
                             plotly_text, shown_token)
from probe.analyses.lens import CELL_MIN_PX
from probe.analyses.memories import MemoryLookup

HOSTILE = 'say "hi" & \'bye\' <b>bold</b>'  # every character plotly or HTML might take for markup


def plotly_shows(text: str) -> str:
    """What plotly.js draws for a label: its tags dropped, then only the entities it decodes decoded (amp, lt, gt,
    nbsp, and numeric; plotly.js's svg_text_utils), so `&quot;` stays `&quot;`. The oracle for `plotly_text`."""
    named = {"amp": "&", "lt": "<", "gt": ">", "nbsp": "\u00a0", "mu": "μ", "times": "×", "plusmn": "±", "deg": "°"}

    def entity(match):
        inner = match.group(1)
        if inner.startswith("#"):
            return chr(int(inner[2:], 16) if inner[1] == "x" else int(inner[1:]))
        return named.get(inner, match.group(0))

    return re.sub(r"&(#\d+|#x[\da-fA-F]+|[a-z]+);", entity, re.sub(r"<[^<>]*>", "", text))


def strings_of(fig) -> list[str]:
    """Every string a figure shows: title, axis titles and ticks, annotations, cell text, hovers."""
    found = []

    def walk(value):
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                if key not in ("hovertemplate", "texttemplate", "type", "colorscale"):
                    walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(fig.to_plotly_json())
    return found


# ---- escaping: &quot; and friends -----------------------------------------------------------------------
def test_plotly_text_shows_quotes_ampersands_and_tags_as_written():
    for text in (HOSTILE, "&quot;", "&amp;lt;", "a < b > c", "&#39;", "<script>alert(1)</script>"):
        assert plotly_shows(plotly_text(text)) == text
        assert "<" not in plotly_text(text) and ">" not in plotly_text(text)
    assert plotly_shows(figure_token(HOSTILE)) == HOSTILE.replace(" ", "␣")
    assert html.escape(HOSTILE, quote=True) != plotly_text(HOSTILE)  # what today's figures used, and showed &quot;
    assert plotly_shows(html.escape('"', quote=True)) == "&quot;"


def test_figures_show_a_hostile_prompt_as_written(tiny_model):
    tokens = tiny_model.to_tokens(HOSTILE)
    raw = "".join(A.attention_patterns(tiny_model, tokens).strings[1:])
    assert raw == HOSTILE
    figures = [A.logit_lens(tiny_model, tokens).figure(), A.attention_patterns(tiny_model, tokens).figure(layer=0, head=1),
               A.direct_logit_attribution(tiny_model, tokens, '"').figure(), A.memory_lookup(tiny_model, tokens, k=3).figure()]
    for fig in figures:
        shown = strings_of(fig)
        assert not any("&quot;" in s or "&#x27;" in s or "<b>" in s or "<script" in s for s in shown)
    lens = figures[0]
    axis = [plotly_shows(label).rsplit(" (", 1)[0] for label in lens.data[0].x]
    assert "".join(axis[1:]) == HOSTILE.replace(" ", "␣")  # each token as written, whitespace visible
    assert 'logit(")' in plotly_shows(figures[2].layout.title.text)


# ---- tokens: visible whitespace, bytes ------------------------------------------------------------------
def test_tokens_show_their_whitespace_and_partial_utf8_bytes(tiny_model):
    assert shown_token(" ") == "␣" and shown_token(" the\n") == "␣the⏎" and shown_token("\t\x07") == "⇥<0x07>"
    assert bytes_text("é".encode()[:1]) == "<0xC3>" and bytes_text("café".encode()) == "café"
    ids = tiny_model.tokenizer.encode("é", add_special_tokens=False)  # not in the tiny vocabulary's merges: one token per byte
    assert len(ids) == 2 and all("\ufffd" in s for s in tiny_model.tokenizer.token_strings(ids))
    assert A.attention_patterns(tiny_model, torch.tensor([ids])).strings == [f"<0x{b:02X}>" for b in "é".encode()]
    lens = A.logit_lens(tiny_model, tiny_model.to_tokens(" é  x"))
    labels = [plotly_shows(s) for s in lens.figure().data[0].x]
    assert "<0xC3> (2)" in labels and not any("\ufffd" in s for s in labels)
    assert any(s.startswith("␣") for s in labels)


def test_memory_cards_show_bytes_and_name_the_commands_flags(tiny_model, tiny_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("caf\u00e9 au lait, s'il vous pla\u00eet. " * 6, encoding="utf-8")
    triggers = A.top_triggers(tiny_model, str(corpus), [0], list(range(4)), k=3, context=6, progress=False)
    page = A.memory_report(tiny_model, triggers, max_cards=2, show_more="raise --max-cards")
    assert "\ufffd" not in page and "&lt;0xC3&gt;" in page
    assert "showing the first 2 of 4 neurons (raise --max-cards)" in page
    from probe.cli.memories import main

    out = tmp_path / "out"
    assert main(["--model", str(tiny_dir), "--triggers", "--corpus", str(corpus), "--layers", "0", "--neurons", "0", "1",
                 "2", "--k", "2", "--max-cards", "1", "--out", str(out), "--quiet"]) == 0
    cards = (out / "memory_cards.html").read_text(encoding="utf-8")
    assert "--max-cards" in cards and "--neurons" in cards and "max_cards=" not in cards and "neurons=" not in cards


# ---- heads: one notation --------------------------------------------------------------------------------
def test_heads_are_written_L2H0_and_read_in_every_notation(tiny_model, tokens):
    assert [parse_head(t) for t in ("L2H0", "2.0", "a2.0", "l10h11")] == [(2, 0), (2, 0), (2, 0), (10, 11)]
    with pytest.raises(ValueError, match="L2H0"):
        parse_head("2:0")
    from probe.cli.common import parse_heads

    assert parse_heads("L1H3, 0.2,a1.0", tiny_model) == [(1, 3), (0, 2), (1, 0)]
    patterns = A.attention_patterns(tiny_model, tokens[:1])
    n_layer, n_head = tiny_model.cfg.n_layers, tiny_model.cfg.n_heads
    overview = [a.text for a in patterns.figure().layout.annotations]
    assert sorted(overview) == sorted(f"L{l}H{h}" for l in range(n_layer) for h in range(n_head))
    assert [a.text for a in patterns.figure(layer=1).layout.annotations] == [f"L1H{h}" for h in range(n_head)]
    assert "L1H2" in patterns.figure(layer=1, head=2).layout.title.text
    dla = A.direct_logit_attribution(tiny_model, tokens, 5).figure("heads")
    assert dla.data[0].customdata[1][2] == "L1H2"
    effects = A.HeadAblationEffects(per_prompt=torch.rand(2, 3, 1), baseline=torch.zeros(1), method="zero", metric_name="loss")
    assert effects.to_frame().label.tolist() == ["L0H0", "L0H1", "L0H2", "L1H0", "L1H1", "L1H2"]
    assert A.Site("z", 1, head=2, pos=3).label == "z L1H2 pos 3"


# ---- layer 0 at the bottom of every layer heatmap -------------------------------------------------------
def test_layer_zero_is_at_the_bottom_of_every_layer_heatmap(tiny_model, tokens):
    scores = torch.rand(2, 4)
    figures = {
        "lens": A.logit_lens(tiny_model, tokens[:1]).figure(),
        "detector": A.HeadScores(scores=scores, kind="induction", tokens=tokens).figure(),
        "ablation": A.HeadAblationEffects(per_prompt=scores[..., None], baseline=torch.zeros(1), method="zero",
                                          metric_name="loss").figure(),
        "importance": A.HeadImportance(scores=scores, raw=scores, n_examples=1, normalized=True, metric_name="loss").figure(),
        "dla": A.direct_logit_attribution(tiny_model, tokens, 5).figure("heads"),
    }
    for name, fig in figures.items():
        # plotly draws the first row at the bottom unless the axis is reversed
        assert fig.layout.yaxis.autorange != "reversed", name
        first = fig.data[0].y[0]
        assert first in (0, "embed"), (name, first)
    grid = A.attention_patterns(tiny_model, tokens[:1]).figure()
    bottom = {}
    for trace in grid.data:  # each head's panel: the layer in its name, the panel's height from its axis
        layer = int(re.search(r"L(\d+)H", trace.hovertemplate).group(1))
        axis = "yaxis" + trace.yaxis[1:]
        bottom.setdefault(layer, grid.layout[axis].domain[0])
    assert sorted(bottom, key=bottom.get) == sorted(bottom)  # layer 0 lowest


# ---- ranks from 1, counts in the singular --------------------------------------------------------------
def test_ranks_count_from_one_everywhere(tiny_model, tokens):
    result = A.logit_lens(tiny_model, tokens[:1], target=None, k=3)
    frame = result.to_frame()
    logits = result.logits[0].float()  # [layer pos vocab]
    target = result.target[0]
    above = (logits > logits.gather(-1, target[None, :, None].expand(logits.shape[0], -1, 1))).sum(-1)  # [layer pos]
    assert frame.target_rank.tolist() == (above + 1).flatten().tolist()  # 1 = the lens's top token
    assert sorted(result.to_frame(top_k=True)["rank"].unique()) == [1, 2, 3]
    hover = result.figure().data[0].hovertext[-1][0]
    assert f"rank {int(above[-1, 0]) + 1}" in hover
    assert A.memory_lookup(tiny_model, tokens[:1], k=2).to_frame()["rank"].tolist()[:2] == [1, 2]
    assert A.value_tokens(tiny_model, 0, [1], k=2).to_frame()["rank"].tolist() == [1, 2, 1, 2]


def test_counts_are_singular_for_one(tiny_model):
    assert count(1, "prompt") == "1 prompt" and count(2, "prompt") == "2 prompts"
    title = A.direct_logit_attribution(tiny_model, "To be", 5).figure().layout.title.text.replace("<br>", " ")
    assert "mean over 1 prompt " in title and "1 prompts" not in title
    fig = A.HeadImportance(scores=torch.rand(2, 4), raw=torch.rand(2, 4), n_examples=1, normalized=True, metric_name="loss").figure()
    assert "over 1 sequence" in fig.layout.title.text and "1 sequences" not in fig.layout.title.text


# ---- sizes: grow with the prompt, text that fits, titles that wrap, spacing from the labels -------------
def plot_width(fig) -> float:
    return fig.layout.width - fig.layout.margin.l - fig.layout.margin.r


def test_position_heatmaps_grow_with_the_prompt_and_keep_their_cells(tiny_model):
    gen = torch.Generator().manual_seed(1)
    long = torch.randint(1, tiny_model.cfg.d_vocab, (1, tiny_model.cfg.n_ctx), generator=gen)
    short, full = A.logit_lens(tiny_model, long[:, :8]).figure(), A.logit_lens(tiny_model, long).figure()
    for fig, n in ((short, 8), (full, long.shape[1])):
        assert fig.layout.autosize is False and plot_width(fig) / n >= CELL_MIN_PX
        cell = plot_width(fig) / n
        heat = fig.data[0]
        for row, hover_row in zip(heat.text, heat.hovertext):
            for text, hover in zip(row, hover_row):
                assert 4 + CHAR_PX * plain_length(text) <= cell  # cell text only where it fits...
                assert plain_length(text.rstrip("…")) == 0 or plotly_shows(text).rstrip("…") in plotly_shows(hover)  # ...all in the hover
    assert full.layout.xaxis.tickangle == -90 and full.layout.margin.b >= 6 * max(plain_length(x) for x in full.data[0].x)
    patching = A.PatchingResult(sites=[A.Site("resid_pre", l, pos=p) for l in range(2) for p in range(60)],
                                patched=torch.rand(120), clean=1.0, corrupted=0.0, method="exact", metric_name="m",
                                labels=[f"t ({p})" for p in range(60)], clean_labels=[f"c ({p})" for p in range(60)],
                                sweep="resid_pre")
    fig = patching.figure()
    assert plot_width(fig) / 60 >= 14 and fig.layout.yaxis.autorange != "reversed"


def title_fits(fig) -> None:
    lines = fig.layout.title.text.split("<br>")
    for line in lines:
        size = 0.7 if line.startswith("<sup>") else 1.0
        assert plain_length(line) * TITLE_CHAR_PX * size <= fig.layout.width - 20, line
    assert fig.layout.margin.t >= 24 * len(lines)  # room above the plot for every line


def test_titles_wrap_to_the_figure_width(tiny_model):
    importance = A.HeadImportance(scores=torch.rand(2, 4), raw=torch.rand(2, 4), n_examples=8, normalized=True,
                                  metric_name="loss")
    fig = importance.figure()
    assert fig.layout.title.text.count("<br>") >= 1
    title_fits(fig)
    title_fits(A.HeadScores(scores=torch.rand(2, 4), kind="duplicate_token", tokens=torch.zeros(1, 2)).figure())
    title_fits(A.direct_logit_attribution(tiny_model, "To be", 5).figure("heads"))


def test_memory_panels_leave_room_for_their_labels(tiny_model, tokens):
    lookup = A.memory_lookup(tiny_model, tokens[:1], k=6)
    fig = lookup.figure()
    paper = fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
    longest = max(plain_length(x) for trace in fig.data for x in trace.x)
    for upper, lower in zip(range(1, len(fig.data)), range(2, len(fig.data) + 1)):
        above = fig.layout[f"yaxis{'' if upper == 1 else upper}"].domain[0]
        below = fig.layout[f"yaxis{lower}"].domain[1]
        # the upper panel's rotated labels (about 5.5 px a character at 10 px) and the lower panel's title
        assert (above - below) * paper >= 5.5 * longest + 20
    assert fig.layout.xaxis.tickangle == -90


def test_memory_lookup_built_by_hand_spaces_long_labels(tiny_model, tokens):
    lookup = A.memory_lookup(tiny_model, tokens[:1], k=2)
    long = MemoryLookup(**{**lookup.__dict__, "top_token_strings": [[["x" * 30] * 3] * 2] * len(lookup.layers)})
    short = MemoryLookup(**{**lookup.__dict__, "top_token_strings": [[["x"] * 3] * 2] * len(lookup.layers)})
    gap = lambda fig: fig.layout.yaxis.domain[0] - fig.layout.yaxis2.domain[1]  # noqa: E731
    assert gap(long.figure()) * long.figure().layout.height > gap(short.figure()) * short.figure().layout.height + 300


# ---- the report: no local paths, no empty section; rendered in Chromium ---------------------------------
def png_colours(path) -> int:
    """How many distinct pixel values a (non-interlaced, 8-bit RGB/RGBA) PNG has: 1 means a blank page."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks.append(body)
        pos += 12 + length
    width, height, depth, colour = header[:4]
    channels = {2: 3, 6: 4}[colour]
    raw = zlib.decompress(b"".join(chunks))
    stride = width * channels + 1
    rows = [raw[i * stride + 1:(i + 1) * stride] for i in range(0, height, 7)]  # filtered rows: distinct bytes suffice
    return len({bytes(row[j:j + channels]) for row in rows for j in range(0, len(row), channels * 5)})


def test_report_names_no_local_path_and_says_how_to_get_patching():
    from probe.bundled import DEFAULT_MODEL
    from probe.cli.report import shown_path

    assert "/" not in shown_path(DEFAULT_MODEL).replace("…/", "") and "tiny-shakespeare" in shown_path(DEFAULT_MODEL)
    assert shown_path("/home/me/models/gpt2-ft") == "…/gpt2-ft" and shown_path("gpt2") == "gpt2"


def test_report_page_names_no_local_path_writes_heads_once_and_explains_patching(tiny_dir, tmp_path, monkeypatch):
    from probe.cli.report import main

    out = tmp_path / "report"
    assert main(["--model", str(tiny_dir), "--prompt", "To be, or not to be", "--skip", "memories", "importance",
                 "--out", str(out), "--quiet"]) == 0
    page = (out / "report.html").read_text(encoding="utf-8")
    assert str(tiny_dir) not in page and str(tmp_path) not in page and f"…/{tiny_dir.name}" in page
    notes = re.findall(r"strongest [a-z-]+ head: (\S+) ", page)
    assert len(notes) == 4 and all(re.fullmatch(r"L\d+H\d+", n) for n in notes)
    patching = re.search(r'<section id="patching">(.*?)</section>', page, flags=re.S).group(1)
    assert "--corrupted" in patching and len(re.sub(r"<[^>]*>", "", patching)) > 60  # not an empty heading
    prediction = re.search(r'<section id="prompt">(.*?)</section>', page, flags=re.S).group(1)
    assert "␣" in prediction  # the predicted tokens' leading spaces are visible


@pytest.mark.slow
def test_report_of_the_bundled_model_at_n_ctx_renders_in_chromium(bundled_model, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    from probe import HELDOUT_TEXT
    from probe.cli.report import Report, figure_html

    ids = bundled_model.to_tokens(HELDOUT_TEXT.read_text(encoding="utf-8")[:4000])[:, :244]
    hostile = bundled_model.to_tokens(HOSTILE)
    report = Report("figures")
    lens = A.logit_lens(bundled_model, ids)
    report.section("lens", "Logit lens").append(figure_html(lens.figure()))
    report.section("attention", "Attention").append(figure_html(A.attention_patterns(bundled_model, ids).figure()))
    report.section("memories", "Memories").append(figure_html(A.memory_lookup(bundled_model, hostile, k=4).figure()))
    report.section("hostile", "Hostile").append(figure_html(A.logit_lens(bundled_model, hostile).figure()))
    imp = A.HeadImportance(scores=torch.rand(4, 6), raw=torch.rand(4, 6), n_examples=8, normalized=True, metric_name="loss")
    report.section("importance", "Importance").append(figure_html(imp.figure()))
    page = tmp_path / "report.html"
    page.write_text(report.render(), encoding="utf-8")
    shot = tmp_path / "shot.png"
    result = subprocess.run([chromium, "--headless", "--no-sandbox", "--enable-logging=stderr", "--v=0",
                             f"--screenshot={shot}", "--window-size=1000,900", page.as_uri()],
                            capture_output=True, text=True, timeout=180)
    console = [line for line in result.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console
    assert png_colours(shot) > 20  # drawn, not one colour
    dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=180).stdout
    def texts_of(part: str) -> list[str]:
        svg = " ".join(re.findall(r"<svg.*?</svg>", part, flags=re.S))
        return [html.unescape(re.sub(r"<[^>]*>", "", t)) for t in re.findall(r"<text[^>]*>(.*?)</text>", svg, flags=re.S)]

    figures = dom.split('class="plotly-graph-div')[1:]
    assert len(figures) == 5
    long_ticks = texts_of(figures[0])
    assert "<|endoftext|> (0)" in long_ticks and any(t.endswith(" (243)") for t in long_ticks)  # every column labelled
    texts = [t for part in figures for t in texts_of(part)]
    joined = " ".join(texts)
    assert "&quot;" not in joined and "&#x27;" not in joined and "&amp;" not in joined
    n = hostile.shape[1]
    ticks = {int(m.group(2)): m.group(1) for t in texts_of(figures[3]) if (m := re.fullmatch(r"(.*) \((\d+)\)", t))}
    # the hostile prompt's lens: its tick labels, in order, are the prompt as written (quotes, & and <b> included)
    assert "".join(ticks[p] for p in range(1, n)) == HOSTILE.replace(" ", "␣")


def test_results_show_their_table_in_jupyter(tiny_model, tokens):
    """A notebook cell ending in a result shows its tidy table: `_repr_html_` is the frame's own HTML."""
    from probe.analyses import attention_patterns, head_scores, logit_lens

    for result in (logit_lens(tiny_model, tokens), head_scores(tiny_model, "previous_token", tokens),
                   attention_patterns(tiny_model, tokens[0])):
        assert result._repr_html_() == result.to_frame()._repr_html_()
        assert "<table" in result._repr_html_()
