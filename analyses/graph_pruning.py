"""Influence and pruning of an attribution graph (Ameisen et al. 2025, section "Graph pruning").

An adjacency A [target source] holds direct effects. Normalising each target's row of |A| to sum 1 gives B, the
share of the target's (absolute) input each source supplies; a node's influence is how much of the logits'
weight w reaches it along every path, w B + w B^2 + ... = w ((I - B)^-1 - I), a finite sum since the graph
has no cycles. Pruning keeps the most influential feature and error nodes until they hold `node_threshold`
of the influence of all feature and error nodes (embeddings and logits always stay), then the edges, scored by
B times their target's influence plus its logit weight (on the graph the nodes left), until they hold
`edge_threshold` of all edge scores; features and errors left without an outgoing edge, and features left
without an incoming one, go too, until none is left; so the shares of influence and edge score kept, measured
at the end, can fall below the thresholds. Thresholds 0.8 and 0.98 are circuit-tracer's defaults.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NODE_THRESHOLD, EDGE_THRESHOLD = 0.8, 0.98  # circuit-tracer's prune_graph defaults


def row_normalised(adjacency: torch.Tensor) -> torch.Tensor:
    """|A| with each row scaled to sum 1 (rows of zeros stay zero)."""
    absolute = adjacency.abs()
    total = absolute.sum(dim=1, keepdim=True)
    return torch.where(total > 0, absolute / total.clamp(min=torch.finfo(absolute.dtype).tiny), absolute)


def influence(normalised: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[node]: w B + w B^2 + ... for B [target source] square and weights w [node]; the sum ends when a power is
    zero, which an acyclic graph reaches within its number of nodes."""
    total = torch.zeros_like(weights)
    reach = weights
    for _ in range(normalised.shape[0] + 1):
        reach = reach @ normalised
        if not bool(reach.any()):
            return total
        total = total + reach
    raise ValueError("the adjacency has a cycle: an attribution graph's edges only run forward")


def top_share(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """[n] bool: the highest scores whose sum first reaches `threshold` of all scores (ties at the cut kept)."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold {threshold} must be in [0, 1]")
    keep = torch.zeros_like(scores, dtype=torch.bool)
    total = float(scores.sum())
    if total <= 0:
        return keep
    ordered = scores.sort(descending=True).values
    reached = (ordered.cumsum(0) >= threshold * total * (1 - 1e-12)).nonzero()
    cut = ordered[int(reached[0]) if len(reached) else len(ordered) - 1]
    return scores >= cut if threshold > 0 else keep


@dataclass
class Pruning:
    node_mask: torch.Tensor  # [node] bool
    edge_mask: torch.Tensor  # [target source] bool
    influence: torch.Tensor  # [node]: each node's influence on the unpruned graph
    node_share: float  # the share of feature and error influence the kept nodes hold (on the unpruned graph)
    edge_share: float  # the share of edge score (on the graph the node step left) the kept edges hold


def prune(adjacency: torch.Tensor, logit_weights: torch.Tensor, prunable: torch.Tensor, has_inputs: torch.Tensor,
          node_threshold: float = NODE_THRESHOLD, edge_threshold: float = EDGE_THRESHOLD) -> Pruning:
    """Masks of the nodes and edges kept. `logit_weights` [node]: each logit's weight, 0 elsewhere; `prunable`
    [node] bool: feature and error nodes; `has_inputs` [node] bool: features (which need an incoming edge)."""
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}={value} must be in [0, 1]")
    adjacency = adjacency.double()
    weights = logit_weights.double()
    node_influence = influence(row_normalised(adjacency), weights)
    scores = torch.where(prunable, node_influence, 0.0)
    node_mask = ~prunable
    node_mask[prunable] = top_share(scores[prunable], node_threshold)

    kept = adjacency * (node_mask[:, None] & node_mask[None, :])
    kept_normalised = row_normalised(kept)
    edge_scores = kept_normalised * (influence(kept_normalised, weights) + weights)[:, None]
    edge_mask = (edge_scores > 0) & top_share(edge_scores.flatten(), edge_threshold).view_as(edge_scores)
    while True:  # drop what no longer connects; each pass can strand more, at most one per layer
        before = node_mask.clone()
        node_mask &= ~prunable | edge_mask.any(dim=0)
        node_mask &= ~has_inputs | edge_mask.any(dim=1)
        edge_mask &= node_mask[:, None] & node_mask[None, :]
        if bool((node_mask == before).all()):
            break
    # measured on what is left, after the stranded nodes went: the shares of the graph the caller gets
    node_share = float(scores[node_mask].sum() / scores.sum()) if float(scores.sum()) > 0 else 1.0
    edge_share = float(edge_scores[edge_mask].sum() / edge_scores.sum()) if float(edge_scores.sum()) > 0 else 1.0
    return Pruning(node_mask, edge_mask, node_influence.to(logit_weights.dtype), node_share, edge_share)
