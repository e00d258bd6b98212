"""Loading and saving Hugging Face GPT-2 checkpoints (safetensors first; never unpickling code)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from probe.config import Activation, DecoderConfig
from probe.model import HookedDecoder
from probe.tokenizer import Tokenizer

GPT2_FAMILY = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "distilgpt2": "distilbert/distilgpt2",
}
SUPPORTED_MODEL_TYPES = ("gpt2",)
HUB_FILES = ["config.json", "model.safetensors", "tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"]
# Buffers some GPT-2 checkpoints carry: the causal mask and its fill value, which we build ourselves.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor and what to do."""


def load_pretrained(
    name_or_path: Union[str, Path],
    device: Optional[Union[str, torch.device]] = None,
    dtype: Optional[torch.dtype] = None,
) -> HookedDecoder:
    directory = resolve_checkpoint(name_or_path)
    hf_config = _read_json(directory / "config.json")
    cfg = config_from_hf(hf_config, directory)
    state = _read_weights(directory)
    tokenizer = _read_tokenizer(directory)
    model = HookedDecoder(cfg, tokenizer=tokenizer)
    model.load_state_dict(state_dict_from_hf(state, cfg, directory), strict=True)
    return model.to(device=device, dtype=dtype)


# ---- finding the files ---------------------------------------------------------------------------
def resolve_checkpoint(name_or_path: Union[str, Path]) -> Path:
    """A local directory as given, or a GPT-2 family name fetched from (or found in the cache of) the hub."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    if name in GPT2_FAMILY:
        return _from_hub(GPT2_FAMILY[name])
    if path.exists():
        raise CheckpointError(f"{path} is a file; pass the checkpoint directory holding config.json")
    if any(sep in name for sep in ("/", "\\")) or name.startswith((".", "~")):
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    raise CheckpointError(
        f"{name!r} is neither a local checkpoint directory nor a supported model name; "
        f"supported names: {', '.join(GPT2_FAMILY)}; or pass a directory holding config.json and model.safetensors"
    )


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:  # the local cache first: works offline and costs no request
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as err:
        raise CheckpointError(
            f"could not download {repo_id} from the Hugging Face hub, and it is not in the local cache "
            f"({type(err).__name__}: {err}). On a machine with network access run "
            f"`hf download {repo_id}` (or save_pretrained it), then pass that local directory "
            f"to from_pretrained."
        ) from err


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: a checkpoint directory needs config.json")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    try:
        if single.is_file():
            return load_file(str(single))
        if index.is_file():
            shards = sorted(set(_read_json(index)["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(load_file(str(directory / shard)))
            return state
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"could not read the safetensors weights in {directory}: {err}") from err
    bin_path = directory / "pytorch_model.bin"
    if bin_path.is_file():
        try:  # weights_only: a pickle that would construct arbitrary objects or run code is refused
            return torch.load(str(bin_path), map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(
                f"refused to load {bin_path}: it is not a plain tensor checkpoint ({type(err).__name__}: {err}). "
                "Only safetensors or weights-only pickles are read; convert it to model.safetensors"
            ) from err
    raise CheckpointError(f"no weights in {directory}: expected model.safetensors (or pytorch_model.bin)")


def _read_tokenizer(directory: Path) -> Optional[Tokenizer]:
    try:
        return Tokenizer.from_directory(directory)
    except FileNotFoundError:
        return None  # a weights-only directory still works with token ids; to_tokens says what is missing


# ---- Hugging Face GPT-2 <-> probe ----------------------------------------------------------------
def config_from_hf(hf: dict, directory: Path = Path(".")) -> DecoderConfig:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{directory / 'config.json'}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not hf.get("scale_attn_weights", True):
        raise CheckpointError(f"{directory / 'config.json'}: scale_attn_weights=false is not supported")
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise CheckpointError(f"{directory / 'config.json'}: scale_attn_by_inverse_layer_idx=true is not supported")
    activation = hf.get("activation_function", "gelu_new")
    activation = {"gelu_pytorch_tanh": "gelu_new"}.get(activation, activation)
    try:
        return DecoderConfig(
            n_layers=hf["n_layer"],
            d_model=hf["n_embd"],
            n_heads=hf["n_head"],
            d_mlp=hf.get("n_inner") or 4 * hf["n_embd"],
            d_vocab=hf["vocab_size"],
            n_ctx=hf["n_positions"],
            eps=hf.get("layer_norm_epsilon", 1e-5),
            activation=Activation(activation),
        )
    except KeyError as err:
        raise CheckpointError(f"{directory / 'config.json'} lacks the field {err.args[0]!r}") from err
    except ValueError as err:
        raise CheckpointError(f"{directory / 'config.json'}: {err}") from err


def _hf_names(cfg: DecoderConfig) -> dict[str, tuple[str, bool]]:
    """probe parameter name -> (Hugging Face name, whether HF stores it transposed as a Conv1D)."""
    names = {
        "embed.W_E": ("wte.weight", False),
        "pos_embed.W_pos": ("wpe.weight", False),
        "ln_final.w": ("ln_f.weight", False),
        "ln_final.b": ("ln_f.bias", False),
    }
    for layer in range(cfg.n_layers):
        ours, theirs = f"blocks.{layer}", f"h.{layer}"
        names.update({
            f"{ours}.ln1.w": (f"{theirs}.ln_1.weight", False),
            f"{ours}.ln1.b": (f"{theirs}.ln_1.bias", False),
            f"{ours}.attn.qkv.weight": (f"{theirs}.attn.c_attn.weight", True),
            f"{ours}.attn.qkv.bias": (f"{theirs}.attn.c_attn.bias", False),
            f"{ours}.attn.out.weight": (f"{theirs}.attn.c_proj.weight", True),
            f"{ours}.attn.out.bias": (f"{theirs}.attn.c_proj.bias", False),
            f"{ours}.ln2.w": (f"{theirs}.ln_2.weight", False),
            f"{ours}.ln2.b": (f"{theirs}.ln_2.bias", False),
            f"{ours}.mlp.fc_in.weight": (f"{theirs}.mlp.c_fc.weight", True),
            f"{ours}.mlp.fc_in.bias": (f"{theirs}.mlp.c_fc.bias", False),
            f"{ours}.mlp.fc_out.weight": (f"{theirs}.mlp.c_proj.weight", True),
            f"{ours}.mlp.fc_out.bias": (f"{theirs}.mlp.c_proj.bias", False),
        })
    return names


def state_dict_from_hf(state: dict[str, torch.Tensor], cfg: DecoderConfig, directory: Path = Path(".")) -> dict[str, torch.Tensor]:
    state = {k.removeprefix("transformer."): v for k, v in state.items()}
    shapes = _param_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    for ours, (theirs, transposed) in _hf_names(cfg).items():
        if theirs not in state:
            raise CheckpointError(f"checkpoint in {directory} is missing the tensor {theirs!r}")
        tensor = state.pop(theirs)
        tensor = tensor.T if transposed else tensor
        if tuple(tensor.shape) != shapes[ours]:
            shown = tuple(tensor.T.shape) if transposed else tuple(tensor.shape)
            want = tuple(reversed(shapes[ours])) if transposed else shapes[ours]
            raise CheckpointError(
                f"tensor {theirs!r} in {directory} has shape {shown}, but config.json implies {want}"
            )
        out[ours] = tensor.contiguous()
    tied = state.pop("lm_head.weight", None)
    if tied is not None and not torch.equal(tied, out["embed.W_E"]):
        raise CheckpointError(f"lm_head.weight in {directory} differs from wte.weight; untied GPT-2 heads are not supported")
    unexpected = [k for k in state if not k.endswith(IGNORED_SUFFIXES)]
    if unexpected:
        raise CheckpointError(f"checkpoint in {directory} has tensors a GPT-2 does not: {', '.join(sorted(unexpected)[:10])}")
    if cfg.tied_embeddings:
        out["unembed.weight"] = out["embed.W_E"]
    return out


def _param_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in HookedDecoder(cfg).named_parameters(remove_duplicate=False)}


def config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    if not cfg.tied_embeddings:
        raise ValueError("a GPT-2 checkpoint ties the unembedding to the embedding; this model's are untied")
    special = tokenizer.bos_id if tokenizer is not None else cfg.d_vocab - 1
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": cfg.n_layers,
        "n_embd": cfg.d_model,
        "n_head": cfg.n_heads,
        "n_inner": cfg.d_mlp,
        "vocab_size": cfg.d_vocab,
        "n_positions": cfg.n_ctx,
        "layer_norm_epsilon": cfg.eps,
        "activation_function": cfg.activation.value,
        "bos_token_id": special,
        "eos_token_id": special,
        "tie_word_embeddings": True,
    }


def save_pretrained(model: HookedDecoder, directory: Union[str, Path], overwrite: bool = False) -> Path:
    """Write a directory that `from_pretrained` and `transformers.GPT2LMHeadModel` both load.

    Written to a temporary sibling first and renamed into place, so a crash never leaves a
    half-written checkpoint under the final name; an existing directory is replaced only with
    overwrite=True.
    """
    cfg = model.cfg
    if cfg.d_head * cfg.n_heads != cfg.d_model:
        raise ValueError("a GPT-2 checkpoint needs n_heads * d_head == d_model")
    directory = Path(directory).expanduser()
    if directory.exists() and not overwrite:
        raise FileExistsError(f"{directory} already exists; choose a new directory or pass overwrite=True")
    directory.parent.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    hf_state = {}
    for ours, (theirs, transposed) in _hf_names(cfg).items():
        tensor = params[ours].detach()
        hf_state[theirs] = (tensor.T if transposed else tensor).contiguous().cpu()
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config_to_hf(cfg, model.tokenizer), indent=2) + "\n")
        save_file(hf_state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if model.tokenizer is not None:
            model.tokenizer.save(tmp)
        if directory.exists():
            shutil.rmtree(directory) if directory.is_dir() else directory.unlink()
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory
