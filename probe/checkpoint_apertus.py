"""Apertus checkpoints (swiss-ai/Apertus-8B, -70B): Llama's attention with each head's q and k RMS-normalised (as
Qwen3's), norms named `attention_layernorm` and `feedforward_layernorm`, and an ungated MLP whose xIELU activation
learns two scalars per layer: `mlp.act_fn.alpha_p` and `alpha_n` [1] (softplus inverses), beside the buffers `beta`
and `eps` [] that transformers saves with them (and needs: it fills missing ones with whatever memory held)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_hf, llama_to_probe
from probe.checkpoint_source import GPT_ACTIVATIONS, Source, with_defaults
from probe.config import Activation, DecoderConfig
from probe.tokenizer import Tokenizer

APERTUS_NORMS = {"ln1": "attention_layernorm", "ln2": "feedforward_layernorm"}
XIELU_PARAMETERS = ("alpha_p", "alpha_n")  # stored [1]
XIELU_BUFFERS = ("beta", "eps")  # stored []


def apertus_config(hf: dict) -> DecoderConfig:
    # (transformers' defaults for a file without them: the released models' Llama 3 rope scaling)
    hf = with_defaults(hf, rope_parameters={"rope_type": "llama3", "rope_theta": 12e6, "factor": 8.0,
                                            "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0})
    config = llama_config(hf, default_act="xielu", activations={**GPT_ACTIVATIONS, "xielu": Activation.XIELU},
                          default_eps=1e-5)
    return dataclasses.replace(config, gated_mlp=False, qk_norm=True)


def apertus_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    out = llama_config_to_hf(cfg, tokenizer, "apertus")
    out.pop("mlp_bias")  # (Apertus's MLP has no biases, and its config no such field)
    return out


def apertus_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_probe(source, cfg, norms=APERTUS_NORMS)
    if cfg.activation is not Activation.XIELU:
        return out
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}.mlp.act_fn", f"layers.{l}.mlp.act_fn"
        for name in XIELU_PARAMETERS:
            out[f"{o}.{name}"] = source.take(f"{t}.{name}", (1,)).reshape(())
        for name in XIELU_BUFFERS:
            out[f"{o}.{name}"] = source.take(f"{t}.{name}", ())
    return out


def apertus_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_hf(params, cfg, norms=APERTUS_NORMS)
    if cfg.activation is Activation.XIELU:
        for l in range(cfg.n_layers):
            for name in XIELU_PARAMETERS + XIELU_BUFFERS:
                value = params[f"blocks.{l}.mlp.act_fn.{name}"]
                out[f"model.layers.{l}.mlp.act_fn.{name}"] = value.reshape(1) if name in XIELU_PARAMETERS else value
    return out
