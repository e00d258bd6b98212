"""A thin wrapper over a Hugging Face `tokenizers` byte-level BPE, without needing `transformers`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

ENDOFTEXT = "<|endoftext|>"


class Tokenizer:
    """Text <-> token ids. GPT-2 uses one special token, `<|endoftext|>`, as BOS, EOS and padding.

    `bos_token=None` is for vocabularies without one (GPT-1): `bos_id` is then None, nothing is
    prepended, and padding uses id 0 (padded positions are masked, so any valid id serves).
    """

    def __init__(self, backend: _HFTokenizer, bos_token: Optional[str] = ENDOFTEXT):
        self.backend = backend
        bos_id = None if bos_token is None else backend.token_to_id(bos_token)
        if bos_token is not None and bos_id is None:
            raise ValueError(f"tokenizer has no {bos_token!r} token to use as BOS and padding; pass bos_token=None if it has none")
        self.bos_token, self.bos_id = bos_token, bos_id
        self.pad_id = 0 if bos_id is None else bos_id

    @classmethod
    def from_directory(cls, directory: Path, bos_token: Optional[str] = None) -> "Tokenizer":
        """Read `tokenizer.json`, or the older `vocab.json` + `merges.txt` pair, from a checkpoint directory.

        The BOS token is `bos_token`, else tokenizer_config.json's, else `<|endoftext|>` if the vocabulary
        has it, else none (GPT-1's vocabulary has no BOS)."""
        directory = Path(directory)
        named = bos_token or _bos_token_from_config(directory)
        if (directory / "tokenizer.json").is_file():
            backend = _HFTokenizer.from_file(str(directory / "tokenizer.json"))
            return cls(backend, named or _default_bos(backend))
        vocab, merges = directory / "vocab.json", directory / "merges.txt"
        if vocab.is_file() and merges.is_file():
            backend = _HFTokenizer(models.BPE.from_file(str(vocab), str(merges)))
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            backend.decoder = decoders.ByteLevel()
            return cls(backend, named or _default_bos(backend))
        raise FileNotFoundError(
            f"no tokenizer in {directory}: expected tokenizer.json, or vocab.json and merges.txt"
        )

    def save(self, directory: Path) -> None:
        self.backend.save(str(Path(directory) / "tokenizer.json"))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id decoded on its own, so the strings concatenate back to the text."""
        return [self.backend.decode([i], skip_special_tokens=False) for i in ids]


def _default_bos(backend: _HFTokenizer) -> Optional[str]:
    return ENDOFTEXT if backend.token_to_id(ENDOFTEXT) is not None else None


def _bos_token_from_config(directory: Path) -> Optional[str]:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return None
    token = json.loads(path.read_text()).get("bos_token")
    return token.get("content") if isinstance(token, dict) else token
