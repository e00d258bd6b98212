"""Laguna checkpoints (`laguna`, LagunaForCausalLM: poolside's coding models): config.json <-> DecoderConfig and the
tensors.

Llama's pre-norm block with Qwen3's per-head q and k norms before rotary, and:
- an output gate on every head: softplus (in float32) of `g_proj` of the layer's input, one logit per head (`gating`
  true or "per-head", transformers' default) or one per channel (false or "per-element"), times z before W_O;
- each layer's own number of query heads (`num_attention_heads_per_layer`) over the same num_key_value_heads;
- sliding and full-attention layers (`layer_types`), each kind with its own rope (`rope_parameters` keyed by kind: its
  base and its partial_rotary_factor; transformers' defaults rotate half of each full layer's heads by 500000 and
  whole sliding ones by 10000);
- experts on the `mlp_layer_types` "sparse" layers (a dense MLP of intermediate_size on the others): sigmoid scores of
  the router's float32 logits, tanh-capped first where moe_router_logit_softcapping > 0, a selection bias
  (e_score_correction_bias) for the choice alone, the chosen weights renormalised and times moe_routed_scaling_factor,
  plus an ungated shared expert of shared_expert_intermediate_size.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_afmoe import output_gates_to_hf
from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_hf, llama_to_probe
from probe.checkpoint_moe import expert_names, take_experts
from probe.checkpoint_source import (Source, layer_kinds, layer_types_to_hf, require_fields, rope_from_hf, rope_to_hf,
                                     special_token_ids, with_defaults)
from probe.config import DecoderConfig, Experts, Norm, NormPlacement, Positions, RotaryScaling
from probe.config_file import CheckpointError
from probe.config_gate import OutputGate
from probe.tokenizer import Tokenizer

# transformers' LagunaConfig defaults, for the fields a config.json leaves out
DEFAULTS = dict(vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=40, num_attention_heads=48,
                num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-6,
                tie_word_embeddings=False, sliding_window=512, attention_bias=False, gating=True, num_experts=256,
                num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                moe_routed_scaling_factor=1.0, moe_apply_router_weight_on_input=False, moe_router_logit_softcapping=0.0)
ROPE_DEFAULTS = {"full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}
GATINGS = {True: True, "per-head": True, False: False, "per-element": False}  # `gating` -> one logit per head


def _rope(hf: dict, kind: str, d_head: int) -> tuple[float, int, Optional[RotaryScaling]]:
    """(base, rotary_dim, rescaling) of the `kind` layers, as LagunaRotaryEmbedding computes them."""
    params = (hf.get("rope_parameters") or ROPE_DEFAULTS).get(kind)
    if params is None:
        raise CheckpointError(f"rope_parameters has no {kind!r} entry, which this model's {kind} layers rotate by: "
                              "give rope_parameters one entry per layer kind (full_attention, sliding_attention)")
    _, scaling = rope_from_hf({"rope_parameters": params, "max_position_embeddings": hf["max_position_embeddings"]})
    return float(params["rope_theta"]), int(d_head * params.get("partial_rotary_factor", 1.0)), scaling


def laguna_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, **DEFAULTS)
    n = hf["num_hidden_layers"]
    if hf["moe_apply_router_weight_on_input"]:
        raise CheckpointError("moe_apply_router_weight_on_input=true (experts reading their inputs times their weights) "
                              "is not in transformers' Laguna, which probe follows; set it false")
    if hf["gating"] not in GATINGS:
        raise CheckpointError(f"gating={hf['gating']!r} is not supported; choose true or 'per-head' (one gate per head) "
                              "or false or 'per-element' (one per channel)")
    heads = list(hf.get("num_attention_heads_per_layer") or [hf["num_attention_heads"]] * n)
    mlps = list(hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1))
    if len(heads) != n or len(mlps) != n or set(mlps) - {"dense", "sparse"}:
        raise CheckpointError(f"num_attention_heads_per_layer and mlp_layer_types ('dense' or 'sparse') must give each of "
                              f"the num_hidden_layers={n} layers one entry; got {heads} and {mlps}")
    sliding = tuple(kind == "sliding_attention" for kind in layer_kinds({**hf, "layer_types": hf.get("layer_types") or
                                                                          ["full_attention"] * n}, 1))
    window = hf["sliding_window"] if any(sliding) else None
    d_head = hf["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"]
    base, rotary_dim, scaling = _rope(hf, "full_attention", d_head) if not all(sliding) else (10000.0, d_head, None)
    sliding_base, sliding_dim = None, None
    if window is not None:
        sliding_base, sliding_dim, sliding_scaling = _rope(hf, "sliding_attention", d_head)
        if sliding_scaling is not None:
            raise CheckpointError("a rescaled rope on the sliding layers is not supported (only full layers' are)")
        if all(sliding):  # (every layer rotates as a sliding one: no full layers' settings to keep)
            base, rotary_dim, sliding_base, sliding_dim = sliding_base, sliding_dim, None, None
    sparse = tuple(kind == "sparse" for kind in mlps)
    experts = Experts(n=hf["num_experts"], per_token=hf["num_experts_per_tok"], renormalize=True, scoring="sigmoid",
                      selection_bias=True, scaling=float(hf["moe_routed_scaling_factor"]),
                      shared=hf["shared_expert_intermediate_size"], shared_gate=False, width=hf["moe_intermediate_size"],
                      layers=sparse, router_softcap=float(hf["moe_router_logit_softcapping"]) or None)
    n_heads = max(heads)
    base_cfg = llama_config({**hf, "num_attention_heads": n_heads, "head_dim": d_head})
    return dataclasses.replace(
        base_cfg, qk_norm=True, attn_output_gate=True,
        output_gate=OutputGate(activation="softplus", per_head=GATINGS[hf["gating"]]),
        heads_per_layer=None if set(heads) == {n_heads} else tuple(heads), out_bias=bool(hf["attention_bias"]),
        rotary_base=base, rotary_dim=rotary_dim, rotary_scaling=scaling, sliding_rotary_base=sliding_base,
        sliding_rotary_dim=sliding_dim, sliding_window=window, sliding_layers=None if window is None else sliding,
        experts=experts if any(sparse) else None)


def laguna_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    experts, gate = cfg.experts, cfg.output_gate
    if experts is not None and (experts.scoring != "sigmoid" or not experts.selection_bias or not experts.renormalize
                                or experts.groups is not None or experts.shared is None or experts.shared_gate
                                or experts.softmax_over != "all" or experts.latent is not None or experts.scale_inputs):
        raise ValueError(f"a Laguna checkpoint holds sigmoid-scored experts with a selection bias, renormalised, no "
                         f"groups, and an ungated shared expert; this model has experts={experts!r}")
    if gate is None or gate.activation != "softplus":
        raise ValueError(f"a Laguna checkpoint's output gates are softplus ones; this model has output_gate={gate!r}")
    require_fields(cfg, "Laguna", norm=Norm.RMS, norm_placement=NormPlacement.PRE, qk_norm=True, attn_output_gate=True,
                   output_gate=gate, positions=Positions.ROTARY, gated_mlp=True, mlp_bias=False, out_bias=cfg.qkv_bias,
                   experts=experts, sliding_window=cfg.sliding_window, sliding_layers=cfg.sliding_layers,
                   sliding_rotary_base=cfg.sliding_rotary_base, sliding_rotary_dim=cfg.sliding_rotary_dim)
    plain = dataclasses.replace(cfg, qk_norm=False, attn_output_gate=False, output_gate=None, heads_per_layer=None,
                                rotary_dim=cfg.d_head, rotary_scaling=None, sliding_window=None, sliding_layers=None,
                                sliding_rotary_base=None, sliding_rotary_dim=None, experts=None, out_bias=cfg.qkv_bias)
    out = llama_config_to_hf(plain, tokenizer, "llama")
    for key in ("mlp_bias", "rope_theta", "rope_scaling"):
        out.pop(key, None)
    full = {**rope_to_hf(cfg)["rope_parameters"], "partial_rotary_factor": cfg.rotary_dim / cfg.d_head}
    sliding = {"rope_type": "default", "rope_theta": cfg.sliding_rotary_base or cfg.rotary_base,
               "partial_rotary_factor": (cfg.sliding_rotary_dim or cfg.rotary_dim) / cfg.d_head}
    width = cfg.expert_width
    out.update(special_token_ids(tokenizer))
    out.update(model_type="laguna", architectures=["LagunaForCausalLM"], attention_bias=cfg.qkv_bias,
               gating="per-head" if gate.per_head else "per-element",
               num_attention_heads_per_layer=[cfg.layer_heads(l) for l in range(cfg.n_layers)],
               layer_types=layer_types_to_hf(cfg), sliding_window=cfg.sliding_window or DEFAULTS["sliding_window"],
               rope_parameters={"full_attention": full, "sliding_attention": sliding},
               mlp_layer_types=["sparse" if cfg.layer_sparse(l) else "dense" for l in range(cfg.n_layers)],
               num_experts=experts.n if experts else 1, num_experts_per_tok=experts.per_token if experts else 1,
               moe_intermediate_size=width, shared_expert_intermediate_size=experts.shared if experts else width,
               moe_routed_scaling_factor=experts.scaling if experts else 1.0,
               moe_router_logit_softcapping=(experts.router_softcap or 0.0) if experts else 0.0)
    return out


# transformers' module names -> the files' (poolside's, and what save_pretrained writes: transformers renames them
# back on loading, and fuses the experts, which take_experts reads either way)
FILE_NAMES = {".mlp.gate.e_score_correction_bias": ".mlp.experts.e_score_correction_bias",
              ".mlp.shared_experts.": ".mlp.shared_expert."}


def _names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """expert_names' table under the files' names."""
    table = {}
    for ours, (theirs, shape) in expert_names(cfg, "laguna").items():
        for module, stored in FILE_NAMES.items():
            theirs = theirs.replace(module, stored)
        table[ours] = (theirs, shape)
    return table


def laguna_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    for name in list(source.state):  # (a state dict under transformers' module names)
        for module, stored in FILE_NAMES.items():
            if module in name:
                source.state[name.replace(module, stored)] = source.state.pop(name)
    out = llama_to_probe(source, cfg)  # everything but the gates and the experts
    for l in range(cfg.n_layers):
        rows = cfg.layer_heads(l) * cfg.output_gate.width(cfg.d_head)
        out[f"blocks.{l}.attn.gate.weight"] = source.take(f"layers.{l}.self_attn.g_proj.weight", (rows, cfg.d_model))
        if cfg.qkv_bias:  # (probe's gate takes q/k/v's bias setting; Laguna's has none)
            out[f"blocks.{l}.attn.gate.bias"] = torch.zeros(rows, dtype=out[f"blocks.{l}.attn.gate.weight"].dtype)
    if cfg.experts is not None:
        out.update(take_experts(source, cfg, "laguna", _names(cfg)))
    return out


def laguna_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_hf(params, cfg)
    output_gates_to_hf(out, params, cfg, "g_proj", "a Laguna")
    if cfg.experts is not None:
        out.update({f"model.{theirs}": params[ours].contiguous() for ours, (theirs, _) in _names(cfg).items()})
    return out
