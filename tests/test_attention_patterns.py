"""attention_patterns: weights against transformers' output_attentions; figures: mask, labels, escaping, size."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

import probe.analyses.attention as attention_module
from probe.analyses import attention_patterns
from probe.analyses.common import token_labels

PROMPT = "To be, or not to be, that is the question: <script>alert('x')</script> & the dog"


def hf_attentions(hf, tokens):
    with torch.no_grad():
        return torch.stack(hf(tokens, output_attentions=True).attentions)[:, 0]  # [layer head query_pos key_pos]


def test_patterns_match_transformers(tiny_model, tiny_hf):
    result = attention_patterns(tiny_model, PROMPT)
    tokens = tiny_model.to_tokens(PROMPT)
    expected = hf_attentions(tiny_hf, tokens)
    assert result.pattern.shape == expected.shape
    torch.testing.assert_close(result.pattern, expected, atol=1e-5, rtol=1e-4)
    assert result.labels == token_labels(tiny_model, tokens)


def test_layer_and_head_selection_picks_those(tiny_model, tiny_hf, tokens):
    result = attention_patterns(tiny_model, tokens[1], layers=[1], heads=[3, 0])
    expected = hf_attentions(tiny_hf, tokens[1:2])
    torch.testing.assert_close(result.pattern[0, 0], expected[1, 3], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(result.pattern[0, 1], expected[1, 0], atol=1e-5, rtol=1e-4)


def test_frame_has_one_row_per_allowed_pair(tiny_model, tiny_hf, tokens):
    result = attention_patterns(tiny_model, tokens[0])
    frame = result.to_frame()
    n = tokens.shape[1]
    assert len(frame) == tiny_model.cfg.n_layers * tiny_model.cfg.n_heads * n * (n + 1) // 2
    assert (frame.key_pos <= frame.query_pos).all()
    expected = hf_attentions(tiny_hf, tokens[:1])
    row = frame[(frame["layer"] == 1) & (frame["head"] == 2) & (frame.query_pos == 9) & (frame.key_pos == 4)]
    assert row.weight.item() == pytest.approx(float(expected[1, 2, 9, 4]), abs=1e-6)
    strings = tiny_model.tokenizer.token_strings(tokens[0].tolist())
    assert (row.query_token.item(), row.key_token.item()) == (strings[9], strings[4])


def test_frame_holds_raw_token_strings_not_html(tiny_model):
    """Labels are escaped for plotly; a CSV of the frame must hold the text itself."""
    text = "a <b> & c"
    result = attention_patterns(tiny_model, text)
    frame = result.to_frame()
    ids = tiny_model.to_tokens(text)[0].tolist()
    last_row = frame[(frame.layer == 0) & (frame["head"] == 0) & (frame.query_pos == len(ids) - 1)]
    assert "".join(last_row.key_token) == tiny_model.tokenizer.decode(ids)
    assert not frame.key_token.str.contains("&lt;|&amp;").any()


def test_head_heatmap_shows_causal_mask_and_tokens(tiny_model):
    result = attention_patterns(tiny_model, PROMPT)
    fig = result.figure(layer=1, head=2)
    z = torch.tensor(fig.data[0].z, dtype=torch.float64)
    n = z.shape[0]
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    assert torch.isnan(z[future]).all() and not torch.isnan(z[~future]).any()
    shown = result.pattern[1, 2].double()  # rows are queries, columns keys: the layer's own head, not transposed
    torch.testing.assert_close(z[~future], shown[~future], atol=1e-6, rtol=0)
    assert list(fig.data[0].x) == result.labels and list(fig.data[0].y) == result.labels
    assert "query" in fig.data[0].hovertemplate and "key" in fig.data[0].hovertemplate
    assert fig.layout.yaxis.autorange == "reversed"  # query tokens run down the page


@pytest.mark.parametrize("where", [dict(layer=1, head=0), dict(layer=0), dict()])
def test_token_strings_are_escaped_in_figures(tiny_model, where):
    fig = attention_patterns(tiny_model, PROMPT).figure(**where)
    text = json.dumps(fig.to_plotly_json(), default=str)
    # the tiny tokenizer splits the tag into '<', 'script', '>', '</': each must reach plotly escaped
    markup = re.sub(r"<br>|</?extra>", "", text)
    assert "<" not in markup and ">" not in markup
    assert re.search(r"&(?!lt;|gt;|amp;|quot;|#x27;)", markup) is None
    assert "&lt;" in text and "&amp;" in text  # the tokens are still there, as text


def test_layer_grid_and_overview_have_one_panel_per_head(tiny_model):
    result = attention_patterns(tiny_model, PROMPT)
    cfg = tiny_model.cfg
    assert len(result.figure(layer=0).data) == cfg.n_heads
    assert len(result.figure().data) == cfg.n_layers * cfg.n_heads


def test_long_prompt_figure_grows_then_drops_labels(tiny_model, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    long = torch.randint(0, tiny_model.cfg.d_vocab, (tiny_model.cfg.n_ctx,), generator=gen)
    short_fig = attention_patterns(tiny_model, long[:8]).figure(layer=0, head=0)
    long_fig = attention_patterns(tiny_model, long).figure(layer=0, head=0)
    def plot_height(fig):
        return fig.layout.height - fig.layout.margin.t

    assert plot_height(long_fig) - plot_height(short_fig) == attention_module.CELL_PX * (len(long) - 8)
    assert long_fig.layout.xaxis.showticklabels is True
    monkeypatch.setattr(attention_module, "MAX_LABELLED_TOKENS", 20)
    capped = attention_patterns(tiny_model, long).figure(layer=0, head=0)
    assert capped.layout.xaxis.showticklabels is False and capped.layout.yaxis.showticklabels is False


def test_grid_pools_long_prompts_by_block_maximum(tiny_model, monkeypatch):
    monkeypatch.setattr(attention_module, "GRID_CELLS", 10)
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, tiny_model.cfg.d_vocab, (45,), generator=gen)
    result = attention_patterns(tiny_model, tokens)
    z = torch.tensor(result.figure(layer=1).data[2].z, dtype=torch.float64)
    size = math.ceil(45 / 10)
    assert z.shape == (math.ceil(45 / size),) * 2
    pattern = result.pattern[1, 2].double()
    for qb, kb in [(0, 0), (3, 1), (8, 8), (8, 0), (5, 5)]:  # brute force the block's maximum
        block = pattern[qb * size:(qb + 1) * size, kb * size:(kb + 1) * size]
        assert z[qb, kb].item() == pytest.approx(block.max().item(), abs=1e-6)
    assert torch.isnan(z[0, 1]) and torch.isnan(z[3, 8])  # blocks wholly in the future stay empty


def test_bad_inputs_say_what_to_do(tiny_model, tokens):
    with pytest.raises(ValueError, match="one prompt"):
        attention_patterns(tiny_model, tokens)
    with pytest.raises(ValueError, match="layers"):
        attention_patterns(tiny_model, tokens[0], layers=[tiny_model.cfg.n_layers])
    with pytest.raises(ValueError, match="give the layer"):
        attention_patterns(tiny_model, tokens[0]).figure(head=1)


def test_pruned_heads_show_as_missing():
    from probe import DecoderConfig, HookedDecoder

    cfg = DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=24, heads_per_layer=(4, 1))
    result = attention_patterns(HookedDecoder(cfg).eval(), torch.arange(10))
    assert result.pattern[1, 1:].isnan().all() and not result.pattern[1, 0].tril().isnan().any()
    assert len(result.to_frame()) == 5 * 10 * 11 // 2
    with pytest.raises(ValueError, match="no head 2"):
        result.figure(layer=1, head=2)
    assert len(result.figure().data) == 8
