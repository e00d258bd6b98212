"""Head detectors: how much each head attends where a known circuit's head would."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, get_args

import pandas as pd
import plotly.graph_objects as go
import torch
from einops import einsum

from probe.analyses.architecture import require_attention_heads
from probe.analyses.common import AnalysisInput, TableDisplay
from probe.analyses.labels import head_grid, head_label
from probe import HookedDecoder
from probe.names import act_name

HeadKind = Literal["previous_token", "first_token", "duplicate_token", "induction"]

DESCRIPTIONS = {
    "previous_token": "attention to the previous token",
    "first_token": "attention to the first token (BOS)",
    "duplicate_token": "attention to earlier copies of the current token",
    "induction": "attention to the token after an earlier copy of the current token",
}


@dataclass
class HeadScores(TableDisplay):
    """scores: [layer head], each the mean over queries (of every prompt) that have a target key of
    the attention weight the head puts on its target keys."""

    scores: torch.Tensor
    kind: str
    tokens: torch.Tensor  # [batch pos] the sequences the scores were measured on

    def to_frame(self) -> pd.DataFrame:
        n_layer, n_head = self.scores.shape
        layer, head = torch.meshgrid(torch.arange(n_layer), torch.arange(n_head), indexing="ij")
        keep = ~self.scores.isnan().flatten()  # pruned heads have no score
        layer, head = layer.flatten()[keep], head.flatten()[keep]
        return pd.DataFrame({"layer": layer.numpy(), "head": head.numpy(),
                             "label": [head_label(l, h) for l, h in zip(layer.tolist(), head.tolist())],
                             "score": self.scores.flatten()[keep].numpy()})

    def top(self, k: int = 5) -> pd.DataFrame:
        return self.to_frame().nlargest(k, "score").reset_index(drop=True)

    def figure(self) -> go.Figure:
        return head_grid(self.scores, f"{self.kind.replace('_', '-')} score<br><sup>{DESCRIPTIONS[self.kind]}</sup>",
                         "score", colorscale="Viridis", zmin=0, zmax=1)


def target_keys(kind: str, tokens: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[batch query_pos key_pos] bool: the keys a `kind` head attends to from each query."""
    batch, n = tokens.shape
    query = torch.arange(n, device=tokens.device)[:, None]
    key = torch.arange(n, device=tokens.device)[None, :]
    earlier = (key < query)[None]
    if kind == "previous_token":
        target = (key == query - 1)[None].expand(batch, n, n)
    elif kind == "first_token":
        # the first real token (BOS when prepended); not the query at position 0, which has no choice
        first = torch.zeros(batch, dtype=torch.long, device=tokens.device) if attention_mask is None \
            else attention_mask.long().argmax(dim=1)
        target = (key[None] == first[:, None, None]) & (query[None] > first[:, None, None])
    elif kind == "duplicate_token":
        target = earlier & (tokens[:, None, :] == tokens[:, :, None])
    elif kind == "induction":
        # key k follows an earlier copy of the query's token: tokens[k-1] == tokens[q], with k <= q
        before_key = torch.cat([torch.full_like(tokens[:, :1], -1), tokens[:, :-1]], dim=1)
        target = (key <= query)[None] & (key > 0)[None] & (before_key[:, None, :] == tokens[:, :, None])
    else:
        raise ValueError(f"kind={kind!r} is not a head detector; choose one of: {', '.join(get_args(HeadKind))}")
    if attention_mask is not None:
        real = attention_mask.bool()
        target = target & real[:, :, None] & real[:, None, :]
    return target


def repeated_random_tokens(model: HookedDecoder, n_samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """[n_samples 1+2*seq_len]: BOS (if the model has a tokenizer), then random tokens, then the same again."""
    gen = torch.Generator().manual_seed(seed)
    bos = None if model.tokenizer is None else model.tokenizer.bos_id
    high = model.cfg.d_vocab - (bos is not None)
    body = torch.randint(0, high, (n_samples, seq_len), generator=gen)
    if bos is not None:
        body = body + (body >= bos).long()  # skip the BOS id, so it only ever appears at position 0
    rows = torch.cat([body, body], dim=1)
    if bos is not None:
        rows = torch.cat([torch.full((n_samples, 1), bos), rows], dim=1)
    return rows


@torch.no_grad()
def head_scores(
    model: HookedDecoder,
    kind: HeadKind,
    input: Optional[AnalysisInput] = None,
    *,
    n_samples: int = 32,
    seq_len: Optional[int] = None,
    seed: int = 0,
    batch_size: int = 16,
) -> HeadScores:
    """Score every head for one detector `kind`.

    With `input` (text or token ids) the scores are measured on it; without, on `n_samples` seeded
    random sequences of `seq_len` tokens repeated once (after BOS), where an induction head shows up.
    """
    require_attention_heads(model, "head_scores")
    if kind not in DESCRIPTIONS:
        raise ValueError(f"kind={kind!r} is not a head detector; choose one of: {', '.join(DESCRIPTIONS)}")
    attention_mask = None
    if input is None:
        if seq_len is None:
            seq_len = min(50, (model.cfg.n_ctx - 1) // 2)
        if not 1 <= seq_len <= (model.cfg.n_ctx - 1) // 2 or n_samples < 1:
            raise ValueError(
                f"need n_samples >= 1 and 1 <= seq_len <= (n_ctx-1)//2 = {(model.cfg.n_ctx - 1) // 2}, "
                f"got n_samples={n_samples}, seq_len={seq_len}"
            )
        tokens = repeated_random_tokens(model, n_samples, seq_len, seed)
    elif isinstance(input, torch.Tensor):
        tokens = model.validate_tokens(input)
    else:
        tokens, attention_mask = model.to_tokens(input, return_attention_mask=True)
    tokens = tokens.to(model.device)
    if attention_mask is not None:
        attention_mask = attention_mask.to(model.device)

    hit = torch.zeros(model.cfg.n_layers, model.cfg.n_heads, dtype=torch.float64)
    present = torch.arange(model.cfg.n_heads)[None, :] < torch.tensor(
        [model.cfg.layer_heads(l) for l in range(model.cfg.n_layers)])[:, None]
    n_queries = 0
    for start in range(0, tokens.shape[0], batch_size):  # chunks bound the memory of the patterns
        chunk = tokens[start: start + batch_size]
        chunk_mask = None if attention_mask is None else attention_mask[start: start + batch_size]
        target = target_keys(kind, chunk, chunk_mask)
        has_target = target.any(dim=-1)  # [batch query_pos]
        n_queries += int(has_target.sum())
        store = {}

        def score(pattern: torch.Tensor, hook, target=target.to(torch.float32), has_target=has_target) -> None:
            mass = einsum(pattern.float(), target, "batch head query_pos key_pos, batch query_pos key_pos -> batch head query_pos")
            store[hook.name] = (mass * has_target[:, None, :]).sum(dim=(0, 2)).double().cpu()

        model.run_with_hooks(chunk, attention_mask=chunk_mask, fwd_hooks=[(lambda name: name.endswith("attn.hook_pattern"), score)])
        for layer in range(model.cfg.n_layers):  # layers may have different head counts after pruning
            layer_hits = store[act_name("pattern", layer)]
            hit[layer, : len(layer_hits)] += layer_hits
    if n_queries == 0:
        raise ValueError(f"no query in the input has a {kind} target ({DESCRIPTIONS[kind]}); use longer or repeated text")
    scores = (hit / n_queries).float().masked_fill(~present, float("nan"))  # NaN: a pruned head
    return HeadScores(scores=scores, kind=kind, tokens=tokens.cpu())
