"""Edge attribution patching: a score for every edge of the graph at once (Syed et al. 2023; EAP-IG, Hanna et al. 2024).

An edge's score estimates how much the metric moves when that edge alone carries its writer's clean
output into the corrupted run: (writer's clean output - its corrupted output) . d metric / d (the
reader's input), summed over positions, one value per prompt, and averaged over the prompts.

Methods (all but "exact" are one vectorised product per reader stage, no loop over edges):
- "eap": the gradient of the corrupted run; 2 forwards and 1 backward.
- "eap-ig-inputs": the gradient averaged over `ig_steps` runs whose input embedding (the residual entering
  block 0: after Bloom's embedding norm, as Hanna et al.'s library moves blocks.0.hook_resid_pre) moves from the
  corrupted one toward the clean one, at alpha = 0, 1/m, ..., (m-1)/m (the left Riemann sum, so
  ig_steps=1 is EAP exactly).
- "eap-ig-activations": the same, but every residual the readers read is moved along the straight
  line between its corrupted and clean values (so every writer's output is too), the gradient still
  flowing through the model's own functions at those points.
- "clean-corrupted": the average of the corrupted run's and the clean run's gradients (as Hanna et
  al.'s library names it).
- "exact": no estimate: one patched forward per edge (batched), the metric's actual change with that
  edge alone patched; cost grows with the number of edges.

The gradient methods run in analyses.edge_gradients: the runs stacked in one forward and one backward,
reduced per reader stage (no per-edge tensor, and none per position unless `positions=True`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, Optional

import pandas as pd
import plotly.graph_objects as go
import torch
from tqdm.auto import tqdm

from probe.analyses.ablation import Metric, metric_name
from probe.analyses.architecture import refuse_next_token_metric
from probe.analyses.circuit_graph import CircuitGraph, circuit_graph, with_grouped_key_values
from probe.analyses.common import AnalysisInput, TableDisplay, evaluate_metric, is_int, model_mask, tokens_and_mask
from probe.analyses.edge_contraction import norm_kind
from probe.analyses.edge_gradients import gradient_scores
from probe.analyses.edge_patching import EdgeInputs, copies_per_forward, graph_hook_names, run_edges, stage_residuals, writer_outputs
from probe.analyses.labels import token_texts
from probe.analyses.metric_reads import logit_reads
from probe.analyses.paired_stats import bootstrap_ci, sign_flip_p
from probe import HookedDecoder

EdgeMethod = Literal["eap", "eap-ig-inputs", "eap-ig-activations", "clean-corrupted", "exact"]
METHODS = ("eap", "eap-ig-inputs", "eap-ig-activations", "clean-corrupted", "exact")


@dataclass
class EdgeScores(TableDisplay):
    """`scores` [edge]: the estimated change of the (batch-mean) metric from patching each edge alone, edges in the
    graph's order (`graph.edge_writer`, `graph.edge_reader`); `per_example` [batch edge]; `per_position`
    [batch pos edge] when asked for. `clean` / `corrupted`: the metric on the unpatched runs (batch means)."""

    graph: CircuitGraph
    scores: torch.Tensor
    per_example: torch.Tensor
    clean: float
    corrupted: float
    method: str
    metric_name: str
    ig_steps: int = 1
    per_position: Optional[torch.Tensor] = field(default=None, repr=False)
    clean_values: Optional[torch.Tensor] = field(default=None, repr=False)  # [batch]
    corrupted_values: Optional[torch.Tensor] = field(default=None, repr=False)  # [batch]
    position_tokens: Optional[list[int]] = field(default=None, repr=False)  # the first corrupted prompt's ids
    tokenizer: object = field(default=None, repr=False, compare=False)  # what decodes them (None: the ids as strings)

    @cached_property
    def position_strings(self) -> Optional[list[str]]:
        """The first corrupted prompt's tokens, raw; decoded when first read (only per-position frames and circuit
        labels read them, and decoding costs a noticeable share of a small model's EAP call)."""
        return None if self.position_tokens is None else token_texts(self.tokenizer, self.position_tokens)

    def __getstate__(self) -> dict:
        # a pickle holds the decoded strings, not the tokenizer
        state = dict(self.__dict__, tokenizer=None)
        state["position_strings"] = self.position_strings
        return state

    def matrix(self) -> torch.Tensor:
        """[writer reader]: the scores, NaN where there is no edge."""
        out = torch.full(tuple(self.graph.valid.shape), float("nan"))
        out[self.graph.edge_writer, self.graph.edge_reader] = self.scores.float().cpu()
        return out

    def to_frame(self, positions: bool = False) -> pd.DataFrame:
        """One row per edge: source, target, input (q k v mlp logits), score; with several prompts a 95% bootstrap
        interval of the mean (ci_low, ci_high) and a sign-flip permutation p-value. `positions=True`: one row per
        (edge, position) with the score at that position (batch mean)."""
        frame = self.graph.to_frame()
        if positions:
            if self.per_position is None:
                raise ValueError("these scores were computed without positions; rerun edge_attribution(..., positions=True)")
            per = self.per_position.float().mean(0).cpu()  # [pos edge]
            n_pos = per.shape[0]
            frame = frame.loc[frame.index.repeat(n_pos)].reset_index(drop=True)
            frame.insert(2, "position", list(range(n_pos)) * self.graph.n_edges)
            if self.position_strings is not None:
                frame.insert(3, "token", self.position_strings * self.graph.n_edges)
            frame["score"] = per.T.reshape(-1).numpy()
            frame["method"] = self.method
            return frame
        frame["score"] = self.scores.float().cpu().numpy()
        if self.per_example.shape[0] > 1:
            low, high = bootstrap_ci(self.per_example)
            frame["ci_low"], frame["ci_high"] = low.numpy(), high.numpy()
            frame["p_value"] = sign_flip_p(self.per_example).numpy()
        frame["method"] = self.method
        return frame

    def top(self, n: int = 20, absolute: bool = True) -> pd.DataFrame:
        """The `n` edges with the largest scores (by |score| unless absolute=False), ranked from 1."""
        if not (isinstance(n, int) and n > 0):
            raise ValueError(f"n={n!r} must be a positive int")
        frame = self.to_frame()
        key = frame["score"].abs() if absolute else frame["score"]
        frame = frame.loc[key.sort_values(ascending=False, kind="stable").index[:n]].reset_index(drop=True)
        frame.insert(0, "rank", range(1, len(frame) + 1))
        return frame

    def circuit(self, n_edges: Optional[int] = None, threshold: Optional[float] = None,
                method: Literal["topn", "greedy"] = "topn", absolute: bool = True):
        """A `Circuit` of the best edges: the top `n_edges` (or every edge with |score| >= `threshold`), or,
        with method='greedy', grown from the logits by adding the best edge into a node already in it; then
        pruned of nodes that do not reach the logits or are not reached from the embedding."""
        from probe.analyses.circuit import circuit_from_scores

        return circuit_from_scores(self, n_edges=n_edges, threshold=threshold, method=method, absolute=absolute)

    def figure(self, top: int = 30) -> go.Figure:
        """The `top` edges by |score| as horizontal bars (with the bootstrap interval when there are several prompts)."""
        frame = self.top(top).iloc[::-1]
        labels = [f"{s} → {t}" for s, t in zip(frame["source"], frame["target"])]
        error = None
        if "ci_low" in frame:
            error = dict(type="data", symmetric=False, array=(frame["ci_high"] - frame["score"]).to_numpy(),
                         arrayminus=(frame["score"] - frame["ci_low"]).to_numpy())
        hover = [f"{l}<br>score {s:+.5g}" + (f"<br>p = {p:.3g}" if "p_value" in frame else "")
                 for l, s, p in zip(labels, frame["score"], frame.get("p_value", frame["score"]))]
        fig = go.Figure(go.Bar(x=frame["score"], y=labels, orientation="h", error_x=error, hovertext=hover, hoverinfo="text",
                               marker_color=["#2166ac" if v >= 0 else "#b2182b" for v in frame["score"]]))
        steps = f", {self.ig_steps} steps" if self.method.startswith("eap-ig") else ""
        fig.update_layout(
            title=f"Edge attribution ({self.method}{steps}): top {len(frame)} of {self.graph.n_edges} edges<br><sup>estimated "
                  f"change of the {self.metric_name} from patching the edge alone (clean {self.clean:.4g}, corrupted "
                  f"{self.corrupted:.4g})</sup>",
            xaxis_title=f"change of the {self.metric_name}", yaxis_type="category", height=200 + 22 * len(frame), width=900)
        return fig


def paired_tokens(model: HookedDecoder, clean: AnalysisInput, corrupted: AnalysisInput, attention_mask=None):
    """(clean tokens, corrupted tokens, mask): the two must line up position by position."""
    clean_tokens, clean_mask = tokens_and_mask(model, clean, attention_mask)
    tokens, mask = tokens_and_mask(model, corrupted, attention_mask)
    if clean_tokens.shape != tokens.shape or not torch.equal(clean_mask, mask):
        raise ValueError(f"clean {tuple(clean_tokens.shape)} and corrupted {tuple(tokens.shape)} prompts must have the "
                         "same shape and padding: edges are patched position by position")
    return clean_tokens, tokens, mask


@with_grouped_key_values
def edge_attribution(
    model: HookedDecoder,
    clean: AnalysisInput,
    corrupted: AnalysisInput,
    metric: Metric,
    method: EdgeMethod = "eap",
    ig_steps: int = 5,
    positions: bool = False,
    *,
    attention_mask: Optional[torch.Tensor] = None,
    max_rows: Optional[int] = None,
) -> EdgeScores:
    """Score every edge of `circuit_graph(model)` for restoring the clean behaviour in the corrupted run.

    `metric(logits, tokens, attention_mask) -> [batch]` as in analyses.ablation (e.g. `logit_diff_metric`).
    `positions=True` also keeps each position's share (memory batch x pos x edges). `max_rows` caps the
    rows of one forward (the stacked runs of the gradient methods, the patched copies of method="exact"), though a
    forward holds at least one batch (method="clean-corrupted" stacks its clean and corrupted batch whatever the cap)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of: {', '.join(METHODS)}")
    # NumPy and 0-d tensor integers too (a sweep's values), as plain ints from here on
    if not (is_int(ig_steps) and ig_steps > 0):
        raise ValueError(f"ig_steps={ig_steps!r} must be a positive int")
    ig_steps = int(ig_steps)
    if max_rows is not None:
        if not (is_int(max_rows) and max_rows > 0):
            # 0 or a negative cap silently meant one batch per forward, and a float failed deep in the slicing
            raise ValueError(f"max_rows={max_rows!r} must be a positive int (rows per forward), or None for a memory budget")
        max_rows = int(max_rows)
    graph = circuit_graph(model)
    refuse_next_token_metric(model, metric, "edge_attribution")
    clean_tokens, tokens, mask = paired_tokens(model, clean, corrupted, attention_mask)
    reads = logit_reads(metric)
    if reads is not None and method != "exact":
        # the gradient methods evaluate the metric on stacked runs only (2 or more batches at once), so 4 answers for 2
        # prompts would tile without complaint (clean rows reading answers 0-1, corrupted rows 2-3): ask the metric for
        # one batch's columns first, which refuses answers that do not match the prompts
        reads.columns(tokens.shape[0], tokens.device)
    if method == "exact":
        if positions:
            raise ValueError("method='exact' patches whole edges (every position at once); per-position scores come from "
                             "the gradient methods")
        writer_names = graph_hook_names(graph)
        with torch.no_grad():
            logits, clean_cache = model.run_with_cache(clean_tokens, attention_mask=model_mask(mask), names=writer_names)
            clean_values = evaluate_metric(metric, logits, clean_tokens, mask)
            logits, cache = model.run_with_cache(tokens, attention_mask=model_mask(mask), names=writer_names)
            corrupted_values = evaluate_metric(metric, logits, tokens, mask)
            del logits
        per_example = _exact(model, graph, tokens, mask, metric, writer_outputs(model, graph, clean_cache), cache,
                             corrupted_values, max_rows)
        per_position = None
    else:
        per_example, per_position, clean_values, corrupted_values = gradient_scores(
            model, graph, clean_tokens, tokens, mask, metric, method, ig_steps, positions, max_rows)
    clean_mean, corrupted_mean = float(clean_values.mean()), float(corrupted_values.mean())
    return EdgeScores(
        graph=graph, scores=per_example.mean(0).cpu(), per_example=per_example.cpu(), clean=clean_mean,
        corrupted=corrupted_mean, method=method, metric_name=metric_name(metric),
        ig_steps=ig_steps if method.startswith("eap-ig") else 1,
        per_position=None if per_position is None else per_position.cpu(), clean_values=clean_values.detach().cpu(),
        corrupted_values=corrupted_values.cpu(), position_tokens=tokens[0].tolist(), tokenizer=model.tokenizer,
    )


@torch.no_grad()
def _exact(model, graph, tokens, mask, metric, clean_out, cache, corrupted_values, max_rows):
    """[batch edge]: the metric's change with each edge alone carrying the clean output, the rest as they are."""
    batch, n_pos = tokens.shape
    corr_out = writer_outputs(model, graph, cache)
    base = stage_residuals(graph, cache)
    valid = graph.valid.to(tokens.device).float()
    w, r = graph.edge_writer.tolist(), graph.edge_reader.tolist()
    copies = copies_per_forward(model, batch, n_pos, max_rows)
    out = torch.empty(batch, graph.n_edges)
    for first in tqdm(range(0, graph.n_edges, copies), desc="exact edge patching", leave=False,
                      total=-(-graph.n_edges // copies)):
        chunk = range(first, min(first + copies, graph.n_edges))
        patch = torch.zeros(len(chunk), *valid.shape, device=tokens.device)
        for c, e in enumerate(chunk):
            patch[c, w[e], r[e]] = 1.0
        spec = EdgeInputs(base=base, ref=corr_out, carry=valid[None] - patch, source=clean_out, patch=patch)
        logits = run_edges(model, graph, tokens, model_mask(mask), spec)
        values = evaluate_metric(metric, logits, tokens.repeat(len(chunk), 1), mask.repeat(len(chunk), 1))
        out[:, first:first + len(chunk)] = (values.view(len(chunk), batch) - corrupted_values[None]).T.cpu()
    return out


def circuit_refusal(model: HookedDecoder) -> Optional[str]:
    """Why edge attribution does not run on `model`, in its refusal's own words, or None where it runs (for callers
    that say so instead of failing, as `probe report` does)."""
    try:
        circuit_graph(model)
        norm_kind(model)  # (the gradient methods pull head gradients back through one kind of norm)
    except (ValueError, TypeError) as refusal:
        return str(refusal)
    return None
