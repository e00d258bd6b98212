"""The gradient runs behind edge attribution, reduced to edge scores without a tensor per edge.

Every gradient method is a set of runs stacked along the batch: "eap" the corrupted run; EAP-IG its
m interpolation steps (alpha = 0, 1/m, ..., (m-1)/m; alpha = 0 is the corrupted run itself);
"clean-corrupted" the corrupted and the clean run, each with weight 1/2. The clean prompts run too,
for the writers' clean outputs. One forward takes as many runs as fit GRADIENT_TOKENS (the clean rows
join it when they need a gradient, or when the model is small enough that a forward costs its
per-operation overhead rather than its arithmetic: then two forwards would cost nearly twice one),
and one backward gives every hook point's gradient.

What is kept, and why it is cheap:
- writers: the embedding, each layer's hook_z (a head's output is z @ W_O, so no per-head result is
  formed in the forward) and MLP output, of the clean and the corrupted rows, kept inline by Store
  hooks; the deltas [batch writer pos d_model] are formed once.
- the logits: for a metric that declares its reads (analyses.metric_reads), only its columns at its
  positions, from the final residual; otherwise computed without a graph for the metric's value, and
  only the rows its gradient says it reads are unembedded again with a graph, so the backward never
  multiplies the whole [batch pos vocab] gradient through W_U.
- readers: the gradients at each head's hook_q/k/v, at each MLP's own input (hook_mlp_in), at each recurrent
  mixer's (ln1.hook_in, which only ln1 reads) and at the final residual; analyses.edge_contraction pulls the heads' back through their projections and ln1
  and contracts everything with the deltas into [batch writer reader] (or [batch pos writer reader]
  when per-position scores are asked for). No [batch pos reader d_model] tensor of the whole graph exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from probe.analyses.circuit_graph import CircuitGraph
from probe.analyses.common import evaluate_metric, model_mask
from probe.analyses.edge_contraction import mixer_in_name, mlp_in_name, norm_kind, reader_scores, writer_deltas
from probe.analyses.edge_patching import gate_name
from probe.analyses.metric_reads import evaluate_output, logit_reads
from probe.hooks.hook_point import Store
from probe import HookedDecoder
from probe.names import act_name

GRADIENT_TOKENS = 2**12  # rows x positions of one gradient forward: the runs beyond it go to further forwards
SMALL_FORWARD = 2**24  # tokens x d_model^2 under which a forward is overhead-bound and the clean rows join it


@dataclass(frozen=True)
class Run:
    """One run stacked in a gradient forward: the clean prompts, or the corrupted ones moved `alpha` of the way
    to the clean run (at the input embedding, or at every residual a reader reads); `weight` of its gradient."""

    clean: bool
    alpha: float = 0.0
    weight: float = 0.0


def plan(method: str, ig_steps: int) -> list[Run]:
    if method == "clean-corrupted":
        return [Run(clean=True, weight=0.5), Run(clean=False, weight=0.5)]
    steps = ig_steps if method.startswith("eap-ig") else 1
    return [Run(clean=True)] + [Run(clean=False, alpha=k / steps, weight=1.0 / steps) for k in range(steps)]


class _Forward:
    """The hooks of one stacked forward: they record writers and residuals, move the interpolated runs and keep
    the tensors whose gradients are wanted."""

    def __init__(self, model: HookedDecoder, graph: CircuitGraph, runs: list[Run], batch: int, move: str,
                 saved: dict, grads: bool):
        self.model, self.graph, self.runs, self.batch, self.move = model, graph, runs, batch, move
        self.saved = saved  # name -> {"clean": ..., "corrupted": ...}, shared by the forwards of one call
        self.grads = grads
        self.live: dict[str, torch.Tensor] = {}  # hook name -> activation in the graph
        self.read: dict[int, torch.Tensor] = {}  # layer -> the residual ln1 read, every row (detached)
        self.stored: dict[str, torch.Tensor] = {}  # writers the Store hooks keep (every row, detached): see collect
        self.residuals: dict[str, torch.Tensor] = {}  # resid_pre the Store hooks keep, when no hook moves it
        self.kept_rows = [("clean" if run.clean else "corrupted", self.rows(i)) for i, run in enumerate(runs)
                          if run.clean or run.alpha == 0]

    def rows(self, i: int) -> slice:
        return slice(i * self.batch, (i + 1) * self.batch)

    def record(self, name: str, act: torch.Tensor) -> None:
        slot = self.saved.setdefault(name, {})
        for key, rows in self.kept_rows:
            if key not in slot:
                part = act[rows]
                slot[key] = part.detach() if part.requires_grad else part  # a Store's tensors come detached

    def collect(self) -> None:
        """After the forward: the stored writers' clean and corrupted rows into `saved`, and the residuals ln1 read."""
        for name, act in self.stored.items():
            self.record(name, act)
        for l in range(1, self.graph.n_layers):
            if act_name("resid_pre", l) in self.residuals:
                self.read[l] = self.residuals[act_name("resid_pre", l)]

    def moved(self, name: str, act: torch.Tensor) -> torch.Tensor:
        """act, with each interpolated run's rows put at corrupted + alpha (clean - corrupted); the gradient still
        flows through act (an offset, not a replacement)."""
        self.record(name, act)
        if not any(run.alpha for run in self.runs):
            return act
        clean, corrupted = self.saved[name]["clean"], self.saved[name]["corrupted"]
        offset = torch.zeros_like(act)
        for i, run in enumerate(self.runs):
            if run.alpha:
                rows = self.rows(i)
                offset[rows] = (corrupted + run.alpha * (clean - corrupted)).to(act.dtype) - act[rows].detach()
        return act + offset

    def keep(self, name: str, act: torch.Tensor, wanted: bool = True) -> torch.Tensor:
        """act, in the graph; its gradient is wanted (self.live) unless it is only the graph's start."""
        if self.grads:
            if not act.requires_grad:  # frozen weights: the first activation becomes a leaf of the graph
                act = act.detach().requires_grad_(True)
            if wanted:
                self.live[name] = act
        return act

    def hooks(self) -> list:
        """Writers recorded; residuals moved (EAP-IG) and the ones ln1 reads kept; gradients wanted at each
        head's q/k/v, each MLP's own input and the final residual (the logits' reader)."""
        graph, L = self.graph, self.graph.n_layers
        moves_all = self.move == "activations"

        def resid(name: str, moves: bool, reads: Optional[int] = None, kept: bool = False):
            def hook(act, hook):
                out = self.moved(name, act) if moves else act
                if name == act_name("resid_pre", 0):
                    self.record("embed", act)
                if reads is not None:
                    self.read[reads] = out.detach()
                return self.keep(name, out, wanted=name != act_name("resid_pre", 0)) if kept else out
            return hook

        store, store_residual = Store(self.stored), Store(self.residuals)  # inline in the hook point: no call, no checks
        # q, k and v kept in their graph, the backward's inputs (downstream of resid_pre 0, so in the graph even when
        # the weights are frozen)
        live = Store(self.live, detach=False)

        def keep_own(act, hook):  # a node of its own: its gradient is its reader's share, not the residual's whole
            return self.keep(hook.name, act.view_as(act)) if self.grads else act

        # resid_pre 0 starts the graph (a leaf, if the weights are frozen); no reader's gradient is its own
        out = [(act_name("resid_pre", 0), resid(act_name("resid_pre", 0), self.move != "none", reads=0, kept=True))]
        for l in range(L):
            if l > 0:
                name = act_name("resid_pre", l)
                out.append((name, resid(name, True, reads=l) if moves_all else store_residual))
            if graph.is_mixer(l):  # its input's own gradient (ln1's input: not the residual's that flows past)
                out += [(act_name("attn_out", l), store), (mixer_in_name(l), keep_own)]
            else:
                if self.grads:
                    out += [(act_name(kind, l), live) for kind in ("q", "k", "v")]
                    out += [(gate_name(l), live)] * graph.gated  # the gate's logits read the queries' input too
                out.append((act_name("z", l), store))
            if graph.mlps:
                out += [(act_name("mlp_out", l), store), (mlp_in_name(l), keep_own)]
            if graph.sandwich:
                out.append((act_name("scale", l, "ln1_post"), store))
            if graph.mlps and not graph.parallel and moves_all:
                out.append((act_name("resid_mid", l), resid(act_name("resid_mid", l), True)))
        last = act_name("resid_post", L - 1)
        out.append((last, resid(last, moves_all, kept=True)))
        if graph.qk_positions:  # what a shortformer model's q and k hold beyond the normalised residual's projection
            out.append(("hook_pos_embed", store))
        return out


def gradient_scores(model: HookedDecoder, graph: CircuitGraph, clean_tokens: torch.Tensor, tokens: torch.Tensor,
                    mask: torch.Tensor, metric, method: str, ig_steps: int, positions: bool,
                    max_rows: Optional[int] = None):
    """(per_example [batch edge], per_position [batch pos edge] or None, clean values [batch], corrupted [batch])."""
    batch, n_pos = tokens.shape
    runs = plan(method, ig_steps)
    move = {"eap-ig-inputs": "inputs", "eap-ig-activations": "activations"}.get(method, "none")
    per_forward = max(1, (max_rows if max_rows is not None else GRADIENT_TOKENS // n_pos) // batch)
    small = batch * n_pos * model.cfg.d_model ** 2 <= SMALL_FORWARD or tokens.device.type != "cpu"
    stack_clean = runs[0].weight > 0 or (small and per_forward >= 2)
    layers_at_once = graph.n_layers if small else 1  # see analyses.edge_contraction
    norm = norm_kind(model)
    chunks = []
    rest = runs if stack_clean else runs[1:]
    while rest:
        chunks.append(rest[:max(per_forward, 2 if rest[0].clean else 1)])  # clean and corrupted share the first
        rest = rest[len(chunks[-1]):]
    if not stack_clean:
        chunks.insert(0, [runs[0]])

    saved: dict = {}
    values: dict[str, torch.Tensor] = {}
    full = None  # [batch (pos) writer reader]
    deltas = None
    for chunk in chunks:
        grads = any(run.weight for run in chunk)
        fwd = _Forward(model, graph, chunk, batch, move, saved, grads)
        stacked = torch.cat([clean_tokens if run.clean else tokens for run in chunk])
        rows_mask = mask.expand(len(chunk), *mask.shape).reshape(-1, n_pos)  # a view for one prompt
        with torch.enable_grad() if grads else torch.no_grad():
            with model.hooks(fwd.hooks()):
                final = model(stacked, attention_mask=model_mask(rows_mask), stop_at_layer=graph.n_layers)
            fwd.collect()
            logit_grads = _metric_pass(model, metric, fwd, final, stacked, rows_mask, mask, values)
            if not grads:
                continue
            hook_grads = _backward(model, fwd, final, logit_grads)
        # weights (parameters) enter below, with no graph; inference mode also skips the version counters and view
        # records of no_grad (measured: ~0.2 ms of a 7 ms small-model EAP call); only `full` leaves it, and it is
        # only read afterwards
        with torch.inference_mode():
            if deltas is None:  # writer-major: each stage's product reads its first writers as one block
                deltas = writer_deltas(model, graph, saved, layers_at_once, norm == "layer")
            part = reader_scores(model, graph, [run.weight for run in chunk], hook_grads, fwd.live, fwd.read, deltas, mask,
                                 positions, layers_at_once, norm,
                                 saved["hook_pos_embed"]["corrupted"] if graph.qk_positions else None)
        full = part if full is None else full + part
        del fwd, final, hook_grads
    w, r = graph.edge_writer.to(tokens.device), graph.edge_reader.to(tokens.device)
    per_position = full[:, :, w, r] if positions else None
    per_example = per_position.sum(1) if positions else full[:, w, r]
    return per_example, per_position, values["clean"], values["corrupted"]


def _metric_pass(model, metric, fwd: _Forward, final, stacked, rows_mask, mask, values):
    """The metric of every run (its value kept for the clean and corrupted runs) and, for the runs with a weight,
    (rows, positions, d metric / d logits) at the positions the metric reads; for a metric that declares what it
    reads (analyses.metric_reads), the sum of the weighted runs' values instead, computed with a graph from the
    final residual at those positions and columns only: no [batch pos vocab] logits at all."""
    if logit_reads(metric) is not None:  # every run's rows at once
        weighted = [fwd.rows(i) for i, run in enumerate(fwd.runs) if run.weight]
        with torch.enable_grad() if weighted else torch.no_grad():
            value = evaluate_output(model, metric, final, stacked, rows_mask)
        for i, run in enumerate(fwd.runs):
            key = "clean" if run.clean else ("corrupted" if run.alpha == 0 else None)
            if key is not None:
                values[key] = value[fwd.rows(i)].detach()
        # the run's weight comes in the contraction
        return sum(value[rows].sum() for rows in weighted) if weighted else None
    out = []
    for i, run in enumerate(fwd.runs):
        rows = fwd.rows(i)
        with torch.no_grad():
            logits = model.unembed(model.ln_final(final[rows].detach()))
        with torch.enable_grad():
            leaf = logits.requires_grad_(True)
            value = evaluate_metric(metric, leaf, stacked[rows], mask)
            key = "clean" if run.clean else ("corrupted" if run.alpha == 0 else None)
            if key is not None:
                values[key] = value.detach()
            if not run.weight:
                continue
            if not value.requires_grad:
                raise ValueError("the metric's value does not depend on the logits through differentiable operations "
                                 "(no autograd graph); edge attribution needs its gradient: compute it with torch "
                                 "operations on the logits, not .item(), argmax or .detach()")
            grad = torch.autograd.grad(value.sum(), leaf)[0]  # the run's weight comes in the contraction
        where = grad.ne(0).any(-1).nonzero()  # [n 2]: (row, position) the metric reads
        out.append((rows.start + where[:, 0], where[:, 1], grad[where[:, 0], where[:, 1]]))
    return out


def _backward(model, fwd: _Forward, final, logit_grads) -> dict[str, torch.Tensor]:
    """Every kept activation's gradient, through the unembedding of the read positions only (`logit_grads` from
    _metric_pass: per-run logit gradients, or the metric's summed value when it declared its reads)."""
    if isinstance(logit_grads, torch.Tensor):
        names = list(fwd.live)
        grads = torch.autograd.grad(logit_grads, [fwd.live[n] for n in names], allow_unused=True, materialize_grads=True)
        return dict(zip(names, grads))
    rows = torch.cat([r for r, _, _ in logit_grads])
    pos = torch.cat([p for _, p, _ in logit_grads])
    names = list(fwd.live)
    if rows.numel() == 0:  # the metric reads nothing: every gradient is zero
        return {n: torch.zeros_like(fwd.live[n]) for n in names}
    logits = model.unembed(model.ln_final(final[rows, pos][None]))
    grad = torch.cat([g for _, _, g in logit_grads])[None].to(logits.dtype)
    grads = torch.autograd.grad(logits, [fwd.live[n] for n in names], grad, allow_unused=True, materialize_grads=True)
    return dict(zip(names, grads))
