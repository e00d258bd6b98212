"""AFMoE checkpoints (`afmoe`, AfmoeForCausalLM: Arcee's Trinity models): config.json <-> DecoderConfig and the
tensors.

A sandwich block (each sublayer's write normalised, `post_attention_layernorm` / `post_mlp_layernorm`; norms in
float32 multiplying by w) with Qwen3's per-head q and k norms and an output gate on every head (`gate_proj`, a
sigmoid of it times z before W_O); the sliding layers rotate q and k, the full-attention ones have no positions
(NoPE); the first num_dense_layers MLPs dense, the rest DeepSeek-style experts (sigmoid scores, a selection bias
`expert_bias` for the choice alone, the chosen weights renormalised and times route_scale, num_shared_experts shared
experts added ungated); with mup_enabled the embeddings are times sqrt(d_model).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_hf, llama_to_probe
from probe.checkpoint_moe import expert_names, take_experts
from probe.checkpoint_source import (Source, layer_kinds, layer_types_to_hf, require_fields, special_token_ids,
                                     with_defaults)
from probe.config import DecoderConfig, Experts, Norm, NormPlacement, Positions
from probe.tokenizer import Tokenizer

# transformers' AfmoeConfig defaults, for the fields a config.json leaves out
DEFAULTS = dict(vocab_size=200192, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=1408,
                num_hidden_layers=32, num_dense_layers=1, num_attention_heads=16, head_dim=128, hidden_act="silu",
                max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts=64,
                num_experts_per_tok=6, num_shared_experts=2, route_scale=1.0, global_attn_every_n_layers=4,
                sliding_window=1024, mup_enabled=False, attention_bias=False, rope_theta=10000.0)
NORMS = {"ln1": "input_layernorm", "ln1_post": "post_attention_layernorm", "ln2": "pre_mlp_layernorm",
         "ln2_post": "post_mlp_layernorm"}


def afmoe_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, **DEFAULTS)
    sliding = tuple(kind == "sliding_attention" for kind in layer_kinds(hf, hf["global_attn_every_n_layers"]))
    window = hf["sliding_window"] if any(sliding) else None
    shared = (hf["num_shared_experts"] or 0) * hf["moe_intermediate_size"]
    experts = Experts(n=hf["num_experts"], per_token=hf["num_experts_per_tok"], renormalize=True, scoring="sigmoid",
                      selection_bias=True, scaling=float(hf["route_scale"]), shared=shared or None,
                      shared_gate=not shared, width=hf["moe_intermediate_size"],
                      layers=tuple(l >= (hf["num_dense_layers"] or 0) for l in range(hf["num_hidden_layers"])))
    return dataclasses.replace(
        llama_config(hf, default_eps=1e-5), norm=Norm.RMS_FLOAT32, norm_placement=NormPlacement.SANDWICH, qk_norm=True,
        attn_output_gate=True, sliding_window=window, sliding_layers=None if window is None else sliding,
        rotary_layers=sliding,  # (the full-attention layers have no positions)
        scale_embed=bool(hf["mup_enabled"]), experts=experts if any(experts.layers) else None)


def afmoe_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    experts = cfg.experts
    sparse = tuple(cfg.layer_sparse(l) for l in range(cfg.n_layers))
    first = sparse.index(True) if any(sparse) else cfg.n_layers
    width = cfg.expert_width
    if experts is not None and (experts.scoring != "sigmoid" or not experts.selection_bias or not experts.renormalize
                                or experts.groups is not None or (experts.shared is not None and (
                                    experts.shared_gate or experts.shared % width))
                                or sparse != tuple(l >= first for l in range(cfg.n_layers))):
        raise ValueError(f"an AFMoE checkpoint holds sigmoid-scored experts with a selection bias, renormalised, no "
                         f"groups, ungated shared experts as wide as a whole number of experts, dense layers first; "
                         f"this model has experts={experts!r}")
    windowed = tuple(cfg.layer_window(l) is not None for l in range(cfg.n_layers))
    rotates = tuple(cfg.layer_rotates(l) for l in range(cfg.n_layers))
    require_fields(cfg, "AFMoE", norm=Norm.RMS_FLOAT32, norm_placement=NormPlacement.SANDWICH, qk_norm=True,
                   attn_output_gate=True, positions=Positions.ROTARY, rotary_dim=cfg.d_head, gated_mlp=True,
                   mlp_bias=False, out_bias=cfg.qkv_bias, experts=experts, scale_embed=cfg.scale_embed,
                   sliding_window=cfg.sliding_window, sliding_layers=cfg.sliding_layers, rotary_layers=cfg.rotary_layers)
    if rotates != windowed:
        raise ValueError("an AFMoE checkpoint rotates q and k in exactly its sliding layers; this model rotates in "
                         f"layers {[l for l in range(cfg.n_layers) if rotates[l]]}")
    plain = dataclasses.replace(cfg, norm=Norm.RMS, norm_placement=NormPlacement.PRE, qk_norm=False,
                                attn_output_gate=False, sliding_window=None, sliding_layers=None, rotary_layers=None,
                                scale_embed=False, experts=None, out_bias=False)
    out = llama_config_to_hf(plain, tokenizer, "llama")
    out.pop("mlp_bias", None)
    out.update(special_token_ids(tokenizer))
    out.update(model_type="afmoe", architectures=["AfmoeForCausalLM"], attention_bias=cfg.qkv_bias,
               layer_types=layer_types_to_hf(cfg), sliding_window=cfg.sliding_window or 1024,
               mup_enabled=cfg.scale_embed, num_dense_layers=first,
               num_experts=experts.n if experts else 1, num_experts_per_tok=experts.per_token if experts else 1,
               moe_intermediate_size=width, num_shared_experts=(experts.shared or 0) // width if experts else 0,
               route_scale=experts.scaling if experts else 1.0)
    return out


def _names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """expert_names' table under AFMoE's names: the router's `router.gate`, the selection bias `expert_bias`."""
    renamed = {".mlp.gate.weight": ".mlp.router.gate.weight", ".mlp.gate.e_score_correction_bias": ".mlp.expert_bias"}
    table = {}
    for ours, (theirs, shape) in expert_names(cfg, "afmoe").items():
        for old, new in renamed.items():
            theirs = theirs.replace(old, new) if theirs.endswith(old) else theirs
        table[ours] = (theirs, shape)
    return table


def afmoe_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_probe(source, cfg, norms=NORMS)  # everything but the gates and the experts
    for l in range(cfg.n_layers):
        out[f"blocks.{l}.attn.gate.weight"] = source.take(f"layers.{l}.self_attn.gate_proj.weight",
                                                          (cfg.n_heads * cfg.d_head, cfg.d_model))
        if cfg.qkv_bias:  # (probe's gate takes q/k/v's bias setting; AFMoE's has none)
            out[f"blocks.{l}.attn.gate.bias"] = torch.zeros(cfg.n_heads * cfg.d_head, dtype=out[f"blocks.{l}.attn.gate.weight"].dtype)
    if cfg.experts is not None:
        out.update(take_experts(source, cfg, "afmoe", _names(cfg)))
        if cfg.experts.shared is None:  # transformers builds them all the same, zero wide (num_shared_experts 0)
            for name in [n for n in source.state if ".mlp.shared_experts." in n and 0 in tuple(source.state[n].shape)]:
                del source.state[name]
    return out


def output_gates_to_hf(out: dict, params: dict[str, torch.Tensor], cfg: DecoderConfig, name: str, family: str) -> None:
    """Each layer's output-gate weight into `out` as `model.layers.{l}.self_attn.{name}.weight`; refused where a gate
    has a bias that is not zero (the format holds none: probe gives gates one under qkv_bias)."""
    for l in range(cfg.n_layers):
        out[f"model.layers.{l}.self_attn.{name}.weight"] = params[f"blocks.{l}.attn.gate.weight"]
        bias = params.get(f"blocks.{l}.attn.gate.bias")
        if bias is not None and bias.abs().max() > 0:
            raise ValueError(f"{family} checkpoint's output gates have no bias; layer {l}'s is not zero")


def afmoe_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_hf(params, cfg, norms=NORMS)
    output_gates_to_hf(out, params, cfg, "gate_proj", "an AFMoE")
    if cfg.experts is not None:
        out.update({f"model.{theirs}": params[ours].contiguous() for ours, (theirs, _) in _names(cfg).items()})
    return out
