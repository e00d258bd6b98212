"""A thin wrapper over a Hugging Face `tokenizers` byte-level BPE, without needing `transformers`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

ENDOFTEXT = "<|endoftext|>"


class Tokenizer:
    """Text <-> token ids. GPT-2 uses one special token, `<|endoftext|>`, as BOS, EOS and padding."""

    def __init__(self, backend: _HFTokenizer, bos_token: str = ENDOFTEXT):
        self.backend = backend
        bos_id = backend.token_to_id(bos_token)
        if bos_id is None:
            raise ValueError(f"tokenizer has no {bos_token!r} token to use as BOS and padding")
        self.bos_token, self.bos_id = bos_token, bos_id
        self.pad_id = bos_id

    @classmethod
    def from_directory(cls, directory: Path, bos_token: Optional[str] = None) -> "Tokenizer":
        """Read `tokenizer.json`, or the older `vocab.json` + `merges.txt` pair, from a checkpoint directory."""
        directory = Path(directory)
        bos_token = bos_token or _bos_token_from_config(directory) or ENDOFTEXT
        if (directory / "tokenizer.json").is_file():
            return cls(_HFTokenizer.from_file(str(directory / "tokenizer.json")), bos_token)
        vocab, merges = directory / "vocab.json", directory / "merges.txt"
        if vocab.is_file() and merges.is_file():
            backend = _HFTokenizer(models.BPE.from_file(str(vocab), str(merges)))
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            backend.decoder = decoders.ByteLevel()
            return cls(backend, bos_token)
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


def _bos_token_from_config(directory: Path) -> Optional[str]:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return None
    token = json.loads(path.read_text()).get("bos_token")
    return token.get("content") if isinstance(token, dict) else token
