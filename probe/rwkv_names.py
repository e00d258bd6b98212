"""transformer-lens 4's bridge names for an RWKV-4 layer (its RwkvArchitectureAdapter: `time_mix` over transformers'
`attention`, `channel_mix` over its `feed_forward`, each projection a LinearBridge under transformers' name, the
channel mix's key and value also as `in` and `out`), as probe.bridge_names builds them for the other mixers; and
the shapes of the mixers' points, for probe.shapes."""
from __future__ import annotations

NORM_POINTS = ("hook_in", "hook_scale", "hook_normalized", "hook_out")


def rwkv_names(b: str, layer: int) -> dict[str, str]:
    """{bridge name: probe point} for block `b`, layer `layer`: the bridge hooks nothing probe lacks."""
    time, channel = f"{b}.time_mix", f"{b}.channel_mix"
    aliases = {f"{b}.hook_in": f"{b}.hook_resid_pre", f"{b}.hook_out": f"{b}.hook_resid_post",
               f"{time}.hook_in": f"{b}.ln1.hook_out", f"{b}.hook_time_mix_in": f"{b}.ln1.hook_out",
               f"{time}.key.hook_in": f"{time}.hook_key_in", f"{time}.key.hook_out": f"{time}.hook_k",
               f"{time}.value.hook_in": f"{time}.hook_value_in", f"{time}.value.hook_out": f"{time}.hook_v",
               f"{time}.receptance.hook_in": f"{time}.hook_receptance_in",
               f"{time}.receptance.hook_out": f"{time}.hook_r", f"{time}.output.hook_in": f"{time}.hook_gated",
               f"{time}.output.hook_out": f"{b}.hook_attn_out", f"{time}.hook_out": f"{b}.hook_attn_out",
               f"{b}.hook_time_mix_out": f"{b}.hook_attn_out",
               f"{channel}.hook_in": f"{b}.ln2.hook_out", f"{b}.hook_channel_mix_in": f"{b}.ln2.hook_out",
               # (the bridge's MLPBridge fires in.hook_in with the channel mix's own input, ln2's output, not the
               # token-shift mix key reads: probe's channel_mix.hook_key_in)
               f"{channel}.in.hook_in": f"{b}.ln2.hook_out", f"{channel}.in.hook_out": f"{channel}.hook_pre",
               f"{channel}.out.hook_in": f"{channel}.hook_post", f"{channel}.out.hook_out": f"{channel}.hook_value",
               f"{channel}.receptance.hook_in": f"{channel}.hook_receptance_in",
               f"{channel}.receptance.hook_out": f"{channel}.hook_r", f"{channel}.hook_out": f"{b}.hook_mlp_out",
               f"{b}.hook_channel_mix_out": f"{b}.hook_mlp_out"}
    if layer == 0:
        # transformers runs pre_ln inside block 0, so the bridge's block 0 begins before it; probe's pre_ln is the
        # embedding's norm (embed.ln), and blocks.0.hook_resid_pre the residual after it, where every layer adds
        aliases[f"{b}.hook_in"] = "embed.ln.hook_in"
        aliases.update({f"{b}.pre_ln.{point}": f"embed.ln.{point}" for point in NORM_POINTS})
    return aliases


def rwkv_shapes(cfg, b: str, batch: int, pos: int) -> dict[str, tuple[int, ...]]:
    """The shapes of block `b`'s time-mix and channel-mix points (probe.rwkv) for `pos` positions."""
    d, width, m = cfg.d_model, cfg.rwkv.d_attention, cfg.d_mlp
    widths = {"time_mix": dict.fromkeys(("key_in", "value_in", "receptance_in"), d) | dict.fromkeys(
                  ("k", "v", "r", "wkv", "gated"), width),
              "channel_mix": dict.fromkeys(("key_in", "receptance_in", "value", "r"), d) | dict.fromkeys(
                  ("pre", "post"), m)}
    return {f"{b}.{mixer}.hook_{name}": (batch, pos, n)
            for mixer, points in widths.items() for name, n in points.items()}
