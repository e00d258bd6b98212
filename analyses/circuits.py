"""Head circuits (Elhage et al. 2021): each head's OV and QK matrices, and how much its OV circuit copies.

A head reads the residual stream twice. Its QK circuit, `W_Q W_K^T` [d_model d_model], is the
bilinear form that scores a query position against a key position; its OV circuit, `W_V W_O`
[d_model d_model], is what it writes for each unit of attention to a key. Through the embedding
and unembedding, the full OV circuit `W_E W_V W_O W_U` [vocab vocab] says which logits a head raises
when it attends to each token; a head that copies (induction, duplicate-token heads) raises the
attended token's own logit, so this matrix has mostly positive eigenvalues. The copying score is
`sum(eigenvalues) / sum(|eigenvalues|)`, in [-1, 1]; its non-zero eigenvalues are those of the small
`W_O W_U W_E W_V` [d_head d_head], so nothing vocabulary-sized is built.

`ov_circuit` and `qk_circuit` use the weights as they are. Norms sit between these matrices in the
model, so `copying_scores` by default first folds their weights in (`probe.process_weights` with
every step the model allows, as transformer-lens does when loading); `process=False` uses the
weights as they are. Position embeddings and MLPs are left out, as in the paper.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch

from probe import HookedDecoder, process_weights
from probe.processing import can_center_writing_weights, can_fold_ln


def _head_weights(model: HookedDecoder, layer: int, head: int) -> tuple[torch.Tensor, ...]:
    """W_Q [d_model d_head], W_K, W_V (of the head's key/value head), W_O [d_head d_model], in float32."""
    if not (isinstance(layer, int) and 0 <= layer < model.cfg.n_layers):
        raise ValueError(f"layer={layer!r} is outside [0, {model.cfg.n_layers})")
    attn = model.blocks[layer].attn
    if not (isinstance(head, int) and 0 <= head < attn.n_heads):
        raise ValueError(f"head={head!r} is outside layer {layer}'s heads [0, {attn.n_heads})")
    kv = head // (attn.n_heads // attn.n_kv_heads)  # grouped-query: adjacent query heads share a key/value head
    return attn.W_Q[head].float(), attn.W_K[kv].float(), attn.W_V[kv].float(), attn.W_O[head].float()


@torch.no_grad()
def ov_circuit(model: HookedDecoder, layer: int, head: int) -> torch.Tensor:
    """[d_model d_model]: W_V W_O, what the head writes (x W_V W_O) per unit of attention to a residual x."""
    _, _, w_v, w_o = _head_weights(model, layer, head)
    return w_v @ w_o


@torch.no_grad()
def qk_circuit(model: HookedDecoder, layer: int, head: int) -> torch.Tensor:
    """[d_model d_model]: W_Q W_K^T, the query-key bilinear form (score = x_q W_Q W_K^T x_k^T, before
    the 1/sqrt(d_head) scale, rotary positions and biases)."""
    w_q, w_k, _, _ = _head_weights(model, layer, head)
    return w_q @ w_k.T


@dataclass
class CopyingScores:
    """The copying score of every head, and the eigenvalues it came from."""

    layers: list[int]
    # [layer head] float32 in [-1, 1], a row per entry of `layers`, a column per current head index: a
    # structurally pruned layer's row ends in NaN (`analyses.original_heads` gives the original indices)
    scores: torch.Tensor
    eigenvalues: list[list[torch.Tensor]]  # [layer][head] complex [d_head]: the full OV circuit's non-zero ones

    def to_frame(self) -> pd.DataFrame:
        rows = [dict(layer=layer, head=h, copying_score=float(self.scores[i, h]),
                     positive_share=float((ev.real > 0).float().mean()))
                for i, (layer, heads) in enumerate(zip(self.layers, self.eigenvalues)) for h, ev in enumerate(heads)]
        return pd.DataFrame(rows, columns=["layer", "head", "copying_score", "positive_share"])

    def figure(self) -> go.Figure:
        n_heads = self.scores.shape[1]
        fig = go.Figure(go.Heatmap(
            z=self.scores.numpy(), x=[f"H{h}" for h in range(n_heads)], y=[f"L{l}" for l in self.layers],
            zmin=-1, zmax=1, colorscale="RdBu", colorbar=dict(title="copying score"),
            hovertemplate="layer %{y}, head %{x}: %{z:.3f}<extra></extra>",
        ))
        fig.update_layout(title="OV copying score: sum(eigenvalues) / sum(|eigenvalues|) of W_E W_V W_O W_U",
                          xaxis_title="head", yaxis_title="layer", yaxis_autorange="reversed")
        return fig


def _processed(model: HookedDecoder) -> HookedDecoder:
    """A copy with every weight-processing step this architecture allows: folding needs pre-norm
    blocks, centring needs LayerNorm (a post-norm model is used as it is)."""
    if not can_fold_ln(model.cfg):
        return model
    return process_weights(model, center_writing_weights=can_center_writing_weights(model.cfg))


@torch.no_grad()
def copying_scores(model: HookedDecoder, layers: Optional[Sequence[int]] = None, *, process: bool = True) -> CopyingScores:
    """Every head's copying score (Elhage et al. 2021), from the eigenvalues of its full OV circuit,
    after folding the norms' weights in (`process=False`: the weights as they are)."""
    layers = list(range(model.cfg.n_layers)) if layers is None else list(layers)
    bad = [l for l in layers if not (isinstance(l, int) and 0 <= l < model.cfg.n_layers)]
    if bad or not layers:
        raise ValueError(f"layers must be a non-empty list of layers in [0, {model.cfg.n_layers}); got {layers!r}")
    if process:  # after the check: processing copies the whole model
        model = _processed(model)
    w_e, w_u = model.W_E.float(), model.W_U.float()  # [vocab d_model], [d_model vocab]
    unembed_embed = w_u @ w_e  # [d_model d_model]: the vocabulary-sized product, contracted once
    scores = torch.full((len(layers), model.cfg.n_heads), float("nan"))
    eigenvalues: list[list[torch.Tensor]] = []
    for i, layer in enumerate(layers):
        per_head = []
        for head in range(model.blocks[layer].attn.n_heads):
            _, _, w_v, w_o = _head_weights(model, layer, head)
            # on the CPU: a d_head-sized problem gains nothing from a GPU, and CUDA's eig needs MAGMA or a
            # recent cuSOLVER, which not every PyTorch build has
            values = torch.linalg.eigvals((w_o @ unembed_embed @ w_v).cpu())  # [d_head] complex
            total = float(values.abs().sum())
            scores[i, head] = float(values.sum().real) / total if total > 0 else 0.0
            per_head.append(values)
        eigenvalues.append(per_head)
    return CopyingScores(layers=layers, scores=scores, eigenvalues=eigenvalues)
