"""What every analysis shares: turning inputs into tokens, and token strings safe to show."""
from __future__ import annotations

import html
from typing import Optional, Sequence, Union

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
    shown = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in shown)
    return html.escape(shown, quote=True)


def tokens_and_mask(
    model: HookedDecoder, input: AnalysisInput, attention_mask: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [batch pos] and a boolean mask [batch pos] of real (not padding) tokens."""
    if isinstance(input, torch.Tensor):
        tokens = model.validate_tokens(input)
        if attention_mask is None:
            return tokens, torch.ones_like(tokens, dtype=torch.bool)
        mask = attention_mask.to(tokens.device)
        mask = mask.unsqueeze(0) if mask.dim() == 1 else mask
        if mask.shape != tokens.shape:
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but the tokens have shape {tuple(tokens.shape)}")
        return tokens, mask.bool()
    if attention_mask is not None:
        raise ValueError("attention_mask is built for you when the input is text; pass token ids to give one")
    tokens, mask = model.to_tokens(input, return_attention_mask=True)
    return tokens, mask.bool()


def model_mask(mask: torch.Tensor) -> Optional[torch.Tensor]:
    return None if bool(mask.all()) else mask.long()  # nothing padded: the causal-only path is exact and faster
