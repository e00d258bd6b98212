"""What every analysis shares: turning inputs into tokens, and token strings safe to show."""
from __future__ import annotations

import html
from typing import Sequence, Union

import torch

from probe import HookedDecoder

AnalysisInput = Union[str, Sequence[str], torch.Tensor]


def as_tokens(model: HookedDecoder, input: AnalysisInput, prepend_bos: bool = True) -> torch.Tensor:
    """Token ids [batch pos] on the model's device, validated, from a string, list of strings or ids."""
    if isinstance(input, torch.Tensor):
        return model.validate_tokens(input)
    return model.to_tokens(input, prepend_bos=prepend_bos)


def token_labels(model: HookedDecoder, tokens: torch.Tensor) -> list[str]:
    """One label per position of a single prompt: the token's string, HTML-escaped, made unique.

    Plotly treats axis labels as HTML and merges equal categories, so each label is escaped and
    suffixed with its position (a prompt like `the cat the` keeps three columns).
    """
    ids = tokens[0] if tokens.dim() == 2 else tokens
    if model.tokenizer is None:
        strings = [str(i) for i in ids.tolist()]
    else:
        strings = model.tokenizer.token_strings(ids.tolist())
    return [f"{escape_token(s)} ({pos})" for pos, s in enumerate(strings)]


def escape_token(token: str) -> str:
    """A token string made safe and visible in HTML: escaped, newlines and tabs shown as \\n and \\t,
    other control characters as \\xNN (byte-level BPE has tokens for them, and plotly.js fails to
    draw a figure whose text contains some of them)."""
    shown = token.replace("\n", "\\n").replace("\t", "\\t")
    shown = "".join(f"\\x{ord(c):02x}" if (ord(c) < 32 or 127 <= ord(c) < 160) else c for c in shown)
    return html.escape(shown, quote=True)
