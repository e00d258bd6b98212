"""Liquid AI's LFM2 checkpoints (`lfm2`, Lfm2ForCausalLM: LFM2-350M ... 2.6B) and LFM2-MoE (`lfm2_moe`,
Lfm2MoeForCausalLM: LFM2-8B-A1B): hybrids whose layers are, as `layer_types` says ("conv" or "full_attention"; older
files: `full_attn_idxs`), a gated short convolution (probe.short_conv, `conv` in the file and here) or attention with
grouped keys and values, rotary positions and each head's q and k RMS-normalised before rotating (`q_layernorm`,
`k_layernorm`; the output projection is `out_proj`). Every layer then has a SwiGLU MLP (`feed_forward`: w1 the gate,
w3 the up projection, w2 the down one), its norm `ffn_norm`; the mixer's is `operator_norm`, the last norm
`embedding_norm` (applied after the last layer, whatever its name says). One `norm_eps` serves every norm; the head
is tied to the embedding unless tie_word_embeddings (or `tie_embedding`) says not.

LFM2's MLP width is not intermediate_size as written: with block_auto_adjust_ff_dim it is int(2/3 of it), then
times block_ffn_dim_multiplier and rounded up to a multiple of block_multiple_of (lfm2_mlp_width, transformers' rule).

LFM2-MoE: its first num_dense_layers layers keep a dense MLP of intermediate_size (no such rule); the others a mixture
of moe_intermediate_size experts chosen by the sigmoid of the router's logits (`feed_forward.gate`) plus, where
use_expert_bias, a selection bias for the choice alone (`feed_forward.expert_bias`), their weights divided by their sum
plus 1e-6 where norm_topk_prob, times routed_scaling_factor. The experts are stored one by one
(`feed_forward.experts.{e}.w1` / `w3` / `w2`, the released files) or fused (transformers 5's modules), read either
way and written one by one."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config
from probe.checkpoint_moe import expert_names, require_routing, sparse_layout, take_experts
from probe.checkpoint_source import (Source, require_fields, rope_to_hf, special_token_ids, split_qkv, take_qkv,
                                     take_unembed, with_defaults)
from probe.config import Activation, DecoderConfig, Experts, Norm, NormPlacement, Positions, ShortConv
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

# transformers' Lfm2Config and Lfm2MoeConfig defaults for what a config.json may leave out
LFM2_DEFAULTS = dict(num_key_value_heads=8, max_position_embeddings=128_000, norm_eps=1e-5, conv_bias=False,
                     conv_L_cache=3, rope_theta=1_000_000.0, tie_word_embeddings=True)
LFM2_MLP_DEFAULTS = dict(intermediate_size=12288, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
                         block_auto_adjust_ff_dim=True)
LFM2_MOE_DEFAULTS = dict(intermediate_size=7168, moe_intermediate_size=1792, num_dense_layers=2, num_experts_per_tok=4,
                         num_experts=32, use_expert_bias=True, routed_scaling_factor=1.0, norm_topk_prob=True)
CONV, ATTENTION = "conv", "full_attention"
NORMS = {"ln1": "operator_norm", "ln2": "ffn_norm"}
MLP = (("gate", "w1"), ("fc_in", "w3"), ("fc_out", "w2"))  # ours, theirs
SHORT_CONV_PARTS = ("in_proj", "conv", "out_proj")  # the mixer's layers, one name in the file and here
RENORMALIZE_EPS = 1e-6  # LFM2-MoE's: added to the chosen experts' summed weights before dividing by it


def lfm2_mlp_width(hf: dict) -> int:
    """The MLP's width as transformers' Lfm2MLP computes it from config.json."""
    hf = with_defaults(hf, **LFM2_MLP_DEFAULTS)
    width = hf.get("block_ff_dim") or hf["intermediate_size"]  # (block_ff_dim: the older files' name)
    if hf["block_auto_adjust_ff_dim"]:
        width = int(2 * width / 3)
        if hf["block_ffn_dim_multiplier"] is not None:
            multiple = hf["block_multiple_of"]
            width = multiple * ((int(hf["block_ffn_dim_multiplier"] * width) + multiple - 1) // multiple)
    return width


def short_conv_of(hf: dict) -> Optional[ShortConv]:
    """Which layers are short convolutions, with the convolution's width and biases; None where every layer attends."""
    n = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if kinds is None:  # (older files list the attention layers; none listed: every layer attends, as transformers)
        attends = set(range(n) if hf.get("full_attn_idxs") is None else hf["full_attn_idxs"])
        kinds = [ATTENTION if l in attends else CONV for l in range(n)]
    if len(kinds) != n or set(kinds) - {CONV, ATTENTION}:
        raise CheckpointError(f"layer_types={kinds!r} must name each of the {n} layers {CONV!r} or {ATTENTION!r}")
    if CONV not in kinds:
        return None
    return ShortConv(layers=tuple(kind == CONV for kind in kinds), conv_kernel=hf["conv_L_cache"],
                     bias=bool(hf["conv_bias"]))


def _base_config(hf: dict, d_mlp: int) -> DecoderConfig:
    hf = with_defaults(hf, **LFM2_DEFAULTS)
    tied = hf.get("tie_embedding", hf["tie_word_embeddings"])
    base = llama_config({**hf, "intermediate_size": d_mlp, "rms_norm_eps": hf["norm_eps"], "tie_word_embeddings": tied,
                         "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"})
    return dataclasses.replace(base, qk_norm=True, short_conv=short_conv_of(hf))


def lfm2_config(hf: dict) -> DecoderConfig:
    return _base_config(hf, lfm2_mlp_width(hf))


def lfm2_moe_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, **LFM2_MOE_DEFAULTS)
    if hf.get("layer_types") is None:
        raise CheckpointError("an lfm2_moe config.json names each layer's kind in layer_types ('conv' or "
                              "'full_attention'), as transformers requires; this one has none")
    renormalize = bool(hf["norm_topk_prob"])
    experts = Experts(n=hf["num_experts"], per_token=hf["num_experts_per_tok"], scoring="sigmoid",
                      selection_bias=bool(hf["use_expert_bias"]), renormalize=renormalize,
                      renormalize_eps=RENORMALIZE_EPS if renormalize else 1e-20,
                      scaling=float(hf["routed_scaling_factor"]))
    dense = hf["num_dense_layers"]
    hf, experts = sparse_layout(hf, experts, tuple(l >= dense for l in range(hf["num_hidden_layers"])))
    return dataclasses.replace(_base_config(hf, hf["intermediate_size"]), experts=experts)


def _lfm2_fields(cfg: DecoderConfig, model_type: str, architecture: str, tokenizer: Optional[Tokenizer]) -> dict:
    """config.json's fields both formats share, once the model is one they hold."""
    if cfg.d_head * cfg.n_heads != cfg.d_model:
        raise ValueError(f"an {model_type} checkpoint's heads split d_model (it has no head_dim); this model has "
                         f"n_heads={cfg.n_heads} of d_head={cfg.d_head}, d_model={cfg.d_model}")
    require_fields(cfg, model_type, norm=Norm.RMS, norm_placement=NormPlacement.PRE, final_norm=True,
                   positions=Positions.ROTARY, rotary_dim=cfg.d_head, gated_mlp=True, activation=Activation.SILU,
                   qkv_bias=False, out_bias=False, mlp_bias=False, qk_norm=True, short_conv=cfg.short_conv,
                   experts=cfg.experts, heads_per_layer=None)
    spec = cfg.short_conv or ShortConv(layers=(True,))  # (every layer attending: the convolution's defaults)
    return {"model_type": model_type, "architectures": [architecture], "vocab_size": cfg.d_vocab,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "max_position_embeddings": cfg.n_ctx, "norm_eps": cfg.eps, **rope_to_hf(cfg),
            "tie_word_embeddings": cfg.tied_embeddings, "conv_bias": spec.bias, "conv_L_cache": spec.conv_kernel,
            "layer_types": [CONV if cfg.layer_is_short_conv(l) else ATTENTION for l in range(cfg.n_layers)],
            **special_token_ids(tokenizer)}


def lfm2_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    if cfg.experts is not None:
        raise ValueError("an lfm2 checkpoint holds one dense MLP per layer; this model has experts (lfm2_moe's format "
                         "holds them)")
    # the MLP's width as it is: no rule applied on reading it back
    return {**_lfm2_fields(cfg, "lfm2", "Lfm2ForCausalLM", tokenizer), "block_auto_adjust_ff_dim": False}


def lfm2_moe_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    experts = cfg.experts
    if experts is None:
        raise ValueError("an lfm2_moe checkpoint holds a mixture of experts; this model has none")
    sparse = [cfg.layer_sparse(l) for l in range(cfg.n_layers)]
    dense = sparse.index(True)
    if not all(sparse[dense:]):
        raise ValueError(f"an lfm2_moe checkpoint's dense MLPs are its first layers (num_dense_layers), the rest "
                         f"sparse; this model's experts are in layers {[l for l in range(cfg.n_layers) if sparse[l]]}")
    require_routing(experts, "lfm2_moe", scoring="sigmoid", selection_bias=experts.selection_bias,
                    scaling=experts.scaling, width=experts.width, layers=experts.layers, softmax_over="all",
                    clamped_glu=None, shared=None, renormalize_min=None,
                    renormalize_eps=RENORMALIZE_EPS if experts.renormalize else experts.renormalize_eps)
    return {**_lfm2_fields(cfg, "lfm2_moe", "Lfm2MoeForCausalLM", tokenizer), "num_dense_layers": dense,
            "moe_intermediate_size": cfg.expert_width, "num_experts": experts.n,
            "num_experts_per_tok": experts.per_token, "use_expert_bias": experts.selection_bias,
            "routed_scaling_factor": experts.scaling, "norm_topk_prob": experts.renormalize}


def tensor_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape), relative to the file's `model.`, of everything but the attention layers' q/k/v (read
    apart: take_qkv), the experts and the head."""
    d, m, dh = cfg.d_model, cfg.d_mlp, cfg.d_head
    table = {"embed.W_E": ("embed_tokens.weight", (cfg.d_vocab, d)), "ln_final.w": ("embedding_norm.weight", (d,))}
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"layers.{l}"
        table.update({f"{o}.{ours}.w": (f"{t}.{theirs}.weight", (d,)) for ours, theirs in NORMS.items()})
        if cfg.layer_is_short_conv(l):
            spec = cfg.short_conv
            shapes = {"in_proj": ((3 * d, d), (3 * d,)), "conv": ((d, 1, spec.conv_kernel), (d,)),
                      "out_proj": ((d, d), (d,))}
            for part in SHORT_CONV_PARTS:
                weight, bias = shapes[part]
                table[f"{o}.conv.{part}.weight"] = (f"{t}.conv.{part}.weight", weight)
                if spec.bias:
                    table[f"{o}.conv.{part}.bias"] = (f"{t}.conv.{part}.bias", bias)
        else:
            table[f"{o}.attn.out.weight"] = (f"{t}.self_attn.out_proj.weight", (d, cfg.n_heads * dh))
            for which in "qk":
                table[f"{o}.attn.{which}_norm.w"] = (f"{t}.self_attn.{which}_layernorm.weight", (dh,))
        if not cfg.layer_sparse(l):
            for (ours, theirs), shape in zip(MLP, ((m, d), (m, d), (d, m))):
                table[f"{o}.mlp.{ours}.weight"] = (f"{t}.feed_forward.{theirs}.weight", shape)
    return table


def _expert_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The routers, selection biases and experts: the MoE layout's names, the selection bias `feed_forward.expert_bias`."""
    table = expert_names(cfg, "lfm2_moe")
    for l in filter(cfg.layer_sparse, range(cfg.n_layers)):
        key = f"blocks.{l}.mlp.e_score_correction_bias"
        if key in table:
            table[key] = (f"layers.{l}.feed_forward.expert_bias", (cfg.experts.n,))
    return table


def _attention_layers(cfg: DecoderConfig) -> list[int]:
    return [l for l in range(cfg.n_layers) if not cfg.layer_is_short_conv(l)]


def lfm2_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in tensor_names(cfg).items()}
    for l in _attention_layers(cfg):
        out.update(take_qkv(source, cfg, l, lambda p, kind, l=l: f"layers.{l}.self_attn.{p}_proj.{kind}"))
    if cfg.experts is not None:
        out.update(take_experts(source, cfg, "lfm2_moe", _expert_names(cfg)))
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    return out


def lfm2_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    names = {**tensor_names(cfg), **(_expert_names(cfg) if cfg.experts is not None else {})}
    out = {f"model.{theirs}": params[ours] for ours, (theirs, _) in names.items()}
    for l in _attention_layers(cfg):
        out.update(split_qkv(params, cfg, l, lambda p, kind, l=l: f"model.layers.{l}.self_attn.{p}_proj.{kind}"))
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}
