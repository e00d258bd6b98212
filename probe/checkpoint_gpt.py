"""GPT-2, GPT-1 and GPT-NeoX (Pythia) checkpoints: config.json <-> DecoderConfig, tensor names and layouts."""
from __future__ import annotations

import math
from typing import Optional

import torch

from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, GPT_ACTIVATIONS, Source, activation_of, grouped_qkv,
                                     require_fields, rope_from_hf, rope_to_hf, take_unembed)
from probe.config import Activation, DecoderConfig, Norm, NormPlacement, Positions
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer


# ---- GPT-2 and GPT-1: Conv1D layers, stored [in, out] -----------------------------------------
def gpt2_config(hf: dict) -> DecoderConfig:
    if not hf.get("scale_attn_weights", True):
        raise CheckpointError("scale_attn_weights=false is not supported")
    heads = hf.get("heads_per_layer")  # written by probe for structurally pruned models
    return DecoderConfig(
        n_layers=hf["n_layer"], d_model=hf["n_embd"], n_heads=hf["n_head"], d_mlp=hf.get("n_inner") or 4 * hf["n_embd"],
        d_vocab=hf["vocab_size"], n_ctx=hf["n_positions"], eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=activation_of(hf.get("activation_function", "gelu_new"), GPT_ACTIVATIONS),
        tied_embeddings=hf.get("tie_word_embeddings", True), heads_per_layer=None if heads is None else tuple(heads),
        # Stanford CRFM's runs (reorder_and_upcast_attn too, which only computes the same scores in float32)
        attn_scale_by_layer=bool(hf.get("scale_attn_by_inverse_layer_idx", False)),
    )


def gpt1_config(hf: dict) -> DecoderConfig:
    return DecoderConfig(
        n_layers=hf["n_layer"], d_model=hf["n_embd"], n_heads=hf["n_head"], d_vocab=hf["vocab_size"],
        n_ctx=hf["n_positions"], eps=hf.get("layer_norm_epsilon", 1e-5),
        # GPT-1's "gelu" is the tanh approximation (transformers maps it to gelu_new)
        activation=activation_of(hf.get("afn", "gelu"), {**GPT_ACTIVATIONS, "gelu": Activation.GELU_TANH}),
        norm_placement=NormPlacement.POST, final_norm=False, tied_embeddings=hf.get("tie_word_embeddings", True),
    )


def gpt2_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    require_fields(cfg, "GPT-2", norm=Norm.LAYER, norm_placement=NormPlacement.PRE, final_norm=True, positions=Positions.LEARNED,
                   attn_scale_by_layer={False, True},
                   gated_mlp=False, n_kv_heads=cfg.n_heads, d_head=cfg.d_model // cfg.n_heads, qkv_bias=True, out_bias=True,
                   mlp_bias=True)
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise ValueError("a GPT-2 checkpoint needs n_heads * d_head == d_model")
    special = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else cfg.d_vocab - 1
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": cfg.n_layers, "n_embd": cfg.d_model,
        "n_head": cfg.n_heads, "n_inner": cfg.d_mlp, "vocab_size": cfg.d_vocab, "n_positions": cfg.n_ctx,
        "layer_norm_epsilon": cfg.eps, "activation_function": GPT_ACTIVATION_NAMES[cfg.activation],
        "bos_token_id": special, "eos_token_id": special, "tie_word_embeddings": cfg.tied_embeddings,
        "scale_attn_by_inverse_layer_idx": cfg.attn_scale_by_layer,
        # transformers cannot load a pruned model (its layers differ in width); probe can
        **({"heads_per_layer": list(cfg.heads_per_layer)} if cfg.heads_per_layer is not None else {}),
    }


def _gpt_names(embed: str, pos: str, final_norm: bool):
    def names(cfg: DecoderConfig):
        d, m, v = cfg.d_model, cfg.d_mlp, cfg.d_vocab
        # ours -> (theirs, their shape, stored transposed)
        table = {"embed.W_E": (embed, (v, d), False), "pos_embed.W_pos": (pos, (cfg.n_ctx, d), False)}
        for l in range(cfg.n_layers):
            o, t, a = f"blocks.{l}", f"h.{l}", cfg.layer_heads(l) * cfg.d_head  # a: this layer's attention width
            table.update({
                f"{o}.ln1.w": (f"{t}.ln_1.weight", (d,), False), f"{o}.ln1.b": (f"{t}.ln_1.bias", (d,), False),
                f"{o}.attn.qkv.weight": (f"{t}.attn.c_attn.weight", (d, 3 * a), True),
                f"{o}.attn.qkv.bias": (f"{t}.attn.c_attn.bias", (3 * a,), False),
                f"{o}.attn.out.weight": (f"{t}.attn.c_proj.weight", (a, d), True),
                f"{o}.attn.out.bias": (f"{t}.attn.c_proj.bias", (d,), False),
                f"{o}.ln2.w": (f"{t}.ln_2.weight", (d,), False), f"{o}.ln2.b": (f"{t}.ln_2.bias", (d,), False),
                f"{o}.mlp.fc_in.weight": (f"{t}.mlp.c_fc.weight", (d, m), True),
                f"{o}.mlp.fc_in.bias": (f"{t}.mlp.c_fc.bias", (m,), False),
                f"{o}.mlp.fc_out.weight": (f"{t}.mlp.c_proj.weight", (m, d), True),
                f"{o}.mlp.fc_out.bias": (f"{t}.mlp.c_proj.bias", (d,), False),
            })
        if final_norm:
            table.update({"ln_final.w": ("ln_f.weight", (d,), False), "ln_final.b": ("ln_f.bias", (d,), False)})
        return table

    return names


def gpt_to_probe(names):
    def convert(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        out = {}
        for ours, (theirs, shape, transposed) in names(cfg).items():
            tensor = source.take(theirs, shape)
            # a transposed Conv1D weight stays a view: F.linear on it reads the stored layout directly
            out[ours] = tensor.T if transposed else tensor
        # tied unless config.json says tie_word_embeddings=false; then the head is lm_head.weight, beside `transformer.`
        out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
        return out

    return convert


def gpt_to_hf(names):
    def convert(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        out = {theirs: (params[ours].T if transposed else params[ours]).contiguous()
               for ours, (theirs, _, transposed) in names(cfg).items()}
        if not cfg.tied_embeddings:
            out["lm_head.weight"] = params["unembed.weight"].contiguous()
        return out

    return convert


gpt2_names = _gpt_names("wte.weight", "wpe.weight", final_norm=True)
gpt1_names = _gpt_names("tokens_embed.weight", "positions_embed.weight", final_norm=False)


def gpt1_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    require_fields(cfg, "GPT-1", heads_per_layer=None, norm=Norm.LAYER, norm_placement=NormPlacement.POST, final_norm=False, positions=Positions.LEARNED,
                   gated_mlp=False, n_kv_heads=cfg.n_heads, qkv_bias=True, out_bias=True, mlp_bias=True)
    afn = {Activation.GELU_TANH: "gelu", Activation.RELU: "relu", Activation.SILU: "silu"}
    if cfg.activation not in afn:
        raise ValueError(f"a GPT-1 checkpoint cannot hold activation={cfg.activation.value}")
    return {"model_type": "openai-gpt", "architectures": ["OpenAIGPTLMHeadModel"], "n_layer": cfg.n_layers, "n_embd": cfg.d_model,
            "n_head": cfg.n_heads, "vocab_size": cfg.d_vocab, "n_positions": cfg.n_ctx, "afn": afn[cfg.activation],
            "layer_norm_epsilon": cfg.eps, "tie_word_embeddings": cfg.tied_embeddings}


# ---- GPT-NeoX (Pythia): nn.Linear layers; q, k, v fused and interleaved per head ---------------------
def neox_config(hf: dict) -> DecoderConfig:
    rope, scaling = rope_from_hf(hf)
    n_heads, d_model = hf["num_attention_heads"], hf["hidden_size"]
    d_head = d_model // n_heads
    # older config files (every Pythia on the hub) say rotary_pct / rotary_emb_base; transformers 5 writes rope_parameters
    fraction = rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))  # transformers' default: a quarter
    bias = hf.get("attention_bias", True)
    heads = hf.get("heads_per_layer")  # written by probe for structurally pruned models
    return DecoderConfig(
        n_layers=hf["num_hidden_layers"], d_model=d_model, n_heads=n_heads, d_mlp=hf["intermediate_size"],
        d_vocab=hf["vocab_size"], n_ctx=hf["max_position_embeddings"], eps=hf.get("layer_norm_eps", 1e-5),
        activation=activation_of(hf.get("hidden_act", "gelu"), GPT_ACTIVATIONS),
        norm_placement=NormPlacement.PARALLEL if hf.get("use_parallel_residual", True) else NormPlacement.PRE,
        positions=Positions.ROTARY, rotary_dim=int(d_head * fraction),
        rotary_base=float(rope.get("rope_theta", hf.get("rotary_emb_base", 10000.0))), rotary_scaling=scaling,
        qkv_bias=bias, out_bias=bias, tied_embeddings=hf.get("tie_word_embeddings", False),
        heads_per_layer=None if heads is None else tuple(heads),
    )


def neox_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    require_fields(cfg, "GPT-NeoX", norm_placement={NormPlacement.PRE, NormPlacement.PARALLEL}, norm=Norm.LAYER, final_norm=True, positions=Positions.ROTARY,
                   gated_mlp=False, n_kv_heads=cfg.n_heads, d_head=cfg.d_model // cfg.n_heads, out_bias=cfg.qkv_bias,
                   mlp_bias=True)
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise ValueError("a GPT-NeoX checkpoint needs n_heads * d_head == d_model")
    special = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else 0
    fraction = cfg.rotary_dim / cfg.d_head
    while int(cfg.d_head * fraction) < cfg.rotary_dim:  # transformers truncates d_head * fraction (4 / 49 * 49 < 4)
        fraction = math.nextafter(fraction, 1.0)
    return {
        "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "intermediate_size": cfg.d_mlp,
        "vocab_size": cfg.d_vocab, "max_position_embeddings": cfg.n_ctx, "layer_norm_eps": cfg.eps,
        "hidden_act": GPT_ACTIVATION_NAMES[cfg.activation],
        "use_parallel_residual": cfg.norm_placement is NormPlacement.PARALLEL,
        # both spellings: transformers 5 reads rope_parameters, older versions rotary_pct / rotary_emb_base
        "rotary_pct": fraction, "rotary_emb_base": cfg.rotary_base, **rope_to_hf(cfg, partial_rotary_factor=fraction),
        "attention_bias": cfg.qkv_bias, "tie_word_embeddings": cfg.tied_embeddings,
        "bos_token_id": special, "eos_token_id": special,
        # transformers cannot load a pruned model (its layers differ in width); probe can
        **({"heads_per_layer": list(cfg.heads_per_layer)} if cfg.heads_per_layer is not None else {}),
    }


def _neox_qkv(tensor: torch.Tensor, ours: str, cfg: DecoderConfig, to_probe: bool) -> torch.Tensor:
    """GPT-NeoX stores q, k, v interleaved per head, [(head qkv d_head) ...]; probe stores [(qkv head d_head) ...].
    Other tensors (`ours` names which) pass unchanged."""
    if ".attn.qkv." not in ours:
        return tensor
    heads = cfg.layer_heads(int(ours.split(".")[1]))
    return grouped_qkv(tensor, heads, heads, cfg.d_head, to_probe)


def _neox_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape); every weight stored [out, in] as ours."""
    d, m, v = cfg.d_model, cfg.d_mlp, cfg.d_vocab
    table = {"embed.W_E": ("embed_in.weight", (v, d)), "ln_final.w": ("final_layer_norm.weight", (d,)),
             "ln_final.b": ("final_layer_norm.bias", (d,))}
    for l in range(cfg.n_layers):
        o, t, a = f"blocks.{l}", f"layers.{l}", cfg.layer_heads(l) * cfg.d_head  # a: this layer's attention width
        table.update({
            f"{o}.ln1.w": (f"{t}.input_layernorm.weight", (d,)), f"{o}.ln1.b": (f"{t}.input_layernorm.bias", (d,)),
            f"{o}.ln2.w": (f"{t}.post_attention_layernorm.weight", (d,)),
            f"{o}.ln2.b": (f"{t}.post_attention_layernorm.bias", (d,)),
            f"{o}.attn.qkv.weight": (f"{t}.attention.query_key_value.weight", (3 * a, d)),
            f"{o}.attn.out.weight": (f"{t}.attention.dense.weight", (d, a)),
            f"{o}.mlp.fc_in.weight": (f"{t}.mlp.dense_h_to_4h.weight", (m, d)),
            f"{o}.mlp.fc_in.bias": (f"{t}.mlp.dense_h_to_4h.bias", (m,)),
            f"{o}.mlp.fc_out.weight": (f"{t}.mlp.dense_4h_to_h.weight", (d, m)),
            f"{o}.mlp.fc_out.bias": (f"{t}.mlp.dense_4h_to_h.bias", (d,)),
        })
        if cfg.qkv_bias:
            table[f"{o}.attn.qkv.bias"] = (f"{t}.attention.query_key_value.bias", (3 * a,))
            table[f"{o}.attn.out.bias"] = (f"{t}.attention.dense.bias", (d,))
    return table


def neox_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {}
    for ours, (theirs, shape) in _neox_names(cfg).items():
        out[ours] = _neox_qkv(source.take(theirs, shape), ours, cfg, to_probe=True)
    # GPTNeoXForCausalLM names its head embed_out (every Pythia file); some converted files say lm_head
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"], ("embed_out.weight", "lm_head.weight"))
    return out


def neox_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {f"gpt_neox.{theirs}": _neox_qkv(params[ours], ours, cfg, to_probe=False) for ours, (theirs, _) in _neox_names(cfg).items()}
    if not cfg.tied_embeddings:
        out["embed_out.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}
