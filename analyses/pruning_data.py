"""The token batches head importance and pruning run on: text, files, folders or token ids, cut into windows."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import torch

from probe.analyses.corpus import encode_document, iter_document_pieces
from probe import HELDOUT_TEXT, HookedDecoder

PruningData = Union[None, str, os.PathLike, Sequence[str], torch.Tensor, Iterable[torch.Tensor]]


def token_batches(
    model: HookedDecoder,
    data: PruningData = None,
    batch_size: int = 8,
    seq_len: Optional[int] = None,
    max_windows: Optional[int] = None,
) -> list[torch.Tensor]:
    """The data as a list of token batches [batch pos] on the model's device.

    data: None (the bundled held-out Shakespeare, `probe.HELDOUT_TEXT`), a `pathlib.Path` to a UTF-8
    text file or to a folder of `*.txt` files (each one document), a string (the text itself), a list
    of strings, token ids [batch pos] (split into batches of `batch_size` rows), or an iterable of
    token batches (kept as given). Texts are tokenised into one stream, each document preceded by
    BOS, and cut into non-overlapping windows of BOS + seq_len - 1 tokens (default seq_len: n_ctx),
    the way the bundled model was trained; a ragged tail is dropped unless it is all there is.
    `max_windows` caps the number of rows (windows) used. Files are read and tokenised a piece at a
    time (`analyses.corpus`), and reading stops once `max_windows` windows are full.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1 or None, got {max_windows}")
    if data is None:
        data = Path(HELDOUT_TEXT)
    documents = None  # each document as consecutive text pieces
    if isinstance(data, os.PathLike):
        documents = (pieces for _, pieces in iter_document_pieces(data))
    elif isinstance(data, str):
        documents = [(data,)]
    elif isinstance(data, (list, tuple)) and data and all(isinstance(t, str) for t in data):
        documents = [(text,) for text in data]
    if documents is not None:
        rows = _windows(model, documents, seq_len or model.cfg.n_ctx, max_windows)
        return [model.validate_tokens(b) for b in rows.split(batch_size)]
    if isinstance(data, torch.Tensor):
        rows = check_length(model.validate_tokens(data))
        if max_windows is not None:
            rows = rows[:max_windows]
        return list(rows.split(batch_size))
    if not isinstance(data, Iterable):
        _not_tokens(data)
    batches = [check_length(model.validate_tokens(b)) if isinstance(b, torch.Tensor) else _not_tokens(b) for b in data]
    if not batches:
        raise ValueError("the data is empty: give at least one text or one batch of token ids")
    if max_windows is not None:
        kept, left = [], max_windows
        for b in batches:
            if left <= 0:
                break
            kept.append(b[:left])
            left -= len(kept[-1])
        batches = kept
    return batches


def _not_tokens(value):
    raise TypeError(
        f"data must be None, a pathlib.Path, a string, a list of strings, token ids [batch pos] or an iterable "
        f"of token-id batches; got {type(value).__name__}"
    )


def check_length(tokens: torch.Tensor) -> torch.Tensor:
    """Token ids with at least one next token to predict: a 1-token row has no loss, and would
    make the mean loss (and every importance) NaN."""
    if tokens.shape[-1] < 2:
        raise ValueError(
            f"token ids of shape {tuple(tokens.shape)} have fewer than 2 positions: the loss needs at least "
            f"one token after the first; pass longer sequences"
        )
    return tokens


def _windows(
    model: HookedDecoder, documents: Iterable[Iterable[str]], seq_len: int, max_windows: Optional[int]
) -> torch.Tensor:
    """[window seq_len]: BOS + the next seq_len - 1 ids of the stream of documents (each BOS +
    its ids), built a span at a time so only the windows and one span's ids are ever held. A
    tokenizer without a BOS (GPT-1's) gives windows of seq_len ids of the documents run together."""
    if not 2 <= seq_len <= model.cfg.n_ctx:
        raise ValueError(f"seq_len must be between 2 and n_ctx={model.cfg.n_ctx}, got {seq_len}")
    tokenizer = model._require_tokenizer()
    bos = tokenizer.bos_id
    body_len = seq_len if bos is None else seq_len - 1

    def spans():
        for pieces in documents:
            if bos is not None:
                yield [bos]
            yield from encode_document(tokenizer, pieces)

    bodies: list[torch.Tensor] = []  # [n body_len] blocks of full windows, in stream order
    n_rows, carry = 0, []  # carry: ids after the last full window
    for span in spans():
        carry.extend(span)
        n = len(carry) // body_len
        if max_windows is not None:
            n = min(n, max_windows - n_rows)
        if n:
            bodies.append(torch.tensor(carry[: n * body_len], dtype=torch.long).view(n, body_len))
            carry, n_rows = carry[n * body_len:], n_rows + n
        if max_windows is not None and n_rows >= max_windows:
            break  # enough windows: the rest of the corpus is never read
    if n_rows == 0:
        if len(carry) < 2:
            raise ValueError("the text is empty (or one token): the loss needs at least two tokens, BOS included")
        return torch.tensor(carry, dtype=torch.long)[None]  # shorter than one window: use it whole
    body = torch.cat(bodies)
    if bos is None:
        return body
    return torch.cat([torch.full((n_rows, 1), bos, dtype=torch.long), body], dim=1)
