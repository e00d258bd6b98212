"""HunYuan dense checkpoints (`hunyuan_v1_dense`: Tencent's Hunyuan-0.5B ... 7B, Hunyuan-MT): Llama's block with each
head's q and k RMS-normalised after rotary (`query_layernorm` / `key_layernorm`, read as probe's q/k norms with
`qk_norm_after_rope`), and the released files' "dynamic" rope with a fixed `alpha`, which only stretches the base:
theta * alpha^(d_head / (d_head - 2)) (a rope without alpha would change with the length, and is refused)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_hf, llama_to_probe
from probe.checkpoint_source import Source, rename_layer_weights, with_fields
from probe.config import DecoderConfig
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

NORMS = {"q_norm": "query_layernorm", "k_norm": "key_layernorm"}  # ours -> theirs, in each layer's self_attn


def hunyuan_config(hf: dict) -> DecoderConfig:
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "dynamic" and not rope.get("alpha"):
        raise CheckpointError("rope_type 'dynamic' without an alpha rescales the rotary frequencies by the input's "
                              "length, which probe does not do; supported: default, or dynamic with a fixed alpha")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    cfg = llama_config(with_fields(hf, rope_parameters={"rope_type": "default", "rope_theta": theta}), default_eps=1e-5)
    base = cfg.rotary_base
    if kind == "dynamic":
        base *= float(rope["alpha"]) ** (cfg.d_head / (cfg.d_head - 2))
    return dataclasses.replace(cfg, qk_norm=True, qk_norm_after_rope=True, rotary_base=base)


def hunyuan_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    out = llama_config_to_hf(cfg, tokenizer, "hunyuan_v1_dense")
    out["head_dim"] = cfg.d_head  # (the alpha rope reads it; the rescaled base is written as the base)
    return out


def hunyuan_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    rename_layer_weights(source.state, {theirs: ours for ours, theirs in NORMS.items()}, cfg.n_layers, "", "self_attn")
    return llama_to_probe(source, cfg)


def hunyuan_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_hf(params, cfg)
    rename_layer_weights(out, NORMS, cfg.n_layers, "model.", "self_attn")
    return out
