"""The model's weights in transformer-lens's names and shapes, stacked over layers (read-only copies)."""
from __future__ import annotations

from typing import Optional

import torch


def _stacked(path: str, shape: str) -> property:
    """Every block's `path` (e.g. "attn.W_Q") stacked over layers, [layer ...]: a copy, to read."""
    sublayer, name = path.split(".")

    def get(self: "WeightViews") -> Optional[torch.Tensor]:
        values = [getattr(getattr(block, sublayer), name) for block in self.blocks]
        if any(v is None for v in values):
            return None  # the model has no such bias
        if len({tuple(v.shape) for v in values}) > 1:
            raise ValueError(f"{name} has a different shape in each layer (structurally pruned heads), so it does not "
                             f"stack; read model.blocks[layer].{path}")
        return torch.stack(values)

    get.__doc__ = f"{shape}: every block's {path}, stacked (None if the model has no such bias)"
    return property(get)


class WeightViews:
    """Mixed into HookedDecoder: `model.W_Q` [layer head d_model d_head] and the rest, as transformer-lens names them."""

    W_Q = _stacked("attn.W_Q", "[layer head d_model d_head]")
    W_K = _stacked("attn.W_K", "[layer kv_head d_model d_head]")
    W_V = _stacked("attn.W_V", "[layer kv_head d_model d_head]")
    W_O = _stacked("attn.W_O", "[layer head d_head d_model]")
    b_Q = _stacked("attn.b_Q", "[layer head d_head]")
    b_K = _stacked("attn.b_K", "[layer kv_head d_head]")
    b_V = _stacked("attn.b_V", "[layer kv_head d_head]")
    b_O = _stacked("attn.b_O", "[layer d_model]")
    W_in = _stacked("mlp.W_in", "[layer d_model d_mlp]")
    W_out = _stacked("mlp.W_out", "[layer d_mlp d_model]")
    b_in = _stacked("mlp.b_in", "[layer d_mlp]")
    b_out = _stacked("mlp.b_out", "[layer d_model]")

    @property
    def W_E(self) -> torch.Tensor:  # [vocab d_model]: the table; Gemma's residual receives it times embed.scale
        return self.embed.W_E

    @property
    def W_pos(self) -> torch.Tensor:  # [n_ctx d_model]
        if self.pos_embed is None:
            raise ValueError("this model has rotary positions, which rotate q and k inside attention: no W_pos")
        return self.pos_embed.W_pos

    @property
    def W_U(self) -> torch.Tensor:  # [d_model vocab]
        return self.unembed.W_U

    @property
    def b_U(self) -> Optional[torch.Tensor]:  # [vocab], None without an unembedding bias
        return self.unembed.bias
