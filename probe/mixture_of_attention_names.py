"""transformer-lens 4's names on JetMoE's blocks (its adapter delegates the mixture of attention heads to transformers,
hooking the router, the shared key/value projection and the pattern; probe.mixture_of_attention): what maps onto
probe's points, and where the rest are. probe.delegated_attention_names calls mixture_of_attention_names per layer."""
from __future__ import annotations


def mixture_of_attention_names(b: str, aliases: dict[str, str], left_out: dict[str, str]) -> None:
    """Block `b`'s attention names, added to (or taken from) `aliases` and `left_out`."""
    a = f"{b}.attn"
    for part in "qkv":  # (no q, k or v Linear of its own: the queries are the chosen experts', k and v one projection)
        aliases.pop(f"{a}.{part}.hook_out", None)
    for name in (f"{a}.o.hook_in", f"{a}.o.hook_out"):
        aliases.pop(name, None)
    routing = (f"probe hooks the attention router's choice, not its logits: {a}.hook_expert_weights (the chosen "
               f"experts' softmax weights, zeros elsewhere, [batch*pos experts]) and {a}.hook_expert_indices "
               f"([batch*pos per_token], each slot's expert, the best first); the router reads {b}.ln1.hook_out")
    split = (f"probe hooks the keys and values apart, {a}.hook_k and {a}.hook_v ([batch pos kv_head d_head] each; the "
             f"bridge's is both, flattened, [batch pos (2 kv_head d_head)])")
    left_out.update({f"{a}.experts.router.hook_in": routing, f"{a}.experts.router.hook_out": routing,
                     f"{a}.kv.hook_in": f"the shared key/value projection reads {b}.ln1.hook_out (all of it)",
                     f"{a}.kv.hook_out": split, f"{a}.hook_kv": split})
