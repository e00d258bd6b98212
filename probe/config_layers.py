"""What a DecoderConfig says about each of its layers (a mixin of it): the heads, window and rotary positions of its
attention, whether it mixes positions linearly, and whether its MLP is a mixture of experts."""
from __future__ import annotations

from typing import Optional

from probe.config_choices import Positions, RotaryScaling


class LayerFacts:
    """Methods only: the fields they read (heads_per_layer, sliding_layers, experts, ...) are DecoderConfig's."""

    def layer_heads(self, layer: int) -> int:
        """The number of query heads in `layer` (fewer than n_heads after structural pruning)."""
        return self.n_heads if self.heads_per_layer is None else self.heads_per_layer[layer]

    def layer_kv_heads(self, layer: int) -> int:
        return self.n_kv_heads if self.heads_per_layer is None else self.heads_per_layer[layer]

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of `layer`'s attention, or None when it sees every earlier key."""
        windowed = self.sliding_layers is None or self.sliding_layers[layer]
        return self.sliding_window if windowed else None

    def layer_rotary(self, layer: int) -> tuple[float, Optional[RotaryScaling]]:
        """`layer`'s rotary base and frequency rescaling (a windowed layer's own, where sliding_rotary_base is set)."""
        if self.sliding_rotary_base is not None and self.layer_window(layer) is not None:
            return self.sliding_rotary_base, None
        return self.rotary_base, self.rotary_scaling

    def layer_rotates(self, layer: int) -> bool:
        """Whether `layer` rotates its queries and keys (rotary positions, and not one of SmolLM3's NoPE layers)."""
        return self.positions is Positions.ROTARY and (self.rotary_layers is None or self.rotary_layers[layer])

    def layer_is_linear(self, layer: int) -> bool:
        """Whether `layer` mixes positions with a recurrent layer instead of attention: linear attention (Gated
        DeltaNet) or a state-space (Mamba-2) mixer; such a layer has no attention heads."""
        return (self.linear_attention is not None and self.linear_attention.layers[layer]) or self.layer_is_state_space(
            layer)

    def layer_is_state_space(self, layer: int) -> bool:
        """Whether `layer`'s token mixer is a Mamba-2 state-space mixer (blocks.L.mixer)."""
        return self.state_space is not None and self.state_space.layers[layer]

    def layer_sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts (else one MLP of d_mlp: dense layers among sparse ones)."""
        return self.experts is not None and (self.experts.layers is None or self.experts.layers[layer])

    @property
    def expert_width(self) -> int:
        """Each routed expert's width: experts.width, or d_mlp where it leaves it None."""
        return self.d_mlp if self.experts is None or self.experts.width is None else self.experts.width
