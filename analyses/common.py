"""What every analysis shares: turning inputs into tokens, and token strings safe to show."""
from __future__ import annotations

import html
import numbers
from typing import Callable, Optional, Sequence, Union

import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from probe import HookedDecoder

AnalysisInput = Union[str, Sequence[str], torch.Tensor]


def as_tokens(model: HookedDecoder, input: AnalysisInput, prepend_bos: Optional[bool] = None) -> torch.Tensor:
    """Token ids [batch pos] on the model's device, validated, from a string, list of strings or ids.
    Text gets a BOS when the tokenizer has one (GPT-2's <|endoftext|>; GPT-1 has none)."""
    if isinstance(input, torch.Tensor):
        return model.validate_tokens(input)
    return model.to_tokens(input, prepend_bos=prepend_bos)


def token_decoder(model: HookedDecoder) -> Callable[[Sequence[int]], list[str]]:
    """`token_strings` for this model's tokenizer, holding the tokenizer but not the model (results keep it)."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        return lambda ids: [str(int(i)) for i in ids]
    return lambda ids: tokenizer.token_strings([int(i) for i in ids])


def token_strings(model: HookedDecoder, ids: Sequence[int]) -> list[str]:
    """Each id's raw string (decoded on its own, so they concatenate back to the text); the id itself
    as a string for a model without a tokenizer. Raw: escape with `escape_token` before HTML."""
    return token_decoder(model)(ids)


def token_labels(model: HookedDecoder, tokens: torch.Tensor) -> list[str]:
    """One label per position of a single prompt: the token's string, HTML-escaped, made unique.

    Plotly treats axis labels as HTML and merges equal categories, so each label is escaped and
    suffixed with its position (a prompt like `the cat the` keeps three columns).
    """
    ids = tokens[0] if tokens.dim() == 2 else tokens
    return labels_of(token_strings(model, ids.tolist()))


def labels_of(strings: Sequence[str]) -> list[str]:
    """`token_labels` from token strings already decoded (escaped, position-suffixed)."""
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


def is_int(value) -> bool:
    """An int-like value usable as a token id or an index: Python or NumPy integers, 0-d integer
    tensors; not bools (True would silently mean 1) and not floats (which would be truncated)."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_id_tensor(ids: torch.Tensor, what: str, noun: str = "token") -> torch.Tensor:
    """Ids given as a tensor must be integers: `.long()` would truncate 3.7 to id 3 without a word."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{what} as a tensor must hold integer {noun} ids, got dtype {ids.dtype}")
    return ids.long()


def unit_ids(values, count: int, unit: str, domain: str) -> torch.Tensor:
    """[n] int64 on the CPU: ids of `unit`s (neurons, SAE features) given as an int, a list or a tensor, each an
    integer in [0, count) (`domain` names that range in errors), none twice."""
    if isinstance(values, torch.Tensor):
        ids = check_id_tensor(values, f"{unit}s", noun=unit).detach().flatten().cpu()
    else:
        try:
            items = [values] if is_int(values) else list(values)
        except TypeError:
            raise TypeError(f"{unit}s={values!r} must be a {unit} id or a list of them") from None
        for value in items:
            if not is_int(value):
                raise TypeError(f"{unit} {value!r} is not a {unit} id: give ints")
        ids = torch.tensor([int(v) for v in items], dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError(f"{unit}s is empty: pass {unit} indices, or None for all {unit}s")
    outside = ids[(ids < 0) | (ids >= count)]
    if outside.numel():
        raise ValueError(f"{unit} {int(outside[0])} is outside {domain}")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"{unit}s lists a {unit} twice")
    return ids


def resolve_positions(mask: torch.Tensor, position: int) -> torch.Tensor:
    """[batch] index of `position` counted among each prompt's real tokens (-1 = each prompt's last),
    for right or left padding."""
    lengths = mask.long().sum(-1)
    if position >= 0:
        if bool((position >= lengths).any()):
            raise ValueError(f"position={position} is past the end of a prompt with {int(lengths.min())} tokens")
        index = torch.full_like(lengths, position)
    else:
        if bool((-position > lengths).any()):
            raise ValueError(f"position={position} is before the start of a prompt with {int(lengths.min())} tokens")
        index = lengths + position
    if not bool(mask[:, :1].all()):  # left padding: real tokens start later
        index = index + (~mask.bool()).long().cumprod(-1).sum(-1)
    return index


def evaluate_metric(metric: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[batch] float: the metric's values, checked to be one per row (batched analyses reshape them by row)."""
    values = metric(logits, tokens, mask)
    rows = logits.shape[0]
    if not isinstance(values, torch.Tensor) or tuple(values.shape) != (rows,):
        got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(
            f"the metric returned {got}; it must return one value per row, shape ({rows},), i.e. one value per "
            "sequence: batched analyses stack several runs along the batch, so return per-row values, not their mean"
        )
    return values.float()


def single_token_id(model: HookedDecoder, text: str, what: str = "answer") -> int:
    """The id of a string that is exactly one token; a multi-token string is an error, not its first token."""
    if model.tokenizer is None:
        raise ValueError(f"this model has no tokenizer: give the {what} as a token id")
    ids = model.tokenizer.encode(text)
    if len(ids) != 1:
        shown = model.tokenizer.token_strings(ids)
        raise ValueError(
            f"{what} {text!r} is {len(ids)} tokens {shown}, not one; pass a string that is one token (mind the "
            f"leading space, e.g. ' Paris') or a token id"
        )
    return ids[0]


def token_id(model: HookedDecoder, value, what: str) -> int:
    """A token id from an int-like id or a single-token string, checked against the vocabulary."""
    if isinstance(value, str):
        return single_token_id(model, value, what)
    if not is_int(value):
        raise TypeError(f"{what} {value!r} is not a token id: give an int or a string that is one token")
    if not 0 <= int(value) < model.cfg.d_vocab:
        raise ValueError(f"{what} token id {value!r} is outside the vocabulary [0, {model.cfg.d_vocab})")
    return int(value)


class PromotedTokens:
    """Shared by tables of the tokens directions promote and suppress (FFN values, SAE decoder rows): each row i
    has `top_ids` / `top_logits` and `bottom_ids` / `bottom_logits` [row k], and `token_strings[i]` holds its k
    promoted strings then its k suppressed ones (raw)."""

    top_ids: torch.Tensor
    top_logits: torch.Tensor
    bottom_ids: torch.Tensor
    bottom_logits: torch.Tensor
    token_strings: list[list[str]]

    @property
    def k(self) -> int:
        return self.top_ids.shape[1]

    def _promoted_frame(self, lead: dict[str, list]) -> pd.DataFrame:
        """One row per (row, direction, rank); `lead` gives each row's leading columns (name -> a value per row)."""
        n, k = self.top_ids.shape
        rows = []
        for direction, ids, logits, offset in (("promoted", self.top_ids, self.top_logits, 0),
                                               ("suppressed", self.bottom_ids, self.bottom_logits, k)):
            for i in range(n):
                for r in range(k):
                    rows.append([values[i] for values in lead.values()]
                                + [direction, r, int(ids[i, r]), self.token_strings[i][offset + r], float(logits[i, r])])
        return pd.DataFrame(rows, columns=[*lead, "direction", "rank", "token_id", "token", "logit"])

    def _promoted_figure(self, labels: list[str], title: str) -> go.Figure:
        """Heatmaps of the promoted (left) and suppressed (right) tokens' logits for the rows `labels` names,
        tokens written (escaped) in the cells."""
        n, k = len(labels), self.k
        fig = make_subplots(rows=1, cols=2, subplot_titles=("promoted", "suppressed"), horizontal_spacing=0.08)
        for col, logits, offset in ((1, self.top_logits, 0), (2, self.bottom_logits, k)):
            text = [[escape_token(self.token_strings[i][offset + r]) for r in range(k)] for i in range(n)]
            fig.add_trace(go.Heatmap(
                z=logits[:n].tolist(), x=[f"#{r + 1}" for r in range(k)], y=labels, text=text,
                texttemplate="%{text}", colorscale="RdBu", zmid=0, showscale=(col == 1),
                hovertemplate="%{y}, rank %{x}<br>token %{text}<br>logit %{z:.4f}<extra></extra>",
            ), row=1, col=col)
        fig.update_yaxes(autorange="reversed", type="category")
        fig.update_layout(title=title, height=200 + 28 * n)
        return fig
