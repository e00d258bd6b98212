"""MiniMax-M2 checkpoints (`minimax_m2`, MiniMaxM2ForCausalLM; MiniMax-M2, M2.1): Llama's block without biases, q and
k each RMS-normalised over all heads together before rotary (as OLMo 2's), rotary on the first `rotary_dim`
dimensions of each head (rotate-half pairs), and in every layer's MLP place Mixtral's experts
(`block_sparse_moe.experts.{e}.w1` / `w3` / `w2`, or fused per layer) chosen by the sigmoid of each router logit plus
a selection bias kept beside the router (`block_sparse_moe.e_score_correction_bias`), their weights the chosen
sigmoids renormalised to sum to 1.

The multi-token-prediction modules a file may store as layers after the last (`num_mtp_modules` of them) are not read:
transformers builds none.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_hf, llama_to_probe
from probe.checkpoint_moe import drop_prediction_layers, expert_names, require_routing, take_experts
from probe.checkpoint_source import Source, require_fields, special_token_ids, with_defaults
from probe.config import DecoderConfig, Experts, Positions
from probe.tokenizer import Tokenizer

# transformers' MiniMaxM2Config defaults for the fields a config.json may leave out
MINIMAX_M2_DEFAULTS = dict(head_dim=128, num_key_value_heads=8, intermediate_size=1536, num_local_experts=256,
                           num_experts_per_tok=8, rope_theta=5_000_000.0, rms_norm_eps=1e-6, hidden_act="silu",
                           tie_word_embeddings=False)


def minimax_m2_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, **MINIMAX_M2_DEFAULTS)
    base = llama_config(hf)
    # the rotated fraction: the rope dict's, else config.json's own, else rotary_dim over the heads' width (the
    # released files' spelling), as transformers' config class reads them
    rope = hf.get("rope_parameters") or {}
    fraction = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if fraction is None:
        fraction = 1.0 if hf.get("rotary_dim") is None else hf["rotary_dim"] / base.d_head
    # (transformers reads neither scoring_func nor use_routing_bias: sigmoid scores and the bias, always)
    experts = Experts(n=hf["num_local_experts"], per_token=hf["num_experts_per_tok"], renormalize=True,
                      scoring="sigmoid", selection_bias=True)
    return dataclasses.replace(base, qkv_bias=False, out_bias=False, mlp_bias=False, qk_norm=True,
                               qk_norm_over_heads=True, rotary_dim=int(base.d_head * fraction), experts=experts)


def minimax_m2_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape) of the routers, selection biases and experts: Mixtral's names, the bias beside the
    router rather than in it."""
    table = expert_names(cfg, "minimax_m2")
    for l in filter(cfg.layer_sparse, range(cfg.n_layers)):
        _, shape = table[f"blocks.{l}.mlp.e_score_correction_bias"]
        table[f"blocks.{l}.mlp.e_score_correction_bias"] = (f"layers.{l}.block_sparse_moe.e_score_correction_bias",
                                                            shape)
    return table


def minimax_m2_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    drop_prediction_layers(source, cfg)
    out = llama_to_probe(source, cfg)  # everything but the experts
    out.update(take_experts(source, cfg, "minimax_m2", minimax_m2_names(cfg)))
    return out


def minimax_m2_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_hf(params, cfg)
    out.update({f"model.{theirs}": params[ours].contiguous() for ours, (theirs, _) in minimax_m2_names(cfg).items()})
    return out


def minimax_m2_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    require_fields(cfg, "minimax_m2", qkv_bias=False, out_bias=False, mlp_bias=False, qk_norm=True,
                   qk_norm_over_heads=True, positions=Positions.ROTARY, experts=cfg.experts)
    if cfg.experts is None:
        raise ValueError("a minimax_m2 checkpoint holds a mixture of experts in every layer; this model has none")
    require_routing(cfg.experts, "minimax_m2", scoring="sigmoid", selection_bias=True, renormalize=True,
                    renormalize_min=None, shared=None, softmax_over="all", clamped_glu=None)
    # Llama's writer checks the rest (the partial rotary and the q/k norms are not Llama's: put back below)
    plain = dataclasses.replace(cfg, rotary_dim=cfg.d_head, qk_norm=False, qk_norm_over_heads=False, experts=None)
    out = llama_config_to_hf(plain, tokenizer, "llama")
    for key in ("mlp_bias", "attention_bias"):
        out.pop(key)
    out["rope_parameters"] = {**out["rope_parameters"], "partial_rotary_factor": cfg.rotary_dim / cfg.d_head}
    out.update(special_token_ids(tokenizer))
    out.update(model_type="minimax_m2", architectures=["MiniMaxM2ForCausalLM"], rotary_dim=cfg.rotary_dim,
               num_local_experts=cfg.experts.n, num_experts_per_tok=cfg.experts.per_token)
    return out
