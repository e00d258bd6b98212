"""Gemma 4 checkpoints: config.json <-> DecoderConfig and the tensors. The text-only files (`gemma4_text`,
Gemma4ForCausalLM), the language model of the multimodal ones (`gemma4`: gemma-4-E2B, -E4B, -31B, -26B-A4B; their
text_config) and of the encoder-free 12B (`gemma4_unified`), whose vision and audio parts are left out.

Gemma 3's sandwich block with per-head q and k norms, and: weightless norms on the values (v_norm), attention
unscaled (scaling 1: the q and k norms set the scale), norms that multiply by w itself (no 1 + w), full-attention
layers with heads of their own width and key/value heads (global_head_dim, num_global_key_value_heads; values from
the keys where attention_k_eq_v), rotating only part of each head (the "proportional" rope), the last
num_kv_shared_layers layers reusing keys and values, their MLPs twice as wide where use_double_wide_mlp, each
block's output times its stored layer_scalar, and in E2B/E4B a per-layer embedding of each token
(hidden_size_per_layer_input). The experts beside the MLP (26B-A4B, enable_moe_block) are probe.checkpoint_gemma4_moe's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from probe.checkpoint_llama import GEMMA_ACTIVATIONS
from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, Source, activation_of, layer_kinds, layer_types_to_hf,
                                     require_fields, rope_by_layer_kind, rope_to_hf, take_unembed, text_config)
from probe.config import DecoderConfig, Experts, GlobalLayers, Norm, NormPlacement, PerLayerInputs, Positions, SharedKV
from probe.config_file import CheckpointError, ConfigFields
from probe.tokenizer import Tokenizer

# transformers' Gemma4TextConfig defaults, for the fields a config.json leaves out (a multimodal file's text_config
# names only some); global_head_dim is read by its __post_init__ (the released files name it)
TEXT_DEFAULTS = {"vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation":
                 "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                 "tie_word_embeddings": True, "attention_bias": False, "sliding_window": 512,
                 "vocab_size_per_layer_input": 262_144, "hidden_size_per_layer_input": 256, "attention_k_eq_v": False,
                 "num_kv_shared_layers": 0, "enable_moe_block": False, "use_double_wide_mlp": False,
                 "global_head_dim": 512}
# the encoder-free 12B's text config (Gemma4UnifiedTextConfig): no per-layer embeddings or experts, a longer window
UNIFIED_DEFAULTS = {**TEXT_DEFAULTS, "sliding_window": 1024, "max_position_embeddings": 262_144,
                    "hidden_size_per_layer_input": 0}
NORMS = {"ln1": "input_layernorm", "ln1_post": "post_attention_layernorm", "ln2": "pre_feedforward_layernorm",
         "ln2_post": "post_feedforward_layernorm"}


def _global_shape(hf: dict, kinds: list[str]) -> tuple[int, Optional[int]]:
    """(the full-attention layers' head width, their key/value heads or None): from per_layer_config, as transformers
    saves them, or global_head_dim and num_global_key_value_heads (the latter read only with attention_k_eq_v, as
    transformers reads it), as the released files name them."""
    overrides = hf.get("per_layer_config")
    if overrides is None:
        kv = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v", True) else None
        return hf["global_head_dim"], kv
    full = {layer for layer, kind in enumerate(kinds) if kind == "full_attention"}
    shapes = {(o.get("head_dim", hf["head_dim"]), o.get("num_key_value_heads")) for o in overrides.values()}
    if {int(layer) for layer in overrides} != full or len(shapes) != 1 or not all(
            set(o) <= {"head_dim", "num_key_value_heads"} for o in overrides.values()):
        raise CheckpointError("per_layer_config must give every full-attention layer, and only those, the same "
                              f"head_dim (and num_key_value_heads), nothing else; got {overrides}")
    return shapes.pop()


def gemma4_config(hf: dict, defaults: dict = TEXT_DEFAULTS) -> DecoderConfig:
    hf = ConfigFields({**defaults, **hf}, getattr(hf, "path", Path("config.json")), getattr(hf, "prefix", ""))
    if hf.get("use_bidirectional_attention") == "all":
        raise CheckpointError("use_bidirectional_attention='all' (an embedding model's attention) is not supported")
    kinds = layer_kinds(hf, 6)
    if kinds[-1] != "full_attention":  # transformers forces it, with a warning
        kinds = [*kinds[:-1], "full_attention"]
    sliding = tuple(kind == "sliding_attention" for kind in kinds)
    full_rope, sliding_rope, scaling = rope_by_layer_kind(hf, 1_000_000.0, 10_000.0)
    d_head, n_kv_global = _global_shape(hf, kinds)
    shared, per_layer = hf["num_kv_shared_layers"], hf["hidden_size_per_layer_input"]
    window = hf["sliding_window"] if any(sliding) else None
    return DecoderConfig(
        n_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"], d_head=hf["head_dim"], d_mlp=hf["intermediate_size"],
        d_vocab=hf["vocab_size"], n_ctx=hf["max_position_embeddings"], eps=hf["rms_norm_eps"],
        activation=activation_of(hf["hidden_activation"], GEMMA_ACTIVATIONS), gated_mlp=True, norm=Norm.RMS_FLOAT32,
        norm_placement=NormPlacement.SANDWICH, positions=Positions.ROTARY, rotary_base=float(full_rope["rope_theta"]),
        rotary_scaling=scaling, sliding_rotary_base=None if window is None else float(sliding_rope["rope_theta"]),
        sliding_window=window, sliding_layers=None if window is None else sliding,
        attn_scale_dim=1, logit_softcap=hf.get("final_logit_softcapping"), scale_embed=True, qk_norm=True,
        qkv_bias=hf["attention_bias"], out_bias=hf["attention_bias"], mlp_bias=False,
        tied_embeddings=hf["tie_word_embeddings"], value_norm=True, layer_scalars=True,
        global_layers=None if window is None else GlobalLayers(d_head, n_kv_global, hf["attention_k_eq_v"]),
        shared_kv=SharedKV(shared, 2 * hf["intermediate_size"] if hf["use_double_wide_mlp"] else None) if shared else None,
        per_layer_inputs=PerLayerInputs(per_layer, hf["vocab_size_per_layer_input"]) if per_layer else None,
        # 26B-A4B: experts beside every layer's MLP, their weights renormalised (then times a per-expert scale)
        experts=Experts(hf["num_experts"], hf["top_k_experts"], renormalize=True, width=hf["moe_intermediate_size"])
        if hf["enable_moe_block"] else None,
    )


def gemma4_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    shared, spec = cfg.shared_kv, cfg.per_layer_inputs
    if shared is not None and shared.d_mlp not in (None, 2 * cfg.d_mlp):
        raise ValueError(f"a Gemma 4 checkpoint widens the shared layers' MLPs twice or not at all (use_double_wide_mlp); "
                         f"got shared_kv.d_mlp={shared.d_mlp} with d_mlp={cfg.d_mlp}")
    experts = cfg.experts
    if experts is not None and experts != Experts(experts.n, experts.per_token, renormalize=True, width=experts.width):
        raise ValueError(f"a Gemma 4 checkpoint's experts are softmax-routed to per_token renormalised ones in every "
                         f"layer, with nothing shared; got {experts}")
    require_fields(cfg, "Gemma 4", experts=experts, scale_embed=True, norm=Norm.RMS_FLOAT32, final_norm=True, positions=Positions.ROTARY,
                   rotary_dim=cfg.d_head, gated_mlp=True, mlp_bias=False, out_bias=cfg.qkv_bias,
                   norm_placement=NormPlacement.SANDWICH, qk_norm=True, attn_scale_dim=1, value_norm=True,
                   layer_scalars=True, heads_per_layer=None, **{f: getattr(cfg, f) for f in (
                       "logit_softcap", "sliding_window", "sliding_layers", "sliding_rotary_base", "global_layers",
                       "shared_kv", "per_layer_inputs")})
    full = rope_to_hf(cfg)["rope_parameters"]
    full_layers = [layer for layer in range(cfg.n_layers) if cfg.layer_window(layer) is None]
    out = {
        "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.d_head, "intermediate_size": cfg.d_mlp, "vocab_size": cfg.d_vocab,
        "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.eps, "attention_bias": cfg.qkv_bias,
        "hidden_activation": GPT_ACTIVATION_NAMES[cfg.activation], "tie_word_embeddings": cfg.tied_embeddings,
        "final_logit_softcapping": cfg.logit_softcap, "sliding_window": cfg.sliding_window or 512,
        "layer_types": layer_types_to_hf(cfg), "enable_moe_block": experts is not None,
        **({} if experts is None else {"num_experts": experts.n, "top_k_experts": experts.per_token,
                                       "moe_intermediate_size": cfg.expert_width}),
        "attention_k_eq_v": cfg.global_layers is not None and cfg.global_layers.values_from_keys,
        "num_kv_shared_layers": 0 if shared is None else shared.layers,
        "use_double_wide_mlp": shared is not None and shared.d_mlp is not None,
        "hidden_size_per_layer_input": 0 if spec is None else spec.d,
        "vocab_size_per_layer_input": cfg.d_vocab if spec is None else spec.d_vocab,
        "rope_parameters": {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": cfg.sliding_rotary_base or cfg.rotary_base}},
        # as transformers saves them: each full-attention layer's head width and key/value heads
        "per_layer_config": {str(layer): {"head_dim": cfg.layer_d_head(layer),
                                          "num_key_value_heads": cfg.layer_kv_heads(layer)} for layer in full_layers},
    }
    return out


def _attention_rows(cfg: DecoderConfig, layer: int) -> dict[str, tuple[int, int]]:
    """The q, k and v projections `layer` stores, [out, in] each: q alone where it reuses keys and values, q and k
    where its values are its keys."""
    d, dh, kv = cfg.d_model, cfg.layer_d_head(layer), cfg.layer_kv_heads(layer)
    rows = {"q": (cfg.layer_heads(layer) * dh, d)}
    if cfg.layer_kv_source(layer) is None:
        rows["k"] = (kv * dh, d)
        if not cfg.layer_values_from_keys(layer):
            rows["v"] = (kv * dh, d)
    return rows


def gemma4_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    d = cfg.d_model
    out = {"embed.W_E": source.take("embed_tokens.weight", (cfg.d_vocab, d)), "ln_final.w": source.take("norm.weight", (d,))}
    spec = cfg.per_layer_inputs
    if spec is not None:
        width = cfg.n_layers * spec.d
        out["per_layer_embed.W_E"] = source.take("embed_tokens_per_layer.weight", (spec.d_vocab, width))
        out["per_layer_embed.projection.weight"] = source.take("per_layer_model_projection.weight", (width, d))
        out["per_layer_embed.ln.w"] = source.take("per_layer_projection_norm.weight", (spec.d,))
    for l in range(cfg.n_layers):
        o, t, dh, m = f"blocks.{l}", f"layers.{l}", cfg.layer_d_head(l), cfg.layer_d_mlp(l)
        for ours, theirs in NORMS.items():
            out[f"{o}.{ours}.w"] = source.take(f"{t}.{theirs}.weight", (d,))
        rows = _attention_rows(cfg, l)
        out[f"{o}.attn.qkv.weight"] = torch.cat([source.take(f"{t}.self_attn.{p}_proj.weight", s) for p, s in rows.items()])
        if cfg.qkv_bias:
            out[f"{o}.attn.qkv.bias"] = torch.cat([source.take(f"{t}.self_attn.{p}_proj.bias", s[:1]) for p, s in rows.items()])
        out[f"{o}.attn.q_norm.w"] = source.take(f"{t}.self_attn.q_norm.weight", (dh,))
        if cfg.layer_kv_source(l) is None:
            out[f"{o}.attn.k_norm.w"] = source.take(f"{t}.self_attn.k_norm.weight", (dh,))
        else:  # the released files keep the unused projections of the layers that reuse keys (transformers skips them)
            for name in ("k_proj.weight", "v_proj.weight", "k_norm.weight", "k_proj.bias", "v_proj.bias"):
                source.take_optional(f"{t}.self_attn.{name}")
        out[f"{o}.attn.out.weight"] = source.take(f"{t}.self_attn.o_proj.weight", (d, rows["q"][0]))
        if cfg.out_bias:
            out[f"{o}.attn.out.bias"] = source.take(f"{t}.self_attn.o_proj.bias", (d,))
        for ours, theirs, shape in (("gate", "gate", (m, d)), ("fc_in", "up", (m, d)), ("fc_out", "down", (d, m))):
            out[f"{o}.mlp.{ours}.weight"] = source.take(f"{t}.mlp.{theirs}_proj.weight", shape)
        out[f"{o}.layer_scalar"] = source.take(f"{t}.layer_scalar", (1,))
        if cfg.experts is not None:
            out.update(_experts_to_probe(source, cfg, o, t))
        if spec is not None:
            out[f"{o}.per_layer.gate.weight"] = source.take(f"{t}.per_layer_input_gate.weight", (spec.d, d))
            out[f"{o}.per_layer.projection.weight"] = source.take(f"{t}.per_layer_projection.weight", (d, spec.d))
            out[f"{o}.per_layer.ln.w"] = source.take(f"{t}.post_per_layer_input_norm.weight", (d,))
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    return out


def gemma4_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": params["embed.W_E"], "model.norm.weight": params["ln_final.w"]}
    if cfg.per_layer_inputs is not None:
        out.update({"model.embed_tokens_per_layer.weight": params["per_layer_embed.W_E"],
                    "model.per_layer_model_projection.weight": params["per_layer_embed.projection.weight"],
                    "model.per_layer_projection_norm.weight": params["per_layer_embed.ln.w"]})
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"model.layers.{l}"
        for ours, theirs in NORMS.items():
            out[f"{t}.{theirs}.weight"] = params[f"{o}.{ours}.w"]
        rows = _attention_rows(cfg, l)
        sizes = [s[0] for s in rows.values()]
        for p, w in zip(rows, params[f"{o}.attn.qkv.weight"].split(sizes)):
            out[f"{t}.self_attn.{p}_proj.weight"] = w
        if cfg.qkv_bias:
            for p, b in zip(rows, params[f"{o}.attn.qkv.bias"].split(sizes)):
                out[f"{t}.self_attn.{p}_proj.bias"] = b
        out[f"{t}.self_attn.q_norm.weight"] = params[f"{o}.attn.q_norm.w"]
        if cfg.layer_kv_source(l) is None:
            out[f"{t}.self_attn.k_norm.weight"] = params[f"{o}.attn.k_norm.w"]
        out[f"{t}.self_attn.o_proj.weight"] = params[f"{o}.attn.out.weight"]
        if cfg.out_bias:
            out[f"{t}.self_attn.o_proj.bias"] = params[f"{o}.attn.out.bias"]
        for ours, theirs in (("gate", "gate"), ("fc_in", "up"), ("fc_out", "down")):
            out[f"{t}.mlp.{theirs}_proj.weight"] = params[f"{o}.mlp.{ours}.weight"]
        out[f"{t}.layer_scalar"] = params[f"{o}.layer_scalar"]
        if cfg.experts is not None:
            out.update(_experts_to_hf(params, cfg, o, t))
        if cfg.per_layer_inputs is not None:
            out[f"{t}.per_layer_input_gate.weight"] = params[f"{o}.per_layer.gate.weight"]
            out[f"{t}.per_layer_projection.weight"] = params[f"{o}.per_layer.projection.weight"]
            out[f"{t}.post_per_layer_input_norm.weight"] = params[f"{o}.per_layer.ln.w"]
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}


# ---- 26B-A4B's experts: stored stacked, [experts out in], gate and up fused --------------------------------------
EXPERT_NORMS = ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")


def _experts_to_probe(source: Source, cfg: DecoderConfig, o: str, t: str) -> dict[str, torch.Tensor]:
    d, m, n = cfg.d_model, cfg.expert_width, cfg.experts.n
    out = {f"{o}.{norm}.w": source.take(f"{t}.{norm}.weight", (d,)) for norm in EXPERT_NORMS}
    out[f"{o}.experts.W_gate.weight"] = source.take(f"{t}.router.proj.weight", (n, d))
    out[f"{o}.experts.router_scale"] = source.take(f"{t}.router.scale", (d,))
    out[f"{o}.experts.per_expert_scale"] = source.take(f"{t}.router.per_expert_scale", (n,))
    gate_up, down = source.take(f"{t}.experts.gate_up_proj", (n, 2 * m, d)), source.take(f"{t}.experts.down_proj", (n, d, m))
    for e in range(n):
        x = f"{o}.experts.experts.{e}"
        out[f"{x}.W_gate.weight"], out[f"{x}.W_in.weight"] = gate_up[e, :m], gate_up[e, m:]
        out[f"{x}.W_out.weight"] = down[e]
    return out


def _experts_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig, o: str, t: str) -> dict[str, torch.Tensor]:
    out = {f"{t}.{norm}.weight": params[f"{o}.{norm}.w"] for norm in EXPERT_NORMS}
    out.update({f"{t}.router.proj.weight": params[f"{o}.experts.W_gate.weight"],
                f"{t}.router.scale": params[f"{o}.experts.router_scale"],
                f"{t}.router.per_expert_scale": params[f"{o}.experts.per_expert_scale"]})
    experts = [f"{o}.experts.experts.{e}" for e in range(cfg.experts.n)]
    out[f"{t}.experts.gate_up_proj"] = torch.stack(
        [torch.cat([params[f"{x}.W_gate.weight"], params[f"{x}.W_in.weight"]]) for x in experts])
    out[f"{t}.experts.down_proj"] = torch.stack([params[f"{x}.W_out.weight"] for x in experts])
    return out


# ---- the multimodal checkpoints' language model -------------------------------------------------------------
# what a multimodal file holds beside the language model: never read (the encoder-free 12B has no vision tower)
OTHER_PARTS = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


def gemma4_multimodal_config(hf: dict) -> DecoderConfig:
    return gemma4_config(text_config(hf, "Gemma 4", default_tied=True))


def gemma4_unified_config(hf: dict) -> DecoderConfig:
    return gemma4_config(text_config(hf, "Gemma 4 (unified)", default_tied=True), UNIFIED_DEFAULTS)


def gemma4_multimodal_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    raise ValueError("probe keeps a multimodal Gemma 4's language model only; it saves as the text-only Gemma 4 "
                     "(gemma4_text), which transformers loads")


def gemma4_multimodal_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    for name in [n for n in source.state if n.startswith(OTHER_PARTS)]:
        del source.state[name]  # never read: they stay on disk
    return gemma4_to_probe(source, cfg)
