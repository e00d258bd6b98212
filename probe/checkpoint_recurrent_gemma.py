"""Google's RecurrentGemma checkpoints (`recurrent_gemma`, RecurrentGemmaForCausalLM: recurrentgemma-2b, -9b and their
-it versions), the open Griffin models: layers cycle through `block_types` ("recurrent", "recurrent", "attention" in the
released files), each a temporal block (Griffin's recurrent block, probe.rg_lru, or local attention over the last
attention_window_size positions with multi-query keys and values, the first partial_rotary_factor of each head rotated,
no q/k/v biases and a bias on o_proj) and a gated GELU MLP with biases whose width is half of intermediate_size
(`mlp_block`: gate_proj, up_proj, down_proj). Gemma's numerics: RMSNorms that multiply by 1 + w in float32
(`temporal_pre_norm`, `channel_pre_norm`, `final_norm`), the embeddings times sqrt(hidden_size) rounded to bfloat16 (a
bfloat16 buffer, whatever the weights' dtype), the logits soft-capped at logits_soft_cap, the head tied to the
embedding unless tie_word_embeddings says not. config.json has no longest sequence: the recurrence has none and attention sees a window, so n_ctx is
max_position_embeddings where a file has it, else 8192 (the released models' training length)."""
from __future__ import annotations

from typing import Optional

import torch

from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, GPT_ACTIVATIONS, Source, activation_of, require_fields, rope_from_hf,
                                     special_token_ids, split_qkv, take_qkv, take_unembed, with_defaults)
from probe.config import Activation, DecoderConfig, Norm, NormPlacement, Positions
from probe.config_file import CheckpointError
from probe.config_rg_lru import RGLRU
from probe.tokenizer import Tokenizer

# transformers' RecurrentGemmaConfig defaults for what a config.json may leave out
DEFAULTS = dict(num_hidden_layers=26, vocab_size=256000, hidden_size=2560, intermediate_size=3 * 2560,
                num_attention_heads=10, lru_width=None, attention_window_size=2048, conv1d_width=4,
                logits_soft_cap=30.0, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                block_types=("recurrent", "recurrent", "attention"), num_key_value_heads=None, attention_bias=False,
                tie_word_embeddings=True)
N_CTX = 8192
RELEASED_ACTIVATIONS = {Activation.GELU_TANH: "gelu_pytorch_tanh"}
RECURRENT, ATTENTION = "recurrent", "attention"
NORMS = {"ln1": "temporal_pre_norm", "ln2": "channel_pre_norm"}
MLP = (("gate", "gate_proj"), ("fc_in", "up_proj"), ("fc_out", "down_proj"))  # ours, theirs
LINEARS = ("linear_x", "linear_y", "linear_out")
LRU_PARTS = ("recurrent_param", "input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias")


def layer_kinds(hf: dict) -> list[str]:
    """Each layer's temporal block, block_types repeated over the layers as transformers' layers_block_type."""
    pattern = list(hf["block_types"])
    if not pattern or set(pattern) - {RECURRENT, ATTENTION}:
        raise CheckpointError(f"block_types={pattern!r} must name a cycle of {RECURRENT!r} and {ATTENTION!r} blocks")
    return [pattern[l % len(pattern)] for l in range(hf["num_hidden_layers"])]


def recurrent_gemma_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, **DEFAULTS)
    d, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    rope, scaling = rope_from_hf(hf)
    if scaling is not None:
        raise CheckpointError(f"RecurrentGemma rotates by the default rope only (transformers refuses others); this "
                              f"file asks for {rope.get('rope_type')!r}")
    d_head = d // n_heads  # (transformers' head_dim, whatever the file says)
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    recurrent = tuple(kind == RECURRENT for kind in layer_kinds(hf))
    spec = None if not any(recurrent) else RGLRU(layers=recurrent, width=hf["lru_width"] or d, n_blocks=n_heads,
                                                  conv_kernel=hf["conv1d_width"])
    return DecoderConfig(
        n_layers=hf["num_hidden_layers"], d_model=d, n_heads=n_heads, d_head=d_head,
        n_kv_heads=hf["num_key_value_heads"] or n_heads, d_mlp=hf["intermediate_size"] // 2, d_vocab=hf["vocab_size"],
        n_ctx=hf.get("max_position_embeddings") or N_CTX, eps=hf["rms_norm_eps"],
        activation=activation_of(hf["hidden_activation"], GPT_ACTIVATIONS), gated_mlp=True, norm=Norm.RMS_FLOAT32,
        positions=Positions.ROTARY, rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rotary_dim=int(d_head * factor), qkv_bias=bool(hf["attention_bias"]), out_bias=True, mlp_bias=True,
        sliding_window=hf["attention_window_size"], logit_softcap=hf["logits_soft_cap"], scale_embed=True,
        tied_embeddings=bool(hf["tie_word_embeddings"]), rg_lru=spec)


def recurrent_gemma_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    spec = cfg.rg_lru
    if cfg.d_head * cfg.n_heads != cfg.d_model or (spec is not None and spec.n_blocks != cfg.n_heads):
        raise ValueError(f"a recurrent_gemma checkpoint's heads split d_model and the recurrence gates have one block "
                         f"per head; this model has n_heads={cfg.n_heads} of d_head={cfg.d_head}, d_model={cfg.d_model}"
                         f"{'' if spec is None else f', gate blocks {spec.n_blocks}'}")
    require_fields(cfg, "recurrent_gemma", norm=Norm.RMS_FLOAT32, norm_placement=NormPlacement.PRE, final_norm=True,
                   positions=Positions.ROTARY, gated_mlp=True, out_bias=True, mlp_bias=True, scale_embed=True,
                   sliding_window=cfg.sliding_window, logit_softcap=cfg.logit_softcap, rg_lru=spec)
    if cfg.sliding_window is None or cfg.logit_softcap is None or cfg.rotary_dim % 2:
        raise ValueError("a recurrent_gemma checkpoint's attention sees a window (attention_window_size), its logits "
                         "are soft-capped (logits_soft_cap) and an even part of each head rotates; this model has "
                         f"sliding_window={cfg.sliding_window}, logit_softcap={cfg.logit_softcap}, rotary_dim="
                         f"{cfg.rotary_dim}")
    kinds = [RECURRENT if cfg.layer_is_rg_lru(l) else ATTENTION for l in range(cfg.n_layers)]
    return {"model_type": "recurrent_gemma", "architectures": ["RecurrentGemmaForCausalLM"],
            "num_hidden_layers": cfg.n_layers, "vocab_size": cfg.d_vocab, "hidden_size": cfg.d_model,
            "intermediate_size": 2 * cfg.d_mlp, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "lru_width": cfg.d_model if spec is None else spec.width,
            "attention_window_size": cfg.sliding_window, "conv1d_width": 4 if spec is None else spec.conv_kernel,
            "logits_soft_cap": cfg.logit_softcap, "rms_norm_eps": cfg.eps,
            # (the released files' spelling of probe's tanh GELU, which transformers computes as probe does)
            "hidden_activation": RELEASED_ACTIVATIONS.get(cfg.activation, GPT_ACTIVATION_NAMES[cfg.activation]),
            "block_types": kinds,
            "attention_bias": cfg.qkv_bias, "tie_word_embeddings": cfg.tied_embeddings, "max_position_embeddings": cfg.n_ctx,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base,
                                "partial_rotary_factor": cfg.rotary_dim / cfg.d_head},
            **special_token_ids(tokenizer)}


def tensor_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape), relative to the file's `model.`, of everything but the attention layers' q/k/v (read
    apart: take_qkv) and the head."""
    d, m = cfg.d_model, cfg.d_mlp
    table = {"embed.W_E": ("embed_tokens.weight", (cfg.d_vocab, d)), "ln_final.w": ("final_norm.weight", (d,))}
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"layers.{l}"
        table.update({f"{o}.{ours}.w": (f"{t}.{theirs}.weight", (d,)) for ours, theirs in NORMS.items()})
        if cfg.layer_is_rg_lru(l):
            spec = cfg.rg_lru
            w, n, bw = spec.width, spec.n_blocks, spec.block_width
            shapes = {"linear_x": (w, d), "linear_y": (w, d), "linear_out": (d, w)}
            for part in LINEARS:
                table[f"{o}.recurrent.{part}.weight"] = (f"{t}.temporal_block.{part}.weight", shapes[part])
                table[f"{o}.recurrent.{part}.bias"] = (f"{t}.temporal_block.{part}.bias", shapes[part][:1])
            table[f"{o}.recurrent.conv_1d.weight"] = (f"{t}.temporal_block.conv_1d.weight", (w, 1, spec.conv_kernel))
            table[f"{o}.recurrent.conv_1d.bias"] = (f"{t}.temporal_block.conv_1d.bias", (w,))
            lru = {"recurrent_param": (w,), "input_gate_weight": (n, bw, bw), "input_gate_bias": (n, bw),
                   "recurrent_gate_weight": (n, bw, bw), "recurrent_gate_bias": (n, bw)}
            for part in LRU_PARTS:
                table[f"{o}.recurrent.rg_lru.{part}"] = (f"{t}.temporal_block.rg_lru.{part}", lru[part])
        else:
            table[f"{o}.attn.out.weight"] = (f"{t}.temporal_block.o_proj.weight", (d, cfg.n_heads * cfg.d_head))
            table[f"{o}.attn.out.bias"] = (f"{t}.temporal_block.o_proj.bias", (d,))
        for (ours, theirs), shape in zip(MLP, ((m, d), (m, d), (d, m))):
            table[f"{o}.mlp.{ours}.weight"] = (f"{t}.mlp_block.{theirs}.weight", shape)
            table[f"{o}.mlp.{ours}.bias"] = (f"{t}.mlp_block.{theirs}.bias", shape[:1])
    return table


def _attention_layers(cfg: DecoderConfig) -> list[int]:
    return [l for l in range(cfg.n_layers) if not cfg.layer_is_rg_lru(l)]


def _qkv_name(layer: int, prefix: str = ""):
    return lambda p, kind: f"{prefix}layers.{layer}.temporal_block.{p}_proj.{kind}"


def recurrent_gemma_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in tensor_names(cfg).items()}
    for l in _attention_layers(cfg):
        out.update(take_qkv(source, cfg, l, _qkv_name(l), bias=cfg.qkv_bias))
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    # Gemma's norms multiply by 1 + w and store w; probe's by w (kept in float32, as RMSNormFloat32 keeps it)
    return {k: v.float() + 1.0 if k.endswith(".w") else v for k, v in out.items()}


def recurrent_gemma_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    params = {k: v.float() - 1.0 if k.endswith(".w") else v for k, v in params.items()}
    out = {f"model.{theirs}": params[ours] for ours, (theirs, _) in tensor_names(cfg).items()}
    for l in _attention_layers(cfg):
        out.update(split_qkv(params, cfg, l, _qkv_name(l, "model."), bias=cfg.qkv_bias))
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}
