"""The files of a tokenizer, as transformers reads and writes them: tokenizer_config.json's settings (BOS, EOS,
model_max_length, the chat template), tokenizer.json read with a message that names the file, and
`save_pretrained`'s pair of files that `transformers.AutoTokenizer.from_pretrained` reads back."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import processors

from probe.io import atomic_file


def read_backend(path: Path, build, other: Optional[Path] = None) -> _HFTokenizer:
    """`tokenizers`' reading of a file (it raises a bare Exception, some without the file), as a ValueError that
    names it."""
    try:
        return build()
    except Exception as err:
        files = f"{other} and {path}" if other is not None else str(path)
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        raise ValueError(f"{files}: not a tokenizer the tokenizers library can read ({reason}); "
                         "re-save it with tokenizer.save_pretrained") from None


def read_config(directory: Path) -> dict:
    """tokenizer_config.json's settings ({} without one)."""
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object of settings, got a {type(config).__name__}")
    return config


def token_from_config(config: dict, directory: Path, key: str) -> Optional[str]:
    """tokenizer_config.json's `key` (bos_token, eos_token): a string, or transformers' {"content": ...} form."""
    token = config.get(key)
    token = token.get("content") if isinstance(token, dict) else token
    if token is not None and not isinstance(token, str):
        raise ValueError(f"{directory / 'tokenizer_config.json'}: {key} must be a token string "
                         f"(or {{\"content\": ...}}), got {token!r:.60}")
    return token


def chat_template_from(config: dict, directory: Path) -> Optional[str]:
    """The default chat template, where transformers reads it: chat_template.jinja (transformers 5 saves it there),
    else tokenizer_config.json's `chat_template` (a string, or a list of {"name", "template"})."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    return template if isinstance(template, str) else None


def write_pretrained(tokenizer, directory: Path) -> tuple[str, str]:
    """tokenizer.json and tokenizer_config.json for `tokenizer` (probe's Tokenizer). As transformers saves a
    tokenizer loaded with add_bos_token=True, the BOS it adds is written into tokenizer.json's post-processor, so
    `AutoTokenizer.from_pretrained(directory)` adds it too; a tokenizer that adds none is saved with no bos_token."""
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    backend = _HFTokenizer.from_str(tokenizer.backend.to_str())
    bos = tokenizer.bos_token if tokenizer.add_bos_token else None
    if bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tokenizer.bos_id)])
    # transformers' save_pretrained replaces the tokenizer's files in a model's directory (probe's model writes its
    # tokenizer.json there first): replaced whole, never left half-written
    with atomic_file(directory / "tokenizer.json", overwrite=True) as tmp:
        backend.save(str(tmp))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": tokenizer.eos_token,
              "pad_token": tokenizer.pad_token, "model_max_length": tokenizer.model_max_length,
              "padding_side": tokenizer.padding_side}
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    with atomic_file(directory / "tokenizer_config.json", overwrite=True) as tmp:
        tmp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return str(directory / "tokenizer_config.json"), str(directory / "tokenizer.json")
