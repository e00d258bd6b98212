"""Text <-> tokens on the model: to_tokens, to_str_tokens, to_string, to_single_token, as transformer-lens has them."""
from __future__ import annotations

import numbers
from typing import Optional, Sequence, Union

import torch

from probe.tokenizer import Tokenizer, pad_rows, prepends_bos

StrTokens = Union[list[str], list[list[str]]]


def is_text(input) -> bool:
    """A string or a non-empty list of strings: what the model tokenises itself."""
    return isinstance(input, str) or (isinstance(input, (list, tuple)) and bool(input) and isinstance(input[0], str))


class TokenMethods:
    """Mixed into HookedDecoder: the tokenizer's methods on the model's device."""

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(
                "this model has no tokenizer: pass token ids, or load the model with from_pretrained from a "
                "directory holding tokenizer.json (or vocab.json and merges.txt)"
            )
        return self.tokenizer

    def to_tokens(
        self,
        input: Union[str, Sequence[str]],
        prepend_bos: Optional[bool] = None,
        padding_side: Optional[str] = None,
        move_to_device: bool = True,
        truncate: bool = True,
        *,
        return_attention_mask: bool = False,
    ):
        """Token ids [batch pos] for a string or a list of strings, as transformer-lens's `to_tokens`.

        `prepend_bos=None` follows `cfg.default_prepend_bos` (True when the tokenizer has a BOS: GPT-2 does,
        GPT-1 does not). A list is padded with `tokenizer.pad_token_id` on `padding_side` (None: the tokenizer's
        `padding_side`, "right" unless set; "left" puts every prompt's last token at the last position, as
        generation needs). `truncate` keeps each prompt's first n_ctx tokens (BOS included). The ids are on the
        model's device unless `move_to_device=False`. With `return_attention_mask=True` (probe's), also returns
        the [batch pos] mask, 1 = real token."""
        tokenizer = self._require_tokenizer()
        padding_side = tokenizer.padding_side if padding_side is None else padding_side
        if prepend_bos is None:
            prepend_bos = prepends_bos(self.cfg.default_prepend_bos, tokenizer)
        elif prepend_bos and tokenizer.bos_id is None:
            raise ValueError("this model's tokenizer has no BOS token (as GPT-1's); pass prepend_bos=False")
        texts = [input] if isinstance(input, str) else list(input) if isinstance(input, (list, tuple)) else None
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"to_tokens takes a string or a non-empty list of strings, got {input!r:.80}; "
                             "token ids need no tokenizing")
        # an empty prompt without BOS is an empty row, as TL's: SAELens's ActivationsStore skips such dataset rows, and
        # the forward refuses an input with no tokens
        rows = [([tokenizer.bos_id] if prepend_bos else []) + tokenizer.encode(t, add_special_tokens=False) for t in texts]
        if truncate:
            rows = [row[: self.cfg.n_ctx] for row in rows]
        tokens, mask = pad_rows(rows, tokenizer.pad_id, padding_side)
        if move_to_device:
            tokens, mask = tokens.to(self.device), mask.to(self.device)
        return (tokens, mask) if return_attention_mask else tokens

    def to_str_tokens(self, input, prepend_bos: Optional[bool] = None, padding_side: Optional[str] = None) -> StrTokens:
        """The string of every token, each decoded on its own (so they concatenate back to the text).

        A string gives its tokens (BOS first unless `prepend_bos=False`); a list of strings, one list per string
        (each tokenized alone, unpadded); ids, as a list of ints, a tensor or a numpy array, give one string per
        id ([pos], or [1 pos]); [batch pos] ids give one list per row. `prepend_bos` and `padding_side` apply to
        strings only, as in transformer-lens."""
        tokenizer = self._require_tokenizer()
        if isinstance(input, str):
            return tokenizer.token_strings(self.to_tokens(input, prepend_bos, padding_side, move_to_device=False)[0].tolist())
        if isinstance(input, (list, tuple)):
            if input and all(_is_int(i) for i in input):
                return tokenizer.token_strings([int(i) for i in input])
            return [self.to_str_tokens(item, prepend_bos, padding_side) for item in input]
        ids = _as_ids(input, "to_str_tokens").squeeze()  # [1 pos] and [pos 1] are one prompt, as in transformer-lens
        if ids.dim() <= 1:
            return tokenizer.token_strings(ids.reshape(-1).tolist())
        if ids.dim() == 2:
            return [tokenizer.token_strings(row.tolist()) for row in ids]
        raise ValueError(f"to_str_tokens takes [pos] or [batch pos] token ids, got shape {tuple(ids.shape)}")

    def to_single_token(self, string: str) -> int:
        """The id of `string` when it is exactly one token (e.g. " love"); otherwise an error listing its tokens."""
        ids = self._require_tokenizer().encode(string, add_special_tokens=False)
        if len(ids) != 1:
            pieces = self.tokenizer.token_strings(ids)
            raise ValueError(f"{string!r} is {len(ids)} tokens {pieces}, not one; choose a string that is a single token")
        return ids[0]

    def to_single_str_token(self, int_token: int) -> str:
        """The string of one token id."""
        if isinstance(int_token, torch.Tensor) and int_token.numel() == 1 and not int_token.is_floating_point():
            int_token = int(int_token.item())
        if not _is_int(int_token):
            raise TypeError(f"to_single_str_token takes one token id (an int), got {int_token!r:.80}")
        if not 0 <= int_token < self.cfg.d_vocab:
            raise ValueError(f"token id {int_token} is outside the vocabulary [0, {self.cfg.d_vocab})")
        return self._require_tokenizer().token_strings([int(int_token)])[0]

    def to_string(self, tokens) -> Union[str, list[str]]:
        """The text of token ids: a string for an int, a list of ints or a 0-d / 1-d tensor or array; a list of
        strings for [batch pos] ids (or a list of id lists). Special tokens are kept, as in transformer-lens."""
        tokenizer = self._require_tokenizer()
        ids = _as_ids(tokens, "to_string")
        if ids.dim() <= 1:
            return tokenizer.decode(ids.reshape(-1).tolist())
        if ids.dim() == 2:
            return [tokenizer.decode(row.tolist()) for row in ids]
        raise ValueError(f"to_string takes an id, [pos] or [batch pos] token ids, got shape {tuple(ids.shape)}")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _as_ids(tokens, where: str) -> torch.Tensor:
    """An int, a (nested) list of ints, a tensor or a numpy array as an integer tensor, or an error naming the type."""
    if isinstance(tokens, (list, tuple)) and not tokens:
        return torch.zeros(0, dtype=torch.long)
    if _is_int(tokens) or isinstance(tokens, (list, tuple)) or hasattr(tokens, "__array__"):
        try:
            tokens = torch.as_tensor(tokens)
        except (TypeError, ValueError) as error:
            raise TypeError(f"{where} takes token ids (an int, a list of ints, a tensor or an array); "
                            f"could not read {tokens!r:.80} as ids: {error}") from None
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"{where} takes a string or token ids (an int, a list of ints, a tensor or an array), "
                        f"got {type(tokens).__name__}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"{where} takes integer token ids, got dtype {tokens.dtype}; use .long()")
    return tokens
