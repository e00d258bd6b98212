"""ERNIE 4.5 MoE checkpoints (`ernie4_5_moe`, Ernie4_5_MoeForCausalLM; ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B):
dense ERNIE 4.5's attention (adjacent-pair rotary, one `use_bias` switch for the attention's, the MLPs' and, unlike
dense ERNIE's, the unembedding's biases: `lm_head.bias`), and in the layers `moe_layer_start_index`,
`moe_layer_end_index` and `moe_layer_interval` pick a mixture of experts `moe_intermediate_size` wide (the others
Llama's gated MLP of intermediate_size).

The router (`mlp.gate`, no bias) takes the softmax over the experts; a selection bias (`mlp.moe_statics.
e_score_correction_bias`, [1 experts]) is added to those scores for the choice alone; the chosen experts' scores are
renormalised by their sum clamped below at `moe_norm_min`. Beside them `moe_num_shared_experts` ungated shared
experts run on every token (`mlp.shared_experts`, one gated MLP of their summed width, biased as use_bias says). The
routed experts are stored one by one (`mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`) or fused per layer,
without biases whatever use_bias says (probe's Experts.routed_bias).

The multi-token-prediction weights the released files carry (`mtp_block`, `mtp_emb_norm`, ...) are not read: as
transformers, every tensor whose name holds "mtp" is left aside.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import ernie4_5_config, llama_config_to_hf, llama_to_hf, llama_to_probe
from probe.checkpoint_moe import LAYOUTS, SHARED, expert_names, require_routing, sparse_layout, take_experts
from probe.checkpoint_source import Source, with_defaults
from probe.config import DecoderConfig, Experts
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

# transformers' Ernie4_5_MoeConfig defaults for the fields a config.json may leave out (its head_dim, absent from the
# class, is hidden_size // num_attention_heads: filled in below)
ERNIE_MOE_DEFAULTS = dict(num_key_value_heads=4, intermediate_size=12288, moe_intermediate_size=1536, moe_k=6,
                          moe_num_experts=64, moe_num_shared_experts=2, moe_layer_start_index=1,
                          moe_layer_end_index=-1, moe_layer_interval=1, moe_norm_min=1e-12, rope_theta=500_000.0,
                          use_bias=False, rms_norm_eps=1e-5, tie_word_embeddings=True)


def ernie_sparse_layers(hf: dict) -> tuple[bool, ...]:
    """Which layers have experts: every moe_layer_interval-th (counted from 1) from moe_layer_start_index to
    moe_layer_end_index (-1: the last), both included, as transformers builds them."""
    hf = with_defaults(hf, **ERNIE_MOE_DEFAULTS)
    n = hf["num_hidden_layers"]
    start, interval = hf["moe_layer_start_index"], hf["moe_layer_interval"]
    end = n - 1 if hf["moe_layer_end_index"] == -1 else hf["moe_layer_end_index"]
    return tuple((l + 1) % interval == 0 and start <= l <= end for l in range(n))


def ernie4_5_moe_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, **ERNIE_MOE_DEFAULTS)
    hf = with_defaults(hf, head_dim=hf["hidden_size"] // hf["num_attention_heads"])
    if hf["moe_norm_min"] is None:
        raise CheckpointError("config.json says moe_norm_min=null, but the chosen experts' weights are divided by "
                              "their sum clamped below at it: give a positive number (transformers' default 1e-12)")
    shared = (hf["moe_num_shared_experts"] or 0) * hf["moe_intermediate_size"]
    biased = bool(hf["use_bias"])
    experts = Experts(n=hf["moe_num_experts"], per_token=hf["moe_k"], renormalize=True,
                      renormalize_min=float(hf["moe_norm_min"]), selection_bias=True, shared=shared or None,
                      shared_gate=not shared, routed_bias=not biased)
    hf, experts = sparse_layout(hf, experts, ernie_sparse_layers(hf))
    return dataclasses.replace(ernie4_5_config(hf), unembed_bias=biased, experts=experts)


def ernie4_5_moe_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape) of the routers, selection biases ([1 experts] in the file), experts and shared experts
    (with their biases where use_bias says)."""
    table = expert_names(cfg, "ernie4_5_moe")
    _, projections, shared_name = LAYOUTS["ernie4_5_moe"]
    s, d = cfg.experts.shared, cfg.d_model
    for l in filter(cfg.layer_sparse, range(cfg.n_layers)):
        o, t = f"blocks.{l}.mlp", f"layers.{l}.mlp"
        table[f"{o}.e_score_correction_bias"] = (f"{t}.moe_statics.e_score_correction_bias", (1, cfg.experts.n))
        if s is not None and cfg.mlp_bias:
            for ours, theirs, width in zip(SHARED, projections, (s, s, d)):
                table[f"{o}.shared_expert.{ours}.bias"] = (f"{t}.{shared_name}.{theirs}.bias", (width,))
    return table


def ernie4_5_moe_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    for name in [n for n in source.state if "mtp" in n]:
        del source.state[name]
    out = llama_to_probe(source, cfg)  # everything but the experts (the dense layers' MLPs included)
    taken = take_experts(source, cfg, "ernie4_5_moe", ernie4_5_moe_names(cfg))
    out.update({k: v.reshape(-1) if k.endswith("e_score_correction_bias") else v for k, v in taken.items()})
    if cfg.unembed_bias:
        out["unembed.bias"] = source.take("lm_head.bias", (cfg.d_vocab,))
    return out


def ernie4_5_moe_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_hf(params, cfg)
    for ours, (theirs, shape) in ernie4_5_moe_names(cfg).items():
        out[f"model.{theirs}"] = params[ours].reshape(shape).contiguous()  # (the selection bias [1 experts])
    if cfg.unembed_bias:
        out["lm_head.bias"] = params["unembed.bias"]
    return out


def sparse_layer_span(sparse: tuple[bool, ...]) -> Optional[tuple[int, int, int]]:
    """(start, end, interval) that ernie_sparse_layers reads back as `sparse`; None where no span does."""
    n = len(sparse)
    last = max(l for l in range(n) if sparse[l])
    for interval in range(1, n + 1):
        for start in range(n):
            if tuple((l + 1) % interval == 0 and start <= l <= last for l in range(n)) == sparse:
                return start, last, interval
    return None


def ernie4_5_moe_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    experts = cfg.experts
    if experts is None:
        raise ValueError("an ernie4_5_moe checkpoint holds a mixture of experts; this model has none")
    width = cfg.expert_width
    # (the format always clamps the renormalising sum: any floor passes, None does not; its router and experts have
    # no biases, so where the MLPs have them the experts must say so)
    require_routing(experts, "ernie4_5_moe", selection_bias=True, renormalize=True, softmax_over="all",
                    clamped_glu=None, renormalize_min=experts.renormalize_min or "a floor",
                    shared_gate=experts.shared is None, width=experts.width, layers=experts.layers,
                    routed_bias=experts.routed_bias and not cfg.mlp_bias)
    if experts.shared is not None and experts.shared % width:
        raise ValueError(f"an ernie4_5_moe checkpoint holds shared experts as wide as a whole number of experts "
                         f"({width}); this model's is {experts.shared} wide")
    sparse = tuple(cfg.layer_sparse(l) for l in range(cfg.n_layers))
    span = sparse_layer_span(sparse)
    if span is None:
        raise ValueError(f"an ernie4_5_moe checkpoint puts experts in every interval-th layer of one span "
                         f"(moe_layer_start_index, moe_layer_end_index, moe_layer_interval); this model's are in "
                         f"layers {[l for l in range(cfg.n_layers) if sparse[l]]}")
    if cfg.unembed_bias != cfg.mlp_bias:
        raise ValueError(f"an ernie4_5_moe checkpoint's use_bias biases the unembedding with the MLPs; this model has "
                         f"unembed_bias={cfg.unembed_bias}, mlp_bias={cfg.mlp_bias}")
    # dense ERNIE 4.5's writer checks the rest: the attention, the other biases, the dense layers' MLPs
    out = llama_config_to_hf(dataclasses.replace(cfg, experts=None, unembed_bias=False), tokenizer, "ernie4_5")
    start, end, interval = span
    out.update(model_type="ernie4_5_moe", architectures=["Ernie4_5_MoeForCausalLM"], moe_num_experts=experts.n,
               moe_k=experts.per_token, moe_intermediate_size=width,
               moe_num_shared_experts=(experts.shared or 0) // width, moe_layer_start_index=start,
               moe_layer_end_index=end, moe_layer_interval=interval, moe_norm_min=experts.renormalize_min)
    return out
