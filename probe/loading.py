"""Loading and saving Hugging Face GPT-2 checkpoints (safetensors first; never unpickling code)."""
from __future__ import annotations

import dataclasses

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch
from safetensors.torch import save_file

from probe.checkpoints import FAMILIES, CheckpointError, Family, Source, family_for_config
from probe.config import DecoderConfig
from probe.config_file import ConfigFields, read_json_object
from probe.safetensors_file import SafetensorsError, StoredTensor, read_header
from probe.io import atomic_directory
from probe.tokenizer import Tokenizer

if TYPE_CHECKING:  # the model class is passed in (HookedDecoder.from_pretrained gives its own): no import circle
    from probe.model import HookedDecoder

# short names, as transformer-lens spells them -> hub repositories
SHORT_NAMES = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "distilgpt2": "distilbert/distilgpt2",
    **{f"pythia-{size}{dedup}": f"EleutherAI/pythia-{size}{dedup}"
       for size in ("14m", "31m", "70m", "160m", "410m", "1b", "1.4b", "2.8b", "6.9b", "12b")
       for dedup in ("", "-deduped")},
    # gated on the hub: accept Google's licence there, then `hf auth login` (or pass a downloaded directory)
    **{f"{name}{it}": f"google/{name}{it}" for name in ("gemma-2b", "gemma-7b", "gemma-2-2b", "gemma-2-9b", "gemma-2-27b",
                                                         "gemma-3-270m")
       for it in ("", "-it")},
    **{f"gemma-3-{size}-{kind}": f"google/gemma-3-{size}-{kind}" for size in ("1b", "4b", "12b", "27b")
       for kind in ("pt", "it")},
}
_STANFORD_RUNS = [(size, letter, f"{run}-gpt2-{size}-x{seed}")
                  for size, runs in (("small", ("alias", "battlestar", "caprica", "darkmatter", "expanse")),
                                     ("medium", ("arwen", "beren", "celebrimbor", "durin", "eowyn")))
                  for letter, run, seed in zip("abcde", runs, (21, 49, 81, 343, 777))]
# transformer-lens's other spellings of the same checkpoints, and its short names for other supported families
SHORT_NAMES.update({
    "gpt2-small": "openai-community/gpt2",
    **{alias: "distilbert/distilgpt2" for alias in ("distillgpt2", "distill-gpt2", "distil-gpt2", "gpt2-xs")},
    # Pythia's first names (sizes counted without the embeddings), its v0 runs, and plain "pythia" for the smallest
    **{f"pythia-{old}{kind}": f"EleutherAI/pythia-{size}{kind}"
       for old, size in (("19m", "70m"), ("125m", "160m"), ("350m", "410m"), ("800m", "1b"), ("1.3b", "1.4b"),
                         ("2.7b", "2.8b"), ("6.7b", "6.9b"), ("13b", "12b"))
       for kind in ("", "-deduped", "-v0", "-deduped-v0")},
    **{f"pythia-{size}{kind}": f"EleutherAI/pythia-{size}{kind}"
       for size in ("70m", "160m", "410m", "1b", "1.4b", "2.8b", "6.9b", "12b") for kind in ("-v0", "-deduped-v0")},
    "pythia": "EleutherAI/pythia-70m", "pythia-v0": "EleutherAI/pythia-70m-v0",
    **{f"pythia-{size}-seed{seed}": f"EleutherAI/pythia-160m-seed{seed}" for size in ("160m", "125m") for seed in (1, 2, 3)},
    # Stanford CRFM's GPT-2 runs (five seeds per size), each with its training checkpoints as revisions
    **{f"stanford-gpt2-{size}-{letter}": f"stanford-crfm/{run}" for size, letter, run in _STANFORD_RUNS},
    **{run: f"stanford-crfm/{run}" for _, _, run in _STANFORD_RUNS},
    **{f"Llama-2-{size}{chat}": f"meta-llama/Llama-2-{size}{chat}-hf" for size in ("7b", "13b")
       for chat in ("", "-chat")},
    "Llama-2-70b-chat": "meta-llama/Llama-2-70b-chat-hf",
    "mistral-7b": "mistralai/Mistral-7B-v0.1", "mistral-7b-instruct": "mistralai/Mistral-7B-Instruct-v0.1",
    **{f"qwen1.5-{size}{chat.lower()}": f"Qwen/Qwen1.5-{size.upper()}{chat}"
       for size in ("0.5b", "1.8b", "4b", "7b", "14b") for chat in ("", "-Chat")},
    **{f"qwen2-{size}{it.lower()}": f"Qwen/Qwen2-{size.upper()}{it}" for size in ("0.5b", "1.5b", "7b")
       for it in ("", "-Instruct")},
    **{f"qwen2.5-{size}{it.lower()}": f"Qwen/Qwen2.5-{size.upper()}{it}"
       for size in ("0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b") for it in ("", "-Instruct")},
    **{f"qwen3-{size}": f"Qwen/Qwen3-{size.upper()}" for size in ("0.6b", "1.7b", "4b", "8b", "14b")},
    "qwen3-0.6b-base": "Qwen/Qwen3-0.6B-Base",
    "olmo-1b": "allenai/OLMo-1B-hf", "olmo-7b": "allenai/OLMo-7B-hf",
    "olmo-2-1b": "allenai/OLMo-2-0425-1B", "olmo-2-7b": "allenai/OLMo-2-1124-7B",
    # GPT-Neo (EleutherAI), the TinyStories models (GPT-Neo's architecture; one repository is spelled "Instuct" on
    # the hub) and OPT (Meta), with transformer-lens's aliases for each
    **{alias: f"EleutherAI/gpt-neo-{size}" for size, aliases in (("125M", ("small", "neo-small", "neo")),
                                                                  ("1.3B", ("medium", "neo-medium")),
                                                                  ("2.7B", ("large", "neo-large")))
       for alias in (f"gpt-neo-{size}", *(a if a.startswith("neo") else f"gpt-neo-{a}" for a in aliases))},
    **{f"tiny-stories{kind.lower()}-{size}": f"roneneldan/TinyStories{kind}-{size}"
       for kind in ("", "-Instruct") for size in ("1M", "3M", "8M", "28M", "33M")},
    "tiny-stories-1L-21M": "roneneldan/TinyStories-1Layer-21M", "tiny-stories-2L-33M": "roneneldan/TinyStories-2Layers-33M",
    "tiny-stories-instruct-1L-21M": "roneneldan/TinyStories-Instuct-1Layer-21M",
    "tiny-stories-instruct-2L-33M": "roneneldan/TinyStories-Instruct-2Layers-33M",
    **{alias: f"facebook/opt-{size}" for size, aliases in (("125m", ("small", "")), ("1.3b", ("medium",)),
                                                            ("2.7b", ("large",)), ("6.7b", ("xl",)), ("13b", ("xxl",)),
                                                            ("30b", ("xxxl",)), ("66b", ("xxxxl",)))
       for alias in (f"opt-{size}", *(f"opt-{a}" if a else "opt" for a in aliases))},
    **{f"phi-{v}": f"microsoft/phi-{v}" for v in ("1", "1_5", "2")},  # Phi (Microsoft), TL's names
    "phi-3": "microsoft/Phi-3-mini-4k-instruct", "phi-4": "microsoft/phi-4",
    **{alias: "EleutherAI/gpt-j-6B" for alias in ("gpt-j-6B", "gpt-j", "gptj")},
    # Neel Nanda's toy models, in transformer-lens's own format (probe.checkpoint_tl); TL's names for them
    **{f"attn-only-{n}l": f"NeelNanda/Attn_Only_{n}L512W_C4_Code" for n in range(1, 5)},
    **{f"gelu-{n}l": f"NeelNanda/GELU_{n}L512W_C4_Code" for n in range(1, 5)},
    "attn-only-2l-demo": "NeelNanda/Attn-Only-2L512W-Shortformer-6B-big-lr",
    "redwood_attn_2l": "ArthurConmy/redwood_attn_2l",  # Redwood's attention-only model, the same format (ACDC's)
    # SoLU-LN MLPs (act_fn="solu_ln"): the C4 + code runs by width, two Wikipedia fine-tunes, and the older Pile runs
    # (repositories named _old, whose tensors TL converts on loading: probe.checkpoint_tl.convert_solu_old)
    **{f"solu-{n}l{alias}": f"NeelNanda/SoLU_{n}L{width}W_C4_Code"
       for n, width in ((1, 512), (2, 512), (3, 512), (4, 512), (6, 768), (8, 1024), (10, 1280), (12, 1536))
       for alias in ("", "-new", "-c4-code")},
    **{f"solu-{n}l-{alias}": f"NeelNanda/SoLU_{n}L512W_Wiki_Finetune" for n in (1, 4)
       for alias in ("wiki", "wiki-finetune", "finetune")},
    **{f"solu-{n}l-{alias}": f"NeelNanda/SoLU_{n}L_v{version}_old"
       for n, version in ((1, 9), (2, 10), (4, 11), (6, 13), (8, 21), (10, 22), (12, 23)) for alias in ("pile", "old")},
})
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
    architectures = hf_config.get("architectures") or [None]  # transformer-lens code reads cfg.original_architecture
    cfg = dataclasses.replace(cfg, original_architecture=architectures[0])
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
_LAYER_NAME = re.compile(r"(?:^|\.)(?:h|layers)\.(\d+)\.")


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
    params = {name: p.detach().cpu() for name, p in model.named_parameters(remove_duplicate=False)}
    hf_state = family.to_hf(params, cfg)
    with atomic_directory(directory, overwrite=overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(family.config_to_hf(cfg, model.tokenizer), indent=2) + "\n")
        save_file(hf_state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if model.tokenizer is not None:
            model.tokenizer.save(tmp)
    return Path(directory).expanduser()


def _rebuild_buffers(model: HookedDecoder) -> None:
    """Buffers (rotary frequencies, sinusoid tables) are derived from the config, not stored: a model
    built on the meta device gets real ones here."""
    for module in model.modules():
        if hasattr(module, "build_buffers"):
            module.build_buffers()
