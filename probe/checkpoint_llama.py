"""Llama, Qwen2, Qwen3, Mistral, OLMo, OLMo 2 and 3, SmolLM3, Arcee, Seed-OSS, ERNIE 4.5, Gemma and Gemma 2
checkpoints: config.json <->
DecoderConfig, tensor names."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, GPT_ACTIVATIONS, Source, activation_of,
                                     layer_kinds, layer_types_to_hf, require_fields, rope_by_layer_kind, rope_from_hf,
                                     rope_to_hf, special_token_ids, take_unembed, with_defaults)
from probe.config import Activation, DecoderConfig, Norm, NormPlacement, Positions
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer


# ---- Llama and Qwen2: nn.Linear layers, stored [out, in]; separate q, k, v -----------------------
def llama_config(hf: dict, qkv_bias: Optional[bool] = None, default_act: str = "silu",
                 activations: dict[str, Activation] = GPT_ACTIVATIONS, default_eps: float = 1e-6) -> DecoderConfig:
    """`default_act`, `default_eps`: the family's defaults for a config.json without hidden_act / rms_norm_eps (as
    transformers' config class of the family fills them)."""
    rope, scaling = rope_from_hf(hf)
    if hf.get("use_sliding_window"):  # Qwen2's: windows in some layers only (max_window_layers)
        raise CheckpointError("use_sliding_window=true (a window in some layers only) is not supported")
    n_heads = hf["num_attention_heads"]
    heads = hf.get("heads_per_layer")  # written by probe for structurally pruned models
    return DecoderConfig(
        n_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, d_head=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        d_mlp=hf["intermediate_size"], d_vocab=hf["vocab_size"], n_ctx=hf["max_position_embeddings"],
        eps=hf.get("rms_norm_eps", default_eps), activation=activation_of(hf.get("hidden_act", default_act), activations),
        gated_mlp=True, norm=Norm.RMS, positions=Positions.ROTARY,
        rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), rotary_scaling=scaling,
        qkv_bias=hf.get("attention_bias", False) if qkv_bias is None else qkv_bias,
        out_bias=hf.get("attention_bias", False) if qkv_bias is None else False,
        mlp_bias=hf.get("mlp_bias", False), tied_embeddings=hf.get("tie_word_embeddings", False),
        heads_per_layer=None if heads is None else tuple(heads),
    )


def qwen2_config(hf: dict) -> DecoderConfig:
    return llama_config(hf, qkv_bias=True)  # Qwen2: biases on q, k, v and none on the output


def qwen3_config(hf: dict) -> DecoderConfig:
    return dataclasses.replace(llama_config(with_defaults(hf, head_dim=128)), qk_norm=True)  # Qwen3: Llama's layout, each head's q and k normalised


def olmo_config(hf: dict) -> DecoderConfig:
    # OLMo: Llama's block with LayerNorms that learn nothing (computed in float32, eps fixed at 1e-5), and (OLMo-7B-0424
    # on) q, k and v clamped to clip_qkv
    return dataclasses.replace(llama_config(hf), norm=Norm.LAYER, norm_weights=False, eps=1e-5,
                               out_bias=hf.get("attention_bias", False), clip_qkv=hf.get("clip_qkv"))


def olmo2_config(hf: dict) -> DecoderConfig:
    # OLMo 2: no norm before either sublayer, an RMSNorm after each (a sandwich block without its input norms), and
    # q and k RMS-normalised over all heads together before rotary
    return dataclasses.replace(llama_config(hf, default_eps=1e-5), norm_placement=NormPlacement.SANDWICH,
                               input_norms=False, qk_norm=True, qk_norm_over_heads=True,
                               out_bias=hf.get("attention_bias", False))


def olmo3_config(hf: dict) -> DecoderConfig:
    # OLMo 3: OLMo 2's block, with three sliding layers in four (their window, their own rope, unscaled) and the
    # full layers' rope rescaled (YaRN)
    sliding = tuple(kind == "sliding_attention" for kind in layer_kinds(hf, 4))
    full, slid, scaling = rope_by_layer_kind(hf, 500_000.0, 500_000.0)
    window = hf.get("sliding_window", 4096) if any(sliding) else None
    return dataclasses.replace(olmo2_config(hf), rotary_base=float(full["rope_theta"]), rotary_scaling=scaling,
                               sliding_window=window, sliding_layers=None if window is None else sliding,
                               sliding_rotary_base=None if window is None else float(slid["rope_theta"]))


def smollm3_config(hf: dict) -> DecoderConfig:
    # SmolLM3: Llama's layers, some of them without positions (NoPE): no_rope_layers is 1 where a layer rotates
    rotates = hf.get("no_rope_layers")
    return dataclasses.replace(llama_config(with_defaults(hf, rope_theta=2e6)), rotary_layers=None if rotates is None else tuple(map(bool, rotates)),
                               tied_embeddings=hf.get("tie_word_embeddings", True))


def seed_oss_config(hf: dict) -> DecoderConfig:
    # Seed-OSS: Llama's layers, q/k/v biases on by default and the output projection's bias a field of its own
    return dataclasses.replace(llama_config(with_defaults(hf, head_dim=128), qkv_bias=hf.get("attention_bias", True)),
                               out_bias=hf.get("attention_out_bias", False))


def ernie4_5_config(hf: dict) -> DecoderConfig:
    # ERNIE 4.5: Llama's layers with one switch for every bias and adjacent dimensions paired by rotary
    bias = hf.get("use_bias", False)
    hf = with_defaults(hf, head_dim=128, rope_theta=500_000.0, attention_bias=bias, mlp_bias=bias)
    return dataclasses.replace(llama_config(hf, default_eps=1e-5),
                               rotary_adjacent_pairs=True, tied_embeddings=hf.get("tie_word_embeddings", True))


def arcee_config(hf: dict) -> DecoderConfig:
    # Arcee (AFM): Llama's layers with an ungated MLP, relu^2 by default
    return dataclasses.replace(llama_config(hf, default_act="relu2", default_eps=1e-5), gated_mlp=False)


def mistral_config(hf: dict) -> DecoderConfig:
    # Mistral: Llama's layers without any bias, and (v0.1) a sliding window; later versions say null (a key left out
    # is transformers' default, 4096)
    return dataclasses.replace(llama_config(hf, qkv_bias=False), sliding_window=hf.get("sliding_window", 4096))


# what each Llama-like format fixes beyond Llama's own layout
_LLAMA_LIKE = {
    "llama": ("LlamaForCausalLM", lambda cfg: dict(out_bias=cfg.qkv_bias)),
    "qwen2": ("Qwen2ForCausalLM", lambda cfg: dict(qkv_bias=True, out_bias=False)),
    "mistral": ("MistralForCausalLM", lambda cfg: dict(qkv_bias=False, out_bias=False, mlp_bias=False,
                                                       sliding_window=cfg.sliding_window)),
    "qwen3": ("Qwen3ForCausalLM", lambda cfg: dict(out_bias=cfg.qkv_bias, mlp_bias=False, qk_norm=True)),
    "olmo": ("OlmoForCausalLM", lambda cfg: dict(norm=Norm.LAYER, norm_weights=False, eps=1e-5, out_bias=cfg.qkv_bias,
                                                 mlp_bias=False, clip_qkv=cfg.clip_qkv)),
    "olmo2": ("Olmo2ForCausalLM", lambda cfg: dict(norm_placement=NormPlacement.SANDWICH, input_norms=False, qk_norm=True,
                                                   qk_norm_over_heads=True, out_bias=cfg.qkv_bias, mlp_bias=False)),
    "olmo3": ("Olmo3ForCausalLM", lambda cfg: dict(norm_placement=NormPlacement.SANDWICH, input_norms=False, qk_norm=True,
                                                   qk_norm_over_heads=True, out_bias=cfg.qkv_bias, mlp_bias=False,
                                                   sliding_window=cfg.sliding_window, sliding_layers=cfg.sliding_layers,
                                                   sliding_rotary_base=cfg.sliding_rotary_base)),
    "smollm3": ("SmolLM3ForCausalLM", lambda cfg: dict(out_bias=cfg.qkv_bias, rotary_layers=cfg.rotary_layers)),
    "arcee": ("ArceeForCausalLM", lambda cfg: dict(out_bias=cfg.qkv_bias, gated_mlp=False)),
    "seed_oss": ("SeedOssForCausalLM", lambda cfg: dict(out_bias=cfg.out_bias)),
    "ernie4_5": ("Ernie4_5ForCausalLM", lambda cfg: dict(out_bias=cfg.qkv_bias, mlp_bias=cfg.qkv_bias,
                                                         rotary_adjacent_pairs=True)),
    "exaone": ("ExaoneForCausalLM", lambda cfg: dict(out_bias=cfg.qkv_bias)),
    "hunyuan_v1_dense": ("HunYuanDenseV1ForCausalLM", lambda cfg: dict(out_bias=cfg.qkv_bias, mlp_bias=False, qk_norm=True,
                                                                       qk_norm_after_rope=True)),
    "exaone4": ("Exaone4ForCausalLM", lambda cfg: dict(norm_placement=NormPlacement.SANDWICH, input_norms=False,
                                                       qk_norm=True, qkv_bias=False, out_bias=False, mlp_bias=False,
                                                       sliding_window=cfg.sliding_window,
                                                       sliding_layers=cfg.sliding_layers,
                                                       rotary_layers=cfg.rotary_layers)),
    "cohere": ("CohereForCausalLM", lambda cfg: dict(norm=Norm.LAYER, norm_placement=NormPlacement.PARALLEL,
                                                     rotary_adjacent_pairs=True, out_bias=cfg.qkv_bias, mlp_bias=False)),
    "cohere2": ("Cohere2ForCausalLM", lambda cfg: dict(norm=Norm.LAYER, norm_placement=NormPlacement.PARALLEL,
                                                       rotary_adjacent_pairs=True, out_bias=cfg.qkv_bias, mlp_bias=False,
                                                       sliding_window=cfg.sliding_window,
                                                       sliding_layers=cfg.sliding_layers,
                                                       rotary_layers=cfg.rotary_layers)),
    "granite": ("GraniteForCausalLM", lambda cfg: dict(out_bias=cfg.qkv_bias, attn_scale_dim=cfg.attn_scale_dim)),
    "granitemoe": ("GraniteMoeForCausalLM", lambda cfg: dict(out_bias=cfg.qkv_bias, attn_scale_dim=cfg.attn_scale_dim,
                                                             mlp_bias=False, experts=cfg.experts)),
    "apertus": ("ApertusForCausalLM", lambda cfg: dict(out_bias=cfg.qkv_bias, gated_mlp=False, mlp_bias=False,
                                                       qk_norm=True, activation=cfg.activation)),
    # mixtures of experts (probe.checkpoint_moe checks and writes the experts)
    "mixtral": ("MixtralForCausalLM", lambda cfg: dict(qkv_bias=False, out_bias=False, mlp_bias=False,
                                                       sliding_window=cfg.sliding_window, experts=cfg.experts)),
    "olmoe": ("OlmoeForCausalLM", lambda cfg: dict(qk_norm=True, qk_norm_over_heads=True, out_bias=cfg.qkv_bias,
                                                   mlp_bias=False, experts=cfg.experts, clip_qkv=cfg.clip_qkv)),
    "flex_olmo": ("FlexOlmoForCausalLM", lambda cfg: dict(norm_placement=NormPlacement.SANDWICH, input_norms=False,
                                                          qk_norm=True, qk_norm_over_heads=True, out_bias=cfg.qkv_bias,
                                                          mlp_bias=False, experts=cfg.experts)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", lambda cfg: dict(out_bias=cfg.qkv_bias, mlp_bias=False, qk_norm=True,
                                                          experts=cfg.experts)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", lambda cfg: dict(qkv_bias={False, True}, out_bias=False, mlp_bias=False,
                                                          experts=cfg.experts)),
    "gpt_oss": ("GptOssForCausalLM", lambda cfg: dict(norm=Norm.RMS_FLOAT32, out_bias=cfg.qkv_bias, mlp_bias=True,
                                                      attn_sinks=True, experts=cfg.experts,
                                                      sliding_window=cfg.sliding_window,
                                                      sliding_layers=cfg.sliding_layers)),
}


def _llama_like_hf(cfg: DecoderConfig, model_type: str, architecture: str) -> dict:
    """The config.json fields Llama, Qwen2, Mistral and Gemma share."""
    return {
        "model_type": model_type, "architectures": [architecture],
        "num_hidden_layers": cfg.n_layers, "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head, "intermediate_size": cfg.d_mlp,
        "vocab_size": cfg.d_vocab, "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.eps,
        **rope_to_hf(cfg), "tie_word_embeddings": cfg.tied_embeddings,
        # transformers cannot load a pruned model (its layers differ in width); probe can
        **({"heads_per_layer": list(cfg.heads_per_layer)} if cfg.heads_per_layer is not None else {}),
    }


def llama_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer], model_type: str = "llama") -> dict:
    architecture, fixed = _LLAMA_LIKE[model_type]
    require_fields(cfg, model_type, **{"norm": Norm.RMS, "norm_placement": NormPlacement.PRE, "final_norm": True,
                                       "positions": Positions.ROTARY, "rotary_dim": cfg.d_head, "gated_mlp": True,
                                       **fixed(cfg)})
    out = {**_llama_like_hf(cfg, model_type, architecture), "hidden_act": GPT_ACTIVATION_NAMES[cfg.activation],
           "mlp_bias": cfg.mlp_bias}
    if model_type in ("llama", "qwen3", "olmo", "olmo2", "olmo3", "olmoe", "qwen3_moe", "smollm3", "arcee", "apertus",
                      "granite", "granitemoe", "exaone", "seed_oss", "flex_olmo", "hunyuan_v1_dense"):
        out["attention_bias"] = cfg.qkv_bias
    if model_type == "seed_oss":
        out["attention_out_bias"] = cfg.out_bias
    if model_type == "ernie4_5":
        out["use_bias"] = out.pop("mlp_bias")
    if model_type in ("smollm3", "cohere", "cohere2", "flex_olmo", "exaone4", "hunyuan_v1_dense"):
        out.update(special_token_ids(tokenizer))
    if model_type == "smollm3":
        out["no_rope_layers"] = [int(cfg.layer_rotates(l)) for l in range(cfg.n_layers)]
    if model_type == "olmo3":  # each layer's kind, and each kind's rope (the sliding layers' unscaled)
        out.pop("rope_theta"), out.pop("rope_scaling", None)
        out.update(layer_types=layer_types_to_hf(cfg),
                   sliding_window=cfg.sliding_window or 4096, rope_parameters={
                       "full_attention": out["rope_parameters"], "sliding_attention": {
                           "rope_type": "default", "rope_theta": cfg.sliding_rotary_base or cfg.rotary_base}})
    if model_type in ("olmo", "olmoe"):
        out["clip_qkv"] = cfg.clip_qkv
    if model_type == "mistral":
        out["sliding_window"] = cfg.sliding_window
    return out


def llama_like(model_type: str) -> tuple[Callable, Callable, Callable]:
    """A Llama-like model type's (config_to_hf, to_probe, to_hf), for its checkpoints.Family: Llama's tensor names,
    the config fields _LLAMA_LIKE says it fixes."""
    return (lambda cfg, tokenizer: llama_config_to_hf(cfg, tokenizer, model_type)), llama_to_probe, llama_to_hf


def _llama_shapes(cfg: DecoderConfig, layer: int) -> dict[str, tuple[int, ...]]:
    d, m, h, kv, dh = cfg.d_model, cfg.d_mlp, cfg.layer_heads(layer), cfg.layer_kv_heads(layer), cfg.d_head
    return {"q": (h * dh, d), "k": (kv * dh, d), "v": (kv * dh, d), "o": (d, h * dh), "gate": (m, d), "up": (m, d), "down": (d, m)}


def _llama_norms(cfg: DecoderConfig) -> dict[str, str]:
    """Each block's norms, ours -> theirs. Gemma 2's "post_attention_layernorm" normalises the attention's write;
    Llama's is the norm before the MLP."""
    if cfg.norm_placement is NormPlacement.SANDWICH:
        norms = {"ln1": "input_layernorm", "ln1_post": "post_attention_layernorm", "ln2": "pre_feedforward_layernorm",
                 "ln2_post": "post_feedforward_layernorm"}
    else:
        norms = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}
    # norms without weights (OLMo's) or none before the sublayers (OLMo 2's) have nothing stored; a sandwich block's
    # write norms keep theirs
    return norms if cfg.norm_weights and cfg.input_norms else {k: v for k, v in norms.items() if k.endswith("_post")}


def _mlp_projections(cfg: DecoderConfig, layer: int) -> tuple[tuple[str, str], ...]:
    """(ours, theirs) of each projection of `layer`'s dense MLP; a mixture of experts' are its family's
    (probe.checkpoint_moe)."""
    if cfg.layer_sparse(layer):
        return ()
    return (("gate", "gate"),) * cfg.gated_mlp + (("fc_in", "up"), ("fc_out", "down"))


def llama_to_probe(source: Source, cfg: DecoderConfig,
                   norms: Optional[dict[str, str]] = None) -> dict[str, torch.Tensor]:
    """`norms`: each block's norms, ours -> theirs, where a format names them otherwise (Apertus)."""
    d = cfg.d_model
    out = {"embed.W_E": source.take("embed_tokens.weight", (cfg.d_vocab, d))}
    if cfg.norm_weights:
        out["ln_final.w"] = source.take("norm.weight", (d,))
    for l in range(cfg.n_layers):
        o, t, s = f"blocks.{l}", f"layers.{l}", _llama_shapes(cfg, l)
        for ours, theirs in (norms or _llama_norms(cfg)).items():
            out[f"{o}.{ours}.w"] = source.take(f"{t}.{theirs}.weight", (d,))
        if cfg.qk_norm:
            for which in "qk":
                width = s[which][0] if cfg.qk_norm_over_heads else cfg.d_head  # OLMo 2's spans every head
                out[f"{o}.attn.{which}_norm.w"] = source.take(f"{t}.self_attn.{which}_norm.weight", (width,))
        out[f"{o}.attn.qkv.weight"] = torch.cat([source.take(f"{t}.self_attn.{p}_proj.weight", s[p]) for p in "qkv"])
        if cfg.qkv_bias:
            out[f"{o}.attn.qkv.bias"] = torch.cat([source.take(f"{t}.self_attn.{p}_proj.bias", s[p][:1]) for p in "qkv"])
        out[f"{o}.attn.out.weight"] = source.take(f"{t}.self_attn.o_proj.weight", s["o"])
        if cfg.out_bias:
            out[f"{o}.attn.out.bias"] = source.take(f"{t}.self_attn.o_proj.bias", (d,))
        for ours, theirs in _mlp_projections(cfg, l):
            out[f"{o}.mlp.{ours}.weight"] = source.take(f"{t}.mlp.{theirs}_proj.weight", s[theirs])
            if cfg.mlp_bias:
                out[f"{o}.mlp.{ours}.bias"] = source.take(f"{t}.mlp.{theirs}_proj.bias", s[theirs][:1])
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    return out


def llama_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig,
                norms: Optional[dict[str, str]] = None) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": params["embed.W_E"]}
    if cfg.norm_weights:
        out["model.norm.weight"] = params["ln_final.w"]
    for l in range(cfg.n_layers):
        o, t, s = f"blocks.{l}", f"model.layers.{l}", _llama_shapes(cfg, l)
        sizes = [s["q"][0], s["k"][0], s["v"][0]]
        for ours, theirs in (norms or _llama_norms(cfg)).items():
            out[f"{t}.{theirs}.weight"] = params[f"{o}.{ours}.w"]
        if cfg.qk_norm:
            for which in "qk":
                out[f"{t}.self_attn.{which}_norm.weight"] = params[f"{o}.attn.{which}_norm.w"]
        for p, w in zip("qkv", params[f"{o}.attn.qkv.weight"].split(sizes)):
            out[f"{t}.self_attn.{p}_proj.weight"] = w
        if cfg.qkv_bias:
            for p, b in zip("qkv", params[f"{o}.attn.qkv.bias"].split(sizes)):
                out[f"{t}.self_attn.{p}_proj.bias"] = b
        out[f"{t}.self_attn.o_proj.weight"] = params[f"{o}.attn.out.weight"]
        if cfg.out_bias:
            out[f"{t}.self_attn.o_proj.bias"] = params[f"{o}.attn.out.bias"]
        for ours, theirs in _mlp_projections(cfg, l):
            out[f"{t}.mlp.{theirs}_proj.weight"] = params[f"{o}.mlp.{ours}.weight"]
            if cfg.mlp_bias:
                out[f"{t}.mlp.{theirs}_proj.bias"] = params[f"{o}.mlp.{ours}.bias"]
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}



# ---- Gemma and Gemma 2: Llama's layout; norms store w - 1, embeddings scaled, GeGLU -----------------------
# Gemma's "gelu" is the tanh approximation: transformers rewrites the released configs' "gelu" to it
GEMMA_ACTIVATIONS = {**GPT_ACTIVATIONS, "gelu": Activation.GELU_TANH}


def gemma_config(hf: dict, activation_key: str = "hidden_act") -> DecoderConfig:
    hf = with_defaults(hf, head_dim=256)
    act = hf.get(activation_key) or "gelu_pytorch_tanh"  # Gemma reads hidden_act, Gemma 2 hidden_activation
    return dataclasses.replace(llama_config(hf), activation=activation_of(act, GEMMA_ACTIVATIONS), scale_embed=True,
                               norm=Norm.RMS_FLOAT32, tied_embeddings=hf.get("tie_word_embeddings", True))


def gemma2_config(hf: dict) -> DecoderConfig:
    n_layers = hf["num_hidden_layers"]
    # older files have no layer_types; transformers then windows the even layers
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise CheckpointError(f"layer_types {unknown} are not supported; supported: sliding_attention, full_attention")
    sliding = tuple(t == "sliding_attention" for t in types)
    # a key left out means transformers' default; a key set to null means none
    window = hf.get("sliding_window", 4096) if any(sliding) else None
    return dataclasses.replace(
        gemma_config(hf, "hidden_activation"), norm_placement=NormPlacement.SANDWICH,
        attn_scale_dim=hf.get("query_pre_attn_scalar", 256), attn_softcap=hf.get("attn_logit_softcapping", 50.0),
        logit_softcap=hf.get("final_logit_softcapping", 30.0), sliding_window=window,
        sliding_layers=None if window is None else sliding,
    )


def vaultgemma_config(hf: dict) -> DecoderConfig:
    """VaultGemma: Gemma 2 without the norms of the sublayers' writes (a pre-norm block)."""
    return dataclasses.replace(gemma2_config(hf), norm_placement=NormPlacement.PRE)


VAULTGEMMA_NORMS = {"ln1": "input_layernorm", "ln2": "pre_feedforward_layernorm"}
GEMMA_ARCHITECTURES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "vaultgemma": "VaultGemmaForCausalLM"}


def gemma_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer], model_type: str) -> dict:
    gemma2 = model_type in ("gemma2", "vaultgemma")  # (VaultGemma's fields are Gemma 2's)
    if cfg.activation is Activation.GELU:
        raise ValueError(f"a {model_type} checkpoint cannot hold activation=gelu (exact): transformers reads Gemma's "
                         "'gelu' as the tanh approximation")
    gemma2_fields = ("attn_scale_dim", "attn_softcap", "logit_softcap", "sliding_window", "sliding_layers")
    require_fields(cfg, model_type, scale_embed=True, norm=Norm.RMS_FLOAT32, final_norm=True, positions=Positions.ROTARY,
                   rotary_dim=cfg.d_head, gated_mlp=True, mlp_bias=False, out_bias=cfg.qkv_bias,
                   norm_placement=NormPlacement.SANDWICH if model_type == "gemma2" else NormPlacement.PRE,
                   **({f: getattr(cfg, f) for f in gemma2_fields} if gemma2 else {}))
    out = {**_llama_like_hf(cfg, model_type, GEMMA_ARCHITECTURES[model_type]),
           "attention_bias": cfg.qkv_bias, "hidden_activation" if gemma2 else "hidden_act": GPT_ACTIVATION_NAMES[cfg.activation]}
    if gemma2:
        windows = cfg.sliding_layers or (True,) * cfg.n_layers
        out.update(query_pre_attn_scalar=cfg.d_head if cfg.attn_scale_dim is None else cfg.attn_scale_dim,
                   attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.logit_softcap,
                   sliding_window=cfg.sliding_window,
                   layer_types=["sliding_attention" if cfg.sliding_window is not None and w else "full_attention" for w in windows])
    return out


def _norm_weights_offset(params: dict[str, torch.Tensor], offset: float) -> dict[str, torch.Tensor]:
    """Gemma's norms multiply by 1 + w and store w; probe's multiply by w. Every `.w` is a norm weight; in float32,
    as Gemma adds the 1 (its norms keep w in float32, see RMSNormFloat32)."""
    return {k: v.float() + offset if k.endswith(".w") else v for k, v in params.items()}


def gemma_to_probe(source: Source, cfg: DecoderConfig, norms: Optional[dict[str, str]] = None) -> dict[str, torch.Tensor]:
    return _norm_weights_offset(llama_to_probe(source, cfg, norms=norms), 1.0)


def gemma_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig,
                norms: Optional[dict[str, str]] = None) -> dict[str, torch.Tensor]:
    return llama_to_hf(_norm_weights_offset(params, -1.0), cfg, norms=norms)
