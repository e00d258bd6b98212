"""NVIDIA's Nemotron-H checkpoints (`nemotron_h`, NemotronHForCausalLM: Nemotron-H, NVIDIA-Nemotron-Nano-9B-v2,
Nemotron-3): every layer ONE sublayer after its one RMS norm, y = x + sublayer(norm(x)), the sublayer named by
`layers_block_type` (or the released files' `hybrid_override_pattern`, one character a layer):

    M  "mamba" / "linear_attention"  a Mamba-2 mixer (probe.state_space, under `mixer` as in the file and the bridge)
    *  "attention" / "full_attention" grouped-query attention without positions (no rotary, no biases)
    -  "mlp"                          an ungated relu^2 MLP, up_proj then down_proj
    E  "moe"                          ungated relu^2 experts chosen as DeepSeek-V3 chooses (sigmoid scores, a selection
                                      bias, groups, renormalised, scaled), a shared expert beside them, and (Nemotron-3's
                                      moe_latent_size) a latent projection around the routed ones

probe builds each layer as a block of that sublayer alone (DecoderConfig.sublayers: "mixer", "attn", "mlp"), so layer
indices are transformers' and the bridge's; the norm is ln1 before a mixer or attention, ln2 before an MLP.

Read as transformers 5.25 reads them: the mixer's width is mamba_num_heads * mamba_head_dim (`expand` is unused);
in_proj and out_proj have biases where `use_bias` (mamba_proj_bias is unused); attention never has biases whatever
`attention_bias` says; `mlp_bias` reaches the dense MLPs, the shared experts and the latent projections, never the
router or the routed experts; n_shared_experts is unused (the shared expert is moe_shared_expert_intermediate_size
wide); `residual_in_fp32` is unused by the forward, `rescale_prenorm_residual` and the time_step_* draws only
initialise, and `chunk_size` only splits the scan (probe's is exact whatever its chunks). The legacy spellings
(mamba_n_groups, mamba_d_conv, mamba_dt_limit, mamba_conv_bias, ...) are read as transformers reads them. The
multi-token-prediction layers (`mtp.*`) are set aside, as transformers builds none. The unembedding is always lm_head's own (transformers' class
ties nothing, whatever tie_word_embeddings says)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from probe.checkpoint_mamba import mixer_names
from probe.checkpoint_source import (Source, require_fields, special_token_ids, split_qkv, take_qkv, take_unembed,
                                     with_defaults)
from probe.config import Activation, DecoderConfig, ExpertGroups, Experts, Norm, Positions, StateSpace
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

PATTERN = {"M": "mixer", "*": "attn", "-": "mlp", "E": "moe"}
SPELLINGS = {"mamba": "mixer", "linear_attention": "mixer", "attention": "attn", "full_attention": "attn",
             "mlp": "mlp", "moe": "moe"}
HF_KINDS = {"mixer": "linear_attention", "attn": "full_attention", "mlp": "mlp", "moe": "moe"}
LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_limit": "time_step_limit",
          "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size"}


def _limit(value) -> float:
    """A time_step_limit entry as transformers writes it ({"__float__": "Infinity"} for an unbounded step)."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def layer_kinds(hf: dict) -> list[str]:
    """Each layer's sublayer, "mixer" / "attn" / "mlp" / "moe", from layers_block_type or hybrid_override_pattern."""
    listed = hf.get("layers_block_type") or hf.get("layer_types")
    if listed is None and hf.get("hybrid_override_pattern") is not None:
        pattern = hf["hybrid_override_pattern"]
        if set(pattern) - set(PATTERN):
            raise CheckpointError(f"hybrid_override_pattern={pattern!r} may hold only M (Mamba-2), * (attention), - "
                                  "(MLP) and E (experts)")
        return [PATTERN[c] for c in pattern]
    listed = listed or ["linear_attention", "moe", "full_attention", "mlp"]  # transformers' default
    if set(listed) - set(SPELLINGS):
        raise CheckpointError(f"layers_block_type={listed!r} may name only {', '.join(sorted(SPELLINGS))}")
    return [SPELLINGS[kind] for kind in listed]


def nemotron_h_config(hf: dict) -> DecoderConfig:
    # (transformers' __post_init__ reads the legacy spellings; the new name wins where a file has both)
    legacy = {new: hf[old] for old, new in LEGACY.items() if old in hf and new not in hf}
    hf = with_defaults(hf, **{**dict(num_attention_heads=32, head_dim=128, num_key_value_heads=8, max_position_embeddings=4096,
                       intermediate_size=21504, mlp_hidden_act="relu2", ssm_state_size=128, mamba_num_heads=128,
                       mamba_head_dim=64, mamba_hidden_act="silu", n_groups=8, conv_kernel=4, use_conv_bias=True,
                       use_bias=False, mlp_bias=False, n_routed_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=7688, moe_shared_expert_intermediate_size=7688, routed_scaling_factor=1.0,
                       n_group=1, topk_group=1, norm_topk_prob=True, layer_norm_epsilon=1e-5), **legacy})
    kinds = layer_kinds(hf)
    n = len(kinds)
    if hf["mamba_hidden_act"] != "silu":
        raise CheckpointError(f"mamba_hidden_act={hf['mamba_hidden_act']!r}: the Mamba-2 convolution's activation is "
                              "read as silu only")
    if hf.get("mlp_hidden_act") != "relu2":
        raise CheckpointError(f"mlp_hidden_act={hf['mlp_hidden_act']!r}: Nemotron-H's MLPs and experts are read as "
                              "relu2 only")
    low, high = hf.get("time_step_limit") or (0.0, math.inf)
    space = None if "mixer" not in kinds else StateSpace(
        layers=tuple(k == "mixer" for k in kinds), n_heads=hf["mamba_num_heads"], d_head=hf["mamba_head_dim"],
        d_state=hf["ssm_state_size"], n_groups=hf["n_groups"], conv_kernel=hf["conv_kernel"],
        conv_bias=hf["use_conv_bias"], proj_bias=hf["use_bias"], dt_min=_limit(low), dt_max=_limit(high))
    experts = None if "moe" not in kinds else Experts(
        n=hf["n_routed_experts"], per_token=hf["num_experts_per_tok"], renormalize=hf["norm_topk_prob"],
        shared=hf["moe_shared_expert_intermediate_size"], scoring="sigmoid", selection_bias=True,
        groups=None if hf["n_group"] == 1 else ExpertGroups(n=hf["n_group"], kept=hf["topk_group"]),
        scaling=float(hf["routed_scaling_factor"]), shared_gate=False, width=hf["moe_intermediate_size"],
        layers=tuple(k == "moe" for k in kinds), routed_bias=False, gated=False, latent=hf.get("moe_latent_size"))
    heads = hf["num_attention_heads"]
    return DecoderConfig(
        n_layers=n, d_model=hf["hidden_size"], n_heads=heads, n_kv_heads=hf["num_key_value_heads"] or heads,
        d_head=hf["head_dim"] or hf["hidden_size"] // heads, d_mlp=hf["intermediate_size"],
        d_vocab=hf["vocab_size"], n_ctx=hf["max_position_embeddings"], eps=hf["layer_norm_epsilon"],
        activation=Activation.RELU2, gated_mlp=False, norm=Norm.RMS, positions=Positions.ROTARY,
        rotary_layers=(False,) * n,  # attention without positions (NoPE): the rotary kind, rotating no layer
        qkv_bias=False, out_bias=False, mlp_bias=hf["mlp_bias"], tied_embeddings=False,
        state_space=space, experts=experts, sublayers=tuple("mlp" if k == "moe" else k for k in kinds))


def nemotron_h_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    experts, space = cfg.experts, cfg.state_space
    if cfg.sublayers is None:
        raise ValueError("a nemotron_h checkpoint holds one sublayer per layer (cfg.sublayers); this model has both "
                         "in every layer")
    if experts is not None and not (experts.scoring == "sigmoid" and experts.selection_bias and experts.shared
                                    and not experts.shared_gate and not experts.gated and not experts.routed_bias
                                    and experts.softmax_over == "all" and experts.clamped_glu is None
                                    and experts.renormalize_min is None and experts.renormalize_eps == 1e-20
                                    and (experts.groups is None or experts.groups.score == "top2_sum")):
        raise ValueError(f"a nemotron_h checkpoint's experts are ungated, chosen by sigmoid score with a selection "
                         f"bias, with an ungated shared expert added as it is; this model has experts={experts!r}")
    if space is not None and (space.kind, space.inner_norm, space.out_bias) != ("mamba2", "after_gate", None):
        raise ValueError(f"a nemotron_h checkpoint holds Mamba-2 mixers normed after their gate, one bias setting for "
                         f"both projections; this model's are kind={space.kind!r}, inner_norm={space.inner_norm!r}, "
                         f"out_bias={space.out_bias!r}")
    require_fields(cfg, "nemotron_h", sublayers=cfg.sublayers, state_space=space, experts=experts,
                   rotary_layers=(False,) * cfg.n_layers, activation=Activation.RELU2,
                   gated_mlp=False, norm=Norm.RMS, positions=Positions.ROTARY, qkv_bias=False, out_bias=False,
                   heads_per_layer=None)
    kinds = [("moe" if cfg.layer_sparse(l) else "mlp") if k == "mlp" else k for l, k in enumerate(cfg.sublayers)]
    out = {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "hidden_size": cfg.d_model,
           "vocab_size": cfg.d_vocab, "layers_block_type": [HF_KINDS[k] for k in kinds],
           "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head,
           "intermediate_size": cfg.d_mlp, "max_position_embeddings": cfg.n_ctx, "layer_norm_epsilon": cfg.eps,
           "mlp_hidden_act": "relu2", "mlp_bias": cfg.mlp_bias, "attention_bias": False,
           "tie_word_embeddings": False, **special_token_ids(tokenizer)}
    if space is not None:
        out.update(mamba_num_heads=space.n_heads, mamba_head_dim=space.d_head, ssm_state_size=space.d_state,
                   n_groups=space.n_groups, conv_kernel=space.conv_kernel, use_conv_bias=space.conv_bias,
                   use_bias=space.proj_bias, mamba_hidden_act="silu", time_step_limit=[space.dt_min, space.dt_max])
    if experts is not None:
        groups = experts.groups or ExpertGroups(n=1, kept=1)
        out.update(n_routed_experts=experts.n, num_experts_per_tok=experts.per_token,
                   moe_intermediate_size=cfg.expert_width, moe_shared_expert_intermediate_size=experts.shared,
                   routed_scaling_factor=experts.scaling, n_group=groups.n, topk_group=groups.kept,
                   norm_topk_prob=experts.renormalize, moe_latent_size=experts.latent)
    return out


def tensor_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape) for every tensor but the attention layers' q/k/v and the unembedding, theirs with the
    file's `backbone.` (or `model.`) stripped."""
    d = cfg.d_model
    table = {"embed.W_E": ("embeddings.weight", (cfg.d_vocab, d)), "ln_final.w": ("norm_f.weight", (d,))}
    for l, kind in enumerate(cfg.sublayers):
        o, t = f"blocks.{l}", f"layers.{l}.mixer"
        table[f"{o}.{'ln2' if kind == 'mlp' else 'ln1'}.w"] = (f"layers.{l}.norm.weight", (d,))
        if kind == "mixer":
            table.update({ours: (theirs.replace(".mamba.", ".mixer."), shape)
                          for ours, (theirs, shape) in mixer_names(cfg, l).items()})
        elif kind == "attn":
            table[f"{o}.attn.out.weight"] = (f"{t}.o_proj.weight", (d, cfg.n_heads * cfg.d_head))
        elif cfg.layer_sparse(l):
            table.update(_experts_names(cfg, o, t))
        else:
            table.update(_mlp_names(cfg, f"{o}.mlp", t, cfg.d_mlp))
    return table


def _mlp_names(cfg: DecoderConfig, ours: str, theirs: str, width: int, d_in: Optional[int] = None) -> dict:
    d = d_in or cfg.d_model
    table = {f"{ours}.fc_in.weight": (f"{theirs}.up_proj.weight", (width, d)),
             f"{ours}.fc_out.weight": (f"{theirs}.down_proj.weight", (d, width))}
    if cfg.mlp_bias:
        table.update({f"{ours}.fc_in.bias": (f"{theirs}.up_proj.bias", (width,)),
                      f"{ours}.fc_out.bias": (f"{theirs}.down_proj.bias", (d,))})
    return table


def _experts_names(cfg: DecoderConfig, o: str, t: str) -> dict:
    """A MoE layer's router, selection bias, routed experts (one file tensor each, as save_pretrained writes them),
    shared expert and latent projections."""
    experts, d = cfg.experts, cfg.d_model
    d_in, m = experts.latent or d, cfg.expert_width
    table = {f"{o}.mlp.W_gate.weight": (f"{t}.gate.weight", (experts.n, d)),
             f"{o}.mlp.e_score_correction_bias": (f"{t}.gate.e_score_correction_bias", (experts.n,))}
    for e in range(experts.n):
        table[f"{o}.mlp.experts.{e}.W_in.weight"] = (f"{t}.experts.{e}.up_proj.weight", (m, d_in))
        table[f"{o}.mlp.experts.{e}.W_out.weight"] = (f"{t}.experts.{e}.down_proj.weight", (d_in, m))
    table.update(_mlp_names(cfg, f"{o}.mlp.shared_expert", f"{t}.shared_experts", experts.shared))
    if experts.latent is not None:
        for proj, shape in (("fc1_latent_proj", (experts.latent, d)), ("fc2_latent_proj", (d, experts.latent))):
            table[f"{o}.mlp.{proj}.weight"] = (f"{t}.{proj}.weight", shape)
            if cfg.mlp_bias:
                table[f"{o}.mlp.{proj}.bias"] = (f"{t}.{proj}.bias", shape[:1])
    return table


def _split_merged_experts(source: Source, cfg: DecoderConfig) -> None:
    """A file with each MoE layer's experts stacked (transformers' in-memory layout, experts.up_proj [experts d_mlp
    d_in]) read as one tensor per expert, the layout save_pretrained writes."""
    for l in filter(cfg.layer_sparse, range(cfg.n_layers)):
        t = f"layers.{l}.mixer.experts"
        for proj in ("up_proj", "down_proj"):
            if f"{t}.{proj}" in source.state:
                stacked = source.take(f"{t}.{proj}", tuple(source.state[f"{t}.{proj}"].shape))
                if stacked.shape[0] != cfg.experts.n:
                    raise CheckpointError(f"{t}.{proj} in {source.directory} stacks {stacked.shape[0]} experts; "
                                          f"config.json says n_routed_experts={cfg.experts.n}")
                source.state.update({f"{t}.{e}.{proj}.weight": w for e, w in enumerate(stacked)})


def nemotron_h_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    for name in [n for n in source.state if n.startswith("mtp.")]:  # the multi-token-prediction layers
        del source.state[name]
    _split_merged_experts(source, cfg)
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in tensor_names(cfg).items()}
    for l in (l for l, kind in enumerate(cfg.sublayers) if kind == "attn"):
        out.update(take_qkv(source, cfg, l, lambda p, kind, l=l: f"layers.{l}.mixer.{p}_proj.{kind}"))
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    return out


def nemotron_h_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """The released files' layout (and save_pretrained's): under `backbone.`, one tensor per expert."""
    out = {f"backbone.{theirs}": params[ours] for ours, (theirs, _) in tensor_names(cfg).items()}
    for l in (l for l, kind in enumerate(cfg.sublayers) if kind == "attn"):
        out.update(split_qkv(params, cfg, l, lambda p, kind, l=l: f"backbone.layers.{l}.mixer.{p}_proj.{kind}"))
    out["lm_head.weight"] = params["unembed.weight"]  # (a tied model's too: the format never ties, see the top)
    return {k: v.float().contiguous() if k.endswith("e_score_correction_bias") else v.contiguous()
            for k, v in out.items()}


__all__ = ["nemotron_h_config", "nemotron_h_config_to_hf", "nemotron_h_to_hf", "nemotron_h_to_probe"]
