"""The result of a corpus scan for top triggers (`TopTriggers`): its slots, figure, files, and merging scans."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import pandas as pd
import plotly.graph_objects as go
import torch

from probe.analyses.common import TableDisplay, token_strings
from probe.analyses.labels import figure_token, plotly_text, shown_text, text_of, titled
from probe import HookedDecoder
from probe.io import atomic_file

EMPTY_DOC = -1  # doc index of an unfilled top-k slot (value -inf)
PAD = -1  # token id padding a context that starts before its window
MLP_SOURCE = "mlp"  # TopTriggers.source of a scan of FFN neurons (mlp.hook_post)


@dataclass
class TopTriggers(TableDisplay):
    """Each neuron's k highest coefficients (or SAE feature's k highest activations) over a corpus,
    with where they happened.

    Slots are ordered by (activation descending, document, position); a slot never filled (fewer
    than k tokens scanned) has activation -inf and document -1.

    `source` says what was scanned: "mlp" for FFN neurons (mlp.hook_post of each of `layers`), or
    the hook name of the SAE whose features were scanned (`top_triggers(..., sae=)`). An SAE scan
    has one entry in `layers`, the index of the block holding the SAE's hook point, or -1 for a hook
    point outside the blocks (hook_embed, hook_pos_embed, ln_final.*), and `neurons` holds feature ids.
    """

    layers: list[int]
    neurons: torch.Tensor  # [neuron]: the same neurons in every layer (an SAE scan: feature ids)
    activations: torch.Tensor  # [layer neuron k] float32
    docs: torch.Tensor  # [layer neuron k] int64: document index in corpus order
    positions: torch.Tensor  # [layer neuron k] int64: token index in the document (BOS not counted)
    contexts: torch.Tensor  # [layer neuron k context] int32: the prefix ending at the trigger token, left-padded with -1
    next_tokens: torch.Tensor  # [layer neuron k] int64: the token after the trigger in its document, -1 at its end
    n_docs: int = 0  # documents fully scanned, in corpus order (what a resumed scan skips)
    resume_start: int = 0  # of an interrupted scan: the token offset in document n_docs where it stopped
    n_tokens: int = 0
    complete: bool = True
    doc_names: dict[int, str] = field(default_factory=dict)  # names of the documents that hold a trigger
    source: str = MLP_SOURCE  # "mlp", or the hook name of the SAE whose features were scanned
    sae_digest: str = ""  # an SAE scan: SparseAutoencoder.digest(), so scans of two SAEs at one hook never mix

    @property
    def k(self) -> int:
        return self.activations.shape[-1]

    @property
    def unit(self) -> str:
        """What one scanned unit is: "neuron" (an MLP scan) or "feature" (an SAE scan)."""
        return "neuron" if self.source == MLP_SOURCE else "feature"

    def index(self, layer: int, neuron: int) -> tuple[int, int]:
        """(layer slot, neuron slot) of a model layer and neuron index (an SAE scan: feature id)."""
        if layer not in self.layers:
            raise ValueError(f"layer {layer} was not scanned; scanned layers: {self.layers}")
        hits = (self.neurons == neuron).nonzero()
        if not len(hits):
            raise ValueError(f"{self.unit} {neuron} was not scanned")
        return self.layers.index(layer), int(hits[0, 0])

    def to_frame(self, model: Optional[HookedDecoder] = None) -> pd.DataFrame:
        """One row per filled (layer, neuron, rank from 1); with a model, the prefix and tokens as text too.
        An SAE scan's rows name the feature in a `feature` column where an MLP scan's have `neuron`."""
        filled = (self.docs >= 0).nonzero().tolist()
        rows = []
        for li, ni, r in filled:
            row = {"layer": self.layers[li], self.unit: int(self.neurons[ni]), "rank": r + 1,
                   "activation": float(self.activations[li, ni, r]), "doc": int(self.docs[li, ni, r]),
                   "position": int(self.positions[li, ni, r]), "next_token_id": int(self.next_tokens[li, ni, r])}
            row["doc_name"] = self.doc_names.get(row["doc"], f"doc {row['doc']}")
            if model is not None and model.tokenizer is not None:
                ctx = [t for t in self.contexts[li, ni, r].tolist() if t != PAD]
                row["prefix"] = model.tokenizer.decode(ctx)
                row["trigger_token"] = model.tokenizer.decode(ctx[-1:])
                nxt = row["next_token_id"]
                row["next_token"] = model.tokenizer.decode([nxt]) if nxt >= 0 else None
            rows.append(row)
        return pd.DataFrame(rows)

    def figure(self, model: HookedDecoder, layer: int, neuron: int) -> go.Figure:
        """The neuron's top activations as bars, hover showing the escaped prefix ending at the trigger.
        For an SAE scan `layer` is its one entry of `layers` and `neuron` a feature id."""
        li, ni = self.index(layer, neuron)
        filled = (self.docs[li, ni] >= 0).nonzero().flatten().tolist()
        labels, hover = [], []
        for r in filled:
            ctx = [t for t in self.contexts[li, ni, r].tolist() if t != PAD]
            strings = token_strings(model, ctx)
            labels.append(f"#{r + 1} {figure_token(strings[-1])}")
            hover.append(f"activation {float(self.activations[li, ni, r]):.5g}<br>doc {int(self.docs[li, ni, r])} "
                         f"pos {int(self.positions[li, ni, r])}<br>…{plotly_text(shown_text(text_of(model.tokenizer, ctx)))}")
        fig = go.Figure(go.Bar(x=labels, y=self.activations[li, ni, filled].tolist(), hovertext=hover, hoverinfo="text"))
        if self.source == MLP_SOURCE:
            title, y_title = f"Top triggers of layer {layer} neuron {neuron}", "coefficient m (mlp.hook_post)"
        else:
            hook = plotly_text(self.source)
            title, y_title = f"Top triggers of feature {neuron} of the SAE at {hook}", f"feature activation (SAE at {hook})"
        width = max(640, 160 + 40 * len(labels))
        fig.update_layout(xaxis_title="trigger token", yaxis_title=y_title, xaxis_type="category", width=width, height=480)
        return titled(fig, title, width)

    # -- persistence: safetensors, so loading a result never unpickles anything
    def save(self, path: Union[str, os.PathLike], overwrite: bool = False) -> Path:
        """Write to `path` (safetensors) atomically; an existing file is kept unless overwrite=True."""
        from safetensors.torch import save_file

        tensors = dict(neurons=self.neurons, activations=self.activations, docs=self.docs,
                       positions=self.positions, contexts=self.contexts, next_tokens=self.next_tokens)
        meta = dict(layers=self.layers, n_docs=self.n_docs, resume_start=self.resume_start, n_tokens=self.n_tokens,
                    complete=self.complete, source=self.source, sae_digest=self.sae_digest,
                    doc_names={str(d): n for d, n in self.doc_names.items()})
        with atomic_file(path, overwrite=overwrite) as tmp:
            save_file({n: t.contiguous().cpu() for n, t in tensors.items()}, str(tmp),
                      metadata={"top_triggers": json.dumps(meta)})
        return Path(path).expanduser()

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "TopTriggers":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = (f.metadata() or {}).get("top_triggers")
            if meta is None:
                raise ValueError(f"{path} is a safetensors file but not a saved TopTriggers result")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        missing = {"neurons", "activations", "docs", "positions", "contexts", "next_tokens"} - set(tensors)
        if missing:
            raise ValueError(f"{path} lacks the tensors {sorted(missing)} of a saved TopTriggers result")
        meta = json.loads(meta)
        # files written before SAE scans existed have no source: they can only be MLP scans
        return cls(layers=meta["layers"], n_docs=meta["n_docs"], resume_start=meta["resume_start"],
                   n_tokens=meta["n_tokens"], complete=meta["complete"], source=meta.get("source", MLP_SOURCE),
                   sae_digest=meta.get("sae_digest", ""),
                   doc_names={int(d): n for d, n in meta["doc_names"].items()}, **tensors)


def empty_state(n_layers: int, n_neurons: int, k: int, context: int, device) -> dict[str, torch.Tensor]:
    shape = (n_layers, n_neurons, k)
    return dict(
        activations=torch.full(shape, -math.inf, device=device),
        docs=torch.full(shape, EMPTY_DOC, dtype=torch.long, device=device),
        positions=torch.full(shape, EMPTY_DOC, dtype=torch.long, device=device),
        contexts=torch.full(shape + (context,), PAD, dtype=torch.int32, device=device),
        next_tokens=torch.full(shape, -1, dtype=torch.long, device=device),
    )


def merge_states(
    states: Sequence[dict[str, torch.Tensor]], k: int, in_corpus_order: bool = False
) -> dict[str, torch.Tensor]:
    """Top-k along the last slot dimension of concatenated states, ordered by (activation desc, doc, pos).

    The order is total (a (doc, pos) pair occurs once in a corpus), so merging is associative and
    commutative: any sharding of the corpus merges to the same result as one scan.
    `in_corpus_order`: equal activations already sit in (doc, pos) order along the concatenation,
    as when a scan appends a batch sorted by activation, so one stable sort by activation suffices.
    """
    cat = {name: torch.cat([s[name] for s in states], dim=2) for name in states[0]}
    if in_corpus_order:
        order = (-cat["activations"]).argsort(dim=-1, stable=True)[..., :k]
    else:  # lexicographic sort from the least significant key up, each sort stable
        order = cat["positions"].argsort(dim=-1, stable=True)
        doc = cat["docs"].gather(-1, order)
        order = order.gather(-1, doc.argsort(dim=-1, stable=True))
        neg = (-cat["activations"]).gather(-1, order)  # ascending on -activation puts -inf (empty) last
        order = order.gather(-1, neg.argsort(dim=-1, stable=True))[..., :k]
    merged = {name: t.gather(2, order) for name, t in cat.items() if name != "contexts"}
    ctx = cat["contexts"]
    merged["contexts"] = ctx.gather(2, order[..., None].expand(-1, -1, -1, ctx.shape[-1]))
    return merged


def merge(results: Sequence[TopTriggers]) -> TopTriggers:
    """Merge scans of disjoint parts of one corpus (same layers, neurons and k, document indices
    global): the result equals one scan of the whole corpus."""
    results = list(results)
    if not results:
        raise ValueError("merge needs at least one TopTriggers result")
    first = results[0]
    for r in results[1:]:
        if (r.source, r.sae_digest) != (first.source, first.sae_digest):
            # an SAE's features and FFN neurons (or two hook points' SAEs) share ids but not meaning
            raise ValueError(f"merge takes results of one source; got {first.source!r} and {r.source!r}"
                             + (" (two different SAEs at one hook point)" if r.source == first.source else ""))
        if r.layers != first.layers or not torch.equal(r.neurons, first.neurons) or r.k != first.k \
                or r.contexts.shape[-1] != first.contexts.shape[-1]:
            raise ValueError("merge takes results of the same layers, neurons, k and context length")
    names = ("activations", "docs", "positions", "contexts", "next_tokens")
    merged = merge_states([{n: getattr(r, n) for n in names} for r in results], first.k)
    doc_names = {}
    for r in results:
        doc_names.update(r.doc_names)
    return TopTriggers(layers=list(first.layers), neurons=first.neurons.clone(), **merged,
                       n_docs=max(r.n_docs for r in results), n_tokens=sum(r.n_tokens for r in results),
                       complete=all(r.complete for r in results),
                       doc_names=kept_names(doc_names, merged["docs"]), source=first.source,
                       sae_digest=first.sae_digest)



def kept_names(doc_names: dict[int, str], docs: torch.Tensor) -> dict[int, str]:
    kept = set(docs.unique().tolist())
    return {d: n for d, n in doc_names.items() if d in kept}
