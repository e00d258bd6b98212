"""Zamba2's shared transformer blocks, as a config choice (the blocks themselves: probe.shared_block)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SharedBlocks:
    """Transformer blocks whose weights several layers share (Zyphra's Zamba2): in each layer `layers` names, before
    its Mamba-2 mixer, one of `n_blocks` blocks (the k-th such layer runs block k % n_blocks, the file's
    num_mem_blocks) reads the residual beside the original embeddings (2 d_model wide) and writes into the mixer's
    input. Every invocation has its own low-rank adapters (`adapter_rank`) on the MLP's gate and up projections, and,
    where `attention_adapters`, on q, k and v (the file's use_shared_attention_adapter)."""

    layers: tuple[bool, ...]
    n_blocks: int = 1
    adapter_rank: int = 128
    attention_adapters: bool = False

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        if not all(isinstance(x, bool) for x in layers) or not any(layers):
            raise ValueError(f"SharedBlocks.layers={self.layers!r} must say for each layer True (a shared block before "
                             "its mixer) or False, with at least one True (else leave shared_blocks None)")
        object.__setattr__(self, "layers", layers)
        for name in ("n_blocks", "adapter_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SharedBlocks.{name} must be a positive int, got {value!r}")
        if not isinstance(self.attention_adapters, bool):
            raise ValueError(f"SharedBlocks.attention_adapters must be a bool, got {self.attention_adapters!r}")

    @property
    def hybrid_layers(self) -> list[int]:
        """The layers that run a shared block, in order (the file's hybrid_layer_ids)."""
        return [layer for layer, shared in enumerate(self.layers) if shared]

    def invocation(self, layer: int) -> int:
        """`layer`'s place among the layers that run a shared block: the index of its own adapters."""
        return self.hybrid_layers.index(layer)

    def block_of(self, layer: int) -> int:
        """Which of the n_blocks shared blocks `layer` runs."""
        return self.invocation(layer) % self.n_blocks

    def first_layer(self, block: int) -> int:
        """The first layer that runs `block`: where its weights live (in probe and in the file)."""
        return self.hybrid_layers[block]

    @classmethod
    def of(cls, value, cfg) -> "SharedBlocks | None":
        """DecoderConfig.shared_blocks as given (a SharedBlocks, its fields as a dict, or None), checked against `cfg`."""
        spec = cls(**value) if isinstance(value, dict) else value
        if spec is None:
            return None
        if not isinstance(spec, cls) or len(spec.layers) != cfg.n_layers:
            raise ValueError(f"shared_blocks={value!r} must be a SharedBlocks (or its fields as a dict) whose layers give "
                             f"each of the n_layers={cfg.n_layers} layers True or False")
        space = cfg.state_space
        wrong = {"state_space": space is None or space.kind != "mamba2" or not all(space.layers),
                 "attn_only": not cfg.attn_only, "gated_mlp": not cfg.gated_mlp, "norm": cfg.norm.value != "rms",
                 "n_heads * d_head": cfg.n_heads * cfg.d_head != 2 * cfg.d_model,
                 "n_kv_heads": spec.attention_adapters and cfg.n_kv_heads != cfg.n_heads,
                 "biases": cfg.qkv_bias or cfg.out_bias or cfg.mlp_bias,
                 "experts": cfg.experts is not None, "sliding_window": cfg.sliding_window is not None,
                 "heads_per_layer": cfg.heads_per_layer is not None, "qk_norm": cfg.qk_norm,
                 "linear_attention": cfg.linear_attention is not None, "bidirectional": cfg.bidirectional,
                 "parallel_state_space": cfg.parallel_state_space is not None, "sublayers": cfg.sublayers is not None,
                 "short_conv": cfg.short_conv is not None, "latent_attention": cfg.latent_attention is not None}
        names = [name for name, bad in wrong.items() if bad]
        if names:
            raise ValueError(f"shared blocks (Zamba2's) sit in models whose every layer is a Mamba-2 mixer without an "
                             f"MLP of its own (state_space on every layer, attn_only), with RMS norms, a gated MLP, no "
                             f"biases, heads 2 * d_model wide in all (n_heads * d_head), key/value heads as many as "
                             f"query heads under attention adapters, and no other layer kinds; these settings differ: "
                             f"{', '.join(names)}")
        return spec
