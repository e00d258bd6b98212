"""What every checkpoint family shares: the tensors of a file taken one by one (Source), the activation names,
the check that a format can hold a configuration, the rotary settings' spellings, and a multimodal file's language
model."""
from __future__ import annotations

import enum
import functools
from pathlib import Path
from typing import Callable, Optional

import torch

from probe.config import Activation, DecoderConfig
from probe.config_file import CheckpointError, ConfigFields
from probe.safetensors_file import SafetensorsError, StoredTensor
from probe import checkpoint_rope


class Source:
    """A checkpoint's tensors, taken one by one with their expected shapes; leftovers are an error."""

    # Buffers some checkpoints carry (causal masks, rotary tables) that we rebuild ourselves.
    IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")

    # what a weight may be stored as; float8, integer and bool tensors are refused by name
    WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

    def __init__(self, state: dict[str, torch.Tensor], directory: Path, prefixes: tuple[str, ...], device=None,
                 config: Optional[dict] = None):
        # config: config.json's fields, for the few tensors whose layout they decide (OPT's embedding projection)
        self.directory, self.device, self.config = directory, device, {} if config is None else config
        self.state = {}
        for name, tensor in state.items():
            for prefix in prefixes:
                name = name.removeprefix(prefix)
            self.state[name] = tensor
        # a file that mixes float dtypes (a float32 norm among bfloat16 weights) is cast at load, explicitly, to
        # the dtype that holds them all (float16 + bfloat16 -> float32), so the model has one dtype, as
        # transformers gives it one; `dtype=` then converts as usual
        self.cast_to = self._one_dtype()

    def _one_dtype(self) -> Optional[torch.dtype]:
        weights = [t for n, t in self.state.items() if not n.endswith(self.IGNORED_SUFFIXES) and t.dtype in self.WEIGHT_DTYPES]
        dtypes = {t.dtype for t in weights}
        return functools.reduce(torch.promote_types, dtypes) if len(dtypes) > 1 else None

    def set_aside(self, prefixes: tuple[str, ...], strip: tuple[str, ...] = ()) -> None:
        """Forget the tensors under `prefixes` (a multimodal file's vision tower, never read), and the dtypes only
        they had (a float32 vision tower does not make a bfloat16 language model float32); then strip `strip` from the
        names left, as the constructor strips its prefixes."""
        kept = {}
        for name, tensor in self.state.items():
            if not name.startswith(prefixes):
                for prefix in strip:
                    name = name.removeprefix(prefix)
                kept[name] = tensor
        self.state = kept
        self.cast_to = self._one_dtype()

    def _pop(self, name: str):
        if name not in self.state:
            raise CheckpointError(f"checkpoint in {self.directory} is missing the tensor {name!r}")
        return self.state.pop(name)

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self._pop(name)
        if tensor.dtype not in self.WEIGHT_DTYPES:
            raise CheckpointError(
                f"tensor {name!r} in {self.directory} is stored as {str(tensor.dtype).removeprefix('torch.')}; weights "
                "must be float16, bfloat16, float32 or float64: convert the checkpoint (e.g. dequantise it)")
        if tuple(tensor.shape) != tuple(shape):  # checked before a stored tensor is read
            raise CheckpointError(
                f"tensor {name!r} in {self.directory} has shape {tuple(tensor.shape)}, but config.json implies {tuple(shape)}"
            )
        tensor = self._read(tensor)
        if tensor.is_floating_point() and tensor.numel() and not _finite(tensor):
            raise CheckpointError(f"tensor {name!r} in {self.directory} contains NaN or inf values: the checkpoint is corrupt")
        return tensor

    def take_packed(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A quantised tensor's packed bytes or scales, stored as `dtype`, read as they are (not cast)."""
        tensor = self._pop(name)
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} in {self.directory} is {str(tensor.dtype).removeprefix('torch.')} "
                                  f"{tuple(tensor.shape)}, but its quantisation implies {str(dtype).removeprefix('torch.')} "
                                  f"{tuple(shape)}")
        return self._read(tensor, cast=False)

    def take_optional(self, name: str) -> Optional[torch.Tensor]:
        tensor = self.state.pop(name, None)
        return None if tensor is None else self._read(tensor)

    def _read(self, tensor, cast: bool = True) -> torch.Tensor:
        """A tensor still in its file read now, on the loader's device, in the checkpoint's one dtype (unless not
        `cast`)."""
        if isinstance(tensor, StoredTensor):
            try:
                tensor = tensor.load()
            except (SafetensorsError, OSError) as err:
                raise CheckpointError(f"could not read the safetensors weights in {tensor.path}: {err}") from None
        if self.device is not None:
            tensor = tensor.to(self.device)
        return tensor if self.cast_to is None or not cast else tensor.to(self.cast_to)

    def finish(self) -> None:
        unexpected = sorted(k for k in self.state if not k.endswith(self.IGNORED_SUFFIXES))
        if unexpected:
            raise CheckpointError(
                f"checkpoint in {self.directory} has tensors this model type does not use: {', '.join(unexpected[:10])}"
            )


def _finite(tensor: torch.Tensor) -> bool:
    # min and max propagate NaN and reach inf: two scalars instead of a bool tensor as large as the weight
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def take_unembed(source: Source, cfg: DecoderConfig, embed: torch.Tensor,
                 names: tuple[str, ...] = ("lm_head.weight",), tied: Optional[bool] = None) -> torch.Tensor:
    """The unembedding [vocab width] (the width of `embed` as stored), under the first of `names` the file has: the
    embedding itself when tied (`tied`, else the config's; a head saved beside it must then equal it), else taken
    and checked like every other tensor."""
    name = next((n for n in names if n in source.state), names[0])
    if cfg.tied_embeddings if tied is None else tied:
        head = source.take_optional(name)
        if head is not None and not torch.equal(head, embed):
            raise CheckpointError(f"{name} in {source.directory} differs from the embedding, but the config ties them "
                                  "(tie_word_embeddings); fix the config or the file")
        return embed
    return source.take(name, (cfg.d_vocab, embed.shape[-1]))


def qkv_rows(cfg: DecoderConfig, layer: int) -> dict[str, int]:
    """The rows of each of q, k, v in `layer`'s fused projection (key/value heads for k and v)."""
    q, kv = cfg.layer_heads(layer) * cfg.d_head, cfg.layer_kv_heads(layer) * cfg.d_head
    return {"q": q, "k": kv, "v": kv}


def take_qkv(source: Source, cfg: DecoderConfig, layer: int, name: Callable[[str, str], str],
             bias: bool = False) -> dict[str, torch.Tensor]:
    """probe's fused q/k/v weight (and bias) of `layer` from a file's separate q, k and v nn.Linear layers, named
    name(which, "weight" | "bias") for which in "q", "k", "v"."""
    rows = qkv_rows(cfg, layer)
    out = {f"blocks.{layer}.attn.qkv.weight": torch.cat([source.take(name(p, "weight"), (n, cfg.d_model))
                                                          for p, n in rows.items()])}
    if bias:
        out[f"blocks.{layer}.attn.qkv.bias"] = torch.cat([source.take(name(p, "bias"), (n,)) for p, n in rows.items()])
    return out


def llama_named_to_probe(source: Source, cfg: DecoderConfig,
                         table: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """A family with Llama's tensor names: `table`'s tensors (ours -> (theirs, shape)), each layer's q, k and v from
    its separate `layers.{l}.self_attn.{q,k,v}_proj`, and the unembedding."""
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in table.items()}
    for l in range(cfg.n_layers):
        out.update(take_qkv(source, cfg, l, lambda p, kind, l=l: f"layers.{l}.self_attn.{p}_proj.{kind}", cfg.qkv_bias))
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    return out


def llama_named_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig,
                      table: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """llama_named_to_probe's inverse: the file's tensors, under `model.` and `lm_head.weight` where untied."""
    out = {f"model.{theirs}": params[ours] for ours, (theirs, _) in table.items()}
    for l in range(cfg.n_layers):
        out.update(split_qkv(params, cfg, l, lambda p, kind, l=l: f"model.layers.{l}.self_attn.{p}_proj.{kind}",
                             cfg.qkv_bias))
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def grouped_qkv(tensor: torch.Tensor, heads: int, kv_heads: int, d_head: int, to_probe: bool) -> torch.Tensor:
    """A fused q/k/v weight or bias stored per key/value head, each with its group's queries, then its key, then its
    value ([(kv_head (queries k v) d_head) ...]: Falcon; with one query per key/value head it is GPT-NeoX's, Bloom's
    and GPTBigCode's [(head (q k v) d_head) ...]), as probe's [(q heads, k heads, v heads) d_head ...], or back."""
    group = heads // kv_heads if kv_heads else 1  # (a layer pruned to no heads: nothing to regroup)
    if to_probe:
        grouped = tensor.unflatten(0, (kv_heads, group + 2, d_head))
        return torch.cat([grouped[:, :group].flatten(0, 2), grouped[:, -2].flatten(0, 1), grouped[:, -1].flatten(0, 1)])
    q, k, v = tensor.split([heads * d_head, kv_heads * d_head, kv_heads * d_head])
    return torch.cat([q.unflatten(0, (kv_heads, group, d_head)), k.unflatten(0, (kv_heads, 1, d_head)),
                      v.unflatten(0, (kv_heads, 1, d_head))], dim=1).flatten(0, 2)


def split_qkv(params: dict[str, torch.Tensor], cfg: DecoderConfig, layer: int, name: Callable[[str, str], str],
              bias: bool = False) -> dict[str, torch.Tensor]:
    """take_qkv's inverse: `layer`'s separate q, k and v tensors under the file's names."""
    sizes, out = list(qkv_rows(cfg, layer).values()), {}
    for kind in ("weight", "bias") if bias else ("weight",):
        for p, tensor in zip("qkv", params[f"blocks.{layer}.attn.qkv.{kind}"].split(sizes)):
            out[name(p, kind)] = tensor
    return out


def copy_shared_norm(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> None:
    """A parallel block whose one norm both sublayers read (Phi, GPT-J): ln2 gets a copy of ln1's weights, as
    transformer-lens loads it (separate tensors: an edit of one leaves the other)."""
    for l in range(cfg.n_layers):
        for p in "wb":
            params[f"blocks.{l}.ln2.{p}"] = params[f"blocks.{l}.ln1.{p}"].clone()


def _norm_bias_names(cfg: DecoderConfig) -> list[str]:
    return ["ln_final.b"] + [f"blocks.{l}.{norm}.b" for l in range(cfg.n_layers) for norm in ("ln1", "ln2")]


def add_zero_norm_biases(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> None:
    """A format whose LayerNorms have no biases (MPT's, Cohere's): probe's LayerNorms get zeros."""
    params.update({name: torch.zeros_like(params["ln_final.w"]) for name in _norm_bias_names(cfg)})


def check_zero_norm_biases(params: dict[str, torch.Tensor], cfg: DecoderConfig, a_checkpoint: str) -> None:
    """Before writing such a format (`a_checkpoint`: "an MPT checkpoint"): every norm bias must still be zero."""
    moved = [name for name in _norm_bias_names(cfg) if params[name].any()]
    if moved:
        raise ValueError(f"{a_checkpoint}'s LayerNorms have no biases, but this model's {moved[0]} is not zero; "
                         "save model.state_dict() with safetensors instead")


def check_shared_norm(params: dict[str, torch.Tensor], cfg: DecoderConfig, family: str) -> None:
    """Before writing such a block's one norm: ln1 and ln2 must still agree."""
    for l in range(cfg.n_layers):
        if not all(torch.equal(params[f"blocks.{l}.ln1.{p}"], params[f"blocks.{l}.ln2.{p}"]) for p in "wb"):
            raise ValueError(f"a {family} checkpoint has one norm per block, which attention and the MLP share, but "
                             f"block {l}'s ln1 and ln2 differ: give ln2 ln1's weights, or save model.state_dict() with "
                             "safetensors")


GPT_ACTIVATIONS = {"gelu_new": Activation.GELU_TANH, "gelu_pytorch_tanh": Activation.GELU_TANH, "gelu_fast": Activation.GELU_TANH,
                   "gelu": Activation.GELU, "relu": Activation.RELU, "silu": Activation.SILU, "swish": Activation.SILU,
                   "relu2": Activation.RELU2}


def activation_of(name: str, table: dict[str, Activation]) -> Activation:
    if name not in table:
        raise CheckpointError(f"activation {name!r} is not supported; supported: {', '.join(table)}")
    return table[name]


GPT_ACTIVATION_NAMES = {Activation.GELU_TANH: "gelu_new", Activation.GELU: "gelu", Activation.RELU: "relu", Activation.SILU: "silu",
                        Activation.RELU2: "relu2", Activation.XIELU: "xielu"}


def with_defaults(hf: dict, **defaults) -> dict:
    """config.json's fields with the family's own defaults for those it leaves out (those transformers' config class
    of the family fills in: Qwen3's head_dim 128, Mixtral's rope_theta 1e6, ...), read and checked as the file's."""
    fields = {**defaults, **hf}
    return ConfigFields(fields, hf.path, hf.prefix) if isinstance(hf, ConfigFields) else fields


def with_fields(hf: dict, **fields) -> dict:
    """config.json's fields with some replaced by a family's own reading of them, read and checked as the file's."""
    merged = {**hf, **fields}
    return ConfigFields(merged, hf.path, hf.prefix) if isinstance(hf, ConfigFields) else merged


def special_token_ids(tokenizer) -> dict:
    """config.json's bos/eos/pad ids from the model's tokenizer (None without one): written by formats whose config
    classes would otherwise fill in their released models' ids, which lie outside a small vocabulary."""
    return {f"{kind}_token_id": None if tokenizer is None else getattr(tokenizer, f"{kind}_id")
            for kind in ("bos", "eos", "pad")}


def require_fields(cfg: DecoderConfig, family: str, **wanted) -> None:
    """Refuse a config the format cannot hold: `wanted` gives each field's value (or a set of values) in the
    format; fields only some formats hold (`PLAIN_FIELDS`) must be at their defaults unless `wanted` says otherwise."""
    wanted = {**PLAIN_FIELDS, **wanted}
    wrong = {k: getattr(cfg, k) for k, v in wanted.items()
             if not (getattr(cfg, k) in v if isinstance(v, (set, frozenset)) else getattr(cfg, k) == v)}
    wrong = {k: v.value if isinstance(v, enum.Enum) else v for k, v in wrong.items()}
    if wrong:
        raise ValueError(f"a {family} checkpoint cannot hold this model: {', '.join(f'{k}={v}' for k, v in wrong.items())}")


# fields only some formats hold (Gemma's, Mistral's windows, Qwen3's q/k norms): every other needs their defaults
PLAIN_FIELDS = dict(final_eps=None, scale_embed=False, attn_scale_dim=None, attn_softcap=None, logit_softcap=None, sliding_window=None,
              sliding_layers=None, qk_norm=False, attn_scale_by_layer=False, unembed_bias=False, norm_weights=True,
              rotary_adjacent_pairs=False, rotary_clockwise=False, sub_norms=False, sliding_rotary_base=None, qk_norm_over_heads=False, input_norms=True,
                    embed_norm=False, experts=None, rotary_layers=None, clip_qkv=None, attn_sinks=False,
                    attn_output_gate=False, output_gate=None, sliding_rotary_dim=None, linear_attention=None, qk_norm_after_rope=False, latent_attention=None, state_space=None,
                    parallel_state_space=None,
                    short_conv=None, rg_lru=None, sublayers=None, global_layers=None, shared_kv=None, per_layer_inputs=None,
                    value_norm=False, layer_scalars=False, chunked_attention=None, shared_blocks=None, rwkv=None, mixture_of_attention=None,
                    # an activation with parameters of its own (xIELU): only Apertus's format holds them
                    activation=frozenset(a for a in Activation if not a.learned))

# rotary settings and layer kinds live in probe.checkpoint_rope; the families read them from here too
LAYER_KINDS, layer_kinds, layer_types_to_hf = checkpoint_rope.LAYER_KINDS, checkpoint_rope.layer_kinds, checkpoint_rope.layer_types_to_hf
rope_by_layer_kind, rope_from_hf, rope_to_hf = checkpoint_rope.rope_by_layer_kind, checkpoint_rope.rope_from_hf, checkpoint_rope.rope_to_hf


# ---- multimodal checkpoints, read for their language model ---------------------------------------------------
VISION_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_config(hf: dict, family: str, default_tied: bool) -> ConfigFields:
    """A multimodal config.json's language model settings (text_config), tied as the top level says, else as they
    say, else as the family's default."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"a multimodal {family} config.json needs text_config, the language model's settings")
    tied = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", default_tied))
    return ConfigFields({**text, "tie_word_embeddings": tied}, getattr(hf, "path", Path("config.json")), "text_config.")


def language_model_of(family: str, text_family: str, config_from_text: Callable, to_probe: Callable,
                      default_tied: bool) -> tuple[Callable, Callable, Callable]:
    """A multimodal format's (config_from_hf, config_to_hf, to_probe), for its checkpoints.Family: the language model
    read from text_config by its text-only family's functions, the vision tower and projector never read, and saving
    refused (the text-only `text_family` holds the model)."""
    def config_from_hf(hf: dict) -> DecoderConfig:
        return config_from_text(text_config(hf, family, default_tied))

    def config_to_hf(cfg: DecoderConfig, tokenizer) -> dict:
        raise ValueError(f"probe keeps a multimodal {family}'s language model only; it saves as the text-only "
                         f"{text_family}, which transformers loads")

    def read(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        for name in [n for n in source.state if n.startswith(VISION_PARTS)]:
            del source.state[name]  # never read: the file's vision weights stay on disk
        return to_probe(source, cfg)

    return config_from_hf, config_to_hf, read


def rename_layer_weights(state: dict, mapping: dict[str, str], n_layers: int, prefix: str, module: str) -> None:
    """Rename each layer's `{prefix}layers.{l}.{module}.{old}.weight` to `...{new}.weight` in place, where present
    (a Llama-like format's own names for a few tensors: HunYuan's q/k norms, NanoChat's MLP)."""
    for l in range(n_layers):
        for old, new in mapping.items():
            name = f"{prefix}layers.{l}.{module}.{old}.weight"
            if name in state:
                state[f"{prefix}layers.{l}.{module}.{new}.weight"] = state.pop(name)
