"""Zamba2 checkpoints (`zamba2`, Zamba2ForCausalLM; Zyphra's Zamba2-1.2B, -2.7B, -7B and their instruct models):
every layer a Mamba-2 mixer (probe.state_space, `mamba` in the file, `mixer` here) without an MLP; the layers
`layers_block_type` calls "hybrid" first run one of num_mem_blocks shared transformer blocks (probe.shared_block) on
the residual beside the original embeddings, its output projected by the layer's own `linear` into the mixer's input.

The file keeps each shared block's weights once, under the first hybrid layer that runs it
(`layers.L.shared_transformer.`), with every invocation's adapters in that layer's lists, at the invocation's index
among the hybrid layers (`gate_up_proj_adapter_list.i`, `linear_{q,k,v}_adapter_list.i`); a hybrid layer's mixer is
under `layers.L.mamba_decoder.`. probe holds the shared weights as one Parameter in every layer running the block, and
saves them once, so transformers reloads the same model.

Refused: untied embeddings (transformers 5.25 ties the shared blocks only where it ties the embeddings, so an untied
file's hybrid layers each run a copy of their own, with adapters of their own; every released Zamba2 is tied),
add_bias_linear (biases on the mixers' projections and the MLP; no released model has them) and an
rms_norm_eps other than 1e-5 (transformers' gated norm in the mixer keeps 1e-5 whatever the file says; probe's mixer
norm uses the model's eps)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from probe.checkpoint_mamba import mixer_names
from probe.checkpoint_rope import rope_from_hf, rope_to_hf
from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, GPT_ACTIVATIONS, Source, activation_of, require_fields,
                                     special_token_ids, take_unembed, with_defaults)
from probe.config import Activation, DecoderConfig, Norm, Positions, StateSpace
from probe.config_file import CheckpointError
from probe.config_shared_block import SharedBlocks
from probe.tokenizer import Tokenizer

# transformers' Zamba2Config defaults for the fields a saved file may leave out
DEFAULTS = dict(vocab_size=32000, max_position_embeddings=4096, hidden_size=2560, num_hidden_layers=54,
                mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, time_step_min=0.001,
                n_mamba_heads=8, add_bias_linear=False, hidden_act="gelu", num_attention_heads=32, num_mem_blocks=1,
                use_shared_attention_adapter=False, adapter_rank=128, use_mem_rope=False, rms_norm_eps=1e-5,
                tie_word_embeddings=True, use_long_context=False)
HYBRID, MAMBA = "hybrid", ("linear_attention", "mamba")  # (transformers 5's spelling of a Mamba layer, the files')


def default_layer_kinds() -> list[str]:
    """transformers' layers_block_type where the file gives none (Zamba2-2.7B's 54 layers)."""
    return (["linear_attention"] + (["linear_attention"] * 5 + [HYBRID]) * 7 + ["linear_attention"] * 4 + [HYBRID]
            + ["linear_attention"] * 3 + [HYBRID] + ["linear_attention"] * 2)


def zamba2_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, **DEFAULTS)
    n, d, heads = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
    kinds = hf.get("layers_block_type") or default_layer_kinds()
    if len(kinds) != n or set(kinds) - {HYBRID, *MAMBA}:
        raise CheckpointError(f"layers_block_type={kinds!r} must name each of the {n} layers 'linear_attention' "
                              "(Mamba-2) or 'hybrid' (a shared block, then Mamba-2)")
    if not hf["tie_word_embeddings"]:
        raise CheckpointError("tie_word_embeddings=false: transformers then ties no shared block either, so each hybrid "
                              "layer runs a copy of its own, which probe (one block's weights in every layer running "
                              "it) does not read; every released Zamba2 ties both")
    if hf["add_bias_linear"]:
        raise CheckpointError("add_bias_linear=true (biases on the mixers' projections and the shared MLP) is not read: "
                              "no released Zamba2 has them")
    if hf["rms_norm_eps"] != 1e-5:
        raise CheckpointError(f"rms_norm_eps={hf['rms_norm_eps']}: transformers' Zamba2 mixers normalise with 1e-5 "
                              "whatever the file says, and probe's with the model's eps; only 1e-5 is read")
    rope, scaling = rope_from_hf(hf)
    if scaling is not None:
        raise CheckpointError(f"rope_parameters={rope!r}: Zamba2's shared attention rotates with the default rope only")
    mamba_heads = hf["n_mamba_heads"]
    space = StateSpace(layers=(True,) * n, n_heads=mamba_heads, d_head=int(hf["mamba_expand"] * d) // mamba_heads,
                       d_state=hf["mamba_d_state"], n_groups=hf["mamba_ngroups"], conv_kernel=hf["mamba_d_conv"],
                       conv_bias=True, proj_bias=False, dt_min=float(hf["time_step_min"]), dt_max=math.inf)
    shared = SharedBlocks(layers=tuple(kind == HYBRID for kind in kinds), n_blocks=hf["num_mem_blocks"],
                          adapter_rank=hf["adapter_rank"], attention_adapters=hf["use_shared_attention_adapter"])
    d_head = 2 * d // heads  # the shared attention reads [residual; embeddings], 2 d_model wide
    return DecoderConfig(
        n_layers=n, d_model=d, n_heads=heads, d_head=d_head, n_kv_heads=hf.get("num_key_value_heads") or heads,
        d_mlp=hf.get("intermediate_size") or 4 * d, d_vocab=hf["vocab_size"],
        n_ctx=16384 if hf["use_long_context"] else hf["max_position_embeddings"], eps=hf["rms_norm_eps"],
        activation=activation_of(hf["hidden_act"], GPT_ACTIVATIONS), gated_mlp=True, norm=Norm.RMS,
        positions=Positions.ROTARY, rotary_base=float(rope.get("rope_theta", 10000.0)),
        rotary_layers=None if hf["use_mem_rope"] else (False,) * n, attn_scale_dim=d_head / 2, attn_only=True,
        qkv_bias=False, out_bias=False, mlp_bias=False, tied_embeddings=True, state_space=space,
        shared_blocks=shared)


def zamba2_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    shared, space = cfg.shared_blocks, cfg.state_space
    if shared is None:
        raise ValueError("a zamba2 checkpoint holds Mamba-2 layers with shared transformer blocks; this model has "
                         "shared_blocks=None")
    rope = cfg.rotary_layers is None
    if not (rope or not any(cfg.rotary_layers)) or space.inner_norm != "after_gate" or space.dt_max != math.inf:
        raise ValueError(f"a zamba2 checkpoint rotates every shared attention or none, normalises the mixers after "
                         f"their gates and bounds no step from above; this model has rotary_layers={cfg.rotary_layers}"
                         f", state_space={space!r}")
    require_fields(cfg, "zamba2", state_space=space, shared_blocks=shared, rotary_layers=cfg.rotary_layers,
                   tied_embeddings=True,
                   attn_scale_dim=cfg.d_head / 2, eps=1e-5, norm=Norm.RMS, positions=Positions.ROTARY,
                   activation=frozenset(GPT_ACTIVATION_NAMES) - {Activation.XIELU}, gated_mlp=True,
                   attn_only=True, qkv_bias=False, out_bias=False, mlp_bias=False, rotary_scaling=None,
                   rotary_dim=cfg.d_head)
    expand = space.d_inner / cfg.d_model
    return {"model_type": "zamba2", "architectures": ["Zamba2ForCausalLM"], "num_hidden_layers": cfg.n_layers,
            "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "intermediate_size": cfg.d_mlp, "vocab_size": cfg.d_vocab, "max_position_embeddings": cfg.n_ctx,
            "rms_norm_eps": cfg.eps, "hidden_act": GPT_ACTIVATION_NAMES[cfg.activation], **rope_to_hf(cfg),
            "use_mem_rope": rope, "tie_word_embeddings": True,
            "layers_block_type": [HYBRID if s else "linear_attention" for s in shared.layers],
            "num_mem_blocks": shared.n_blocks, "adapter_rank": shared.adapter_rank,
            "use_shared_attention_adapter": shared.attention_adapters, "n_mamba_heads": space.n_heads,
            "mamba_expand": int(expand) if expand == int(expand) else expand, "mamba_d_state": space.d_state,
            "mamba_ngroups": space.n_groups, "mamba_d_conv": space.conv_kernel, "time_step_min": space.dt_min,
            "add_bias_linear": False, **special_token_ids(tokenizer)}


def zamba2_names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape) for every tensor each layer holds alone (the shared blocks' apart: shared_names)."""
    d, shared = cfg.d_model, cfg.shared_blocks
    table = {"embed.W_E": ("embed_tokens.weight", (cfg.d_vocab, d)), "ln_final.w": ("final_layernorm.weight", (d,))}
    for l in range(cfg.n_layers):
        mixer = f"layers.{l}.mamba_decoder" if shared.layers[l] else f"layers.{l}"
        table[f"blocks.{l}.ln1.w"] = (f"{mixer}.input_layernorm.weight", (d,))
        table.update({ours: (theirs.replace(f"layers.{l}.mamba", f"{mixer}.mamba"), shape)
                      for ours, (theirs, shape) in mixer_names(cfg, l).items()})
        if shared.layers[l]:
            table[f"blocks.{l}.linear.weight"] = (f"layers.{l}.linear.weight", (d, d))
            table.update(adapter_names(cfg, l))
    return table


def adapter_names(cfg: DecoderConfig, layer: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """`layer`'s own adapters, kept in the lists of the first layer running its block, at its invocation's index."""
    shared, d, rank = cfg.shared_blocks, cfg.d_model, cfg.shared_blocks.adapter_rank
    i = shared.invocation(layer)
    t, o = f"layers.{shared.first_layer(shared.block_of(layer))}.shared_transformer", f"blocks.{layer}"
    table = {f"{o}.mlp.adapter.down.weight": (f"{t}.feed_forward.gate_up_proj_adapter_list.{i}.0.weight", (rank, d)),
             f"{o}.mlp.adapter.up.weight": (f"{t}.feed_forward.gate_up_proj_adapter_list.{i}.1.weight",
                                            (2 * cfg.d_mlp, rank))}
    if shared.attention_adapters:
        for index, p in enumerate("qkv"):
            table[f"{o}.attn.adapters.{index}.down.weight"] = (f"{t}.self_attn.linear_{p}_adapter_list.{i}.0.weight",
                                                               (rank, 2 * d))
            table[f"{o}.attn.adapters.{index}.up.weight"] = (f"{t}.self_attn.linear_{p}_adapter_list.{i}.1.weight",
                                                             (2 * d, rank))
    return table


def shared_names(cfg: DecoderConfig, layer: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, shape) for the shared block `layer` runs, theirs where the file keeps it (under the block's
    first layer), q/k/v and gate/up apart (fused here)."""
    shared, d, m = cfg.shared_blocks, cfg.d_model, cfg.d_mlp
    t, o = f"layers.{shared.first_layer(shared.block_of(layer))}.shared_transformer", f"blocks.{layer}"
    q, kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    return {f"{o}.ln_shared.w": (f"{t}.input_layernorm.weight", (2 * d,)),
            f"{o}.attn.q": (f"{t}.self_attn.q_proj.weight", (q, 2 * d)),
            f"{o}.attn.k": (f"{t}.self_attn.k_proj.weight", (kv, 2 * d)),
            f"{o}.attn.v": (f"{t}.self_attn.v_proj.weight", (kv, 2 * d)),
            f"{o}.attn.out.weight": (f"{t}.self_attn.o_proj.weight", (d, q)),
            f"{o}.ln2.w": (f"{t}.pre_ff_layernorm.weight", (d,)),
            f"{o}.mlp.gate_up": (f"{t}.feed_forward.gate_up_proj.weight", (2 * m, d)),
            f"{o}.mlp.fc_out.weight": (f"{t}.feed_forward.down_proj.weight", (d, m))}


def fuse(parts: dict[str, torch.Tensor], o: str) -> dict[str, torch.Tensor]:
    """shared_names' tensors in probe's names: q, k, v fused into attn.qkv, the gate and up projections apart."""
    out = {k: v for k, v in parts.items() if not k.endswith((".attn.q", ".attn.k", ".attn.v", ".mlp.gate_up"))}
    out[f"{o}.attn.qkv.weight"] = torch.cat([parts[f"{o}.attn.{p}"] for p in "qkv"])
    out[f"{o}.mlp.gate.weight"], out[f"{o}.mlp.fc_in.weight"] = parts[f"{o}.mlp.gate_up"].chunk(2)
    return out


def zamba2_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in zamba2_names(cfg).items()}
    shared, read = cfg.shared_blocks, {}
    for layer in shared.hybrid_layers:
        first = shared.first_layer(shared.block_of(layer))
        if first not in read:  # the block's one copy, under its first layer
            read[first] = {ours: source.take(theirs, shape) for ours, (theirs, shape) in shared_names(cfg, layer).items()}
        elif f"layers.{layer}.shared_transformer.input_layernorm.weight" in source.state:
            # a file that repeats the tied weights under every layer: each copy must be the block's
            for ours, (theirs, shape) in shared_names(cfg, layer).items():
                again = source.take(theirs.replace(f"layers.{first}.", f"layers.{layer}."), shape)
                if not torch.equal(again, read[first][ours.replace(f"blocks.{layer}.", f"blocks.{first}.")]):
                    raise CheckpointError(f"layer {layer}'s copy of shared block {shared.block_of(layer)} differs "
                                          f"from layer {first}'s; Zamba2 ties them: fix the file")
        mine = {ours.replace(f"blocks.{first}.", f"blocks.{layer}."): tensor for ours, tensor in read[first].items()}
        out.update(fuse(mine, f"blocks.{layer}"))
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    return out


def zamba2_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {f"model.{theirs}": params[ours] for ours, (theirs, _) in zamba2_names(cfg).items()}
    shared = cfg.shared_blocks
    for block in range(min(shared.n_blocks, len(shared.hybrid_layers))):  # once, under each block's first layer
        layer = shared.first_layer(block)
        o, names = f"blocks.{layer}", shared_names(cfg, layer)
        q_k_v = params[f"{o}.attn.qkv.weight"].split([names[f"{o}.attn.{p}"][1][0] for p in "qkv"])
        gate_up = torch.cat([params[f"{o}.mlp.gate.weight"], params[f"{o}.mlp.fc_in.weight"]])
        unfused = {**{f"{o}.attn.{p}": t for p, t in zip("qkv", q_k_v)}, f"{o}.mlp.gate_up": gate_up}
        for ours, (theirs, _) in names.items():
            out[f"model.{theirs}"] = unfused[ours] if ours in unfused else params[ours]
    return {k: v.contiguous() for k, v in out.items()}
