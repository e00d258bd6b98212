"""transformer-lens 4's bridge names for an LFM2 short-convolution layer (its Lfm2ShortConvBridge under `conv`, with
the bridge's aliases), as probe.bridge_names builds them for the other mixers."""
from __future__ import annotations


def short_conv_names(b: str) -> tuple[dict[str, str], dict[str, str]]:
    """({bridge name: probe point}, {bridge name left out: what to hook instead}) for block `b`'s mixer."""
    mixer = f"{b}.conv"
    aliases = {f"{b}.hook_in": f"{b}.hook_resid_pre", f"{b}.hook_out": f"{b}.hook_resid_post",
               f"{mixer}.hook_in": f"{b}.ln1.hook_out", f"{mixer}.in.hook_in": f"{b}.ln1.hook_out",
               f"{mixer}.hook_out": f"{b}.hook_attn_out", f"{mixer}.out.hook_out": f"{b}.hook_attn_out",
               f"{mixer}.in.hook_out": f"{mixer}.hook_in_proj", f"{mixer}.out.hook_in": f"{mixer}.hook_gated"}
    # (the bridge's hook_conv is an alias of its convolution module's output)
    conv = (f"the bridge hooks the convolution as [batch channel pos] (its output before the causal trim, kernel - 1 "
            f"positions longer), and transformers' path reads the convolution's weight, not its module, so the bridge's "
            f"points do not fire; probe's are {mixer}.hook_conv_in (B * x) and {mixer}.hook_conv_out, [batch pos d_model]")
    return aliases, {f"{mixer}.conv.hook_in": conv, f"{mixer}.conv.hook_out": conv, f"{mixer}.hook_conv": conv}
