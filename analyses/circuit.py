"""A circuit: a set of edges of the graph, and the nodes they join, pruned to what can matter.

An edge can only change the logits if its writer is reached from the embedding through the circuit
(otherwise, with every input ablated, the writer's output is its ablated value and the edge carries
nothing new) and its reader's node reaches the logits through the circuit. Pruning drops the other
edges, which leaves a circuit's faithfulness unchanged under patching and shows the circuit as it acts.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import pandas as pd
import torch

from probe.analyses.circuit_graph import CircuitGraph
from probe.analyses.common import TableDisplay, is_int


def prune(graph: CircuitGraph, chosen: torch.Tensor) -> torch.Tensor:
    """[edge] bool: the chosen edges [edge] bool whose writer the embedding reaches and whose reader reaches the logits."""
    W, R = graph.valid.shape
    w, r = graph.edge_writer, graph.edge_reader
    feeds = graph.reader_nodes.float()  # [reader node]
    adjacency = torch.zeros(W, R)
    adjacency[w[chosen], r[chosen]] = 1.0
    reached = torch.zeros(W, dtype=torch.bool)
    reached[0] = True  # the embedding
    for _ in range(2 * graph.n_layers + 2):  # a path visits at most one writer per stage
        readers = (reached.float() @ adjacency) > 0
        nodes = (readers.float() @ feeds) > 0
        grown = nodes[:W] | reached
        if torch.equal(grown, reached):
            break
        reached = grown
    useful_nodes = torch.zeros(W + 1, dtype=torch.bool)
    useful_nodes[-1] = True  # the logits
    for _ in range(2 * graph.n_layers + 2):
        readers = (feeds @ useful_nodes.float()) > 0
        writers = (adjacency @ readers.float()) > 0
        grown = useful_nodes.clone()
        grown[:W] |= writers
        if torch.equal(grown, useful_nodes):
            break
        useful_nodes = grown
    useful_readers = (feeds @ useful_nodes.float()) > 0
    return chosen & reached[w] & useful_readers[r]


@dataclass
class Circuit(TableDisplay):
    """`edges` [n] indices into the graph's edges (its order), best first when they came from scores; `scores` [n]
    their scores (None for a hand-made circuit); `requested`: how many were chosen before pruning."""

    graph: CircuitGraph
    edges: torch.Tensor
    scores: Optional[torch.Tensor] = None
    requested: int = 0
    method: str = "manual"
    metric_name: str = "metric"
    labels: Optional[list[str]] = field(default=None, repr=False)  # the prompt's tokens, raw, for the figure's title
    labels_are_ids: bool = field(default=False, repr=False)  # token ids (no tokenizer): the title spaces them

    def __post_init__(self):
        # an index of -1 would wrap to the graph's last edge without a word, and one past the end fail far from here
        edges = self.edges
        if not (isinstance(edges, torch.Tensor) and edges.dim() == 1 and not edges.is_floating_point()
                and edges.dtype != torch.bool):
            raise TypeError("Circuit.edges must be a 1-D integer tensor of edge indices (Circuit.from_edges builds one "
                            f"from names), got {edges.dtype if isinstance(edges, torch.Tensor) else type(edges).__name__}"
                            f"{'' if not isinstance(edges, torch.Tensor) else ' of shape ' + str(tuple(edges.shape))}")
        if edges.numel() and not (0 <= int(edges.min()) and int(edges.max()) < self.graph.n_edges):
            raise ValueError(f"Circuit.edges holds indices from {int(edges.min())} to {int(edges.max())}, but the graph's "
                             f"edges are 0 to {self.graph.n_edges - 1}")

    @classmethod
    def from_edges(cls, graph: CircuitGraph, edges: Sequence[tuple[str, str]], prune_edges: bool = False) -> "Circuit":
        """A circuit from (writer, reader) names, e.g. [("L0H1", "L2H0<k"), ("L2H0", "logits")]."""
        lookup = {(int(a), int(b)): e for e, (a, b) in enumerate(zip(graph.edge_writer.tolist(), graph.edge_reader.tolist()))}
        ids = []
        for item in edges:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError(f"an edge is a (writer, reader) pair of names, e.g. ('L0H1', 'L2H0<k'); got {item!r}")
            writer = graph.writer_index(item[0])
            for reader in graph.reader_indices(item[1]):
                if (writer, reader) not in lookup:
                    raise ValueError(f"{graph.writers[writer]} -> {graph.readers[reader]} is not an edge: the reader reads "
                                     "the residual before the writer writes to it")
                ids.append(lookup[(writer, reader)])
        chosen = torch.zeros(graph.n_edges, dtype=torch.bool)
        chosen[ids] = True
        requested = int(chosen.sum())
        if prune_edges:
            chosen = prune(graph, chosen)
        return cls(graph=graph, edges=chosen.nonzero()[:, 0], requested=requested)

    @property
    def n_edges(self) -> int:
        return int(self.edges.numel())

    def edge_mask(self) -> torch.Tensor:
        """[edge] bool."""
        out = torch.zeros(self.graph.n_edges, dtype=torch.bool)
        out[self.edges] = True
        return out

    def mask(self) -> torch.Tensor:
        """[writer reader] bool."""
        out = torch.zeros(tuple(self.graph.valid.shape), dtype=torch.bool)
        out[self.graph.edge_writer[self.edges], self.graph.edge_reader[self.edges]] = True
        return out

    @property
    def nodes(self) -> list[str]:
        """The nodes the edges join, in graph order (a shared key/value input adds no head by itself)."""
        w, r = self.graph.edge_writer[self.edges], self.graph.edge_reader[self.edges]
        present = torch.zeros(len(self.graph.nodes), dtype=torch.bool)
        present[w] = True
        feeds = self.graph.reader_nodes[r]
        single = feeds.sum(1) == 1
        if bool(single.any()):
            present |= feeds[single].any(0)
        return [n for n, keep in zip(self.graph.nodes, present.tolist()) if keep]

    def contains(self, writer: str, reader: str) -> bool:
        names = set(self.edge_names())
        return all(f"{self.graph.writers[self.graph.writer_index(writer)]} -> {self.graph.readers[i]}" in names
                   for i in self.graph.reader_indices(reader))

    def edge_names(self) -> list[str]:
        g = self.graph
        return [f"{g.writers[w]} -> {g.readers[r]}" for w, r in zip(g.edge_writer[self.edges].tolist(), g.edge_reader[self.edges].tolist())]

    def to_frame(self) -> pd.DataFrame:
        frame = self.graph.to_frame().iloc[self.edges.tolist()].reset_index(drop=True)
        if self.scores is not None:
            frame["score"] = self.scores.float().numpy()
        return frame

    def __str__(self) -> str:
        return (f"Circuit of {self.n_edges} edges ({self.requested} chosen by {self.method}, "
                f"{self.requested - self.n_edges} pruned), {len(self.nodes)} nodes")

    def figure(self, title: Optional[str] = None):
        """An interactive drawing: layers top to bottom, edge width and colour by score, q/k/v inputs told apart."""
        from probe.analyses.circuit_figure import circuit_figure

        return circuit_figure(self, title=title)


def circuit_from_scores(scores, n_edges: Optional[int] = None, threshold: Optional[float] = None,
                        method: Literal["topn", "greedy"] = "topn", absolute: bool = True) -> Circuit:
    """See EdgeScores.circuit."""
    graph = scores.graph
    if (n_edges is None) == (threshold is None):
        raise ValueError("give exactly one of n_edges (how many edges) or threshold (the smallest |score| kept)")
    # NumPy and 0-d tensor integers too: a size read back from a frame (faithfulness.csv) is an np.int64
    if n_edges is not None and not (is_int(n_edges) and 0 <= int(n_edges)):
        raise ValueError(f"n_edges={n_edges!r} must be a non-negative int (the graph has {graph.n_edges} edges)")
    n_edges = None if n_edges is None else int(n_edges)
    # a NaN threshold kept nothing without a word, and a string failed inside torch's comparison
    if isinstance(threshold, torch.Tensor) and threshold.dim() == 0 and threshold.dtype != torch.bool:
        threshold = float(threshold)  # e.g. scores.scores.abs().max(), as before
    if threshold is not None and not (isinstance(threshold, numbers.Real) and not isinstance(threshold, bool)
                                      and not math.isnan(threshold)):
        raise ValueError(f"threshold={threshold!r} must be a number (the smallest |score| kept, or score with absolute=False)")
    if method not in ("topn", "greedy"):
        raise ValueError(f"method={method!r} is not one of: topn, greedy")
    key = scores.scores.float().abs() if absolute else scores.scores.float()
    limit = graph.n_edges if n_edges is None else min(n_edges, graph.n_edges)
    if method == "topn":
        order = torch.sort(key, descending=True, stable=True).indices
        chosen_ids = order[:limit] if threshold is None else order[key[order] >= threshold]
    else:
        chosen_ids = _greedy(graph, key, limit, threshold)
    chosen = torch.zeros(graph.n_edges, dtype=torch.bool)
    chosen[chosen_ids] = True
    kept = prune(graph, chosen)
    ranked = [int(e) for e in chosen_ids.tolist() if kept[e]]  # best first
    ids = torch.tensor(ranked, dtype=torch.long)
    labels = scores.position_strings
    # a model without a tokenizer labels its positions with ids, which the figure's title would run together
    ids_only = labels is not None and scores.tokenizer is None and labels == [str(t) for t in scores.position_tokens]
    return Circuit(graph=graph, edges=ids, scores=scores.scores[ids], requested=int(chosen.sum()), method=method,
                   metric_name=scores.metric_name, labels=labels, labels_are_ids=ids_only)


def _greedy(graph: CircuitGraph, key: torch.Tensor, limit: int, threshold: Optional[float]) -> torch.Tensor:
    """Grow from the logits: each step adds the best edge into a reader of a node already in the circuit."""
    feeds = graph.reader_nodes  # [reader node]
    w, r = graph.edge_writer, graph.edge_reader
    in_circuit = torch.zeros(len(graph.nodes), dtype=torch.bool)
    in_circuit[-1] = True
    taken = torch.zeros(graph.n_edges, dtype=torch.bool)
    picked = []
    for _ in range(limit):
        open_readers = feeds[:, in_circuit].any(1)
        candidates = open_readers[r] & ~taken
        if not bool(candidates.any()):
            break
        masked = torch.where(candidates, key, torch.tensor(float("-inf")))
        best = int(masked.argmax())
        if threshold is not None and float(key[best]) < threshold:
            break
        taken[best] = True
        picked.append(best)
        in_circuit[w[best]] = True
    return torch.tensor(picked, dtype=torch.long)
