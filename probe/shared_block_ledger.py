"""The ledger's rows for a Zamba2 hybrid layer's shared block (probe.shared_block): the block's weights once, at the
first layer that runs it (they are one Parameter in every layer running it, as transformers ties them), and each
layer's own adapters and projection into its mixer."""
from __future__ import annotations


def add_shared_block(cfg, add, layer: int) -> None:
    """`add(component, group, params, layer)` the shared block rows of `layer` (its mixer is counted apart)."""
    spec, d, m = cfg.shared_blocks, cfg.d_model, cfg.d_mlp
    q, kv, rank = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head, spec.adapter_rank
    if spec.first_layer(spec.block_of(layer)) == layer:
        add("shared.norms", "norm", 2 * d + d, layer)  # over [residual; embeddings], then over attention's output
        add("shared.attn.qkv.weight", "attention", 2 * d * (q + 2 * kv), layer)
        add("shared.attn.out.weight", "attention", q * d, layer)
        add("shared.mlp.weight", "mlp", 3 * d * m, layer)  # gate, up and down
    add("shared.mlp.adapter.weight", "mlp", rank * (d + 2 * m), layer)
    add("shared.attn.adapters.weight", "attention", rank * (3 * 2 * d + q + 2 * kv) if spec.attention_adapters else 0,
        layer)
    add("shared.linear.weight", "attention", d * d, layer)
