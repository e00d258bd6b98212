"""PhiMoE checkpoints (`phimoe`, PhimoeForCausalLM: Phi-3.5-MoE-instruct, Phi-mini-MoE, Phi-tiny-MoE): config.json
<-> DecoderConfig and the tensors.

Mixtral's layout and tensor names (`block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1` / `w3` / `w2`: what the
releases hold and transformers saves) with LayerNorms (weights and biases; eps is rms_norm_eps), biases on q, k, v and
the output projection where attention_bias says, a bias on the logits where lm_head_bias says, and:

- sparsemixer routing (Experts.softmax_over="sparsemixer", its eps router_jitter_noise, which transformers reads at
  inference as the width of the mask around each chosen expert); always two experts per token, as transformers'
  sparsemixer chooses whatever num_experts_per_tok says (another count is refused); input_jitter_noise is
  training's alone;
- LongRoPE with PhiMoE's own attention factors: short_mscale within original_max_position_embeddings, long_mscale
  past it (in place of the one factor Phi-3 derives). Past the threshold the frequencies are long_factor's, as
  Microsoft's code and transformers 4 compute them; transformers 5.25's PhimoeRotaryEmbedding recomputes its
  frequencies without the sequence length and so keeps short_factor's there (only the factor switches), which
  probe does not copy (tests/test_phimoe.py shows both).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config
from probe.checkpoint_layernorm_llama import layernorm_attention_names
from probe.checkpoint_moe import expert_names
from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, Source, llama_named_to_hf, llama_named_to_probe,
                                     require_fields, rope_from_hf, rope_to_hf, special_token_ids, with_defaults,
                                     with_fields)
from probe.config import DecoderConfig, Experts, Norm, NormPlacement, Positions
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

# transformers' PhimoeConfig defaults, for the fields a config.json leaves out
DEFAULTS = dict(vocab_size=32064, hidden_size=4096, intermediate_size=6400, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, hidden_act="silu", max_position_embeddings=4096 * 32, rms_norm_eps=1e-5,
                rope_theta=1e6, num_experts_per_tok=2, num_local_experts=16, router_jitter_noise=0.01,
                attention_bias=False, lm_head_bias=False, tie_word_embeddings=False)


def phimoe_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, **DEFAULTS)
    rope, scaling = rope_from_hf(hf)
    if scaling is not None:
        if scaling.kind != "longrope" or not all(isinstance(rope.get(k), (int, float)) for k in ("short_mscale",
                                                                                              "long_mscale")):
            raise CheckpointError(f"a PhiMoE rope dict is LongRoPE's with short_mscale and long_mscale (numbers), as "
                                  f"transformers requires; got {dict(rope)!r}")
        scaling = dataclasses.replace(scaling, attention_factor=float(rope["short_mscale"]),
                                      long_attention_factor=float(rope["long_mscale"]))
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError("partial_rotary_factor: transformers' PhiMoE rotates whole heads; set it to 1.0")
    if hf["num_experts_per_tok"] != 2:
        raise CheckpointError(f"num_experts_per_tok={hf['num_experts_per_tok']}: PhiMoE's sparsemixer routing always "
                              "chooses two experts per token (transformers ignores the field); set it to 2")
    theta = rope.get("rope_theta", hf["rope_theta"])
    base = llama_config(with_fields(hf, rope_parameters={"rope_type": "default", "rope_theta": theta}, rope_scaling=None),
                        default_eps=1e-5)
    bias = bool(hf["attention_bias"])
    experts = Experts(n=hf["num_local_experts"], per_token=2, softmax_over="sparsemixer",
                      sparsemixer_eps=float(hf["router_jitter_noise"]))
    return dataclasses.replace(base, norm=Norm.LAYER, qkv_bias=bias, out_bias=bias, mlp_bias=False,
                               unembed_bias=bool(hf["lm_head_bias"]), sliding_window=hf.get("sliding_window"),
                               rotary_scaling=scaling, experts=experts)


def phimoe_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    require_fields(cfg, "PhiMoE", norm=Norm.LAYER, norm_placement=NormPlacement.PRE, final_norm=True,
                   positions=Positions.ROTARY, rotary_dim=cfg.d_head, gated_mlp=True, out_bias=cfg.qkv_bias,
                   mlp_bias=False, heads_per_layer=None, sliding_window=cfg.sliding_window, experts=cfg.experts,
                   unembed_bias=cfg.unembed_bias)
    experts, scaling = cfg.experts, cfg.rotary_scaling
    if experts is None or experts.softmax_over != "sparsemixer" or experts.shared is not None or experts.width \
            or experts.layers or not experts.gated or experts.clamped_glu is not None or experts.scale_inputs:
        raise ValueError(f"a PhiMoE checkpoint holds sparsemixer-routed gated experts in every layer, d_mlp wide; this "
                         f"model has experts={experts!r}")
    if scaling is not None and scaling.kind != "longrope":
        raise ValueError(f"a PhiMoE checkpoint rescales its rope by LongRoPE alone; this model has "
                         f"rotary_scaling={scaling!r}")
    rope = rope_to_hf(cfg)
    if scaling is not None:
        long = scaling.attention_factor if scaling.long_attention_factor is None else scaling.long_attention_factor
        rope["rope_parameters"].update(short_mscale=scaling.attention_factor, long_mscale=long)
        rope["rope_scaling"].update(short_mscale=scaling.attention_factor, long_mscale=long)
    return {
        "model_type": "phimoe", "architectures": ["PhimoeForCausalLM"], "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.d_head, "intermediate_size": cfg.d_mlp, "vocab_size": cfg.d_vocab,
        "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.eps, "hidden_act": GPT_ACTIVATION_NAMES[cfg.activation],
        "tie_word_embeddings": cfg.tied_embeddings, "attention_bias": cfg.qkv_bias, "lm_head_bias": cfg.unembed_bias,
        "num_local_experts": experts.n, "num_experts_per_tok": 2, "router_jitter_noise": experts.sparsemixer_eps,
        "sliding_window": cfg.sliding_window, **rope, **special_token_ids(tokenizer),
        **({} if scaling is None else {"original_max_position_embeddings": scaling.original_n_ctx}),
    }


def _names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape) for every tensor but q/k/v and the unembedding's weight; [out, in] as ours."""
    return {**layernorm_attention_names(cfg), **expert_names(cfg, "mixtral")}


def phimoe_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_named_to_probe(source, cfg, _names(cfg))
    if cfg.unembed_bias:
        out["unembed.bias"] = source.take("lm_head.bias", (cfg.d_vocab,))
    return out


def phimoe_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_named_to_hf(params, cfg, _names(cfg))
    if cfg.unembed_bias:
        out["lm_head.bias"] = params["unembed.bias"].contiguous()
    return out
