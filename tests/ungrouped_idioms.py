"""What circuit code reads and edits on a grouped-query model once its keys and values are ungrouped
(transformer-lens's `ungroup_grouped_query_attention`, which EAP-IG turns on for Llama-style models), written once as
transformer-lens code: the oracle (tests/saelens_oracle.py `ungrouped`, HookedTransformer of transformer-lens 3) and
tests/test_ungrouped.py (probe) each run `ungrouped_idioms` on a model built from the same config with the same
weights. Attribute access only, no imports from either library."""
from __future__ import annotations

import torch

CACHED = ("q", "k", "v", "rot_k", "k_input", "v_input", "z", "pattern")


def ungrouped_idioms(model, tokens: torch.Tensor) -> dict:
    out = {}
    model.cfg.ungroup_grouped_query_attention = True  # as EAP-IG's setup assigns it
    model.set_use_split_qkv_input(True)
    try:
        with torch.no_grad():
            logits, cache = model.run_with_cache(tokens)
        out["logits"] = logits
        out.update({f"cache.{name}{layer}": cache[name, layer] for layer in range(model.cfg.n_layers) for name in CACHED
                    if f"blocks.{layer}.attn.hook_{name}" in cache or f"blocks.{layer}.hook_{name}" in cache})

        def halve_one_query_heads_key_input(act, hook):  # an edit that reaches query head 1's key alone
            act[:, :, 1] = act[:, :, 1] * 0.5

        def zero_one_query_heads_value(act, hook):
            act[:, :, 2] = 0.0
            return act

        with torch.no_grad():
            out["edited"] = model.run_with_hooks(tokens, fwd_hooks=[
                ("blocks.0.hook_k_input", halve_one_query_heads_key_input),
                ("blocks.1.attn.hook_v", zero_one_query_heads_value)])

        # EAP's backward: the gradient of a metric at every head's own q, k and v input
        grads = {}

        def keep_gradient(grad, hook):
            grads[f"grad.{hook.name}"] = grad.detach().clone()

        names = [f"blocks.{layer}.hook_{x}_input" for layer in range(model.cfg.n_layers) for x in "qkv"]
        for name in names:
            model.add_hook(name, keep_gradient, dir="bwd")
        try:
            model(tokens)[:, -1, :3].sum().backward()
        finally:
            model.reset_hooks()
        out.update(grads)
        # without the key/value cache: transformer-lens 3.9's cache keeps key/value heads, so it fails ungrouped
        out["generated"] = model.generate(tokens[:1, :4], max_new_tokens=3, do_sample=False, stop_at_eos=False,
                                          use_past_kv_cache=False, verbose=False)
    finally:
        model.cfg.ungroup_grouped_query_attention = False
        model.set_use_split_qkv_input(False)
    with torch.no_grad():
        out["logits_after"] = model(tokens)
        out["k_after"] = model.run_with_cache(tokens, names_filter="blocks.0.attn.hook_k")[1]["k", 0]
    return out
