"""How much of the clean behaviour a circuit keeps when every edge outside it is ablated.

One forward of the corrupted prompt in which each reader's input is rebuilt from the writers it keeps
(their outputs in this very run, which depend on what reaches them) and the ablated value of those it
drops: "patch" the corrupted run's output, "mean" its mean over the corrupted prompts (per position),
"zero" nothing. The embedding's kept edges carry the clean embedding. Every edge kept is the clean run;
none kept is the corrupted run (for "patch"). Faithfulness is (circuit - ablated) / (clean - ablated) of
the batch-mean metric, where "ablated" is the empty circuit (the corrupted run for "patch").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch
from tqdm.auto import tqdm

from probe.analyses.ablation import Metric, metric_name
from probe.analyses.architecture import refuse_next_token_metric
from probe.analyses.circuit import Circuit
from probe.analyses.circuit_graph import CircuitGraph, circuit_graph, with_grouped_key_values
from probe.analyses.common import AnalysisInput, TableDisplay, check_int, is_int, model_mask
from probe.analyses.edge_attribution import EdgeScores, paired_tokens
from probe.analyses.circuit_forward import BaseRun, qkv_hook_names, sparse_final, sparse_supported
from probe.analyses.edge_patching import EdgeInputs, copies_per_forward, graph_hook_names, rebased, run_edges, stage_residuals, writer_outputs
from probe.analyses.metric_reads import evaluate_output, metric_stop
from probe.analyses.paired_stats import bootstrap_ratio_ci, sign_flip_p
from probe import HookedDecoder

Ablation = Literal["patch", "mean", "zero"]
ABLATIONS = ("patch", "mean", "zero")
Engine = Literal["auto", "sparse", "hooked"]
ENGINES = ("auto", "sparse", "hooked")


@dataclass
class CircuitRunner:
    """The clean and corrupted runs a circuit's forward is rebuilt from (two forwards, once); `evaluate(masks)` runs
    circuits stacked along the batch, `faithfulness(circuit)` one circuit in one patched forward. Prepare one to
    measure many circuits on the same prompts: `CircuitRunner.prepare(model, clean, corrupted, metric)`.

    `engine`: "sparse" computes only the nodes a circuit touches, from the weights (analyses.circuit_forward);
    "hooked" runs the model's forward with every reader's input rebuilt by hooks (analyses.edge_patching); "auto"
    (the default) is "sparse" wherever it runs (not sandwich blocks, nor a model with hooks attached to stay, such as
    ARENA's padding masks on hook_attn_scores, which only the hooked forward runs): it computes a subset of what the
    hooked forward computes, so it is never the more expensive one. The two agree to float error."""

    model: HookedDecoder
    graph: CircuitGraph
    metric: Metric
    tokens: torch.Tensor
    mask: torch.Tensor
    clean_out: torch.Tensor
    ref: torch.Tensor
    base: dict
    clean_values: torch.Tensor  # [batch]
    corrupted_values: torch.Tensor  # [batch]
    ablation: str
    max_rows: Optional[int] = None
    run: Optional[BaseRun] = None  # the base run, when the sparse engine is used

    @classmethod
    @torch.no_grad()
    def prepare(cls, model: HookedDecoder, clean: AnalysisInput, corrupted: AnalysisInput, metric: Metric,
                ablation: Ablation = "patch", attention_mask=None, max_rows: Optional[int] = None,
                engine: Engine = "auto") -> "CircuitRunner":
        if ablation not in ABLATIONS:
            raise ValueError(f"ablation={ablation!r} is not one of: {', '.join(ABLATIONS)}")
        if engine not in ENGINES:
            raise ValueError(f"engine={engine!r} is not one of: {', '.join(ENGINES)}")
        graph = circuit_graph(model)
        refuse_next_token_metric(model, metric, "faithfulness")
        if engine == "sparse" and not sparse_supported(graph):
            raise ValueError("engine='sparse' does not run sandwich blocks (Gemma 2, OLMo 2), whose heads' outputs share "
                             "one norm scale per layer, nor ALiBi's position bias on the scores (Bloom), nor clamped "
                             "q, k and v (clip_qkv), nor attention sinks (GPT-OSS), nor q/k norms after rotary "
                             "(HunYuan); use engine='auto' or 'hooked'")
        # hooks attached to stay (add_hook, a padding mask on hook_attn_scores) change the model's forward, which the
        # sparse engine recomputes from the weights without them
        attached = sorted({name for name, direction, *_ in model.persistent_hooks() if direction == "fwd"})
        if engine == "sparse" and attached:
            raise ValueError(f"engine='sparse' computes the circuit's forward from the weights, without the hooks "
                             f"attached to {attached}; use engine='auto' or 'hooked', which runs them")
        sparse = engine == "sparse" or (engine == "auto" and sparse_supported(graph) and not attached)
        clean_tokens, tokens, mask = paired_tokens(model, clean, corrupted, attention_mask)
        names = graph_hook_names(graph)
        stop = metric_stop(model, metric)  # a metric that says what it reads: no full logits
        out, clean_cache = model.run_with_cache(clean_tokens, attention_mask=model_mask(mask), names=names, stop_at_layer=stop)
        clean_values = evaluate_output(model, metric, out, clean_tokens, mask)
        extra = qkv_hook_names(graph) if sparse and ablation == "patch" else []
        out, cache = model.run_with_cache(tokens, attention_mask=model_mask(mask), names=names + extra, stop_at_layer=stop)
        corrupted_values = evaluate_output(model, metric, out, tokens, mask)
        del out
        corr_out = writer_outputs(model, graph, cache)
        if ablation == "patch":
            ref = corr_out
        elif ablation == "zero":
            ref = torch.zeros_like(corr_out)
        else:
            if tokens.shape[0] < 2:
                raise ValueError("ablation='mean' averages the writers' outputs over the corrupted prompts, so it needs "
                                 "more than one; pass several, or use ablation='patch' or 'zero'")
            weights = mask.float()[:, :, None, None]
            ref = ((corr_out * weights).sum(0, keepdim=True) / weights.sum(0, keepdim=True).clamp(min=1)).expand_as(corr_out)
        base = rebased(graph, stage_residuals(graph, cache), corr_out, ref)
        # under "patch" the base run is the corrupted run; otherwise one more forward, with every residual at base
        run = BaseRun.prepare(model, graph, tokens, mask, base, ref, cache if ablation == "patch" else None) if sparse else None
        return cls(model=model, graph=graph, metric=metric, tokens=tokens, mask=mask, clean_out=writer_outputs(model, graph, clean_cache),
                   ref=ref, base=base, clean_values=clean_values, corrupted_values=corrupted_values, ablation=ablation,
                   max_rows=max_rows, run=run)

    @torch.no_grad()
    def evaluate(self, circuits: torch.Tensor, progress: bool = False) -> torch.Tensor:
        """[circuit batch]: the metric of each circuit, given as [circuit edge] bool."""
        graph, (batch, n_pos) = self.graph, self.tokens.shape
        _check_masks(graph, circuits)
        device = self.tokens.device
        w, r = graph.edge_writer.to(device), graph.edge_reader.to(device)
        copies = copies_per_forward(self.model, batch, n_pos, self.max_rows)
        out = torch.empty(circuits.shape[0], batch)
        starts = range(0, circuits.shape[0], copies)
        for first in tqdm(starts, desc="circuits", total=len(starts), leave=False) if progress else starts:
            chunk = circuits[first:first + copies].to(device)
            keep = torch.zeros(chunk.shape[0], *graph.valid.shape, device=device)
            keep[:, w, r] = chunk.float()
            k = chunk.shape[0]
            stop = metric_stop(self.model, self.metric)  # a metric that says what it reads: no full logits
            if self.run is not None:  # the embedding's row: its kept edges carry the clean embedding
                final = sparse_final(self.model, graph, self.run, self.base, self.ref, self.clean_out, keep.bool())
                output = final if stop is not None else self.model.unembed(self.model.ln_final(final))
            else:
                source = torch.zeros_like(keep)
                source[:, 0] = keep[:, 0]  # the embedding has no input to rebuild: its kept edges carry the clean one
                keep[:, 0] = 0.0
                spec = EdgeInputs(base=self.base, ref=self.ref, carry=keep, source=self.clean_out, patch=source)
                output = run_edges(self.model, graph, self.tokens, model_mask(self.mask), spec, stop_at_layer=stop)
            tokens, mask = (self.tokens, self.mask) if k == 1 else (self.tokens.repeat(k, 1), self.mask.repeat(k, 1))
            values = evaluate_output(self.model, self.metric, output, tokens, mask)
            out[first:first + k] = values.view(k, batch).cpu()
        return out

    def faithfulness(self, circuit: Circuit) -> Faithfulness:
        """One circuit's faithfulness from these runs: one patched forward (what a curve pays per circuit)."""
        _check_circuit(self.graph, circuit)
        values = self.evaluate(circuit.edge_mask()[None])[0]
        return _result(self, values, self.baseline(), circuit.n_edges)

    def baseline(self) -> torch.Tensor:
        """[batch]: the metric with every edge ablated (the corrupted run itself for 'patch')."""
        if self.ablation == "patch":
            return self.corrupted_values.cpu()
        return self.evaluate(torch.zeros(1, self.graph.n_edges, dtype=torch.bool))[0]


@dataclass
class Faithfulness(TableDisplay):
    """`value`: (circuit - ablated) / (clean - ablated) of the batch means; per-prompt metrics in `circuit_values`,
    `clean_values`, `ablated_values` [batch]; a 95% bootstrap interval of the ratio and a sign-flip p-value that the
    circuit moves the metric away from the ablated run at all."""

    value: float
    n_edges: int
    ablation: str
    metric_name: str
    circuit_values: torch.Tensor
    clean_values: torch.Tensor
    ablated_values: torch.Tensor

    @property
    def circuit(self) -> float:
        return float(self.circuit_values.mean())

    @property
    def clean(self) -> float:
        return float(self.clean_values.mean())

    @property
    def ablated(self) -> float:
        return float(self.ablated_values.mean())

    def interval(self) -> tuple[float, float]:
        low, high = bootstrap_ratio_ci(self.circuit_values - self.ablated_values, self.clean_values - self.ablated_values)
        return float(low), float(high)

    def p_value(self) -> float:
        return float(sign_flip_p(self.circuit_values - self.ablated_values))

    def to_frame(self) -> pd.DataFrame:
        """One row per prompt, and a last row `prompt = "mean"` with the interval and p-value."""
        gap = self.clean_values - self.ablated_values
        rows = pd.DataFrame({"prompt": [str(i) for i in range(len(gap))], "circuit": self.circuit_values.numpy(),
                             "clean": self.clean_values.numpy(), "ablated": self.ablated_values.numpy(),
                             "faithfulness": ((self.circuit_values - self.ablated_values) / gap).numpy()})
        low, high = self.interval()
        mean = pd.DataFrame({"prompt": ["mean"], "circuit": [self.circuit], "clean": [self.clean], "ablated": [self.ablated],
                             "faithfulness": [self.value], "ci_low": [low], "ci_high": [high], "p_value": [self.p_value()]})
        frame = pd.concat([rows, mean], ignore_index=True)
        frame["edges"], frame["ablation"] = self.n_edges, self.ablation
        return frame


def _check_masks(graph: CircuitGraph, circuits) -> None:
    # one circuit's [edge] mask would broadcast into every row, and float weights would be fractional edges to the
    # hooked engine but whole ones to the sparse engine: both silently wrong
    if not isinstance(circuits, torch.Tensor) or circuits.dim() != 2:
        got = tuple(circuits.shape) if isinstance(circuits, torch.Tensor) else type(circuits).__name__
        raise ValueError(f"circuits must be a [circuit edge] bool tensor, got {got}; for one circuit pass "
                         "circuit.edge_mask()[None], for several torch.stack of their edge masks")
    if circuits.shape[1] != graph.n_edges:
        raise ValueError(f"circuits has {circuits.shape[1]} columns but this model's graph has {graph.n_edges} edges: "
                         "build the masks from this model's graph (Circuit.edge_mask())")
    if circuits.dtype != torch.bool:
        raise TypeError(f"circuits must be bool (an edge is kept or not), got {circuits.dtype}; pass mask.bool() or "
                        "Circuit.edge_mask()")


def _check_circuit(graph: CircuitGraph, circuit: Circuit) -> None:
    if not isinstance(circuit, Circuit):
        raise TypeError(f"circuit must be a Circuit (from EdgeScores.circuit or Circuit.from_edges), got {type(circuit).__name__}")
    if circuit.graph.writers != graph.writers or circuit.graph.readers != graph.readers:
        raise ValueError("the circuit was built on another model's graph; build it from this model's edge scores")


@with_grouped_key_values
def faithfulness(model: HookedDecoder, circuit: Circuit, clean: AnalysisInput, corrupted: AnalysisInput, metric: Metric,
                 ablation: Ablation = "patch", *, attention_mask: Optional[torch.Tensor] = None,
                 engine: Engine = "auto") -> Faithfulness:
    """The metric with only the circuit's edges carrying what they carry in the clean run, normalised (see above);
    `engine` as in CircuitRunner."""
    _check_circuit(circuit_graph(model), circuit)
    return CircuitRunner.prepare(model, clean, corrupted, metric, ablation, attention_mask, engine=engine).faithfulness(circuit)


def _result(runner: CircuitRunner, values: torch.Tensor, ablated: torch.Tensor, n_edges: int) -> Faithfulness:
    clean = runner.clean_values.cpu()
    gap = float(clean.mean() - ablated.mean())
    if abs(gap) <= 1e-6 * max(abs(float(clean.mean())), abs(float(ablated.mean())), 1e-30):
        raise ValueError(f"the metric is {float(clean.mean()):.6g} both clean and with every edge ablated, so there is "
                         "nothing for a circuit to recover; choose prompts (or a metric) that tell them apart")
    return Faithfulness(value=float(values.mean() - ablated.mean()) / gap, n_edges=n_edges, ablation=runner.ablation,
                        metric_name=metric_name(runner.metric), circuit_values=values, clean_values=clean, ablated_values=ablated)


@dataclass
class FaithfulnessCurve(TableDisplay):
    """Faithfulness of the best circuits of each size and of random circuits of the same sizes."""

    sizes: list[int]  # edges chosen
    kept: list[int]  # edges left after pruning
    results: list[Faithfulness]  # the scored circuits, one per size
    random: list[list[Faithfulness]]  # [size][draw]
    method: str
    scores_method: str
    signed: bool = False  # ranked by the score itself rather than |score|

    def to_frame(self) -> pd.DataFrame:
        rows = []
        for size, kept, best, draws in zip(self.sizes, self.kept, self.results, self.random):
            low, high = best.interval()
            rows.append({"circuit": self.method, "edges": size, "edges_after_pruning": kept, "draw": pd.NA,
                         "faithfulness": best.value, "ci_low": low, "ci_high": high, "p_value": best.p_value(),
                         "metric": best.circuit})
            for i, draw in enumerate(draws):
                rows.append({"circuit": "random", "edges": size, "edges_after_pruning": size, "draw": i,
                             "faithfulness": draw.value, "ci_low": float("nan"), "ci_high": float("nan"),
                             "p_value": float("nan"), "metric": draw.circuit})
        return pd.DataFrame(rows)

    def figure(self) -> go.Figure:
        frame = self.to_frame()
        best = frame[frame["circuit"] != "random"]
        fig = go.Figure()
        fig.add_trace(go.Scatter(
            x=best["edges"], y=best["faithfulness"], mode="lines+markers", name=f"{self.scores_method} circuit ({self.method}{', signed' if self.signed else ''})",
            error_y=dict(type="data", symmetric=False, array=(best["ci_high"] - best["faithfulness"]).to_numpy(),
                         arrayminus=(best["faithfulness"] - best["ci_low"]).to_numpy()),
            customdata=best[["edges_after_pruning", "p_value"]].to_numpy(),
            hovertemplate="%{x} edges chosen (%{customdata[0]} after pruning)<br>faithfulness %{y:.3f}<br>p = %{customdata[1]:.3g}<extra></extra>"))
        rand = frame[frame["circuit"] == "random"]
        if len(rand):
            stats = rand.groupby("edges")["faithfulness"].agg(["mean", "min", "max"]).reset_index()
            fig.add_trace(go.Scatter(x=stats["edges"], y=stats["mean"], mode="lines+markers", name="random circuits (mean, range)",
                                     line=dict(color="grey", dash="dash"),
                                     error_y=dict(type="data", symmetric=False, array=(stats["max"] - stats["mean"]).to_numpy(),
                                                  arrayminus=(stats["mean"] - stats["min"]).to_numpy()),
                                     hovertemplate="%{x} random edges<br>faithfulness %{y:.3f}<extra></extra>"))
        fig.add_hline(y=1.0, line=dict(color="#888", width=1), annotation_text="clean")
        fig.add_hline(y=0.0, line=dict(color="#888", width=1), annotation_text="ablated")
        name = self.results[0].metric_name if self.results else "metric"
        fig.update_layout(title=f"Faithfulness by circuit size<br><sup>share of the {name} kept, (circuit - ablated) / (clean - "
                                f"ablated), ablation '{self.results[0].ablation if self.results else ''}'</sup>",
                          xaxis_title="edges in the circuit", yaxis_title="faithfulness", xaxis_type="log", width=900, height=520)
        return fig


def default_sizes(n_edges: int, points: int = 12) -> list[int]:
    """Roughly geometric sizes from 1 to every edge."""
    sizes = {max(1, round(math.exp(math.log(n_edges) * i / (points - 1)))) for i in range(points)}
    return sorted(sizes)


@with_grouped_key_values
def faithfulness_curve(model: HookedDecoder, scores: EdgeScores, clean: AnalysisInput, corrupted: AnalysisInput, metric: Metric,
                       sizes: Optional[Sequence[int]] = None, ablation: Ablation = "patch",
                       method: Literal["topn", "greedy"] = "topn", n_random: int = 3, seed: int = 0, *,
                       attention_mask: Optional[torch.Tensor] = None, absolute: bool = True) -> FaithfulnessCurve:
    """Faithfulness of `scores.circuit(n_edges=size, method=method, absolute=absolute)` for each size, against
    `n_random` circuits of `size` edges drawn uniformly from the graph (not pruned: pruning would not change their
    value). The clean and corrupted runs are prepared once (CircuitRunner)."""
    if not isinstance(scores, EdgeScores):
        raise TypeError(f"scores must be EdgeScores from edge_attribution, got {type(scores).__name__}")
    runner = CircuitRunner.prepare(model, clean, corrupted, metric, ablation, attention_mask)
    if scores.graph.writers != runner.graph.writers or scores.graph.readers != runner.graph.readers:
        raise ValueError("the scores were computed on another model's graph")
    n = runner.graph.n_edges
    sizes = default_sizes(n) if sizes is None else sorted({check_int(s, 'a size in sizes') for s in sizes})  # 2.5 refused
    bad = [s for s in sizes if not 0 <= s <= n]
    if bad:
        raise ValueError(f"sizes {bad} are outside [0, {n}], the graph's edge count")
    if not (is_int(n_random) and n_random >= 0):  # not True, which would quietly be 1
        raise ValueError(f"n_random={n_random!r} must be a non-negative int")
    circuits = [scores.circuit(n_edges=s, method=method, absolute=absolute) for s in sizes]
    gen = torch.Generator().manual_seed(seed)
    masks = [c.edge_mask() for c in circuits]
    for s in sizes:
        for _ in range(n_random):
            drawn = torch.zeros(n, dtype=torch.bool)
            drawn[torch.randperm(n, generator=gen)[:s]] = True
            masks.append(drawn)
    values = runner.evaluate(torch.stack(masks), progress=True)
    ablated = runner.baseline()
    results = [_result(runner, values[i], ablated, c.n_edges) for i, c in enumerate(circuits)]
    random = [[_result(runner, values[len(sizes) + i * n_random + j], ablated, s) for j in range(n_random)]
              for i, s in enumerate(sizes)]
    return FaithfulnessCurve(sizes=list(sizes), kept=[c.n_edges for c in circuits], results=results, random=random,
                             method=method, scores_method=scores.method, signed=not absolute)
