"""MPT checkpoints (MosaicML's MPT-7B, MPT-30B and their fine-tunes): config.json <-> DecoderConfig, tensor names.

A pre-norm block with ALiBi positions, no biases anywhere (`no_bias`: its LayerNorms have none either, loaded as
zeros and saved only while they stay zeros), q, k and v fused in probe's own order, an exact-GELU MLP of width
expansion_ratio * d_model, and a tied unembedding. MPT's ALiBi slopes are Bloom's for 2^k heads and the default
alibi_bias_max of 8, which every released MPT has; other settings, qk_ln and logit_scale are refused; clip_qkv
clamps q, k and v.
"""
from __future__ import annotations

from typing import Optional

import torch

from probe.checkpoint_source import (Source, add_zero_norm_biases, check_zero_norm_biases, require_fields,
                                     take_unembed)
from probe.config import Activation, DecoderConfig, Norm, NormPlacement, Positions
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer


def mpt_config(hf: dict) -> DecoderConfig:
    attn = hf.get("attn_config") or {}
    n_heads, d_model = hf["n_heads"], hf["d_model"]
    refused = {"alibi": (attn.get("alibi", False), True), "alibi_bias_max": (attn.get("alibi_bias_max", 8), 8),
               "qk_ln": (attn.get("qk_ln", False), False),
               "logit_scale": (hf.get("logit_scale"), None), "no_bias": (hf.get("no_bias", True), True)}
    for name, (value, supported) in refused.items():
        if value != supported:
            raise CheckpointError(f"MPT's {name}={value!r} is not supported (only {supported!r}, as every released MPT)")
    if n_heads & (n_heads - 1):
        raise CheckpointError(f"MPT's ALiBi slopes for n_heads={n_heads} (not a power of two) are not supported: they "
                              "differ from Bloom's, which probe builds")
    scale = attn.get("softmax_scale")
    return DecoderConfig(
        n_layers=hf["n_layers"], d_model=d_model, n_heads=n_heads, d_mlp=hf.get("expansion_ratio", 4) * d_model,
        d_vocab=hf["vocab_size"], n_ctx=hf["max_seq_len"], eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=Activation.GELU, positions=Positions.ALIBI, attn_scale_dim=None if scale is None else scale ** -2,
        qkv_bias=False, out_bias=False, mlp_bias=False, tied_embeddings=True, clip_qkv=attn.get("clip_qkv"),
    )


def mpt_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    require_fields(cfg, "MPT", heads_per_layer=None, norm=Norm.LAYER, norm_placement=NormPlacement.PRE, final_norm=True,
                   positions=Positions.ALIBI, activation=Activation.GELU, gated_mlp=False, n_kv_heads=cfg.n_heads,
                   d_head=cfg.d_model // cfg.n_heads, qkv_bias=False, out_bias=False, mlp_bias=False,
                   tied_embeddings=True, bidirectional=False, attn_scale_dim=cfg.attn_scale_dim,  # any: softmax_scale
                   clip_qkv=cfg.clip_qkv)
    if cfg.n_heads * cfg.d_head != cfg.d_model or cfg.d_mlp % cfg.d_model or cfg.n_heads & (cfg.n_heads - 1):
        raise ValueError("an MPT checkpoint needs n_heads * d_head == d_model, d_mlp a multiple of d_model and 2^k heads")
    scale = None if cfg.attn_scale_dim is None else cfg.attn_scale_dim ** -0.5
    return {
        "model_type": "mpt", "architectures": ["MptForCausalLM"], "n_layers": cfg.n_layers, "d_model": cfg.d_model,
        "n_heads": cfg.n_heads, "expansion_ratio": cfg.d_mlp // cfg.d_model, "vocab_size": cfg.d_vocab,
        "max_seq_len": cfg.n_ctx, "layer_norm_epsilon": cfg.eps, "no_bias": True, "logit_scale": None,
        "attn_config": {"alibi": True, "alibi_bias_max": 8, "clip_qkv": cfg.clip_qkv, "qk_ln": False,
                        "softmax_scale": scale},
        "tie_word_embeddings": True,
    }


def _names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape) for every stored tensor but the unembedding; [out, in] as ours."""
    d, m = cfg.d_model, cfg.d_mlp
    table = {"embed.W_E": ("wte.weight", (cfg.d_vocab, d)), "ln_final.w": ("norm_f.weight", (d,))}
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"blocks.{l}"
        table.update({
            f"{o}.ln1.w": (f"{t}.norm_1.weight", (d,)), f"{o}.ln2.w": (f"{t}.norm_2.weight", (d,)),
            f"{o}.attn.qkv.weight": (f"{t}.attn.Wqkv.weight", (3 * d, d)),
            f"{o}.attn.out.weight": (f"{t}.attn.out_proj.weight", (d, d)),
            f"{o}.mlp.fc_in.weight": (f"{t}.ffn.up_proj.weight", (m, d)),
            f"{o}.mlp.fc_out.weight": (f"{t}.ffn.down_proj.weight", (d, m)),
        })
    return table


def mpt_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in _names(cfg).items()}
    add_zero_norm_biases(out, cfg)  # MPT's norms have none
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    return out


def mpt_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    check_zero_norm_biases(params, cfg, "an MPT checkpoint")
    return {f"transformer.{theirs}": params[ours].contiguous() for ours, (theirs, _) in _names(cfg).items()}
