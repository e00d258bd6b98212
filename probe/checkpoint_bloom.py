"""Bloom checkpoints (BigScience's bloom-560m ... bloom-7b1, bloomz, and the models trained like them):
config.json <-> DecoderConfig, tensor names and layouts.

GPT-2's pre-norm block with three things of Bloom's own:
- no position vectors: ALiBi adds a per-head distance penalty to the attention scores (positions=alibi);
- a LayerNorm on the token embeddings before block 0 (`embed.ln`: embed_norm, transformer-lens's post_embedding_ln);
- q, k and v fused per head ([head (q k v) d_head] rows), regrouped into probe's [q heads, k heads, v heads] on
  loading and back on saving.
Bloom has no context limit of its own (ALiBi extrapolates); n_ctx is config.json's `seq_length`, else the 2,048
positions Bloom was trained on (transformer-lens's cap too).
"""
from __future__ import annotations

from typing import Optional

import torch

from probe.checkpoint_source import Source, grouped_qkv, require_fields, take_unembed
from probe.config import Activation, DecoderConfig, Norm, NormPlacement, Positions
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

TRAINED_CONTEXT = 2048


def bloom_config(hf: dict) -> DecoderConfig:
    if hf.get("apply_residual_connection_post_layernorm", False):
        raise CheckpointError("apply_residual_connection_post_layernorm=True (the residual taken after each norm) is "
                              "not supported: no released Bloom checkpoint uses it")
    d_model = hf.get("hidden_size") or hf["n_embed"]  # older files spell it n_embed, as transformers still reads
    return DecoderConfig(
        n_layers=hf["n_layer"], d_model=d_model, n_heads=hf["n_head"], d_mlp=4 * d_model, d_vocab=hf["vocab_size"],
        n_ctx=hf.get("seq_length") or TRAINED_CONTEXT, eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=Activation.GELU_TANH,  # bloom_gelu_forward: the tanh approximation
        positions=Positions.ALIBI, embed_norm=True, tied_embeddings=hf.get("tie_word_embeddings", True),
    )


def bloom_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    require_fields(cfg, "Bloom", heads_per_layer=None, norm=Norm.LAYER, norm_placement=NormPlacement.PRE, final_norm=True,
                   positions=Positions.ALIBI, embed_norm=True, activation=Activation.GELU_TANH, gated_mlp=False,
                   n_kv_heads=cfg.n_heads, d_head=cfg.d_model // cfg.n_heads, d_mlp=4 * cfg.d_model, qkv_bias=True,
                   out_bias=True, mlp_bias=True, bidirectional=False)
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise ValueError("a Bloom checkpoint needs n_heads * d_head == d_model")
    bos = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else cfg.d_vocab - 1
    eos = tokenizer.eos_id if tokenizer is not None and tokenizer.eos_id is not None else bos
    pad = tokenizer.pad_id if tokenizer is not None else None
    return {
        "model_type": "bloom", "architectures": ["BloomForCausalLM"], "n_layer": cfg.n_layers, "hidden_size": cfg.d_model,
        "n_head": cfg.n_heads, "vocab_size": cfg.d_vocab, "layer_norm_epsilon": cfg.eps, "seq_length": cfg.n_ctx,
        "apply_residual_connection_post_layernorm": False, "tie_word_embeddings": cfg.tied_embeddings,
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
    }


def _names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape) for every tensor but the fused q/k/v and the unembedding; [out, in] as ours."""
    d, m = cfg.d_model, cfg.d_mlp
    table = {"embed.W_E": ("word_embeddings.weight", (cfg.d_vocab, d)),
             "embed.ln.w": ("word_embeddings_layernorm.weight", (d,)), "embed.ln.b": ("word_embeddings_layernorm.bias", (d,)),
             "ln_final.w": ("ln_f.weight", (d,)), "ln_final.b": ("ln_f.bias", (d,))}
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"h.{l}"
        table.update({
            f"{o}.ln1.w": (f"{t}.input_layernorm.weight", (d,)), f"{o}.ln1.b": (f"{t}.input_layernorm.bias", (d,)),
            f"{o}.ln2.w": (f"{t}.post_attention_layernorm.weight", (d,)),
            f"{o}.ln2.b": (f"{t}.post_attention_layernorm.bias", (d,)),
            f"{o}.attn.out.weight": (f"{t}.self_attention.dense.weight", (d, d)),
            f"{o}.attn.out.bias": (f"{t}.self_attention.dense.bias", (d,)),
            f"{o}.mlp.fc_in.weight": (f"{t}.mlp.dense_h_to_4h.weight", (m, d)),
            f"{o}.mlp.fc_in.bias": (f"{t}.mlp.dense_h_to_4h.bias", (m,)),
            f"{o}.mlp.fc_out.weight": (f"{t}.mlp.dense_4h_to_h.weight", (d, m)),
            f"{o}.mlp.fc_out.bias": (f"{t}.mlp.dense_4h_to_h.bias", (d,)),
        })
    return table


def bloom_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in _names(cfg).items()}
    d, h = cfg.d_model, cfg.n_heads
    for l in range(cfg.n_layers):
        fused = f"h.{l}.self_attention.query_key_value"
        out[f"blocks.{l}.attn.qkv.weight"] = grouped_qkv(source.take(f"{fused}.weight", (3 * d, d)), h, h, cfg.d_head, True)
        out[f"blocks.{l}.attn.qkv.bias"] = grouped_qkv(source.take(f"{fused}.bias", (3 * d,)), h, h, cfg.d_head, True)
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    return out


def bloom_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {f"transformer.{theirs}": params[ours] for ours, (theirs, _) in _names(cfg).items()}
    for l in range(cfg.n_layers):
        fused = f"transformer.h.{l}.self_attention.query_key_value"
        out[f"{fused}.weight"] = grouped_qkv(params[f"blocks.{l}.attn.qkv.weight"], cfg.n_heads, cfg.n_heads, cfg.d_head, False)
        out[f"{fused}.bias"] = grouped_qkv(params[f"blocks.{l}.attn.qkv.bias"], cfg.n_heads, cfg.n_heads, cfg.d_head, False)
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}
