"""Multi-head latent attention checkpoints: DeepSeek-V2 (and V2-Lite, Coder-V2), DeepSeek-V3 (and R1, Kimi K2,
Moonlight), GLM-4.7-Flash (glm4_moe_lite) and Youtu-LLM: Llama's embeddings, norms and gated MLPs around
probe.latent_attention's attention, its tensors under transformers' names (`self_attn.q_a_proj`, `q_a_layernorm`,
`q_b_proj` or `q_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`), and, after the first dense
layers (DeepSeek's first_k_dense_replace, GLM's mlp_layer_types), DeepSeek's mixture of experts (probe.checkpoint_moe:
V2's softmax scores, V3's and GLM's sigmoid ones with a selection bias, groups, scaling, ungated shared experts).

Rotary positions turn each head's last qk_rope_head_dim query and key dimensions: DeepSeek-V2 in adjacent pairs in
place; V3, GLM-4.7-Flash and Youtu in adjacent pairs written back evens first (rope_interleave, the default), or
half-split pairs where rope_interleave is false. A long-context YaRN rope with mscale_all_dim also scales the scores
by its square. The multi-token-prediction layer some files carry after the last layer is not read, as transformers
skips it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

from probe.checkpoint_llama import llama_config
from probe.checkpoint_moe import (deepseek_experts, deepseek_experts_to_hf, deepseek_sparse_layers,
                                  drop_prediction_layers, expert_names, sparse_layout, take_experts)
from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, Source, require_fields, rope_to_hf, special_token_ids,
                                     take_unembed, with_defaults, with_fields)
from probe.config import DecoderConfig, Experts, LatentAttention, Norm, NormPlacement, Positions
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

# model_type -> (architecture, whether rotary pairs are adjacent in place rather than chosen by rope_interleave,
# transformers' config defaults that a file may leave out)
FORMATS = {
    "deepseek_v2": ("DeepseekV2ForCausalLM", True, dict(q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                                                       qk_nope_head_dim=128, v_head_dim=128)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", False, dict(q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                                                        qk_nope_head_dim=128, v_head_dim=128)),
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", False, dict(q_lora_rank=768, kv_lora_rank=512, qk_rope_head_dim=64,
                                                           qk_nope_head_dim=192, v_head_dim=256, rms_norm_eps=1e-5)),
    "youtu": ("YoutuForCausalLM", False, dict(q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                                             qk_nope_head_dim=128, v_head_dim=128, tie_word_embeddings=True)),
    # (its indexer: probe.checkpoint_glm_dsa)
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", False, dict(q_lora_rank=2048, kv_lora_rank=512, qk_rope_head_dim=64,
                                                       qk_nope_head_dim=192, v_head_dim=256, rms_norm_eps=1e-5)),
}


def yarn_mscale(factor: float, weight: float) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0


def latent_config(model_type: str) -> Callable[[dict], DecoderConfig]:
    def config_from_hf(hf: dict) -> DecoderConfig:
        _, in_place, defaults = FORMATS[model_type]
        hf = with_defaults(hf, **defaults)
        # num_key_value_heads is not read: every head's keys and values come from the shared latent (transformers'
        # attention passes it by; its config classes default it to the released models' head count)
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        stretched = rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim")
        mscale = yarn_mscale(float(rope.get("factor") or 1.0), float(rope["mscale_all_dim"])) if stretched else 1.0
        latent = LatentAttention(kv_rank=hf["kv_lora_rank"], d_nope=hf["qk_nope_head_dim"],
                                 d_rope=hf["qk_rope_head_dim"], q_rank=hf.get("q_lora_rank"),
                                 deinterleaved=not in_place and hf.get("rope_interleave", True), mscale=mscale)
        hf, experts = experts_of(hf, model_type)
        dense = llama_config(with_fields(hf, num_key_value_heads=hf["num_attention_heads"]), qkv_bias=False)
        return dataclasses.replace(
            dense, d_head=hf["v_head_dim"], n_kv_heads=dense.n_heads, rotary_dim=latent.d_rope, latent_attention=latent,
            rotary_adjacent_pairs=in_place or latent.deinterleaved, qkv_bias=hf.get("attention_bias", False),
            out_bias=hf.get("attention_bias", False), mlp_bias=hf.get("mlp_bias", False) if in_place else False,
            experts=experts)
    return config_from_hf


def sparse_layers(hf: dict, model_type: str) -> tuple[bool, ...]:
    """Which layers have experts: all but DeepSeek's first first_k_dense_replace, GLM-4.7-Flash's mlp_layer_types
    (all but the first by default), none of Youtu's."""
    n = hf["num_hidden_layers"]
    if model_type == "youtu":
        return (False,) * n
    if model_type in ("glm4_moe_lite", "glm_moe_dsa"):  # (GLM-5's: first_k_dense_replace dense layers by default)
        first = 1 if model_type == "glm4_moe_lite" else min(hf.get("first_k_dense_replace", 3), n)
        kinds = hf.get("mlp_layer_types") or ["dense"] * first + ["sparse"] * (n - first)
        if len(kinds) != n or set(kinds) - {"dense", "sparse"}:
            raise CheckpointError(f"mlp_layer_types={kinds!r} must say 'dense' or 'sparse' for each of the {n} layers")
        return tuple(kind == "sparse" for kind in kinds)
    return deepseek_sparse_layers(hf, model_type)


def experts_of(hf: dict, model_type: str) -> tuple[dict, Optional[Experts]]:
    """(config.json as the dense layers read it, the experts, with DeepSeek's routing: probe.checkpoint_moe); no
    experts where every layer is dense."""
    sparse = sparse_layers(hf, model_type)
    if not any(sparse):
        return hf, None
    if hf.get("mlp_bias"):  # (DeepSeek-V2's switch: its shared experts would have biases, its routed ones none)
        raise CheckpointError("mlp_bias=true with mixture-of-experts layers is not supported (no released DeepSeek "
                              "model has it): set it false, or make every layer dense")
    return sparse_layout(hf, deepseek_experts(hf, model_type), sparse)


def latent_config_to_hf(model_type: str) -> Callable[[DecoderConfig, Optional[Tokenizer]], dict]:
    def config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
        architecture, in_place, _ = FORMATS[model_type]
        latent = cfg.latent_attention
        sparse = model_type == "glm_moe_dsa"  # (GLM-5's indexer: probe.checkpoint_glm_dsa)
        if latent is None or (in_place and latent.deinterleaved) or (latent.indexer is None) == sparse:
            raise ValueError(f"a {model_type} checkpoint holds multi-head latent attention"
                             + (" with its rotary pairs in place" if in_place else "")
                             + (" and a sparse indexer" if sparse else " without a sparse indexer")
                             + f"; this model has "
                             f"latent_attention={latent!r}")
        if cfg.experts is not None and model_type == "youtu":
            raise ValueError(f"a youtu checkpoint has no experts; this model has experts={cfg.experts!r}")
        require_fields(cfg, model_type, norm=Norm.RMS, norm_placement=NormPlacement.PRE, final_norm=True,
                       positions=Positions.ROTARY, gated_mlp=True, latent_attention=latent, experts=cfg.experts,
                       rotary_adjacent_pairs=in_place or latent.deinterleaved, out_bias=cfg.qkv_bias,
                       mlp_bias=cfg.mlp_bias if in_place and cfg.experts is None else False)
        if latent.mscale != 1.0 and (cfg.rotary_scaling is None or cfg.rotary_scaling.kind != "yarn"):
            raise ValueError(f"a {model_type} checkpoint scales the scores by mscale^2 only under a YaRN rope; this "
                             f"model has mscale={latent.mscale} and rotary_scaling={cfg.rotary_scaling!r}")
        n = cfg.n_layers
        out = {"model_type": model_type, "architectures": [architecture], "num_hidden_layers": n,
               "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
               "intermediate_size": cfg.d_mlp, "vocab_size": cfg.d_vocab, "max_position_embeddings": cfg.n_ctx,
               "rms_norm_eps": cfg.eps, "hidden_act": GPT_ACTIVATION_NAMES[cfg.activation],
               "tie_word_embeddings": cfg.tied_embeddings, "attention_bias": cfg.qkv_bias,
               "q_lora_rank": latent.q_rank, "kv_lora_rank": latent.kv_rank, "qk_nope_head_dim": latent.d_nope,
               "qk_rope_head_dim": latent.d_rope, "v_head_dim": cfg.d_head, **rope_to_hf(cfg),
               **special_token_ids(tokenizer)}
        if latent.mscale != 1.0:  # (the legacy rope_scaling too: transformers reads it first where both are given)
            for key in ("rope_parameters", "rope_scaling"):
                if out.get(key):
                    out[key]["mscale_all_dim"] = _mscale_weight(latent.mscale, cfg.rotary_scaling.factor)
        if not in_place:
            out["rope_interleave"] = latent.deinterleaved
        if in_place:
            out["mlp_bias"] = cfg.mlp_bias
        if model_type == "youtu":
            return out
        out.update(deepseek_experts_to_hf(cfg, model_type) if cfg.experts is not None else {"first_k_dense_replace": n})
        if model_type in ("glm4_moe_lite", "glm_moe_dsa"):  # its layers' kinds by name
            del out["first_k_dense_replace"]
            out["mlp_layer_types"] = ["sparse" if cfg.layer_sparse(l) else "dense" for l in range(n)]
        return out
    return config_to_hf


def _mscale_weight(mscale: float, factor: float) -> float:
    """The mscale_all_dim that gives `mscale` at `factor` (yarn_mscale's inverse)."""
    return (mscale - 1.0) / (0.1 * math.log(factor))


def attention_names(cfg: DecoderConfig, layer: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape) for `layer`'s latent attention tensors."""
    latent, d, h = cfg.latent_attention, cfg.d_model, cfg.n_heads
    o, t = f"blocks.{layer}.attn", f"layers.{layer}.self_attn"
    table = {}
    if latent.q_rank is None:
        table[f"{o}.q_proj.weight"] = (f"{t}.q_proj.weight", (h * latent.d_qk, d))
    else:
        table.update({f"{o}.q_a_proj.weight": (f"{t}.q_a_proj.weight", (latent.q_rank, d)),
                      f"{o}.q_a_layernorm.w": (f"{t}.q_a_layernorm.weight", (latent.q_rank,)),
                      f"{o}.q_b_proj.weight": (f"{t}.q_b_proj.weight", (h * latent.d_qk, latent.q_rank))})
        if cfg.qkv_bias:
            table[f"{o}.q_a_proj.bias"] = (f"{t}.q_a_proj.bias", (latent.q_rank,))
    table.update({
        f"{o}.kv_a_proj_with_mqa.weight": (f"{t}.kv_a_proj_with_mqa.weight", (latent.kv_rank + latent.d_rope, d)),
        f"{o}.kv_a_layernorm.w": (f"{t}.kv_a_layernorm.weight", (latent.kv_rank,)),
        f"{o}.kv_b_proj.weight": (f"{t}.kv_b_proj.weight", (h * (latent.d_nope + cfg.d_head), latent.kv_rank)),
        f"{o}.out.weight": (f"{t}.o_proj.weight", (d, h * cfg.d_head))})
    if cfg.qkv_bias:
        table[f"{o}.kv_a_proj_with_mqa.bias"] = (f"{t}.kv_a_proj_with_mqa.bias", (latent.kv_rank + latent.d_rope,))
    if cfg.out_bias:
        table[f"{o}.out.bias"] = (f"{t}.o_proj.bias", (d,))
    return table


def tensor_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape) for every tensor but the unembedding."""
    d, m = cfg.d_model, cfg.d_mlp
    table = {"embed.W_E": ("embed_tokens.weight", (cfg.d_vocab, d)), "ln_final.w": ("norm.weight", (d,))}
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"layers.{l}"
        table.update({f"{o}.ln1.w": (f"{t}.input_layernorm.weight", (d,)),
                      f"{o}.ln2.w": (f"{t}.post_attention_layernorm.weight", (d,))})
        table.update(attention_names(cfg, l))
        if cfg.layer_sparse(l):  # (a mixture of experts: expert_names)
            continue
        for ours, theirs, shape in (("gate", "gate", (m, d)), ("fc_in", "up", (m, d)), ("fc_out", "down", (d, m))):
            table[f"{o}.mlp.{ours}.weight"] = (f"{t}.mlp.{theirs}_proj.weight", shape)
            if cfg.mlp_bias:
                table[f"{o}.mlp.{ours}.bias"] = (f"{t}.mlp.{theirs}_proj.bias", shape[:1])
    return table


def latent_family(model_type: str) -> tuple[Callable, Callable]:
    """The model type's (to_probe, to_hf), for its checkpoints.Family."""
    def to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in tensor_names(cfg).items()}
        if cfg.experts is not None:
            out.update(take_experts(source, cfg, model_type))
        out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
        # (V3's config class counts one prediction layer where the file names none; GLM-4.7-Flash's names none and
        # transformers sets its one aside)
        drop_prediction_layers(source, cfg, default=int(model_type in ("deepseek_v3", "glm4_moe_lite",
                                                                         "glm_moe_dsa")))
        return out

    def to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        table = {**tensor_names(cfg), **(expert_names(cfg, model_type) if cfg.experts is not None else {})}
        out = {f"model.{theirs}": params[ours] for ours, (theirs, _) in table.items()}
        if not cfg.tied_embeddings:
            out["lm_head.weight"] = params["unembed.weight"]
        return {k: v.contiguous() for k, v in out.items()}

    return to_probe, to_hf
