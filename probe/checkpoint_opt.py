"""OPT checkpoints (Meta's OPT-125m ... 66b) and XGLM's (xglm-564M ... 7.5B, OPT's names): config.json <->
DecoderConfig, tensor names and layouts.

GPT-2's block with separate q/k/v/out nn.Linear layers and ReLU. Three things of OPT's own:
- the learned position table has two extra rows in front (OPT offsets position ids by 2; the rows are reached only
  by padding), dropped on loading and written back as zeros, as transformer-lens drops them;
- positions count real tokens (transformers numbers them by the attention mask's running sum), which is what
  probe does for any padded batch;
- a `word_embed_proj_dim` narrower than the residual (OPT-350m) adds `project_in` after the embedding and
  `project_out` before the head: both are linear, so they are folded into the embedding and the unembedding
  (untied, [vocab d_model]); `hook_embed` is then the projected embedding.

XGLM has OPT's block and tensor names (its final norm `layer_norm`), exact GELU, the token embeddings times
sqrt(d_model) (`scale_embedding`: scale_embed) and fairseq's fixed sinusoids for positions, which no file holds:
sin over the first half of each row, cos over the second, frequencies 10000^(-i / (half - 1)), rows offset by 2 as
OPT's. They are computed on loading into pos_embed.W_pos (a table like any learned one), and saving asks that they
are still those sinusoids.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, GPT_ACTIVATIONS, Source, activation_of, require_fields,
                                     split_qkv, take_qkv, take_unembed)
from probe.config import DecoderConfig, Norm, NormPlacement, Positions
from probe.tokenizer import Tokenizer

POSITION_OFFSET = 2  # transformers' OPTLearnedPositionalEmbedding.offset


def _projection_width(hf: dict) -> int:
    return hf.get("word_embed_proj_dim") or hf["hidden_size"]


def opt_config(hf: dict) -> DecoderConfig:
    before = hf.get("do_layer_norm_before", True)
    bias = hf.get("enable_bias", True)
    return DecoderConfig(
        n_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
        d_mlp=hf["ffn_dim"], d_vocab=hf["vocab_size"], n_ctx=hf["max_position_embeddings"],
        eps=1e-5,  # OPT's nn.LayerNorm default; config.json has no field for it
        activation=activation_of(hf.get("activation_function", "relu"), GPT_ACTIVATIONS),
        norm_placement=NormPlacement.PRE if before else NormPlacement.POST,
        final_norm=before and not hf.get("_remove_final_layer_norm", False),
        norm_weights=hf.get("layer_norm_elementwise_affine", True), qkv_bias=bias, out_bias=bias, mlp_bias=bias,
        # a projected embedding is folded into two different matrices (see the module's docstring)
        tied_embeddings=hf.get("tie_word_embeddings", True) and _projection_width(hf) == hf["hidden_size"],
    )


def opt_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    pre = cfg.norm_placement is NormPlacement.PRE
    require_fields(cfg, "OPT", heads_per_layer=None, norm=Norm.LAYER, norm_placement={NormPlacement.PRE, NormPlacement.POST},
                   positions=Positions.LEARNED, gated_mlp=False, n_kv_heads=cfg.n_heads, d_head=cfg.d_model // cfg.n_heads,
                   qkv_bias=cfg.mlp_bias, out_bias=cfg.mlp_bias, final_norm={False, True} if pre else False,
                   norm_weights={False, True})
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise ValueError("an OPT checkpoint needs n_heads * d_head == d_model")
    special = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else cfg.d_vocab - 1
    pad = tokenizer.pad_id if tokenizer is not None and tokenizer.pad_id is not None else special
    return {
        "model_type": "opt", "architectures": ["OPTForCausalLM"], "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.d_model, "word_embed_proj_dim": cfg.d_model, "num_attention_heads": cfg.n_heads,
        "ffn_dim": cfg.d_mlp, "vocab_size": cfg.d_vocab, "max_position_embeddings": cfg.n_ctx,
        "activation_function": GPT_ACTIVATION_NAMES[cfg.activation], "do_layer_norm_before": pre,
        "_remove_final_layer_norm": pre and not cfg.final_norm, "layer_norm_elementwise_affine": cfg.norm_weights,
        "enable_bias": cfg.mlp_bias, "tie_word_embeddings": cfg.tied_embeddings,
        "bos_token_id": special, "eos_token_id": special, "pad_token_id": pad,
    }


def _names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape) for every tensor but the embeddings; weights stored [out, in] as ours."""
    d, m = cfg.d_model, cfg.d_mlp
    table = {}
    if cfg.final_norm and cfg.norm_weights:
        table.update({"ln_final.w": ("final_layer_norm.weight", (d,)), "ln_final.b": ("final_layer_norm.bias", (d,))})
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"layers.{l}"
        if cfg.norm_weights:
            for ours, theirs in (("ln1", "self_attn_layer_norm"), ("ln2", "final_layer_norm")):
                table.update({f"{o}.{ours}.w": (f"{t}.{theirs}.weight", (d,)), f"{o}.{ours}.b": (f"{t}.{theirs}.bias", (d,))})
        table.update({f"{o}.attn.out.weight": (f"{t}.self_attn.out_proj.weight", (d, d)),
                      f"{o}.mlp.fc_in.weight": (f"{t}.fc1.weight", (m, d)),
                      f"{o}.mlp.fc_out.weight": (f"{t}.fc2.weight", (d, m))})
        if cfg.mlp_bias:
            table.update({f"{o}.attn.out.bias": (f"{t}.self_attn.out_proj.bias", (d,)),
                          f"{o}.mlp.fc_in.bias": (f"{t}.fc1.bias", (m,)), f"{o}.mlp.fc_out.bias": (f"{t}.fc2.bias", (d,))})
    return table


def opt_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    d, width = cfg.d_model, _projection_width(source.config)
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in _names(cfg).items()}
    for l in range(cfg.n_layers):
        out.update(take_qkv(source, cfg, l, lambda p, kind, l=l: f"layers.{l}.self_attn.{p}_proj.{kind}", cfg.qkv_bias))
    out["pos_embed.W_pos"] = source.take("embed_positions.weight", (cfg.n_ctx + POSITION_OFFSET, d))[POSITION_OFFSET:]
    out["embed.W_E"] = source.take("embed_tokens.weight", (cfg.d_vocab, width))
    if width == d:
        out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
        return out
    head = take_unembed(source, cfg, out["embed.W_E"], tied=source.config.get("tie_word_embeddings", True))
    project_in, project_out = source.take("project_in.weight", (d, width)), source.take("project_out.weight", (width, d))
    # folded in float64 and rounded once, so the product is as exact as the file's dtype allows
    out["embed.W_E"] = (out["embed.W_E"].double() @ project_in.double().T).to(project_in.dtype)
    out["unembed.weight"] = (head.double() @ project_out.double()).to(project_out.dtype)
    return out


def opt_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {f"model.decoder.{theirs}": params[ours] for ours, (theirs, _) in _names(cfg).items()}
    for l in range(cfg.n_layers):
        out.update(split_qkv(params, cfg, l, lambda p, kind, l=l: f"model.decoder.layers.{l}.self_attn.{p}_proj.{kind}",
                             cfg.qkv_bias))
    pos = params["pos_embed.W_pos"]
    out["model.decoder.embed_positions.weight"] = torch.cat([pos.new_zeros(POSITION_OFFSET, cfg.d_model), pos])
    out["model.decoder.embed_tokens.weight"] = params["embed.W_E"]
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}


# ---- XGLM ---------------------------------------------------------------------------------------------------------
XGLM_NAMES = {"final_layer_norm.weight": "layer_norm.weight", "final_layer_norm.bias": "layer_norm.bias"}


def xglm_positions(n_ctx: int, d_model: int) -> torch.Tensor:
    """[n_ctx d_model]: fairseq's sinusoids for positions 0 .. n_ctx - 1 (its table's rows 2 on), in float32."""
    half = d_model // 2
    rates = torch.exp(torch.arange(half, dtype=torch.int64).float() * -(math.log(10000) / (half - 1)))
    angles = torch.arange(POSITION_OFFSET, n_ctx + POSITION_OFFSET, dtype=torch.int64).float()[:, None] * rates[None]
    table = torch.cat([angles.sin(), angles.cos()], dim=1)
    return torch.cat([table, table.new_zeros(n_ctx, d_model % 2)], dim=1)  # an odd width's last column is 0


def xglm_config(hf: dict) -> DecoderConfig:
    return DecoderConfig(
        n_layers=hf["num_layers"], d_model=hf["d_model"], n_heads=hf["attention_heads"], d_mlp=hf["ffn_dim"],
        d_vocab=hf["vocab_size"], n_ctx=hf["max_position_embeddings"], eps=1e-5,  # nn.LayerNorm's default
        activation=activation_of(hf.get("activation_function", "gelu"), GPT_ACTIVATIONS),
        scale_embed=hf.get("scale_embedding", True), tied_embeddings=hf.get("tie_word_embeddings", True))


def xglm_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    require_fields(cfg, "xglm", heads_per_layer=None, norm=Norm.LAYER, norm_placement=NormPlacement.PRE,
                   positions=Positions.LEARNED, gated_mlp=False, n_kv_heads=cfg.n_heads, d_head=cfg.d_model // cfg.n_heads,
                   qkv_bias=True, out_bias=True, mlp_bias=True, final_norm=True, eps=1e-5, scale_embed={False, True})
    ids = {kind: getattr(tokenizer, f"{kind}_id", None) if tokenizer is not None else None for kind in ("bos", "eos", "pad")}
    return {
        "model_type": "xglm", "architectures": ["XGLMForCausalLM"], "num_layers": cfg.n_layers, "d_model": cfg.d_model,
        "attention_heads": cfg.n_heads, "ffn_dim": cfg.d_mlp, "vocab_size": cfg.d_vocab,
        "max_position_embeddings": cfg.n_ctx, "activation_function": GPT_ACTIVATION_NAMES[cfg.activation],
        "scale_embedding": cfg.scale_embed, "tie_word_embeddings": cfg.tied_embeddings,
        **{f"{kind}_token_id": value for kind, value in ids.items()},
    }


def xglm_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {ours: source.take(XGLM_NAMES.get(theirs, theirs), shape) for ours, (theirs, shape) in _names(cfg).items()}
    for l in range(cfg.n_layers):
        out.update(take_qkv(source, cfg, l, lambda p, kind, l=l: f"layers.{l}.self_attn.{p}_proj.{kind}", True))
    out["embed.W_E"] = source.take("embed_tokens.weight", (cfg.d_vocab, cfg.d_model))
    out["pos_embed.W_pos"] = xglm_positions(cfg.n_ctx, cfg.d_model).to(out["embed.W_E"])
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    return out


def xglm_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    held = params["pos_embed.W_pos"]
    if not torch.equal(held, xglm_positions(cfg.n_ctx, cfg.d_model).to(held)):
        raise ValueError("an XGLM checkpoint's positions are fixed sinusoids, which transformers computes rather than "
                         "reads, but this model's pos_embed.W_pos differs from them; save model.state_dict() with "
                         "safetensors instead")
    out = {f"model.{XGLM_NAMES.get(theirs, theirs)}": params[ours] for ours, (theirs, _) in _names(cfg).items()}
    for l in range(cfg.n_layers):
        out.update(split_qkv(params, cfg, l, lambda p, kind, l=l: f"model.layers.{l}.self_attn.{p}_proj.{kind}", True))
    out["model.embed_tokens.weight"] = params["embed.W_E"]
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}
