"""A thin wrapper over a Hugging Face `tokenizers` byte-level BPE, without needing `transformers`.

Beside probe's own methods (`token_strings`, `bos_id`, `pad_id`) it has the surface of transformers' fast tokenizer
that transformer-lens code reaches for through `model.tokenizer`, as TL 3.9's HookedTransformer loads it: with
`add_bos_token=True`, so `encode` and `tokenizer(texts, return_tensors="pt", padding=True)` put BOS first unless
`add_special_tokens=False`; `bos_token_id`, `eos_token_id`, `pad_token` / `pad_token_id` (settable), `padding_side`,
`decode`, `batch_decode`, `convert_ids_to_tokens`, `pad` (for transformers' data collators), `save_pretrained`,
`apply_chat_template`, `name_or_path`, `model_max_length` and `len(tokenizer)`, with transformers' results for the
same files (tests/test_tl_tokens.py and tests/test_tokenizer_surface.py hold it to transformers and to TL 3.9).
Probe's own callers say `add_special_tokens=False` and add BOS themselves (`model.to_tokens`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from probe.chat_template import render_chat
from probe.token_ids import TokenIds, as_array, check_padding_side, id_list, is_int, pad_encodings, pad_rows
from probe.tokenizer_files import chat_template_from, read_backend, read_config, token_from_config, write_pretrained

ENDOFTEXT = "<|endoftext|>"
NO_MAX_LENGTH = int(1e30)  # transformers' model_max_length when the checkpoint names none (its VERY_LARGE_INTEGER)
__all__ = ["Encoding", "Tokenizer", "check_padding_side", "pad_rows", "prepends_bos"]  # the last three for callers


class Encoding(dict):
    """What `tokenizer(text)` returns: `input_ids` and `attention_mask`, by key or attribute, as transformers'
    BatchEncoding."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"this encoding has no {name!r}; it has {sorted(self)}") from None

    def to(self, device) -> "Encoding":
        """The tensors on `device`, as transformers' `BatchEncoding.to` (lists stay lists)."""
        return Encoding({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()})


class Tokenizer:
    """Text <-> token ids. GPT-2 uses one special token, `<|endoftext|>`, as BOS, EOS and padding.

    `bos_token=None` is for vocabularies without one (GPT-1): `bos_id` is then None and nothing is prepended.
    `eos_token` defaults to the BOS token, GPT-2's convention. Padding uses `pad_token`, else EOS, as transformer-lens
    pads (HookedTransformer.set_tokenizer; a Llama tokenizer pads with `</s>`), else BOS, else id 0.

    `add_bos_token`: whether `encode` and `tokenizer(...)` put BOS first (with `add_special_tokens=True`, their
    default). None means TL 3.9's choice: it reloads every tokenizer that names a BOS token with add_bos_token=True
    (transformer_lens/utilities/tokenize_utils.py `get_tokenizer_with_bos`), except one whose BOS holds a ':',
    which tokenizers' TemplateProcessing cannot write and TL keeps as loaded.
    """

    def __init__(self, backend: _HFTokenizer, bos_token: Optional[str] = ENDOFTEXT, eos_token: Optional[str] = None,
                 *, pad_token: Optional[str] = None, add_bos_token: Optional[bool] = None, name_or_path: str = "",
                 model_max_length: int = NO_MAX_LENGTH, chat_template: Optional[str] = None):
        self.backend = backend
        self.bos_id = self._special_id(bos_token, "BOS", "bos_token")
        self.eos_id = self._special_id(eos_token or bos_token, "EOS", "eos_token")
        named_pad = self._special_id(pad_token, "padding", "pad_token")
        self.pad_id = next((i for i in (named_pad, self.eos_id, self.bos_id) if i is not None), 0)
        self.padding_side = "right"
        self.add_bos_token = (bos_token is not None and ":" not in bos_token) if add_bos_token is None else add_bos_token
        self.name_or_path, self.model_max_length, self.chat_template = name_or_path, model_max_length, chat_template

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
        has it, else none (GPT-1's vocabulary has no BOS). The EOS token is tokenizer_config.json's, else BOS; the
        padding token tokenizer_config.json's, else EOS (transformer-lens's rule).
        `encode` and `tokenizer(...)` put BOS first unless tokenizer_config.json says `"bos_token": null` (Qwen's), or
        names an EOS token and no BOS (Qwen's saved by transformers 5, which drops null keys):
        transformers' tokenizer then has none, and TL 3.9 adds none, though `to_tokens` prepends `<|endoftext|>`."""
        directory = Path(directory)
        config = read_config(directory)
        named = bos_token or token_from_config(config, directory, "bos_token")
        eos, pad = token_from_config(config, directory, "eos_token"), token_from_config(config, directory, "pad_token")
        if (directory / "tokenizer.json").is_file():
            path = directory / "tokenizer.json"
            backend = read_backend(path, lambda: _HFTokenizer.from_file(str(path)))
        elif (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
            vocab, merges = directory / "vocab.json", directory / "merges.txt"
            backend = read_backend(merges, lambda: _HFTokenizer(models.BPE.from_file(str(vocab), str(merges))), vocab)
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            backend.decoder = decoders.ByteLevel()
        else:
            raise FileNotFoundError(
                f"no tokenizer in {directory}: expected tokenizer.json, or vocab.json and merges.txt"
            )
        bos = named or _default_bos(backend)
        # no BOS named where the config names the others (Qwen's, saved by transformers 5, which drops the null
        # "bos_token"): none added, as transformers' tokenizer and TL's add none
        add_bos = None if named or not ({"bos_token", "eos_token"} & config.keys()) else False
        max_length = config.get("model_max_length")
        try:
            return cls(backend, bos, _known(backend, eos), pad_token=_known(backend, pad), add_bos_token=add_bos,
                       name_or_path=str(directory),
                       model_max_length=max_length if is_int(max_length) else NO_MAX_LENGTH,
                       chat_template=chat_template_from(config, directory))
        except ValueError as err:
            raise ValueError(f"the tokenizer in {directory}: {err} (or fix bos_token in tokenizer_config.json)") from None

    @classmethod
    def from_transformers(cls, tokenizer) -> "Tokenizer":
        """A transformers tokenizer (transformer-lens's `tokenizer=`): its fast backend, BOS, EOS and padding tokens."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, _HFTokenizer):
            raise TypeError(f"tokenizer must be a fast transformers tokenizer (AutoTokenizer.from_pretrained(..., "
                            f"use_fast=True)), got {type(tokenizer).__name__}")
        backend = _HFTokenizer.from_str(backend.to_str())  # its own copy, without the caller's padding settings
        backend.no_padding()
        backend.no_truncation()
        bos = tokenizer.bos_token
        return cls(backend, _known(backend, bos) or _default_bos(backend), _known(backend, tokenizer.eos_token),
                   pad_token=_known(backend, tokenizer.pad_token),
                   add_bos_token=bos is not None and ":" not in bos and backend.token_to_id(bos) is not None,
                   name_or_path=getattr(tokenizer, "name_or_path", ""),
                   model_max_length=getattr(tokenizer, "model_max_length", NO_MAX_LENGTH),
                   chat_template=getattr(tokenizer, "chat_template", None))

    def save(self, directory: Path) -> None:
        """tokenizer.json as the checkpoint shipped it (a model's save_pretrained); see also `save_pretrained`."""
        self.backend.save(str(Path(directory) / "tokenizer.json"))

    def save_pretrained(self, save_directory: Union[str, Path], **_) -> tuple[str, str]:
        """transformers' `save_pretrained`: tokenizer.json and tokenizer_config.json, which
        `AutoTokenizer.from_pretrained` (and `Tokenizer.from_directory`) read back as this tokenizer, BOS included."""
        return write_pretrained(self, Path(save_directory))

    # ---- probe's own ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, *, add_special_tokens: bool = True, return_tensors: Optional[str] = None):
        """The ids of `text`: a list, or [1 pos] with `return_tensors` "pt" / "np". BOS comes first, as in TL 3.9's
        `model.tokenizer.encode` (`[50256, 6342]` for GPT-2's " Paris"), unless `add_special_tokens=False`."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a string, got {type(text).__name__}; use tokenizer(list_of_texts) for a batch")
        ids = self._ids(text, add_special_tokens)
        return ids if return_tensors is None else as_array([ids], return_tensors)

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        if add_special_tokens and self.add_bos_token:
            # transformers rebuilds the post-processor as "BOS $A" for add_bos_token=True, dropping whatever else the
            # shipped one added (an EOS): the text's own ids with BOS first
            return [self.bos_id] + self.backend.encode(text, add_special_tokens=False).ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def add_bos_token(self) -> bool:
        return self._add_bos_token

    @add_bos_token.setter
    def add_bos_token(self, value: bool) -> None:
        if value and self.bos_id is None:
            raise ValueError("this tokenizer has no BOS token to add; leave add_bos_token=False")
        self._add_bos_token = bool(value)

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
        return self.backend.decode(id_list(ids, "decode"), skip_special_tokens=skip_special_tokens)

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
    def bos_token(self) -> Optional[str]:
        return None if self.bos_id is None else self.backend.id_to_token(self.bos_id)

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.eos_id

    @property
    def eos_token(self) -> Optional[str]:
        return None if self.eos_id is None else self.backend.id_to_token(self.eos_id)

    @eos_token.setter
    def eos_token(self, token: str) -> None:
        self.eos_id = self._special_id(token, "EOS", "eos_token")

    @property
    def pad_token_id(self) -> int:
        return self.pad_id

    @pad_token_id.setter
    def pad_token_id(self, token_id: int) -> None:
        """`tokenizer.pad_token_id = tokenizer.eos_token_id`: what `tokenizer(..., padding=True)`, `pad` and
        `model.to_tokens` pad with."""
        if not is_int(token_id) or not 0 <= token_id < self.vocab_size:
            raise ValueError(f"pad_token_id must be a token id in [0, {self.vocab_size}), got {token_id!r}")
        self.pad_id = int(token_id)

    @property
    def pad_token(self) -> str:
        return self.backend.id_to_token(self.pad_id)

    @pad_token.setter
    def pad_token(self, token: str) -> None:
        """`tokenizer.pad_token = tokenizer.eos_token`, the first line of many refusal-direction scripts."""
        if token is None:
            raise ValueError("probe's tokenizer always pads with some token; set pad_token to one in its vocabulary "
                             "(e.g. tokenizer.eos_token)")
        self.pad_id = self._special_id(token, "padding", "pad_token")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        names = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        return {name: token for name, token in names.items() if token is not None}

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
        if is_int(ids) or (isinstance(ids, torch.Tensor) and ids.dim() == 0):
            return self.backend.id_to_token(int(ids))
        special = set(self.special_ids) if skip_special_tokens else set()
        return [self.backend.id_to_token(i) for i in id_list(ids, "convert_ids_to_tokens") if i not in special]

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
        `return_tensors="pt"`) [batch pos] tensors, BOS first unless `add_special_tokens=False` (TL 3.9's)."""
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
        rows = [self._ids(t, add_special_tokens) for t in texts]
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
            ids, mask = as_array(ids, return_tensors), as_array(mask, return_tensors)
        elif single:
            ids, mask = ids[0], mask[0]
        out = Encoding(input_ids=ids)
        if return_attention_mask:
            out["attention_mask"] = mask
        return out

    def pad(self, encoded_inputs, padding: Union[bool, str] = True, max_length: Optional[int] = None,
            pad_to_multiple_of: Optional[int] = None, padding_side: Optional[str] = None,
            return_attention_mask: bool = True, return_tensors: Optional[str] = None, **_) -> Encoding:
        """transformers' `pad`, as its data collators call it (`DataCollatorForLanguageModeling(model.tokenizer,
        mlm=False)`): encodings padded to one length with `pad_token_id` on `padding_side`, attention_mask 0 there."""
        return Encoding(pad_encodings(encoded_inputs, self.pad_id, padding_side or self.padding_side, padding,
                                      max_length, pad_to_multiple_of, return_attention_mask, return_tensors))

    def apply_chat_template(self, conversation, chat_template: Optional[str] = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True, padding: Union[bool, str] = False,
                            truncation: bool = False, max_length: Optional[int] = None,
                            return_tensors: Optional[str] = None, return_dict: bool = True, **kwargs):
        """transformers' (5.x) `apply_chat_template`: the checkpoint's chat template (tokenizer_config.json's
        `chat_template`, or chat_template.jinja) rendered with jinja2 over `conversation` (a list of
        {"role", "content"} dicts, or a list of them), then tokenized without adding BOS (the template writes its
        own). `tools=`, `documents=` and `return_assistant_tokens_mask=` are refused: for those, render with
        `transformers.AutoTokenizer.from_pretrained(model_dir).apply_chat_template(...)` and pass its ids."""
        texts = render_chat(chat_template or self.chat_template, conversation, add_generation_prompt,
                            continue_final_message, {**self.special_tokens_map, **kwargs}, self.name_or_path)
        if not tokenize:
            return texts
        out = self(texts, padding=padding, truncation=truncation, max_length=max_length, return_tensors=return_tensors,
                   add_special_tokens=False)
        return out if return_dict else out["input_ids"]


def prepends_bos(default: bool, tokenizer: Optional["Tokenizer"]) -> bool:
    """Whether a model prepends BOS by default: its config says so (`default`) and its tokenizer, if any, has one."""
    return default and (tokenizer is None or tokenizer.bos_id is not None)


def _default_bos(backend: _HFTokenizer) -> Optional[str]:
    return ENDOFTEXT if backend.token_to_id(ENDOFTEXT) is not None else None


def _known(backend: _HFTokenizer, token: Optional[str]) -> Optional[str]:
    return token if token is not None and backend.token_to_id(token) is not None else None


