"""AI21's Jamba (`jamba`, JambaForCausalLM: Jamba-v0.1, Jamba-1.5-Mini / Large, Jamba Reasoning), a hybrid whose every
layer is x + mixer(input_layernorm(x)), then h + mlp(pre_ff_layernorm(h)), under `model.`:

- the mixer: attention in the layers l with l % attn_layer_period == attn_layer_offset (Llama's projections, grouped
  keys and values, no biases and no positions at all: NoPE), else a Mamba-1 mixer (probe.selective_scan, `mamba` in
  the file, `mixer` here as TL 4's bridge names it) whose step input, B and C pass RMS norms with learned scales
  (`dt_layernorm`, `b_layernorm`, `c_layernorm`, the model's rms_norm_eps), its convolution's activation the model's
  hidden_act (silu, the only one read);
- the MLP (`feed_forward`): in the layers l with l % expert_layer_period == expert_layer_offset, num_experts gated
  experts of intermediate_size (`experts.{e}.gate_proj` / `up_proj` / `down_proj`, or fused) chosen by the top
  num_experts_per_tok of a softmax over every expert's router logit (`router`), their weights never renormalised;
  elsewhere (and everywhere where num_experts is 1: Jamba Reasoning) Llama's gated MLP of intermediate_size.

use_mamba_kernels and use_mambapy pick transformers' implementation, not the model, and are not read."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config
from probe.checkpoint_mamba import attention_to_hf, take_attention
from probe.checkpoint_mamba1 import mamba_names
from probe.checkpoint_moe import expert_names, take_experts
from probe.checkpoint_source import Source, require_fields, special_token_ids, take_unembed, with_defaults
from probe.config import Activation, DecoderConfig, Experts, Norm, NormPlacement, Positions, StateSpace
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

# transformers' JambaConfig defaults for the fields a config.json may leave out (Jamba-v0.1's shape)
DEFAULTS = dict(num_key_value_heads=8, rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=16,
                num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=8,
                attn_layer_offset=4, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank="auto",
                mamba_conv_bias=True, mamba_proj_bias=False, max_position_embeddings=262144, hidden_act="silu")


def every(period: int, offset: int, n: int) -> tuple[bool, ...]:
    """The layers l < n with l % period == offset (Jamba's rule for its attention and its expert layers)."""
    if not (isinstance(period, int) and isinstance(offset, int) and 0 <= offset < period):
        raise CheckpointError(f"a layer period {period!r} with offset {offset!r}: the offset must be an int in "
                              "[0, period)")
    return tuple(l % period == offset for l in range(n))


def period_of(layers: tuple[bool, ...], what: str) -> tuple[int, int]:
    """(period, offset) whose every() is `layers`, the shortest; a pattern no period gives is refused."""
    n = len(layers)
    for period in range(1, n + 2):
        for offset in range(period):
            if every(period, offset, n) == layers:
                return period, offset
    raise ValueError(f"a jamba checkpoint places its {what} every `period` layers from an offset; this model's "
                     f"{what} are in layers {[l for l, x in enumerate(layers) if x]}, which no period gives")


def jamba_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, **DEFAULTS)
    n, d = hf["num_hidden_layers"], hf["hidden_size"]
    if hf["hidden_act"] != "silu":
        raise CheckpointError(f"hidden_act={hf['hidden_act']!r}: Jamba's Mamba convolution takes the model's "
                              "activation, read as silu only")
    attention = every(hf["attn_layer_period"], hf["attn_layer_offset"], n)
    rank = math.ceil(d / 16) if hf["mamba_dt_rank"] == "auto" else int(hf["mamba_dt_rank"])
    space = None if all(attention) else StateSpace(
        layers=tuple(not a for a in attention), n_heads=int(hf["mamba_expand"] * d), d_head=1,
        d_state=hf["mamba_d_state"], conv_kernel=hf["mamba_d_conv"], conv_bias=hf["mamba_conv_bias"],
        proj_bias=hf["mamba_proj_bias"], kind="mamba1", dt_rank=rank, bcdt_norm_eps=hf["rms_norm_eps"],
        bcdt_norm_weights=True)
    sparse = every(hf["expert_layer_period"], hf["expert_layer_offset"], n)
    experts = None
    if hf["num_experts"] > 1 and any(sparse):  # (transformers builds a dense MLP where a layer would have one expert)
        experts = Experts(n=hf["num_experts"], per_token=hf["num_experts_per_tok"],
                          layers=None if all(sparse) else sparse)
    base = llama_config(hf)
    return dataclasses.replace(base, state_space=space, experts=experts, rotary_layers=(False,) * n, qkv_bias=False,
                               out_bias=False, mlp_bias=False)


def jamba_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    space, experts, n = cfg.state_space, cfg.experts, cfg.n_layers
    expand = 0 if space is None else space.d_inner // cfg.d_model
    if space is not None and (space.kind != "mamba1" or space.d_inner % cfg.d_model or space != StateSpace(
            layers=space.layers, n_heads=space.n_heads, d_head=1, d_state=space.d_state, conv_kernel=space.conv_kernel,
            conv_bias=space.conv_bias, proj_bias=space.proj_bias, kind="mamba1", dt_rank=space.dt_rank,
            bcdt_norm_eps=cfg.eps, bcdt_norm_weights=True)):
        raise ValueError(f"a jamba checkpoint's recurrent layers are Mamba-1 mixers a whole multiple of d_model wide, "
                         f"their dt/B/C norms learned with the model's eps ({cfg.eps}); this model has "
                         f"state_space={space!r}")
    if experts is not None and experts != Experts(n=experts.n, per_token=experts.per_token, layers=experts.layers):
        raise ValueError(f"a jamba checkpoint's experts are chosen by a softmax over every expert, unrenormalised, "
                         f"d_mlp wide, with no shared expert; this model has experts={experts!r}")
    if cfg.d_head * cfg.n_heads != cfg.d_model:
        raise ValueError(f"a jamba checkpoint's heads are d_model / n_heads wide; this model's d_head={cfg.d_head}, "
                         f"d_model={cfg.d_model}, n_heads={cfg.n_heads}")
    require_fields(cfg, "jamba", state_space=space, experts=experts, rotary_layers=(False,) * n, norm=Norm.RMS,
                   norm_placement=NormPlacement.PRE, positions=Positions.ROTARY, rotary_dim=cfg.d_head,
                   rotary_scaling=None, gated_mlp=True, final_norm=True, activation=Activation.SILU, qkv_bias=False,
                   out_bias=False, mlp_bias=False, attn_only=False, bidirectional=False, heads_per_layer=None)
    attn_period, attn_offset = period_of(tuple(not cfg.layer_is_state_space(l) for l in range(n)), "attention layers")
    sparse = tuple(cfg.layer_sparse(l) for l in range(n))
    expert_period, expert_offset = period_of(sparse, "expert layers") if any(sparse) else (1, 0)
    out = {"model_type": "jamba", "architectures": ["JambaForCausalLM"], "num_hidden_layers": n,
           "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_attention_heads": cfg.n_heads,
           "num_key_value_heads": cfg.n_kv_heads, "vocab_size": cfg.d_vocab, "max_position_embeddings": cfg.n_ctx,
           "rms_norm_eps": cfg.eps, "tie_word_embeddings": cfg.tied_embeddings, "hidden_act": "silu",
           "attn_layer_period": attn_period, "attn_layer_offset": attn_offset,
           "expert_layer_period": expert_period, "expert_layer_offset": expert_offset,
           "num_experts": 1 if experts is None else experts.n,
           "num_experts_per_tok": 1 if experts is None else experts.per_token, **special_token_ids(tokenizer)}
    if space is not None:
        out.update(mamba_d_state=space.d_state, mamba_d_conv=space.conv_kernel, mamba_expand=expand,
                   mamba_dt_rank=space.dt_rank, mamba_conv_bias=space.conv_bias, mamba_proj_bias=space.proj_bias)
    return out


def jamba_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape), relative to the file's `model.`, for all but the attention layers' q/k/v (read apart:
    take_attention) and the unembedding."""
    d, m = cfg.d_model, cfg.d_mlp
    table = {"embed.W_E": ("embed_tokens.weight", (cfg.d_vocab, d)), "ln_final.w": ("final_layernorm.weight", (d,))}
    mixers = {} if cfg.state_space is None else mamba_names(cfg)  # (Mamba-1's, every layer's: the mixers' kept)
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"layers.{l}"
        table.update({f"{o}.ln1.w": (f"{t}.input_layernorm.weight", (d,)),
                      f"{o}.ln2.w": (f"{t}.pre_ff_layernorm.weight", (d,))})
        if cfg.layer_is_state_space(l):
            table.update({ours: (theirs.replace(f"{t}.mixer.", f"{t}.mamba."), shape)
                          for ours, (theirs, shape) in mixers.items() if ours.startswith(f"{o}.mixer.")})
            space = cfg.state_space
            for norm, width in (("dt", space.dt_rank), ("b", space.d_state), ("c", space.d_state)):
                table[f"{o}.mixer.{norm}_layernorm.w"] = (f"{t}.mamba.{norm}_layernorm.weight", (width,))
        else:
            table[f"{o}.attn.out.weight"] = (f"{t}.self_attn.o_proj.weight", (d, cfg.n_heads * cfg.d_head))
        if not cfg.layer_sparse(l):
            for ours, theirs, shape in (("gate", "gate", (m, d)), ("fc_in", "up", (m, d)), ("fc_out", "down", (d, m))):
                table[f"{o}.mlp.{ours}.weight"] = (f"{t}.feed_forward.{theirs}_proj.weight", shape)
    return table


def jamba_expert_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The sparse layers' experts under the file's names: Mixtral's table with the router as Jamba names it."""
    if cfg.experts is None:
        return {}
    return {ours: (theirs.replace(".feed_forward.gate.", ".feed_forward.router."), shape)
            for ours, (theirs, shape) in expert_names(cfg, "jamba").items()}


def jamba_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in jamba_names(cfg).items()}
    out.update(take_attention(source, cfg))
    if cfg.experts is not None:
        out.update(take_experts(source, cfg, "jamba", jamba_expert_names(cfg)))
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    return out


def jamba_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    names = {**jamba_names(cfg), **jamba_expert_names(cfg)}
    out = {f"model.{theirs}": params[ours] for ours, (theirs, _) in names.items()}
    out.update(attention_to_hf(params, cfg))
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}
