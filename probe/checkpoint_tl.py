"""Checkpoints saved in transformer-lens's own format, as Neel Nanda's toy models on the hub are (`attn-only-2l`,
`gelu-1l`, ...; what TL's `from_pretrained` reads through `convert_neel_model_config`): a `config.json` of TL's
config keywords (`d_model`, `n_layers`, `act_fn`, `attn_only`, `normalization` or `normalization_type`,
`shortformer_pos`, `tokenizer_name`, ...) and a `*final.pth` state dict in TL's layout.

Neel Nanda's older SoLU runs (`solu-1l-pile` ... `solu-12l-pile`, hub repositories named `..._old`) saved their
tensors under other names and orientations; they are converted as TL converts them (`convert_solu_old`), which TL
decides by the repository's name, and probe by the name loaded or, for a directory, its config's
`"architecture": "neel-solu-old"`.

The state dict is read with `torch.load(weights_only=True)`, which refuses anything but tensors and plain
containers, so a hostile file cannot run code. The tokenizer is the directory's own when it has one, else the one
`tokenizer_name` names (a directory or hub repository, as TL loads it)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from probe.config import DecoderConfig
from probe.tokenizer import Tokenizer

# the keys that tell TL's config format from a Hugging Face config.json (which names its model_type)
TL_KEYS = ("d_model", "n_layers", "d_head", "act_fn")
# what transformer-lens's convert_neel_model_config reads, by the name HookedTransformerConfig takes it under
COPIED = ("d_model", "n_layers", "d_mlp", "d_head", "n_heads", "n_ctx", "d_vocab", "act_fn", "attn_only")


class TLFormatError(ValueError):
    """A transformer-lens-format checkpoint that cannot be read, with the reason and the file."""


def is_tl_format(config: dict) -> bool:
    return "model_type" not in config and all(key in config for key in TL_KEYS)


def tl_architecture(config: dict, source: Optional[str]) -> str:
    """"neel", or "neel-solu-old" for an older SoLU run: the config's own `architecture`, else TL's rule, a hub
    repository (`source`, the name the checkpoint was asked for) whose name has `_old` in it."""
    old = source is not None and not Path(source).exists() and "_old" in source
    return config.get("architecture", "neel-solu-old" if old else "neel")


def tl_format_config(config: dict, directory: Path, architecture: str = "neel") -> DecoderConfig:
    """The DecoderConfig of a TL-format config.json, with TL's defaults for what it leaves out."""
    from probe.tl_config import HookedTransformerConfig

    missing = [key for key in COPIED if key not in config]
    if missing:
        raise TLFormatError(f"{directory / 'config.json'}: a transformer-lens config needs {missing}")
    settings = {key: config[key] for key in COPIED}
    settings["normalization_type"] = config["normalization"] if "normalization" in config else config.get(
        "normalization_type", "LN")
    settings["positional_embedding_type"] = "shortformer" if config.get("shortformer_pos") else "standard"
    settings["final_rms"] = config.get("final_rms", False)
    settings["original_architecture"] = architecture
    try:
        return HookedTransformerConfig(**settings)
    except (TypeError, ValueError) as err:
        raise TLFormatError(f"{directory / 'config.json'}: {err}") from None


def final_state_file(directory: Path) -> Path:
    """The `*final.pth` of a TL-format checkpoint (TL's choice among a run's saved states)."""
    found = sorted(directory.glob("*final.pth"))
    if len(found) != 1:
        what = "no file" if not found else f"{len(found)} files ({', '.join(p.name for p in found)})"
        raise TLFormatError(f"{directory}: a transformer-lens checkpoint holds one *final.pth state dict; found {what}")
    return found[0]


def read_tl_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # weights_only refuses pickled code: say so, with the file
        raise TLFormatError(f"{path}: not a state dict of tensors torch.load(weights_only=True) can read "
                            f"({type(err).__name__}: {err})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise TLFormatError(f"{path}: expected a state dict {{name: tensor}}, got {type(state).__name__}")
    return state


def convert_solu_old(state: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """An older SoLU run's state dict in TL's layout, as TL's convert_neel_solu_old_weights makes it: `norm` in a
    name is `ln` (the final `norm.` is `ln_final.`); models of up to 8 layers stored W_pos [d_model n_ctx], and those
    of up to 6 every other W_ [out in] (the last two dimensions swapped)."""
    converted = {}
    for key, tensor in state.items():
        key = key.replace("norm", "ln")
        converted["ln_final." + key[len("ln."):] if key.startswith("ln.") else key] = tensor
    if cfg.n_layers <= 8 and "pos_embed.W_pos" in converted:
        converted["pos_embed.W_pos"] = converted["pos_embed.W_pos"].T
    if cfg.n_layers <= 6:
        converted = {key: t.transpose(-2, -1) if "W_" in key and "W_pos" not in key else t
                     for key, t in converted.items()}
    return converted


def tl_format_tokenizer(directory: Path, config: dict, load_tokenizer: Callable) -> Optional[Tokenizer]:
    """The directory's own tokenizer, else the one `tokenizer_name` names (read by `load_tokenizer`), else None."""
    try:
        return Tokenizer.from_directory(directory)
    except FileNotFoundError:
        pass
    return load_tokenizer(config["tokenizer_name"]) if config.get("tokenizer_name") else None


def load_tl_format(directory: Path, config: dict, load_tokenizer: Callable, device, dtype, model_class: type,
                   source: Optional[str] = None):
    """The model of a TL-format checkpoint directory, its weights loaded strictly (TL's layout); `load_tokenizer`
    (probe.loading's) reads a tokenizer the config names. `source`: the hub repository it was fetched as, if any."""
    architecture = tl_architecture(config, source)
    cfg = tl_format_config(config, directory, architecture)
    state = read_tl_state(final_state_file(directory))
    if architecture == "neel-solu-old":
        state = convert_solu_old(state, cfg)
    with torch.random.fork_rng(devices=[]):  # initial weights overwritten at once: TL's loading draws nothing
        model = model_class(cfg, tokenizer=tl_format_tokenizer(directory, config, load_tokenizer))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        if architecture != "neel" or not cfg.activation.normed:
            raise
        # the one layout a TL-format SoLU checkpoint may be in without saying so: a local copy of an older run
        raise TLFormatError(f"{directory}: {err}\nif this is one of Neel Nanda's older SoLU runs (solu-*-pile, a hub "
                            "repository named ..._old), its tensors are stored transposed and renamed: load it by its "
                            "name, or add \"architecture\": \"neel-solu-old\" to its config.json") from None
    return model.to(device=device, dtype=dtype)
