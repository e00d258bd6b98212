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

`composition_scores` measures how much a later head reads what an earlier head writes: with the
earlier head's OV circuit on the left and the later head's QK (through its queries or its keys) or
OV circuit on the right, `||left right||_F / (||left||_F ||right||_F)` (Q-, K- and V-composition).
The d_model-sized products are never built: with left = A M1 and right = M2 D, the norm of
A (M1 M2) D follows from d_head-sized matrices and the Gram matrices A^T A and D D^T.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch
from einops import einsum

from probe.analyses.architecture import refuse_prediction_head, require_head_weights, require_own_keys_and_one_width
from probe.analyses.common import TableDisplay, is_int
from probe import HookedDecoder, process_weights
from probe.processing import can_center_writing_weights, can_fold_ln, can_fold_value_biases


def _head_weights(model: HookedDecoder, layer: int, head: int) -> tuple[torch.Tensor, ...]:
    """W_Q [d_model d_head], W_K, W_V (of the head's key/value head), W_O [d_head d_model], in float32."""
    require_head_weights(model, "the heads' QK and OV circuits")
    if not (is_int(layer) and 0 <= layer < model.cfg.n_layers):
        raise ValueError(f"layer={layer!r} is outside [0, {model.cfg.n_layers})")
    attn = model.blocks[layer].attn
    if not (is_int(head) and 0 <= head < attn.n_heads):
        raise ValueError(f"head={head!r} is outside layer {layer}'s heads [0, {attn.n_heads})")
    kv = head // (attn.n_heads // attn.n_kv_heads)  # grouped-query: adjacent query heads share a key/value head
    w_q, w_k, w_o = attn.W_Q[head].float(), attn.W_K[kv].float(), attn.W_O[head].float()
    write_norm = getattr(model.blocks[layer], "ln1_post", None)
    if write_norm is not None:  # a sandwich block's write passes its norm: w per dimension (its scale is one number)
        w_o = w_o * write_norm.w.float()
    if hasattr(getattr(attn, "z_norm", None), "w"):  # BitNet's norm of every head's z before W_O: its weight likewise, per channel
        w_o = attn.z_norm.w.float().view(attn.n_heads, -1)[head, :, None] * w_o
    if hasattr(attn.q_norm, "w"):  # Qwen3's per-head q and k norms: their weights likewise (scales left out)
        w_q, w_k = w_q * attn.q_norm.w.float(), w_k * attn.k_norm.w.float()
    return w_q, w_k, attn.W_V[kv].float(), w_o


@torch.no_grad()
def ov_circuit(model: HookedDecoder, layer: int, head: int) -> torch.Tensor:
    """[d_model d_model]: W_V W_O, what the head writes (x W_V W_O) per unit of attention to a residual x (in a
    sandwich block, through its write norm's weight; the norm's scale, one number per position, is left out)."""
    _, _, w_v, w_o = _head_weights(model, layer, head)
    return w_v @ w_o


@torch.no_grad()
def qk_circuit(model: HookedDecoder, layer: int, head: int) -> torch.Tensor:
    """[d_model d_model]: W_Q W_K^T, the query-key bilinear form (score = x_q W_Q W_K^T x_k^T, before
    the 1/sqrt(d_head) scale, rotary positions and biases; with per-head q/k norms, through their weights)."""
    w_q, w_k, _, _ = _head_weights(model, layer, head)
    return w_q @ w_k.T


@dataclass
class CopyingScores(TableDisplay):
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


def processed_for_circuits(model: HookedDecoder) -> HookedDecoder:
    """A copy with every weight-processing step this architecture allows: folding needs pre-norm
    blocks, centring needs LayerNorm (a post-norm model is used as it is)."""
    if not can_fold_ln(model.cfg):
        return model
    return process_weights(model, center_writing_weights=can_center_writing_weights(model.cfg),
                           center_unembed=model.cfg.logit_softcap is None,  # a capped logit does not pass a shift
                           fold_value_biases=can_fold_value_biases(model.cfg))  # (not through Gemma 4's value norm)


@torch.no_grad()
def copying_scores(model: HookedDecoder, layers: Optional[Sequence[int]] = None, *, process: bool = True) -> CopyingScores:
    """Every head's copying score (Elhage et al. 2021), from the eigenvalues of its full OV circuit,
    after folding the norms' weights in (`process=False`: the weights as they are)."""
    layers = list(range(model.cfg.n_layers)) if layers is None else list(layers)
    bad = [l for l in layers if not (is_int(l) and 0 <= l < model.cfg.n_layers)]
    if bad or not layers:
        raise ValueError(f"layers must be a non-empty list of layers in [0, {model.cfg.n_layers}); got {layers!r}")
    require_own_keys_and_one_width(model, "copying_scores")
    refuse_prediction_head(model, "copying_scores (the full OV circuit W_E W_V W_O W_U)")
    if process:  # after the check: processing copies the whole model
        model = processed_for_circuits(model)
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


# ---- composition --------------------------------------------------------------------------------------
CompositionKind = Literal["q", "k", "v"]


@dataclass
class CompositionScores(TableDisplay):
    """Q-, K- and V-composition of every head into every head of a later layer (Elhage et al. 2021).

    Each of `q`, `k`, `v` is [layer head layer head]: entry [l1, h1, l2, h2] is how much head (l2, h2)
    reads what head (l1, h1) writes, through its queries, keys or values, in [0, 1]; NaN where l2 <= l1
    (no composition) or for heads a structurally pruned layer no longer has."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def to_frame(self) -> pd.DataFrame:
        """One row per (earlier head, later head) pair: its q, k and v scores."""
        valid = ~self.q.isnan()
        l1, h1, l2, h2 = valid.nonzero(as_tuple=True)
        return pd.DataFrame({"layer": l1.tolist(), "head": h1.tolist(), "later_layer": l2.tolist(), "later_head": h2.tolist(),
                             "q": self.q[valid].tolist(), "k": self.k[valid].tolist(), "v": self.v[valid].tolist()})

    def figure(self, kind: CompositionKind = "k") -> go.Figure:
        """A heatmap of one kind: a row per writing head, a column per reading head."""
        if kind not in ("q", "k", "v"):
            raise ValueError(f"kind={kind!r} is not one of: q, k, v")
        scores = getattr(self, kind)
        n_layers, n_heads = scores.shape[:2]
        labels = [f"L{l}H{h}" for l in range(n_layers) for h in range(n_heads)]
        fig = go.Figure(go.Heatmap(
            z=scores.reshape(n_layers * n_heads, n_layers * n_heads).numpy(), x=labels, y=labels, zmin=0,
            colorscale="Viridis", colorbar=dict(title=f"{kind.upper()}-composition"),
            hovertemplate="%{y} writes, %{x} reads: %{z:.3f}<extra></extra>",
        ))
        fig.update_layout(title=f"{kind.upper()}-composition: ||OV(writer) {'OV' if kind == 'v' else 'QK'}(reader)||_F "
                                "/ (||OV|| ||" + ("OV" if kind == "v" else "QK") + "||)",
                          xaxis_title="reading head", yaxis_title="writing head", yaxis_autorange="reversed")
        return fig


@torch.no_grad()
def composition_scores(model: HookedDecoder, *, process: bool = True) -> CompositionScores:
    """Q-, K- and V-composition between every pair of heads in different layers, after folding the norms'
    weights in like `copying_scores` (`process=False`: the weights as they are). Costs about
    (heads)^2 * d_head^2 * d_model multiply-adds: seconds for GPT-2 small on a CPU."""
    require_own_keys_and_one_width(model, "composition_scores", one_width=True)
    if process:
        model = processed_for_circuits(model)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    heads = [(l, h) for l in range(n_layers) for h in range(model.blocks[l].attn.n_heads)]
    w_q, w_k, w_v, w_o = (torch.stack(ws) for ws in zip(*(_head_weights(model, l, h) for l, h in heads)))
    layer_of = torch.tensor([l for l, _ in heads])

    def gram(a: torch.Tensor) -> torch.Tensor:  # [head d_model r] -> [head r r]: a^T a
        return einsum(a, a, "head d_model r, head d_model s -> head r s")

    # ||A M D||_F^2 = tr(M^T (A^T A) M (D D^T)), each factor d_head-sized
    g_v, g_o = gram(w_v), gram(w_o.transpose(1, 2))  # W_V^T W_V, W_O W_O^T
    g_q, g_k = gram(w_q), gram(w_k)
    ov_norm = einsum(g_v, g_o, "head r s, head s r -> head").clamp(min=0).sqrt()
    qk_norm = einsum(g_q, g_k, "head r s, head s r -> head").clamp(min=0).sqrt()
    scores = {}
    for kind, reader_in, reader_gram, reader_norm in (("q", w_q, g_k, qk_norm), ("k", w_k, g_q, qk_norm),
                                                       ("v", w_v, g_o, ov_norm)):
        out = torch.full((len(heads), len(heads)), float("nan"))
        for i in range(len(heads)):  # one writer at a time keeps the [reader r r] temporaries small
            later = (layer_of > layer_of[i]).nonzero().flatten()
            if later.numel() == 0:
                continue
            middle = einsum(w_o[i], reader_in[later], "r d_model, reader d_model s -> reader r s")  # W_O(writer) W_in(reader)
            left = einsum(g_v[i], middle, "r t, reader t s -> reader r s")  # (A^T A) M
            squared = einsum(middle, left, reader_gram[later], "reader r s, reader r u, reader u s -> reader")
            out[i, later] = squared.clamp(min=0).sqrt().cpu() / (ov_norm[i] * reader_norm[later]).cpu()
        full = torch.full((n_layers, n_heads, n_layers, n_heads), float("nan"))
        index = torch.tensor(heads)
        full[index[:, 0][:, None], index[:, 1][:, None], index[:, 0][None, :], index[:, 1][None, :]] = out
        scores[kind] = full
    return CompositionScores(**scores)
