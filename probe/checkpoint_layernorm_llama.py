"""Checkpoints with Llama's tensor names, LayerNorms (with biases) and an ungated MLP: StarCoder 2 (`starcoder2`:
tanh GELU, `mlp.c_fc` / `mlp.c_proj`, biases everywhere by `use_bias`, a sliding window where the file names one) and
Nemotron (`nemotron`: relu^2, `mlp.up_proj` / `down_proj`, rotary on each head's first half, and LayerNorm1P, whose
weight is stored as w - 1: the 1 is added on loading and taken off on saving) and Jais 2 (`jais2`: relu^2, biases on
by default)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, GPT_ACTIVATIONS, Source, activation_of, llama_named_to_hf,
                                     llama_named_to_probe, require_fields, rope_from_hf, rope_to_hf,
                                     special_token_ids)
from probe.config import DecoderConfig, Norm, NormPlacement, Positions
from probe.tokenizer import Tokenizer


@dataclass(frozen=True)
class Format:
    architecture: str
    mlp: tuple[str, str]  # the up and down projections' names
    eps: str  # config.json's name for the norms' epsilon
    activation: str  # hidden_act's default
    rotary_fraction: float  # partial_rotary_factor's default
    norm_offset: float  # what the stored norm weights lack (Nemotron's LayerNorm1P: 1)
    tied: bool  # tie_word_embeddings' default
    biases: bool = False  # attention_bias' and mlp_bias' default (StarCoder 2's one use_bias is on by default)


FORMATS = {
    "starcoder2": Format("Starcoder2ForCausalLM", ("c_fc", "c_proj"), "norm_epsilon", "gelu_pytorch_tanh", 1.0, 0.0,
                         True),
    "nemotron": Format("NemotronForCausalLM", ("up_proj", "down_proj"), "norm_eps", "relu2", 0.5, 1.0, False),
    "jais2": Format("Jais2ForCausalLM", ("up_proj", "down_proj"), "layer_norm_eps", "relu2", 1.0, 0.0, False, True),
}


def layernorm_llama_config(model_type: str) -> Callable[[dict], DecoderConfig]:
    fmt = FORMATS[model_type]

    def config_from_hf(hf: dict) -> DecoderConfig:
        rope, scaling = rope_from_hf(hf)
        n_heads, d_model = hf["num_attention_heads"], hf["hidden_size"]
        d_head = hf.get("head_dim") or d_model // n_heads
        fraction = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", fmt.rotary_fraction))
        attn_bias = hf.get("use_bias", True) if model_type == "starcoder2" else hf.get("attention_bias", fmt.biases)
        mlp_bias = hf.get("use_bias", True) if model_type == "starcoder2" else hf.get("mlp_bias", fmt.biases)
        return DecoderConfig(
            n_layers=hf["num_hidden_layers"], d_model=d_model, n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads, d_head=d_head, d_mlp=hf["intermediate_size"],
            d_vocab=hf["vocab_size"], n_ctx=hf["max_position_embeddings"], eps=hf.get(fmt.eps, 1e-5),
            activation=activation_of(hf.get("hidden_act") or fmt.activation, GPT_ACTIVATIONS), gated_mlp=False,
            positions=Positions.ROTARY, rotary_dim=int(d_head * fraction),
            rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), rotary_scaling=scaling,
            qkv_bias=attn_bias, out_bias=attn_bias, mlp_bias=mlp_bias,
            tied_embeddings=hf.get("tie_word_embeddings", fmt.tied), sliding_window=hf.get("sliding_window"),
        )
    return config_from_hf


def layernorm_llama_config_to_hf(model_type: str) -> Callable[[DecoderConfig, Optional[Tokenizer]], dict]:
    fmt = FORMATS[model_type]

    def config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
        # StarCoder 2's one use_bias switches every bias; Nemotron's and Jais 2's attention and MLP biases are apart
        biases = ({"qkv_bias": cfg.mlp_bias, "out_bias": cfg.mlp_bias} if model_type == "starcoder2"
                  else {"out_bias": cfg.qkv_bias})
        require_fields(cfg, model_type, norm=Norm.LAYER, norm_placement=NormPlacement.PRE, final_norm=True,
                       positions=Positions.ROTARY, gated_mlp=False, sliding_window=cfg.sliding_window if
                       model_type == "starcoder2" else None, **biases)
        fraction = cfg.rotary_dim / cfg.d_head
        out = {"model_type": model_type, "architectures": [fmt.architecture], "num_hidden_layers": cfg.n_layers,
               "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
               "head_dim": cfg.d_head, "intermediate_size": cfg.d_mlp, "vocab_size": cfg.d_vocab,
               "max_position_embeddings": cfg.n_ctx, fmt.eps: cfg.eps,
               "hidden_act": GPT_ACTIVATION_NAMES[cfg.activation], "tie_word_embeddings": cfg.tied_embeddings,
               **rope_to_hf(cfg, partial_rotary_factor=fraction), **special_token_ids(tokenizer)}
        if model_type == "starcoder2":
            out.update(use_bias=cfg.mlp_bias, sliding_window=cfg.sliding_window)
        else:
            out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
        return out
    return config_to_hf


def layernorm_attention_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape) for the embedding, the LayerNorms (weights and biases) and each attention's output
    projection of Llama's names with LayerNorms (StarCoder 2, Nemotron, Jais 2, PhiMoE); [out, in] as ours."""
    d, width = cfg.d_model, cfg.n_heads * cfg.d_head
    table = {"embed.W_E": ("embed_tokens.weight", (cfg.d_vocab, d)), "ln_final.w": ("norm.weight", (d,)),
             "ln_final.b": ("norm.bias", (d,))}
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"layers.{l}"
        for ours, theirs in (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm")):
            table.update({f"{o}.{ours}.w": (f"{t}.{theirs}.weight", (d,)), f"{o}.{ours}.b": (f"{t}.{theirs}.bias", (d,))})
        table[f"{o}.attn.out.weight"] = (f"{t}.self_attn.o_proj.weight", (d, width))
        if cfg.out_bias:
            table[f"{o}.attn.out.bias"] = (f"{t}.self_attn.o_proj.bias", (d,))
    return table


def _names(cfg: DecoderConfig, fmt: Format) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape) for every tensor but q/k/v; [out, in] as ours."""
    d, m = cfg.d_model, cfg.d_mlp
    up, down = fmt.mlp
    table = layernorm_attention_names(cfg)
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"layers.{l}"
        table.update({f"{o}.mlp.fc_in.weight": (f"{t}.mlp.{up}.weight", (m, d)),
                      f"{o}.mlp.fc_out.weight": (f"{t}.mlp.{down}.weight", (d, m))})
        if cfg.mlp_bias:
            table.update({f"{o}.mlp.fc_in.bias": (f"{t}.mlp.{up}.bias", (m,)),
                          f"{o}.mlp.fc_out.bias": (f"{t}.mlp.{down}.bias", (d,))})
    return table


def _offset_norms(params: dict[str, torch.Tensor], offset: float) -> dict[str, torch.Tensor]:
    return {k: v + offset if k.endswith(".w") else v for k, v in params.items()} if offset else params


def layernorm_llama_to_probe(model_type: str) -> Callable[[Source, DecoderConfig], dict[str, torch.Tensor]]:
    fmt = FORMATS[model_type]

    def to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        return _offset_norms(llama_named_to_probe(source, cfg, _names(cfg, fmt)), fmt.norm_offset)
    return to_probe


def layernorm_llama_to_hf(model_type: str) -> Callable[[dict[str, torch.Tensor], DecoderConfig], dict[str, torch.Tensor]]:
    fmt = FORMATS[model_type]

    def to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        return llama_named_to_hf(_offset_norms(params, -fmt.norm_offset), cfg, _names(cfg, fmt))
    return to_hf
