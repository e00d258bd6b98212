"""ModernBERT decoder checkpoints (`modernbert-decoder`, ModernBertDecoderForCausalLM: the Ettin decoders,
jhu-clsp/ettin-decoder-17m ... -1b): ModernBERT's layers run causally. config.json <-> DecoderConfig and the tensors.

What sets it apart, and where probe has it:
- the token embeddings pass a LayerNorm of their own (`embeddings.norm`: embed_norm, `embed.ln`), and layer 0's
  attention reads the residual without a norm of its own (its attn_norm is an identity: first_ln1=False, so
  blocks.0.ln1 is a NoNorm, its hook_scale ones);
- q, k and v apart, and `Wi` one projection holding the gated MLP's two halves: act(first half) * second half, so the
  first is probe's gate and the second its fc_in;
- every `global_attn_every_n_layers`-th layer from layer 0 a full one, the others windowed; transformers' window is
  half of config.json's `local_attention` (each query sees local_attention // 2 keys, itself included), and each kind
  rotates by its own base (rope_parameters per kind, or older files' global_rope_theta / local_rope_theta);
- after the final norm a prediction head, dense -> classifier_activation -> LayerNorm (`lm_head`: probe's
  unembed.head, probe.prediction_head), then the `decoder` (W_U, tied to the embedding by default, with a bias
  where decoder_bias says);
- every LayerNorm has a bias only where norm_bias says; probe's get zeros otherwise, and saving checks they still are.
"""
from __future__ import annotations

from typing import Optional

import torch

from probe.checkpoint_rope import LAYER_KINDS, rope_by_layer_kind
from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, GPT_ACTIVATIONS, Source, activation_of, require_fields,
                                     special_token_ids, take_unembed)
from probe.config import DecoderConfig, Norm, NormPlacement, Positions
from probe.config_file import CheckpointError
from probe.config_head import PredictionHead
from probe.tokenizer import Tokenizer

# transformers' ModernBertDecoderConfig defaults for what a config.json may leave out
DEFAULTS = {"vocab_size": 50368, "hidden_size": 768, "intermediate_size": 1152, "num_hidden_layers": 22,
            "num_attention_heads": 12, "hidden_activation": "gelu", "max_position_embeddings": 8192, "norm_eps": 1e-5,
            "norm_bias": False, "attention_bias": False, "mlp_bias": False, "decoder_bias": True,
            "classifier_bias": False, "classifier_activation": "gelu", "local_attention": 128,
            "tie_word_embeddings": True, "global_attn_every_n_layers": 3}
DEFAULT_PAD = 50283  # transformers' pad_token_id for the family


def modernbert_decoder_config(hf: dict) -> DecoderConfig:
    f = {**DEFAULTS, **hf}
    n_layers, every = f["num_hidden_layers"], f["global_attn_every_n_layers"]
    kinds = f.get("layer_types") or [LAYER_KINDS[1] if layer % every == 0 else LAYER_KINDS[0] for layer in range(n_layers)]
    if len(kinds) != n_layers or set(kinds) - set(LAYER_KINDS):
        raise CheckpointError(f"layer_types must give each of the num_hidden_layers={n_layers} layers one of "
                              f"{', '.join(LAYER_KINDS)}; got {kinds}")
    # transformers' window is half the file's local_attention (ModernBERT's encoders look local_attention // 2
    # either side; the decoders keep the half, looking back only)
    window = f["local_attention"] // 2 if f["local_attention"] else None
    sliding = tuple(kind == LAYER_KINDS[0] for kind in kinds)
    full, local, scaling = rope_by_layer_kind({**f, "rope_theta": f.get("global_rope_theta", 160_000.0)},
                                              160_000.0, f.get("local_rope_theta", 10_000.0))
    windowed = window is not None and any(sliding)
    return DecoderConfig(
        n_layers=n_layers, d_model=f["hidden_size"], n_heads=f["num_attention_heads"], d_vocab=f["vocab_size"],
        n_ctx=f["max_position_embeddings"], d_mlp=f["intermediate_size"], eps=f["norm_eps"],
        activation=activation_of(f["hidden_activation"], GPT_ACTIVATIONS), gated_mlp=True, norm=Norm.LAYER,
        norm_placement=NormPlacement.PRE, positions=Positions.ROTARY, embed_norm=True, first_ln1=False,
        rotary_base=float(full["rope_theta"]), rotary_scaling=scaling,
        sliding_window=window if windowed else None, sliding_layers=sliding if windowed else None,
        sliding_rotary_base=float(local["rope_theta"]) if windowed else None,
        qkv_bias=f["attention_bias"], out_bias=f["attention_bias"], mlp_bias=f["mlp_bias"],
        tied_embeddings=f["tie_word_embeddings"], unembed_bias=f["decoder_bias"],
        prediction_head=PredictionHead(activation=activation_of(f["classifier_activation"], GPT_ACTIVATIONS).value,
                                       bias=f["classifier_bias"]),
    )


def modernbert_decoder_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    if cfg.prediction_head is None:
        raise ValueError("a modernbert-decoder checkpoint has a prediction head before its decoder; this model has none "
                         "(prediction_head=None): save it in another format")
    windowed = cfg.sliding_window is not None
    require_fields(cfg, "ModernBERT decoder", norm=Norm.LAYER, norm_placement=NormPlacement.PRE, final_norm=True,
                   positions=Positions.ROTARY, rotary_dim=cfg.d_head, gated_mlp=True, embed_norm=True, first_ln1=False,
                   n_kv_heads=cfg.n_heads, heads_per_layer=None, out_bias=cfg.qkv_bias, unembed_bias=cfg.unembed_bias,
                   d_head=cfg.d_model // cfg.n_heads, attn_only=False, sliding_window=cfg.sliding_window,
                   sliding_layers=cfg.sliding_layers, sliding_rotary_base=cfg.sliding_rotary_base,
                   activation=set(GPT_ACTIVATION_NAMES))
    full = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rotary_scaling is not None:
        raise ValueError("a modernbert-decoder checkpoint rescales its two kinds of layers alike, which probe's "
                         "rotary_scaling (the full layers' alone) does not say: save with safetensors instead")
    kinds = [LAYER_KINDS[0] if cfg.layer_window(layer) is not None else LAYER_KINDS[1] for layer in range(cfg.n_layers)]
    return {
        "model_type": "modernbert-decoder", "architectures": ["ModernBertDecoderForCausalLM"],
        "vocab_size": cfg.d_vocab, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "hidden_activation": GPT_ACTIVATION_NAMES[cfg.activation], "max_position_embeddings": cfg.n_ctx,
        "norm_eps": cfg.eps, "norm_bias": True, "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias,
        "decoder_bias": cfg.unembed_bias, "classifier_bias": cfg.prediction_head.bias,
        "classifier_activation": GPT_ACTIVATION_NAMES[cfg.prediction_head.act],
        "local_attention": 2 * cfg.sliding_window if windowed else None, "layer_types": kinds,
        "tie_word_embeddings": cfg.tied_embeddings,
        "rope_parameters": {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": cfg.sliding_rotary_base or cfg.rotary_base}},
        **_token_ids(cfg, tokenizer),
    }


def _token_ids(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    """The tokenizer's special ids. transformers' config class takes no None for them, and makes the padding id the
    embedding's padding_idx, which must lie inside the vocabulary: without one, its default (50283) where it does,
    else 0 (the padding row only stops gradients, so any row gives the same forward)."""
    ids = {k: v for k, v in special_token_ids(tokenizer).items() if v is not None}
    ids.setdefault("pad_token_id", DEFAULT_PAD if DEFAULT_PAD < cfg.d_vocab else 0)
    return ids


def _norms(cfg: DecoderConfig) -> dict[str, str]:
    """Every LayerNorm, ours -> theirs (after the `model.` prefix)."""
    norms = {"embed.ln": "embeddings.norm", "ln_final": "final_norm", "unembed.head.ln": "lm_head.norm"}
    for layer in range(cfg.n_layers):
        if layer:  # (layer 0's attention norm is an identity: first_ln1)
            norms[f"blocks.{layer}.ln1"] = f"layers.{layer}.attn_norm"
        norms[f"blocks.{layer}.ln2"] = f"layers.{layer}.mlp_norm"
    return norms


def modernbert_decoder_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    d, d_mlp = cfg.d_model, cfg.d_mlp
    out = {"embed.W_E": source.take("embeddings.tok_embeddings.weight", (cfg.d_vocab, d))}
    norm_bias = "final_norm.bias" in source.state
    for ours, theirs in _norms(cfg).items():
        out[f"{ours}.w"] = source.take(f"{theirs}.weight", (d,))
        # zeros where the file's norms have no bias (norm_bias false): probe's LayerNorms always add one
        out[f"{ours}.b"] = source.take(f"{theirs}.bias", (d,)) if norm_bias else torch.zeros_like(out[f"{ours}.w"])
    for layer in range(cfg.n_layers):
        o, t = f"blocks.{layer}", f"layers.{layer}"
        out[f"{o}.attn.qkv.weight"] = torch.cat([source.take(f"{t}.attn.{p}_proj.weight", (d, d)) for p in "qkv"])
        out[f"{o}.attn.out.weight"] = source.take(f"{t}.attn.Wo.weight", (d, d))
        if cfg.qkv_bias:
            out[f"{o}.attn.qkv.bias"] = torch.cat([source.take(f"{t}.attn.{p}_proj.bias", (d,)) for p in "qkv"])
            out[f"{o}.attn.out.bias"] = source.take(f"{t}.attn.Wo.bias", (d,))
        # act(first half) * second half: the first half is the activated one, probe's gate
        out[f"{o}.mlp.gate.weight"], out[f"{o}.mlp.fc_in.weight"] = source.take(f"{t}.mlp.Wi.weight", (2 * d_mlp, d)).chunk(2)
        out[f"{o}.mlp.fc_out.weight"] = source.take(f"{t}.mlp.Wo.weight", (d, d_mlp))
        if cfg.mlp_bias:
            out[f"{o}.mlp.gate.bias"], out[f"{o}.mlp.fc_in.bias"] = source.take(f"{t}.mlp.Wi.bias", (2 * d_mlp,)).chunk(2)
            out[f"{o}.mlp.fc_out.bias"] = source.take(f"{t}.mlp.Wo.bias", (d,))
    out["unembed.head.dense.weight"] = source.take("lm_head.dense.weight", (d, d))
    if cfg.prediction_head.bias:
        out["unembed.head.dense.bias"] = source.take("lm_head.dense.bias", (d,))
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"], names=("decoder.weight",))
    if cfg.unembed_bias:
        out["unembed.bias"] = source.take("decoder.bias", (cfg.d_vocab_out,))
    return {k: v.contiguous() for k, v in out.items()}


def modernbert_decoder_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {"model.embeddings.tok_embeddings.weight": params["embed.W_E"]}
    for ours, theirs in _norms(cfg).items():  # (saved with biases: norm_bias true)
        out[f"model.{theirs}.weight"], out[f"model.{theirs}.bias"] = params[f"{ours}.w"], params[f"{ours}.b"]
    for layer in range(cfg.n_layers):
        o, t = f"blocks.{layer}", f"model.layers.{layer}"
        for p, w in zip("qkv", params[f"{o}.attn.qkv.weight"].chunk(3)):
            out[f"{t}.attn.{p}_proj.weight"] = w
        out[f"{t}.attn.Wo.weight"] = params[f"{o}.attn.out.weight"]
        if cfg.qkv_bias:
            for p, b in zip("qkv", params[f"{o}.attn.qkv.bias"].chunk(3)):
                out[f"{t}.attn.{p}_proj.bias"] = b
            out[f"{t}.attn.Wo.bias"] = params[f"{o}.attn.out.bias"]
        out[f"{t}.mlp.Wi.weight"] = torch.cat([params[f"{o}.mlp.gate.weight"], params[f"{o}.mlp.fc_in.weight"]])
        out[f"{t}.mlp.Wo.weight"] = params[f"{o}.mlp.fc_out.weight"]
        if cfg.mlp_bias:
            out[f"{t}.mlp.Wi.bias"] = torch.cat([params[f"{o}.mlp.gate.bias"], params[f"{o}.mlp.fc_in.bias"]])
            out[f"{t}.mlp.Wo.bias"] = params[f"{o}.mlp.fc_out.bias"]
    out["lm_head.dense.weight"] = params["unembed.head.dense.weight"]
    if cfg.prediction_head.bias:
        out["lm_head.dense.bias"] = params["unembed.head.dense.bias"]
    if not cfg.tied_embeddings:
        out["decoder.weight"] = params["unembed.weight"]
    if cfg.unembed_bias:
        out["decoder.bias"] = params["unembed.bias"]
    return {k: v.contiguous() for k, v in out.items()}
