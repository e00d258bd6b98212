"""BitNet b1.58 checkpoints (`bitnet`): Llama's block with a gated relu^2 MLP and an RMSNorm before each output
projection (sub_norms: `attn_sub_norm` over every head's z before o_proj, `ffn_sub_norm` over d_mlp before down_proj).

Unquantised files only. Both released files (microsoft/bitnet-b1.58-2B-4T, -bf16) carry a `quantization_config`
(quant_method "bitnet"): transformers then replaces every linear layer but the head with a BitLinear /
AutoBitLinear that rounds its weights to {-1, 0, 1} times their mean magnitude and each token's input to 8 bits before
the product. probe runs full-precision linear layers, so it refuses those files by name rather than run another model
under their name; a file without the quantization_config (saved by BitNetForCausalLM itself) is loaded exactly."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_hf, llama_to_probe
from probe.checkpoint_source import Source, require_fields, special_token_ids, with_defaults
from probe.config import Activation, DecoderConfig
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

SUB_NORMS = {"attn.z_norm.w": "self_attn.attn_sub_norm.weight", "mlp.ln.w": "mlp.ffn_sub_norm.weight"}  # in each layer


def bitnet_config(hf: dict) -> DecoderConfig:
    quantization = hf.get("quantization_config")
    if quantization:
        mode = f"{quantization.get('linear_class', 'bitlinear')}, {quantization.get('quantization_mode', 'offline')}"
        raise CheckpointError(
            f"this BitNet file is quantised (quantization_config: quant_method {quantization.get('quant_method')!r}, "
            f"{mode}): transformers rounds its linear layers' weights to {{-1, 0, 1}} times a scale and each token's "
            f"inputs to 8 bits, which probe's full-precision layers do not do, so it would run another model; probe "
            f"loads BitNet files without a quantization_config (a BitNetForCausalLM saved unquantised)")
    hf = with_defaults(hf, rope_theta=500000.0)  # (transformers' BitNetConfig default; rope_parameters say otherwise)
    return dataclasses.replace(llama_config(hf, default_act="relu2", default_eps=1e-5), sub_norms=True,
                               mlp_bias=False)


def bitnet_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    require_fields(cfg, "bitnet", sub_norms=True, gated_mlp=True, mlp_bias=False, out_bias=cfg.qkv_bias,
                   activation=set(Activation) - {a for a in Activation if a.learned})
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise ValueError(f"a bitnet checkpoint cannot hold this model: its attn_sub_norm is d_model wide, so "
                         f"n_heads * d_head ({cfg.n_heads * cfg.d_head}) must be d_model ({cfg.d_model})")
    out = llama_config_to_hf(dataclasses.replace(cfg, sub_norms=False), tokenizer, "llama")
    for name in ("mlp_bias", "architectures", "model_type"):
        out.pop(name, None)
    return {**out, "model_type": "bitnet", "architectures": ["BitNetForCausalLM"], "attention_bias": cfg.qkv_bias,
            **special_token_ids(tokenizer)}


def bitnet_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_probe(source, cfg)
    widths = {"attn.z_norm.w": cfg.d_model, "mlp.ln.w": cfg.d_mlp}
    for l in range(cfg.n_layers):
        for ours, theirs in SUB_NORMS.items():
            out[f"blocks.{l}.{ours}"] = source.take(f"layers.{l}.{theirs}", (widths[ours],))
    return out


def bitnet_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_hf(params, cfg)
    for l in range(cfg.n_layers):
        for ours, theirs in SUB_NORMS.items():
            out[f"model.layers.{l}.{theirs}"] = params[f"blocks.{l}.{ours}"].contiguous()
    return out
