"""Hugging Face checkpoint families: how each one's config and tensor names map onto DecoderConfig.

One small table of functions per family; loading.py does the file handling for all of them.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from einops import rearrange

from probe.config import Activation, DecoderConfig, Norm, NormPlacement, Positions, RotaryScaling
from probe.tokenizer import Tokenizer


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor and what to do."""


class Source:
    """A checkpoint's tensors, taken one by one with their expected shapes; leftovers are an error."""

    # Buffers some checkpoints carry (causal masks, rotary tables) that we rebuild ourselves.
    IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")

    def __init__(self, state: dict[str, torch.Tensor], directory: Path, prefixes: tuple[str, ...]):
        self.directory = directory
        self.state = {}
        for name, tensor in state.items():
            for prefix in prefixes:
                name = name.removeprefix(prefix)
            self.state[name] = tensor

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.state:
            raise CheckpointError(f"checkpoint in {self.directory} is missing the tensor {name!r}")
        tensor = self.state.pop(name)
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} in {self.directory} has shape {tuple(tensor.shape)}, but config.json implies {tuple(shape)}"
            )
        if tensor.is_floating_point() and tensor.numel() and not _finite(tensor):
            raise CheckpointError(f"tensor {name!r} in {self.directory} contains NaN or inf values: the checkpoint is corrupt")
        return tensor

    def take_optional(self, name: str) -> Optional[torch.Tensor]:
        return self.state.pop(name, None)

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


def _take_unembed(source: Source, cfg: DecoderConfig, embed: torch.Tensor,
                  names: tuple[str, ...] = ("lm_head.weight",)) -> torch.Tensor:
    """The unembedding [vocab d_model], under the first of `names` the file has: the embedding itself when tied
    (a head saved beside it must then equal it), else taken and checked like every other tensor."""
    name = next((n for n in names if n in source.state), names[0])
    if cfg.tied_embeddings:
        head = source.take_optional(name)
        if head is not None and not torch.equal(head, embed):
            raise CheckpointError(f"{name} in {source.directory} differs from the embedding, but the config ties them "
                                  "(tie_word_embeddings); fix the config or the file")
        return embed
    return source.take(name, (cfg.d_vocab, cfg.d_model))


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    prefixes: tuple[str, ...]  # stripped from tensor names (LM-head wrappers add them)
    config_from_hf: Callable[[dict], DecoderConfig]
    config_to_hf: Callable[[DecoderConfig, Optional[Tokenizer]], dict]
    to_probe: Callable[[Source, DecoderConfig], dict[str, torch.Tensor]]
    to_hf: Callable[[dict[str, torch.Tensor], DecoderConfig], dict[str, torch.Tensor]]


# ---- GPT-2 and GPT-1: Conv1D layers, stored [in, out] -----------------------------------------
GPT_ACTIVATIONS = {"gelu_new": Activation.GELU_TANH, "gelu_pytorch_tanh": Activation.GELU_TANH, "gelu_fast": Activation.GELU_TANH,
                   "gelu": Activation.GELU, "relu": Activation.RELU, "silu": Activation.SILU, "swish": Activation.SILU}


def _activation(name: str, table: dict[str, Activation]) -> Activation:
    if name not in table:
        raise CheckpointError(f"activation {name!r} is not supported; supported: {', '.join(table)}")
    return table[name]


def gpt2_config(hf: dict) -> DecoderConfig:
    if not hf.get("scale_attn_weights", True):
        raise CheckpointError("scale_attn_weights=false is not supported")
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise CheckpointError("scale_attn_by_inverse_layer_idx=true is not supported")
    heads = hf.get("heads_per_layer")  # written by probe for structurally pruned models
    return DecoderConfig(
        n_layers=hf["n_layer"], d_model=hf["n_embd"], n_heads=hf["n_head"], d_mlp=hf.get("n_inner") or 4 * hf["n_embd"],
        d_vocab=hf["vocab_size"], n_ctx=hf["n_positions"], eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=_activation(hf.get("activation_function", "gelu_new"), GPT_ACTIVATIONS),
        heads_per_layer=None if heads is None else tuple(heads),
    )


def gpt1_config(hf: dict) -> DecoderConfig:
    return DecoderConfig(
        n_layers=hf["n_layer"], d_model=hf["n_embd"], n_heads=hf["n_head"], d_vocab=hf["vocab_size"],
        n_ctx=hf["n_positions"], eps=hf.get("layer_norm_epsilon", 1e-5),
        # GPT-1's "gelu" is the tanh approximation (transformers maps it to gelu_new)
        activation=_activation(hf.get("afn", "gelu"), {**GPT_ACTIVATIONS, "gelu": Activation.GELU_TANH}),
        norm_placement=NormPlacement.POST, final_norm=False,
    )


_GPT_ACTIVATION_NAMES = {Activation.GELU_TANH: "gelu_new", Activation.GELU: "gelu", Activation.RELU: "relu", Activation.SILU: "silu"}


def _require(cfg: DecoderConfig, family: str, **wanted) -> None:
    """Refuse a config the format cannot hold: `wanted` gives each field's value (or a set of values) in the
    format; fields only some formats hold (`_PLAIN`) must be at their defaults unless `wanted` says otherwise."""
    wanted = {**_PLAIN, **wanted}
    wrong = {k: getattr(cfg, k) for k, v in wanted.items()
             if not (getattr(cfg, k) in v if isinstance(v, (set, frozenset)) else getattr(cfg, k) == v)}
    wrong = {k: v.value if isinstance(v, enum.Enum) else v for k, v in wrong.items()}
    if wrong:
        raise ValueError(f"a {family} checkpoint cannot hold this model: {', '.join(f'{k}={v}' for k, v in wrong.items())}")


# fields only some formats hold (Gemma's, Mistral's windows, Qwen3's q/k norms): every other needs their defaults
_PLAIN = dict(scale_embed=False, attn_scale_dim=None, attn_softcap=None, logit_softcap=None, sliding_window=None,
              sliding_layers=None, qk_norm=False)

def gpt2_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    _require(cfg, "GPT-2", norm=Norm.LAYER, norm_placement=NormPlacement.PRE, final_norm=True, positions=Positions.LEARNED,
             gated_mlp=False, n_kv_heads=cfg.n_heads, d_head=cfg.d_model // cfg.n_heads, qkv_bias=True, out_bias=True,
             mlp_bias=True, tied_embeddings=True)
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise ValueError("a GPT-2 checkpoint needs n_heads * d_head == d_model")
    special = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else cfg.d_vocab - 1
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": cfg.n_layers, "n_embd": cfg.d_model,
        "n_head": cfg.n_heads, "n_inner": cfg.d_mlp, "vocab_size": cfg.d_vocab, "n_positions": cfg.n_ctx,
        "layer_norm_epsilon": cfg.eps, "activation_function": _GPT_ACTIVATION_NAMES[cfg.activation],
        "bos_token_id": special, "eos_token_id": special, "tie_word_embeddings": True,
        # transformers cannot load a pruned model (its layers differ in width); probe can
        **({"heads_per_layer": list(cfg.heads_per_layer)} if cfg.heads_per_layer is not None else {}),
    }


def _gpt_names(embed: str, pos: str, final_norm: bool):
    def names(cfg: DecoderConfig):
        d, m, v = cfg.d_model, cfg.d_mlp, cfg.d_vocab
        # ours -> (theirs, their shape, stored transposed)
        table = {"embed.W_E": (embed, (v, d), False), "pos_embed.W_pos": (pos, (cfg.n_ctx, d), False)}
        for l in range(cfg.n_layers):
            o, t, a = f"blocks.{l}", f"h.{l}", cfg.layer_heads(l) * cfg.d_head  # a: this layer's attention width
            table.update({
                f"{o}.ln1.w": (f"{t}.ln_1.weight", (d,), False), f"{o}.ln1.b": (f"{t}.ln_1.bias", (d,), False),
                f"{o}.attn.qkv.weight": (f"{t}.attn.c_attn.weight", (d, 3 * a), True),
                f"{o}.attn.qkv.bias": (f"{t}.attn.c_attn.bias", (3 * a,), False),
                f"{o}.attn.out.weight": (f"{t}.attn.c_proj.weight", (a, d), True),
                f"{o}.attn.out.bias": (f"{t}.attn.c_proj.bias", (d,), False),
                f"{o}.ln2.w": (f"{t}.ln_2.weight", (d,), False), f"{o}.ln2.b": (f"{t}.ln_2.bias", (d,), False),
                f"{o}.mlp.fc_in.weight": (f"{t}.mlp.c_fc.weight", (d, m), True),
                f"{o}.mlp.fc_in.bias": (f"{t}.mlp.c_fc.bias", (m,), False),
                f"{o}.mlp.fc_out.weight": (f"{t}.mlp.c_proj.weight", (m, d), True),
                f"{o}.mlp.fc_out.bias": (f"{t}.mlp.c_proj.bias", (d,), False),
            })
        if final_norm:
            table.update({"ln_final.w": ("ln_f.weight", (d,), False), "ln_final.b": ("ln_f.bias", (d,), False)})
        return table

    return names


def _gpt_to_probe(names):
    def convert(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        out = {}
        for ours, (theirs, shape, transposed) in names(cfg).items():
            tensor = source.take(theirs, shape)
            # a transposed Conv1D weight stays a view: F.linear on it reads the stored layout directly
            out[ours] = tensor.T if transposed else tensor
        out["unembed.weight"] = _take_unembed(source, cfg, out["embed.W_E"])  # GPT-1 and GPT-2 are always tied
        return out

    return convert


def _gpt_to_hf(names):
    def convert(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        return {theirs: (params[ours].T if transposed else params[ours]).contiguous()
                for ours, (theirs, _, transposed) in names(cfg).items()}

    return convert


_gpt2_names = _gpt_names("wte.weight", "wpe.weight", final_norm=True)
_gpt1_names = _gpt_names("tokens_embed.weight", "positions_embed.weight", final_norm=False)


def gpt1_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    _require(cfg, "GPT-1", heads_per_layer=None, norm=Norm.LAYER, norm_placement=NormPlacement.POST, final_norm=False, positions=Positions.LEARNED,
             gated_mlp=False, n_kv_heads=cfg.n_heads, qkv_bias=True, out_bias=True, mlp_bias=True, tied_embeddings=True)
    afn = {Activation.GELU_TANH: "gelu", Activation.RELU: "relu", Activation.SILU: "silu"}
    if cfg.activation not in afn:
        raise ValueError(f"a GPT-1 checkpoint cannot hold activation={cfg.activation.value}")
    return {"model_type": "openai-gpt", "architectures": ["OpenAIGPTLMHeadModel"], "n_layer": cfg.n_layers, "n_embd": cfg.d_model,
            "n_head": cfg.n_heads, "vocab_size": cfg.d_vocab, "n_positions": cfg.n_ctx, "afn": afn[cfg.activation],
            "layer_norm_epsilon": cfg.eps, "tie_word_embeddings": True}


# ---- rotary settings, shared by the rotary families ---------------------------------------------------
def _rope(hf: dict) -> tuple[dict, Optional[RotaryScaling]]:
    """config.json's rope dict (transformers 5: rope_parameters; older files: rope_scaling, with rope_theta beside
    it) and the frequency rescaling it asks for."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return rope, None
    if kind == "linear":
        return rope, RotaryScaling("linear", float(rope["factor"]))
    if kind == "llama3":
        return rope, RotaryScaling("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                                   float(rope["high_freq_factor"]),
                                   int(rope.get("original_max_position_embeddings") or hf["max_position_embeddings"]))
    raise CheckpointError(f"rope scaling {kind!r} is not supported; supported: default (none), linear, llama3")


def _rope_to_hf(cfg: DecoderConfig, **extra) -> dict:
    """rope_parameters (transformers 5) and, for older versions, rope_theta and rope_scaling beside it."""
    params: dict = {"rope_type": "default", "rope_theta": cfg.rotary_base, **extra}
    scaling = cfg.rotary_scaling
    if scaling is not None:
        params.update(rope_type=scaling.kind, factor=scaling.factor)
        if scaling.kind == "llama3":
            params.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                          original_max_position_embeddings=scaling.original_n_ctx)
    out = {"rope_theta": cfg.rotary_base, "rope_parameters": params}
    if scaling is not None:
        out["rope_scaling"] = {k: v for k, v in params.items() if k not in ("rope_theta", *extra)}
    return out


# ---- Llama and Qwen2: nn.Linear layers, stored [out, in]; separate q, k, v -----------------------
def llama_config(hf: dict, qkv_bias: Optional[bool] = None) -> DecoderConfig:
    rope, scaling = _rope(hf)
    if hf.get("use_sliding_window"):  # Qwen2's: windows in some layers only (max_window_layers)
        raise CheckpointError("use_sliding_window=true (a window in some layers only) is not supported")
    n_heads = hf["num_attention_heads"]
    heads = hf.get("heads_per_layer")  # written by probe for structurally pruned models
    return DecoderConfig(
        n_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, d_head=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        d_mlp=hf["intermediate_size"], d_vocab=hf["vocab_size"], n_ctx=hf["max_position_embeddings"],
        eps=hf.get("rms_norm_eps", 1e-6), activation=_activation(hf.get("hidden_act", "silu"), GPT_ACTIVATIONS),
        gated_mlp=True, norm=Norm.RMS, positions=Positions.ROTARY,
        rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), rotary_scaling=scaling,
        qkv_bias=hf.get("attention_bias", False) if qkv_bias is None else qkv_bias,
        out_bias=hf.get("attention_bias", False) if qkv_bias is None else False,
        mlp_bias=hf.get("mlp_bias", False), tied_embeddings=hf.get("tie_word_embeddings", False),
        heads_per_layer=None if heads is None else tuple(heads),
    )


def qwen2_config(hf: dict) -> DecoderConfig:
    return llama_config(hf, qkv_bias=True)  # Qwen2: biases on q, k, v and none on the output


def qwen3_config(hf: dict) -> DecoderConfig:
    return dataclasses.replace(llama_config(hf), qk_norm=True)  # Qwen3: Llama's layout, each head's q and k normalised


def mistral_config(hf: dict) -> DecoderConfig:
    # Mistral: Llama's layers without any bias, and (v0.1) a sliding window; later versions say null (a key left out
    # is transformers' default, 4096)
    return dataclasses.replace(llama_config(hf, qkv_bias=False), sliding_window=hf.get("sliding_window", 4096))


# what each Llama-like format fixes beyond Llama's own layout
_LLAMA_LIKE = {
    "llama": ("LlamaForCausalLM", lambda cfg: dict(out_bias=cfg.qkv_bias)),
    "qwen2": ("Qwen2ForCausalLM", lambda cfg: dict(qkv_bias=True, out_bias=False)),
    "mistral": ("MistralForCausalLM", lambda cfg: dict(qkv_bias=False, out_bias=False, mlp_bias=False,
                                                       sliding_window=cfg.sliding_window)),
    "qwen3": ("Qwen3ForCausalLM", lambda cfg: dict(out_bias=cfg.qkv_bias, mlp_bias=False, qk_norm=True)),
}


def _llama_like_hf(cfg: DecoderConfig, model_type: str, architecture: str) -> dict:
    """The config.json fields Llama, Qwen2, Mistral and Gemma share."""
    return {
        "model_type": model_type, "architectures": [architecture],
        "num_hidden_layers": cfg.n_layers, "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head, "intermediate_size": cfg.d_mlp,
        "vocab_size": cfg.d_vocab, "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.eps,
        **_rope_to_hf(cfg), "tie_word_embeddings": cfg.tied_embeddings,
        # transformers cannot load a pruned model (its layers differ in width); probe can
        **({"heads_per_layer": list(cfg.heads_per_layer)} if cfg.heads_per_layer is not None else {}),
    }


def llama_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer], model_type: str = "llama") -> dict:
    architecture, fixed = _LLAMA_LIKE[model_type]
    _require(cfg, model_type, norm=Norm.RMS, norm_placement=NormPlacement.PRE, final_norm=True,
             positions=Positions.ROTARY, rotary_dim=cfg.d_head, gated_mlp=True, **fixed(cfg))
    out = {**_llama_like_hf(cfg, model_type, architecture), "hidden_act": _GPT_ACTIVATION_NAMES[cfg.activation],
           "mlp_bias": cfg.mlp_bias}
    if model_type in ("llama", "qwen3"):
        out["attention_bias"] = cfg.qkv_bias
    if model_type == "mistral":
        out["sliding_window"] = cfg.sliding_window
    return out


def _llama_shapes(cfg: DecoderConfig, layer: int) -> dict[str, tuple[int, ...]]:
    d, m, h, kv, dh = cfg.d_model, cfg.d_mlp, cfg.layer_heads(layer), cfg.layer_kv_heads(layer), cfg.d_head
    return {"q": (h * dh, d), "k": (kv * dh, d), "v": (kv * dh, d), "o": (d, h * dh), "gate": (m, d), "up": (m, d), "down": (d, m)}


def _llama_norms(cfg: DecoderConfig) -> dict[str, str]:
    """Each block's norms, ours -> theirs. Gemma 2's "post_attention_layernorm" normalises the attention's write;
    Llama's is the norm before the MLP."""
    if cfg.norm_placement is NormPlacement.SANDWICH:
        return {"ln1": "input_layernorm", "ln1_post": "post_attention_layernorm", "ln2": "pre_feedforward_layernorm",
                "ln2_post": "post_feedforward_layernorm"}
    return {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}


def llama_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    d = cfg.d_model
    out = {"embed.W_E": source.take("embed_tokens.weight", (cfg.d_vocab, d)), "ln_final.w": source.take("norm.weight", (d,))}
    for l in range(cfg.n_layers):
        o, t, s = f"blocks.{l}", f"layers.{l}", _llama_shapes(cfg, l)
        for ours, theirs in _llama_norms(cfg).items():
            out[f"{o}.{ours}.w"] = source.take(f"{t}.{theirs}.weight", (d,))
        if cfg.qk_norm:
            for which in "qk":
                out[f"{o}.attn.{which}_norm.w"] = source.take(f"{t}.self_attn.{which}_norm.weight", (cfg.d_head,))
        out[f"{o}.attn.qkv.weight"] = torch.cat([source.take(f"{t}.self_attn.{p}_proj.weight", s[p]) for p in "qkv"])
        if cfg.qkv_bias:
            out[f"{o}.attn.qkv.bias"] = torch.cat([source.take(f"{t}.self_attn.{p}_proj.bias", s[p][:1]) for p in "qkv"])
        out[f"{o}.attn.out.weight"] = source.take(f"{t}.self_attn.o_proj.weight", s["o"])
        if cfg.out_bias:
            out[f"{o}.attn.out.bias"] = source.take(f"{t}.self_attn.o_proj.bias", (d,))
        for ours, theirs in (("gate", "gate"), ("fc_in", "up"), ("fc_out", "down")):
            out[f"{o}.mlp.{ours}.weight"] = source.take(f"{t}.mlp.{theirs}_proj.weight", s[theirs])
            if cfg.mlp_bias:
                out[f"{o}.mlp.{ours}.bias"] = source.take(f"{t}.mlp.{theirs}_proj.bias", s[theirs][:1])
    out["unembed.weight"] = _take_unembed(source, cfg, out["embed.W_E"])
    return out


def llama_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": params["embed.W_E"], "model.norm.weight": params["ln_final.w"]}
    for l in range(cfg.n_layers):
        o, t, s = f"blocks.{l}", f"model.layers.{l}", _llama_shapes(cfg, l)
        sizes = [s["q"][0], s["k"][0], s["v"][0]]
        for ours, theirs in _llama_norms(cfg).items():
            out[f"{t}.{theirs}.weight"] = params[f"{o}.{ours}.w"]
        if cfg.qk_norm:
            for which in "qk":
                out[f"{t}.self_attn.{which}_norm.weight"] = params[f"{o}.attn.{which}_norm.w"]
        for p, w in zip("qkv", params[f"{o}.attn.qkv.weight"].split(sizes)):
            out[f"{t}.self_attn.{p}_proj.weight"] = w
        if cfg.qkv_bias:
            for p, b in zip("qkv", params[f"{o}.attn.qkv.bias"].split(sizes)):
                out[f"{t}.self_attn.{p}_proj.bias"] = b
        out[f"{t}.self_attn.o_proj.weight"] = params[f"{o}.attn.out.weight"]
        if cfg.out_bias:
            out[f"{t}.self_attn.o_proj.bias"] = params[f"{o}.attn.out.bias"]
        for ours, theirs in (("gate", "gate"), ("fc_in", "up"), ("fc_out", "down")):
            out[f"{t}.mlp.{theirs}_proj.weight"] = params[f"{o}.mlp.{ours}.weight"]
            if cfg.mlp_bias:
                out[f"{t}.mlp.{theirs}_proj.bias"] = params[f"{o}.mlp.{ours}.bias"]
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}



# ---- Gemma and Gemma 2: Llama's layout; norms store w - 1, embeddings scaled, GeGLU -----------------------
# Gemma's "gelu" is the tanh approximation: transformers rewrites the released configs' "gelu" to it
GEMMA_ACTIVATIONS = {**GPT_ACTIVATIONS, "gelu": Activation.GELU_TANH}


def gemma_config(hf: dict, activation_key: str = "hidden_act") -> DecoderConfig:
    act = hf.get(activation_key) or "gelu_pytorch_tanh"  # Gemma reads hidden_act, Gemma 2 hidden_activation
    return dataclasses.replace(llama_config(hf), activation=_activation(act, GEMMA_ACTIVATIONS), scale_embed=True,
                               norm=Norm.RMS_FLOAT32, tied_embeddings=hf.get("tie_word_embeddings", True))


def gemma2_config(hf: dict) -> DecoderConfig:
    n_layers = hf["num_hidden_layers"]
    # older files have no layer_types; transformers then windows the even layers
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise CheckpointError(f"layer_types {unknown} are not supported; supported: sliding_attention, full_attention")
    sliding = tuple(t == "sliding_attention" for t in types)
    # a key left out means transformers' default; a key set to null means none
    window = hf.get("sliding_window", 4096) if any(sliding) else None
    return dataclasses.replace(
        gemma_config(hf, "hidden_activation"), norm_placement=NormPlacement.SANDWICH,
        attn_scale_dim=hf.get("query_pre_attn_scalar", 256), attn_softcap=hf.get("attn_logit_softcapping", 50.0),
        logit_softcap=hf.get("final_logit_softcapping", 30.0), sliding_window=window,
        sliding_layers=None if window is None else sliding,
    )


def gemma_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer], model_type: str) -> dict:
    gemma2 = model_type == "gemma2"
    if cfg.activation is Activation.GELU:
        raise ValueError(f"a {model_type} checkpoint cannot hold activation=gelu (exact): transformers reads Gemma's "
                         "'gelu' as the tanh approximation")
    gemma2_fields = ("attn_scale_dim", "attn_softcap", "logit_softcap", "sliding_window", "sliding_layers")
    _require(cfg, model_type, scale_embed=True, norm=Norm.RMS_FLOAT32, final_norm=True, positions=Positions.ROTARY,
             rotary_dim=cfg.d_head, gated_mlp=True, mlp_bias=False, out_bias=cfg.qkv_bias,
             norm_placement=NormPlacement.SANDWICH if gemma2 else NormPlacement.PRE,
             **({f: getattr(cfg, f) for f in gemma2_fields} if gemma2 else {}))
    out = {**_llama_like_hf(cfg, model_type, "Gemma2ForCausalLM" if gemma2 else "GemmaForCausalLM"),
           "attention_bias": cfg.qkv_bias, "hidden_activation" if gemma2 else "hidden_act": _GPT_ACTIVATION_NAMES[cfg.activation]}
    if gemma2:
        windows = cfg.sliding_layers or (True,) * cfg.n_layers
        out.update(query_pre_attn_scalar=cfg.d_head if cfg.attn_scale_dim is None else cfg.attn_scale_dim,
                   attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.logit_softcap,
                   sliding_window=cfg.sliding_window,
                   layer_types=["sliding_attention" if cfg.sliding_window is not None and w else "full_attention" for w in windows])
    return out


def _norm_weights_offset(params: dict[str, torch.Tensor], offset: float) -> dict[str, torch.Tensor]:
    """Gemma's norms multiply by 1 + w and store w; probe's multiply by w. Every `.w` is a norm weight; in float32,
    as Gemma adds the 1 (its norms keep w in float32, see RMSNormFloat32)."""
    return {k: v.float() + offset if k.endswith(".w") else v for k, v in params.items()}


def gemma_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    return _norm_weights_offset(llama_to_probe(source, cfg), 1.0)


def gemma_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    return llama_to_hf(_norm_weights_offset(params, -1.0), cfg)


# ---- GPT-NeoX (Pythia): nn.Linear layers; q, k, v fused and interleaved per head ---------------------
def neox_config(hf: dict) -> DecoderConfig:
    rope, scaling = _rope(hf)
    n_heads, d_model = hf["num_attention_heads"], hf["hidden_size"]
    d_head = d_model // n_heads
    # older config files (every Pythia on the hub) say rotary_pct / rotary_emb_base; transformers 5 writes rope_parameters
    fraction = rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))  # transformers' default: a quarter
    bias = hf.get("attention_bias", True)
    heads = hf.get("heads_per_layer")  # written by probe for structurally pruned models
    return DecoderConfig(
        n_layers=hf["num_hidden_layers"], d_model=d_model, n_heads=n_heads, d_mlp=hf["intermediate_size"],
        d_vocab=hf["vocab_size"], n_ctx=hf["max_position_embeddings"], eps=hf.get("layer_norm_eps", 1e-5),
        activation=_activation(hf.get("hidden_act", "gelu"), GPT_ACTIVATIONS),
        norm_placement=NormPlacement.PARALLEL if hf.get("use_parallel_residual", True) else NormPlacement.PRE,
        positions=Positions.ROTARY, rotary_dim=int(d_head * fraction),
        rotary_base=float(rope.get("rope_theta", hf.get("rotary_emb_base", 10000.0))), rotary_scaling=scaling,
        qkv_bias=bias, out_bias=bias, tied_embeddings=hf.get("tie_word_embeddings", False),
        heads_per_layer=None if heads is None else tuple(heads),
    )


def neox_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    _require(cfg, "GPT-NeoX", norm_placement={NormPlacement.PRE, NormPlacement.PARALLEL}, norm=Norm.LAYER, final_norm=True, positions=Positions.ROTARY,
             gated_mlp=False, n_kv_heads=cfg.n_heads, d_head=cfg.d_model // cfg.n_heads, out_bias=cfg.qkv_bias,
             mlp_bias=True)
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise ValueError("a GPT-NeoX checkpoint needs n_heads * d_head == d_model")
    special = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else 0
    fraction = cfg.rotary_dim / cfg.d_head
    while int(cfg.d_head * fraction) < cfg.rotary_dim:  # transformers truncates d_head * fraction (4 / 49 * 49 < 4)
        fraction = math.nextafter(fraction, 1.0)
    return {
        "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "intermediate_size": cfg.d_mlp,
        "vocab_size": cfg.d_vocab, "max_position_embeddings": cfg.n_ctx, "layer_norm_eps": cfg.eps,
        "hidden_act": _GPT_ACTIVATION_NAMES[cfg.activation],
        "use_parallel_residual": cfg.norm_placement is NormPlacement.PARALLEL,
        # both spellings: transformers 5 reads rope_parameters, older versions rotary_pct / rotary_emb_base
        "rotary_pct": fraction, "rotary_emb_base": cfg.rotary_base, **_rope_to_hf(cfg, partial_rotary_factor=fraction),
        "attention_bias": cfg.qkv_bias, "tie_word_embeddings": cfg.tied_embeddings,
        "bos_token_id": special, "eos_token_id": special,
        # transformers cannot load a pruned model (its layers differ in width); probe can
        **({"heads_per_layer": list(cfg.heads_per_layer)} if cfg.heads_per_layer is not None else {}),
    }


def _neox_qkv(tensor: torch.Tensor, ours: str, cfg: DecoderConfig, to_probe: bool) -> torch.Tensor:
    """GPT-NeoX stores q, k, v interleaved per head, [(head qkv d_head) ...]; probe stores [(qkv head d_head) ...].
    Other tensors (`ours` names which) pass unchanged."""
    if ".attn.qkv." not in ours:
        return tensor
    heads = cfg.layer_heads(int(ours.split(".")[1]))
    sizes = dict(head=heads, qkv=3, d_head=cfg.d_head)  # all given: a layer pruned to no heads has nothing to infer from
    if to_probe:
        return rearrange(tensor, "(head qkv d_head) ... -> (qkv head d_head) ...", **sizes)
    return rearrange(tensor, "(qkv head d_head) ... -> (head qkv d_head) ...", **sizes)


def _neox_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape); every weight stored [out, in] as ours."""
    d, m, v = cfg.d_model, cfg.d_mlp, cfg.d_vocab
    table = {"embed.W_E": ("embed_in.weight", (v, d)), "ln_final.w": ("final_layer_norm.weight", (d,)),
             "ln_final.b": ("final_layer_norm.bias", (d,))}
    for l in range(cfg.n_layers):
        o, t, a = f"blocks.{l}", f"layers.{l}", cfg.layer_heads(l) * cfg.d_head  # a: this layer's attention width
        table.update({
            f"{o}.ln1.w": (f"{t}.input_layernorm.weight", (d,)), f"{o}.ln1.b": (f"{t}.input_layernorm.bias", (d,)),
            f"{o}.ln2.w": (f"{t}.post_attention_layernorm.weight", (d,)),
            f"{o}.ln2.b": (f"{t}.post_attention_layernorm.bias", (d,)),
            f"{o}.attn.qkv.weight": (f"{t}.attention.query_key_value.weight", (3 * a, d)),
            f"{o}.attn.out.weight": (f"{t}.attention.dense.weight", (d, a)),
            f"{o}.mlp.fc_in.weight": (f"{t}.mlp.dense_h_to_4h.weight", (m, d)),
            f"{o}.mlp.fc_in.bias": (f"{t}.mlp.dense_h_to_4h.bias", (m,)),
            f"{o}.mlp.fc_out.weight": (f"{t}.mlp.dense_4h_to_h.weight", (d, m)),
            f"{o}.mlp.fc_out.bias": (f"{t}.mlp.dense_4h_to_h.bias", (d,)),
        })
        if cfg.qkv_bias:
            table[f"{o}.attn.qkv.bias"] = (f"{t}.attention.query_key_value.bias", (3 * a,))
            table[f"{o}.attn.out.bias"] = (f"{t}.attention.dense.bias", (d,))
    return table


def neox_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {}
    for ours, (theirs, shape) in _neox_names(cfg).items():
        out[ours] = _neox_qkv(source.take(theirs, shape), ours, cfg, to_probe=True)
    # GPTNeoXForCausalLM names its head embed_out (every Pythia file); some converted files say lm_head
    out["unembed.weight"] = _take_unembed(source, cfg, out["embed.W_E"], ("embed_out.weight", "lm_head.weight"))
    return out


def neox_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {f"gpt_neox.{theirs}": _neox_qkv(params[ours], ours, cfg, to_probe=False) for ours, (theirs, _) in _neox_names(cfg).items()}
    if not cfg.tied_embeddings:
        out["embed_out.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}

FAMILIES = {
    family.model_type: family
    for family in (
        Family("gpt2", "GPT2LMHeadModel", ("transformer.",), gpt2_config, gpt2_config_to_hf,
               _gpt_to_probe(_gpt2_names), _gpt_to_hf(_gpt2_names)),
        Family("openai-gpt", "OpenAIGPTLMHeadModel", ("transformer.",), gpt1_config, gpt1_config_to_hf,
               _gpt_to_probe(_gpt1_names), _gpt_to_hf(_gpt1_names)),
        Family("llama", "LlamaForCausalLM", ("model.",), llama_config, llama_config_to_hf, llama_to_probe, llama_to_hf),
        Family("qwen2", "Qwen2ForCausalLM", ("model.",), qwen2_config,
               lambda cfg, tok: llama_config_to_hf(cfg, tok, "qwen2"), llama_to_probe, llama_to_hf),
        Family("qwen3", "Qwen3ForCausalLM", ("model.",), qwen3_config,
               lambda cfg, tok: llama_config_to_hf(cfg, tok, "qwen3"), llama_to_probe, llama_to_hf),
        Family("mistral", "MistralForCausalLM", ("model.",), mistral_config,
               lambda cfg, tok: llama_config_to_hf(cfg, tok, "mistral"), llama_to_probe, llama_to_hf),
        Family("gemma", "GemmaForCausalLM", ("model.",), gemma_config,
               lambda cfg, tok: gemma_config_to_hf(cfg, tok, "gemma"), gemma_to_probe, gemma_to_hf),
        Family("gemma2", "Gemma2ForCausalLM", ("model.",), gemma2_config,
               lambda cfg, tok: gemma_config_to_hf(cfg, tok, "gemma2"), gemma_to_probe, gemma_to_hf),
        Family("gpt_neox", "GPTNeoXForCausalLM", ("gpt_neox.",), neox_config, neox_config_to_hf, neox_to_probe, neox_to_hf),
    )
}


def family_for_config(cfg: DecoderConfig) -> Family:
    """The checkpoint format that can hold this model (for saving)."""
    if cfg.unembed_bias:
        raise ValueError("no Hugging Face checkpoint format here holds an unembedding bias (a model from "
                         "process_weights has one); save the unprocessed model and process it again after loading")
    errors = []
    for family in FAMILIES.values():
        try:
            family.config_to_hf(cfg, None)
            return family
        except ValueError as err:
            errors.append(str(err))
    raise ValueError("no Hugging Face checkpoint format holds this configuration: " + "; ".join(errors))
