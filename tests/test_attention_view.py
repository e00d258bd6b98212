"""The interactive attention view: its data are the model's attention weights, its tokens show as written."""
from __future__ import annotations

import html
import json
import re
import shutil
import subprocess

import pytest
import torch

from probe.analyses import AttentionView, attention_view
from probe.analyses.attention_view import DIGITS

HOSTILE = "To be </script><script>alert('x')</script> & \"q\" <b>x</b>"


def embedded(fragment: str) -> dict:
    """The JSON the page's script reads, parsed as the browser would (the `<\\/` is JSON's own escape)."""
    found = re.search(r'<script type="application/json" class="pa-data">(.*?)</script>', fragment, re.S)
    return json.loads(found.group(1))


def test_the_embedded_weights_are_the_models_attention_pattern(tiny_model):
    prompt = "To be, or not to be, that is"
    view = attention_view(tiny_model, prompt)
    data = embedded(view.to_html())
    _, cache = tiny_model.run_with_cache(prompt, names=lambda name: name.endswith("hook_pattern"))
    n = tiny_model.to_tokens(prompt).shape[1]
    assert data["layers"] == list(range(tiny_model.cfg.n_layers)) and data["labels"][1][2] == "L1H2"
    for layer in range(tiny_model.cfg.n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"][0]  # [head query_pos key_pos]
        for head in range(tiny_model.cfg.n_heads):
            rows = data["rows"][layer][head]
            assert [len(r) for r in rows] == list(range(1, n + 1))  # the causal part of each row only
            for q in range(n):
                torch.testing.assert_close(torch.tensor(rows[q]), pattern[head, q, :q + 1].float(),
                                           atol=0.5 * 10 ** -DIGITS + 1e-7, rtol=0)


def test_a_hostile_token_shows_as_written_and_cannot_end_the_script(tiny_model):
    view = attention_view(tiny_model, HOSTILE)
    fragment = view.to_html()
    # three script elements: the JSON, the code, and nothing a token could open or close
    assert fragment.count("<script") == 2 and fragment.count("</script>") == 2
    data = embedded(fragment)
    assert data["tokens"][0] == "<|endoftext|>"
    assert "".join(data["tokens"][1:]) == HOSTILE.replace(" ", "␣")  # every character as typed, spaces visible
    assert "alert('x')" not in re.sub(r'<script type="application/json".*?</script>', "", fragment, flags=re.S)
    assert view._repr_html_().startswith('<div class="probe-attn"')


def test_a_pruned_models_missing_heads_are_marked(tiny_model, tmp_path):
    from probe.analyses import prune_heads

    pruned = prune_heads(tiny_model, [(0, 1), (0, 3)])
    data = attention_view(pruned, "To be, or not").data()
    # a structurally pruned layer keeps its heads first: layer 0 has two heads left, numbered 0 and 1
    assert [r is None for r in data["rows"][0]] == [False, False, True, True]
    assert all(r is not None for r in data["rows"][1])


def hovered_in_chromium(view, layer: int, head: int, position: int, tmp_path) -> subprocess.CompletedProcess:
    """The DOM of `view`'s page after choosing `layer` and `head` and hovering token `position`, in headless
    Chromium (the test skips where it is not installed)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    page = view.to_html(full_html=True).replace("</body>", (
        '<script>var r = document.querySelector(".probe-attn");'
        f'r.querySelector(".pa-layer").value = "{layer}"; r.querySelector(".pa-layer").dispatchEvent(new Event("change"));'
        f'r.querySelector(".pa-head").value = "{head}"; r.querySelector(".pa-head").dispatchEvent(new Event("change"));'
        f'r.querySelectorAll(".pa-tok")[{position}].dispatchEvent(new MouseEvent("mouseenter"));</script></body>'))
    path = tmp_path / "view.html"
    path.write_text(page, encoding="utf-8")
    return subprocess.run([chromium, "--headless", "--no-sandbox", "--enable-logging=stderr", "--v=0", "--dump-dom",
                           path.as_uri()], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_the_view_in_chromium_hovered_shows_the_hovered_tokens_row(tiny_model, tmp_path):
    layer, head, position = 1, 2, 6
    result = hovered_in_chromium(attention_view(tiny_model, HOSTILE), layer, head, position, tmp_path)
    console = [line for line in result.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console
    spans = re.findall(r'<span class="pa-tok[^"]*"[^>]*data-weight="([0-9.]+)"[^>]*>(.*?)</span>', result.stdout)
    _, cache = tiny_model.run_with_cache(HOSTILE, names=[f"blocks.{layer}.attn.hook_pattern"])
    expected = cache[f"blocks.{layer}.attn.hook_pattern"][0, head, position].float()
    assert len(spans) == len(expected)
    torch.testing.assert_close(torch.tensor([float(w) for w, _ in spans]), expected, atol=1e-4, rtol=0)
    assert "".join(html.unescape(text) for _, text in spans[1:]) == HOSTILE.replace(" ", "␣")
    info = re.search(r'<div class="pa-info">(.*?)</div>', result.stdout).group(1)
    best = int(expected.argmax())
    assert info.startswith(f"L{layer}H{head}: ") and f"attends most to" in info and f"({best}), weight" in info
