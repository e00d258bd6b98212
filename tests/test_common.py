"""Shared analysis helpers: token labels that are safe in HTML and drawable by plotly."""
from analyses.common import escape_token, token_labels


def test_escape_token_escapes_markup_and_shows_control_characters():
    assert escape_token("<script>&") == "&lt;script&gt;&amp;"
    assert escape_token("a\nb\tc") == "a\\nb\\tc"
    assert escape_token("\x06\x7f") == "\\x06\\x7f"
    assert escape_token(" é") == " é"


def test_token_labels_are_unique_per_position(tiny_model):
    tokens = tiny_model.to_tokens("the the the")
    labels = token_labels(tiny_model, tokens)
    assert len(labels) == len(set(labels)) == tokens.shape[1]
