"""GPT-Neo checkpoints (EleutherAI's GPT-Neo, the TinyStories models): config.json <-> DecoderConfig, tensor names.

GPT-2's block with three differences: q, k and v are separate bias-free nn.Linear layers, q.k is not scaled
(attn_scale_dim=1), and "local" layers see only the last `window_size` keys (a sliding window on those layers).
"""
from __future__ import annotations

from typing import Optional

import torch

from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, GPT_ACTIVATIONS, Source, activation_of, require_fields,
                                     split_qkv, take_qkv, take_unembed)
from probe.config import DecoderConfig, Norm, NormPlacement, Positions
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

ATTENTION_KINDS = ("global", "local")


def attention_layers(hf: dict) -> list[str]:
    """Each layer's kind, as transformers expands `attention_types` ([[kinds, repeats], ...]) into `attention_layers`."""
    spec = hf.get("attention_types", [[["global", "local"], 12]])  # transformers' default
    n_layers, layers = hf["num_layers"], []
    try:
        for kinds, repeats in spec:
            if not (isinstance(kinds, list) and all(isinstance(k, str) for k in kinds) and type(repeats) is int
                    and repeats >= 0 and len(layers) + len(kinds) * repeats <= n_layers):  # no list of millions
                raise TypeError
            layers.extend(kinds * repeats)
    except (TypeError, ValueError):
        raise CheckpointError(f"attention_types must be a list of [[kind, ...], repeats] pairs giving each of the "
                              f"num_layers={n_layers} layers a kind, got {str(spec)[:80]}") from None
    unknown = sorted(set(layers) - set(ATTENTION_KINDS))
    if unknown:
        raise CheckpointError(f"attention_types names {unknown}; GPT-Neo layers are 'global' or 'local'")
    if len(layers) != n_layers:
        raise CheckpointError(f"attention_types gives {len(layers)} layers but num_layers={n_layers}; "
                              "make them agree (transformers refuses this file too)")
    return layers


def gptneo_config(hf: dict) -> DecoderConfig:
    local = tuple(kind == "local" for kind in attention_layers(hf))
    return DecoderConfig(
        n_layers=hf["num_layers"], d_model=hf["hidden_size"], n_heads=hf["num_heads"],
        d_mlp=hf.get("intermediate_size") or 4 * hf["hidden_size"], d_vocab=hf["vocab_size"],
        n_ctx=hf["max_position_embeddings"], eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=activation_of(hf.get("activation_function", "gelu_new"), GPT_ACTIVATIONS),
        qkv_bias=False, attn_scale_dim=1.0,
        sliding_window=hf.get("window_size", 256) if any(local) else None, sliding_layers=local if any(local) else None,
        tied_embeddings=hf.get("tie_word_embeddings", True),
    )


def gptneo_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    require_fields(cfg, "GPT-Neo", heads_per_layer=None, norm=Norm.LAYER, norm_placement=NormPlacement.PRE, final_norm=True,
                   positions=Positions.LEARNED, gated_mlp=False, n_kv_heads=cfg.n_heads, d_head=cfg.d_model // cfg.n_heads,
                   qkv_bias=False, out_bias=True, mlp_bias=True, attn_scale_dim=1.0,
                   sliding_window=cfg.sliding_window, sliding_layers=cfg.sliding_layers)
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise ValueError("a GPT-Neo checkpoint needs n_heads * d_head == d_model")
    kinds = ["local" if cfg.layer_window(l) is not None else "global" for l in range(cfg.n_layers)]
    runs: list[list] = []  # run-length: [[["global"], 1], [["local"], 1], ...] expands back to `kinds`
    for kind in kinds:
        if runs and runs[-1][0] == [kind]:
            runs[-1][1] += 1
        else:
            runs.append([[kind], 1])
    special = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else cfg.d_vocab - 1
    return {
        "model_type": "gpt_neo", "architectures": ["GPTNeoForCausalLM"], "num_layers": cfg.n_layers,
        "hidden_size": cfg.d_model, "num_heads": cfg.n_heads, "intermediate_size": cfg.d_mlp, "vocab_size": cfg.d_vocab,
        "max_position_embeddings": cfg.n_ctx, "layer_norm_epsilon": cfg.eps,
        "activation_function": GPT_ACTIVATION_NAMES[cfg.activation], "attention_types": runs,
        "window_size": cfg.sliding_window if cfg.sliding_window is not None else 256,
        "tie_word_embeddings": cfg.tied_embeddings, "bos_token_id": special, "eos_token_id": special,
    }


def _names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape); q, k and v are taken one by one and fused separately."""
    d, m = cfg.d_model, cfg.d_mlp
    table = {"embed.W_E": ("wte.weight", (cfg.d_vocab, d)), "pos_embed.W_pos": ("wpe.weight", (cfg.n_ctx, d)),
             "ln_final.w": ("ln_f.weight", (d,)), "ln_final.b": ("ln_f.bias", (d,))}
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"h.{l}"
        table.update({
            f"{o}.ln1.w": (f"{t}.ln_1.weight", (d,)), f"{o}.ln1.b": (f"{t}.ln_1.bias", (d,)),
            f"{o}.attn.out.weight": (f"{t}.attn.attention.out_proj.weight", (d, d)),
            f"{o}.attn.out.bias": (f"{t}.attn.attention.out_proj.bias", (d,)),
            f"{o}.ln2.w": (f"{t}.ln_2.weight", (d,)), f"{o}.ln2.b": (f"{t}.ln_2.bias", (d,)),
            f"{o}.mlp.fc_in.weight": (f"{t}.mlp.c_fc.weight", (m, d)), f"{o}.mlp.fc_in.bias": (f"{t}.mlp.c_fc.bias", (m,)),
            f"{o}.mlp.fc_out.weight": (f"{t}.mlp.c_proj.weight", (d, m)),
            f"{o}.mlp.fc_out.bias": (f"{t}.mlp.c_proj.bias", (d,)),
        })
    return table


def gptneo_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in _names(cfg).items()}
    for l in range(cfg.n_layers):
        out.update(take_qkv(source, cfg, l, lambda p, kind, l=l: f"h.{l}.attn.attention.{p}_proj.{kind}"))
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    return out


def gptneo_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {f"transformer.{theirs}": params[ours] for ours, (theirs, _) in _names(cfg).items()}
    for l in range(cfg.n_layers):
        out.update(split_qkv(params, cfg, l, lambda p, kind, l=l: f"transformer.h.{l}.attn.attention.{p}_proj.{kind}"))
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}
