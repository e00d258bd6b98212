"""OPT checkpoints (Meta's OPT-125m ... 66b): config.json <-> DecoderConfig, tensor names and layouts.

GPT-2's block with separate q/k/v/out nn.Linear layers and ReLU. Three things of OPT's own:
- the learned position table has two extra rows in front (OPT offsets position ids by 2; the rows are reached only
  by padding), dropped on loading and written back as zeros, as transformer-lens drops them;
- positions count real tokens (transformers numbers them by the attention mask's running sum), which is what
  probe does for any padded batch;
- a `word_embed_proj_dim` narrower than the residual (OPT-350m) adds `project_in` after the embedding and
  `project_out` before the head: both are linear, so they are folded into the embedding and the unembedding
  (untied, [vocab d_model]); `hook_embed` is then the projected embedding.
"""
from __future__ import annotations

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
