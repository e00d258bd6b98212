"""The rotary settings' spellings in config.json (transformers 5's rope_parameters, older files' rope_theta and
rope_scaling) and the layer kinds of models whose sliding and full-attention layers rotate apart (Gemma 2, 3, 4);
probe.checkpoint_source re-exports them for the families."""
from __future__ import annotations

import math
from typing import Optional

from probe.config import DecoderConfig, RotaryScaling
from probe.config_file import CheckpointError


# ---- rotary settings, shared by the rotary families ---------------------------------------------------
def rope_from_hf(hf: dict) -> tuple[dict, Optional[RotaryScaling]]:
    """config.json's rope dict (transformers 5: rope_parameters; older files: rope_scaling, with rope_theta beside
    it) and the frequency rescaling it asks for."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return rope, None
    if kind == "linear":
        return rope, RotaryScaling("linear", float(rope["factor"]))
    if kind == "llama3":
        return rope, RotaryScaling("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                                   float(rope["high_freq_factor"]),
                                   int(rope.get("original_max_position_embeddings") or hf["max_position_embeddings"]))
    if kind == "yarn":
        return rope, _yarn_from_hf(rope, hf)
    if kind == "proportional":  # Gemma 4's full-attention layers
        return rope, RotaryScaling("proportional", float(rope.get("factor", 1.0)),
                                   rotated_fraction=float(rope.get("partial_rotary_factor", 1.0)))
    if kind in ("longrope", "su"):  # ("su": Phi-3's first files' name for it)
        return rope, longrope_from_hf(rope, hf)
    raise CheckpointError(f"rope scaling {kind!r} is not supported; supported: default (none), linear, llama3, yarn, "
                          "proportional, longrope (su)")


def longrope_from_hf(rope: dict, hf: dict) -> RotaryScaling:
    """transformers' reading of a LongRoPE dict: the pretraining context is config.json's own
    original_max_position_embeddings where it has one (Phi-3's files keep it there), else the dict's; a missing factor
    is max_position_embeddings over it, a missing attention_factor sqrt(1 + ln(factor) / ln(original)), or 1 for a
    factor of at most 1. (PhiMoE's short_mscale and long_mscale replace it: probe.checkpoint_phimoe.)"""
    original = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    if not original or "short_factor" not in rope or "long_factor" not in rope:
        raise CheckpointError("a longrope rope dict needs short_factor, long_factor and "
                              "original_max_position_embeddings (in it or beside it in config.json)")
    factor = float(rope.get("factor") or hf["max_position_embeddings"] / original)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RotaryScaling("longrope", factor, original_n_ctx=int(original), attention_factor=float(attention),
                         short_factor=tuple(map(float, rope["short_factor"])),
                         long_factor=tuple(map(float, rope["long_factor"])))


def _yarn_from_hf(rope: dict, hf: dict) -> RotaryScaling:
    """transformers' reading of a YaRN rope dict: a missing factor is max_position_embeddings over the pretraining
    context (DeepSeek's), a missing attention_factor 0.1 ln(factor) + 1 (or the mscale / mscale_all_dim ratio)."""
    original = int(rope.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
                   or hf["max_position_embeddings"])
    factor = float(rope.get("factor") or hf["max_position_embeddings"] / original)

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        weights = (rope.get("mscale"), rope.get("mscale_all_dim"))
        attention = mscale(weights[0]) / mscale(weights[1]) if all(weights) else mscale(1.0)
    return RotaryScaling("yarn", factor, original_n_ctx=original, beta_fast=float(rope.get("beta_fast") or 32),
                         beta_slow=float(rope.get("beta_slow") or 1), attention_factor=float(attention),
                         truncate=bool(rope.get("truncate", True)))


# ---- models whose layers are of two kinds: sliding (windowed) and full attention, each with its own rope -------------
LAYER_KINDS = ("sliding_attention", "full_attention")


def layer_kinds(hf: dict, pattern: int) -> list[str]:
    """Each layer's kind: config.json's layer_types, else every `pattern`-th layer a full one (older files)."""
    n_layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(n_layers)]
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown or len(kinds) != n_layers:
        raise CheckpointError(f"layer_types must give each of the num_hidden_layers={n_layers} layers one of "
                              f"{', '.join(LAYER_KINDS)}; got {len(kinds)} entries{f', naming {unknown}' if unknown else ''}")
    return kinds


def layer_types_to_hf(cfg: DecoderConfig) -> list[str]:
    """config.json's layer_types: each layer's kind, by whether it is windowed."""
    return [LAYER_KINDS[0] if cfg.layer_window(l) is not None else LAYER_KINDS[1] for l in range(cfg.n_layers)]


def rope_by_layer_kind(hf: dict, full_theta: float, sliding_theta: float) -> tuple[dict, dict, Optional[RotaryScaling]]:
    """(the full layers' rope settings, the sliding layers', the full layers' rescaling), from transformers 5's
    per-kind rope_parameters, or an older file's rope_theta and rope_scaling, which are the full layers' (the
    sliding ones then rotate by `sliding_theta`). The sliding layers rotate unscaled (sliding_rotary_base)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, sliding = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full, sliding = {"rope_theta": hf.get("rope_theta", full_theta), **(hf.get("rope_scaling") or {})}, {}
    full.setdefault("rope_theta", full_theta)
    sliding.setdefault("rope_theta", sliding_theta)
    _, scaling = rope_from_hf({"rope_parameters": full, "max_position_embeddings": hf["max_position_embeddings"]})
    if rope_from_hf({"rope_parameters": sliding, "max_position_embeddings": hf["max_position_embeddings"]})[1] is not None:
        raise CheckpointError("a rescaled rope on the sliding layers is not supported (only full layers are rescaled)")
    return full, sliding, scaling


def rope_to_hf(cfg: DecoderConfig, **extra) -> dict:
    """rope_parameters (transformers 5) and, for older versions, rope_theta and rope_scaling beside it."""
    params: dict = {"rope_type": "default", "rope_theta": cfg.rotary_base, **extra}
    scaling = cfg.rotary_scaling
    if scaling is not None:
        params.update(rope_type=scaling.kind, factor=scaling.factor)
        if scaling.kind == "llama3":
            params.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                          original_max_position_embeddings=scaling.original_n_ctx)
        if scaling.kind == "proportional":
            params.update(partial_rotary_factor=scaling.rotated_fraction)
        if scaling.kind == "yarn":
            params.update(original_max_position_embeddings=scaling.original_n_ctx, beta_fast=scaling.beta_fast,
                          beta_slow=scaling.beta_slow, attention_factor=scaling.attention_factor,
                          truncate=scaling.truncate)
        if scaling.kind == "longrope":
            params.update(original_max_position_embeddings=scaling.original_n_ctx, attention_factor=scaling.attention_factor,
                          short_factor=list(scaling.short_factor), long_factor=list(scaling.long_factor))
    out = {"rope_theta": cfg.rotary_base, "rope_parameters": params}
    if scaling is not None:
        out["rope_scaling"] = {k: v for k, v in params.items() if k not in ("rope_theta", *extra)}
    return out
