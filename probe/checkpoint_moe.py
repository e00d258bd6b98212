"""Mixture-of-experts checkpoints (Mixtral, OLMoE, FlexOlmo, Qwen3-MoE, Qwen1.5/Qwen2-MoE): Llama's attention and norms
(probe.checkpoint_llama) and, in place of each MLP, a router and its experts (probe.moe), with Qwen2-MoE's shared
expert and its gate (`mlp.shared_expert`, `mlp.shared_expert_gate`).

The experts are stored one by one, [out, in] as nn.Linear: Mixtral's under `block_sparse_moe.experts.{e}.w1` (gate),
`w3` (up) and `w2` (down), OLMoE's, FlexOlmo's and Qwen3-MoE's under `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`; the
router is the block's `gate`. Mixtral renormalises the chosen experts' weights always, the others as
`norm_topk_prob` says.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_hf, llama_to_probe, olmo2_config
from probe.checkpoint_source import Source, with_defaults, with_fields
from probe.config import DecoderConfig, Experts
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

# model_type -> (the sparse block's name in a layer, each expert's (gate, up, down) projections)
LAYOUTS = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
           "olmoe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "qwen3_5_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "flex_olmo": ("mlp", ("gate_proj", "up_proj", "down_proj"))}  # (Qwen3.5-MoE's and Qwen3-Next's)
PROJECTIONS = ("W_gate", "W_in", "W_out")  # probe's (transformer-lens's) names for the same three
SHARED = ("gate", "fc_in", "fc_out")  # the shared expert's, a gated MLP's (probe.mlp.GatedMLP)


def _experts(hf: dict, count_key: str, renormalize: bool) -> Experts:
    return Experts(n=hf.get(count_key) or hf["num_local_experts"], per_token=hf["num_experts_per_tok"],
                   renormalize=renormalize)


def mixtral_config(hf: dict) -> DecoderConfig:
    # Mistral's attention (no biases; a window where the file names one) and experts whose weights are renormalised
    return dataclasses.replace(llama_config(with_defaults(hf, rope_theta=1e6), qkv_bias=False, default_eps=1e-5),
                               sliding_window=hf.get("sliding_window"),
                               experts=_experts(hf, "num_local_experts", True))


def olmoe_config(hf: dict) -> DecoderConfig:
    # OLMo 2's q and k norms over all heads, in a pre-norm block; q, k and v clamped where clip_qkv says
    return dataclasses.replace(llama_config(hf, default_eps=1e-5), qk_norm=True, qk_norm_over_heads=True,
                               out_bias=hf.get("attention_bias", False), clip_qkv=hf.get("clip_qkv"),
                               experts=_experts(hf, "num_experts", hf.get("norm_topk_prob", False)))


def flex_olmo_config(hf: dict) -> DecoderConfig:
    # FlexOlmo: OLMo 2's block (write norms only, q and k normalised over all heads) with OLMoE's experts in the MLP's
    # place, intermediate_size their width
    return dataclasses.replace(olmo2_config(with_defaults(hf, rope_theta=500_000.0)), eps=hf.get("rms_norm_eps", 1e-6),
                               experts=_experts(hf, "num_experts", hf.get("norm_topk_prob", False)))


def every_layer_sparse(hf: dict) -> dict:
    """config.json with the experts' width as the MLP's (the file's intermediate_size is a dense layer's, which Qwen's
    MoE files, Qwen3-Next's too, may put among the sparse ones: refused)."""
    dense = hf.get("mlp_only_layers") or []
    if dense or hf.get("decoder_sparse_step", 1) != 1:
        raise CheckpointError(f"dense MLP layers among the sparse ones (mlp_only_layers={dense}, decoder_sparse_step="
                              f"{hf.get('decoder_sparse_step', 1)}) are not supported: every layer must be sparse")
    return with_fields(hf, intermediate_size=hf["moe_intermediate_size"])


def qwen3_moe_config(hf: dict) -> DecoderConfig:
    hf = every_layer_sparse(hf)
    return dataclasses.replace(llama_config(hf), qk_norm=True,
                               experts=_experts(hf, "num_experts", hf.get("norm_topk_prob", False)))


def qwen2_moe_config(hf: dict) -> DecoderConfig:
    # Qwen2's attention (q/k/v biases) and, beside the routed experts, a shared one every token runs
    hf = every_layer_sparse(hf)
    experts = dataclasses.replace(_experts(hf, "num_experts", hf.get("norm_topk_prob", False)),
                                  shared=hf.get("shared_expert_intermediate_size") or None)
    return dataclasses.replace(llama_config(hf, qkv_bias=hf.get("qkv_bias", True)), experts=experts)


def moe_config_to_hf(model_type: str) -> Callable[[DecoderConfig, Optional[Tokenizer]], dict]:
    def config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
        if cfg.experts is None or (model_type == "mixtral" and not cfg.experts.renormalize):
            raise ValueError(f"a {model_type} checkpoint holds a mixture of experts"
                             + (" whose weights are renormalised" if model_type == "mixtral" else "")
                             + f"; this model has experts={cfg.experts!r}")
        out = llama_config_to_hf(cfg, tokenizer, model_type)
        experts = cfg.experts
        count = "num_local_experts" if model_type == "mixtral" else "num_experts"
        out.update({count: experts.n, "num_experts_per_tok": experts.per_token})
        if model_type == "mixtral":
            out["sliding_window"] = cfg.sliding_window
        else:
            out["norm_topk_prob"] = experts.renormalize
        if model_type in ("qwen3_moe", "qwen2_moe"):
            out.update(moe_intermediate_size=cfg.d_mlp, decoder_sparse_step=1, mlp_only_layers=[])
        if model_type == "qwen2_moe":
            out.update(shared_expert_intermediate_size=experts.shared or 0, qkv_bias=cfg.qkv_bias)
        elif experts.shared is not None:
            raise ValueError(f"a {model_type} checkpoint has no shared expert; this model has experts={experts!r}")
        return out
    return config_to_hf


def expert_names(cfg: DecoderConfig, model_type: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape) for every router and expert tensor, [out, in] as ours (Llama's names do the rest)."""
    block, projections = LAYOUTS[model_type]
    d, m, experts = cfg.d_model, cfg.d_mlp, cfg.experts
    table = {}
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}.mlp", f"layers.{l}.{block}"
        table[f"{o}.W_gate.weight"] = (f"{t}.gate.weight", (experts.n, d))
        for e in range(experts.n):
            for ours, theirs, shape in zip(PROJECTIONS, projections, ((m, d), (m, d), (d, m))):
                table[f"{o}.experts.{e}.{ours}.weight"] = (f"{t}.experts.{e}.{theirs}.weight", shape)
        if experts.shared is not None:
            s = experts.shared
            table[f"{o}.shared_expert_gate.weight"] = (f"{t}.shared_expert_gate.weight", (1, d))
            for ours, theirs, shape in zip(SHARED, projections, ((s, d), (s, d), (d, s))):
                table[f"{o}.shared_expert.{ours}.weight"] = (f"{t}.shared_expert.{theirs}.weight", shape)
    return table


def moe_family(model_type: str) -> tuple[Callable, Callable, Callable]:
    """The model type's (config_to_hf, to_probe, to_hf), for its checkpoints.Family."""
    def to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        out = llama_to_probe(source, cfg)  # everything but the experts
        out.update({ours: source.take(theirs, shape) for ours, (theirs, shape) in expert_names(cfg, model_type).items()})
        return out

    def to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        out = llama_to_hf(params, cfg)
        out.update({f"model.{theirs}": params[ours].contiguous()
                    for ours, (theirs, _) in expert_names(cfg, model_type).items()})
        return out

    return moe_config_to_hf(model_type), to_probe, to_hf
