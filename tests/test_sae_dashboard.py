"""Feature dashboards (`analyses.feature_scan`, `analyses.sae_dashboard`, `probe sae dashboard`): the scan against a
brute-force pass (each window run alone, the features encoded by hand in float64, sorted), densities and
histograms counted by hand, the page's escaping and its search box (headless Chromium)."""
from __future__ import annotations

import html
import math
import re
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest
import torch

from probe.analyses.feature_scan import BINS, feature_scan
from probe.analyses.labels import token_texts
from probe.analyses.sae_dashboard import feature_dashboard
from test_cli import run_cli
from test_sae import D_SAE, by_hand, random_sae, random_transcoder

CORPUS = [
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 2,  # several windows at window=12
    "To be, or not to be, that is the question.",
    "<script>alert('x')</script> & other <b>markup</b> should stay text.",
    "When in the course of human events it becomes necessary for one people to dissolve the bands.",
]


def brute_force(model, sae, docs, features, window, before, after, max_tokens=None):
    """Per feature, every scanned token's activation and each active one's (value, doc, position, context ids,
    context activations), from each window run alone (BOS first, no padding) and `by_hand` in float64. A
    document's first window counts all of BOS + window - 1 tokens; each later one starts `before` tokens (at most
    half the window) before the first token it counts."""
    tokenizer, hook, per_window = model.tokenizer, sae.cfg.hook_name, window - 1
    overlap = min(before, per_window // 2)
    values = {f: [] for f in features}
    active = {f: [] for f in features}
    left = math.inf if max_tokens is None else max_tokens
    for d, text in enumerate(docs):
        ids = tokenizer.encode(text, add_special_tokens=False)[:max(left, 0)] if left < math.inf else tokenizer.encode(text, add_special_tokens=False)
        left -= len(ids)
        counted_from = [0] + list(range(per_window, len(ids), per_window - overlap))
        for first in counted_from:
            start = max(first - overlap, 0)
            chunk = ids[start:start + per_window]
            with torch.no_grad():
                _, cache = model.run_with_cache(torch.tensor([[tokenizer.bos_id] + chunk]), names=hook)
            x = cache[hook][0, 1:].flatten(1)  # BOS dropped; hook_z's heads flattened
            acts = by_hand(sae, x)[0][:, features].T.tolist()  # [feature pos]
            for f, column in zip(features, acts):
                values[f] += column[first - start:]
                for p, value in enumerate(column):
                    if value > 0 and p >= first - start:
                        span = range(p - before, p + after + 1)
                        inside = [0 <= q < len(chunk) for q in span]
                        active[f].append((value, d, start + p, [chunk[q] if i else -1 for q, i in zip(span, inside)],
                                          [column[q] if i else math.nan for q, i in zip(span, inside)]))
    return values, {f: sorted(rows, key=lambda e: (-e[0], e[1], e[2])) for f, rows in active.items()}


@pytest.mark.parametrize("make, features, window, max_tokens", [
    (lambda: random_sae(seed=21), [3, 17, 50, 88], 12, None),  # windows cut the documents
    (lambda: random_transcoder(layer=1, skip=True, architecture="topk", seed=4), None, None, None),  # all 96 features
    (lambda: random_sae("jumprelu", hook="blocks.1.attn.hook_z", seed=6), [1, 2, 60], 16, 40),  # stops inside doc 1
])
def test_the_scan_equals_a_brute_force_pass(tiny_model, make, features, window, max_tokens):
    sae, k, before, after = make(), 4, 3, 2
    args = dict(k=k, window=window, batch_size=3, before=before, after=after, progress=False)
    scan = feature_scan(tiny_model, sae, CORPUS, features, **args, **({"max_tokens": max_tokens} if max_tokens else {}))
    features = list(range(D_SAE)) if features is None else features
    values, expected = brute_force(tiny_model, sae, CORPUS, features, window or tiny_model.cfg.n_ctx, before, after,
                                   max_tokens)
    n_tokens = len(values[features[0]])
    assert scan.features.tolist() == features and scan.n_tokens == n_tokens
    if max_tokens:
        assert n_tokens == max_tokens
    for fi, f in enumerate(features):
        column = np.array(values[f])
        on = column[column > 0]
        width = float(scan.bin_width[fi])
        if len(on):
            assert math.frexp(width)[0] == 0.5 and BINS * width > on.max() >= BINS * width / 2  # a power of two, snug
            # the oracle is float64, the scan float32: no value may sit where rounding could move it across an edge
            assert np.abs(on / width - np.round(on / width)).min() > 1e-4, "the test data needs another seed"
        assert int(scan.active[fi]) == len(on)
        assert float(scan.active_sum[fi]) == pytest.approx(on.sum(), abs=1e-4)
        assert scan.histogram[fi].tolist() == np.histogram(on, bins=np.arange(BINS + 1) * width)[0].tolist()
        rows = expected[f][:k]
        got = [(d, p) for d, p in zip(scan.top_docs[fi].tolist(), scan.top_positions[fi].tolist()) if d >= 0]
        assert got == [(e[1], e[2]) for e in rows], f
        filled = len(rows)
        torch.testing.assert_close(scan.top_activations[fi, :filled].double(), torch.tensor([e[0] for e in rows],
                                   dtype=torch.float64).reshape(-1), atol=1e-5, rtol=0)
        assert bool((scan.top_activations[fi, filled:] == 0).all()) and bool((scan.top_docs[fi, filled:] == -1).all())
        assert scan.context_ids[fi, :filled].tolist() == [e[3] for e in rows]
        torch.testing.assert_close(scan.context_activations[fi, :filled].double(),
                                   torch.tensor([e[4] for e in rows], dtype=torch.float64).reshape(filled, before + 1 + after),
                                   atol=1e-5, rtol=0, equal_nan=True)
    assert any(len(expected[f]) > k for f in features)  # a real choice of the top k somewhere
    densities = scan.densities_frame()
    assert densities.density.tolist() == pytest.approx([sum(v > 0 for v in values[f]) / n_tokens for f in features])
    contexts = scan.contexts_frame()
    assert (contexts.offset == 0).sum() == int((scan.top_docs >= 0).sum())  # one trigger row per filled context
    assert contexts.token.tolist() == token_texts(tiny_model.tokenizer, contexts.token_id.tolist())
    assert contexts["rank"].min() == 1


def test_ties_between_documents_keep_corpus_order(tiny_model):
    """Two copies of a document, each a window run alone (batch_size=1), tie at every token: the kept contexts are
    ordered as brute force sorts them, (activation desc, document, position), the first copy's before the second's."""
    sae, features, docs = random_sae(seed=21), [3, 17, 50, 88], [CORPUS[3], CORPUS[3], CORPUS[1]]
    scan = feature_scan(tiny_model, sae, docs, features, k=6, batch_size=1, before=3, after=2, progress=False)
    _, expected = brute_force(tiny_model, sae, docs, features, tiny_model.cfg.n_ctx, 3, 2)
    tied = 0
    for fi, f in enumerate(features):
        rows = expected[f][:6]
        got = [(d, p) for d, p in zip(scan.top_docs[fi].tolist(), scan.top_positions[fi].tolist()) if d >= 0]
        assert got == [(e[1], e[2]) for e in rows], f
        assert scan.context_ids[fi, :len(rows)].tolist() == [e[3] for e in rows]
        values = scan.top_activations[fi, :len(rows)].tolist()
        tied += sum(a == b and (d0, d1) == (0, 1) for a, b, (d0, _), (d1, _) in zip(values, values[1:], got, got[1:]))
    assert tied >= 4  # exact ties, copy 0 then copy 1, in most features' top-k


def test_a_dashboard_of_the_top_features_is_of_those_active_most_often(tiny_model):
    sae = random_sae("topk", hook="blocks.1.hook_resid_pre", seed=9)
    dashboard = feature_dashboard(tiny_model, sae, CORPUS, top=5, k=3, n_tokens=4, progress=False)
    values, _ = brute_force(tiny_model, sae, CORPUS, list(range(D_SAE)), tiny_model.cfg.n_ctx, 20, 5)
    counts = {f: sum(v > 0 for v in column) for f, column in values.items()}
    assert dashboard.features.tolist() == sorted(counts, key=lambda f: (-counts[f], f))[:5]
    assert dashboard.scan.active.tolist() == [counts[f] for f in dashboard.features.tolist()]
    assert dashboard.logits is not None and dashboard.inputs is not None  # the residual stream: both views
    frames = dashboard.frames()
    assert set(frames) == {"contexts", "densities", "histograms", "logits", "inputs"}
    assert frames["densities"].feature.tolist() == dashboard.features.tolist()
    assert set(frames["contexts"].feature) == set(dashboard.features.tolist())
    with pytest.raises(ValueError, match="give features .* or top"):
        feature_dashboard(tiny_model, sae, CORPUS, [1], top=2, progress=False)
    for bad, match in ((dict(top=0), r"top=0 must be an integer in \[1, d_sae=96\]"),
                       (dict(features=[96]), r"feature 96 is outside"), (dict(features=[1], k=0), "k=0 must be"),
                       (dict(features=[1], window=1), r"window=1 must be an integer in \[2, n_ctx=48\]"),
                       (dict(features=[1], n_tokens=0), "n_tokens=0 must be")):
        with pytest.raises(ValueError, match=match):
            feature_dashboard(tiny_model, sae, CORPUS, progress=False, **bad)


def test_the_default_dashboard_of_an_sae_narrower_than_the_default_top_shows_every_feature(tiny_model, tmp_path,
                                                                                        capsys, tiny_dir):
    """The default top 20 on an SAE of 6 features: the library noted "only 6 features are active" when all were, and
    `probe sae dashboard` passed 20 itself and was refused; both now show every feature, most often active first."""
    from probe import SAEConfig, SparseAutoencoder
    from test_sae import randomised

    sae = randomised(SparseAutoencoder(SAEConfig(d_in=64, d_sae=6, hook_name="blocks.1.hook_resid_pre")), 3,
                     lambda name: 0.3, 0.0)
    with torch.no_grad():
        sae.b_enc.abs_().add_(1.0)  # every feature fires somewhere
    dashboard = feature_dashboard(tiny_model, sae, CORPUS, k=3, n_tokens=4, progress=False)
    values, _ = brute_force(tiny_model, sae, CORPUS, list(range(6)), tiny_model.cfg.n_ctx, 20, 5)
    counts = {f: sum(v > 0 for v in column) for f, column in values.items()}
    active = sorted((f for f in counts if counts[f]), key=lambda f: (-counts[f], f))
    assert len(active) == 6 and dashboard.features.tolist() == active
    assert not any("only" in note for note in dashboard.notes), dashboard.notes
    corpus = tmp_path / "plays.txt"
    corpus.write_text(" ".join(CORPUS), encoding="utf-8")
    code, _, err = run_cli(capsys, "sae", "dashboard", "--model", str(tiny_dir), "--sae",
                           str(sae.save_pretrained(tmp_path / "sae")), "--corpus", str(corpus), "--k", "3", "--quiet",
                           "--out", str(tmp_path / "out"))
    assert code == 0, err
    assert pd.read_csv(tmp_path / "out" / "densities.csv").feature.tolist() == active


def hostile_dashboard(tiny_model):
    """A transcoder's dashboard whose token strings and document name are markup (the tiny tokenizer has no such
    tokens: they are written into the result, where any tokenizer's strings would be)."""
    sae = random_transcoder(layer=0, seed=2)
    dashboard = feature_dashboard(tiny_model, sae, CORPUS, [5, 11, 40], k=3, n_tokens=3, progress=False)
    scan = dashboard.scan
    filled = [fi for fi in range(3) if int(scan.top_docs[fi, 0]) >= 0]
    assert filled, "no feature fired: pick other features"
    scan.context_strings[filled[0]][0][scan.before] = "<script>alert(1)</script>"
    dashboard.logits.token_strings[0][0] = '"&'
    dashboard.inputs.token_strings[1][0] = "<b>bold</b>\n"
    scan.doc_names[int(scan.top_docs[filled[0], 0])] = "<i>name</i>"
    return dashboard


def test_the_page_shows_every_feature_and_every_string_as_written(tiny_model):
    from html.parser import HTMLParser

    dashboard = hostile_dashboard(tiny_model)
    page = dashboard.to_html()
    assert dashboard.is_transcoder and "Input view" in page and "Output view" in page
    for f in (5, 11, 40):
        assert page.count(f'id="F{f}"') == 1 and f'<li data-feature="{f}"><a href="#F{f}">F{f}</a>' in page
    assert page.count("<script") == 1 and "alert(1)</script>" not in page  # only the page's own script
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&quot;&amp;" in page and "<b>bold" not in page and "&lt;b&gt;bold&lt;/b&gt;⏎" in page
    assert "&lt;i&gt;name&lt;/i&gt;" in page and "<i>" not in page
    assert "http://" not in page and "https://" not in page and "src=" not in page  # nothing from the network

    class Text(HTMLParser):  # what a browser shows: the text, entities decoded
        def __init__(self):
            super().__init__()
            self.parts, self.skip = [], False

        def handle_starttag(self, tag, attrs):
            self.skip = tag in ("script", "style")

        def handle_endtag(self, tag):
            self.skip = False

        def handle_data(self, data):
            if not self.skip:
                self.parts.append(data)

    parser = Text()
    parser.feed(page)
    shown = "".join(parser.parts)
    assert "<script>alert(1)</script>" in shown and '"&' in shown and "<b>bold</b>⏎" in shown


def test_probe_sae_dashboard_writes_what_feature_dashboard_finds(tiny_dir, tiny_model, tmp_path, capsys):
    sae = random_sae(seed=14)
    directory = sae.save_pretrained(tmp_path / "sae")
    corpus = tmp_path / "plays.txt"
    corpus.write_text(" ".join(CORPUS), encoding="utf-8")
    base = ["sae", "dashboard", "--model", str(tiny_dir), "--sae", str(directory), "--corpus", str(corpus), "--quiet"]
    code, shown, err = run_cli(capsys, *base, "--features", "3,17", "--k", "4", "--tokens", "60", "--out",
                               str(tmp_path / "out"))
    assert code == 0, err
    expected = feature_dashboard(tiny_model, sae, corpus, [3, 17], k=4, n_tokens=4, max_tokens=60, progress=False)
    for name, frame in expected.frames().items():
        written = pd.read_csv(tmp_path / "out" / f"{name}.csv", keep_default_na=False)  # a token "nan" stays text
        numbers = pd.read_csv(tmp_path / "out" / f"{name}.csv")
        assert list(written.columns) == list(frame.columns), name
        for column in frame.columns:
            if frame[column].dtype.kind == "f":
                assert numbers[column].to_numpy(dtype=float) == pytest.approx(frame[column].to_numpy(), nan_ok=True)
            else:
                assert written[column].astype(str).tolist() == frame[column].astype(str).tolist(), (name, column)
    page = (tmp_path / "out" / "dashboard.html").read_text(encoding="utf-8")
    assert 'id="F3"' in page and 'id="F17"' in page and "60 tokens of " in page
    assert "F3" in shown and "F17" in shown and "dashboard.html" in shown

    # the old command is untouched by the subcommands
    code, _, err = run_cli(capsys, "sae", "--model", str(tiny_dir), "--sae", str(directory), "--prompt", "To be",
                           "--k", "2", "--quiet", "--out", str(tmp_path / "prompt"))
    assert code == 0 and (tmp_path / "prompt" / "features.csv").is_file(), err

    for extra, message in ((["--features", "96"], "--features: feature 96 is outside"),
                           (["--top", "0"], "--top 0 must be in [1, d_sae=96]"),
                           (["--k", "0"], "--k 0 must be in [1, d_vocab_out="),
                           (["--window", "1"], "--window 1 must be in [2, n_ctx=48]"),
                           (["--corpus", str(tmp_path / "nowhere")], "does not exist")):
        out = tmp_path / f"bad{len(message)}"
        code, _, err = run_cli(capsys, *base, *extra, "--out", str(out))
        assert code == 2 and message in err, (extra, err)
        assert not out.exists()  # refused before any work
    with pytest.raises(SystemExit):  # argparse's own refusal
        run_cli(capsys, *base, "--features", "1,x")
    assert "write feature ids comma-separated, e.g. 0,5,17" in capsys.readouterr().err


def test_probe_sae_train_is_probe_train_sae(tiny_dir, tmp_path, capsys):
    """The same flags, the same run: bit-identical weights."""
    from safetensors.torch import load_file

    corpus = tmp_path / "plays.txt"
    corpus.write_text(" ".join(CORPUS) * 3, encoding="utf-8")
    flags = ["--model", str(tiny_dir), "--hook", "blocks.0.hook_resid_post", "--arch", "topk", "--k", "4", "--d-sae", "32",
             "--tokens", "768", "--batch-tokens", "128", "--buffer-tokens", "256", "--corpus", str(corpus), "--quiet"]
    for command, out in ((["sae", "train"], "a"), (["train_sae"], "b")):
        code, _, err = run_cli(capsys, *command, *flags, "--out", str(tmp_path / out))
        assert code == 0, err
    a, b = (load_file(str(tmp_path / out / "sae_weights.safetensors")) for out in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    with pytest.raises(SystemExit):
        run_cli(capsys, "sae", "train", "--help")
    assert "probe sae train" in capsys.readouterr().out


@pytest.mark.slow
def test_the_page_in_chromium_runs_without_errors_and_its_search_filters(tiny_model, tmp_path):
    from html.parser import HTMLParser

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    dashboard = hostile_dashboard(tiny_model)
    path = tmp_path / "dashboard.html"
    path.write_text(dashboard.to_html(), encoding="utf-8")

    class Elements(HTMLParser):  # the sections and index entries of the DOM Chromium dumps, and their attributes
        def __init__(self):
            super().__init__()
            self.found = []

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            if (tag == "section" and attrs.get("class") == "feature") or (tag == "li" and "data-feature" in attrs):
                self.found.append((tag, int(attrs["data-feature"]), "hidden" in attrs))

    def shown(query=None, page=path):
        """The features whose section and index entry are visible once the page's script ran (with ?q=query),
        the console's complaints, and the DOM."""
        uri = page.as_uri() + ("" if query is None else "?q=" + query)
        result = subprocess.run([chromium, "--headless", "--no-sandbox", "--enable-logging=stderr", "--v=0",
                                 "--dump-dom", uri], capture_output=True, text=True, timeout=120)
        errors = [line for line in result.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
        parser = Elements()
        parser.feed(result.stdout)
        sections = [f for tag, f, hidden in parser.found if tag == "section" and not hidden]
        entries = [f for tag, f, hidden in parser.found if tag == "li" and not hidden]
        assert sections == entries and len(parser.found) == 6
        return sections, errors, result.stdout

    visible, errors, dom = shown()
    assert visible == [5, 11, 40] and not errors, errors
    assert "3 of 3 features" in dom
    visible, errors, dom = shown("F11")
    assert visible == [11] and not errors and "1 of 3 features" in dom
    # text: the features whose contexts or token lists hold it, as the page's data says
    word = "alert(1)"
    expected = [f for f, text in zip((5, 11, 40), re.findall(r'data-search="([^"]*)"', dashboard.to_html()))
                if word in html.unescape(text)]
    visible, errors, _ = shown(word)
    assert visible == expected and 0 < len(expected) < 3 and not errors

    broken = tmp_path / "broken.html"  # the same check sees a failing script
    broken.write_text(dashboard.to_html().replace('getElementById("search")', 'getElementById("nowhere")'),
                      encoding="utf-8")
    _, errors, _ = shown(page=broken)
    assert errors
