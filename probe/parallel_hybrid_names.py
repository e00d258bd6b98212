"""transformer-lens 4's bridge names for Falcon-H1's parallel hybrid blocks (probe.blocks.ParallelHybridBlock): its
Mamba-2 mixer under the bridge's `mamba` (SSM2MixerBridge), and the bridge's points for values before a multiplier that
probe folds into the weights (probe.checkpoint_falcon_h1), left out with where probe has them."""
from __future__ import annotations

from probe.config import DecoderConfig

_FOLD = "probe folds Falcon-H1's {} into the weights, so it has this value only {}"


def parallel_mixer_aliases(cfg: DecoderConfig, b: str) -> dict[str, str]:
    """The bridge's mixer points whose values are probe's: {bridge name: probe point} for block `b`."""
    m = f"{b}.mamba"
    out = {f"{m}.hook_in": f"{b}.ln1.hook_out", f"{m}.conv1d.hook_out": f"{m}.hook_conv",
           f"{m}.out_proj.hook_in": f"{m}.hook_inner_norm"}
    if cfg.parallel_state_space.inner_norm is not None:
        out[f"{m}.inner_norm.hook_out"] = f"{m}.hook_inner_norm"
    return out


def parallel_hybrid_left_out(b: str) -> dict[str, str]:
    """{bridge name: what to hook instead} for block `b`: values before a folded multiplier, and the mixer's state."""
    m = f"{b}.mamba"
    scaled = {"attention_out_multiplier": (f"{b}.hook_attn_out", (f"{b}.attn.hook_out", f"{b}.attn.o.hook_out",
                                                                  f"{b}.attn.hook_hidden_states")),
              "ssm_out_multiplier": (f"{b}.hook_mixer_out", (f"{m}.hook_out", f"{m}.hook_ssm_out",
                                                             f"{m}.out_proj.hook_out")),
              # (the MLP module's own output is after it: the bridge's mlp.hook_out is probe's hook_mlp_out)
              "mlp_multipliers' second": (f"{b}.hook_mlp_out", (f"{b}.mlp.out.hook_out",))}
    out = {name: _FOLD.format(multiplier, f"times it: {ours}")
           for multiplier, (ours, names) in scaled.items() for name in names}
    before = f"before it: {b}.ln1.hook_out (the layer's weights hold the multiplier)"
    out.update(dict.fromkeys((f"{b}.attn.hook_in", f"{b}.attn.qkv.hook_in"), _FOLD.format("attention_in_multiplier",
                                                                                          before)))
    out[f"{m}.in_proj.hook_in"] = _FOLD.format("ssm_in_multiplier", before)
    out[f"{m}.in_proj.hook_out"] = _FOLD.format("ssm_multipliers (one per part of in_proj)", f"times them: "
                                                f"{m}.hook_in_proj")
    out[f"{b}.mlp.gate.hook_out"] = _FOLD.format("mlp_multipliers' first", f"times it: {b}.mlp.hook_pre (what the "
                                                 "activation reads)")
    out.update({
        f"{m}.inner_norm.hook_gate": f"the gate is the first channels of {m}.hook_in_proj",
        f"{m}.hook_ssm_state": f"probe does not keep the state at every position (a [batch pos head d_head d_state] "
                               f"tensor); what writes and reads it is hooked: {m}.hook_conv (x, B, C), hook_dt and "
                               f"hook_scan_out",
        f"{m}.hook_ssm_write": f"probe does not form each position's write dt x B^T; its parts are {m}.hook_conv and "
                               f"hook_dt",
        f"{m}.conv1d.hook_in": f"the convolution's input is {m}.hook_in_proj's x, B and C channels ([batch pos ...], "
                               f"not the convolution's [batch channel pos])",
        f"{m}.inner_norm.hook_in": f"the gated norm's input is {m}.hook_scan_out ([batch pos head d_head]; flatten its "
                                   f"last two dimensions for the bridge's)"})
    return out


def add_parallel_hybrid_names(cfg: DecoderConfig, b: str, aliases: dict[str, str], left_out: dict[str, str]) -> None:
    """Block `b`'s names into probe.bridge_names' tables: the left-out ones first, so the attention block's own
    aliases for them are dropped."""
    left_out.update(parallel_hybrid_left_out(b))
    aliases.update(parallel_mixer_aliases(cfg, b))
