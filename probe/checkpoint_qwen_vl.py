"""Qwen3-VL, Qwen3-VL-MoE and Qwen2.5-VL checkpoints (`qwen3_vl`, `qwen3_vl_moe`, `qwen2_5_vl`): their language model,
read from text_config as Qwen3's (per-head q/k norms), Qwen3-MoE's (softmax-routed experts, always renormalised) and
Qwen2's (q/k/v biases), the vision tower never read.

On text their positions are Qwen3's: the multimodal rope (mrope_section) gives each of its three sections (time,
height, width) the token's one position when there is no image, so every frequency turns by it, as a 1-D rope's
does; the vision tower's deepstack features join the residual only at image tokens. probe reads text, so the model is
exact there (tested against transformers' multimodal model on token ids) and saves as the text-only format.
"""
from __future__ import annotations

from pathlib import Path

import torch

from probe.checkpoint_llama import llama_to_probe, qwen2_config, qwen3_config
from probe.checkpoint_moe import qwen3_moe_config, take_experts
from probe.checkpoint_source import Source, text_config, with_fields
from probe.config import DecoderConfig
from probe.config_file import CheckpointError, ConfigFields

# transformers' Qwen3VLTextConfig / Qwen3VLMoeTextConfig defaults, for what a text_config leaves out (the MoE one's
# head_dim is d_model / n_heads then)
TEXT_DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
                 "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "attention_bias": False,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
MOE_DEFAULTS = {**{k: v for k, v in TEXT_DEFAULTS.items() if k != "head_dim"}, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
                "num_attention_heads": 16, "num_key_value_heads": 16, "num_local_experts": 60, "num_experts_per_tok": 4,
                "moe_intermediate_size": 1408, "decoder_sparse_step": 1, "mlp_only_layers": []}
# transformers' Qwen2_5_VLTextConfig defaults (Qwen2.5-VL-72B's shape)
QWEN25_DEFAULTS = {"vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_act": "silu",
                   "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
# what a file holds beside the language model (transformers saves Qwen2.5-VL in its released layout: the language
# model under `model.`, the vision tower under `visual.`)
VISION = ("model.visual.", "visual.")


def _text(hf: dict, family: str, defaults: dict) -> ConfigFields:
    text = text_config(hf, family, default_tied=False)
    return ConfigFields({**defaults, **text}, getattr(text, "path", Path("config.json")), "text_config.")


def qwen3_vl_config(hf: dict) -> DecoderConfig:
    return qwen3_config(_text(hf, "Qwen3-VL", TEXT_DEFAULTS))


def qwen2_5_vl_config(hf: dict) -> DecoderConfig:
    return qwen2_config(_text(hf, "Qwen2.5-VL", QWEN25_DEFAULTS))


def qwen3_vl_moe_config(hf: dict) -> DecoderConfig:
    text = _text(hf, "Qwen3-VL-MoE", MOE_DEFAULTS)
    if text.get("norm_topk_prob") is False:
        raise CheckpointError("norm_topk_prob=false: Qwen3-VL-MoE's router always renormalises the chosen experts' "
                              "weights (transformers ignores the field); drop it")
    return qwen3_moe_config(with_fields(text, norm_topk_prob=True))  # (its router always renormalises)


def qwen_vl_config_to_hf(cfg: DecoderConfig, tokenizer) -> dict:
    raise ValueError("probe keeps a Qwen-VL model's language model only; it saves as the text-only Qwen3 (qwen3), "
                     "Qwen3-MoE (qwen3_moe) or Qwen2 (qwen2), which transformers loads")


def _language_model(source: Source) -> None:
    for name in [n for n in source.state if n.startswith(VISION)]:
        del source.state[name]  # never read: the vision tower stays on disk


def vl_text_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    _language_model(source)
    return llama_to_probe(source, cfg)


def qwen3_vl_moe_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    _language_model(source)
    out = llama_to_probe(source, cfg)  # everything but the experts
    out.update(take_experts(source, cfg, "qwen3_moe"))
    return out
