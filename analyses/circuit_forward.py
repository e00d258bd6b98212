"""A circuit's forward computed from the weights, node by node, only where the circuit changes something.

With every edge outside the circuit ablated, a reader that keeps no edge reads the ablated residual `base`
(analyses.edge_patching), so a node whose inputs keep no edge computes exactly what it computes in the *base
run*, the forward in which every reader reads `base` (the corrupted run itself under "patch" ablation). A
circuit's forward therefore only computes:
- the heads with a kept q, k or v edge (into their own query input or their key/value head's): the q, k or v of
  each rebuilt input through ln1 and that input's own projection, the others taken from the base run, then
  attention and the head's rows of W_O;
- the MLPs with a kept input edge;
- the final residual, base + the kept writers' (output - ref), then the logits (only at the positions the metric
  reads when it declares them, analyses.metric_reads).
A writer whose output some kept edge carries but whose inputs keep none outputs its base-run output (zero change
from `ref` under "patch"; under "mean" and "zero" its base-run output differs from the mean or zero). Nodes
whose output no kept edge carries are not computed at all: nothing reads them. The arithmetic is the hooked
patched forward's (run_edges) restricted to those nodes, so the two agree to float error; circuits are stacked
along the batch as copies, and a node any copy needs is computed for all of them (in the others its inputs are
the base and it gives its base output). Sandwich blocks (Gemma 2), whose heads' outputs share one norm scale per
layer, are left to the hooked forward (`sparse_supported`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from einops import einsum

from probe import HookedDecoder
from probe.analyses.circuit_graph import CircuitGraph
from probe.analyses.common import model_mask
from probe.analyses.edge_patching import head_outputs
from probe.inputs import allowed_keys, token_positions
from probe.names import act_name


def sparse_supported(graph: CircuitGraph) -> bool:
    """Whether `sparse_final` can run this graph's model: not sandwich blocks, whose head outputs share a scale, nor
    ALiBi's biased scores, clamped q, k and v (clip_qkv), attention sinks, q/k norms after rotary, an output gate or
    recurrent mixers, which it does not compute."""
    return not (graph.sandwich or graph.score_bias or graph.clipped_qkv or graph.attention_sinks
                or graph.reordered_or_gated or any(graph.mixers))


def qkv_hook_names(graph: CircuitGraph) -> list[str]:
    """The base run's activations `BaseRun` keeps (cache these in the corrupted run under "patch")."""
    names = [act_name(kind, l) for l in range(graph.n_layers) for kind in ("q", "k", "v")]
    return names + ["hook_pos_embed"] if graph.qk_positions else names


@dataclass
class BaseRun:
    """The base run (every reader reads `base`): `qkv[l]` [h + 2 kv, batch, pos, d_head] layer l's q of every head,
    then k and v of every key/value head (hook_q/k/v, reader-major as the graph orders the readers); `out_delta`
    [batch pos writer d_model] each writer's base-run output less `ref` (None under "patch", where it is zero); the
    positions and attention masks of the prompts."""

    qkv: list
    out_delta: Optional[torch.Tensor]
    positions: torch.Tensor  # [batch pos]
    qk_positions: Optional[torch.Tensor]  # [batch pos d_model]: shortformer positions (each q and k input's), else None
    allowed: dict  # window -> [batch 1 query_pos key_pos] bool, or None (the attention's default: causal, or every key)

    @classmethod
    @torch.no_grad()
    def prepare(cls, model: HookedDecoder, graph: CircuitGraph, tokens: torch.Tensor, mask: torch.Tensor,
                base: dict, ref: torch.Tensor, cache=None) -> "BaseRun":
        """From `cache` (the corrupted run's, holding qkv_hook_names) when `base` is that run's residuals ("patch"),
        else by running the model with every reader's residual set to `base`."""
        names = qkv_hook_names(graph)
        out_delta = None
        if cache is not None and graph.qk_positions and "hook_pos_embed" not in cache:
            raise KeyError("the corrupted run's cache must hold hook_pos_embed (qkv_hook_names) for a shortformer model")
        if cache is None:
            hooks = []
            for l in range(graph.n_layers):
                hooks.append((act_name("resid_pre", l), lambda act, hook, s=2 * l + 1: base[s].to(act.dtype)))
                if graph.mlps and not graph.parallel:
                    hooks.append((act_name("resid_mid", l), lambda act, hook, s=2 * l + 2: base[s].to(act.dtype)))
            writers = [act_name("z", l) for l in range(graph.n_layers)]
            writers += [act_name("mlp_out", l) for l in range(graph.n_layers)] if graph.mlps else []
            _, cache = model.run_with_cache(tokens, attention_mask=model_mask(mask), names=names + writers,
                                            fwd_hooks=hooks, stop_at_layer=graph.n_layers)
            out = torch.zeros_like(ref)  # the embedding is never carried: its kept edges carry the clean one
            for l in range(graph.n_layers):
                heads = graph.head_writers(l)
                result = einsum(cache[act_name("z", l)], model.blocks[l].attn.W_O,
                                "batch pos head d_head, head d_head d_model -> batch pos head d_model")
                out[:, :, heads.start:heads.stop] = head_outputs(model, l, result, None)
                if graph.mlps:
                    out[:, :, graph.mlp_writer(l)] = cache[act_name("mlp_out", l)].float()
            out_delta = out - ref
            out_delta[:, :, 0] = 0.0
        batch, n_pos = tokens.shape
        attention_mask = model_mask(mask)
        positions = token_positions(attention_mask, batch, n_pos, tokens.device)
        # the model's own masks: a bidirectional model's queries see every real key, later ones too
        causal = not model.cfg.bidirectional
        allowed = {window: allowed_keys(attention_mask, positions, window, causal) for window in model.windows}
        qkv = [torch.cat([cache[act_name(kind, l)] for kind in ("q", "k", "v")], dim=2).permute(2, 0, 1, 3).contiguous()
               for l in range(graph.n_layers)]
        qk_positions = cache["hook_pos_embed"] if graph.qk_positions else None
        return cls(qkv=qkv, out_delta=out_delta, positions=positions, qk_positions=qk_positions, allowed=allowed)


@torch.inference_mode()  # less bookkeeping per operation than no_grad: these tensors never meet autograd
def sparse_final(model: HookedDecoder, graph: CircuitGraph, run: BaseRun, base: dict, ref: torch.Tensor,
                 source: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The final residual [copy*batch pos d_model] (copy-major) of each circuit in `keep` [copy writer reader] bool,
    the embedding's row meaning "carries the clean embedding" (`source`), the others "carries this run's output"."""
    k = keep.shape[0]
    batch, n_pos, W, d_model = ref.shape
    n_rows, device, dtype = k * batch * n_pos, ref.device, model.embed.W_E.dtype
    keep = keep.to(device)
    carried = keep.any(dim=2).any(dim=0).nonzero()[:, 0]  # writers some copy carries, in stage order
    slot = torch.full((W,), -1, dtype=torch.long)
    slot[carried.cpu()] = torch.arange(carried.numel())
    before = torch.searchsorted(graph.writer_stage[carried.cpu()].contiguous(), torch.arange(2 * graph.n_layers + 2)).tolist()
    keep_t = keep.index_select(1, carried).to(ref.dtype).permute(2, 0, 1)  # [reader copy carried]
    active = keep.any(dim=1).any(dim=0).cpu()  # [reader]
    # (output - ref) of each carried writer [writer copy batch pos d_model]: the embedding's clean one, the others
    # their base-run output until they are computed
    delta = torch.zeros(carried.numel(), k, batch, n_pos, d_model, device=device)
    if run.out_delta is not None:
        delta[:] = run.out_delta.index_select(2, carried).permute(2, 0, 1, 3)[:, None]
    if int(slot[0]) >= 0:
        delta[int(slot[0])] = (source[:, :, 0] - ref[:, :, 0])[None]

    def inputs(stage: int, readers) -> torch.Tensor:  # [reader copy batch pos d_model]
        n = before[stage]  # carried writers that write before `stage` (they come first)
        if not n:
            return base[stage].expand(len(readers), k, batch, n_pos, d_model)
        mix = keep_t[readers, :, :n]  # [reader copy writer]
        if k == 1:
            added = torch.mm(mix[:, 0], delta[:n].view(n, -1))
        else:
            added = torch.einsum("rcn,nce->rce", mix, delta[:n].view(n, k, -1))
        return base[stage] + added.view(len(readers), k, batch, n_pos, d_model)

    def report(writers: torch.Tensor, outputs: torch.Tensor) -> None:  # outputs [writer copy batch pos d_model]
        delta.index_copy_(0, slot[writers].to(device), outputs.float() - ref.index_select(2, writers.to(device)).permute(2, 0, 1, 3)[:, None])

    for l in range(graph.n_layers):
        block, attn = model.blocks[l], model.blocks[l].attn
        first = graph.attn_readers(l).start
        h, kv, d_head = attn.n_heads, attn.n_kv_heads, attn.d_head
        group = h // kv
        heads = graph.head_writers(l)
        on = active[first:first + h + 2 * kv]  # q inputs, k inputs, v inputs
        # the heads whose z changes and whose output some edge carries
        moved = on[:h] | on[h:h + kv].repeat_interleave(group) | on[h + kv:].repeat_interleave(group)
        changed = (moved & (slot[heads.start:heads.stop] >= 0)).nonzero()[:, 0].tolist()
        if changed:
            kv_used = sorted({hd // group for hd in changed})
            needed = changed + [h + g for g in kv_used] + [h + kv + g for g in kv_used]  # readers within the layer
            rebuilt = [i for i, j in enumerate(needed) if bool(on[j])]
            parts = run.qkv[l][needed][:, None]  # [needed copy batch pos d_head], a copy
            parts = parts.repeat(1, k, 1, 1, 1) if k > 1 else parts
            if rebuilt:
                wanted = [needed[i] for i in rebuilt]
                x = inputs(2 * l + 1, [first + j for j in wanted]).to(dtype)  # [reader copy batch pos d_model]
                normed = block.ln1(x).reshape(len(wanted), n_rows, d_model)
                if run.qk_positions is not None:  # shortformer: the positions join the q and k inputs after ln1
                    is_qk = torch.tensor([j < h + kv for j in wanted], device=device)[:, None, None]
                    normed = normed + is_qk * run.qk_positions.to(normed.dtype).repeat(k, 1, 1).view(1, n_rows, d_model)
                w = attn.qkv.weight.view(h + 2 * kv, d_head, d_model)[wanted]
                got = torch.bmm(normed, w.transpose(1, 2))
                if attn.qkv.bias is not None:
                    got = got + attn.qkv.bias.view(h + 2 * kv, 1, d_head)[wanted]
                parts[rebuilt] = got.view(len(wanted), k, batch, n_pos, d_head).to(parts.dtype)
            nq, nkv = len(changed), len(kv_used)
            parts = parts.permute(1, 2, 3, 0, 4).reshape(k * batch, n_pos, len(needed), d_head)  # [row pos reader d_head]
            q, key, value = attn.q_norm(parts[:, :, :nq]), attn.k_norm(parts[:, :, nq:nq + nkv]), parts[:, :, nq + nkv:]
            if attn.rotary is not None:
                positions = run.positions.repeat(k, 1) if k > 1 else run.positions
                q, key = attn.rotary(q, positions), attn.rotary(key, positions)
            if nkv != nq:  # each changed head reads its key/value head
                which = torch.tensor([kv_used.index(hd // group) for hd in changed], device=device)
                key, value = key.index_select(2, which), value.index_select(2, which)
            allowed = run.allowed[model.cfg.layer_window(l)]
            if allowed is not None and k > 1:
                allowed = allowed.repeat(k, 1, 1, 1)
            z = _attend(attn, q, key, value, allowed)  # [row pos head d_head]
            w_o = attn.out.weight.view(d_model, h, d_head).permute(1, 2, 0)[changed]  # [head d_head d_model]
            out = torch.bmm(z.permute(2, 0, 1, 3).reshape(nq, n_rows, d_head), w_o)
            report(heads.start + torch.tensor(changed), out.view(nq, k, batch, n_pos, d_model))
        if not graph.mlps:
            continue
        mlp_reader, mlp_writer = graph.mlp_reader(l), graph.mlp_writer(l)
        if bool(active[mlp_reader]) and int(slot[mlp_writer]) >= 0:
            x = inputs(int(graph.reader_stage[mlp_reader]), [mlp_reader]).reshape(k * batch, n_pos, d_model)
            report(torch.tensor([mlp_writer]), block.mlp(block.ln2(x.to(dtype))).view(1, k, batch, n_pos, d_model))
    last = len(graph.readers) - 1
    # in the model's dtype, as the hooked forward's final residual: ln_final and W_U (bf16 models) refuse float32
    return inputs(2 * graph.n_layers + 1, [last]).reshape(k * batch, n_pos, d_model).to(dtype)


def _attend(attn, q, k, v, allowed) -> torch.Tensor:
    """z [row pos head d_head] of q, k, v [row pos head d_head] (the model's attention for these heads); `allowed`
    None means what it means to the model's attention: earlier keys (`attn.causal`), or every key (bidirectional)."""
    if attn.fusable:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed,
                                              is_causal=allowed is None and attn.causal, scale=attn.scale).transpose(1, 2)
    scores = attn.score_cap(einsum(q, k, "row query_pos head d_head, row key_pos head d_head -> row head query_pos key_pos")
                            * attn.scale)
    if allowed is None and attn.causal:
        n = q.shape[1]
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return einsum(scores.softmax(dim=-1), v, "row head query_pos key_pos, row key_pos head d_head -> row query_pos head d_head")
