"""A thin wrapper over a Hugging Face `tokenizers` byte-level BPE, without needing `transformers`.

Beside probe's own methods (`encode`, `decode`, `token_strings`, `bos_id`, `pad_id`) it has the surface of
transformers' fast tokenizer that transformer-lens code reaches for through `model.tokenizer`: `bos_token_id`,
`eos_token_id`, `pad_token_id`, `padding_side`, `decode`, `batch_decode`, `convert_ids_to_tokens`,
`tokenizer(texts, return_tensors="pt", padding=True)` and `len(tokenizer)`, with transformers' results for the
same tokenizer.json (tests/test_tl_tokens.py holds it to `PreTrainedTokenizerFast`).
"""
from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

ENDOFTEXT = "<|endoftext|>"
PADDING_SIDES = ("right", "left")
TokenIds = Union[int, Sequence[int], torch.Tensor]


class Encoding(dict):
    """What `tokenizer(text)` returns: `input_ids` and `attention_mask`, by key or attribute, as transformers'
    BatchEncoding."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"this encoding has no {name!r}; it has {sorted(self)}") from None


class Tokenizer:
    """Text <-> token ids. GPT-2 uses one special token, `<|endoftext|>`, as BOS, EOS and padding.

    `bos_token=None` is for vocabularies without one (GPT-1): `bos_id` is then None, nothing is
    prepended, and padding uses id 0 (padded positions are masked, so any valid id serves).
    `eos_token` defaults to the BOS token, GPT-2's convention.
    """

    def __init__(self, backend: _HFTokenizer, bos_token: Optional[str] = ENDOFTEXT, eos_token: Optional[str] = None):
        self.backend = backend
        self.bos_token, self.bos_id = bos_token, self._special_id(bos_token, "BOS and padding", "bos_token")
        self.eos_token = eos_token or bos_token
        self.eos_id = self._special_id(self.eos_token, "EOS", "eos_token")
        self.pad_id = 0 if self.bos_id is None else self.bos_id
        self.padding_side = "right"

    def _special_id(self, token: Optional[str], role: str, keyword: str) -> Optional[int]:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer has no {token!r} token to use as {role}; pass {keyword}=None if it has none")
        return token_id

    @classmethod
    def from_directory(cls, directory: Path, bos_token: Optional[str] = None) -> "Tokenizer":
        """Read `tokenizer.json`, or the older `vocab.json` + `merges.txt` pair, from a checkpoint directory.

        The BOS token is `bos_token`, else tokenizer_config.json's, else `<|endoftext|>` if the vocabulary
        has it, else none (GPT-1's vocabulary has no BOS). The EOS token is tokenizer_config.json's, else BOS."""
        directory = Path(directory)
        named = bos_token or _token_from_config(directory, "bos_token")
        eos = _token_from_config(directory, "eos_token")
        if (directory / "tokenizer.json").is_file():
            path = directory / "tokenizer.json"
            backend = _backend(path, lambda: _HFTokenizer.from_file(str(path)))
        elif (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
            vocab, merges = directory / "vocab.json", directory / "merges.txt"
            backend = _backend(merges, lambda: _HFTokenizer(models.BPE.from_file(str(vocab), str(merges))), vocab)
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            backend.decoder = decoders.ByteLevel()
        else:
            raise FileNotFoundError(
                f"no tokenizer in {directory}: expected tokenizer.json, or vocab.json and merges.txt"
            )
        try:
            return cls(backend, named or _default_bos(backend), _known(backend, eos))
        except ValueError as err:
            raise ValueError(f"the tokenizer in {directory}: {err} (or fix bos_token in tokenizer_config.json)") from None

    @classmethod
    def from_transformers(cls, tokenizer) -> "Tokenizer":
        """A transformers tokenizer (transformer-lens's `tokenizer=`): its fast backend, BOS and EOS tokens."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, _HFTokenizer):
            raise TypeError(f"tokenizer must be a fast transformers tokenizer (AutoTokenizer.from_pretrained(..., "
                            f"use_fast=True)), got {type(tokenizer).__name__}")
        backend = _HFTokenizer.from_str(backend.to_str())  # its own copy, without the caller's padding settings
        backend.no_padding()
        backend.no_truncation()
        return cls(backend, _known(backend, tokenizer.bos_token) or _default_bos(backend),
                   _known(backend, tokenizer.eos_token))

    def save(self, directory: Path) -> None:
        self.backend.save(str(Path(directory) / "tokenizer.json"))

    # ---- probe's own ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False, return_tensors: Optional[str] = None):
        """The ids of `text`: a list, or [1 pos] with `return_tensors` "pt" / "np". Nothing is added by default
        (probe's `to_tokens` prepends BOS itself); GPT-2's tokenizer adds nothing either way, so this is
        transformers' `encode` there."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a string, got {type(text).__name__}; use tokenizer(list_of_texts) for a batch")
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids if return_tensors is None else _as_array([ids], return_tensors)

    def tokenize(self, text: str) -> list[str]:
        """The vocabulary entries `text` splits into (byte-level strings, e.g. "Ġthe")."""
        return self.backend.encode(text, add_special_tokens=False).tokens

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        return self.decode(self.convert_tokens_to_ids(list(tokens)))

    def decode(self, ids: TokenIds, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False,
               **_) -> str:
        """The text of one sequence: an id, a list of ids, or a 0-d / 1-d tensor or array.

        `clean_up_tokenization_spaces` is accepted and ignored: it would strip spaces before punctuation, which
        corrupts byte-level BPE text (transformers 5 ignores it for these tokenizers too)."""
        return self.backend.decode(_id_list(ids, "decode"), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False,
                     **_) -> list[str]:
        """The text of each sequence of a 2-D tensor or array, or of a list of id lists."""
        if isinstance(sequences, torch.Tensor) or hasattr(sequences, "__array__"):
            sequences = torch.as_tensor(sequences)
            if sequences.dim() != 2:
                raise ValueError(f"batch_decode takes [batch pos] ids, got shape {tuple(sequences.shape)}; "
                                 "use decode for one sequence")
        return [self.decode(row, skip_special_tokens=skip_special_tokens) for row in sequences]

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id decoded on its own, so the strings concatenate back to the text."""
        return [self.backend.decode([i], skip_special_tokens=False) for i in ids]

    # ---- transformers' names -------------------------------------------------------------------
    @property
    def bos_token_id(self) -> Optional[int]:
        return self.bos_id

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.eos_id

    @property
    def pad_token_id(self) -> int:
        return self.pad_id

    @property
    def pad_token(self) -> str:
        return self.backend.id_to_token(self.pad_id)

    @property
    def padding_side(self) -> str:
        """Where `tokenizer(...)` and `model.to_tokens(...)` pad by default; settable, as in transformers."""
        return self._padding_side

    @padding_side.setter
    def padding_side(self, side: str) -> None:
        self._padding_side = check_padding_side(side)

    @property
    def vocab(self) -> dict[str, int]:  # Hugging Face's name for the same mapping
        return self.get_vocab()

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: Union[int, Sequence[int], torch.Tensor], skip_special_tokens: bool = False):
        """The vocabulary entries (byte-level strings, e.g. "Ġthe") of ids: one for an int, a list for a list."""
        if _is_int(ids) or (isinstance(ids, torch.Tensor) and ids.dim() == 0):
            return self.backend.id_to_token(int(ids))
        special = set(self.special_ids) if skip_special_tokens else set()
        return [self.backend.id_to_token(i) for i in _id_list(ids, "convert_ids_to_tokens") if i not in special]

    def convert_tokens_to_ids(self, tokens: Union[str, Sequence[str]]):
        """The id of a vocabulary entry (None when it is not one, as transformers gives without an unk token)."""
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    @property
    def special_ids(self) -> list[int]:
        return sorted(i for i, added in self.backend.get_added_tokens_decoder().items() if added.special)

    @property
    def all_special_ids(self) -> list[int]:  # transformers' name
        return self.special_ids

    def __call__(self, text: Union[str, Sequence[str]], padding: Union[bool, str] = False,
                 truncation: Union[bool, str] = False, max_length: Optional[int] = None,
                 return_tensors: Optional[str] = None, add_special_tokens: bool = True,
                 padding_side: Optional[str] = None, return_attention_mask: bool = True, **unsupported) -> Encoding:
        """transformers' `tokenizer(text_or_texts, ...)`: `input_ids` and `attention_mask`, lists or (with
        `return_tensors="pt"`) [batch pos] tensors. GPT-2's tokenizer adds no BOS here; `model.to_tokens` does."""
        if unsupported:
            raise TypeError(f"tokenizer() got unexpected keyword(s) {sorted(unsupported)}; it takes padding, "
                            "truncation, max_length, return_tensors, add_special_tokens, padding_side")
        single = isinstance(text, str)
        texts = [text] if single else list(text) if isinstance(text, (list, tuple)) else None
        if not texts or not all(isinstance(t, str) for t in texts):
            raise TypeError(f"tokenizer() takes a string or a non-empty list of strings, got {text!r:.80}")
        if return_tensors not in (None, "pt", "np"):
            raise ValueError(f"return_tensors={return_tensors!r}: only 'pt' (torch), 'np' (numpy) or None (lists) "
                             "is supported")
        rows = [self.backend.encode(t, add_special_tokens=add_special_tokens).ids for t in texts]
        if truncation not in (False, "do_not_truncate") and max_length is not None:
            rows = [row[:max_length] for row in rows]
        if padding in (True, "longest", "max_length"):
            if padding == "max_length" and max_length is None:
                raise ValueError("padding='max_length' needs max_length=")
            length = max_length if padding == "max_length" else max(len(row) for row in rows)
            ids, mask = pad_rows(rows, self.pad_id, padding_side or self.padding_side, max(length, *map(len, rows)))
            ids, mask = ids.tolist(), mask.tolist()
        elif padding in (False, "do_not_pad"):
            ids, mask = rows, [[1] * len(row) for row in rows]
        else:
            raise ValueError(f"padding={padding!r} is not one of True, False, 'longest', 'max_length', 'do_not_pad'")
        if return_tensors is not None:
            ids, mask = _as_array(ids, return_tensors), _as_array(mask, return_tensors)
        elif single:
            ids, mask = ids[0], mask[0]
        out = Encoding(input_ids=ids)
        if return_attention_mask:
            out["attention_mask"] = mask
        return out


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int, padding_side: str, length: Optional[int] = None):
    """Id rows as one [batch length] long tensor padded with `pad_id` on `padding_side`, and its mask (1 = real)."""
    check_padding_side(padding_side)
    length = max(len(row) for row in rows) if length is None else length
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(0, len(row)) if padding_side == "right" else slice(length - len(row), length)
        ids[i, span] = torch.tensor(list(row), dtype=torch.long)
        mask[i, span] = 1
    return ids, mask


def _as_array(rows: list[list[int]], kind: str):
    """Equal-length id rows as a [batch pos] torch ("pt") or numpy ("np") int64 array."""
    if len({len(row) for row in rows}) > 1:
        raise ValueError("these texts have different lengths, so they make no [batch pos] tensor: pass padding=True")
    ids = torch.tensor(rows, dtype=torch.long)
    return ids.numpy() if kind == "np" else ids


def prepends_bos(default: bool, tokenizer: Optional["Tokenizer"]) -> bool:
    """Whether a model prepends BOS by default: its config says so (`default`) and its tokenizer, if any, has one."""
    return default and (tokenizer is None or tokenizer.bos_id is not None)


def check_padding_side(side: str) -> str:
    if side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be 'right' or 'left', got {side!r}")
    return side


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _id_list(ids: TokenIds, where: str) -> list[int]:
    """An id, a list of ids or a 0-d / 1-d integer tensor or array as a list of ints."""
    if _is_int(ids):
        return [int(ids)]
    if isinstance(ids, torch.Tensor) or hasattr(ids, "__array__"):
        ids = torch.as_tensor(ids)
        if ids.is_floating_point() or ids.dtype == torch.bool:
            raise TypeError(f"{where} takes integer token ids, got dtype {ids.dtype}")
        if ids.dim() > 1:
            raise ValueError(f"{where} takes one sequence, got ids of shape {tuple(ids.shape)}; "
                             "use batch_decode (or model.to_string) for a batch")
        return ids.reshape(-1).tolist()
    ids = list(ids)
    if not all(_is_int(i) for i in ids):
        raise TypeError(f"{where} takes token ids (ints); got {[type(i).__name__ for i in ids][:5]}")
    return [int(i) for i in ids]


def _default_bos(backend: _HFTokenizer) -> Optional[str]:
    return ENDOFTEXT if backend.token_to_id(ENDOFTEXT) is not None else None


def _known(backend: _HFTokenizer, token: Optional[str]) -> Optional[str]:
    return token if token is not None and backend.token_to_id(token) is not None else None


def _backend(path: Path, build, other: Optional[Path] = None) -> _HFTokenizer:
    """`tokenizers`' reading of a file (it raises a bare Exception, some without the file), as a ValueError that
    names it."""
    try:
        return build()
    except Exception as err:
        files = f"{other} and {path}" if other is not None else str(path)
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        raise ValueError(f"{files}: not a tokenizer the tokenizers library can read ({reason}); "
                         "re-save it with tokenizer.save_pretrained") from None


def _token_from_config(directory: Path, key: str) -> Optional[str]:
    """tokenizer_config.json's `key` (bos_token, eos_token): a string, or transformers' {"content": ...} form."""
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object of settings, got a {type(config).__name__}")
    token = config.get(key)
    token = token.get("content") if isinstance(token, dict) else token
    if token is not None and not isinstance(token, str):
        raise ValueError(f"{path}: {key} must be a token string (or {{\"content\": ...}}), got {token!r:.60}")
    return token
