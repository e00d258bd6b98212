"""The graph a circuit lives in: who writes to the residual stream, who reads it, and every edge between them.

Writers (nodes with an output): `embed` (token + position embedding, as it enters block 0), every
head `L{l}H{h}` (its write without the output bias b_O, which is the same in every run), every MLP
`L{l} mlp`. Readers (a node's input): each head's query input `L{l}H{h}<q`, its key and value
inputs `L{l}H{h}<k` / `<v`, each MLP's input `L{l} mlp` and the `logits` (the final norm's input).
Grouped-query models read keys and values once per key/value head, so their key and value inputs
are per key/value head, `L{l}KV{g}<k` / `<v`, each feeding the query heads that share it: that is
what the model computes, so patching one of them is exact (a per-query-head key input would not be). This holds
with transformer-lens's `ungroup_grouped_query_attention` on too: the analyses taking this graph
(`with_grouped_key_values`) run with keys and values hooked per key/value head, and leave the switch as it was.

There is an edge from a writer to every reader that reads the residual after the writer wrote to
it: a head of layer l reaches the MLP of layer l and everything from layer l + 1 on. Parallel
blocks (GPT-NeoX) read the residual entering the block with both sublayers, so the MLP of layer l
does not read the attention of layer l. A reader's input is then the sum of its writers' outputs
plus constants (biases), the same in every run: patching an edge adds (new - old) of one writer
to one reader's input alone.

Sandwich blocks (Gemma 2) normalise the attention's summed write: a head's output is its share of
hook_attn_out, its result times ln1_post's weight over that run's ln1_post scale (the shares add
up to hook_attn_out exactly). The shares depend on the other heads of the layer only through that
one scale per position. A LayerNorm sandwich, or one with b_O, has no such exact split and is
refused; post-norm blocks (GPT-1), whose residual is not a sum of writes, are refused too.

Recurrent layers (a hybrid's Gated DeltaNet, Mamba or short-convolution layers, and every layer of Mamba) have no
heads: each is one node, `L{l} mixer`, with one input, the residual it reads through ln1 (`blocks.l.ln1.hook_in`),
and one output, its write (`hook_attn_out`), as an MLP is. Its edges are exact in the same sense: the mixer is a
function of its whole input (every position), as a head is of its q, k and v inputs.

Attention-only models (toy models, transformer-lens's attn_only) have no MLP nodes. Shortformer models add
their positions to every query and key input after ln1, never to the residual: the positions are not a node, as
a bias is not, since clean and corrupted prompts share their padding and so their positions; `embed` is the
token embedding alone, which is all their residual starts with.

Names are accepted on input in this notation or the issue's short one: `a2.0` = `2.0` = `L2H0`,
`a2.0<q` = `L2H0<q`, `m1` = `L1 mlp`, `input` = `embed`, `mixer3` = `L3 mixer`.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence, Union

import pandas as pd
import torch

from probe import HookedDecoder
from probe.config import Norm, NormPlacement, Positions
from probe.analyses.architecture import (refuse_mixers_beside_heads, refuse_shared_blocks,
                                         refuse_shared_keys_and_scaled_layers, require_head_weights)
from probe.analyses.common import TableDisplay

LOGITS = "logits"


def check_graph_model(model: HookedDecoder) -> None:
    """Refuse the families whose residual stream is not an exact sum of writer outputs."""
    require_head_weights(model, "circuit discovery")
    refuse_mixers_beside_heads(model, "circuit discovery")
    refuse_shared_blocks(model, "circuit discovery")
    refuse_shared_keys_and_scaled_layers(model, "circuit discovery")
    cfg = model.cfg
    check_mixer_layers(model)
    if cfg.sub_norms:
        raise ValueError("circuit discovery: this model (BitNet) normalises every head's z together before W_O "
                         "(attn_sub_norm), so a head's write depends on all the others' through one scale per position, "
                         "which edges between heads do not carry; head ablation and patching (patch(..., sites='heads')) "
                         "work on it")
    if cfg.norm_placement is NormPlacement.POST:
        raise ValueError("post-norm blocks (GPT-1, OPT-350m) normalise the residual itself, so it is not a sum of the "
                         "writers' outputs and an edge has no exact meaning; circuits need pre-norm, parallel or sandwich "
                         "blocks")
    if cfg.norm_placement is NormPlacement.SANDWICH:
        if cfg.norm is Norm.LAYER:
            raise ValueError("a LayerNorm sandwich block centres the attention's summed write, so heads' shares of "
                             "it are not exact; circuits support RMSNorm sandwich blocks (Gemma 2)")
        if any(block.attn.out.bias is not None for block in model.blocks):
            raise ValueError("a sandwich block with an attention output bias normalises b_O with the heads, so no head "
                             "owns that share; circuits support sandwich blocks without b_O (Gemma 2)")



def mixer_layers(cfg) -> tuple[bool, ...]:
    """Per layer: whether its node is a recurrent mixer (no heads) rather than attention heads."""
    return tuple(cfg.layer_is_linear(l) for l in range(cfg.n_layers))


def check_mixer_layers(model: HookedDecoder) -> None:
    """Refuse the recurrent layers a mixer node cannot stand for: layers of one sublayer (NemotronH's MLP-only layers,
    where a layer's writers are not heads + mixer + MLP), and mixers in sandwich or parallel blocks (their writes are
    normalised with the heads', or read beside the MLP's input); a mixer must read through ln1 and write at
    hook_attn_out."""
    cfg = model.cfg
    layers = [l for l, mixer in enumerate(mixer_layers(cfg)) if mixer]
    if not layers:
        return
    if cfg.sublayers is not None:
        raise ValueError("circuit discovery: this model's layers hold one sublayer each (NemotronH's mixer-, "
                         "attention- and MLP-only layers), which the circuit graph's layers (heads or a mixer, then an "
                         "MLP) do not describe; analyses by layer work on it (logit_lens, patch(..., sites='resid_pre' / "
                         "'attn_out' / 'mlp_out'))")
    if cfg.norm_placement in (NormPlacement.SANDWICH, NormPlacement.PARALLEL):
        raise ValueError(f"circuit discovery: this model's recurrent layers {layers} sit among "
                         f"{cfg.norm_placement.value} blocks (OLMo-Hybrid's sandwich attention), which the circuit graph "
                         "does not combine with mixer nodes; it takes recurrent layers among pre-norm blocks (Mamba, "
                         "Qwen3.5, LFM2, Jamba, Granite 4.0-H)")
    missing = [l for l in layers if not all(hasattr(model.blocks[l], part) for part in ("ln1", "hook_attn_out"))
               or not hasattr(model.blocks[l].ln1, "hook_in")]
    if missing:
        raise ValueError(f"circuit discovery: layers {missing} of this model mix positions without reading through "
                         "ln1 and writing at hook_attn_out, which a mixer node needs")

@dataclass(frozen=True)
class CircuitGraph(TableDisplay):
    """Writers, readers and edges of one model. Edges are the valid (writer, reader) pairs in writer-major
    order: `edge_writer[e]`, `edge_reader[e]` index `writers` and `readers`. Nodes are the writers then
    `logits`; `reader_nodes` [reader node] says which nodes each reader feeds (a shared key/value input
    feeds every query head of its group)."""

    writers: list[str]
    writer_kind: list[str]  # embed, head, mixer, mlp
    writer_layer: list[int]  # -1 for embed
    writer_head: list[int]  # -1 unless a head
    readers: list[str]
    reader_kind: list[str]  # q, k, v, mixer, mlp, logits
    reader_layer: list[int]  # n_layers for logits
    reader_head: list[int]  # query head (q), key/value head (k, v), -1 otherwise
    writer_stage: torch.Tensor = field(repr=False)  # [writer] where the write lands: 0 embed, 2l+1 attention l, 2l+2 MLP l
    reader_stage: torch.Tensor = field(repr=False)  # [reader] the residual it reads: writers of a lower stage reach it
    reader_nodes: torch.Tensor = field(repr=False)  # [reader node] bool
    n_layers: int = 0
    heads: tuple[int, ...] = ()  # query heads per layer
    kv_heads: tuple[int, ...] = ()  # key/value heads per layer
    mixers: tuple[bool, ...] = ()  # per layer: a recurrent mixer node (and no heads)
    parallel: bool = False
    sandwich: bool = False
    mlps: bool = True  # False in attention-only models: no MLP writers or readers
    qk_positions: bool = False  # shortformer: the positions join each q and k input after ln1
    score_bias: bool = False  # ALiBi: the positions add to each head's scores
    clipped_qkv: bool = False  # q, k and v clamped (clip_qkv: OLMo-7B-0424)
    attention_sinks: bool = False  # each head's softmax has a learned sink logit (GPT-OSS)
    # q and k normalised after rotary (HunYuan), or each head's z gated (a gated attention): orders and gates the
    # sparse engine's attention does not compute
    reordered_or_gated: bool = False
    # each head's z times a function of its gate's logits, which read the queries' input (Qwen3.5, AFMoE, Laguna):
    # part of each q reader, rebuilt and differentiated with it
    gated: bool = False

    @property
    def grouped(self) -> bool:
        return any(kv != h for kv, h in zip(self.kv_heads, self.heads))

    @property
    def nodes(self) -> list[str]:
        return self.writers + [LOGITS]

    @cached_property
    def valid(self) -> torch.Tensor:
        """[writer reader] bool: which pairs are edges."""
        return self.writer_stage[:, None] < self.reader_stage[None, :]

    @cached_property
    def edge_writer(self) -> torch.Tensor:
        return self.valid.nonzero()[:, 0]

    @cached_property
    def edge_reader(self) -> torch.Tensor:
        return self.valid.nonzero()[:, 1]

    @cached_property
    def n_edges(self) -> int:
        return int(self.valid.sum())

    @cached_property
    def writers_before(self) -> tuple[int, ...]:
        """For each stage s (0 .. 2 n_layers + 2), how many writers land before it: a prefix in writer order."""
        stages = self.writer_stage.tolist()
        return tuple(sum(w < s for w in stages) for s in range(2 * self.n_layers + 3))

    def edge_names(self) -> list[str]:
        return [f"{self.writers[w]} -> {self.readers[r]}" for w, r in self.valid.nonzero().tolist()]

    def stages(self) -> list[int]:
        """The distinct reader stages, in forward order."""
        return sorted(set(self.reader_stage.tolist()))

    def is_mixer(self, layer: int) -> bool:
        return bool(self.mixers) and self.mixers[layer]

    @cached_property
    def _reader_starts(self) -> tuple[int, ...]:
        """Each layer's first reader: its q inputs, then k, then v, then its mixer's input, then its MLP's."""
        per_layer = [h + 2 * kv + self.is_mixer(l) + self.mlps for l, (h, kv) in enumerate(zip(self.heads, self.kv_heads))]
        return tuple(sum(per_layer[:l]) for l in range(self.n_layers + 1))

    @cached_property
    def _writer_starts(self) -> tuple[int, ...]:
        """Each layer's first writer (after the embedding): its heads, then its mixer, then its MLP."""
        per_layer = [h + self.is_mixer(l) + self.mlps for l, h in enumerate(self.heads)]
        return tuple(1 + sum(per_layer[:l]) for l in range(self.n_layers + 1))

    def attn_readers(self, layer: int) -> range:
        """Reader indices of layer `layer`'s attention: its q inputs, then k, then v (none in a mixer layer)."""
        start = self._reader_starts[layer]
        return range(start, start + self.heads[layer] + 2 * self.kv_heads[layer])

    def mixer_reader(self, layer: int) -> int:
        self._need_mixer(layer)
        return self.attn_readers(layer).stop

    def mlp_reader(self, layer: int) -> int:
        self._need_mlps()
        return self.attn_readers(layer).stop + self.is_mixer(layer)

    def head_writers(self, layer: int) -> range:
        start = self._writer_starts[layer]
        return range(start, start + self.heads[layer])

    def mixer_writer(self, layer: int) -> int:
        self._need_mixer(layer)
        return self.head_writers(layer).stop

    def mlp_writer(self, layer: int) -> int:
        self._need_mlps()
        return self.head_writers(layer).stop + self.is_mixer(layer)

    def layer_writers(self, layer: int) -> range:
        """Layer `layer`'s writers: its heads (or its mixer), then its MLP when it has one."""
        heads = self.head_writers(layer)
        return range(heads.start, heads.stop + self.is_mixer(layer) + self.mlps)

    def _need_mixer(self, layer: int) -> None:
        if not self.is_mixer(layer):
            raise ValueError(f"layer {layer} of this graph has attention heads, not a mixer node")

    def _need_mlps(self) -> None:
        if not self.mlps:
            raise ValueError("this attention-only model's graph has no MLP nodes")

    def counts(self) -> dict[str, int]:
        kinds = pd.Series(self.reader_kind).value_counts()
        valid = self.valid
        per_kind = {f"edges into {k}": int(valid[:, [i for i, r in enumerate(self.reader_kind) if r == k]].sum())
                    for k in ("q", "k", "v", "mixer", "mlp", "logits")}
        return {"writers": len(self.writers), "readers": len(self.readers), "nodes": len(self.nodes),
                "edges": self.n_edges, **{f"{k} inputs": int(kinds.get(k, 0)) for k in ("q", "k", "v", "mixer", "mlp")},
                **per_kind}

    def to_frame(self) -> pd.DataFrame:
        """One row per edge: source, target (the reader's name), input (q, k, v, mixer, mlp, logits), layers."""
        w, r = self.edge_writer.tolist(), self.edge_reader.tolist()
        return pd.DataFrame({
            "source": [self.writers[i] for i in w], "target": [self.readers[i] for i in r],
            "input": [self.reader_kind[i] for i in r],
            "source_layer": [self.writer_layer[i] for i in w], "target_layer": [self.reader_layer[i] for i in r],
        })

    def __str__(self) -> str:
        c = self.counts()
        kv = " (key/value inputs per key/value head)" if self.grouped else ""
        mixers = f", {c['edges into mixer']} mixer" if any(self.mixers) else ""
        return (f"CircuitGraph: {c['writers']} writers, {c['readers']} readers{kv}, {c['edges']} edges "
                f"({c['edges into q']} into q, {c['edges into k']} k, {c['edges into v']} v{mixers}, "
                f"{c['edges into mlp']} mlp, {c['edges into logits']} logits)")

    # ---- names on input ---------------------------------------------------------------------------
    def writer_index(self, name: Union[str, tuple]) -> int:
        """A writer from `L2H0` / `a2.0` / `2.0` / (2, 0), `L1 mlp` / `m1`, `L3 mixer` / `mixer3`, `embed` / `input`."""
        key = _canonical(name)
        if key in self.writers:
            return self.writers.index(key)
        raise ValueError(_unknown(name, "writer", self.writers))

    def reader_indices(self, name: Union[str, tuple]) -> list[int]:
        """The readers a name means: one input (`L2H0<k`, `L2KV0<k`, `L1 mlp`, `L3 mixer`, `logits`), or every input of a head
        (`L2H0`: its q, k and v inputs; with grouped-query attention, its group's key/value inputs)."""
        key = _canonical(name)
        if key in self.readers:
            return [self.readers.index(key)]
        match = re.fullmatch(r"L(\d+)H(\d+)(?:<([kv]))?", key)
        if match and int(match[1]) < self.n_layers and int(match[2]) < self.heads[int(match[1])]:
            layer, head = int(match[1]), int(match[2])
            group = head // (self.heads[layer] // self.kv_heads[layer])
            parts = [match[3]] if match[3] else ["q", "k", "v"]
            wanted = [f"L{layer}H{head}<q"] if "q" in parts else []
            wanted += [f"L{layer}KV{group}<{p}" if self.grouped else f"L{layer}H{head}<{p}" for p in parts if p != "q"]
            return [self.readers.index(n) for n in wanted]
        raise ValueError(_unknown(name, "reader", self.readers))


def _canonical(name) -> str:
    if isinstance(name, tuple) and len(name) == 2:
        return f"L{int(name[0])}H{int(name[1])}"
    if not isinstance(name, str):
        raise TypeError(f"a node is named by a string such as 'L2H0', 'L2H0<q', 'L1 mlp', 'embed' or 'logits' "
                        f"(or a (layer, head) tuple), got {type(name).__name__}")
    text = name.strip()
    if text in ("input", "embed"):
        return "embed"
    match = re.fullmatch(r"(?:a|L)?(\d+)[.H](\d+)(<[qkv])?", text)
    if match:
        return f"L{match[1]}H{match[2]}{match[3] or ''}"
    match = re.fullmatch(r"(?:m|L)(\d+)(?: ?mlp)?", text)
    if match and text != f"L{match[1]}":
        return f"L{match[1]} mlp"
    match = re.fullmatch(r"(?:mixer|L)(\d+)(?: ?mixer)?", text)
    if match and text != f"L{match[1]}":
        return f"L{match[1]} mixer"
    return text


def _unknown(name, what: str, valid: Sequence[str]) -> str:
    import difflib

    close = difflib.get_close_matches(str(name), valid, n=3)
    hint = f"; closest: {', '.join(close)}" if close else ""
    return (f"{name!r} is not a {what} of this model's graph{hint} ({what}s are named like "
            f"{', '.join(valid[:2])}, ..., {valid[-1]})")


def circuit_graph(model: HookedDecoder) -> CircuitGraph:
    """The model's graph: writers, readers and edges (see the module docstring for the names). It depends on the
    config alone, so models of one config share one graph: treat it as read-only."""
    check_graph_model(model)
    return _graph_of(model.cfg)


def with_grouped_key_values(analysis):
    """`analysis(model, ...)` run inside model.grouped_key_values(): the graph's key and value inputs are one per
    key/value head whatever transformer-lens's `ungroup_grouped_query_attention` says."""
    @functools.wraps(analysis)
    def run(model, *args, **kwargs):
        with model.grouped_key_values():
            return analysis(model, *args, **kwargs)
    return run


@functools.lru_cache(maxsize=32)
def _graph_of(cfg) -> CircuitGraph:
    L = cfg.n_layers
    parallel = cfg.norm_placement is NormPlacement.PARALLEL
    mlps = not cfg.attn_only
    mixers = mixer_layers(cfg)
    heads = tuple(0 if mixers[l] else cfg.layer_heads(l) for l in range(L))
    kv_heads = tuple(0 if mixers[l] else cfg.layer_kv_heads(l) for l in range(L))
    grouped = any(k != h for k, h in zip(kv_heads, heads))
    writers, w_kind, w_layer, w_head, w_stage = ["embed"], ["embed"], [-1], [-1], [0]
    readers, r_kind, r_layer, r_head, r_stage = [], [], [], [], []
    for l in range(L):
        m = int(mixers[l])
        writers += [f"L{l}H{h}" for h in range(heads[l])] + [f"L{l} mixer"] * m + [f"L{l} mlp"] * mlps
        w_kind += ["head"] * heads[l] + ["mixer"] * m + ["mlp"] * mlps
        w_layer += [l] * (heads[l] + m + mlps)
        w_head += list(range(heads[l])) + [-1] * (m + mlps)
        w_stage += [2 * l + 1] * (heads[l] + m) + [2 * l + 2] * mlps
        kv_name = (lambda g, p: f"L{l}KV{g}<{p}") if grouped else (lambda g, p: f"L{l}H{g}<{p}")
        readers += [f"L{l}H{h}<q" for h in range(heads[l])]
        readers += [kv_name(g, "k") for g in range(kv_heads[l])] + [kv_name(g, "v") for g in range(kv_heads[l])]
        readers += [f"L{l} mixer"] * m + [f"L{l} mlp"] * mlps
        r_kind += ["q"] * heads[l] + ["k"] * kv_heads[l] + ["v"] * kv_heads[l] + ["mixer"] * m + ["mlp"] * mlps
        r_layer += [l] * (heads[l] + 2 * kv_heads[l] + m + mlps)
        r_head += list(range(heads[l])) + list(range(kv_heads[l])) * 2 + [-1] * (m + mlps)
        r_stage += [2 * l + 1] * (heads[l] + 2 * kv_heads[l] + m) + [2 * l + 1 if parallel else 2 * l + 2] * mlps
    readers.append(LOGITS)
    r_kind.append("logits")
    r_layer.append(L)
    r_head.append(-1)
    r_stage.append(2 * L + 1)

    nodes = len(writers) + 1
    reader_nodes = torch.zeros(len(readers), nodes, dtype=torch.bool)
    for r, (kind, layer, head) in enumerate(zip(r_kind, r_layer, r_head)):
        if kind == "logits":
            reader_nodes[r, -1] = True
        elif kind in ("mlp", "mixer"):
            reader_nodes[r, writers.index(f"L{layer} {kind}")] = True
        elif kind == "q":
            reader_nodes[r, writers.index(f"L{layer}H{head}")] = True
        else:  # a key/value head serves a group of adjacent query heads
            group = heads[layer] // kv_heads[layer]
            for h in range(head * group, (head + 1) * group):
                reader_nodes[r, writers.index(f"L{layer}H{h}")] = True
    return CircuitGraph(
        writers=writers, writer_kind=w_kind, writer_layer=w_layer, writer_head=w_head,
        readers=readers, reader_kind=r_kind, reader_layer=r_layer, reader_head=r_head,
        writer_stage=torch.tensor(w_stage), reader_stage=torch.tensor(r_stage), reader_nodes=reader_nodes,
        n_layers=L, heads=heads, kv_heads=kv_heads, mixers=mixers, parallel=parallel,
        sandwich=cfg.norm_placement is NormPlacement.SANDWICH, mlps=mlps,
        qk_positions=cfg.positions is Positions.SHORTFORMER, score_bias=cfg.positions is Positions.ALIBI,
        clipped_qkv=cfg.clip_qkv is not None, attention_sinks=cfg.attn_sinks,
        # (Llama 4: q and k normalised after rotary, NoPE layers' queries scaled by position)
        reordered_or_gated=cfg.qk_norm_after_rope or cfg.attn_output_gate or cfg.chunked_attention is not None,
        gated=cfg.attn_output_gate,
    )
