"""Mamba-2 checkpoints: Mamba-2's own models (`mamba2`, Mamba2ForCausalLM: every layer x + mixer(norm(x)), no MLP,
under `backbone.`), and hybrids, most layers a Mamba-2 state-space mixer (probe.state_space, under `mamba.` in the file,
`mixer.` here as TL 4's bridge names it), a few attention (Llama's, from `self_attn`).

Bamba (`bamba`, BambaForCausalLM): the attention layers are `attn_layer_indices`, rotating half of each head; every MLP
Llama's gated one (`feed_forward`), its norm `pre_ff_layernorm`.

IBM Granite 4.0-H (`granitemoehybrid`, GraniteMoeHybridForCausalLM): the layers' kinds are `layer_types`;
every layer's MLP a shared gated MLP (`shared_mlp`, its gate and up projections fused in `input_linear`) beside a
mixture of experts chosen by logit (GraniteMoE's, `block_sparse_moe`), or the shared MLP alone where the file has no
experts. Granite's four scalars as probe.checkpoint_granite folds them (the embedding, residual and logit ones into
the weights, the attention one into the scores' scale). Attention layers rotate q and k where position_embedding_type
is "rope", else use no positions (NoPE). The convolution's activation is the model's (silu, the only one read)."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

from probe.checkpoint_granite import (fold_multipliers, granite_config, granite_config_to_hf, granite_experts_to_hf,
                                      take_granite_experts)
from probe.checkpoint_llama import llama_config, llama_config_to_hf
from probe.checkpoint_source import (Source, require_fields, special_token_ids, split_qkv, take_qkv, take_unembed,
                                     with_defaults, with_fields)
from probe.config import Activation, DecoderConfig, Experts, Norm, Positions, StateSpace
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

GRANITE_LN2 = "post_attention_layernorm"
BAMBA_NAMES = ("pre_ff_layernorm", "feed_forward", "final_layernorm")  # its MLP's norm, its MLP, its last norm
STATE_SPACE = ("linear_attention", "mamba")  # a layer type's spellings (transformers 5's, and the released files')
ATTENTION = ("full_attention", "attention")


def _limit(value) -> float:
    """A time_step_limit entry as transformers writes it ({"__float__": "Infinity"} for an unbounded step)."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def state_space_of(hf: dict, kinds: list[str]) -> StateSpace:
    """The Mamba-2 layers of a config.json whose layers' kinds are `kinds`, with transformers' defaults."""
    n = hf["num_hidden_layers"]
    if len(kinds) != n or set(kinds) - set(STATE_SPACE + ATTENTION):
        raise CheckpointError(f"layer_types={kinds!r} must name each of the {n} layers 'linear_attention' (Mamba-2) "
                              "or 'full_attention'")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act={hf['hidden_act']!r}: the Mamba-2 convolution's activation is read as silu "
                              "only")
    inner = int(hf.get("mamba_expand", 2) * hf["hidden_size"])
    heads = hf.get("mamba_n_heads", 128)
    d_head = hf.get("mamba_d_head", "auto")
    low, high = hf.get("time_step_limit") or (0.0, math.inf)
    return StateSpace(layers=tuple(kind in STATE_SPACE for kind in kinds), n_heads=heads,
                      d_head=inner // heads if d_head == "auto" else d_head, d_state=hf.get("mamba_d_state", 256),
                      n_groups=hf.get("mamba_n_groups", 1), conv_kernel=hf.get("mamba_d_conv", 4),
                      conv_bias=hf.get("mamba_conv_bias", True), proj_bias=hf.get("mamba_proj_bias", False),
                      dt_min=_limit(low), dt_max=_limit(high))


def state_space_to_hf(cfg: DecoderConfig) -> dict:
    """state_space_of's fields for a config.json."""
    space = cfg.state_space
    if space.kind != "mamba2":
        raise ValueError(f"this format holds Mamba-2 mixers; this model's are kind={space.kind!r} (Mamba-1's format: "
                         "mamba or falcon_mamba)")
    if (space.n_heads * space.d_head) % cfg.d_model:
        raise ValueError(f"a Mamba-2 checkpoint's mixer width is a whole multiple of d_model (mamba_expand); this "
                         f"model's is {space.n_heads * space.d_head} with d_model={cfg.d_model}")
    return dict(mamba_n_heads=space.n_heads, mamba_d_head=space.d_head, mamba_d_state=space.d_state,
                mamba_n_groups=space.n_groups, mamba_d_conv=space.conv_kernel, mamba_conv_bias=space.conv_bias,
                mamba_proj_bias=space.proj_bias, mamba_expand=space.n_heads * space.d_head // cfg.d_model,
                time_step_limit=[space.dt_min, space.dt_max])


def granite_hybrid_config(hf: dict) -> DecoderConfig:
    n = hf["num_hidden_layers"]
    space = state_space_of(hf, hf.get("layer_types") or hf.get("layers_block_type") or ["linear_attention"] * n)
    shared = hf.get("shared_intermediate_size", 1024)
    n_experts = hf.get("num_local_experts", 8)
    experts = None
    if n_experts:  # the experts are intermediate_size wide, the shared MLP beside them added as it is
        experts = Experts(n=n_experts, per_token=hf.get("num_experts_per_tok", 2), softmax_over="chosen",
                          shared=shared, shared_gate=False)
    else:  # the shared MLP alone: the layer's one MLP
        hf = with_fields(hf, intermediate_size=shared)
    base = granite_config(hf)
    # attention layers without positions (NoPE) unless the file asks for rope
    rotates = None if hf.get("position_embedding_type") == "rope" else (False,) * n
    return dataclasses.replace(base, state_space=space, experts=experts, rotary_layers=rotates, mlp_bias=False)


def granite_hybrid_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    space, experts = cfg.state_space, cfg.experts
    if space is None or (experts is not None and (experts.softmax_over != "chosen" or experts.shared is None
                                                  or experts.shared_gate or experts.layers is not None)):
        raise ValueError(f"a granitemoehybrid checkpoint holds Mamba-2 layers and, in every layer, a shared MLP beside "
                         f"experts chosen by logit (or the shared MLP alone); this model has state_space={space!r}, "
                         f"experts={experts!r}")
    rope = cfg.rotary_layers is None
    if not (rope or not any(cfg.rotary_layers)):
        raise ValueError("a granitemoehybrid checkpoint rotates every attention layer or none; this model has "
                         f"rotary_layers={cfg.rotary_layers!r}")
    require_fields(cfg, "granitemoehybrid", state_space=space, experts=experts, rotary_layers=cfg.rotary_layers,
                   activation=Activation.SILU, mlp_bias=False, out_bias=cfg.qkv_bias, attn_scale_dim=cfg.attn_scale_dim)
    plain = dataclasses.replace(cfg, state_space=None, experts=None, rotary_layers=None)
    out = granite_config_to_hf(plain, tokenizer)
    out.pop("mlp_bias")
    out.update(special_token_ids(tokenizer))
    out.update(model_type="granitemoehybrid", architectures=["GraniteMoeHybridForCausalLM"],
               layer_types=["linear_attention" if s else "full_attention" for s in space.layers],
               position_embedding_type="rope" if rope else "nope", **state_space_to_hf(cfg),
               num_local_experts=0 if experts is None else experts.n,
               num_experts_per_tok=2 if experts is None else experts.per_token,
               shared_intermediate_size=cfg.d_mlp if experts is None else experts.shared)
    return out


def mixer_names(cfg: DecoderConfig, layer: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape) for `layer`'s Mamba-2 mixer (`layers.L.mamba` in the file)."""
    space, d = cfg.state_space, cfg.d_model
    inner, heads = space.n_heads * space.d_head, space.n_heads
    channels = inner + 2 * space.n_groups * space.d_state
    m, x = f"blocks.{layer}.mixer", f"layers.{layer}.mamba"
    table = {f"{m}.in_proj.weight": (f"{x}.in_proj.weight", (inner + channels + heads, d)),
             f"{m}.conv1d.weight": (f"{x}.conv1d.weight", (channels, 1, space.conv_kernel)),
             f"{m}.dt_bias": (f"{x}.dt_bias", (heads,)), f"{m}.A_log": (f"{x}.A_log", (heads,)),
             f"{m}.D": (f"{x}.D", (heads,)), f"{m}.norm.w": (f"{x}.norm.weight", (inner,)),
             f"{m}.out_proj.weight": (f"{x}.out_proj.weight", (d, inner))}
    if space.conv_bias:
        table[f"{m}.conv1d.bias"] = (f"{x}.conv1d.bias", (channels,))
    if space.proj_bias:
        table.update({f"{m}.in_proj.bias": (f"{x}.in_proj.bias", (inner + channels + heads,)),
                      f"{m}.out_proj.bias": (f"{x}.out_proj.bias", (d,))})
    return table


def tensor_names(cfg: DecoderConfig, ln2: str, mlp: Optional[str] = None,
                 final: str = "norm") -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape) for the embedding, the norms (the MLP's is `ln2` in the file, the last `final`), the Mamba-2
    layers, the attention layers' outputs and (where `mlp` names the file's gated MLP) Llama's MLPs; each attention
    layer's q/k/v are read apart (take_qkv)."""
    d, m = cfg.d_model, cfg.d_mlp
    table = {"embed.W_E": ("embed_tokens.weight", (cfg.d_vocab, d)), "ln_final.w": (f"{final}.weight", (d,))}
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"layers.{l}"
        table.update({f"{o}.ln1.w": (f"{t}.input_layernorm.weight", (d,)), f"{o}.ln2.w": (f"{t}.{ln2}.weight", (d,))})
        if cfg.layer_is_state_space(l):
            table.update(mixer_names(cfg, l))
        else:
            table[f"{o}.attn.out.weight"] = (f"{t}.self_attn.o_proj.weight", (d, cfg.n_heads * cfg.d_head))
            if cfg.out_bias:
                table[f"{o}.attn.out.bias"] = (f"{t}.self_attn.o_proj.bias", (d,))
        for ours, theirs, shape in (("gate", "gate", (m, d)), ("fc_in", "up", (m, d)), ("fc_out", "down", (d, m))):
            if mlp is not None:
                table[f"{o}.mlp.{ours}.weight"] = (f"{t}.{mlp}.{theirs}_proj.weight", shape)
                if cfg.mlp_bias:
                    table[f"{o}.mlp.{ours}.bias"] = (f"{t}.{mlp}.{theirs}_proj.bias", shape[:1])
    return table


def take_attention(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """The attention layers' q/k/v, from Llama's separate projections."""
    out = {}
    for l in filter(lambda l: not cfg.layer_is_state_space(l), range(cfg.n_layers)):
        out.update(take_qkv(source, cfg, l, lambda p, kind, l=l: f"layers.{l}.self_attn.{p}_proj.{kind}",
                            cfg.qkv_bias))
    return out


def attention_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {}
    for l in filter(lambda l: not cfg.layer_is_state_space(l), range(cfg.n_layers)):
        out.update(split_qkv(params, cfg, l, lambda p, kind, l=l: f"model.layers.{l}.self_attn.{p}_proj.{kind}",
                             cfg.qkv_bias))
    return out


def _mlp_name(cfg: DecoderConfig, layer: int) -> str:
    """Where probe keeps the shared MLP: beside the experts, or as the layer's one MLP."""
    return f"blocks.{layer}.mlp" + (".shared_expert" if cfg.experts is not None else "")


def granite_hybrid_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in tensor_names(cfg, GRANITE_LN2).items()}
    out.update(take_attention(source, cfg))
    width = cfg.d_mlp if cfg.experts is None else cfg.experts.shared
    for l in range(cfg.n_layers):
        t, mlp = f"layers.{l}.shared_mlp", _mlp_name(cfg, l)
        out[f"{mlp}.gate.weight"], out[f"{mlp}.fc_in.weight"] = source.take(
            f"{t}.input_linear.weight", (2 * width, cfg.d_model)).chunk(2)
        out[f"{mlp}.fc_out.weight"] = source.take(f"{t}.output_linear.weight", (cfg.d_model, width))
    if cfg.experts is not None:
        take_granite_experts(source, cfg, out)
    out["unembed.weight"] = take_unembed(source, dataclasses.replace(cfg, tied_embeddings=source.config.get(
        "tie_word_embeddings", False)), out["embed.W_E"])
    return fold_multipliers(out, source.config)


def granite_hybrid_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {f"model.{theirs}": params[ours] for ours, (theirs, _) in tensor_names(cfg, GRANITE_LN2).items()}
    out.update(attention_to_hf(params, cfg))
    for l in range(cfg.n_layers):
        t, mlp = f"model.layers.{l}.shared_mlp", _mlp_name(cfg, l)
        out[f"{t}.input_linear.weight"] = torch.cat([params[f"{mlp}.gate.weight"], params[f"{mlp}.fc_in.weight"]])
        out[f"{t}.output_linear.weight"] = params[f"{mlp}.fc_out.weight"]
    out.update(granite_experts_to_hf(params, cfg))
    out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}


# ---- Bamba: Mamba-2 layers and Llama's attention, a dense gated MLP in every layer ----------------------------------
def bamba_config(hf: dict) -> DecoderConfig:
    n = hf["num_hidden_layers"]
    attention = set(hf.get("attn_layer_indices") or ())
    space = state_space_of(hf, ["full_attention" if l in attention else "linear_attention" for l in range(n)])
    base = llama_config(with_defaults(hf, rms_norm_eps=1e-5, num_key_value_heads=8), default_eps=1e-5)
    # transformers' Bamba rotates half of each head whatever its rope dict says (its config hardcodes the fraction)
    return dataclasses.replace(base, state_space=space, rotary_dim=base.d_head // 2, mlp_bias=hf.get("mlp_bias", False),
                               out_bias=hf.get("attention_bias", False))


def bamba_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    space = cfg.state_space
    if space is None:
        raise ValueError(f"a bamba checkpoint holds Mamba-2 layers; this model has state_space={space!r}")
    require_fields(cfg, "bamba", state_space=space, activation=Activation.SILU, rotary_dim=cfg.d_head // 2,
                   out_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    out = llama_config_to_hf(dataclasses.replace(cfg, state_space=None, rotary_dim=cfg.d_head), tokenizer)
    out.update(special_token_ids(tokenizer))
    out.update(model_type="bamba", architectures=["BambaForCausalLM"], **state_space_to_hf(cfg),
               attn_layer_indices=[l for l in range(cfg.n_layers) if not cfg.layer_is_state_space(l)])
    return out


def bamba_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in tensor_names(cfg, *BAMBA_NAMES).items()}
    out.update(take_attention(source, cfg))
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    return out


def bamba_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {f"model.{theirs}": params[ours] for ours, (theirs, _) in tensor_names(cfg, *BAMBA_NAMES).items()}
    out.update(attention_to_hf(params, cfg))
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}


# ---- Mamba-2's own models: every layer a Mamba-2 mixer, no MLP, no attention ----------------------------------------
# n_ctx, which a config.json without positions does not give: the released models' pretraining context (a longer input
# is refused, as everywhere; model.cfg.n_ctx is the bound to raise, in a copy of the config, for longer ones)
MAMBA2_CONTEXT = 2048


def mamba2_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, num_heads=128, head_dim=64, state_size=128, expand=2, conv_kernel=4, n_groups=8,
                       use_bias=False, use_conv_bias=True, layer_norm_epsilon=1e-5, tie_word_embeddings=False)
    n, heads, d_head = hf["num_hidden_layers"], hf["num_heads"], hf["head_dim"]
    if heads * d_head != int(hf["expand"] * hf["hidden_size"]):
        raise CheckpointError(f"num_heads * head_dim = {heads * d_head} must be expand * hidden_size = "
                              f"{int(hf['expand'] * hf['hidden_size'])}, the mixer's width")
    space = state_space_of(with_fields(hf, mamba_n_heads=heads, mamba_d_head=d_head, mamba_d_state=hf["state_size"],
                                       mamba_n_groups=hf["n_groups"], mamba_d_conv=hf["conv_kernel"],
                                       mamba_expand=hf["expand"], mamba_conv_bias=hf["use_conv_bias"],
                                       mamba_proj_bias=hf["use_bias"]), ["linear_attention"] * n)
    # (the heads are the mixer's: there is no attention, so nothing reads positions, q, k or an MLP)
    return DecoderConfig(n_layers=n, d_model=hf["hidden_size"], n_heads=heads, d_head=d_head, d_vocab=hf["vocab_size"],
                         n_ctx=hf.get("max_position_embeddings") or MAMBA2_CONTEXT, eps=hf["layer_norm_epsilon"], activation=Activation.SILU, norm=Norm.RMS,
                         positions=Positions.ROTARY, attn_only=True, qkv_bias=False, out_bias=False, mlp_bias=False,
                         tied_embeddings=hf["tie_word_embeddings"], state_space=space)


def mamba2_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    space = cfg.state_space
    if space is None or not all(space.layers) or not cfg.attn_only:
        raise ValueError(f"a mamba2 checkpoint holds Mamba-2 mixers in every layer and nothing else; this model has "
                         f"state_space={space!r}, attn_only={cfg.attn_only}")
    require_fields(cfg, "mamba2", state_space=space, attn_only=True, norm=Norm.RMS, positions=Positions.ROTARY,
                   activation=Activation.SILU, qkv_bias=False, out_bias=False, mlp_bias=False)
    mamba = state_space_to_hf(cfg)
    return {"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "num_hidden_layers": cfg.n_layers,
            "hidden_size": cfg.d_model, "vocab_size": cfg.d_vocab, "layer_norm_epsilon": cfg.eps,
            "tie_word_embeddings": cfg.tied_embeddings, "num_heads": space.n_heads, "head_dim": space.d_head,
            "state_size": space.d_state, "n_groups": space.n_groups, "conv_kernel": space.conv_kernel,
            "expand": mamba["mamba_expand"], "use_bias": space.proj_bias, "use_conv_bias": space.conv_bias,
            "time_step_limit": mamba["time_step_limit"], "hidden_act": "silu", **special_token_ids(tokenizer)}


def mamba2_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape), theirs under `backbone.` (stripped on reading), the unembedding apart."""
    d = cfg.d_model
    table = {"embed.W_E": ("embeddings.weight", (cfg.d_vocab, d)), "ln_final.w": ("norm_f.weight", (d,))}
    for l in range(cfg.n_layers):
        table[f"blocks.{l}.ln1.w"] = (f"layers.{l}.norm.weight", (d,))
        table.update({ours: (theirs.replace(".mamba.", ".mixer."), shape)
                      for ours, (theirs, shape) in mixer_names(cfg, l).items()})
    return table


def backbone_family(names: Callable[[DecoderConfig], dict]) -> tuple[Callable, Callable]:
    """(to_probe, to_hf) for a Mamba format whose every tensor but the unembedding `names` lists (ours -> (theirs,
    shape)), theirs under `backbone.` in the file (Mamba-2's, Mamba-1's)."""
    def to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in names(cfg).items()}
        out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
        return out

    def to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        out = {f"backbone.{theirs}": params[ours] for ours, (theirs, _) in names(cfg).items()}
        if not cfg.tied_embeddings:
            out["lm_head.weight"] = params["unembed.weight"]
        return {k: v.contiguous() for k, v in out.items()}

    return to_probe, to_hf


mamba2_to_probe, mamba2_to_hf = backbone_family(mamba2_names)
