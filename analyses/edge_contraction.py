"""Edge scores from one stacked backward: every reader's gradient contracted with every writer's delta.

An edge's score is the sum over positions of delta_writer . g_reader, g_reader being the gradient of the
metric with respect to that reader's own input (the residual a head's q, k or v reads, or an MLP's, or the
logits'), summed over the runs with their weights. A recurrent mixer's (at ln1.hook_in), an MLP's and the logits'
gradients come from their hook points; a head's input gradient is its hook_q/k/v gradient dq pulled back through its
projection W (a gated head's q reader adds its gate's gradient pulled back through W_gate) and through ln1 at the
residual that run read, n being that residual centred (LayerNorm) and divided by its
scale s:

    g = (1/s) (w*(dq W) - mean(w*(dq W)) - n mean(n*w*(dq W)))      (RMSNorm has no middle term)

Without norms (transformer-lens's normalization_type=None) g = dq W: no scale, and no rank-one term below.
g is never formed per run, and there is no pass over [run batch pos reader d_model]. In a model of LayerNorms
every reader's gradient has zero mean over d_model (each is a LayerNorm's input gradient: ln1's, ln2's or the
final norm's), so a delta's mean never contributes and the deltas are centred once (writer_deltas); the middle
term of g then vanishes. With h = dq/s (weighted, padding zeroed) and W' = W diag(w), for D = d_model:

    delta . g = delta . (h W')  -  (delta . n)(h . W'n) / D

The first term is linear in h, so the runs' h are summed first: one product with W' and one matmul with the
deltas, whatever the number of runs (W' is the weight where it lies times w, or w multiplies the pulled-back
rows instead when those are the smaller tensor). The other is rank one at each position. With one run
(EAP) of a small model on a CPU it comes off the pulled-back rows, h W' - n (h W' . n) / D, one pass over them
that replaces several small operations (bundled model: 2.4 ms against 3.4 for this function). Otherwise it is
subtracted from the scores, not from the gradients (off the rows it costs passes over a tensor of every reader: at
GPT-2-small's shape, 4 x 128, this function took 605 ms against 426 this way for EAP): W'n is what the run's
projection computed (hook_q/k/v less the biases, and a shortformer model's projected positions), delta . n is
one product per prompt for every layer and run on the deltas as they lie (writer-major), and the rest is a
[writer (run pos)] x [(run pos) reader] product per group.

Layers are taken in groups of consecutive layers with the same head counts, stacked along a leading layer
dimension: on a model whose forward costs its per-operation overhead, one group holds every layer, so the
number of operations does not grow with depth; each product of a group then runs over the writers before its
last reader, and the pairs that are not edges are computed and never read. A large model on a CPU takes one
layer per group, so no product runs over writers that cannot reach it. The MLPs' and the logits' readers join
the last group's product.
"""
from __future__ import annotations

from typing import Optional

import torch
from einops import einsum

from probe.analyses.circuit_graph import CircuitGraph
from probe.analyses.edge_patching import gate_name, gate_weights, head_outputs
from probe.analyses.scratch import scratch
from probe import HookedDecoder
from probe.names import act_name
from probe.norm import LayerNorm, NoNorm, RMSNorm


def mlp_in_name(layer: int) -> str:
    return f"blocks.{layer}.hook_mlp_in"


def mixer_in_name(layer: int) -> str:
    """A recurrent mixer's own input: ln1's (the residual flowing past the block is another tensor)."""
    return f"blocks.{layer}.ln1.hook_in"


def f32(t: torch.Tensor) -> torch.Tensor:
    """t as float32, without a dispatch when it already is (this module's small-model calls make dozens)."""
    return t if t.dtype == torch.float32 else t.float()


NORM_KINDS = {"layer": (LayerNorm,), "rms": (RMSNorm,), "none": (NoNorm, torch.nn.Identity)}


def norm_kind(model: HookedDecoder) -> str:
    """The kind of the norm the heads' inputs pass (every ln1), through which their gradients are pulled back:
    "layer" (LayerNorm), "rms" (RMSNorm) or "none" (no normalisation: transformer-lens's normalization_type=None,
    OLMo 2's input). "layer" also centres the deltas, which needs every reader's norm (ln1, ln2, the final norm) to be
    a LayerNorm; the MLPs' and the logits' gradients are autograd's, through whatever norm they read."""
    ln1s = [block.ln1 for block in model.blocks]
    others = [n for block in model.blocks for n in (getattr(block, "ln2", None),) if n is not None] + [model.ln_final]
    for kind, classes in NORM_KINDS.items():
        if all(isinstance(n, classes) for n in ln1s) and (kind != "layer" or all(isinstance(n, classes) for n in others)):
            return kind
    norms = ln1s + others
    raise TypeError("edge attribution pulls head gradients back through LayerNorm, RMSNorm or no norm, one kind before "
                    "every attention (and LayerNorms everywhere when it is LayerNorm); this model's norms are "
                    f"{sorted({type(n).__name__ for n in norms})}")


def layer_groups(graph: CircuitGraph, most: int) -> list[range]:
    """Consecutive layers with the same query and key/value head counts (mixer layers: none), at most `most` to a
    group."""
    groups, start = [], 0
    for l in range(1, graph.n_layers + 1):
        if (l == graph.n_layers or l - start == most or graph.heads[l] != graph.heads[start]
                or graph.kv_heads[l] != graph.kv_heads[start] or graph.is_mixer(l) != graph.is_mixer(start)):
            groups.append(range(start, l))
            start = l
    return groups


@torch.no_grad()
def writer_deltas(model: HookedDecoder, graph: CircuitGraph, saved: dict, most: int, centred: bool) -> torch.Tensor:
    """[batch writer pos d_model] float32, writer-major: every writer's clean output less its corrupted one, centred
    over d_model when `centred` (a model of LayerNorms: `norm_kind(model) == "layer"`; see the module's docstring).
    `saved`: name -> {"clean": ..., "corrupted": ...} of the embedding, hook_z, a mixer's hook_attn_out, hook_mlp_out
    (and in sandwich blocks ln1_post's scale). A head's output is z @ W_O (in a sandwich block, its share of the
    normalised write)."""
    first = saved["embed"]
    batch, n_pos, d_model = first["clean"].shape
    out = torch.empty(batch, len(graph.writers), n_pos, d_model, device=first["clean"].device)
    torch.sub(f32(first["clean"]), f32(first["corrupted"]), out=out[:, 0])
    blocks = list(model.blocks)  # indexed once, as in reader_scores
    for group in layer_groups(graph, most):
        n_heads = graph.heads[group.start]
        first_writer = graph.head_writers(group.start).start
        mixer = graph.is_mixer(group.start)
        per_layer = n_heads + mixer + graph.mlps
        block = out[:, first_writer:graph.layer_writers(group.stop - 1).stop].unflatten(1, (len(group), per_layer))
        for j, l in enumerate(group):
            if mixer:
                write = saved[act_name("attn_out", l)]
                torch.sub(f32(write["clean"]), f32(write["corrupted"]), out=block[:, j, 0])
            elif graph.sandwich:  # each run's write is divided by its own ln1_post scale: head_outputs
                z, w_o = saved[act_name("z", l)], out_weights(blocks[l])
                shares = [head_outputs(model, l, einsum(f32(z[run]), w_o, "batch pos head d_head, head d_head d_model "
                                                        "-> batch pos head d_model"),
                                       saved[act_name("scale", l, "ln1_post")][run]) for run in ("clean", "corrupted")]
                block[:, j, :n_heads] = (shares[0] - shares[1]).transpose(1, 2)
            else:  # linear in z: one product of the difference per prompt, written where it stays
                z, w_o = saved[act_name("z", l)], out_weights(blocks[l])
                dz = f32(z["clean"]) - f32(z["corrupted"])  # [batch pos head d_head]
                for b in range(batch):
                    torch.bmm(dz[b].transpose(0, 1), w_o, out=block[b, j, :n_heads])
            if graph.mlps:
                mlp_out = saved[act_name("mlp_out", l)]
                torch.sub(f32(mlp_out["clean"]), f32(mlp_out["corrupted"]), out=block[:, j, n_heads + mixer])
    if centred:
        out -= out.mean(-1, keepdim=True)
    return out


def read_weights(blocks: list, n_read: int, fold_scale: bool):
    """float32, for the `blocks` (a group's): each layer's q/k/v projection [reader d_head d_model] (in the weight's own
    memory layout: a transposed Conv1D weight is not copied into another), times ln1's weight when `fold_scale`
    (a copy), else the weight itself (the caller scales what it pulls back); and ln1's weights, one [d_model] per
    layer. The parameters themselves, not detached copies: for callers under no_grad, as the scoring runs."""
    projections, scales = [], []
    for block in blocks:
        weight, scale = f32(block.attn.qkv.weight), f32(block.ln1.w)
        scales.append(scale)
        projections.append((weight * scale if fold_scale else weight).view(n_read, -1, weight.shape[1]))
    return projections, scales


def qkv_offsets(blocks: list, n_read: int, qk_positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[layer reader d_head] float32: what the `blocks`' q, k and v hold beyond W'n (the projection's bias and ln1's
    bias projected); with shortformer `qk_positions` [batch pos d_model], [batch pos layer reader d_head], the
    positions projected into the q and k readers added. For callers under no_grad."""
    offsets = []
    for block in blocks:
        qkv, norm = block.attn.qkv, block.ln1
        weight = f32(qkv.weight)
        offset = f32(qkv.bias) if qkv.bias is not None else weight.new_zeros(weight.shape[0])
        shift = getattr(norm, "b", None)
        offsets.append(offset if shift is None else torch.addmv(offset, weight, f32(shift)))
    out = torch.stack(offsets).view(len(blocks), n_read, -1)
    if qk_positions is None:
        return out
    n_qk = n_read - blocks[0].attn.n_kv_heads  # the q and k readers come first, the v readers last
    d_model = qk_positions.shape[-1]
    weights = torch.stack([f32(block.attn.qkv.weight) for block in blocks]).view(len(blocks), n_read, -1, d_model)
    projected = einsum(f32(qk_positions), weights[:, :n_qk],
                       "batch pos d_model, layer reader d_head d_model -> batch pos layer reader d_head")
    out = out.expand(*qk_positions.shape[:2], *out.shape).clone()
    out[:, :, :, :n_qk] += projected
    return out


def gate_offsets(blocks: list) -> torch.Tensor:
    """[layer head width] float32: what a gated attention's gate logits hold beyond W_G'n (its bias and ln1's bias
    projected), as qkv_offsets for q, k and v. For callers under no_grad."""
    offsets = []
    for block in blocks:
        gate, shift = block.attn.gate, getattr(block.ln1, "b", None)
        weight = f32(gate.weight)
        offset = f32(gate.bias) if gate.bias is not None else weight.new_zeros(weight.shape[0])
        offsets.append((offset if shift is None else torch.addmv(offset, weight, f32(shift))).view(block.attn.n_heads, -1))
    return torch.stack(offsets)


def out_weights(block) -> torch.Tensor:
    """[head d_head d_model] float32: the block's W_O (a view of the parameter: for callers under no_grad)."""
    return f32(block.attn.W_O)


@torch.no_grad()
def reader_scores(model: HookedDecoder, graph: CircuitGraph, weights: list[float], hook_grads: dict[str, torch.Tensor],
                  acts: dict[str, torch.Tensor], read: dict[int, torch.Tensor], deltas: torch.Tensor, mask: torch.Tensor, positions: bool,
                  most: int, norm: str, qk_positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[batch (pos) writer reader]: deltas [batch writer pos d_model] . the readers' gradients, weighted over the runs.

    `weights`: each stacked run's weight (runs of `batch` rows each; a run of weight 0 is skipped);
    `hook_grads`: the gradients of each layer's hook_q/k/v and hook_mlp_in and of the last hook_resid_post,
    every row; `acts`: the hook_q/k/v activations, every row; `read`: layer -> the residual ln1 read, every row;
    `most`: layers per group; `norm`: `norm_kind(model)`, as the deltas were made; `qk_positions` [batch pos d_model]:
    a shortformer model's positions (what its q and k hold beyond the normalised residual's projection)."""
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

    def buffer(name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        return scratch(f"edge_contraction.{name}", shape, dtype, deltas.device)

    def summed(names: list[str], out: torch.Tensor) -> None:
        """out [layer batch pos d_model] = the names' gradients summed over the runs with their weights, padding zeroed."""
        if k == 1:  # a copy, scaled
            torch.stack([f32(pick(hook_grads[name])) for name in names], out=out)
            out *= keep * weights[weighted[0]]
            return
        for name, rows in zip(names, out):
            torch.mv(f32(pick(hook_grads[name])).reshape(k, -1).t(), run_weights, out=rows.view(-1))
        out *= keep

    flat = deltas.reshape(batch, n_writers, n_pos * d_model)

    def product(n: int, grads: torch.Tensor) -> torch.Tensor:
        """deltas[:, :n] . grads [reader batch pos d_model]: [batch (pos) n reader]."""
        if positions:
            return einsum(deltas[:, :n], grads, "batch writer pos d_model, reader batch pos d_model -> batch pos writer reader")
        return torch.matmul(flat[:, :n], grads.reshape(grads.shape[0], batch, n_pos * d_model).permute(1, 2, 0))

    blocks = list(model.blocks)  # indexed once: a ModuleList's lookups cost more than this call's small products
    scaled = norm != "none"  # without a norm, g = dq W: no 1/s and no rank-one term
    if scaled:
        eps = blocks[0].ln1.eps
        # every layer's residual as its ln1 normalised it, n [layer run batch pos d_model], and 1/s, its scale's inverse
        # (in place, and the large buffers from analyses.scratch: on a CPU every fresh large temporary costs its page
        # faults, often more than its arithmetic)
        residuals = [pick(read[l]) for l in range(graph.n_layers)]
        normed = torch.stack(residuals, out=buffer("normed", (len(residuals), *residuals[0].shape), residuals[0].dtype))
        normed = f32(normed).view(-1, k, batch, n_pos, d_model)
        if norm == "layer":
            normed -= normed.mean(-1, keepdim=True)
        # (torch.var_mean is several times slower than this on a CPU; LayerNorm's own kernel, which gives 1/s too, saves
        # ~30 us on the small model but writes a second tensor of this size)
        inv_scales = torch.linalg.vector_norm(normed, dim=-1, keepdim=True).square_().div_(d_model).add_(eps).rsqrt_()
        normed *= inv_scales
    else:
        inv_scales = deltas.new_ones(graph.n_layers, k, batch, n_pos, 1)
    # one run on a small model on a CPU: the rank-one term comes off the pulled-back rows (see the module's docstring)
    fold_rank_one = scaled and k == 1 and most > 1 and deltas.device.type == "cpu"
    if scaled and not fold_rank_one:
        # delta . n of every writer for every layer and run [batch pos (layer run) writer]: one product per prompt, on
        # the deltas as they lie (writer-major)
        dots = torch.stack([torch.bmm(normed[:, :, b].flatten(0, 1).transpose(0, 1), deltas[b].permute(1, 2, 0))
                            for b in range(batch)])
        del normed  # only the folded path reads it again

    groups = [g for g in layer_groups(graph, most) if not graph.is_mixer(g.start)]  # the layers with heads
    n_read_rows = max((len(g) * len(graph.attn_readers(g.start)) for g in groups), default=0)
    mixer_layers = [l for l in range(graph.n_layers) if graph.is_mixer(l)]
    mlp_layers = range(graph.n_layers) if graph.mlps else range(0)
    n_tail = len(mixer_layers) + len(mlp_layers) + 1  # the mixers' readers, the MLPs', then the logits'
    # [reader batch pos d_model]: a group's pulled-back head gradients end where the mixers', MLPs' and logits' gradients
    # (their hook points', summed over the runs) begin, so the last group's one product covers them all
    # the readers padded to a multiple of 16 (zero rows): MKL's product runs whole blocks of them markedly faster
    # (on the bundled model 77 readers take ~410 us, 80 ~300)
    n_rows = -(-(n_read_rows + n_tail) // 16) * 16
    rows_buffer = buffer("rows", (n_rows, batch, n_pos, d_model), torch.float32)
    rows_buffer[n_read_rows + n_tail:] = 0
    summed([mixer_in_name(l) for l in mixer_layers] + [mlp_in_name(l) for l in mlp_layers]
           + [act_name("resid_post", graph.n_layers - 1)], rows_buffer[n_read_rows:n_read_rows + n_tail])
    # [batch (pos) writer column], columns in this function's order: every layer's attention readers, then the MLPs',
    # then the logits'; reordered to the graph's at the end
    columns = [r for l in range(graph.n_layers) for r in graph.attn_readers(l)]
    columns += [graph.mixer_reader(l) for l in mixer_layers] + [graph.mlp_reader(l) for l in mlp_layers]
    columns += [len(graph.readers) - 1]
    full = deltas.new_zeros((batch, n_pos, n_writers, len(columns)) if positions else (batch, n_writers, len(columns)))
    def qkv_of(source: dict[str, torch.Tensor], group: range, name: str) -> torch.Tensor:
        """[rows pos (layer reader) d_head]: the group's q, k and v (values or gradients), q then k then v per layer."""
        parts = [pick(source[act_name(kind, l)]) for l in group for kind in ("q", "k", "v")]
        shape = (*parts[0].shape[:2], sum(p.shape[2] for p in parts), parts[0].shape[3])
        return f32(torch.cat(parts, dim=2, out=buffer(name, shape, parts[0].dtype)))

    def gates_of(source: dict[str, torch.Tensor], group: range, name: str) -> torch.Tensor:
        """[rows pos (layer head) width]: the group's gate logits (values or gradients)."""
        parts = [pick(source[gate_name(l)]) for l in group]
        shape = (*parts[0].shape[:2], sum(p.shape[2] for p in parts), parts[0].shape[3])
        return f32(torch.cat(parts, dim=2, out=buffer(name, shape, parts[0].dtype)))

    done = 0  # attention columns written
    for g, group in enumerate(groups):
        G, last, final = len(group), group.stop - 1, g == len(groups) - 1
        n_read = len(graph.attn_readers(group.start))
        # [run batch pos layer reader d_head]: q, then k, then v readers, as the fused projection's rows are ordered
        dq = qkv_of(hook_grads, group, "dq")
        d_head = dq.shape[-1]
        dq = dq.view(k, batch, n_pos, G, n_read, d_head)
        # h = dq / s, weighted, padding zeroed, each run's in place of its dq (a copy)
        factor = (keep * inv_scales[group.start:group.stop, ..., 0].permute(1, 2, 3, 0) * run_weights.view(k, 1, 1, 1))[..., None, None]
        dq *= factor
        if graph.gated:  # the gate's logits read each head's queries' input too: its gradient joins the q readers'
            n_q = graph.heads[group.start]
            dg = gates_of(hook_grads, group, "dg")
            dg = dg.view(k, batch, n_pos, G, n_q, dg.shape[-1])
            dg *= factor
            summed_g = dg[0] if k == 1 else dg.sum(0)
            gate_by_layer = summed_g.permute(2, 3, 0, 1, 4).reshape(G, n_q, batch * n_pos, -1)
        # W' = W diag(w) copied, or w applied to what W pulls back: whichever tensor is the smaller
        fold = batch * n_pos > d_head
        projections, ln_w = read_weights(blocks[group.start:group.stop], n_read, fold)
        summed_h = dq[0] if k == 1 else torch.sum(dq, 0, out=buffer("h", dq.shape[1:], dq.dtype))  # [batch pos layer reader d_head]
        by_layer = summed_h.permute(2, 3, 0, 1, 4).reshape(G, n_read, batch * n_pos, d_head)
        start = n_read_rows - G * n_read
        pulled = rows_buffer[start:n_read_rows].view(G * n_read, batch * n_pos, d_model)
        for j in range(G):  # one product per layer, each with its weight as stored
            rows = pulled[j * n_read:(j + 1) * n_read]
            torch.bmm(by_layer[j], projections[j], out=rows)
            if graph.gated:
                gate_w = f32(gate_weights(blocks[group.start + j].attn))  # [head width d_model]
                rows[:n_q].baddbmm_(gate_by_layer[j], gate_w * ln_w[j] if fold else gate_w)
            if not fold:
                rows *= ln_w[j]
        # the writers before the group's last reader; the last group's product also takes the MLPs' and the logits'
        # readers, against every writer
        if fold_rank_one:  # rows -= n (rows . n) / D: h W' n is rows . n
            by_reader = pulled.view(G, n_read, -1, d_model)
            n_run = normed[group.start:group.stop, 0].view(G, 1, -1, d_model)
            by_reader.addcmul_(n_run, torch.linalg.vecdot(by_reader, n_run)[..., None], value=-1.0 / d_model)
        n = n_writers if final else graph.writers_before[2 * last + 1]
        scores = product(n, rows_buffer[start:] if final else rows_buffer[start:n_read_rows])
        width = G * n_read + (n_tail if final else 0)
        if scaled and not fold_rank_one:
            attention = scores[..., :G * n_read].unflatten(-1, (G, n_read))
            # the rank-one term, for every run: (delta . n_run)(h_run . W'n_run) / D; W'n is what the run's projection
            # computed less its bias and the projected norm bias, i.e. q, k and v as hooked
            qkv = qkv_of(acts, group, "qkv").view(k, batch, n_pos, G, n_read, d_head)
            qkv -= qkv_offsets(blocks[group.start:group.stop], n_read, qk_positions)  # W'n in place of q, k, v (a copy), then times h
            c = qkv.mul_(dq).sum(-1).div_(d_model)  # [run batch pos layer reader]
            if graph.gated:  # and the gate's W_G'n . h_g for the q readers
                gates = gates_of(acts, group, "gates").view(dg.shape)
                gates -= gate_offsets(blocks[group.start:group.stop])
                c[..., :n_q] += gates.mul_(dg).sum(-1).div_(d_model)
            e = dots[:, :, group.start * k:group.stop * k, :n].unflatten(2, (G, k))  # [batch pos layer run writer]
            attention -= torch.einsum("bplkw,kbplr->bpwlr" if positions else "bplkw,kbplr->bwlr", e, c)
        full[..., :n, done:done + width] = scores[..., :width]
        done += G * n_read
    if not groups:  # a model of mixers alone: the tail's product, against every writer
        full[...] = product(n_writers, rows_buffer)[..., :n_tail]
    order = sorted(range(len(columns)), key=columns.__getitem__)  # the graph's reader r is column order[r]
    return full.index_select(-1, torch.tensor(order, device=full.device))
