"""StableLM checkpoints (Stability AI's StableLM-3B-4E1T, StableLM 2, StableCode): config.json <-> DecoderConfig,
tensor names.

Llama's attention and SwiGLU MLP with LayerNorms that have biases, rotary on each head's first
partial_rotary_factor (GPT-NeoX's halves), q/k/v biases where `use_qkv_bias` says, and, with
`use_parallel_residual`, a parallel block whose one norm both sublayers read (loaded as ln1 and a copy ln2, as Phi's).
`qk_layernorm` (StableLM 2 12B: a LayerNorm of each head's own on q and k) is refused: probe's q/k norms share one
weight across heads.
"""
from __future__ import annotations

from typing import Optional

import torch

from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, GPT_ACTIVATIONS, Source, activation_of, check_shared_norm,
                                     copy_shared_norm, llama_named_to_hf, llama_named_to_probe, require_fields,
                                     rope_from_hf, rope_to_hf)
from probe.config import DecoderConfig, Norm, NormPlacement, Positions
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer


def stablelm_config(hf: dict) -> DecoderConfig:
    if hf.get("qk_layernorm", False):
        raise CheckpointError("qk_layernorm=true (a LayerNorm of each head's own on q and k) is not supported")
    rope, scaling = rope_from_hf(hf)
    n_heads, d_model = hf["num_attention_heads"], hf["hidden_size"]
    fraction = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))  # transformers' default
    bias = bool(hf.get("use_qkv_bias", False))
    return DecoderConfig(
        n_layers=hf["num_hidden_layers"], d_model=d_model, n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, d_mlp=hf["intermediate_size"], d_vocab=hf["vocab_size"],
        n_ctx=hf["max_position_embeddings"], eps=hf.get("layer_norm_eps", 1e-5),
        activation=activation_of(hf.get("hidden_act", "silu"), GPT_ACTIVATIONS), gated_mlp=True,
        norm_placement=NormPlacement.PARALLEL if hf.get("use_parallel_residual", False) else NormPlacement.PRE,
        positions=Positions.ROTARY, rotary_dim=round(d_model // n_heads * fraction),
        rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), rotary_scaling=scaling,
        qkv_bias=bias, out_bias=False, mlp_bias=False, tied_embeddings=hf.get("tie_word_embeddings", False),
    )


def stablelm_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    require_fields(cfg, "StableLM", heads_per_layer=None, norm=Norm.LAYER,
                   norm_placement={NormPlacement.PRE, NormPlacement.PARALLEL}, final_norm=True,
                   positions=Positions.ROTARY, gated_mlp=True, d_head=cfg.d_model // cfg.n_heads,
                   qkv_bias={False, True}, out_bias=False, mlp_bias=False)
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise ValueError("a StableLM checkpoint needs n_heads * d_head == d_model")
    special = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else 0
    fraction = cfg.rotary_dim / cfg.d_head
    return {
        "model_type": "stablelm", "architectures": ["StableLmForCausalLM"], "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.d_mlp, "vocab_size": cfg.d_vocab, "max_position_embeddings": cfg.n_ctx,
        "layer_norm_eps": cfg.eps, "hidden_act": GPT_ACTIVATION_NAMES[cfg.activation], "qk_layernorm": False,
        "use_qkv_bias": cfg.qkv_bias, "use_parallel_residual": cfg.norm_placement is NormPlacement.PARALLEL,
        "partial_rotary_factor": fraction, **rope_to_hf(cfg, partial_rotary_factor=fraction),
        "tie_word_embeddings": cfg.tied_embeddings, "bos_token_id": special, "eos_token_id": special,
    }


def _names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape) for every tensor but q/k/v; [out, in] as ours. A parallel block stores one
    norm (ln1's; ln2 is its copy)."""
    d, m = cfg.d_model, cfg.d_mlp
    table = {"embed.W_E": ("embed_tokens.weight", (cfg.d_vocab, d)), "ln_final.w": ("norm.weight", (d,)),
             "ln_final.b": ("norm.bias", (d,))}
    norms = {"ln1": "input_layernorm"} if cfg.norm_placement is NormPlacement.PARALLEL else \
        {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"layers.{l}"
        for ours, theirs in norms.items():
            table.update({f"{o}.{ours}.w": (f"{t}.{theirs}.weight", (d,)), f"{o}.{ours}.b": (f"{t}.{theirs}.bias", (d,))})
        table.update({
            f"{o}.attn.out.weight": (f"{t}.self_attn.o_proj.weight", (d, d)),
            f"{o}.mlp.gate.weight": (f"{t}.mlp.gate_proj.weight", (m, d)),
            f"{o}.mlp.fc_in.weight": (f"{t}.mlp.up_proj.weight", (m, d)),
            f"{o}.mlp.fc_out.weight": (f"{t}.mlp.down_proj.weight", (d, m)),
        })
    return table


def stablelm_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_named_to_probe(source, cfg, _names(cfg))
    if cfg.norm_placement is NormPlacement.PARALLEL:
        copy_shared_norm(out, cfg)
    return out


def stablelm_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    if cfg.norm_placement is NormPlacement.PARALLEL:
        check_shared_norm(params, cfg, "StableLM parallel-residual")
    return llama_named_to_hf(params, cfg, _names(cfg))
