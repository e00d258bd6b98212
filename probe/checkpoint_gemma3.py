"""Gemma 3 checkpoints: config.json <-> DecoderConfig. The text-only ones (`gemma3_text`: gemma-3-270m, gemma-3-1b) and
the language model of the multimodal ones (`gemma3`: gemma-3-4b, -12b, -27b; their text_config), whose vision tower
and projector are left out: probe reads text.

Gemma 2's sandwich block and (1 + w) norms, with Qwen3's per-head q and k norms (Gemma's norms too), no cap on the
scores (transformers' Gemma 3 never applies attn_logit_softcapping), a cap on the logits only where
final_logit_softcapping sets one, and two rotary settings: the sliding layers rotate by their own base
(rope_local_base_freq, 10,000) and unscaled, the full-attention layers by rope_theta (1,000,000) with the file's
rescaling (linear x8 on the larger models). Tensor names are Gemma's (checkpoint_llama.py's gemma_to_probe /
gemma_to_hf).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from probe.checkpoint_llama import gemma_config, gemma_to_probe
from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, language_model_of, layer_kinds, layer_types_to_hf,
                                     require_fields, rope_by_layer_kind, rope_to_hf)
from probe.config import Activation, DecoderConfig, Norm, NormPlacement, Positions
from probe.config_file import CheckpointError, ConfigFields
from probe.tokenizer import Tokenizer

# transformers' Gemma3TextConfig defaults, for the fields a config.json leaves out: the multimodal checkpoints'
# text_config names only a few (gemma-3-4b's: hidden_size, intermediate_size, num_hidden_layers, rope_scaling,
# sliding_window), and the rest is these (tests/test_checkpoint_gemma3.py compares them with transformers')
TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
                 "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                 "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "attention_bias": False}


def gemma3_config(hf: dict) -> DecoderConfig:
    hf = ConfigFields({**TEXT_DEFAULTS, **hf}, getattr(hf, "path", Path("config.json")), getattr(hf, "prefix", ""))
    if hf.get("use_bidirectional_attention"):
        raise CheckpointError("use_bidirectional_attention=true (an embedding model's attention) is not supported")
    # older files: every sliding_window_pattern-th layer a full one, rope_local_base_freq the sliding layers' base
    sliding = tuple(t == "sliding_attention" for t in layer_kinds(hf, hf.get("sliding_window_pattern", 6)))
    full_rope, sliding_rope, scaling = rope_by_layer_kind(hf, 1_000_000.0, hf.get("rope_local_base_freq", 10_000.0))
    window = hf["sliding_window"] if any(sliding) else None
    return dataclasses.replace(
        gemma_config(hf, "hidden_activation"), norm_placement=NormPlacement.SANDWICH, qk_norm=True,
        # config.json may name attn_logit_softcapping, which transformers' Gemma 3 never applies: no cap, as there
        attn_scale_dim=hf.get("query_pre_attn_scalar", 256), logit_softcap=hf.get("final_logit_softcapping"),
        sliding_window=window,
        sliding_layers=None if window is None else sliding, rotary_base=float(full_rope["rope_theta"]),
        rotary_scaling=scaling, sliding_rotary_base=None if window is None else float(sliding_rope["rope_theta"]),
    )


def gemma3_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    if cfg.activation is Activation.GELU:
        raise ValueError("a Gemma 3 checkpoint cannot hold activation=gelu (exact): transformers reads Gemma's 'gelu' "
                         "as the tanh approximation")
    same = ("attn_scale_dim", "logit_softcap", "sliding_window", "sliding_layers", "sliding_rotary_base")
    require_fields(cfg, "Gemma 3", heads_per_layer=None, scale_embed=True, norm=Norm.RMS_FLOAT32, final_norm=True,
                   positions=Positions.ROTARY, rotary_dim=cfg.d_head, gated_mlp=True, mlp_bias=False,
                   out_bias=cfg.qkv_bias, norm_placement=NormPlacement.SANDWICH, qk_norm=True,
                   **{f: getattr(cfg, f) for f in same})
    full = rope_to_hf(cfg)["rope_parameters"]
    return {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.d_head, "intermediate_size": cfg.d_mlp, "vocab_size": cfg.d_vocab,
        "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.eps, "attention_bias": cfg.qkv_bias,
        "hidden_activation": GPT_ACTIVATION_NAMES[cfg.activation], "tie_word_embeddings": cfg.tied_embeddings,
        "query_pre_attn_scalar": cfg.d_head if cfg.attn_scale_dim is None else cfg.attn_scale_dim,
        "attn_logit_softcapping": None, "final_logit_softcapping": cfg.logit_softcap,
        "sliding_window": cfg.sliding_window if cfg.sliding_window is not None else 4096,
        "layer_types": layer_types_to_hf(cfg),
        "rope_parameters": {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": cfg.sliding_rotary_base or cfg.rotary_base}},
    }


# ---- the multimodal checkpoints' language model -------------------------------------------------------------
gemma3_multimodal = language_model_of("Gemma 3", "Gemma 3 (gemma3_text)", gemma3_config, gemma_to_probe,
                                      default_tied=True)
