"""Text <-> tokens on the model: to_tokens, to_str_tokens, to_string, to_single_token, as transformer-lens has them."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from probe.tokenizer import Tokenizer


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
        text: Union[str, Sequence[str]],
        prepend_bos: Optional[bool] = None,
        return_attention_mask: bool = False,
        padding_side: str = "right",
    ):
        """Token ids [batch pos] for a string or a list of strings, padded on `padding_side` ("right",
        or "left" so that every prompt ends at the last position, as generation needs), on the model's device.
        `prepend_bos=None` prepends BOS when the tokenizer has one (GPT-2 does, GPT-1 does not)."""
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        tokenizer = self._require_tokenizer()
        if prepend_bos is None:
            prepend_bos = tokenizer.bos_id is not None
        elif prepend_bos and tokenizer.bos_id is None:
            raise ValueError("this model's tokenizer has no BOS token (as GPT-1's); pass prepend_bos=False")
        texts = [text] if isinstance(text, str) else list(text)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("to_tokens takes a string or a non-empty list of strings")
        ids = [([tokenizer.bos_id] if prepend_bos else []) + tokenizer.encode(t) for t in texts]
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(f"prompt {i} is empty and no BOS is prepended, so it has no tokens")
        length = max(len(row) for row in ids)
        tokens = torch.full((len(ids), length), tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), length), dtype=torch.long)
        for i, row in enumerate(ids):
            span = slice(0, len(row)) if padding_side == "right" else slice(length - len(row), length)
            tokens[i, span] = torch.tensor(row)
            mask[i, span] = 1
        tokens, mask = tokens.to(self.device), mask.to(self.device)
        return (tokens, mask) if return_attention_mask else tokens

    def to_str_tokens(self, input: Union[str, torch.Tensor], prepend_bos: Optional[bool] = None) -> list[str]:
        """The string of every token of one prompt (a string or 1-D ids)."""
        tokenizer = self._require_tokenizer()
        if isinstance(input, str):
            input = self.to_tokens(input, prepend_bos=prepend_bos)
        ids = input.squeeze(0) if input.dim() == 2 and input.shape[0] == 1 else input
        if ids.dim() != 1:
            raise ValueError(f"to_str_tokens takes one prompt; got token ids of shape {tuple(input.shape)}")
        return tokenizer.token_strings(ids.tolist())

    def to_single_token(self, text: str) -> int:
        """The id of `text` when it is exactly one token (e.g. " love"); otherwise an error listing its tokens."""
        ids = self._require_tokenizer().encode(text)
        if len(ids) != 1:
            pieces = self.tokenizer.token_strings(ids)
            raise ValueError(f"{text!r} is {len(ids)} tokens {pieces}, not one; choose a string that is a single token")
        return ids[0]

    def to_string(self, tokens: torch.Tensor) -> Union[str, list[str]]:
        tokenizer = self._require_tokenizer()
        if tokens.dim() == 1:
            return tokenizer.decode(tokens.tolist())
        return [tokenizer.decode(row.tolist()) for row in tokens]
