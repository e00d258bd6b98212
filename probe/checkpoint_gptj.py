"""GPT-J checkpoints (EleutherAI's GPT-J-6B) and CodeGen's (Salesforce's, GPT-J's block): config.json <->
DecoderConfig, tensor names.

A parallel block whose one LayerNorm attention and the MLP both read (as Phi's: ln2 is loaded as a copy of ln1),
bias-free q, k, v and output projections, rotary positions on each head's first rotary_dim dimensions with adjacent
dimensions paired (2i with 2i + 1: rotary_adjacent_pairs), and an unembedding with a bias. CodeGen fuses q, k and v
in one `attn.qkv_proj` [3 d_model, d_model] laid out for the four model-parallel shards it was trained on: each
shard's rows hold its quarter of q, then of v, then of k.
"""
from __future__ import annotations

from typing import Optional

import torch

from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, GPT_ACTIVATIONS, Source, activation_of, check_shared_norm,
                                     copy_shared_norm, require_fields, split_qkv, take_qkv, take_unembed)
from probe.config import DecoderConfig, Norm, NormPlacement, Positions
from probe.tokenizer import Tokenizer


def gptj_config(hf: dict) -> DecoderConfig:
    d_model, n_heads = hf["n_embd"], hf["n_head"]
    return DecoderConfig(
        n_layers=hf["n_layer"], d_model=d_model, n_heads=n_heads, d_mlp=hf.get("n_inner") or 4 * d_model,
        d_vocab=hf["vocab_size"], n_ctx=hf["n_positions"], eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=activation_of(hf.get("activation_function", "gelu_new"), GPT_ACTIVATIONS),
        norm_placement=NormPlacement.PARALLEL, positions=Positions.ROTARY, rotary_adjacent_pairs=True,
        rotary_dim=hf.get("rotary_dim", 64) or d_model // n_heads,  # 64: transformers' default, GPT-J-6B's
        qkv_bias=False, out_bias=False, unembed_bias=True,
        tied_embeddings=hf.get("tie_word_embeddings", False),
    )


CODEGEN_SHARDS = 4


def gptj_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer], model_type: str = "gptj") -> dict:
    require_fields(cfg, model_type, heads_per_layer=None, norm=Norm.LAYER, norm_placement=NormPlacement.PARALLEL,
                   final_norm=True, positions=Positions.ROTARY, rotary_adjacent_pairs=True, rotary_base=10000.0,
                   rotary_scaling=None, gated_mlp=False, n_kv_heads=cfg.n_heads, d_head=cfg.d_model // cfg.n_heads,
                   qkv_bias=False, out_bias=False, mlp_bias=True, unembed_bias=True)
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise ValueError(f"a {model_type} checkpoint needs n_heads * d_head == d_model")
    if model_type == "codegen" and cfg.d_model % CODEGEN_SHARDS:
        raise ValueError(f"a codegen checkpoint splits d_model over {CODEGEN_SHARDS} shards; d_model={cfg.d_model}")
    special = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else cfg.d_vocab - 1
    return {
        "model_type": model_type, "n_layer": cfg.n_layers, "n_embd": cfg.d_model,
        "architectures": ["CodeGenForCausalLM" if model_type == "codegen" else "GPTJForCausalLM"],
        "n_head": cfg.n_heads, "n_inner": cfg.d_mlp, "vocab_size": cfg.d_vocab, "n_positions": cfg.n_ctx,
        "rotary_dim": cfg.rotary_dim, "layer_norm_epsilon": cfg.eps,
        "activation_function": GPT_ACTIVATION_NAMES[cfg.activation],
        "tie_word_embeddings": cfg.tied_embeddings, "bos_token_id": special, "eos_token_id": special,
    }


def _names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape) for every tensor but the fused q/k/v and the shared norm; [out, in] as ours."""
    d, m = cfg.d_model, cfg.d_mlp
    table = {"embed.W_E": ("wte.weight", (cfg.d_vocab, d)), "ln_final.w": ("ln_f.weight", (d,)),
             "ln_final.b": ("ln_f.bias", (d,))}
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"h.{l}"
        table.update({
            f"{o}.ln1.w": (f"{t}.ln_1.weight", (d,)), f"{o}.ln1.b": (f"{t}.ln_1.bias", (d,)),
            f"{o}.attn.out.weight": (f"{t}.attn.out_proj.weight", (d, d)),
            f"{o}.mlp.fc_in.weight": (f"{t}.mlp.fc_in.weight", (m, d)), f"{o}.mlp.fc_in.bias": (f"{t}.mlp.fc_in.bias", (m,)),
            f"{o}.mlp.fc_out.weight": (f"{t}.mlp.fc_out.weight", (d, m)),
            f"{o}.mlp.fc_out.bias": (f"{t}.mlp.fc_out.bias", (d,)),
        })
    return table


def gptj_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in _names(cfg).items()}
    for l in range(cfg.n_layers):
        out.update(take_qkv(source, cfg, l, lambda p, kind, l=l: f"h.{l}.attn.{p}_proj.{kind}"))
    copy_shared_norm(out, cfg)
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    out["unembed.bias"] = source.take("lm_head.bias", (cfg.d_vocab,))
    return out


def gptj_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    check_shared_norm(params, cfg, "GPT-J")
    out = {f"transformer.{theirs}": params[ours] for ours, (theirs, _) in _names(cfg).items()}
    for l in range(cfg.n_layers):
        out.update(split_qkv(params, cfg, l, lambda p, kind, l=l: f"transformer.h.{l}.attn.{p}_proj.{kind}"))
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    out["lm_head.bias"] = params["unembed.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def codegen_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    d = cfg.d_model
    for l in range(cfg.n_layers):  # the fused projection unpacked into GPT-J's three, then read as GPT-J's
        shards = source.take(f"h.{l}.attn.qkv_proj.weight", (3 * d, d)).view(CODEGEN_SHARDS, 3, d // CODEGEN_SHARDS, d)
        for p, part in zip("qvk", shards.unbind(1)):
            source.state[f"h.{l}.attn.{p}_proj.weight"] = part.reshape(d, d)
    return gptj_to_probe(source, cfg)


def codegen_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out, d = gptj_to_hf(params, cfg), cfg.d_model
    for l in range(cfg.n_layers):
        t = f"transformer.h.{l}.attn"
        parts = [out.pop(f"{t}.{p}_proj.weight").view(CODEGEN_SHARDS, d // CODEGEN_SHARDS, d) for p in "qvk"]
        out[f"{t}.qkv_proj.weight"] = torch.stack(parts, dim=1).reshape(3 * d, d)
    return out
