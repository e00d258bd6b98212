"""Falcon-H1 checkpoints (`falcon_h1`, FalconH1ForCausalLM; TII 2025): every layer runs Llama's grouped-query
attention and a Mamba-2 mixer (probe.state_space, `mamba` in the file and here) side by side on one RMSNorm's output,
their writes summed into the residual (probe.blocks.ParallelHybridBlock), then a gated MLP (`feed_forward`, its norm
`pre_ff_layernorm`). The mixer's width is mamba_d_ssm (not a multiple of d_model in general); its gated norm is
absent where mamba_rms_norm is false (the released models), else before or after the gate (mamba_norm_before_gate);
its in_proj bias is mamba_proj_bias, its out_proj's projectors_bias.

Falcon-H1's muP multipliers, as transformers applies them, are folded into the weights on loading, each exactly:
embedding_multiplier into W_E; lm_head_multiplier into W_U (so the unembedding is never the embedding's transpose,
and the model is untied); attention_in_multiplier into W_Q, W_K and W_V (not their biases: it scales attention's
input); attention_out_multiplier into W_O and b_O; ssm_in_multiplier into in_proj's weight (its input) and
ssm_multipliers, the five factors on in_proj's parts (z, x, B, C, dt), into its rows and bias; ssm_out_multiplier into
out_proj; mlp_multipliers' first into the gate projection (before the activation), its second into W_out.
key_multiplier scales every key, so it becomes the scores' scale (attn_scale_dim = d_head / key_multiplier^2) and
hook_k holds k_proj's own output, as TL 4's bridge's attn.k.hook_out does. So the hooks hold what the residual
stream receives (hook_attn_out, hook_mixer_out, hook_mlp_out, each head's hook_result) and what each layer reads;
the bridge's names for a value before a folded multiplier are left out, saying where probe has it
(probe.bridge_names). Saving writes the folded weights with every multiplier 1 but key_multiplier, which keeps the
scale."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config
from probe.checkpoint_mamba import state_space_of
from probe.checkpoint_source import (Source, llama_named_to_hf, llama_named_to_probe, require_fields, rope_to_hf,
                                     special_token_ids, with_defaults, with_fields)
from probe.config import Activation, DecoderConfig, Norm, NormPlacement, Positions
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

# transformers' FalconH1Config defaults for the fields its saved files may leave out
DEFAULTS = dict(rms_norm_eps=1e-5, num_key_value_heads=8, max_position_embeddings=8192, hidden_act="silu",
                mamba_n_heads=128, mamba_d_state=256, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
                mamba_conv_bias=True, mamba_proj_bias=False, mamba_rms_norm=False, mamba_norm_before_gate=True,
                projectors_bias=False)
MULTIPLIERS = ("embedding_multiplier", "lm_head_multiplier", "attention_in_multiplier", "attention_out_multiplier",
               "ssm_in_multiplier", "ssm_out_multiplier")


def falcon_h1_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, **DEFAULTS)
    n, width = hf["num_hidden_layers"], hf.get("mamba_d_ssm", 1024)
    width = int(hf["mamba_expand"] * hf["hidden_size"]) if width is None else width
    heads = hf["mamba_n_heads"]
    d_head = hf.get("mamba_d_head", "auto")
    d_head = width // heads if d_head in ("auto", None) else d_head
    if heads * d_head != width:
        raise CheckpointError(f"mamba_n_heads * mamba_d_head = {heads * d_head} must be mamba_d_ssm = {width}, the "
                              "mixer's width")
    space = state_space_of(with_fields(hf, mamba_d_head=d_head), ["linear_attention"] * n)
    inner_norm = ("before_gate" if hf["mamba_norm_before_gate"] else "after_gate") if hf["mamba_rms_norm"] else None
    space = dataclasses.replace(space, inner_norm=inner_norm, out_bias=hf["projectors_bias"])
    base = llama_config(hf, default_eps=1e-5)
    key = hf.get("key_multiplier", 1.0)
    if not (isinstance(key, (int, float)) and key > 0):
        raise CheckpointError(f"key_multiplier={key!r}: probe folds it into the scores' scale, which needs a positive "
                              "number; edit a copy of config.json (and negate W_K) for a negative one")
    return dataclasses.replace(base, parallel_state_space=space, attn_scale_dim=base.d_head / key ** 2,
                               tied_embeddings=False)


def falcon_h1_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    space = cfg.parallel_state_space
    if space is None or not all(space.layers):
        raise ValueError(f"a falcon_h1 checkpoint holds a Mamba-2 mixer beside attention in every layer; this model "
                         f"has parallel_state_space={space!r}")
    require_fields(cfg, "falcon_h1", parallel_state_space=space, attn_scale_dim=cfg.attn_scale_dim, norm=Norm.RMS,
                   norm_placement=NormPlacement.PRE, final_norm=True, positions=Positions.ROTARY,
                   rotary_dim=cfg.d_head, gated_mlp=True, activation=Activation.SILU, out_bias=cfg.qkv_bias)
    out_bias = space.proj_bias if space.out_bias is None else space.out_bias
    return {"model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"], "num_hidden_layers": cfg.n_layers,
            "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.d_head, "intermediate_size": cfg.d_mlp, "vocab_size": cfg.d_vocab,
            "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.eps, **rope_to_hf(cfg), "hidden_act": "silu",
            "tie_word_embeddings": cfg.tied_embeddings, "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias,
            "mamba_d_ssm": space.d_inner, "mamba_n_heads": space.n_heads, "mamba_d_head": space.d_head,
            "mamba_n_groups": space.n_groups, "mamba_d_state": space.d_state, "mamba_d_conv": space.conv_kernel,
            "mamba_conv_bias": space.conv_bias, "mamba_proj_bias": space.proj_bias, "projectors_bias": out_bias,
            "mamba_rms_norm": space.inner_norm is not None, "mamba_norm_before_gate": space.inner_norm == "before_gate",
            "time_step_limit": [space.dt_min, space.dt_max],
            # the scale lives in the key multiplier; every other multiplier was folded into the weights
            "key_multiplier": (cfg.d_head / (cfg.attn_scale_dim or cfg.d_head)) ** 0.5,
            **dict.fromkeys(MULTIPLIERS, 1.0), "mlp_multipliers": [1.0, 1.0], "ssm_multipliers": [1.0] * 5,
            **special_token_ids(tokenizer)}


def falcon_h1_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape) for every tensor but q/k/v and the unembedding (llama_named_to_probe's table)."""
    space, d, m = cfg.parallel_state_space, cfg.d_model, cfg.d_mlp
    inner, heads, channels = space.d_inner, space.n_heads, space.d_inner + 2 * space.n_groups * space.d_state
    table = {"embed.W_E": ("embed_tokens.weight", (cfg.d_vocab, d)), "ln_final.w": ("final_layernorm.weight", (d,))}
    for l in range(cfg.n_layers):
        o, t, x = f"blocks.{l}", f"layers.{l}", f"blocks.{l}.mamba"
        table.update({f"{o}.ln1.w": (f"{t}.input_layernorm.weight", (d,)),
                      f"{o}.ln2.w": (f"{t}.pre_ff_layernorm.weight", (d,)),
                      f"{o}.attn.out.weight": (f"{t}.self_attn.o_proj.weight", (d, cfg.n_heads * cfg.d_head)),
                      f"{x}.in_proj.weight": (f"{t}.mamba.in_proj.weight", (inner + channels + heads, d)),
                      f"{x}.conv1d.weight": (f"{t}.mamba.conv1d.weight", (channels, 1, space.conv_kernel)),
                      f"{x}.dt_bias": (f"{t}.mamba.dt_bias", (heads,)), f"{x}.A_log": (f"{t}.mamba.A_log", (heads,)),
                      f"{x}.D": (f"{t}.mamba.D", (heads,)),
                      f"{x}.out_proj.weight": (f"{t}.mamba.out_proj.weight", (d, inner))})
        optional = {f"{o}.attn.out.bias": (cfg.out_bias, f"{t}.self_attn.o_proj.bias", (d,)),
                    f"{x}.norm.w": (space.inner_norm is not None, f"{t}.mamba.norm.weight", (inner,)),
                    f"{x}.conv1d.bias": (space.conv_bias, f"{t}.mamba.conv1d.bias", (channels,)),
                    f"{x}.in_proj.bias": (space.proj_bias, f"{t}.mamba.in_proj.bias", (inner + channels + heads,)),
                    f"{x}.out_proj.bias": (space.proj_bias if space.out_bias is None else space.out_bias,
                                           f"{t}.mamba.out_proj.bias", (d,))}
        for ours, theirs, shape in (("gate", "gate", (m, d)), ("fc_in", "up", (m, d)), ("fc_out", "down", (d, m))):
            table[f"{o}.mlp.{ours}.weight"] = (f"{t}.feed_forward.{theirs}_proj.weight", shape)
            optional[f"{o}.mlp.{ours}.bias"] = (cfg.mlp_bias, f"{t}.feed_forward.{theirs}_proj.bias", shape[:1])
        table.update({ours: (theirs, shape) for ours, (present, theirs, shape) in optional.items() if present})
    return table


def fold_falcon_h1_multipliers(out: dict[str, torch.Tensor], cfg: DecoderConfig, hf: dict) -> dict[str, torch.Tensor]:
    """The multipliers of the module docstring into the weights (new tensors: a tied W_U is not W_E)."""
    get = lambda name: float(hf.get(name, 1.0))  # noqa: E731
    space, out = cfg.parallel_state_space, dict(out)
    z_x, b_c = space.d_inner, space.n_groups * space.d_state
    # one factor per row of in_proj: z, x, B, C, then dt
    parts = hf.get("ssm_multipliers") or [1.0] * 5
    rows = torch.cat([torch.full((n,), float(f)) for n, f in zip((z_x, z_x, b_c, b_c, space.n_heads), parts)])
    gate, down = hf.get("mlp_multipliers") or [1.0, 1.0]
    q_k_v = cfg.n_heads * cfg.d_head + 2 * cfg.n_kv_heads * cfg.d_head
    factors = {".attn.qkv.weight": torch.full((q_k_v, 1), get("attention_in_multiplier")),
               ".attn.out.weight": get("attention_out_multiplier"), ".attn.out.bias": get("attention_out_multiplier"),
               ".mamba.in_proj.weight": rows[:, None] * get("ssm_in_multiplier"), ".mamba.in_proj.bias": rows,
               ".mamba.out_proj.weight": get("ssm_out_multiplier"), ".mamba.out_proj.bias": get("ssm_out_multiplier"),
               ".mlp.gate.weight": float(gate), ".mlp.gate.bias": float(gate), ".mlp.fc_out.weight": float(down),
               ".mlp.fc_out.bias": float(down)}
    for name, tensor in out.items():
        factor = next((f for end, f in factors.items() if name.endswith(end)), None)
        if factor is not None:
            out[name] = tensor * (factor.to(tensor.dtype) if isinstance(factor, torch.Tensor) else factor)
    out["embed.W_E"] = out["embed.W_E"] * get("embedding_multiplier")
    out["unembed.weight"] = out["unembed.weight"] * get("lm_head_multiplier")
    return out


def falcon_h1_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    tied = dataclasses.replace(cfg, tied_embeddings=source.config.get("tie_word_embeddings", False))
    out = llama_named_to_probe(source, tied, falcon_h1_names(cfg))
    return fold_falcon_h1_multipliers(out, cfg, source.config)


def falcon_h1_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    return llama_named_to_hf(params, cfg, falcon_h1_names(cfg))
