"""Mamba-1 checkpoints: Mamba (`mamba`, MambaForCausalLM: state-spaces/mamba-130m ... 2.8b) and TII's FalconMamba
(`falcon_mamba`, FalconMambaForCausalLM: the same mixer with weightless RMS norms on dt, B and C). Every layer is
x + mixer(norm(x)) with no MLP, under `backbone.`; the mixer is probe.selective_scan's."""
from __future__ import annotations

import math
from typing import Optional

from probe.checkpoint_mamba import MAMBA2_CONTEXT, backbone_family
from probe.checkpoint_source import require_fields, special_token_ids, with_defaults
from probe.config import Activation, DecoderConfig, Norm, Positions, StateSpace
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

ARCHITECTURES = {"mamba": "MambaForCausalLM", "falcon_mamba": "FalconMambaForCausalLM"}


def mamba_config(hf: dict, model_type: str = "mamba") -> DecoderConfig:
    hf = with_defaults(hf, state_size=16, expand=2, conv_kernel=4, use_bias=False, use_conv_bias=True,
                       layer_norm_epsilon=1e-5, time_step_rank="auto", tie_word_embeddings=True, mixer_rms_eps=1e-6)
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act={hf['hidden_act']!r}: the Mamba convolution's activation is read as silu only")
    d, n = hf["hidden_size"], hf["num_hidden_layers"]
    rank = math.ceil(d / 16) if hf["time_step_rank"] == "auto" else int(hf["time_step_rank"])
    space = StateSpace(layers=(True,) * n, n_heads=int(hf["expand"] * d), d_head=1, d_state=hf["state_size"],
                       conv_kernel=hf["conv_kernel"], conv_bias=hf["use_conv_bias"], proj_bias=hf["use_bias"],
                       kind="mamba1", dt_rank=rank,
                       bcdt_norm_eps=hf["mixer_rms_eps"] if model_type == "falcon_mamba" else None)
    # (no attention: nothing reads positions, heads or an MLP; n_ctx as Mamba-2's, the file naming none)
    return DecoderConfig(n_layers=n, d_model=d, n_heads=1, d_head=d, d_vocab=hf["vocab_size"], n_ctx=MAMBA2_CONTEXT,
                         eps=hf["layer_norm_epsilon"], activation=Activation.SILU, norm=Norm.RMS,
                         positions=Positions.ROTARY, attn_only=True, qkv_bias=False, out_bias=False, mlp_bias=False,
                         tied_embeddings=hf["tie_word_embeddings"], state_space=space)


def falcon_mamba_config(hf: dict) -> DecoderConfig:
    return mamba_config(hf, "falcon_mamba")


def mamba_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer], model_type: str = "mamba") -> dict:
    space = cfg.state_space
    falcon = model_type == "falcon_mamba"
    if (space is None or space.kind != "mamba1" or not all(space.layers) or not cfg.attn_only
            or (space.bcdt_norm_eps is not None) != falcon):
        raise ValueError(f"a {model_type} checkpoint holds Mamba-1 mixers (kind='mamba1', "
                         f"{'with' if falcon else 'without'} B/C/dt norms) in every layer and nothing else; this "
                         f"model has state_space={space!r}, attn_only={cfg.attn_only}")
    if space.d_inner % cfg.d_model:
        raise ValueError(f"a {model_type} checkpoint's mixer width is a whole multiple of d_model (expand); this "
                         f"model's is {space.d_inner} with d_model={cfg.d_model}")
    require_fields(cfg, model_type, state_space=space, attn_only=True, norm=Norm.RMS, positions=Positions.ROTARY,
                   activation=Activation.SILU, qkv_bias=False, out_bias=False, mlp_bias=False)
    out = {"model_type": model_type, "architectures": [ARCHITECTURES[model_type]], "num_hidden_layers": cfg.n_layers,
           "hidden_size": cfg.d_model, "vocab_size": cfg.d_vocab, "layer_norm_epsilon": cfg.eps,
           "tie_word_embeddings": cfg.tied_embeddings, "state_size": space.d_state, "conv_kernel": space.conv_kernel,
           "expand": space.d_inner // cfg.d_model, "use_bias": space.proj_bias, "use_conv_bias": space.conv_bias,
           "time_step_rank": space.dt_rank, "hidden_act": "silu", **special_token_ids(tokenizer)}
    if falcon:
        out["mixer_rms_eps"] = space.bcdt_norm_eps
    return out


def falcon_mamba_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    return mamba_config_to_hf(cfg, tokenizer, "falcon_mamba")


def mamba_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape), theirs under `backbone.` (stripped on reading), the unembedding apart."""
    space, d = cfg.state_space, cfg.d_model
    inner, rank, n = space.d_inner, space.dt_rank, space.d_state
    table = {"embed.W_E": ("embeddings.weight", (cfg.d_vocab, d)), "ln_final.w": ("norm_f.weight", (d,))}
    for l in range(cfg.n_layers):
        ours, theirs = f"blocks.{l}.mixer", f"layers.{l}.mixer"
        table[f"blocks.{l}.ln1.w"] = (f"layers.{l}.norm.weight", (d,))
        mixer = {"in_proj.weight": (2 * inner, d), "conv1d.weight": (inner, 1, space.conv_kernel),
                 "x_proj.weight": (rank + 2 * n, inner), "dt_proj.weight": (inner, rank), "dt_proj.bias": (inner,),
                 "A_log": (inner, n), "D": (inner,), "out_proj.weight": (d, inner)}
        if space.conv_bias:
            mixer["conv1d.bias"] = (inner,)
        if space.proj_bias:
            mixer.update({"in_proj.bias": (2 * inner,), "out_proj.bias": (d,)})
        table.update({f"{ours}.{name}": (f"{theirs}.{name}", shape) for name, shape in mixer.items()})
    return table


mamba_to_probe, mamba_to_hf = backbone_family(mamba_names)
