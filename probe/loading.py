"""Loading and saving Hugging Face checkpoints (safetensors first; never unpickling code)."""
from __future__ import annotations

import dataclasses

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch
from safetensors.torch import save_file

from probe.checkpoint_wrapped import original_architecture
from probe.checkpoints import FAMILIES, CheckpointError, Family, Source, family_for_config
from probe.config import DecoderConfig
from probe.config_file import ConfigFields, read_json_object
from probe.safetensors_file import SafetensorsError, StoredTensor, read_header
from probe.io import atomic_directory
from probe.model_names import SHORT_NAMES
from probe.tokenizer import Tokenizer
from probe.shared_block import share_block_weights

if TYPE_CHECKING:  # the model class is passed in (HookedDecoder.from_pretrained gives its own): no import circle
    from probe.model import HookedDecoder

WEIGHT_FILES = ["model.safetensors", "model.safetensors.index.json", "model-*.safetensors",
                "*final.pth"]  # a transformer-lens-format checkpoint's state dict (probe.checkpoint_tl)
PICKLE_FILES = ["pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*.bin"]
TOKENIZER_FILES = ["tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"]
HUB_FILES = ["config.json", *WEIGHT_FILES, *TOKENIZER_FILES]
HUB_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def load_pretrained(
    name_or_path: Union[str, Path],
    device: Optional[Union[str, torch.device]] = None,
    dtype: Optional[torch.dtype] = None,
    revision: Optional[str] = None,
    *,
    model_class: type,  # HookedDecoder, or a subclass: what from_pretrained was called on
) -> HookedDecoder:
    directory = resolve_checkpoint(name_or_path, revision)
    hf_config = _read_json(directory / "config.json")
    _family(hf_config, directory)
    return _build(hf_config, _read_weights(directory), _read_tokenizer(directory), directory, device, dtype, model_class)


def load_hf_model(hf_model, tokenizer: Optional[Tokenizer], device=None, dtype: Optional[torch.dtype] = None, *,
                  model_class: type) -> HookedDecoder:
    """A transformers model already in memory (transformer-lens's `hf_model=`), read as its saved directory would
    be: its config and a copy of its weights (`hf_model` itself is left as it was)."""
    config = getattr(hf_model, "config", None)
    if not (hasattr(config, "to_dict") and hasattr(hf_model, "state_dict")):
        raise TypeError(f"hf_model must be a transformers model (e.g. GPT2LMHeadModel), got {type(hf_model).__name__}")
    hf_config = config.to_dict()
    where = Path(f"<hf_model {type(hf_model).__name__}>")  # what error messages name in place of a directory
    _family(hf_config, where)
    # copies: the model built must not share (and later process in place) hf_model's own tensors
    return _build(hf_config, {name: tensor.detach().clone() for name, tensor in hf_model.state_dict().items()},
                  tokenizer, where, device, dtype, model_class)


def _build(hf_config: dict, weights: dict, tokenizer: Optional[Tokenizer], directory: Path, device, dtype,
           model_class: type) -> HookedDecoder:
    _check_layer_count(hf_config, weights, directory)  # before any table or tensor is sized by the config
    cfg = config_from_hf(hf_config, directory)
    # transformer-lens code reads cfg.original_architecture; a LLaVA file's is its language model's (what it is on text)
    cfg = dataclasses.replace(cfg, original_architecture=original_architecture(hf_config, FAMILIES))
    # each tensor is read, converted and moved to `device` in turn: the host never holds more than the tensors one
    # conversion needs at a time (plus the model itself, when it stays on the CPU)
    state = state_dict_from_hf(weights, hf_config, cfg, directory, device=device)
    del weights
    with torch.device("meta"):  # no time spent initialising weights that are overwritten at once
        model = model_class(cfg, tokenizer=tokenizer)
    model.load_state_dict(state, strict=True, assign=True)
    del state  # a dtype change below then frees each parameter's old copy as it goes
    if cfg.tied_embeddings:
        model.unembed.weight = model.embed.W_E
    share_block_weights(cfg, model.blocks)  # (assign=True gave each layer its own copy of Zamba2's shared weights)
    _rebuild_buffers(model)
    return model.to(device=device, dtype=dtype)


# ---- finding the files ---------------------------------------------------------------------------
def load_tokenizer(name_or_path: Union[str, Path], revision: Optional[str] = None) -> Optional[Tokenizer]:
    """The tokenizer of a checkpoint directory, short name or hub repository, without its weights (for a model
    given in memory, transformer-lens's `hf_model=`)."""
    return _read_tokenizer(resolve_checkpoint(name_or_path, revision, files=TOKENIZER_FILES))


def resolve_checkpoint(name_or_path: Union[str, Path], revision: Optional[str] = None,
                       files: Sequence[str] = HUB_FILES) -> Path:
    """A local directory as given, or a short name (`gpt2`, `pythia-70m`) or hub repository fetched from (or
    found in the cache of) the hub, at `revision` (a branch, tag or commit: Pythia's training checkpoints
    are the branches `step0` ... `step143000`)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if revision is not None:
            raise CheckpointError(f"revision={revision!r} selects a version of a hub repository; {path} is a local "
                                  "directory, which has only the version it holds: drop revision=")
        return path
    name = str(name_or_path)
    if name in SHORT_NAMES:
        return _from_hub(SHORT_NAMES[name], revision=revision, files=files)
    if path.exists():
        raise CheckpointError(f"{path} is a file; pass the checkpoint directory holding config.json")
    if HUB_REPO_ID.fullmatch(name):  # not a local directory, but shaped like owner/name: a hub repository
        return _from_hub(name, also=f"there is no local directory {path}", revision=revision, files=files)
    if any(sep in name for sep in ("/", "\\")) or name.startswith((".", "~")):
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    raise CheckpointError(
        f"{name!r} is neither a local checkpoint directory nor a supported model name; "
        f"supported names: {', '.join(list(SHORT_NAMES)[:12])}, ... ({len(SHORT_NAMES)} in all, "
        "transformer-lens's short names: probe.loading.SHORT_NAMES); or a hub repository (owner/name); "
        "or pass a directory holding config.json and model.safetensors"
    )


def _from_hub(repo_id: str, also: str = "", revision: Optional[str] = None, files: Sequence[str] = HUB_FILES) -> Path:
    directory = _snapshot(repo_id, also, revision, files)
    if files is HUB_FILES and not any(any(directory.glob(pattern)) for pattern in (*WEIGHT_FILES, *PICKLE_FILES)):
        # older repositories (OPT, TinyStories, many training checkpoints) hold only PyTorch pickles, which are
        # read weights-only; asked for only then, so a repository with both costs one download, not two
        directory = _snapshot(repo_id, also, revision, PICKLE_FILES)
    return directory


def _snapshot(repo_id: str, also: str, revision: Optional[str], files: Sequence[str]) -> Path:
    from huggingface_hub import snapshot_download

    try:  # the local cache first: works offline and costs no request
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(files), local_files_only=True))
    except Exception:
        pass
    at = "" if revision is None else f" at revision {revision!r}"
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(files)))
    except Exception as err:
        raise CheckpointError(
            (f"{also}; " if also else "") +
            f"could not download {repo_id}{at} from the Hugging Face hub, and it is not in the local cache "
            f"({type(err).__name__}: {err}). On a machine with network access run "
            f"`hf download {repo_id}{'' if revision is None else f' --revision {revision}'}` (or save_pretrained it), "
            f"then pass that local directory to from_pretrained."
        ) from err


def _read_json(path: Path) -> dict:
    return read_json_object(path)


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    for single, index, read in (("model.safetensors", "model.safetensors.index.json", _read_safetensors),
                                ("pytorch_model.bin", "pytorch_model.bin.index.json", _read_pickle)):
        if (directory / single).is_file():
            return read(directory / single)
        if (directory / index).is_file():
            state: dict[str, torch.Tensor] = {}
            for shard in _shards(directory / index, directory):
                tensors = read(directory / shard)
                twice = sorted(state.keys() & tensors.keys())
                if twice:  # which copy is meant is unknowable; taking the last would be a silent choice
                    raise CheckpointError(f"the tensor {twice[0]!r} is in two shards of {directory} ({shard} and an "
                                          f"earlier one{f'; {len(twice)} tensors in all' if len(twice) > 1 else ''}): "
                                          "the checkpoint is inconsistent")
                state.update(tensors)
            return state
    raise CheckpointError(f"no weights in {directory}: expected model.safetensors (or pytorch_model.bin)")


def _read_pickle(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (the shard index names it)")
    try:  # weights_only: a pickle that would construct arbitrary objects or run code is refused
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(
            f"refused to load {path}: it is not a plain tensor checkpoint ({type(err).__name__}: {err}). "
            "Only safetensors or weights-only pickles are read; convert it to model.safetensors"
        ) from err
    if not (isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a mapping of tensor names to tensors "
                              "(a state dict): it is not a model checkpoint")
    return state


def _read_safetensors(path: Path) -> dict[str, StoredTensor]:
    """The file's tensors, each read only when the family's conversion takes it (see probe.safetensors_file)."""
    try:
        return read_header(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (the shard index names it)") from None
    except (SafetensorsError, OSError) as err:
        raise CheckpointError(f"could not read the safetensors weights in {path}: {err}") from None


def _shards(index: Path, directory: Path) -> list[str]:
    """The shard files an index (model.safetensors.index.json, pytorch_model.bin.index.json) names: relative paths
    inside the checkpoint directory."""
    weight_map = read_json_object(index, "").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: weight_map must be a non-empty object of tensor names to shard files, got "
                              f"{type(weight_map).__name__ if weight_map is not None else 'nothing'}")
    bad = [(k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v]
    if bad:
        raise CheckpointError(f"{index}: weight_map[{bad[0][0]!r}] must be a shard file name, got {bad[0][1]!r}")
    for shard in set(weight_map.values()):
        # by name, not by resolving: the hub's cache links every file to a blob elsewhere, legitimately
        if Path(shard).is_absolute() or ".." in Path(shard).parts or "\\" in shard:
            raise CheckpointError(f"{index}: the shard {shard!r} is outside the checkpoint directory; shards are "
                                  "files beside the index")
    return sorted(set(weight_map.values()))


LAYER_FIELDS = ("n_layer", "num_hidden_layers", "num_layers")
_LAYER_NAME = re.compile(r"(?:^|\.)(?:h|layers|blocks)\.(\d+)\.")  # (blocks: RWKV's)


def _check_layer_count(hf: dict, state: dict[str, torch.Tensor], directory: Path) -> None:
    """A layer count the weight files cannot back (a typo, or a hostile n_layer of millions) is refused before
    anything is built for every layer."""
    fields = ConfigFields(hf, directory / "config.json")
    for field in LAYER_FIELDS:
        n = fields.get(field)
        if isinstance(n, int):
            held = {int(m.group(1)) for name in state for m in [_LAYER_NAME.search(name)] if m}
            if n > len(held):
                raise CheckpointError(f"{directory / 'config.json'}: {field}={n}, but the weights hold "
                                      f"{len(held)} layers; fix {field}")


def _read_tokenizer(directory: Path) -> Optional[Tokenizer]:
    try:
        return Tokenizer.from_directory(directory)
    except FileNotFoundError:
        return None  # a weights-only directory still works with token ids; to_tokens says what is missing
    except ValueError as err:  # the tokenizer's own message names the file and the field
        raise CheckpointError(str(err)) from None


# ---- config and tensors ---------------------------------------------------------------------------
def config_from_hf(hf: dict, directory: Path = Path(".")) -> DecoderConfig:
    family = _family(hf, directory)
    try:
        return family.config_from_hf(ConfigFields(hf, directory / "config.json"))
    except CheckpointError:
        raise
    except KeyError as err:
        raise CheckpointError(f"{directory / 'config.json'} lacks the field {err.args[0]!r}") from err
    except ValueError as err:
        raise CheckpointError(f"{directory / 'config.json'}: {err}") from err
    except (TypeError, AttributeError) as err:  # a field of a type FIELD_TYPES does not list yet
        raise CheckpointError(f"{directory / 'config.json'}: a field has the wrong type ({err})") from None


def _family(hf: dict, directory: Path) -> Family:
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise CheckpointError(
            f"{directory / 'config.json'}: model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]


def state_dict_from_hf(
    state: dict[str, torch.Tensor], hf: dict, cfg: DecoderConfig, directory: Path = Path("."), device=None
) -> dict[str, torch.Tensor]:
    family = _family(hf, directory)
    source = Source(state, directory, family.prefixes, device=device, config=hf)
    out = family.to_probe(source, cfg)
    source.finish()
    return out


def save_pretrained(model: HookedDecoder, directory: Union[str, Path], overwrite: bool = False) -> Path:
    """Write a directory that `from_pretrained` and `transformers.GPT2LMHeadModel` both load.

    Written to a temporary sibling first and renamed into place, so a crash never leaves a
    half-written checkpoint under the final name; an existing directory is replaced only with
    overwrite=True.
    """
    cfg = model.cfg
    table = model.positions_held
    if table is not None and table != cfg.n_ctx:  # `model.cfg.n_ctx = n` narrowed the inputs, not the weights
        raise ValueError(f"model.cfg.n_ctx={cfg.n_ctx} is not the {table} positions the model holds (pos_embed.W_pos), "
                         f"and a checkpoint must say what its weights are: set model.cfg.n_ctx = {table} before saving")
    family = family_for_config(cfg)
    # the weights, beside the buffers a format may hold too (xIELU's beta and eps); each format takes what it holds
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    params = {name: t.detach().cpu() for name, t in tensors}
    hf_state = family.to_hf(params, cfg)
    with atomic_directory(directory, overwrite=overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(family.config_to_hf(cfg, model.tokenizer), indent=2) + "\n")
        save_file(hf_state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if model.tokenizer is not None:  # with tokenizer_config.json: its BOS, EOS, padding and chat template
            model.tokenizer.save_pretrained(tmp)  # (tokenizer.json alone would reload with other BOS / EOS tokens)
    return Path(directory).expanduser()


def _rebuild_buffers(model: HookedDecoder) -> None:
    """Buffers (rotary frequencies, sinusoid tables) are derived from the config, not stored: a model
    built on the meta device gets real ones here."""
    for module in model.modules():
        if hasattr(module, "build_buffers"):
            module.build_buffers()
