"""Shared analysis helpers: token labels that are safe in plotly and drawable by it."""
from probe.analyses.common import escape_token, token_labels


def test_escape_token_escapes_markup_for_plotly_and_shows_whitespace():
    """escape_token is the figures' token (analyses.labels.figure_token): plotly's three entities, whitespace shown."""
    assert escape_token("<script>&") == "&lt;script&gt;&amp;"
    assert escape_token("a\nb\tc") == "a⏎b⇥c"
    assert escape_token("\x06\x7f") == "&lt;0x06&gt;&lt;0x7F&gt;"  # shows as <0x06><0x7F>
    assert escape_token(" é") == "␣é"
    assert escape_token('say "hi"') == 'say␣"hi"'  # no &quot;: plotly would show it as written


def test_token_labels_are_unique_per_position(tiny_model):
    tokens = tiny_model.to_tokens("the the the")
    labels = token_labels(tiny_model, tokens)
    assert len(labels) == len(set(labels)) == tokens.shape[1]


def test_resolve_positions_counts_real_tokens_on_either_side():
    import pytest
    import torch

    from probe.analyses.common import resolve_positions

    right = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    left = right.flip(-1)  # [[0 1 1 1 1], [0 0 0 1 1]]
    for mask in (right, right.bool()):
        assert resolve_positions(mask, -1).tolist() == [3, 1]
        assert resolve_positions(mask, 1).tolist() == [1, 1]
    for mask in (left, left.bool()):  # a long mask too: metrics receive them (~ on a long tensor is bitwise)
        assert resolve_positions(mask, -1).tolist() == [4, 4]
        assert resolve_positions(mask, 0).tolist() == [1, 3]
        assert resolve_positions(mask, -2).tolist() == [3, 3]
    with pytest.raises(ValueError, match="past the end"):
        resolve_positions(right, 2)
    full = torch.ones(2, 5, dtype=torch.bool)  # nothing padded: every prompt's positions are the tensor's
    for mask in (full, full.long()):
        assert resolve_positions(mask, -1).tolist() == [4, 4]
        assert resolve_positions(mask, 2).tolist() == [2, 2]
        assert resolve_positions(mask, -5).tolist() == [0, 0]
    with pytest.raises(ValueError, match="position=5 is past the end of a prompt with 5 tokens"):
        resolve_positions(full, 5)
    with pytest.raises(ValueError, match="position=-6 is before the start of a prompt with 5 tokens"):
        resolve_positions(full, -6)


def test_text_gets_a_bos_only_when_the_tokenizer_has_one(tiny_model, no_bos_model):
    """GPT-1's vocabulary has no BOS: analyses of its text must not ask for one."""
    from probe.analyses.common import as_tokens

    text = "To be, or not"
    ids = tiny_model.tokenizer.encode(text, add_special_tokens=False)
    assert as_tokens(tiny_model, text).tolist() == [[tiny_model.tokenizer.bos_id] + ids]
    assert as_tokens(no_bos_model, text).tolist() == [ids]
