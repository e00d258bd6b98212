"""Edge scores from one stacked backward: every reader's gradient contracted with every writer's delta.

An edge's score is the sum over positions of delta_writer . g_reader, g_reader being the gradient of the
metric with respect to that reader's own input (the residual a head's q, k or v reads, or an MLP's, or the
logits'), summed over the runs with their weights. An MLP's and the logits' gradients come from their
hook points; a head's input gradient is its hook_q/k/v gradient dq pulled back through its projection W
and through ln1 at the residual that run read, n being that residual centred (LayerNorm) and divided by its
scale s:

    g = (1/s) (w*(dq W) - mean(w*(dq W)) - n mean(n*w*(dq W)))      (RMSNorm has no middle term)

g is never formed per run, and there is no pass over [run batch pos reader d_model]. With h = dq/s (weighted,
padding zeroed) and W' = W diag(w), for D = d_model:

    delta . g = delta . (h W')  -  (delta . 1)(h . W'1) / D  -  (delta . n)(h . W'n) / D

The first term is linear in h, so the runs' h are summed first: one product with W' and one matmul with the
deltas, whatever the number of runs (W' is the weight where it lies times w, or w multiplies the pulled-back
rows instead when those are the smaller tensor). The two others are rank one at each position and are subtracted from the
scores, not from the gradients: W'n is what the run's projection computed (hook_q/k/v less the biases), delta . n
is one product per prompt for every layer and run on the deltas as they lie (writer-major), and the rest is a
[writer (run pos)] x [(run pos) reader] product per group.

Layers are taken in groups of consecutive layers with the same head counts, stacked along a leading layer
dimension: on a model whose forward costs its per-operation overhead, one group holds every layer, so the
number of operations does not grow with depth; each product of a group then runs over the writers before its
last reader, and the pairs that are not edges are computed and never read. A large model on a CPU takes one
layer per group, so no product runs over writers that cannot reach it.
"""
from __future__ import annotations

import torch
from einops import einsum

from probe.analyses.circuit_graph import CircuitGraph
from probe.analyses.edge_patching import head_outputs
from probe import HookedDecoder
from probe.names import act_name
from probe.norm import LayerNorm, RMSNorm


def mlp_in_name(layer: int) -> str:
    return f"blocks.{layer}.hook_mlp_in"


def layer_groups(graph: CircuitGraph, most: int) -> list[range]:
    """Consecutive layers with the same query and key/value head counts, at most `most` to a group."""
    groups, start = [], 0
    for l in range(1, graph.n_layers + 1):
        if (l == graph.n_layers or l - start == most or graph.heads[l] != graph.heads[start]
                or graph.kv_heads[l] != graph.kv_heads[start]):
            groups.append(range(start, l))
            start = l
    return groups


def _n_before(graph: CircuitGraph, stage: int) -> int:
    """How many writers (a prefix, in writer order) land before `stage`."""
    return int((graph.writer_stage < stage).sum())


@torch.no_grad()
def writer_deltas(model: HookedDecoder, graph: CircuitGraph, saved: dict, most: int) -> torch.Tensor:
    """[batch writer pos d_model] float32, writer-major: every writer's clean output less its corrupted one.
    `saved`: name -> {"clean": ..., "corrupted": ...} of the embedding, hook_z, hook_mlp_out (and in sandwich
    blocks ln1_post's scale). A head's output is z @ W_O (in a sandwich block, its share of the normalised write)."""
    first = saved["embed"]
    batch, n_pos, d_model = first["clean"].shape
    out = torch.empty(batch, len(graph.writers), n_pos, d_model, device=first["clean"].device)
    out[:, 0] = first["clean"].float() - first["corrupted"].float()
    for group in layer_groups(graph, most):
        n_heads = graph.heads[group.start]
        w_o = out_weights(model, group)

        def stacked(name: str, run: str) -> torch.Tensor:
            return torch.stack([saved[act_name(name, l)][run] for l in group]).float()

        first_writer = graph.head_writers(group.start).start
        block = out[:, first_writer:graph.mlp_writer(group.stop - 1) + 1].unflatten(1, (len(group), n_heads + 1))
        if graph.sandwich:  # each run's write is divided by its own ln1_post scale: head_outputs, layer by layer
            for j, l in enumerate(group):
                shares = [head_outputs(model, l, einsum(saved[act_name("z", l)][run].float(), w_o[j],
                                                        "batch pos head d_head, head d_head d_model -> batch pos head d_model"),
                                       saved[act_name("scale", l, "ln1_post")][run]) for run in ("clean", "corrupted")]
                block[:, j, :n_heads] = (shares[0] - shares[1]).transpose(1, 2)
        else:  # linear in z: one product of the difference, per prompt and layer, written where it stays
            z = stacked("z", "clean") - stacked("z", "corrupted")  # [layer batch pos head d_head]
            for j in range(len(group)):
                for b in range(batch):
                    torch.bmm(z[j, b].transpose(0, 1), w_o[j], out=block[b, j, :n_heads])
        block[:, :, n_heads] = (stacked("mlp_out", "clean") - stacked("mlp_out", "corrupted")).transpose(0, 1)
    return out


def read_weights(model: HookedDecoder, group: range, n_read: int, fold_scale: bool):
    """float32, for the group's layers: each layer's q/k/v projection [reader d_head d_model] (in the weight's own
    memory layout: a transposed Conv1D weight is not copied into another), times ln1's weight when `fold_scale`
    (a copy), else the weight itself (the caller scales what it pulls back); ln1's weights [layer d_model]; and
    [layer reader d_head] stacks of W'1 and of what q, k and v hold beyond W'n (the projection's bias and ln1's
    bias projected)."""
    projections, scales, ones, offsets = [], [], [], []
    for l in group:
        qkv, norm = model.blocks[l].attn.qkv, model.blocks[l].ln1
        weight, scale = qkv.weight.detach().float(), norm.w.detach().float()
        scales.append(scale)
        projections.append((weight * scale if fold_scale else weight).view(n_read, -1, weight.shape[1]))
        ones.append(weight @ scale)
        offset = qkv.bias.detach().float() if qkv.bias is not None else torch.zeros(weight.shape[0], device=weight.device)
        if getattr(norm, "b", None) is not None:
            offset = offset + weight @ norm.b.detach().float()
        offsets.append(offset)
    return projections, torch.stack(scales), torch.stack(ones).view(len(group), n_read, -1), torch.stack(offsets).view(len(group), n_read, -1)


def out_weights(model: HookedDecoder, group: range) -> torch.Tensor:
    """[layer head d_head d_model] float32: the group's W_O."""
    return torch.stack([model.blocks[l].attn.W_O.detach() for l in group]).float()


@torch.no_grad()
def reader_scores(model: HookedDecoder, graph: CircuitGraph, weights: list[float], hook_grads: dict[str, torch.Tensor],
                  acts: dict[str, torch.Tensor], read: dict[int, torch.Tensor], deltas: torch.Tensor, mask: torch.Tensor, positions: bool,
                  most: int) -> torch.Tensor:
    """[batch (pos) writer reader]: deltas [batch writer pos d_model] . the readers' gradients, weighted over the runs.

    `weights`: each stacked run's weight (runs of `batch` rows each; a run of weight 0 is skipped);
    `hook_grads`: the gradients of each layer's hook_q/k/v and hook_mlp_in and of the last hook_resid_post,
    every row; `acts`: the hook_q/k/v activations, every row; `read`: layer -> the residual ln1 read, every row;
    `most`: layers per group."""
    batch, n_writers, n_pos, d_model = deltas.shape
    weighted = [i for i, w in enumerate(weights) if w]
    k = len(weighted)
    if weighted == list(range(weighted[0], weighted[0] + k)):
        def pick(t):
            return t[weighted[0] * batch:(weighted[0] + k) * batch]
    else:
        index = torch.cat([torch.arange(i * batch, (i + 1) * batch) for i in weighted]).to(deltas.device)

        def pick(t):
            return t.index_select(0, index)
    run_weights = torch.tensor([weights[i] for i in weighted], dtype=torch.float32, device=deltas.device)
    keep = mask.to(device=deltas.device, dtype=torch.float32)[:, :, None]  # [batch pos 1]: padding carries no effect

    def per_run(names: list[str]) -> torch.Tensor:  # [layer run batch pos ...] float32
        t = torch.stack([pick(hook_grads[name]) for name in names]).float()
        return t.view(len(names), k, batch, *t.shape[2:])

    def summed(names: list[str]) -> torch.Tensor:  # [layer batch pos d_model]: the weighted sum over runs
        runs = per_run(names)
        if k == 1 and weights[weighted[0]] == 1.0:
            return runs[:, 0] * keep
        return einsum(runs, run_weights, "layer run batch pos d_model, run -> layer batch pos d_model") * keep

    n_readers = graph.valid.shape[1]
    full = deltas.new_zeros((batch, n_pos, n_writers, n_readers) if positions else (batch, n_writers, n_readers))
    flat = deltas.reshape(batch, n_writers, n_pos * d_model)
    mlp_grads = deltas.new_empty(graph.n_layers + 1, batch, n_pos, d_model)  # [reader batch pos d_model]

    def product(n: int, grads: torch.Tensor) -> torch.Tensor:
        """deltas[:, :n] . grads [reader batch pos d_model]: [batch (pos) n reader]."""
        if positions:
            return einsum(deltas[:, :n], grads, "batch writer pos d_model, reader batch pos d_model -> batch pos writer reader")
        return torch.matmul(flat[:, :n], grads.reshape(grads.shape[0], batch, n_pos * d_model).permute(1, 2, 0))

    norms = [model.blocks[l].ln1 for l in range(graph.n_layers)]
    if not all(isinstance(norm, (LayerNorm, RMSNorm)) for norm in norms):
        raise TypeError("edge attribution pulls head gradients back through LayerNorm or RMSNorm; this model's ln1 is a "
                        f"{type(norms[0]).__name__}")
    centres = isinstance(norms[0], LayerNorm)
    # every layer's residual as its ln1 normalised it, n [layer run batch pos d_model], and its scale s
    # (in place: on a CPU every fresh large temporary costs its page faults, often more than its arithmetic)
    normed = torch.stack([pick(read[l]) for l in range(graph.n_layers)]).float().view(-1, k, batch, n_pos, d_model)
    if centres:
        normed.sub_(normed.mean(-1, keepdim=True))
    scales = (torch.linalg.vector_norm(normed, dim=-1, keepdim=True).square_().div_(d_model) + norms[0].eps).sqrt_()
    normed /= scales  # scales [layer run batch pos 1]
    # delta . n of every writer for every layer and run [batch pos (layer run) writer]: one product per prompt, on
    # the deltas as they lie (writer-major), and delta . 1 [batch writer pos]
    dots = torch.stack([torch.bmm(normed[:, :, b].flatten(0, 1).transpose(0, 1), deltas[b].permute(1, 2, 0))
                        for b in range(batch)])
    sums = deltas.sum(-1) if centres else None
    del normed

    scratch: dict[str, torch.Tensor] = {}  # buffers every group reuses

    def reused(name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        held = scratch.get(name)
        if held is None or held.shape != shape or held.dtype != dtype:
            held = scratch[name] = torch.empty(shape, dtype=dtype, device=deltas.device)
        return held

    def qkv_of(source: dict[str, torch.Tensor], group: range, name: str) -> torch.Tensor:
        """[rows pos (layer reader) d_head]: the group's q, k and v (values or gradients), q then k then v per layer."""
        parts = [pick(source[act_name(kind, l)]).detach() for l in group for kind in ("q", "k", "v")]
        shape = (*parts[0].shape[:2], sum(p.shape[2] for p in parts), parts[0].shape[3])
        return torch.cat(parts, dim=2, out=reused(name, shape, parts[0].dtype)).float()

    for group in layer_groups(graph, most):
        G, last = len(group), group.stop - 1
        first_reader = graph.attn_readers(group.start).start
        n_read = len(graph.attn_readers(group.start))
        # [.. n layer reader+1]: the group's attention readers, then its MLP reader, layer by layer
        target = full[..., first_reader:graph.mlp_reader(last) + 1].unflatten(-1, (G, n_read + 1))
        # [run batch pos layer reader d_head]: q, then k, then v readers, as the fused projection's rows are ordered
        dq = qkv_of(hook_grads, group, "dq")
        d_head = dq.shape[-1]
        dq = dq.view(k, batch, n_pos, G, n_read, d_head)
        # h = dq / s, weighted, padding zeroed: never formed, its factor enters each product
        factor = keep / scales[group.start:group.stop, ..., 0].permute(1, 2, 3, 0) * run_weights.view(k, 1, 1, 1)
        # W' = W diag(w) copied, or w applied to what W pulls back: whichever tensor is the smaller
        fold = batch * n_pos > d_head
        projections, ln_w, w_ones, offsets = read_weights(model, group, n_read, fold)
        if k == 1:
            summed_h = dq[0] * factor[0, ..., None, None]  # [batch pos layer reader d_head]
        else:
            summed_h = torch.einsum("kbpgrd,kbpg->bpgrd", dq, factor)
        by_layer = summed_h.permute(2, 3, 0, 1, 4).reshape(G, n_read, batch * n_pos, d_head)
        pulled = reused("pulled", (G * n_read, batch * n_pos, d_model), torch.float32)
        for j in range(G):  # one product per layer, each with its weight as stored
            rows = pulled[j * n_read:(j + 1) * n_read]
            torch.bmm(by_layer[j], projections[j], out=rows)
            if not fold:
                rows *= ln_w[j]
        n = _n_before(graph, 2 * last + 1)
        scores = product(n, pulled.view(G * n_read, batch, n_pos, d_model)).unflatten(-1, (G, n_read))
        # the rank-one terms, for every run: (delta . n_run)(h_run . W'n_run) / D, and (delta . 1)(h . W'1) / D for
        # LayerNorm; W'n is what the run's projection computed less its bias and the projected norm bias, i.e. q, k
        # and v as hooked
        qkv = qkv_of(acts, group, "qkv").view(k, batch, n_pos, G, n_read, d_head)
        c = torch.linalg.vecdot(dq, qkv - offsets) * (factor[..., None] / d_model)  # [run batch pos layer reader]
        e = dots[:, :, group.start * k:group.stop * k, :n].unflatten(2, (G, k))  # [batch pos layer run writer]
        out = "batch pos writer layer reader" if positions else "batch writer layer reader"
        scores -= einsum(e, c, f"batch pos layer run writer, run batch pos layer reader -> {out}")
        if centres:
            ones = einsum(summed_h, w_ones, "batch pos layer reader d_head, layer reader d_head -> batch pos layer reader")
            scores -= einsum(sums[:, :n], ones / d_model, f"batch writer pos, batch pos layer reader -> {out}")
        target[..., :n, :, :n_read] += scores
        mlp_grads[list(group)] = summed([mlp_in_name(l) for l in group])

    # the MLPs' and the logits' inputs, whose gradients are their hook points': one product against every writer
    mlp_grads[graph.n_layers] = summed([act_name("resid_post", graph.n_layers - 1)])[0]
    columns = [graph.mlp_reader(l) for l in range(graph.n_layers)] + [len(graph.readers) - 1]
    full[..., columns] += product(n_writers, mlp_grads)
    return full
