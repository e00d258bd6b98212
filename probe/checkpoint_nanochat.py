"""NanoChat checkpoints (`nanochat`: karpathy/nanochat-d20, -d32): Llama's attention with every norm a weightless
RMSNorm (norm_weights False), one more right after the token embedding (embed_norm: transformers runs the final norm's
module there too), q and k of each head RMS-normalised with no weight after their rotation (Llama 4's
ChunkedAttention(qk_norm=True), no layer chunked), rotary pairs turned the other way (rotary_clockwise: NanoChat's
rotate_half flips Llama's signs), an ungated relu^2 MLP (`fc1` / `fc2`) and the logits soft-capped (15 by default)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_hf, llama_to_probe
from probe.checkpoint_source import Source, rename_layer_weights, require_fields, special_token_ids
from probe.config import Activation, DecoderConfig, Norm
from probe.config_chunked import ChunkedAttention
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

MLP = {"up_proj": "fc1", "down_proj": "fc2"}  # Llama's names -> NanoChat's, in each layer's mlp


def nanochat_config(hf: dict) -> DecoderConfig:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointError(f"NanoChat with rope_type {rope.get('rope_type', rope.get('type'))!r}: probe turns its "
                              f"pairs the other way only at the plain frequencies; supported: default")
    cfg = llama_config(hf, default_act="relu2", default_eps=1e-6)
    return dataclasses.replace(
        cfg, gated_mlp=False, norm_weights=False, embed_norm=Norm.RMS, rotary_clockwise=True, mlp_bias=False,
        chunked_attention=_qk_norms(cfg.n_layers),
        # (a config.json that leaves it out means transformers' default, 15; null means none)
        logit_softcap=hf.get("final_logit_softcapping", 15.0))


def nanochat_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    require_fields(cfg, "nanochat", norm=Norm.RMS, embed_norm=Norm.RMS, norm_weights=False, rotary_clockwise=True,
                   rotary_scaling=None, gated_mlp=False, mlp_bias=False, logit_softcap=cfg.logit_softcap,
                   out_bias=cfg.qkv_bias, activation=Activation.RELU2, chunked_attention=_qk_norms(cfg.n_layers))
    # llama's writer holds the shared fields; NanoChat's differ in the ones it fixes, so check those above
    plain = dataclasses.replace(cfg, gated_mlp=True, norm_weights=True, embed_norm=False, rotary_clockwise=False,
                                chunked_attention=None, logit_softcap=None)
    out = llama_config_to_hf(plain, tokenizer, "llama")
    for name in ("mlp_bias", "architectures", "model_type"):
        out.pop(name, None)
    return {**out, "model_type": "nanochat", "architectures": ["NanoChatForCausalLM"], "hidden_act": "relu2",
            "attention_bias": cfg.qkv_bias, "final_logit_softcapping": cfg.logit_softcap, **special_token_ids(tokenizer)}


def _qk_norms(n_layers: int) -> ChunkedAttention:
    """Llama 4's weightless q/k norm after the rotation, in every layer, none of them chunked (NanoChat's)."""
    return ChunkedAttention(size=None, layers=(False,) * n_layers, qk_norm=True)


def nanochat_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    rename_layer_weights(source.state, {theirs: ours for ours, theirs in MLP.items()}, cfg.n_layers, "", "mlp")
    return llama_to_probe(source, cfg)


def nanochat_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_hf(params, cfg)
    rename_layer_weights(out, MLP, cfg.n_layers, "model.", "mlp")
    return out
