"""GPTBigCode checkpoints (BigCode's SantaCoder and StarCoder, and the models trained like them): config.json <->
DecoderConfig, tensor names and layouts.

GPT-2's block (learned positions, LayerNorms with biases, tied embeddings) with nn.Linear layers stored [out, in],
and multi-query attention: one key/value head shared by every query head (`multi_query`, the released models' way),
its q, k and v fused in that order, which is probe's; without multi-query they are fused per head
([head (q k v) d_head], GPT-NeoX's layout). `scale_attn_weights=false` leaves q.k unscaled.
"""
from __future__ import annotations

from typing import Optional

import torch

from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, GPT_ACTIVATIONS, Source, activation_of, grouped_qkv,
                                     require_fields, take_unembed)
from probe.config import DecoderConfig, Norm, NormPlacement, Positions
from probe.tokenizer import Tokenizer


def bigcode_config(hf: dict) -> DecoderConfig:
    d_model, n_heads = hf["n_embd"], hf["n_head"]
    return DecoderConfig(
        n_layers=hf["n_layer"], d_model=d_model, n_heads=n_heads, n_kv_heads=1 if hf.get("multi_query", True) else None,
        d_mlp=hf.get("n_inner") or 4 * d_model, d_vocab=hf["vocab_size"], n_ctx=hf["n_positions"],
        eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=activation_of(hf.get("activation_function", "gelu_pytorch_tanh"), GPT_ACTIVATIONS),
        attn_scale_dim=None if hf.get("scale_attn_weights", True) else 1,
        tied_embeddings=hf.get("tie_word_embeddings", True),
    )


def bigcode_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    require_fields(cfg, "GPTBigCode", heads_per_layer=None, norm=Norm.LAYER, norm_placement=NormPlacement.PRE,
                   final_norm=True, positions=Positions.LEARNED, gated_mlp=False, n_kv_heads={1, cfg.n_heads},
                   d_head=cfg.d_model // cfg.n_heads, attn_scale_dim={None, 1}, qkv_bias=True, out_bias=True,
                   mlp_bias=True)
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise ValueError("a GPTBigCode checkpoint needs n_heads * d_head == d_model")
    special = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else cfg.d_vocab - 1
    return {
        "model_type": "gpt_bigcode", "architectures": ["GPTBigCodeForCausalLM"], "n_layer": cfg.n_layers,
        "n_embd": cfg.d_model, "n_head": cfg.n_heads, "n_inner": cfg.d_mlp, "vocab_size": cfg.d_vocab,
        "n_positions": cfg.n_ctx, "layer_norm_epsilon": cfg.eps, "activation_function": GPT_ACTIVATION_NAMES[cfg.activation],
        "multi_query": cfg.n_kv_heads == 1, "scale_attn_weights": cfg.attn_scale_dim is None,
        "tie_word_embeddings": cfg.tied_embeddings, "bos_token_id": special, "eos_token_id": special,
    }


def _names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape) for every tensor but the unembedding; [out, in] as ours."""
    d, m = cfg.d_model, cfg.d_mlp
    fused = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.d_head
    table = {"embed.W_E": ("wte.weight", (cfg.d_vocab, d)), "pos_embed.W_pos": ("wpe.weight", (cfg.n_ctx, d)),
             "ln_final.w": ("ln_f.weight", (d,)), "ln_final.b": ("ln_f.bias", (d,))}
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"h.{l}"
        table.update({
            f"{o}.ln1.w": (f"{t}.ln_1.weight", (d,)), f"{o}.ln1.b": (f"{t}.ln_1.bias", (d,)),
            f"{o}.attn.qkv.weight": (f"{t}.attn.c_attn.weight", (fused, d)), f"{o}.attn.qkv.bias": (f"{t}.attn.c_attn.bias", (fused,)),
            f"{o}.attn.out.weight": (f"{t}.attn.c_proj.weight", (d, d)), f"{o}.attn.out.bias": (f"{t}.attn.c_proj.bias", (d,)),
            f"{o}.ln2.w": (f"{t}.ln_2.weight", (d,)), f"{o}.ln2.b": (f"{t}.ln_2.bias", (d,)),
            f"{o}.mlp.fc_in.weight": (f"{t}.mlp.c_fc.weight", (m, d)), f"{o}.mlp.fc_in.bias": (f"{t}.mlp.c_fc.bias", (m,)),
            f"{o}.mlp.fc_out.weight": (f"{t}.mlp.c_proj.weight", (d, m)), f"{o}.mlp.fc_out.bias": (f"{t}.mlp.c_proj.bias", (d,)),
        })
    return table


def _layout(tensor: torch.Tensor, ours: str, cfg: DecoderConfig, to_probe: bool) -> torch.Tensor:
    """Without multi-query, q, k and v are fused per head; every other tensor is stored as probe stores it."""
    if ".attn.qkv." not in ours or cfg.n_kv_heads == 1:
        return tensor
    return grouped_qkv(tensor, cfg.n_heads, cfg.n_heads, cfg.d_head, to_probe)


def bigcode_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {ours: _layout(source.take(theirs, shape), ours, cfg, True) for ours, (theirs, shape) in _names(cfg).items()}
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    return out


def bigcode_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {f"transformer.{theirs}": _layout(params[ours], ours, cfg, False) for ours, (theirs, _) in _names(cfg).items()}
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}
