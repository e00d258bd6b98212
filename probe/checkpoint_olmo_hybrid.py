"""OLMo-Hybrid checkpoints (`olmo_hybrid`, OlmoHybridForCausalLM): OLMo 3's attention layers among Gated DeltaNet
layers (three in four by default, layer_types saying which).

- The attention layers: OLMo 3's post-norm sandwich without input norms, h = x + post_attention_layernorm(attn(x)),
  y = h + post_feedforward_layernorm(mlp(h)), q and k RMS-normalised over all heads together; no sliding window.
  Released files rotate nothing (NoPE: rope_parameters with rope_theta null, which makes transformers build no rotary
  embedding): probe's rotary_layers all False. A file with a rope_theta rotates every attention layer.
- The linear-attention layers: Llama's pre-norm block, h = x + linear_attn(input_layernorm(x)),
  y = h + mlp(post_attention_layernorm(h)), around probe.linear_attention.GatedDeltaNet, with two documented options
  where OLMo-Hybrid's DeltaNet differs from Qwen3-Next's: beta doubled (allow_neg_eigval, beta in (0, 2):
  LinearAttention.beta_scale=2) and the gated output norm's eps fixed at 1e-5 (FLA's; LinearAttention.norm_eps).
  Its separate q/k/v projections are stored as one in_proj_qkv (q, k, v: the order its convolution reads them), its
  g_proj as in_proj_z (the output gate), a_proj / b_proj as in_proj_a / in_proj_b, o_norm as norm and o_proj as
  out_proj, and split again on saving.
- The files' names are transformers' save format (its conversion mapping, the released layout): input_layernorm is
  stored as attention_layer_norm and post_attention_layernorm as feedforward_layer_norm (in every layer, an attention
  layer's norm after attention included), the DeltaNet's convolution as q_conv1d, k_conv1d and v_conv1d. Both
  spellings are read; probe writes the stored one, the convolution in transformers' three even chunks. Its mask (create_recurrent_attention_mask) zeroes padded inputs, as
  Qwen3.5's does.
- Every RMSNorm is OLMo 2's, w applied in float32 before rounding (probe's Norm.RMS rounds first: equal in float32).
The conv activation is hidden_act (silu in every file); transformers repeats no key head, so value heads must equal
key heads."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config_to_hf, olmo2_config
from probe.checkpoint_source import (Source, require_fields, special_token_ids, take_unembed, with_defaults,
                                     with_fields)
from probe.config import Activation, DecoderConfig, LinearAttention, Norm, NormPlacement
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

LAYER_TYPES = ("linear_attention", "full_attention")
DELTANET_NORM_EPS = 1e-5  # transformers' OlmoHybridRMSNormGated(eps=1e-5), whatever rms_norm_eps says
# ours -> theirs, in each linear layer's DeltaNet; in_proj_qkv is q_proj, k_proj and v_proj stacked
DELTANET_NAMES = {"in_proj_z.weight": "g_proj.weight", "in_proj_b.weight": "b_proj.weight",
                  "in_proj_a.weight": "a_proj.weight", "out_proj.weight": "o_proj.weight", "A_log": "A_log",
                  "dt_bias": "dt_bias", "norm.w": "o_norm.weight"}
STORED = {"input_layernorm": "attention_layer_norm", "post_attention_layernorm": "feedforward_layer_norm"}


def _layer_types(hf: dict) -> list[str]:
    """transformers' default where the file lists none: every fourth layer attention, the last one at least."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if not types:
        types = [LAYER_TYPES[i % 4 == 3] for i in range(n)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != n or not {"linear_attention", "full_attention"} <= set(types):
        raise CheckpointError(f"layer_types={types!r} must name each of the {n} layers one of {', '.join(LAYER_TYPES)}, "
                              "at least one of each")
    return types


def olmo_hybrid_config(hf: dict) -> DecoderConfig:
    types = _layer_types(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act={hf['hidden_act']!r} is not supported in an OLMo-Hybrid checkpoint: it is "
                              "also the DeltaNet convolution's activation, which probe computes as silu")
    rope = hf.get("rope_parameters") or {}
    # a null rope_theta is NoPE here, not a malformed number: read past the file's type check
    nope = "rope_theta" in rope and dict.get(rope, "rope_theta") is None
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("partial_rotary_factor is not supported in an OLMo-Hybrid checkpoint (OLMo 3's attention "
                              "rotates whole heads)")
    n_heads = hf["num_attention_heads"]
    key_heads = hf.get("linear_num_key_heads") or n_heads
    value_heads = hf.get("linear_num_value_heads") or n_heads
    if key_heads != value_heads:
        raise CheckpointError(f"linear_num_value_heads={value_heads} differs from linear_num_key_heads={key_heads}: "
                              "transformers' OLMo-Hybrid DeltaNet shares no key head between value heads")
    d_key = hf.get("linear_key_head_dim") or int(0.75 * hf["hidden_size"] / key_heads)
    linear = LinearAttention(layers=tuple(t == "linear_attention" for t in types), key_heads=key_heads,
                             value_heads=value_heads, d_key_head=d_key,
                             d_value_head=hf.get("linear_value_head_dim") or 2 * d_key,
                             conv_kernel=hf.get("linear_conv_kernel_dim", 4),
                             beta_scale=2.0 if hf.get("linear_allow_neg_eigval", True) else 1.0,
                             norm_eps=DELTANET_NORM_EPS)
    plain = with_fields(with_defaults(hf, max_position_embeddings=65536), head_dim=None,
                        **({"rope_parameters": None} if nope else {}))
    base = olmo2_config(plain)
    return dataclasses.replace(base, eps=hf.get("rms_norm_eps", 1e-6), linear_attention=linear,
                               rotary_layers=(False,) * base.n_layers if nope else None)


def olmo_hybrid_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    linear = cfg.linear_attention
    if linear is None or linear.key_heads != linear.value_heads or linear.norm_eps != DELTANET_NORM_EPS:
        raise ValueError(f"an olmo_hybrid checkpoint holds Gated DeltaNet layers with as many value heads as key heads "
                         f"and a gated norm eps of {DELTANET_NORM_EPS}; this model has linear_attention={linear!r}")
    if linear.beta_scale not in (1.0, 2.0):
        raise ValueError(f"an olmo_hybrid checkpoint scales beta by 1 or 2 (linear_allow_neg_eigval); this model's "
                         f"beta_scale is {linear.beta_scale}")
    rotates = {cfg.layer_rotates(l) for l in range(cfg.n_layers) if not linear.layers[l]}
    if len(rotates) > 1:
        raise ValueError("an olmo_hybrid checkpoint rotates every attention layer or none (NoPE); this model's "
                         "rotary_layers mix them")
    require_fields(cfg, "olmo_hybrid", activation=Activation.SILU, d_head=cfg.d_model // cfg.n_heads, experts=None,
                   mlp_bias=False, norm=Norm.RMS, norm_placement=NormPlacement.SANDWICH, input_norms=False,
                   qk_norm=True, qk_norm_over_heads=True, out_bias=cfg.qkv_bias, linear_attention=linear,
                   rotary_layers=None if rotates == {True} else cfg.rotary_layers)
    plain = dataclasses.replace(cfg, linear_attention=None, rotary_layers=None)
    out = llama_config_to_hf(plain, tokenizer, "olmo2")
    for key in ("head_dim", "mlp_bias", "rope_theta", "rope_scaling"):
        out.pop(key, None)
    if rotates == {False}:
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": None}
    out.update(model_type="olmo_hybrid", architectures=["OlmoHybridForCausalLM"],
               layer_types=[LAYER_TYPES[not is_linear] for is_linear in linear.layers],
               linear_num_key_heads=linear.key_heads, linear_num_value_heads=linear.value_heads,
               linear_key_head_dim=linear.d_key_head, linear_value_head_dim=linear.d_value_head,
               linear_conv_kernel_dim=linear.conv_kernel, linear_allow_neg_eigval=linear.beta_scale == 2.0,
               # (else the config class fills in the released vocabulary's ids, past a small model's)
               **special_token_ids(tokenizer))
    return out


def _norms(cfg: DecoderConfig, layer: int) -> dict[str, str]:
    """The block's norms, ours -> theirs: a linear layer's are pre-norm (Llama's names), an attention layer's follow
    its sublayers (OLMo 3's)."""
    if cfg.layer_is_linear(layer):
        return {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}
    return {"ln1_post": "post_attention_layernorm", "ln2_post": "post_feedforward_layernorm"}


def _shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    linear, d, m = cfg.linear_attention, cfg.d_model, cfg.d_mlp
    keys, values, heads = linear.key_heads * linear.d_key_head, linear.value_heads * linear.d_value_head, linear.value_heads
    return {"q": (keys, d), "k": (keys, d), "v": (values, d), "in_proj_z.weight": (values, d),
            "in_proj_b.weight": (heads, d), "in_proj_a.weight": (heads, d), "out_proj.weight": (d, values),
            "conv1d.weight": (2 * keys + values, 1, linear.conv_kernel), "A_log": (heads,), "dt_bias": (heads,),
            "norm.w": (linear.d_value_head,), "gate": (m, d), "up": (m, d), "down": (d, m)}


def _take_conv(source: Source, mixer: str, s: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """The convolution's weight over q, k and v's channels, stored whole or as q_conv1d, k_conv1d and v_conv1d: their
    widths q's, k's and v's, or (transformers 5.25's own save, which chunks the concatenation in three) a third each, rounded up."""
    whole = s["conv1d.weight"]
    if f"{mixer}.conv1d.weight" in source.state:
        return source.take(f"{mixer}.conv1d.weight", whole)
    widths = [s[p][0] for p in "qkv"]
    if tuple(source.state.get(f"{mixer}.q_conv1d.weight", torch.empty(0)).shape[:1]) != (widths[0],):
        third = -(-whole[0] // 3)  # (torch.chunk's: the last piece the remainder)
        widths = [third, third, whole[0] - 2 * third]
    return torch.cat([source.take(f"{mixer}.{p}_conv1d.weight", (w,) + whole[1:]) for p, w in zip("qkv", widths)])


def olmo_hybrid_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    d, h, kv, dh, s = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, _shapes(cfg)
    out = {"embed.W_E": source.take("embed_tokens.weight", (cfg.d_vocab, d)),
           "ln_final.w": source.take("norm.weight", (d,))}
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"layers.{l}"
        for ours, theirs in _norms(cfg, l).items():
            stored = f"{t}.{STORED.get(theirs, theirs)}.weight"
            out[f"{o}.{ours}.w"] = source.take(stored if stored in source.state else f"{t}.{theirs}.weight", (d,))
        for ours, theirs in (("gate", "gate"), ("fc_in", "up"), ("fc_out", "down")):
            out[f"{o}.mlp.{ours}.weight"] = source.take(f"{t}.mlp.{theirs}_proj.weight", s[theirs])
        if cfg.layer_is_linear(l):
            mixer = f"{t}.linear_attn"
            out[f"{o}.linear_attn.in_proj_qkv.weight"] = torch.cat(
                [source.take(f"{mixer}.{p}_proj.weight", s[p]) for p in "qkv"])
            out[f"{o}.linear_attn.conv1d.weight"] = _take_conv(source, mixer, s)
            for ours, theirs in DELTANET_NAMES.items():
                out[f"{o}.linear_attn.{ours}"] = source.take(f"{mixer}.{theirs}", s[ours])
            continue
        sizes = {"q": h * dh, "k": kv * dh, "v": kv * dh}
        out[f"{o}.attn.qkv.weight"] = torch.cat([source.take(f"{t}.self_attn.{p}_proj.weight", (sizes[p], d))
                                                 for p in "qkv"])
        out[f"{o}.attn.out.weight"] = source.take(f"{t}.self_attn.o_proj.weight", (d, h * dh))
        if cfg.qkv_bias:
            out[f"{o}.attn.qkv.bias"] = torch.cat([source.take(f"{t}.self_attn.{p}_proj.bias", (sizes[p],))
                                                   for p in "qkv"])
            out[f"{o}.attn.out.bias"] = source.take(f"{t}.self_attn.o_proj.bias", (d,))
        for which in "qk":
            out[f"{o}.attn.{which}_norm.w"] = source.take(f"{t}.self_attn.{which}_norm.weight", (sizes[which],))
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    return out


def olmo_hybrid_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    linear = cfg.linear_attention
    out = {"model.embed_tokens.weight": params["embed.W_E"], "model.norm.weight": params["ln_final.w"]}
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"model.layers.{l}"
        for ours, theirs in _norms(cfg, l).items():
            out[f"{t}.{STORED.get(theirs, theirs)}.weight"] = params[f"{o}.{ours}.w"]
        for ours, theirs in (("gate", "gate"), ("fc_in", "up"), ("fc_out", "down")):
            out[f"{t}.mlp.{theirs}_proj.weight"] = params[f"{o}.mlp.{ours}.weight"]
        if cfg.layer_is_linear(l):
            mixer, keys = f"{t}.linear_attn", linear.key_heads * linear.d_key_head
            qkv = params[f"{o}.linear_attn.in_proj_qkv.weight"].split([keys, keys, linear.value_heads * linear.d_value_head])
            out.update({f"{mixer}.{p}_proj.weight": w for p, w in zip("qkv", qkv)})
            # in three even chunks, as transformers 5.25's own save splits it (its load concatenates whatever widths)
            conv = params[f"{o}.linear_attn.conv1d.weight"].chunk(3)
            out.update({f"{mixer}.{p}_conv1d.weight": w for p, w in zip("qkv", conv)})
            out.update({f"{mixer}.{theirs}": params[f"{o}.linear_attn.{ours}"] for ours, theirs in DELTANET_NAMES.items()})
            continue
        sizes = [cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head]
        for p, w in zip("qkv", params[f"{o}.attn.qkv.weight"].split(sizes)):
            out[f"{t}.self_attn.{p}_proj.weight"] = w
        out[f"{t}.self_attn.o_proj.weight"] = params[f"{o}.attn.out.weight"]
        if cfg.qkv_bias:
            for p, b in zip("qkv", params[f"{o}.attn.qkv.bias"].split(sizes)):
                out[f"{t}.self_attn.{p}_proj.bias"] = b
            out[f"{t}.self_attn.o_proj.bias"] = params[f"{o}.attn.out.bias"]
        for which in "qk":
            out[f"{t}.self_attn.{which}_norm.weight"] = params[f"{o}.attn.{which}_norm.w"]
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}
