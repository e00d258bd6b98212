"""A forward pass in which every reader's input is rebuilt edge by edge: the one engine behind exact edge
patching, circuit faithfulness and path patching.

For copy c of the batch, reader r (at residual stage s) reads

    input_r = base[s] + sum_w patch[c, w, r] (source_w - ref_w) + sum_w carry[c, w, r] (current_w - ref_w)

where `ref` [batch pos writer d_model] is what `base` already holds for each writer (the corrupted run's
outputs, or their mean, or zero), `source` is a fixed other value (the clean run's outputs) and
`current` is what each writer outputs in this very forward (which depends on its own rebuilt inputs).
With carry = every edge and no patch, every input is the run's own and the forward is the plain one.

The model's forward is untouched: a head's q, k and v inputs are rebuilt at `hook_q` / `hook_k` /
`hook_v` (the block's ln1 applied to each head's own input, a shortformer model's positions added to the q and k
ones, then that head's projection), a recurrent mixer's at ln1's input (`ln1.hook_in`), the MLP's at
the residual it reads (hook_resid_mid, or hook_resid_pre in parallel blocks) and the logits' at the
last hook_resid_post. Every reader is rebuilt, so what the residual stream itself carries between
them never reaches anything. `frozen_readers` read through their norm with the scale taken from
`frozen` (a cache holding `...hook_scale` of the corrupted run) instead of their own: path patching's
frozen norms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from einops import einsum

from probe.analyses.ablation import LOGIT_BUDGET
from probe.analyses.circuit_graph import CircuitGraph
from probe import HookedDecoder
from probe.names import act_name


def graph_hook_names(graph: CircuitGraph) -> list[str]:
    """What a cache needs for `writer_outputs` and `stage_residuals`."""
    names = [act_name("resid_pre", 0)]
    for l in range(graph.n_layers):
        names.append(act_name("attn_out" if graph.is_mixer(l) else "result", l))
        if graph.mlps:
            names.append(act_name("mlp_out", l))
        if l > 0:
            names.append(act_name("resid_pre", l))
        if graph.mlps and not graph.parallel:
            names.append(act_name("resid_mid", l))
        if graph.sandwich:
            names.append(act_name("scale", l, "ln1_post"))
    return names + [act_name("resid_post", graph.n_layers - 1)]


def gate_name(layer: int) -> str:
    """Where a gated attention's gate logits are hooked (before the gate's function)."""
    return f"blocks.{layer}.attn.hook_q_gate"


def gate_weights(attn) -> torch.Tensor:
    """[head width d_model]: each head's gate weights (width d_head, or 1 for a gate per head)."""
    return attn.gate.weight.view(attn.n_heads, attn.gate_width, -1)


def gate_biases(attn) -> torch.Tensor:
    """[head width]"""
    return attn.gate.bias.view(attn.n_heads, attn.gate_width)


def head_outputs(model: HookedDecoder, layer: int, result: torch.Tensor, post_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """[batch pos head d_model] float32: each head's output; in a sandwich block its share of the normalised write
    (result x ln1_post's weight / that run's ln1_post scale), which the heads' shares add up to."""
    out = result.float()
    if post_scale is None:
        return out
    return out * model.blocks[layer].ln1_post.w.float() / post_scale.float()[:, :, None]


def writer_outputs(model: HookedDecoder, graph: CircuitGraph, cache: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """[batch pos writer d_model] float32: every writer's output in a cached run (names from graph_hook_names)."""
    parts = [cache[act_name("resid_pre", 0)].float()[:, :, None]]
    for l in range(graph.n_layers):
        if graph.is_mixer(l):
            parts.append(cache[act_name("attn_out", l)].float()[:, :, None])
        else:
            scale = cache[act_name("scale", l, "ln1_post")] if graph.sandwich else None
            parts.append(head_outputs(model, l, cache[act_name("result", l)], scale))
        if graph.mlps:
            parts.append(cache[act_name("mlp_out", l)].float()[:, :, None])
    return torch.cat(parts, dim=2)


def stage_residuals(graph: CircuitGraph, cache: Mapping[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """stage -> [batch pos d_model] float32: the residual each reader stage reads in a cached run."""
    out = {}
    for l in range(graph.n_layers):
        out[2 * l + 1] = cache[act_name("resid_pre", l)].float()
        if graph.mlps and not graph.parallel:
            out[2 * l + 2] = cache[act_name("resid_mid", l)].float()
    out[2 * graph.n_layers + 1] = cache[act_name("resid_post", graph.n_layers - 1)].float()
    return out


def rebased(graph: CircuitGraph, residuals: dict[int, torch.Tensor], outputs: torch.Tensor, ref: torch.Tensor) -> dict[int, torch.Tensor]:
    """The stage residuals had every writer carried `ref` instead of `outputs` (the run they come from)."""
    change = ref - outputs  # [batch pos writer d_model]
    out = {}
    for stage, resid in residuals.items():
        before = graph.writer_stage < stage
        out[stage] = resid + change[:, :, before].sum(dim=2)
    return out


@dataclass
class EdgeInputs:
    """How a patched forward rebuilds the readers' inputs (see the module docstring); masks are [copy writer reader]."""

    base: dict[int, torch.Tensor]
    ref: torch.Tensor
    carry: torch.Tensor
    source: Optional[torch.Tensor] = None
    patch: Optional[torch.Tensor] = None
    frozen: Optional[Mapping[str, torch.Tensor]] = None
    frozen_readers: Optional[torch.Tensor] = None  # [reader] bool

    @property
    def copies(self) -> int:
        return self.carry.shape[0]


def copies_per_forward(model: HookedDecoder, batch: int, n_pos: int, max_rows: Optional[int] = None) -> int:
    """How many copies of a batch one patched forward stacks: its logits stay near the ablation budget."""
    rows = max_rows if max_rows is not None else max(1, LOGIT_BUDGET // max(1, n_pos * model.cfg.d_vocab_out))
    return max(1, rows // batch)


def run_edges(model: HookedDecoder, graph: CircuitGraph, tokens: torch.Tensor, attention_mask: Optional[torch.Tensor],
              spec: EdgeInputs, stop_at_layer: Optional[int] = None) -> torch.Tensor:
    """Logits [copy*batch pos vocab] (copy-major) of `tokens` with every reader's input rebuilt per `spec` (with
    `stop_at_layer=n_layers`, the final residual [copy*batch pos d_model], the logits' rebuilt input, instead).

    Only what a circuit touches costs extra: a reader no copy rebuilds (no kept edge, no patch, no frozen
    norm) reads `base` itself, which the residual stream is set to before each block, so the block's own
    ln1 and fused projection compute it; only the heads of the readers a copy rebuilds are recomputed, and
    only the writers some copy keeps report their outputs (a head's from hook_z and its rows of W_O)."""
    k, (batch, n_pos) = spec.copies, tokens.shape
    d_model, device = model.cfg.d_model, tokens.device
    carry = spec.carry.to(device)
    used = carry.any(dim=2).any(dim=0).nonzero()[:, 0]  # the writers some copy carries, in stage order
    slot = torch.full((len(graph.writers),), -1, dtype=torch.long, device=device)
    slot[used] = torch.arange(used.numel(), device=device)
    carry_used = carry.index_select(1, used)  # [copy used reader]
    used_stage = graph.writer_stage.to(device)[used]
    # (current - ref) of each carried writer, filled in as the forward reaches it
    delta = torch.zeros(k, batch, n_pos, used.numel(), d_model, device=device)
    stash: dict[str, torch.Tensor] = {}
    patch = None if spec.patch is None else spec.patch.to(device)
    source_delta = None if spec.source is None else spec.source - spec.ref
    frozen_readers = spec.frozen_readers if spec.frozen_readers is not None else torch.zeros(len(graph.readers), dtype=torch.bool)
    frozen_readers = frozen_readers.cpu()
    active = carry.any(dim=0).any(dim=0).cpu() | frozen_readers  # [reader]: rebuilt by some copy
    if patch is not None:
        active |= patch.any(dim=0).any(dim=0).cpu()

    def inputs(stage: int, readers: list[int]) -> torch.Tensor:
        """[copy batch pos reader d_model] float32."""
        x = spec.base[stage][None, :, :, None, :]
        n = int((used_stage < stage).sum())  # carried writers that write before `stage`
        if n:
            x = x + einsum(delta[:, :, :, :n], carry_used[:, :n, readers].to(delta.dtype),
                           "copy batch pos writer d_model, copy writer reader -> copy batch pos reader d_model")
        if patch is not None:
            before = int((graph.writer_stage < stage).sum())
            mask = patch[:, :before, readers]
            sources = mask.any(dim=2).any(dim=0).nonzero()[:, 0]
            if sources.numel():
                x = x + einsum(source_delta[:, :, sources], mask.index_select(1, sources).to(source_delta.dtype),
                               "batch pos writer d_model, copy writer reader -> copy batch pos reader d_model")
        return x.expand(k, batch, n_pos, len(readers), d_model)

    def frozen_scale(name: str) -> torch.Tensor:
        return spec.frozen[name].repeat(k, *([1] * (spec.frozen[name].dim() - 1)))

    def through(norm_name: str, norm, x: torch.Tensor) -> torch.Tensor:
        scale = frozen_scale(norm_name)
        while scale.dim() < x.dim():
            scale = scale.unsqueeze(-2)

        def freeze(s, hook):
            return scale.to(s.dtype).expand_as(s)

        with model.hooks([(norm_name, freeze)]):
            return norm(x)

    def as_rows(x: torch.Tensor) -> torch.Tensor:  # [copy batch ...] -> [copy*batch ...]
        return x.reshape(k * batch, *x.shape[2:])

    def base_rows(stage: int, dtype) -> torch.Tensor:
        return spec.base[stage].to(dtype).repeat(k, 1, 1)

    def carried(writers: range) -> torch.Tensor:
        """Offsets within `writers` of the ones some copy carries."""
        return (slot[writers.start:writers.stop] >= 0).nonzero()[:, 0]

    def report(writers: range, offsets: torch.Tensor, outputs: torch.Tensor) -> None:
        """outputs [copy*batch pos n d_model] of the writers at `offsets` within `writers`."""
        if offsets.numel():
            into = slot[writers.start + offsets]
            got = outputs.float().view(k, batch, n_pos, -1, d_model)
            delta[:, :, :, into] = got - spec.ref[None, :, :, used[into]]

    def reader_input(layer: int, act):
        """What the block reads: the MLP's rebuilt input in parallel blocks (which ln1 reads too), else base."""
        if graph.parallel:
            return mlp_input(layer, act)
        return base_rows(2 * layer + 1, act.dtype)

    def embed_hook(act, hook):
        report(range(0, 1), carried(range(0, 1)), act[:, :, None])
        return reader_input(0, act)

    def q_hook(act, hook, layer):
        readers = list(graph.attn_readers(layer))
        mlp_rebuilt = graph.parallel and bool(active[graph.mlp_reader(layer)])  # then ln1 did not read base
        rebuilt = [i for i, r in enumerate(readers) if mlp_rebuilt or bool(active[r])]
        if not rebuilt:
            return None
        block, attn = model.blocks[layer], model.blocks[layer].attn
        x = as_rows(inputs(2 * layer + 1, [readers[i] for i in rebuilt])).to(act.dtype)  # [copy*batch pos reader d_model]
        normed = block.ln1(x)
        frozen = frozen_readers[[readers[i] for i in rebuilt]]
        if bool(frozen.any()):
            held = through(act_name("scale", layer, "ln1"), block.ln1, x)
            normed = torch.where(frozen.to(x.device)[:, None], held, normed)
        h, kv = attn.n_heads, attn.n_kv_heads
        for name, w, b, lo, hi in (("q", attn.W_Q, attn.b_Q, 0, h), ("k", attn.W_K, attn.b_K, h, h + kv),
                                   ("v", attn.W_V, attn.b_V, h + kv, h + 2 * kv)):
            picked = [(i, j - lo) for i, j in enumerate(rebuilt) if lo <= j < hi]
            if not picked:
                continue
            cols, heads = [i for i, _ in picked], [hd for _, hd in picked]
            read = normed[:, :, cols]
            if graph.qk_positions and name != "v":  # shortformer positions join the queries' and keys' inputs
                read = read + stash["positions"][:, :, None].to(read.dtype)
            out = einsum(read, w[heads], "batch pos head d_model, head d_model d_head -> batch pos head d_head")
            stash[f"{name}{layer}"] = (heads, out if b is None else out + b[heads])
            if name == "q" and graph.gated:  # the gate reads the queries' input too: rebuilt with it
                gate = einsum(read, gate_weights(attn)[heads], "batch pos head d_model, head width d_model -> batch pos head width")
                stash[f"gate{layer}"] = (heads, gate if attn.gate.bias is None else gate + gate_biases(attn)[heads])
        return replaced(act, stash.pop(f"q{layer}", None))

    def replaced(act, got):
        if got is None:
            return None
        heads, values = got
        act = act.clone()
        act[:, :, heads] = values.to(act.dtype)
        return act

    def z_hook(act, hook, layer):
        heads = graph.head_writers(layer)
        keep = carried(heads)
        if keep.numel():
            report(heads, keep, einsum(act[:, :, keep], model.blocks[layer].attn.W_O[keep],
                                       "batch pos head d_head, head d_head d_model -> batch pos head d_model"))

    def result_hook(act, hook, layer):  # sandwich blocks: a head's output needs its layer's ln1_post scale
        stash[f"result{layer}"] = act

    def post_scale_hook(act, hook, layer):
        heads = graph.head_writers(layer)
        keep = carried(heads)
        report(heads, keep, head_outputs(model, layer, stash.pop(f"result{layer}")[:, :, keep], act))

    def mlp_input(layer: int, act):
        reader = graph.mlp_reader(layer)
        stage = int(graph.reader_stage[reader])
        if not bool(active[reader]):
            return base_rows(stage, act.dtype)
        return as_rows(inputs(stage, [reader]))[:, :, 0].to(act.dtype)

    def mlp_hook(act, hook):
        layer = int(hook.name.split(".")[1])
        if graph.parallel:
            return reader_input(layer, act)
        return mlp_input(layer, act)

    def pre_hook(act, hook):
        return reader_input(int(hook.name.split(".")[1]), act)

    def mixer_in_hook(act, hook, layer):
        reader = graph.mixer_reader(layer)
        if not bool(active[reader]):
            return None  # the residual the block reads is base already
        return as_rows(inputs(2 * layer + 1, [reader]))[:, :, 0].to(act.dtype)

    def mixer_out_hook(act, hook, layer):
        writer = range(graph.mixer_writer(layer), graph.mixer_writer(layer) + 1)
        report(writer, carried(writer), act[:, :, None])

    def mlp_out_hook(act, hook):
        layer = int(hook.name.split(".")[1])
        writer = range(graph.mlp_writer(layer), graph.mlp_writer(layer) + 1)
        report(writer, carried(writer), act[:, :, None])

    def logits_hook(act, hook):
        return as_rows(inputs(2 * graph.n_layers + 1, [len(graph.readers) - 1]))[:, :, 0].to(act.dtype)

    def frozen_hook(act, hook):
        return frozen_scale(hook.name).to(act.dtype).expand_as(act)

    hooks = [(act_name("resid_pre", 0), embed_hook)]
    if graph.qk_positions:
        hooks.insert(0, ("hook_pos_embed", lambda a, h: stash.__setitem__("positions", a)))
    for l in range(graph.n_layers):
        if l > 0:
            hooks.append((act_name("resid_pre", l), mlp_hook if graph.parallel else pre_hook))
        if graph.is_mixer(l):  # its input rebuilt where ln1 reads it, past the residual the block carries on
            hooks += [(f"blocks.{l}.ln1.hook_in", lambda a, h, l=l: mixer_in_hook(a, h, l)),
                      (act_name("attn_out", l), lambda a, h, l=l: mixer_out_hook(a, h, l))]
            if bool(frozen_readers[graph.mixer_reader(l)]):
                hooks.append((act_name("scale", l, "ln1"), frozen_hook))
        else:
            hooks += [(act_name("q", l), lambda a, h, l=l: q_hook(a, h, l)),
                      (act_name("k", l), lambda a, h, l=l: replaced(a, stash.pop(f"k{l}", None))),
                      (act_name("v", l), lambda a, h, l=l: replaced(a, stash.pop(f"v{l}", None)))]
            if graph.gated:
                hooks.append((gate_name(l), lambda a, h, l=l: replaced(a, stash.pop(f"gate{l}", None))))
            if graph.sandwich:
                hooks += [(act_name("result", l), lambda a, h, l=l: result_hook(a, h, l)),
                          (act_name("scale", l, "ln1_post"), lambda a, h, l=l: post_scale_hook(a, h, l))]
            else:
                hooks.append((act_name("z", l), lambda a, h, l=l: z_hook(a, h, l)))
        if not graph.mlps:
            continue
        if not graph.parallel:
            hooks.append((act_name("resid_mid", l), mlp_hook))
        if bool(frozen_readers[graph.mlp_reader(l)]):
            hooks.append((act_name("scale", l, "ln2"), frozen_hook))
        hooks.append((act_name("mlp_out", l), mlp_out_hook))
    hooks.append((act_name("resid_post", graph.n_layers - 1), logits_hook))
    if bool(frozen_readers[-1]) and "ln_final.hook_scale" in model.hook_names:
        hooks.append(("ln_final.hook_scale", frozen_hook))
    mask = None if attention_mask is None else attention_mask.repeat(k, 1)
    return model.run_with_hooks(tokens.repeat(k, 1), attention_mask=mask, fwd_hooks=hooks, stop_at_layer=stop_at_layer)
