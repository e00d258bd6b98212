"""What a DecoderConfig says about each of its layers (a mixin of it): the heads, window and rotary positions of its
attention, whether it mixes positions linearly, and whether its MLP is a mixture of experts."""
from __future__ import annotations

import math
from typing import Optional

from probe.config_choices import Positions, RotaryScaling
from probe.config_rg_lru import bfloat16_rounded

# what one layer of a one-sublayer model holds (NemotronH): a state-space mixer, attention, or an MLP (or experts)
SUBLAYERS = ("mixer", "attn", "mlp")


class LayerFacts:
    """Methods only: the fields they read (heads_per_layer, sliding_layers, experts, ...) are DecoderConfig's."""

    def layer_heads(self, layer: int) -> int:
        """The number of query heads in `layer` (fewer than n_heads after structural pruning)."""
        return self.n_heads if self.heads_per_layer is None else self.heads_per_layer[layer]

    def layer_kv_heads(self, layer: int) -> int:
        if self.heads_per_layer is not None and self.n_kv_heads == self.n_heads:  # pruned heads keep their own
            return self.heads_per_layer[layer]
        return self.global_layers.n_kv_heads or self.n_kv_heads if self.layer_is_global(layer) else self.n_kv_heads

    def layer_is_global(self, layer: int) -> bool:
        """Whether `layer` is a full-attention layer shaped by global_layers (Gemma 4's), not like the windowed ones."""
        return self.global_layers is not None and self.layer_window(layer) is None

    def layer_d_head(self, layer: int) -> int:
        """The width of `layer`'s heads: d_head, or global_layers.d_head in a full-attention layer it shapes."""
        return self.global_layers.d_head if self.layer_is_global(layer) else self.d_head

    def layer_values_from_keys(self, layer: int) -> bool:
        """Whether `layer`'s values are its key projection's output (global_layers.values_from_keys)."""
        return self.layer_is_global(layer) and self.global_layers.values_from_keys

    def layer_kv_source(self, layer: int) -> Optional[int]:
        """The earlier layer whose keys and values `layer` attends over (shared_kv: the last layer of the same kind,
        windowed or full, before the shared ones), or None where `layer` computes its own."""
        if self.shared_kv is None or layer < self.n_layers - self.shared_kv.layers:
            return None
        window = self.layer_window(layer)
        own = [l for l in range(self.n_layers - self.shared_kv.layers) if self.layer_window(l) == window]
        return own[-1] if own else None

    def resume_layer(self, layer: int) -> int:
        """Where a run that changes `layer` onward must start: `layer`, or the earliest layer before it whose keys and
        values a later layer reuses (shared_kv), since those are computed nowhere else."""
        sources = (self.layer_kv_source(later) for later in range(layer, self.n_layers))
        return min([layer, *(source for source in sources if source is not None)])

    def layer_d_mlp(self, layer: int) -> int:
        """The width of `layer`'s dense MLP: d_mlp, or shared_kv.d_mlp in a layer that reuses keys and values."""
        if self.layer_kv_source(layer) is not None and self.shared_kv.d_mlp is not None:
            return self.shared_kv.d_mlp
        return self.d_mlp

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of `layer`'s attention, or None when it sees every earlier key."""
        windowed = self.sliding_layers is None or self.sliding_layers[layer]
        return self.sliding_window if windowed else None

    def layer_mask_key(self, layer: int):
        """What limits the keys `layer`'s queries see (the key of its mask): its sliding window (None: every earlier
        key), or its chunk (a config_chunked.Chunk: Llama 4's chunked layers)."""
        chunked = self.chunked_attention
        return self.layer_window(layer) if chunked is None else chunked.mask_key(layer)

    def layer_rotary(self, layer: int) -> tuple[float, Optional[RotaryScaling]]:
        """`layer`'s rotary base and frequency rescaling (a windowed layer's own, where sliding_rotary_base is set)."""
        if self.sliding_rotary_base is not None and self.layer_window(layer) is not None:
            return self.sliding_rotary_base, None
        return self.rotary_base, self.rotary_scaling

    def layer_rotary_dim(self, layer: int) -> int:
        """How many of each head's dimensions `layer` rotates: sliding_rotary_dim in a windowed layer where it is set
        (Laguna's), else rotary_dim (a whole head where rotary_dim is d_head, also global_layers' wider ones)."""
        if self.sliding_rotary_dim is not None and self.layer_window(layer) is not None:
            return self.sliding_rotary_dim
        return self.layer_d_head(layer) if self.rotary_dim == self.d_head else self.rotary_dim

    def layer_rotates(self, layer: int) -> bool:
        """Whether `layer` rotates its queries and keys (rotary positions, and not one of SmolLM3's NoPE layers)."""
        return self.positions is Positions.ROTARY and (self.rotary_layers is None or self.rotary_layers[layer])

    def layer_is_linear(self, layer: int) -> bool:
        """Whether `layer` mixes positions with a recurrent layer instead of attention: linear attention (Gated
        DeltaNet), a state-space (Mamba-2) mixer or a short convolution (LFM2's); such a layer has no attention heads."""
        return ((self.linear_attention is not None and self.linear_attention.layers[layer])
                or (self.layer_is_state_space(layer) and not self.layer_has_shared_block(layer))
                or self.layer_is_short_conv(layer) or self.layer_is_rg_lru(layer) or self.rwkv is not None)

    def layer_has_shared_block(self, layer: int) -> bool:
        """Whether `layer` runs one of Zamba2's shared transformer blocks before its Mamba-2 mixer (its attention
        heads are then the shared block's)."""
        return self.shared_blocks is not None and self.shared_blocks.layers[layer]

    def layer_is_short_conv(self, layer: int) -> bool:
        """Whether `layer`'s token mixer is LFM2's gated short convolution (blocks.L.conv)."""
        return self.short_conv is not None and self.short_conv.layers[layer]

    def layer_is_rg_lru(self, layer: int) -> bool:
        """Whether `layer`'s token mixer is Griffin's recurrent block (RecurrentGemma's; blocks.L.recurrent)."""
        return self.rg_lru is not None and self.rg_lru.layers[layer]

    @property
    def embed_scale(self) -> Optional[float]:
        """What the token embeddings are multiplied by: None, or sqrt(d_model) (scale_embed: Gemma's), rounded to
        bfloat16 first in a Griffin model (RecurrentGemma's normalizer is a bfloat16 buffer whatever the dtype)."""
        if not self.scale_embed:
            return None
        return math.sqrt(self.d_model) if self.rg_lru is None else bfloat16_rounded(math.sqrt(self.d_model))

    @property
    def recurrent_kind(self) -> str:
        """What this model's layers without heads are, in messages that refuse them (other than state-space ones,
        which StateSpace.label names)."""
        return ("short-convolution (LFM2)" if self.short_conv is not None else "recurrent (Griffin RG-LRU)"
                if self.rg_lru is not None else "RWKV time-mix" if self.rwkv is not None else "linear-attention")

    def layer_is_state_space(self, layer: int) -> bool:
        """Whether `layer`'s token mixer is a Mamba-2 state-space mixer (blocks.L.mixer)."""
        return self.state_space is not None and self.state_space.layers[layer]

    def layer_has_parallel_mixer(self, layer: int) -> bool:
        """Whether `layer` runs a Mamba-2 mixer beside its attention (Falcon-H1: blocks.L.mamba), both reading ln1."""
        return self.parallel_state_space is not None and self.parallel_state_space.layers[layer]

    def layer_has_mixer(self, layer: int) -> bool:
        """Whether `layer` mixes positions (attention or a recurrent mixer): every layer but an MLP-only one."""
        return self.sublayers is None or self.sublayers[layer] != "mlp"

    def layer_has_attention(self, layer: int) -> bool:
        """Whether `layer` has attention heads: neither a recurrent layer nor an MLP-only one (NemotronH's)."""
        return self.layer_has_mixer(layer) and not self.layer_is_linear(layer)

    def layer_has_mlp(self, layer: int) -> bool:
        """Whether `layer` has an MLP (or experts): not in an attn_only model, nor in a one-sublayer mixer layer."""
        return not self.attn_only and (self.sublayers is None or self.sublayers[layer] == "mlp")

    def check_sublayers(self) -> None:
        """Refuse `sublayers` (NemotronH's one sublayer per layer) that disagree with the other per-layer fields."""
        if self.sublayers is None:
            return
        kinds = tuple(self.sublayers)
        if len(kinds) != self.n_layers or set(kinds) - set(SUBLAYERS):
            raise ValueError(f"sublayers={self.sublayers!r} must give each of the n_layers={self.n_layers} layers one "
                             f"of {', '.join(map(repr, SUBLAYERS))}")
        mixers = tuple(kind == "mixer" for kind in kinds)
        if mixers != (self.state_space.layers if self.state_space is not None else (False,) * self.n_layers):
            raise ValueError(f"sublayers={kinds!r} puts a state-space mixer in layers {[i for i, m in enumerate(mixers) if m]}; "
                             "state_space.layers must say True there and nowhere else (and state_space be set where "
                             "any layer is 'mixer')")
        if self.experts is not None and any(self.layer_sparse(l) and kinds[l] != "mlp" for l in range(self.n_layers)):
            raise ValueError(f"sublayers={kinds!r}: experts.layers must be True only in 'mlp' layers (the others have "
                             "no MLP to replace)")
        if self.attn_only or self.linear_attention is not None or self.norm_placement.value != "pre":
            raise ValueError("one-sublayer layers (sublayers) are pre-norm, x + sublayer(norm(x)), without Gated "
                             "DeltaNet layers: set attn_only=False, linear_attention=None, norm_placement='pre'")
        object.__setattr__(self, "sublayers", kinds)

    def layer_sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts (else one MLP of d_mlp: dense layers among sparse ones)."""
        return self.experts is not None and (self.experts.layers is None or self.experts.layers[layer])

    @property
    def expert_width(self) -> int:
        """Each routed expert's width: experts.width, or d_mlp where it leaves it None."""
        return self.d_mlp if self.experts is None or self.experts.width is None else self.experts.width
