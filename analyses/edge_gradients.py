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
  formed in the forward) and MLP output, of the clean and the corrupted rows; the deltas
  [batch pos writer d_model] are formed once.
- the logits: computed without a graph for the metric's value; the metric's gradient with respect
  to them says which positions it reads, and only those rows are unembedded again with a graph, so
  the backward never multiplies the whole [batch pos vocab] gradient through W_U.
- readers: per layer, a head's q/k/v input gradient is its hook_q/k/v gradient pulled back through
  its projection and through ln1 at the residual that run read (the norm's vector-Jacobian product,
  in closed form for LayerNorm and RMSNorm); it is summed over the runs with their weights and at
  once contracted with the deltas into [batch writer reader] (or [batch pos writer reader] when
  per-position scores are asked for). No [batch pos reader d_model] tensor of the whole graph exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from einops import einsum

from probe.analyses.circuit_graph import CircuitGraph
from probe.analyses.common import evaluate_metric, model_mask
from probe.analyses.edge_patching import head_outputs
from probe.analyses.metric_reads import evaluate_output, logit_reads
from probe import HookedDecoder
from probe.names import act_name
from probe.norm import LayerNorm, RMSNorm

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


def norm_vjp(norm, x: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """[reader rows pos d_model]: grads [reader rows pos d_model] pulled back through `norm` at x [rows pos d_model],
    one vector-Jacobian product per reader."""
    x = x.float()
    if type(norm) is LayerNorm or isinstance(norm, RMSNorm):
        centred = x - x.mean(-1, keepdim=True) if type(norm) is LayerNorm else x
        scale = (centred.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()  # [rows pos 1]
        normalized = centred / scale
        gw = grads * norm.w.float()
        out = gw - normalized * (gw * normalized).mean(-1, keepdim=True)
        if type(norm) is LayerNorm:
            out = out - gw.mean(-1, keepdim=True)
        return out / scale
    with torch.enable_grad():  # any other norm: autograd through it, once per reader
        leaf = x[None].expand_as(grads).contiguous().requires_grad_(True)
        return torch.autograd.grad(norm(leaf.to(norm_dtype(norm, x))), leaf, grads.to(norm_dtype(norm, x)))[0].float()


def norm_dtype(norm, x):
    params = list(norm.parameters())
    return params[0].dtype if params else x.dtype


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

    def rows(self, i: int) -> slice:
        return slice(i * self.batch, (i + 1) * self.batch)

    def record(self, name: str, act: torch.Tensor) -> None:
        slot = self.saved.setdefault(name, {})
        for i, run in enumerate(self.runs):
            key = "clean" if run.clean else ("corrupted" if run.alpha == 0 else None)
            if key is not None and key not in slot:
                slot[key] = act[self.rows(i)].detach()

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

    def keep(self, name: str, act: torch.Tensor) -> torch.Tensor:
        if self.grads:
            if not act.requires_grad:  # frozen weights: the first activation becomes a leaf of the graph
                act = act.detach().requires_grad_(True)
            self.live[name] = act
        return act

    def hooks(self) -> list:
        graph, moves_all = self.graph, self.move == "activations"
        L = graph.n_layers

        def resid(layer: Optional[int], name: str, moves: bool, reads: bool):
            def hook(act, hook):
                out = self.moved(name, act) if moves else act
                if name == act_name("resid_pre", 0):
                    self.record("embed", act)
                if reads:
                    self.read[layer] = out.detach()
                wanted = not name.startswith("blocks") or "resid_pre" not in name or graph.parallel or layer == 0
                return self.keep(name, out) if wanted else out
            return hook

        def writer(name):
            def hook(act, hook):
                self.record(name, act)
            return hook

        def keep(act, hook):
            return self.keep(hook.name, act)

        out = [(act_name("resid_pre", 0), resid(0, act_name("resid_pre", 0), self.move != "none", True))]
        for l in range(L):
            if l > 0:
                out.append((act_name("resid_pre", l), resid(l, act_name("resid_pre", l), moves_all, True)))
            out += [(act_name(kind, l), keep) for kind in ("q", "k", "v")]
            out += [(act_name("z", l), writer(act_name("z", l))), (act_name("mlp_out", l), writer(act_name("mlp_out", l)))]
            if graph.sandwich:
                out.append((act_name("scale", l, "ln1_post"), writer(act_name("scale", l, "ln1_post"))))
            if not graph.parallel:
                out.append((act_name("resid_mid", l), resid(l, act_name("resid_mid", l), moves_all, False)))
            last = act_name("resid_post", l)
            out.append((last, resid(l, last, moves_all and l == L - 1, False)))
        return out


def _head_deltas(model, graph, saved, layer) -> torch.Tensor:
    """[batch pos head d_model] float32: each head's clean output less its corrupted one."""
    z = saved[act_name("z", layer)]
    w_o = model.blocks[layer].attn.W_O.float()
    pattern = "batch pos head d_head, head d_head d_model -> batch pos head d_model"
    if not graph.sandwich:  # linear in z: one product of the difference
        return einsum(z["clean"].float() - z["corrupted"].float(), w_o, pattern)
    scale = saved[act_name("scale", layer, "ln1_post")]
    return (head_outputs(model, layer, einsum(z["clean"].float(), w_o, pattern), scale["clean"])
            - head_outputs(model, layer, einsum(z["corrupted"].float(), w_o, pattern), scale["corrupted"]))


def writer_deltas(model: HookedDecoder, graph: CircuitGraph, saved: dict) -> torch.Tensor:
    """[batch pos writer d_model] float32: every writer's clean output less its corrupted one."""
    first = saved["embed"]
    batch, n_pos, d_model = first["clean"].shape
    out = torch.empty(batch, n_pos, len(graph.writers), d_model, device=first["clean"].device)
    out[:, :, 0] = first["clean"].float() - first["corrupted"].float()
    for l in range(graph.n_layers):
        heads = graph.head_writers(l)
        out[:, :, heads.start:heads.stop] = _head_deltas(model, graph, saved, l)
        mlp = saved[act_name("mlp_out", l)]
        out[:, :, graph.mlp_writer(l)] = mlp["clean"].float() - mlp["corrupted"].float()
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
        rows_mask = mask.repeat(len(chunk), 1)
        with torch.enable_grad() if grads else torch.no_grad():
            with model.hooks(fwd.hooks()):
                final = model(stacked, attention_mask=model_mask(rows_mask), stop_at_layer=graph.n_layers)
            logit_grads = _metric_pass(model, metric, fwd, final, stacked, rows_mask, mask, values)
            if not grads:
                continue
            hook_grads = _backward(model, fwd, final, logit_grads)
        with torch.no_grad():  # weights (parameters) enter below: no graph
            if deltas is None:  # writer-major: each stage's product reads its first writers as one block
                deltas = writer_deltas(model, graph, saved).permute(0, 2, 1, 3).contiguous()
            part = _contract(model, graph, fwd, hook_grads, deltas, mask, positions)
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
    if logit_reads(metric) is not None:
        target = None
        for i, run in enumerate(fwd.runs):
            rows = fwd.rows(i)
            with torch.enable_grad() if run.weight else torch.no_grad():
                value = evaluate_output(model, metric, final[rows], stacked[rows], mask)
            key = "clean" if run.clean else ("corrupted" if run.alpha == 0 else None)
            if key is not None:
                values[key] = value.detach()
            if run.weight:  # the run's weight comes in the contraction
                target = value.sum() if target is None else target + value.sum()
        return target
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


def _contract(model, graph: CircuitGraph, fwd: _Forward, hook_grads, deltas, mask, positions: bool) -> torch.Tensor:
    """[batch (pos) writer reader]: deltas [batch writer pos d_model] . (the runs' weighted reader gradients), one
    product per reader stage. Reader gradients are laid out reader-first, so each product is one batched matmul."""
    batch, W, n_pos, d_model = deltas.shape
    weighted = [i for i, run in enumerate(fwd.runs) if run.weight]  # the others' gradients are zero: skipped
    rows = torch.cat([torch.arange(i * batch, (i + 1) * batch) for i in weighted]).to(deltas.device)
    weights = torch.tensor([fwd.runs[i].weight for i in weighted], device=deltas.device)
    keep = mask[None, :, :, None].to(deltas.dtype)  # padded positions carry no effect

    def summed(g: torch.Tensor) -> torch.Tensor:  # [reader weighted-rows pos d_model] -> [reader batch pos d_model]
        if len(weighted) == 1 and fwd.runs[weighted[0]].weight == 1.0:
            return g * keep
        g = g.reshape(g.shape[0], len(weighted), batch, n_pos, d_model)
        return einsum(g, weights, "reader run batch pos d_model, run -> reader batch pos d_model") * keep

    R = graph.valid.shape[1]
    full = deltas.new_zeros((batch, n_pos, W, R) if positions else (batch, W, R))

    def add(stage: int, readers: range, grads: torch.Tensor) -> None:  # grads [reader batch pos d_model]
        n = int((graph.writer_stage < stage).sum())
        if positions:
            full[:, :, :n, readers.start:readers.stop] += einsum(
                deltas[:, :n], grads, "batch writer pos d_model, reader batch pos d_model -> batch pos writer reader")
            return
        flat = grads.permute(1, 0, 2, 3).reshape(batch, len(readers), n_pos * d_model)
        full[:, :n, readers.start:readers.stop] += torch.matmul(deltas[:, :n].reshape(batch, n, n_pos * d_model),
                                                                flat.transpose(1, 2))

    def g(name):  # [weighted-rows pos ...]
        return hook_grads[name].index_select(0, rows).float()

    for l in range(graph.n_layers):
        block, attn = model.blocks[l], model.blocks[l].attn
        qkv = torch.cat([g(act_name(kind, l)) for kind in ("q", "k", "v")], dim=2)  # [row pos reader d_head]
        n_read, n_rows = qkv.shape[2], qkv.shape[0]
        w_qkv = attn.qkv.weight.float().view(n_read, attn.d_head, d_model)  # [(head kv_head kv_head) d_head d_model]
        pulled = torch.bmm(qkv.permute(2, 0, 1, 3).reshape(n_read, n_rows * n_pos, attn.d_head), w_qkv)
        attn_grads = norm_vjp(block.ln1, fwd.read[l].index_select(0, rows), pulled.view(n_read, n_rows, n_pos, d_model))
        post = g(act_name("resid_post", l))
        if graph.parallel:  # resid_pre reaches resid_post directly, through the attention's inputs and through the MLP
            mlp = g(act_name("resid_pre", l)) - post - attn_grads.sum(dim=0)
        else:
            mlp = g(act_name("resid_mid", l)) - post
        add(2 * l + 1, graph.attn_readers(l), summed(attn_grads))
        mlp_reader = graph.mlp_reader(l)
        add(int(graph.reader_stage[mlp_reader]), range(mlp_reader, mlp_reader + 1), summed(mlp[None]))
    last = len(graph.readers) - 1
    add(2 * graph.n_layers + 1, range(last, last + 1), summed(g(act_name("resid_post", graph.n_layers - 1))[None]))
    return full
