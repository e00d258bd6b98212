"""transformer-lens 4's bridge names for a Zamba2 hybrid layer (probe.shared_block), as probe.bridge_names builds them
for the other blocks. TL 4.3's Zamba2 adapter hooks a hybrid layer's ends alone (its `norm` and `mixer` are declared
on the Mamba-2 layers, which a hybrid layer wraps); probe also answers to the names the bridge gives a Mamba-2 layer's
norm and mixer, for the hybrid layer's own, so the mixers are named alike in every layer."""
from __future__ import annotations


def shared_block_names(b: str) -> tuple[dict[str, str], dict[str, str]]:
    """({bridge name: probe point}, {bridge name left out: what to hook instead}) for hybrid block `b`."""
    mixer = f"{b}.mixer"
    aliases = {f"{b}.hook_in": f"{b}.hook_resid_pre", f"{b}.hook_out": f"{b}.hook_resid_post",
               **{f"{b}.norm.{p}": f"{b}.ln1.{p}" for p in ("hook_in", "hook_scale", "hook_normalized", "hook_out")},
               f"{mixer}.hook_in": f"{b}.ln1.hook_out", f"{mixer}.in_proj.hook_in": f"{b}.ln1.hook_out",
               f"{mixer}.hook_out": f"{b}.hook_mixer_out", f"{mixer}.out_proj.hook_out": f"{b}.hook_mixer_out",
               f"{mixer}.in_proj.hook_out": f"{mixer}.hook_in_proj", f"{mixer}.conv1d.hook_out": f"{mixer}.hook_conv",
               f"{mixer}.inner_norm.hook_out": f"{mixer}.hook_inner_norm",
               f"{mixer}.out_proj.hook_in": f"{mixer}.hook_inner_norm"}
    state = (f"probe does not keep the state at every position; what writes and reads it is hooked: {mixer}.hook_conv "
             f"(x, B, C), hook_dt and hook_scan_out")
    return aliases, {f"{mixer}.hook_ssm_state": state, f"{mixer}.hook_ssm_write": state}


def mamba_layer_names(b: str) -> dict[str, str]:
    """The names TL 4.3's Zamba2 adapter adds to a Mamba-2 layer's mixer beyond probe.bridge_names' state-space ones:
    its output projection's ends."""
    return {f"{b}.mixer.out_proj.hook_in": f"{b}.mixer.hook_inner_norm", f"{b}.mixer.out_proj.hook_out": f"{b}.hook_attn_out"}


def shared_block_shapes(cfg, b: str, batch: int, pos: int) -> dict[str, tuple[int, ...]]:
    """The shapes of hybrid block `b`'s own points (its attention's and mixer's are the other blocks' shapes)."""
    d, m = cfg.d_model, cfg.d_mlp
    return {f"{b}.hook_shared_in": (batch, pos, 2 * d), f"{b}.ln_shared.hook_scale": (batch, pos, 1),
            f"{b}.ln_shared.hook_normalized": (batch, pos, 2 * d), f"{b}.ln2.hook_scale": (batch, pos, 1),
            f"{b}.ln2.hook_normalized": (batch, pos, d),
            **{f"{b}.mlp.hook_{name}": (batch, pos, m) for name in ("pre", "pre_linear", "post")},
            **{f"{b}.hook_{name}": (batch, pos, d) for name in ("mlp_out", "shared_out", "mixer_in", "mixer_out")}}
