"""What every analysis shares: turning inputs into tokens, and token strings safe to show."""
from __future__ import annotations

import numbers
from typing import Callable, Optional, Sequence, Union

import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from probe.analyses.labels import CHAR_PX, figure_token, fitted, grid_layout, plain_length, position_labels, token_texts
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
    return lambda ids: token_texts(tokenizer, ids)


def token_strings(model: HookedDecoder, ids: Sequence[int]) -> list[str]:
    """Each id's string, decoded on its own (so they concatenate back to the text), a partial UTF-8
    character as `<0xE2>` (`analyses.labels.token_texts`); the id itself as a string for a model without
    a tokenizer. Raw text: `figure_token` / `html_token` before a figure or a page."""
    return token_decoder(model)(ids)


def token_labels(model: HookedDecoder, tokens: torch.Tensor) -> list[str]:
    """One plotly axis label per position of a single prompt: the token shown (whitespace visible,
    escaped for plotly) and suffixed with its position, as plotly merges equal categories (a prompt
    like `the cat the` keeps three columns)."""
    ids = tokens[0] if tokens.dim() == 2 else tokens
    return position_labels(token_strings(model, ids.tolist()))


labels_of = position_labels  # `token_labels` from strings already decoded
escape_token = figure_token  # a token for a plotly figure (analyses.labels)


def tokens_and_mask(
    model: HookedDecoder, input: AnalysisInput, attention_mask: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [batch pos] and a boolean mask [batch pos] of real (not padding) tokens."""
    if isinstance(input, torch.Tensor):
        tokens = model.validate_tokens(input)
        if attention_mask is None:
            return tokens, torch.ones_like(tokens, dtype=torch.bool)
        return tokens, model.validate_attention_mask(attention_mask, tokens).bool()  # 1s and 0s only, or an error
    if attention_mask is not None:
        raise ValueError("attention_mask is built for you when the input is text; pass token ids to give one")
    tokens, mask = model.to_tokens(input, return_attention_mask=True)
    return tokens, mask.bool()


def model_mask(mask: torch.Tensor) -> Optional[torch.Tensor]:
    # nothing padded: the attention's own default (causal, or every key when bidirectional) is exact and faster
    return None if bool(mask.all()) else mask.long()


def is_int(value) -> bool:
    """An int-like value usable as a token id or an index: Python or NumPy integers, 0-d integer
    tensors; not bools (True would silently mean 1) and not floats (which would be truncated)."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(value, what: str) -> int:
    """`value` as an int when `is_int` holds; a float (2.5), a bool or a float tensor is refused, never truncated."""
    if not is_int(value):
        raise TypeError(f"{what}={value!r} must be an int; floats and bools are refused rather than truncated")
    return int(value)


def top_count(k, limit: int, limit_name: str, default: int, what: str = "k") -> int:
    """How many of `limit` things (a vocabulary's tokens, an SAE's features) to rank: `k`, or when k is None
    `default` cut to `limit`, since a toy model's vocabulary (two classes) can be smaller than any default. An
    explicit k outside [1, limit] is refused naming the limit, as everywhere else: taking fewer than asked without a
    word would hide a mistake."""
    if k is None:
        return min(default, limit)
    if not is_int(k) or not 1 <= int(k) <= limit:
        message = f"{what}={k!r} must be an integer in [1, {limit_name}={limit}]"
        if is_int(k) and int(k) > limit:  # the likely mistake: a count meant for a larger model
            message += f": there are only {limit}; pass {what}={limit} or less, or leave {what} unset for " \
                       f"min({default}, {limit_name})"
        raise ValueError(message)
    return int(k)


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
    position = check_int(position, "position")

    def check(shortest: int) -> None:  # the shortest prompt decides for all
        if position >= shortest:
            raise ValueError(f"position={position} is past the end of a prompt with {shortest} tokens")
        if -position > shortest:
            raise ValueError(f"position={position} is before the start of a prompt with {shortest} tokens")

    if bool(mask.all()):  # nothing padded (the usual case): every prompt has the full length
        check(mask.shape[-1])
        return torch.full((mask.shape[0],), position % mask.shape[-1], dtype=torch.long, device=mask.device)
    lengths = mask.long().sum(-1)
    check(int(lengths.min()))
    index = torch.full_like(lengths, position) if position >= 0 else lengths + position
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
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        shown = model.tokenizer.token_strings(ids)
        raise ValueError(
            f"{what} {text!r} is {len(ids)} tokens {shown}, not one; pass a string that is one token (mind the "
            f"leading space, e.g. ' Paris') or a token id"
        )
    return ids[0]


def token_id(model: HookedDecoder, value, what: str) -> int:
    """A token id the logits hold (an answer, a target) from an int-like id or a single-token string, checked
    against the output vocabulary (d_vocab_out: all of d_vocab but in a toy model that predicts fewer)."""
    if isinstance(value, str):
        value = single_token_id(model, value, what)
    elif not is_int(value):
        raise TypeError(f"{what} {value!r} is not a token id: give an int or a string that is one token")
    if not 0 <= int(value) < model.cfg.d_vocab_out:
        raise ValueError(f"{what} token id {value!r} is outside the vocabulary the logits cover [0, {model.cfg.d_vocab_out})")
    return int(value)


class TableDisplay:
    """Results that have a table show it in Jupyter: `_repr_html_` is their `to_frame()` as pandas shows it
    (truncated to pandas' display limits). Call `.figure()` for the picture."""

    def _repr_html_(self) -> str:
        return self.to_frame()._repr_html_()


class PromotedTokens(TableDisplay):
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
        """One row per (row, direction, rank from 1); `lead` gives each row's leading columns (name -> a value per row)."""
        n, k = self.top_ids.shape
        rows = []
        for direction, ids, logits, offset in (("promoted", self.top_ids, self.top_logits, 0),
                                               ("suppressed", self.bottom_ids, self.bottom_logits, k)):
            for i in range(n):
                for r in range(k):
                    rows.append([values[i] for values in lead.values()]
                                + [direction, r + 1, int(ids[i, r]), self.token_strings[i][offset + r], float(logits[i, r])])
        return pd.DataFrame(rows, columns=[*lead, "direction", "rank", "token_id", "token", "logit"])

    def _promoted_figure(self, labels: list[str], title: str) -> go.Figure:
        """Heatmaps of the promoted (left) and suppressed (right) tokens' logits for the rows `labels` names,
        tokens written in the cells where they fit (all of them in the hover)."""
        n, k = len(labels), self.k
        shown = [[figure_token(s) for s in strings] for strings in self.token_strings[:n]]
        longest = max((plain_length(s) for row in shown for s in row), default=1)
        cell_w = min(max(40.0, 12 + CHAR_PX * longest), 110.0)
        spacing = 0.06
        fig = make_subplots(rows=1, cols=2, subplot_titles=("promoted", "suppressed"), horizontal_spacing=spacing)
        for col, logits, offset in ((1, self.top_logits, 0), (2, self.bottom_logits, k)):
            full = [row[offset:offset + k] for row in shown]
            fig.add_trace(go.Heatmap(
                z=logits[:n].tolist(), x=[f"#{r + 1}" for r in range(k)], y=labels,
                text=[[fitted(t, cell_w) for t in row] for row in full], texttemplate="%{text}", customdata=full,
                textfont=dict(size=11), colorscale="RdBu", zmid=0, showscale=(col == 1),
                hovertemplate="%{y}, rank %{x}<br>token %{customdata}<br>logit %{z:.4f}<extra></extra>",
            ), row=1, col=col)
        fig.update_yaxes(autorange="reversed", type="category")
        fig.update_yaxes(showticklabels=False, row=1, col=2)  # the same rows as on the left
        grid_layout(fig, title, x_labels=[f"#{r + 1}" for r in range(2 * k)], y_labels=labels, cell_w=cell_w,
                    cell_h=26, x_title="", y_title="", x_rotated=False, extra_top=24)
        return fig
