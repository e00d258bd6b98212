"""Cohere checkpoints (Command R, Aya 23, Aya Expanse) and Cohere 2's (Command R7B, Command A): a parallel block
whose one LayerNorm (no bias) attention and the gated MLP both read, rotary on whole heads with adjacent dimensions
paired (rotary_adjacent_pairs), grouped key/value heads, and the logits times `logit_scale`.

As in Phi's and GPT-J's blocks, ln2 is loaded as a copy of ln1 (transformer-lens's layout), and saved only while the
two agree; the norms' biases are zeros, saved only while they stay so. The logit scale is folded into W_U on loading
(so the model is untied) and saved as 1. Command R+'s per-head q/k LayerNorms (`use_qk_norm`) are refused. Cohere 2
windows three layers in four (`layer_types`, or the older `sliding_window_pattern`) and rotates only those: its full
layers have no positions (NoPE: `rotary_layers`)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_hf, llama_to_probe
from probe.checkpoint_source import (LAYER_KINDS, Source, add_zero_norm_biases, check_shared_norm, check_zero_norm_biases,
                                     copy_shared_norm, layer_kinds, layer_types_to_hf)
from probe.config import DecoderConfig, Norm, NormPlacement
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

COHERE_NORMS = {"ln1": "input_layernorm"}  # the block's one norm; ln2 is its copy


def cohere_config(hf: dict) -> DecoderConfig:
    if hf.get("use_qk_norm"):
        raise CheckpointError("use_qk_norm=true (Command R+'s LayerNorm over each head's q and k, with weights per "
                              "head) is not supported")
    return dataclasses.replace(llama_config(hf), norm=Norm.LAYER, eps=hf.get("layer_norm_eps", 1e-5),
                               norm_placement=NormPlacement.PARALLEL, rotary_adjacent_pairs=True, tied_embeddings=False)


def cohere2_config(hf: dict) -> DecoderConfig:
    sliding = tuple(kind == LAYER_KINDS[0] for kind in layer_kinds(hf, hf.get("sliding_window_pattern", 4)))
    window = hf.get("sliding_window", 4096) if any(sliding) else None
    return dataclasses.replace(cohere_config(hf), sliding_window=window, rotary_layers=sliding,
                               sliding_layers=None if window is None else sliding)


def cohere_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer], model_type: str = "cohere") -> dict:
    out = llama_config_to_hf(cfg, tokenizer, model_type)
    out["layer_norm_eps"] = out.pop("rms_norm_eps")
    out.update(logit_scale=1.0, attention_bias=cfg.qkv_bias)
    out.pop("mlp_bias")  # (Cohere's MLP has no biases, and its config no such field)
    if model_type == "cohere":
        out["use_qk_norm"] = False
        return out
    windowed = [cfg.layer_window(l) is not None for l in range(cfg.n_layers)]
    if [cfg.layer_rotates(l) for l in range(cfg.n_layers)] != windowed:
        raise ValueError("a cohere2 checkpoint rotates exactly its windowed layers; this model's rotary_layers "
                         f"{cfg.rotary_layers} are not its windowed ones {tuple(windowed)}")
    out.update(layer_types=layer_types_to_hf(cfg), sliding_window=cfg.sliding_window)
    return out


def cohere_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    hf = source.config
    out = llama_to_probe(source, dataclasses.replace(cfg, tied_embeddings=hf.get("tie_word_embeddings", True)),
                         norms=COHERE_NORMS)
    add_zero_norm_biases(out, cfg)
    copy_shared_norm(out, cfg)
    out["unembed.weight"] = out["unembed.weight"] * hf.get("logit_scale", 0.0625)  # a new tensor, also when tied
    return out


def cohere_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    check_shared_norm(params, cfg, "Cohere")
    check_zero_norm_biases(params, cfg, "a Cohere checkpoint")
    return llama_to_hf(params, cfg, norms=COHERE_NORMS)
