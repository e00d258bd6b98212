"""Phi checkpoints (Microsoft's phi-1, phi-1.5, phi-2; Phi-3 and phi-4): config.json <-> DecoderConfig, tensor names.

Phi (phi-1 to phi-2): a parallel block as GPT-NeoX's, but with one LayerNorm that attention and the MLP both read:
probe's block has ln1 and ln2, so ln2 is loaded as a copy of ln1 (as transformer-lens loads it) and saving asks that
they still agree. q, k, v are separate biased nn.Linear layers (grouped-query where num_key_value_heads says so),
rotary turns the first partial_rotary_factor of each head (GPT-NeoX's halves), and the unembedding has a bias.

Phi-3 (Phi-3, phi-4): Llama's block with q, k and v fused in one projection (in probe's own order) and the gate and
up projections in another, partial rotary, and a sliding window on every layer where sliding_window says so.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config, llama_to_hf, llama_to_probe
from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, GPT_ACTIVATIONS, Source, activation_of, check_shared_norm,
                                     copy_shared_norm, qkv_rows, require_fields, rope_from_hf, rope_to_hf, split_qkv,
                                     take_qkv, take_unembed, with_defaults, with_fields)
from probe.config import DecoderConfig, Norm, NormPlacement, Positions
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer


def phi_config(hf: dict) -> DecoderConfig:
    if hf.get("qk_layernorm", False):
        raise CheckpointError("qk_layernorm=true (a LayerNorm on each head's q and k) is not supported")
    rope, scaling = rope_from_hf(hf)
    n_heads, d_model = hf["num_attention_heads"], hf["hidden_size"]
    d_head = d_model // n_heads
    # transformers 5 writes partial_rotary_factor into rope_parameters, older files beside it; its default is a half
    fraction = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    return DecoderConfig(
        n_layers=hf["num_hidden_layers"], d_model=d_model, n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, d_mlp=hf["intermediate_size"], d_vocab=hf["vocab_size"],
        n_ctx=hf["max_position_embeddings"], eps=hf.get("layer_norm_eps", 1e-5),
        activation=activation_of(hf.get("hidden_act", "gelu_new"), GPT_ACTIVATIONS),
        norm_placement=NormPlacement.PARALLEL, positions=Positions.ROTARY, rotary_dim=int(d_head * fraction),
        rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), rotary_scaling=scaling,
        unembed_bias=True, tied_embeddings=hf.get("tie_word_embeddings", False),
    )


def phi_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    require_fields(cfg, "Phi", heads_per_layer=None, norm=Norm.LAYER, norm_placement=NormPlacement.PARALLEL, final_norm=True,
                   positions=Positions.ROTARY, gated_mlp=False, d_head=cfg.d_model // cfg.n_heads, qkv_bias=True,
                   out_bias=True, mlp_bias=True, unembed_bias=True)
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise ValueError("a Phi checkpoint needs n_heads * d_head == d_model")
    special = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else cfg.d_vocab - 1
    fraction = cfg.rotary_dim / cfg.d_head
    return {
        "model_type": "phi", "architectures": ["PhiForCausalLM"], "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.d_mlp, "vocab_size": cfg.d_vocab, "max_position_embeddings": cfg.n_ctx,
        "layer_norm_eps": cfg.eps, "hidden_act": GPT_ACTIVATION_NAMES[cfg.activation], "qk_layernorm": False,
        "partial_rotary_factor": fraction, **rope_to_hf(cfg, partial_rotary_factor=fraction),
        "tie_word_embeddings": cfg.tied_embeddings, "bos_token_id": special, "eos_token_id": special,
    }


def _names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape) for every tensor but the fused q/k/v and the shared norm; [out, in] as ours."""
    d, m, a = cfg.d_model, cfg.d_mlp, cfg.n_heads * cfg.d_head
    table = {"embed.W_E": ("embed_tokens.weight", (cfg.d_vocab, d)), "ln_final.w": ("final_layernorm.weight", (d,)),
             "ln_final.b": ("final_layernorm.bias", (d,))}
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"layers.{l}"
        table.update({
            f"{o}.ln1.w": (f"{t}.input_layernorm.weight", (d,)), f"{o}.ln1.b": (f"{t}.input_layernorm.bias", (d,)),
            f"{o}.attn.out.weight": (f"{t}.self_attn.dense.weight", (d, a)),
            f"{o}.attn.out.bias": (f"{t}.self_attn.dense.bias", (d,)),
            f"{o}.mlp.fc_in.weight": (f"{t}.mlp.fc1.weight", (m, d)), f"{o}.mlp.fc_in.bias": (f"{t}.mlp.fc1.bias", (m,)),
            f"{o}.mlp.fc_out.weight": (f"{t}.mlp.fc2.weight", (d, m)), f"{o}.mlp.fc_out.bias": (f"{t}.mlp.fc2.bias", (d,)),
        })
    return table


def phi_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in _names(cfg).items()}
    for l in range(cfg.n_layers):
        out.update(take_qkv(source, cfg, l, lambda p, kind, l=l: f"layers.{l}.self_attn.{p}_proj.{kind}", bias=True))
    copy_shared_norm(out, cfg)
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    out["unembed.bias"] = source.take("lm_head.bias", (cfg.d_vocab,))
    return out


def phi_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    check_shared_norm(params, cfg, "Phi")
    out = {f"model.{theirs}": params[ours] for ours, (theirs, _) in _names(cfg).items()}
    for l in range(cfg.n_layers):
        out.update(split_qkv(params, cfg, l, lambda p, kind, l=l: f"model.layers.{l}.self_attn.{p}_proj.{kind}", bias=True))
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    out["lm_head.bias"] = params["unembed.bias"]
    return {k: v.contiguous() for k, v in out.items()}


# ---- Phi-3 -------------------------------------------------------------------------------------------------
def phi3_config(hf: dict) -> DecoderConfig:
    # transformers' Phi3Config holds a pretraining context of its own, 4096 unless config.json says, and it overrides
    # the rope dict's (LongRoPE's threshold)
    hf = with_defaults(hf, original_max_position_embeddings=4096)
    stored = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if stored.get("rope_type", stored.get("type")) == "yarn":  # (Phi3Config reads "yarn", as "su", for LongRoPE)
        hf = with_fields(hf, rope_parameters={**stored, "rope_type": "longrope"}, rope_scaling=None)
    rope, scaling = rope_from_hf(hf)
    # (Llama's reading without the rescaling, which is checked against the partial rotary width below)
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    base = llama_config(with_fields(hf, rope_parameters={"rope_type": "default", "rope_theta": theta}, rope_scaling=None),
                        qkv_bias=False, default_eps=1e-5)
    fraction = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return dataclasses.replace(base, rotary_dim=int(base.d_head * fraction), sliding_window=hf.get("sliding_window"),
                               mlp_bias=False, rotary_scaling=scaling)


def phi3_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    require_fields(cfg, "Phi-3", heads_per_layer=None, norm=Norm.RMS, norm_placement=NormPlacement.PRE, final_norm=True,
                   positions=Positions.ROTARY, gated_mlp=True, d_head=cfg.d_model // cfg.n_heads, qkv_bias=False,
                   out_bias=False, mlp_bias=False, sliding_window=cfg.sliding_window)
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise ValueError("a Phi-3 checkpoint needs n_heads * d_head == d_model")
    scaling = cfg.rotary_scaling
    if scaling is not None and (scaling.kind != "longrope" or scaling.long_attention_factor is not None):
        raise ValueError(f"a Phi-3 checkpoint rescales its rope by LongRoPE alone, one attention factor for both "
                         f"regimes; this model has rotary_scaling={scaling!r}")
    special = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else cfg.d_vocab - 1
    fraction = cfg.rotary_dim / cfg.d_head
    return {
        **({} if scaling is None else {"original_max_position_embeddings": scaling.original_n_ctx}),
        "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.d_mlp, "vocab_size": cfg.d_vocab, "max_position_embeddings": cfg.n_ctx,
        "rms_norm_eps": cfg.eps, "hidden_act": GPT_ACTIVATION_NAMES[cfg.activation], "sliding_window": cfg.sliding_window,
        "partial_rotary_factor": fraction, **rope_to_hf(cfg, partial_rotary_factor=fraction),
        "tie_word_embeddings": cfg.tied_embeddings, "bos_token_id": special, "eos_token_id": special,
        "pad_token_id": special,
    }


def phi3_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """Llama's conversion, after splitting each fused projection into the separate ones Llama stores."""
    d, m = cfg.d_model, cfg.d_mlp
    for l in range(cfg.n_layers):
        t, rows = f"layers.{l}", qkv_rows(cfg, l)
        qkv = source.take(f"{t}.self_attn.qkv_proj.weight", (sum(rows.values()), d))
        for p, w in zip("qkv", qkv.split(list(rows.values()))):
            source.state[f"{t}.self_attn.{p}_proj.weight"] = w
        gate, up = source.take(f"{t}.mlp.gate_up_proj.weight", (2 * m, d)).chunk(2)  # transformers' chunk: gate first
        source.state[f"{t}.mlp.gate_proj.weight"], source.state[f"{t}.mlp.up_proj.weight"] = gate, up
    return llama_to_probe(source, cfg)


def phi3_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_hf(params, cfg)
    for l in range(cfg.n_layers):
        t = f"model.layers.{l}"
        out[f"{t}.self_attn.qkv_proj.weight"] = torch.cat([out.pop(f"{t}.self_attn.{p}_proj.weight") for p in "qkv"])
        out[f"{t}.mlp.gate_up_proj.weight"] = torch.cat([out.pop(f"{t}.mlp.{p}_proj.weight") for p in ("gate", "up")])
    return out
