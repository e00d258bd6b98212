"""Falcon checkpoints (TII's Falcon-7B, -40B, -180B, Falcon 2): config.json <-> DecoderConfig, tensor names, layouts.

Rotary positions on whole heads, an exact-GELU MLP, a tied unembedding, and one of three blocks: parallel with one
norm both sublayers read (Falcon-7B, `parallel_attn`: loaded as ln1 and a copy ln2, as Phi's), parallel with a norm
each (`new_decoder_architecture`: ln_attn, ln_mlp), or sequential. Keys and values: one head for all
(`multi_query`), one per group of query heads (`num_kv_heads`, the new architecture), or one per head. Their fused
projection holds, for each key/value head, its group's queries, then its key, then its value; probe's holds every
query, then every key, then every value. Falcon-RW's ALiBi (added before the scale, unlike Bloom's) is refused.
"""
from __future__ import annotations

from typing import Optional

import torch

from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, GPT_ACTIVATIONS, Source, activation_of, check_shared_norm,
                                     copy_shared_norm, grouped_qkv, require_fields, rope_from_hf, rope_to_hf, take_unembed)
from probe.config import DecoderConfig, Norm, NormPlacement, Positions
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer


def falcon_config(hf: dict) -> DecoderConfig:
    if hf.get("alibi", False):
        raise CheckpointError("alibi=true (Falcon-RW's ALiBi, added before the scale) is not supported")
    rope, scaling = rope_from_hf(hf)
    n_heads, d_model = hf["num_attention_heads"], hf["hidden_size"]
    new = hf.get("new_decoder_architecture", False)
    n_kv = (hf.get("num_kv_heads") or n_heads) if new else (1 if hf.get("multi_query", True) else n_heads)
    parallel = new or hf.get("parallel_attn", True)
    bias = bool(hf.get("bias", False))
    return DecoderConfig(
        n_layers=hf["num_hidden_layers"], d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv,
        d_mlp=hf.get("ffn_hidden_size") or 4 * d_model, d_vocab=hf["vocab_size"],
        n_ctx=hf.get("max_position_embeddings", 2048), eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=activation_of(hf.get("activation", "gelu"), GPT_ACTIVATIONS),
        norm_placement=NormPlacement.PARALLEL if parallel else NormPlacement.PRE, positions=Positions.ROTARY,
        rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), rotary_scaling=scaling,
        qkv_bias=bias, out_bias=bias, mlp_bias=bias, tied_embeddings=hf.get("tie_word_embeddings", True),
    )


def _one_norm(cfg: DecoderConfig, hf: Optional[dict] = None) -> bool:
    """Whether a parallel block stores one norm for both sublayers (Falcon-7B's; probe writes the new architecture's
    two norms whenever ln1 and ln2 may differ)."""
    if hf is not None:
        return hf.get("num_ln_in_parallel_attn") == 1 or not hf.get("new_decoder_architecture", False)
    return cfg.norm_placement is NormPlacement.PARALLEL and cfg.n_kv_heads == 1


def falcon_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    bias = cfg.mlp_bias
    require_fields(cfg, "Falcon", heads_per_layer=None, norm=Norm.LAYER, final_norm=True, positions=Positions.ROTARY,
                   norm_placement={NormPlacement.PRE, NormPlacement.PARALLEL}, rotary_dim=cfg.d_head, gated_mlp=False,
                   d_head=cfg.d_model // cfg.n_heads, qkv_bias=bias, out_bias=bias)
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise ValueError("a Falcon checkpoint needs n_heads * d_head == d_model")
    parallel = cfg.norm_placement is NormPlacement.PARALLEL
    if not parallel and cfg.n_kv_heads not in (1, cfg.n_heads):
        raise ValueError("a sequential Falcon block has one key/value head or one per query head")
    new = parallel and not _one_norm(cfg)
    special = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else cfg.d_vocab - 1
    return {
        "model_type": "falcon", "architectures": ["FalconForCausalLM"], "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "num_kv_heads": cfg.n_kv_heads,
        "new_decoder_architecture": new, "multi_query": cfg.n_kv_heads == 1, "parallel_attn": parallel,
        "num_ln_in_parallel_attn": 2 if new else None, "ffn_hidden_size": cfg.d_mlp, "vocab_size": cfg.d_vocab,
        "max_position_embeddings": cfg.n_ctx, "layer_norm_epsilon": cfg.eps, "alibi": False, "bias": bias,
        "activation": GPT_ACTIVATION_NAMES[cfg.activation], **rope_to_hf(cfg), "tie_word_embeddings": cfg.tied_embeddings,
        "bos_token_id": special, "eos_token_id": special,
    }


def _norms(cfg: DecoderConfig, one_norm: bool) -> dict[str, str]:
    if cfg.norm_placement is not NormPlacement.PARALLEL:
        return {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}
    return {"ln1": "input_layernorm"} if one_norm else {"ln1": "ln_attn", "ln2": "ln_mlp"}


def _names(cfg: DecoderConfig, one_norm: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape); [out, in] as ours (the fused q/k/v in Falcon's order: grouped_qkv)."""
    d, m, fused = cfg.d_model, cfg.d_mlp, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.d_head
    table = {"embed.W_E": ("word_embeddings.weight", (cfg.d_vocab, d)), "ln_final.w": ("ln_f.weight", (d,)),
             "ln_final.b": ("ln_f.bias", (d,))}
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"h.{l}"
        for ours, theirs in _norms(cfg, one_norm).items():
            table.update({f"{o}.{ours}.w": (f"{t}.{theirs}.weight", (d,)), f"{o}.{ours}.b": (f"{t}.{theirs}.bias", (d,))})
        parts = {"attn.qkv": ("self_attention.query_key_value", fused), "attn.out": ("self_attention.dense", d),
                 "mlp.fc_in": ("mlp.dense_h_to_4h", m), "mlp.fc_out": ("mlp.dense_4h_to_h", d)}
        for ours, (theirs, rows) in parts.items():
            table[f"{o}.{ours}.weight"] = (f"{t}.{theirs}.weight", (rows, m if ours == "mlp.fc_out" else d))
            if cfg.mlp_bias:
                table[f"{o}.{ours}.bias"] = (f"{t}.{theirs}.bias", (rows,))
    return table


def falcon_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    one_norm = cfg.norm_placement is NormPlacement.PARALLEL and _one_norm(cfg, source.config)
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in _names(cfg, one_norm).items()}
    for name in [k for k in out if ".attn.qkv." in k]:
        out[name] = grouped_qkv(out[name], cfg.n_heads, cfg.n_kv_heads, cfg.d_head, True)
    if one_norm:
        copy_shared_norm(out, cfg)
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    return out


def falcon_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    one_norm = _one_norm(cfg)
    if one_norm:
        check_shared_norm(params, cfg, "Falcon multi-query")
    out = {}
    for ours, (theirs, _) in _names(cfg, one_norm).items():
        tensor = params[ours]
        out[f"transformer.{theirs}"] = grouped_qkv(tensor, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, False) \
            if ".attn.qkv." in ours else tensor
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}
