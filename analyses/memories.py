"""FFN layers as key-value memories (Geva et al. 2021, 2022).

An FFN layer computes `FF(x) = sum_i m_i(x) v_i + b_out`: the key k_i is the i-th column of W_in,
the coefficient m_i(x) = act(x . k_i + b_in_i) is `blocks.{l}.mlp.hook_post`, and the value v_i is
the i-th row of W_out. Each term m_i v_i is a sub-update of the residual stream.

- `value_tokens`: which tokens each value promotes and suppresses (v_i W_U).
- `memory_lookup`: the memories that fire at one position of one prompt, ranked by |m_i| ||v_i||.
- `top_triggers`: every chosen neuron's top-k activating prefixes over a corpus, streamed; with
  `sae=`, the same scan of a sparse autoencoder's features at its hook point.
- `agreement`: Geva's statistic, how often a value's top token is the next token after its triggers.

`python -m analyses.memories` (or `torchrun --nproc_per_node N -m analyses.memories`) scans a corpus
from the command line (`--sae DIR` for an SAE's features) and writes the result as safetensors.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import pandas as pd
import plotly.graph_objects as go
import torch
from einops import einsum, rearrange
from plotly.subplots import make_subplots

from analyses.common import AnalysisInput, PromotedTokens, as_tokens, escape_token, token_strings, unit_ids
from analyses.corpus import Corpus, _encode_document, _iter_document_pieces, iter_documents
from probe import HookedDecoder, Norm, NormPlacement, SparseAutoencoder
from probe.io import atomic_file
from probe.names import act_name

Layers = Union[int, Sequence[int], None]

# value_tokens multiplies [neuron d_model] by [d_model vocab] in chunks of at most this many logits,
# so all 3072 neurons of a GPT-2 layer against a 50k vocabulary never sit in memory at once (and a
# half-precision unembedding is converted to float32 at most this many entries at a time)
_LOGIT_CHUNK = 1 << 24


# ---- shared helpers ------------------------------------------------------------------------------
def _layer_list(model: HookedDecoder, layers: Layers) -> list[int]:
    n = model.cfg.n_layers
    if layers is None:
        return list(range(n))
    chosen = [layers] if isinstance(layers, int) else list(layers)
    if not chosen:
        raise ValueError("layers is empty: pass a layer index, a list of them, or None for all layers")
    for layer in chosen:
        if not isinstance(layer, int) or not -n <= layer < n:
            raise ValueError(f"layer {layer!r} is outside the model's layers [0, {n})")
    resolved = [layer % n for layer in chosen]
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"layers {chosen} name a layer twice")
    return resolved


def _neuron_tensor(model: HookedDecoder, neurons: Optional[Sequence[int]]) -> torch.Tensor:
    d_mlp = model.cfg.d_mlp
    if neurons is None:
        return torch.arange(d_mlp)
    return unit_ids(neurons, d_mlp, "neuron", f"the layer's neurons [0, d_mlp={d_mlp})")


def _value_directions(model: HookedDecoder, layer: int, neurons: torch.Tensor, through_final_norm: bool) -> torch.Tensor:
    """[neuron d_model] float32: the values v_i, or what the final norm does to them (`_final_norm_directions`)."""
    # float32 whatever the model's dtype: the weights are exact, and bfloat16 arithmetic on them would
    # round v_i W_U to 8 bits, tying and reordering near-equal tokens (half the neurons' top-10 lists)
    block = model.blocks[layer]
    values = block.mlp.W_out[neurons.to(model.device)].float()
    if hasattr(block, "ln2_post"):  # a sandwich block's write: the MLP output times ln2_post.w over a per-position scale
        values = values * block.ln2_post.w.float()
    return _final_norm_directions(model, values) if through_final_norm else values


def _final_norm_directions(model: HookedDecoder, directions: torch.Tensor) -> torch.Tensor:
    """[n d_model] float32: what the final norm does to residual directions: a LayerNorm centres them and
    multiplies by its weight, an RMSNorm only multiplies, and a model without a final norm leaves them be
    (the scale is per position and never changes a ranking)."""
    if model.cfg.final_norm:
        if model.cfg.norm is Norm.LAYER:
            directions = directions - directions.mean(-1, keepdim=True)
        directions = directions * model.ln_final.w.float()
    return directions


@torch.no_grad()
def _top_value_tokens(
    model: HookedDecoder, layer: int, neurons: torch.Tensor, k: int, through_final_norm: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k and bottom-k of v_i W_U for each neuron: (top_logits, top_ids, bottom_logits, bottom_ids), [neuron k]."""
    return _top_tokens(model, lambda rows: _value_directions(model, layer, neurons[rows], through_final_norm),
                       len(neurons), k)


@torch.no_grad()
def _top_tokens(
    model: HookedDecoder, directions: Callable[[slice], torch.Tensor], n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_top_value_tokens` for any n residual directions, `directions(rows)` giving rows [rows d_model] float32."""
    W_U = model.unembed.W_U  # [d_model vocab]
    d_model, d_vocab = W_U.shape
    # float32 like the values: a half-precision W_U is converted a slice of columns at a time, so no
    # float32 copy of the whole unembedding is ever held (a float32 W_U is used whole, uncopied)
    cols = d_vocab if W_U.dtype == torch.float32 else max(1, _LOGIT_CHUNK // d_model)
    chunk = max(1, _LOGIT_CHUNK // d_vocab)
    outs = []
    for start in range(0, n, chunk):
        values = directions(slice(start, start + chunk))
        logits = values.new_empty(len(values), d_vocab)  # [neuron vocab]
        for col in range(0, d_vocab, cols):
            logits[:, col:col + cols] = einsum(values, W_U[:, col:col + cols].float(), "neuron d_model, d_model vocab -> neuron vocab")
        top = logits.topk(k, dim=-1)
        bottom = logits.topk(k, dim=-1, largest=False)
        outs.append((top.values, top.indices, bottom.values, bottom.indices))
    return tuple(torch.cat([o[i] for o in outs]).cpu() for i in range(4))


# ---- value_tokens --------------------------------------------------------------------------------
@dataclass
class ValueTokens(PromotedTokens):
    """The tokens each value vector promotes and suppresses when read through the unembedding."""

    layer: int
    neurons: torch.Tensor  # [neuron]
    top_ids: torch.Tensor  # [neuron k], most promoted first
    top_logits: torch.Tensor  # [neuron k]
    bottom_ids: torch.Tensor  # [neuron k], most suppressed first
    bottom_logits: torch.Tensor  # [neuron k]
    token_strings: list[list[str]]  # [neuron] of k promoted strings then k suppressed strings
    through_final_norm: bool

    def to_frame(self) -> pd.DataFrame:
        """One row per (neuron, direction, rank): the token, its id and its logit v_i W_U."""
        return self._promoted_frame({"layer": [self.layer] * len(self.neurons), "neuron": self.neurons.tolist()})

    def figure(self, max_neurons: int = 20) -> go.Figure:
        """Heatmaps of the promoted (left) and suppressed (right) tokens' logits, tokens written in the cells."""
        norm = " through the final norm" if self.through_final_norm else ""
        return self._promoted_figure([f"L{self.layer} N{int(m)}" for m in self.neurons[:max_neurons]],
                                     f"Tokens promoted and suppressed by layer {self.layer}'s values (v W_U{norm})")


def value_tokens(
    model: HookedDecoder,
    layer: int,
    neurons: Optional[Sequence[int]] = None,
    k: int = 10,
    *,
    through_final_norm: bool = False,
) -> ValueTokens:
    """The top-k promoted and suppressed tokens of v_i W_U for each neuron of `layer` (None = all).

    `through_final_norm=True` reads what the final norm does to the direction before the
    unembedding instead of v_i: (v_i - mean(v_i)) * ln_final.w for a LayerNorm, v_i * ln_final.w for
    an RMSNorm (Geva et al. read the raw v_i).
    """
    (layer,) = _layer_list(model, layer)
    ids = _neuron_tensor(model, neurons)
    if not isinstance(k, int) or not 0 < k <= model.cfg.d_vocab:
        raise ValueError(f"k={k!r} must be an integer in [1, d_vocab={model.cfg.d_vocab}]")
    top_logits, top_ids, bottom_logits, bottom_ids = _top_value_tokens(model, layer, ids, k, through_final_norm)
    strings = [token_strings(model, top_ids[i].tolist() + bottom_ids[i].tolist()) for i in range(len(ids))]
    return ValueTokens(layer, ids, top_ids, top_logits, bottom_ids, bottom_logits, strings, through_final_norm)


# ---- memory_lookup -------------------------------------------------------------------------------
@dataclass
class MemoryLookup:
    """The memories active at one position: every coefficient, and the top-k sub-updates per layer."""

    tokens: torch.Tensor  # [pos]
    position: int
    layers: list[int]
    coefficients: torch.Tensor  # [layer d_mlp]: m_i, equal to mlp.hook_post at the position
    value_norms: torch.Tensor  # [layer d_mlp]: ||v_i|| (a sandwich block: of v_i * ln2_post.w / its scale, what it writes)
    neurons: torch.Tensor  # [layer k]: ranked by sub-update size, largest first
    sizes: torch.Tensor  # [layer k]: |m_i| ||v_i||
    prediction_effect: torch.Tensor  # [layer k]: direct effect of m_i v_i on the predicted token's logit
    top_token_ids: torch.Tensor  # [layer k n_tokens]: the value's most promoted tokens
    top_token_strings: list[list[list[str]]]
    predicted_token: int  # the model's argmax next token at the position
    predicted_string: str
    token_string: str  # the token at the position

    @property
    def sub_update_sizes(self) -> torch.Tensor:
        """[layer d_mlp]: |m_i| ||v_i|| for every neuron."""
        return self.coefficients.abs() * self.value_norms

    def to_frame(self) -> pd.DataFrame:
        """One row per (layer, rank) of the top memories."""
        rows = []
        for li, layer in enumerate(self.layers):
            for r in range(self.neurons.shape[1]):
                n = int(self.neurons[li, r])
                rows.append(dict(
                    layer=layer, rank=r, neuron=n, coefficient=float(self.coefficients[li, n]),
                    value_norm=float(self.value_norms[li, n]), size=float(self.sizes[li, r]),
                    top_tokens=list(self.top_token_strings[li][r]),
                    prediction_effect=float(self.prediction_effect[li, r]),
                    pushes_prediction=bool(self.prediction_effect[li, r] > 0),
                ))
        return pd.DataFrame(rows)

    def figure(self) -> go.Figure:
        """Per layer, the top sub-updates' sizes, labelled by neuron and top tokens; green bars push the
        model's predicted next token up (direct effect through the final norm), red bars push it down."""
        n_layers = len(self.layers)
        fig = make_subplots(rows=n_layers, cols=1, subplot_titles=[f"layer {l}" for l in self.layers],
                            vertical_spacing=min(0.08, 0.5 / max(n_layers, 1)))
        for li, layer in enumerate(self.layers):
            labels, hover = [], []
            for r in range(self.neurons.shape[1]):
                n = int(self.neurons[li, r])
                tokens = " ".join(escape_token(s) for s in self.top_token_strings[li][r][:3])
                labels.append(f"N{n}: {tokens}")
                hover.append(
                    f"layer {layer} neuron {n}<br>coefficient m = {float(self.coefficients[li, n]):.5g}"
                    f"<br>|m| ||v|| = {float(self.sizes[li, r]):.5g}"
                    f"<br>effect on logit of {escape_token(self.predicted_string)} = "
                    f"{float(self.prediction_effect[li, r]):.5g}"
                    f"<br>promotes: {' '.join(escape_token(s) for s in self.top_token_strings[li][r])}"
                )
            colours = ["#2ca02c" if e > 0 else "#d62728" for e in self.prediction_effect[li].tolist()]
            fig.add_trace(go.Bar(x=labels, y=self.sizes[li].tolist(), marker_color=colours, hovertext=hover,
                                 hoverinfo="text", showlegend=False), row=li + 1, col=1)
            fig.update_yaxes(title_text="|m| ||v||", row=li + 1, col=1)
        fig.update_layout(
            title=(f"Memories firing at position {self.position} ({escape_token(self.token_string)}); "
                   f"prediction {escape_token(self.predicted_string)} (green: pushed up, red: pushed down)"),
            height=120 + 260 * n_layers,
        )
        return fig


@torch.no_grad()
def memory_lookup(
    model: HookedDecoder,
    input: AnalysisInput,
    position: int = -1,
    layer: Layers = None,
    k: int = 10,
    *,
    n_tokens: int = 5,
    through_final_norm: bool = False,
) -> MemoryLookup:
    """The memories that fire at `position` of one prompt, ranked by sub-update size |m_i| ||v_i||.

    For each chosen layer (None = all) the top-k neurons, each with its coefficient, its value's
    `n_tokens` most promoted tokens, and its direct effect on the logit of the model's own next-token
    prediction at that position (through the final norm, at this prompt's scale there).
    """
    tokens = as_tokens(model, input)
    if tokens.shape[0] != 1:
        raise ValueError(
            f"memory_lookup takes one prompt, got a batch of {tokens.shape[0]}; pass one string or ids [pos]"
        )
    n_pos = tokens.shape[1]
    if not isinstance(position, int) or not -n_pos <= position < n_pos:
        raise ValueError(f"position {position!r} is outside the prompt's {n_pos} tokens")
    position %= n_pos
    layers = _layer_list(model, layer)
    if not isinstance(k, int) or not 0 < k <= model.cfg.d_mlp:
        raise ValueError(f"k={k!r} must be an integer in [1, d_mlp={model.cfg.d_mlp}]")
    sandwich = model.cfg.norm_placement is NormPlacement.SANDWICH
    post_scales = [act_name("scale", l, "ln2_post") for l in layers] if sandwich else []
    names = [act_name("post", l) for l in layers] + (["ln_final.hook_scale"] if model.cfg.final_norm else []) + post_scales
    logits, cache = model.run_with_cache(tokens, names=names)
    predicted = int(logits[0, position].argmax())
    scale = cache["ln_final.hook_scale"][0, position] if model.cfg.final_norm else torch.ones(1, device=model.device)
    unembed_predicted = model.unembed.W_U[:, predicted].float()  # [d_model]

    coefficients = torch.stack([cache[act_name("post", l)][0, position] for l in layers]).float()
    # what each memory writes per unit coefficient: v_i, or in a sandwich block v_i * ln2_post.w / ln2_post's scale
    # (frozen at this position, so the sub-updates still add up to the block's hook_mlp_out)
    write_scale = (torch.stack([cache[n][0, position, 0] for n in post_scales]).float() if sandwich
                   else torch.ones(len(layers), device=coefficients.device))
    all_neurons = torch.arange(model.cfg.d_mlp)
    value_norms = torch.stack([_value_directions(model, l, all_neurons, through_final_norm=False).norm(dim=-1)
                               for l in layers]) / write_scale[:, None]
    sizes, neurons = (coefficients.abs() * value_norms).topk(k, dim=-1)
    effects, top_ids = [], []
    for li, l in enumerate(layers):
        directions = _value_directions(model, l, neurons[li], through_final_norm=True) / write_scale[li]
        effect = coefficients[li, neurons[li]] * (directions @ unembed_predicted) / scale.float()
        effects.append(effect)
        top_ids.append(_top_value_tokens(model, l, neurons[li], n_tokens, through_final_norm)[1])
    top_ids = torch.stack(top_ids)
    strings = [[token_strings(model, top_ids[li, r].tolist()) for r in range(k)] for li in range(len(layers))]
    return MemoryLookup(
        tokens=tokens[0].cpu(), position=position, layers=layers, coefficients=coefficients.cpu(),
        value_norms=value_norms.cpu(), neurons=neurons.cpu(), sizes=sizes.cpu(),
        prediction_effect=torch.stack(effects).cpu(), top_token_ids=top_ids, top_token_strings=strings,
        predicted_token=predicted, predicted_string=token_strings(model, [predicted])[0],
        token_string=token_strings(model, [int(tokens[0, position])])[0],
    )


def sub_updates(model: HookedDecoder, layer: int, coefficients: torch.Tensor) -> torch.Tensor:
    """[d_mlp d_model]: every memory's sub-update m_i v_i for coefficients [d_mlp] of `layer`."""
    W_out = model.blocks[layer].mlp.W_out.detach()
    return einsum(coefficients.to(W_out), W_out, "d_mlp, d_mlp d_model -> d_mlp d_model")


# ---- top_triggers --------------------------------------------------------------------------------
_EMPTY_DOC = -1  # doc index of an unfilled top-k slot (value -inf)
_PAD = -1  # token id padding a context that starts before its window
MLP_SOURCE = "mlp"  # TopTriggers.source of a scan of FFN neurons (mlp.hook_post)


@dataclass
class TopTriggers:
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
        """One row per filled (layer, neuron, rank); with a model, the prefix and tokens as text too.
        An SAE scan's rows name the feature in a `feature` column where an MLP scan's have `neuron`."""
        filled = (self.docs >= 0).nonzero().tolist()
        rows = []
        for li, ni, r in filled:
            row = {"layer": self.layers[li], self.unit: int(self.neurons[ni]), "rank": r,
                   "activation": float(self.activations[li, ni, r]), "doc": int(self.docs[li, ni, r]),
                   "position": int(self.positions[li, ni, r]), "next_token_id": int(self.next_tokens[li, ni, r])}
            row["doc_name"] = self.doc_names.get(row["doc"], f"doc {row['doc']}")
            if model is not None and model.tokenizer is not None:
                ctx = [t for t in self.contexts[li, ni, r].tolist() if t != _PAD]
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
            ctx = [t for t in self.contexts[li, ni, r].tolist() if t != _PAD]
            strings = token_strings(model, ctx)
            labels.append(f"#{r + 1} {escape_token(strings[-1])}")
            hover.append(f"activation {float(self.activations[li, ni, r]):.5g}<br>doc {int(self.docs[li, ni, r])} "
                         f"pos {int(self.positions[li, ni, r])}<br>…{escape_token(''.join(strings))}")
        fig = go.Figure(go.Bar(x=labels, y=self.activations[li, ni, filled].tolist(), hovertext=hover, hoverinfo="text"))
        if self.source == MLP_SOURCE:
            title, y_title = f"Top triggers of layer {layer} neuron {neuron}", "coefficient m (mlp.hook_post)"
        else:
            hook = escape_token(self.source)
            title, y_title = f"Top triggers of feature {neuron} of the SAE at {hook}", f"feature activation (SAE at {hook})"
        fig.update_layout(title=title, xaxis_title="trigger token", yaxis_title=y_title)
        return fig

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


def _empty_state(n_layers: int, n_neurons: int, k: int, context: int, device) -> dict[str, torch.Tensor]:
    shape = (n_layers, n_neurons, k)
    return dict(
        activations=torch.full(shape, -math.inf, device=device),
        docs=torch.full(shape, _EMPTY_DOC, dtype=torch.long, device=device),
        positions=torch.full(shape, _EMPTY_DOC, dtype=torch.long, device=device),
        contexts=torch.full(shape + (context,), _PAD, dtype=torch.int32, device=device),
        next_tokens=torch.full(shape, -1, dtype=torch.long, device=device),
    )


def _merge_states(
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
    merged = _merge_states([{n: getattr(r, n) for n in names} for r in results], first.k)
    doc_names = {}
    for r in results:
        doc_names.update(r.doc_names)
    return TopTriggers(layers=list(first.layers), neurons=first.neurons.clone(), **merged,
                       n_docs=max(r.n_docs for r in results), n_tokens=sum(r.n_tokens for r in results),
                       complete=all(r.complete for r in results),
                       doc_names=_kept_names(doc_names, merged["docs"]), source=first.source,
                       sae_digest=first.sae_digest)


class _Scanner:
    """The streaming state of one scan: hooks that fold each batch's activations into the top-k.

    Without `sae` it reads mlp.hook_post of each of `layers`; with one it reads the SAE's features
    at its hook point (`layers` is then that point's one entry, see `_sae_layer`)."""

    def __init__(self, model: HookedDecoder, layers: list[int], neurons: torch.Tensor, k: int, context: int,
                 sae: Optional[SparseAutoencoder] = None):
        self.model, self.layers, self.k, self.context, self.sae = model, layers, k, context, sae
        self.neurons = neurons.to(model.device)
        width = model.cfg.d_mlp if sae is None else sae.cfg.d_sae
        self.all_neurons = len(neurons) == width and bool((neurons == torch.arange(len(neurons))).all())
        # the forward runs only as far as the last activation read: through the last chosen layer, or the
        # SAE's block; a point before the blocks needs none of them, one after them (ln_final) the whole model
        if sae is None:
            self.stop_at_layer = max(layers) + 1
        else:
            self.stop_at_layer = layers[0] + 1 if layers[0] >= 0 else _stop_outside_blocks(model, sae.cfg.hook_name)
        empty = _empty_state(1, len(neurons), k, context, model.device)
        self.layer_states = [empty] * len(layers)  # per layer [1 neuron k ...]; replaced, never edited in place
        self.staged: list = []
        self.batch: Optional[dict[str, torch.Tensor]] = None

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return {n: torch.cat([s[n] for s in self.layer_states]) for n in self.layer_states[0]}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.layer_states = [{n: t[li:li + 1].to(self.model.device) for n, t in state.items()}
                             for li in range(len(self.layers))]

    def run(self, tokens: torch.Tensor) -> None:
        """Fold one batch into every layer's top-k, all layers or none: a Ctrl-C during the forward
        leaves the state as it was before the batch, so a resumed scan never counts a window twice."""
        self.staged = list(self.layer_states)
        self.model.run_with_hooks(tokens, fwd_hooks=self.hooks(), stop_at_layer=self.stop_at_layer)
        self.layer_states = self.staged

    def hooks(self):
        if self.sae is not None:
            return [(self.sae.cfg.hook_name, self._sae_hook)]
        return [(act_name("post", l), self._hook(li)) for li, l in enumerate(self.layers)]

    def _hook(self, li: int):
        def fold(post: torch.Tensor, hook) -> None:
            self._fold(li, post)
        return fold

    def _sae_hook(self, activation: torch.Tensor, hook) -> None:
        sae = self.sae
        # only the scanned features: a wide SAE's [batch pos d_sae] would be as large as the activations times d_sae
        ids = self.neurons.to(sae.W_enc.device)
        features = sae.feature_activations(activation.to(sae.W_enc.device), None if self.all_neurons else ids)
        if features.shape != (*self.batch_shape, len(ids)):
            raise ValueError(f"the SAE's features at {sae.cfg.hook_name!r} have shape {tuple(features.shape)}; "
                             f"top_triggers reads one activation vector per position, [batch pos d_sae]")
        self._fold(0, features.to(self.model.device), selected=True)

    def _fold(self, li: int, post: torch.Tensor, selected: bool = False) -> None:
        """`post` [batch pos unit]: every unit, or with `selected` only the scanned ones, in their order."""
        b = self.batch
        acts = post if self.all_neurons or selected else post[..., self.neurons]
        acts = rearrange(acts, "batch pos unit -> (batch pos) unit").float()
        # Only activations above a neuron's current k-th best can enter its top-k (an equal one
        # loses the tie to the earlier document already there). Once the state has filled, few do,
        # and gathering those few is much cheaper than a top-k over the whole batch.
        state = self.layer_states[li]
        above = (acts > state["activations"][0, :, -1]) & b["valid"][:, None]
        counts = above.sum(0)  # [neuron]
        n_above = int(counts.sum())
        if n_above == 0:
            self.staged[li] = state
            return
        if n_above * 16 <= acts.numel():
            values, flat = self._top_sparse(acts, above)
            touched = counts.nonzero().flatten()  # merge only the neurons that gained candidates
            values, flat = values[touched], flat[touched]
        else:
            values, flat = self._top_dense(acts.masked_fill(~b["valid"][:, None], -math.inf))
            touched = None
        empty = ~torch.isfinite(values)
        flat = flat.masked_fill(empty, 0)
        new = dict(
            activations=values[None],
            docs=b["docs"][flat].masked_fill(empty, _EMPTY_DOC)[None],
            positions=b["positions"][flat].masked_fill(empty, _EMPTY_DOC)[None],
            contexts=b["contexts"][flat].masked_fill(empty[..., None], _PAD)[None],
            next_tokens=b["next_tokens"][flat].masked_fill(empty, -1)[None],
        )
        if touched is None:
            self.staged[li] = _merge_states([state, new], self.k, in_corpus_order=True)
        else:
            merged = _merge_states([{n: t[:, touched] for n, t in state.items()}, new], self.k, in_corpus_order=True)
            self.staged[li] = {n: t.index_copy(1, touched, merged[n]) for n, t in state.items()}

    def _top_dense(self, acts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[neuron k] values and row indices of each column's top-k, earliest row first among ties."""
        k = min(self.k, acts.shape[0])
        values, flat = acts.topk(k, dim=0)  # [k neuron]
        # topk breaks ties arbitrarily; where a tie straddles the k-th slot, take the earliest
        # (document, position) ones instead, so every sharding of the corpus keeps the same set
        kth = values[-1]
        straddles = ((acts == kth).sum(0) > (values == kth).sum(0)) & torch.isfinite(kth)
        if bool(straddles.any()):
            cols = straddles.nonzero().flatten()
            order = (-acts[:, cols]).argsort(dim=0, stable=True)[:k]
            flat[:, cols] = order
            values[:, cols] = acts[:, cols].gather(0, order)
        # order equal values by row (= corpus order), as the merge expects
        values, flat = values.T, flat.T
        order = flat.argsort(dim=-1, stable=True)
        order = order.gather(-1, (-values.gather(-1, order)).argsort(dim=-1, stable=True))
        return values.gather(-1, order), flat.gather(-1, order)

    def _top_sparse(self, acts: torch.Tensor, above: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same as _top_dense from the few entries marked `above` (the others cannot enter)."""
        rows, cols = above.nonzero(as_tuple=True)  # row-major: rows ascending within a column
        vals = acts[rows, cols]
        order = (-vals).argsort(stable=True)  # by value, earliest row first among ties
        order = order[cols[order].argsort(stable=True)]  # grouped by neuron, keeping that order
        rows, cols, vals = rows[order], cols[order], vals[order]
        counts = torch.bincount(cols, minlength=acts.shape[1])
        rank = torch.arange(len(cols), device=acts.device) - (counts.cumsum(0) - counts)[cols]
        keep = rank < self.k
        values = torch.full((acts.shape[1], self.k), -math.inf, device=acts.device)
        flat = torch.zeros((acts.shape[1], self.k), dtype=torch.long, device=acts.device)
        values[cols[keep], rank[keep]] = vals[keep]
        flat[cols[keep], rank[keep]] = rows[keep]
        return values, flat

    def set_batch(self, windows: list[tuple[int, int, list[int], list[int]]], bos: Optional[int], pad_id: int,
                  n_pos: int) -> torch.Tensor:
        """Lay out a batch of windows (doc, doc_start, window ids, next ids), right-padded to n_pos
        tokens; right padding needs no attention mask in a causal model."""
        device = self.model.device
        offset = 1 if bos is not None else 0
        n = len(windows)
        tokens = torch.full((n, n_pos), pad_id, dtype=torch.long)
        valid = torch.zeros((n, n_pos), dtype=torch.bool)
        next_ids = torch.full((n, n_pos), -1, dtype=torch.long)
        docs = torch.empty((n, n_pos), dtype=torch.long)
        positions = torch.empty((n, n_pos), dtype=torch.long)
        for row, (doc, start, ids, nxt) in enumerate(windows):
            if bos is not None:
                tokens[row, 0] = bos
            tokens[row, offset:offset + len(ids)] = torch.tensor(ids)
            valid[row, offset:offset + len(ids)] = True
            next_ids[row, offset:offset + len(ids)] = torch.tensor(nxt)
            docs[row] = doc
            positions[row] = torch.arange(n_pos) + start - offset
        # the context of each position: the last `context` tokens of its window up to it, BOS hidden
        shown = tokens.masked_fill(~valid, _PAD).to(torch.int32)
        padded = torch.cat([torch.full((n, self.context - 1), _PAD, dtype=torch.int32), shown], dim=1)
        contexts = padded.unfold(1, self.context, 1)  # [batch pos context]
        flat = lambda t: rearrange(t, "batch pos ... -> (batch pos) ...").to(device)
        self.batch = dict(valid=flat(valid), docs=flat(docs), positions=flat(positions),
                          contexts=flat(contexts.contiguous()), next_tokens=flat(next_ids))
        self.batch_shape = (n, n_pos)
        return tokens.to(device)


def _sae_layer(model: HookedDecoder, hook_name: str) -> int:
    """The index of the block holding the hook point, or -1 for a point outside the blocks. Found by
    the point's identity, so a name the hook point is also known by resolves the same."""
    point = model.hook_point(hook_name)
    for layer, block in enumerate(model.blocks):
        if any(point is module for module in block.modules()):
            return layer
    return -1


def _stop_outside_blocks(model: HookedDecoder, hook_name: str) -> Optional[int]:
    """stop_at_layer for a hook point outside the blocks: 0 for the embeddings, which come before
    every block, else None (the final norm's points come after all of them)."""
    point = model.hook_point(hook_name)
    before = [getattr(model, name, None) for name in ("hook_embed", "hook_pos_embed")]
    return 0 if any(point is p for p in before) else None


def _windows(model: HookedDecoder, corpus: Corpus, window: int, prepend_bos: bool, skip: tuple[int, int],
             rank: int, world: int):
    """(doc index, name, doc_start, ids, next ids) for every window of every document of this rank,
    from token `skip[1]` of document `skip[0]` on. Documents are tokenised a span at a time, so
    memory holds one span's ids however long the document."""
    tokenizer = model._require_tokenizer()
    per_window = window - 1 if prepend_bos else window
    for doc, (name, pieces) in enumerate(_iter_document_pieces(corpus)):
        if doc < skip[0]:
            continue
        if doc % world != rank:
            # read it all the same, so a bad file stops every rank rather than one, which would
            # leave the others waiting for it in the final gather
            for _ in pieces:
                pass
            continue
        to_skip = skip[1] if doc == skip[0] else 0
        ids, start = [], 0  # ids not yet in a window; start: their offset in the document
        for span in _encode_document(tokenizer, pieces):
            if to_skip:
                dropped = min(to_skip, len(span))
                span, to_skip, start = span[dropped:], to_skip - dropped, start + dropped
            ids += span
            i = 0
            while len(ids) - i > per_window:  # a window's last next id is the first id after it
                yield doc, name, start, ids[i:i + per_window], ids[i + 1:i + per_window + 1]
                i, start = i + per_window, start + per_window
            ids = ids[i:]
        if ids:
            yield doc, name, start, ids, ids[1:] + [-1]


@torch.no_grad()
def top_triggers(
    model: HookedDecoder,
    texts: Corpus = None,
    layers: Layers = None,
    neurons: Optional[Sequence[int]] = None,
    k: int = 25,
    *,
    batch_size: int = 8,
    window: Optional[int] = None,
    context: int = 24,
    prepend_bos: bool = True,
    progress: bool = True,
    shard: Optional[tuple[int, int]] = None,
    resume: Optional[TopTriggers] = None,
    save_path: Union[str, os.PathLike, None] = None,
    overwrite: bool = False,
    sae: Optional[SparseAutoencoder] = None,
) -> TopTriggers:
    """Each chosen neuron's k highest coefficients (mlp.hook_post) over every prefix of a corpus.

    `texts` is anything `iter_documents` reads (None = the bundled held-out text). Each document is
    tokenised and cut into windows of at most `window` tokens (default n_ctx), each window starting
    with BOS when `prepend_bos`; BOS positions never count as triggers. The forward stops after the
    last chosen layer, and each layer's activations are folded into a running top-k inside its hook,
    so memory is O(layers x neurons x k) however long the corpus. A file is read and tokenised a
    piece at a time (`analyses.corpus`), so one larger than memory scans too, to the same tokens as
    reading it whole (see `analyses.corpus._cut` for the one exception).

    Ctrl-C stops the scan and returns what was folded so far (`complete=False`, `n_docs` documents
    fully done); `resume=` continues such a result over the same corpus. `save_path` writes the
    result (also a partial one) as safetensors.

    `shard=(i, n)` scans only documents i, i+n, i+2n, ... (indices stay global), for splitting a
    corpus across jobs; `merge` of all n shards equals one scan. Under `torch.distributed` (torchrun)
    the shard is the process's rank, and every rank returns the merged result of all ranks.

    `sae=` (a `probe.SparseAutoencoder`) scans the SAE's features instead: `sae.encode` of the
    activation at `sae.cfg.hook_name`, `neurons` then being feature ids (None = all d_sae) and
    `layers` left None. The forward stops after the hook point's block (before the first block for
    hook_embed and hook_pos_embed; a final-norm point runs it all); everything else is as for
    neurons, and the result's `source` is the hook name (with the SAE's digest). Only the scanned
    features are computed (a TopK SAE computes all, its k largest being the point), batch_size x
    window x features floats at a time: lower batch_size for a wide SAE scanned whole.
    """
    if sae is not None:
        from analyses.features import check_sae, feature_ids  # analyses.features imports this module

        hook_name = check_sae(model, sae)  # an SAE, for a point this model has, and not spliced in
        if layers is not None:
            raise ValueError(f"layers={layers!r}: an SAE scan reads the features at the SAE's hook point "
                             f"{hook_name!r}; leave layers=None")
        layer_ids = [_sae_layer(model, hook_name)]
        neuron_ids = torch.arange(sae.cfg.d_sae) if neurons is None else feature_ids(sae, neurons)
        source = hook_name
    else:
        layer_ids = _layer_list(model, layers)
        neuron_ids = _neuron_tensor(model, neurons)
        source = MLP_SOURCE
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be a positive integer")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        # 0 or 2.5 never equals a batch's length: the whole corpus would go through as one forward
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    window = model.cfg.n_ctx if window is None else window
    if not 1 + prepend_bos <= window <= model.cfg.n_ctx:
        raise ValueError(f"window={window} must be in [{1 + prepend_bos}, n_ctx={model.cfg.n_ctx}]")
    if context < 1:
        raise ValueError(f"context={context} must be at least 1 token")
    if save_path is not None and Path(save_path).exists() and not overwrite:
        raise FileExistsError(f"{save_path} exists; pass overwrite=True to replace it or choose another path")
    tokenizer = model._require_tokenizer()
    dist = _distributed()
    if dist is not None and shard is not None:
        raise ValueError("under torch.distributed each rank is its own shard; leave shard=None")
    if dist is not None and resume is not None:
        raise ValueError("resume= is for single-process scans; resume each rank's shard with shard=(rank, world)")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (shard or (0, 1))
    if not (isinstance(world, int) and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"shard={shard!r} must be (index, count) with 0 <= index < count")

    digest = "" if sae is None else sae.digest()  # after the cheap checks: it reads every weight
    scanner = _Scanner(model, layer_ids, neuron_ids, k, context, sae)
    skip, skip_start, n_tokens, doc_names = 0, 0, 0, {}
    if resume is not None:
        if resume.source != source:
            raise ValueError(f"resume= is a scan of {resume.source!r}, this one of {source!r}: resume the same source")
        if resume.sae_digest != digest:
            raise ValueError("resume= is a scan of another SAE at the same hook point (their weights differ): resume it "
                             "with the SAE it was started with")
        if resume.layers != layer_ids or not torch.equal(resume.neurons, neuron_ids) or resume.k != k \
                or resume.contexts.shape[-1] != context:
            raise ValueError("resume= must be a result of the same layers, neurons, k and context")
        if resume.complete:
            raise ValueError("resume= takes an interrupted scan (complete=False); this one is complete")
        scanner.load({name: getattr(resume, name) for name in scanner.state})
        skip, skip_start = resume.n_docs, resume.resume_start
        n_tokens, doc_names = resume.n_tokens, dict(resume.doc_names)

    from tqdm.auto import tqdm

    bar = tqdm(unit="tok", unit_scale=True, desc="top_triggers", disable=not progress or (dist is not None and rank != 0))
    done_docs, done_start = skip, skip_start  # where the folded windows end: (document, token offset)
    complete = True
    pending: list = []
    bos = tokenizer.bos_id if prepend_bos else None

    def run(batch) -> None:
        nonlocal n_tokens, done_docs, done_start
        scanner.run(scanner.set_batch([(d, s, ids, nxt) for d, _, s, ids, nxt in batch], bos, tokenizer.pad_id, window))
        n_batch = sum(len(w[3]) for w in batch)
        n_tokens += n_batch
        bar.update(n_batch)
        doc, _, start, ids, nxt = batch[-1]
        # a document ends in the window whose last next id is -1
        done_docs, done_start = (doc + 1, 0) if nxt[-1] == -1 else (doc, start + len(ids))

    try:
        for item in _windows(model, texts, window, prepend_bos, (skip, skip_start), rank, world):
            pending.append(item)
            if not item[1].startswith("doc "):  # file names are worth keeping; "doc i" is implied by i
                doc_names[item[0]] = item[1]
            if len(pending) == batch_size:
                run(pending)
                pending = []
        if pending:
            run(pending)
    except KeyboardInterrupt:
        complete = False
        bar.write(f"top_triggers interrupted after {n_tokens} tokens: returning the top-k folded so far "
                  f"({done_docs} documents complete; pass the result as resume= to continue)")
    finally:
        bar.close()

    state = {n: t.cpu() for n, t in scanner.state.items()}
    result = TopTriggers(layers=layer_ids, neurons=neuron_ids, **state, n_docs=done_docs, resume_start=done_start,
                         n_tokens=n_tokens, complete=complete, doc_names=_kept_names(doc_names, state["docs"]),
                         source=source, sae_digest=digest)
    if dist is not None and complete:
        result = _gather(dist, result, world)
    if save_path is not None and (dist is None or rank == 0):
        result.save(save_path, overwrite=overwrite)
    return result


def _kept_names(doc_names: dict[int, str], docs: torch.Tensor) -> dict[int, str]:
    kept = set(docs.unique().tolist())
    return {d: n for d, n in doc_names.items() if d in kept}


def _distributed():
    """torch.distributed when a process group is running (torchrun), else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _gather(dist, result: TopTriggers, world: int) -> TopTriggers:
    """All ranks' top-k merged into one, on every rank (the per-rank states have equal shapes)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    parts = []
    for name in ("activations", "docs", "positions", "contexts", "next_tokens"):
        local = getattr(result, name).to(device).contiguous()
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        parts.append([g.cpu() for g in gathered])
    counts = torch.tensor([result.n_tokens], dtype=torch.long, device=device)
    dist.all_reduce(counts)
    n_docs = torch.tensor([result.n_docs], dtype=torch.long, device=device)
    dist.all_reduce(n_docs, op=dist.ReduceOp.MAX)  # each rank counts up to the last document it scanned
    names_json = json.dumps(result.doc_names)
    # document names travel as bytes in a padded tensor: all_gather_object would pickle
    encoded = torch.tensor(list(names_json.encode()), dtype=torch.uint8, device=device)
    length = torch.tensor([encoded.numel()], device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    longest = int(max(l.item() for l in lengths))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: encoded.numel()] = encoded
    all_names = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(all_names, padded)
    shards = []
    for r in range(world):
        names = {int(d): n for d, n in json.loads(bytes(all_names[r][: int(lengths[r])].tolist()).decode()).items()}
        shards.append(TopTriggers(result.layers, result.neurons, *(p[r] for p in parts), n_docs=0, n_tokens=0,
                                  doc_names=names, source=result.source, sae_digest=result.sae_digest))
    merged = merge(shards)
    merged.n_tokens = int(counts.item())
    merged.n_docs = int(n_docs.item())
    return merged


# ---- agreement -----------------------------------------------------------------------------------
def _require_mlp(triggers: TopTriggers, what: str) -> None:
    """Refuse an SAE scan where FFN value vectors are read: its ids are features, not neurons, and
    its layer may not even be a block (-1)."""
    if triggers.source != MLP_SOURCE:
        raise ValueError(f"{what} reads FFN value vectors (W_out rows) and needs a scan of MLP neurons; this one "
                         f"scanned the features of the SAE at {triggers.source!r} (for what a feature writes, see "
                         "analyses.feature_logits)")


@dataclass
class Agreement:
    """Per layer, how often a memory's top value token is the actual next token after its triggers."""

    layers: list[int]
    matches: torch.Tensor  # [layer]: trigger examples whose next token is the value's top token
    examples: torch.Tensor  # [layer]: trigger examples with a next token
    baseline_matches: torch.Tensor  # [layer]: the same with each neuron's top token taken from another neuron

    @property
    def rate(self) -> torch.Tensor:
        return self.matches / self.examples.clamp(min=1)

    @property
    def baseline_rate(self) -> torch.Tensor:
        return self.baseline_matches / self.examples.clamp(min=1)

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(dict(layer=self.layers, agreement=self.rate.tolist(), matches=self.matches.tolist(),
                                 examples=self.examples.tolist(), baseline=self.baseline_rate.tolist()))

    def figure(self) -> go.Figure:
        x = [f"layer {l}" for l in self.layers]
        fig = go.Figure([
            go.Bar(name="value's top token = next token", x=x, y=self.rate.tolist(),
                   hovertext=[f"{int(m)} of {int(e)} trigger examples" for m, e in zip(self.matches, self.examples)],
                   hoverinfo="text+y"),
            go.Bar(name="baseline: another neuron's top token", x=x, y=self.baseline_rate.tolist(),
                   hovertext=[f"{int(m)} of {int(e)}" for m, e in zip(self.baseline_matches, self.examples)],
                   hoverinfo="text+y"),
        ])
        fig.update_layout(title="Agreement between memories' values and their triggers' next tokens (Geva et al. 2021)",
                          yaxis_title="fraction of trigger examples", barmode="group")
        return fig


@torch.no_grad()
def agreement(model: HookedDecoder, triggers: TopTriggers, *, through_final_norm: bool = False) -> Agreement:
    """Geva's agreement statistic per layer over the trigger examples of `triggers`.

    The baseline pairs each neuron's triggers with the top token of the next scanned neuron's
    value (a cyclic shift), which keeps the token distribution and breaks the neuron's identity.
    """
    _require_mlp(triggers, "agreement")
    matches, examples, baseline = [], [], []
    for li, layer in enumerate(triggers.layers):
        top = _top_value_tokens(model, layer, triggers.neurons, 1, through_final_norm)[1][:, 0]  # [neuron]
        nxt = triggers.next_tokens[li]  # [neuron k]
        has = (nxt >= 0) & (triggers.docs[li] >= 0)
        matches.append(((nxt == top[:, None]) & has).sum())
        baseline.append(((nxt == top.roll(1)[:, None]) & has).sum())
        examples.append(has.sum())
    return Agreement(list(triggers.layers), torch.stack(matches), torch.stack(examples), torch.stack(baseline))


# ---- benchmark and command line ------------------------------------------------------------------
@torch.no_grad()
def benchmark(model: HookedDecoder, texts: Corpus = None, layers: Layers = None, k: int = 25,
              batch_size: int = 8, repeats: int = 1) -> dict[str, float]:
    """Tokens/s of top_triggers against a plain forward pass over the same windows (issue: >= 0.8x)."""
    import time

    tokenizer = model._require_tokenizer()
    window = model.cfg.n_ctx
    items = list(_windows(model, texts, window, True, (0, 0), 0, 1))
    n_tokens = sum(len(w[3]) for w in items)
    batches = [items[i:i + batch_size] for i in range(0, len(items), batch_size)]
    scanner = _Scanner(model, _layer_list(model, layers), torch.arange(model.cfg.d_mlp), k, 24)
    token_batches = [scanner.set_batch([(d, s, ids, n) for d, _, s, ids, n in b], tokenizer.bos_id,
                                       tokenizer.pad_id, window) for b in batches]

    def sync():
        if model.device.type == "cuda":
            torch.cuda.synchronize()

    model(token_batches[0])  # warm-up
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        for tokens in token_batches:
            model(tokens)
    sync()
    forward = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(repeats):
        top_triggers(model, [t for _, t in iter_documents(texts)], layers, k=k, batch_size=batch_size, progress=False)
    sync()
    scan = time.perf_counter() - start
    return dict(tokens=n_tokens * repeats, forward_tokens_per_s=n_tokens * repeats / forward,
                scan_tokens_per_s=n_tokens * repeats / scan, ratio=forward / scan)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analyses.memories",
                                     description="Scan a corpus for each FFN neuron's top-k triggers (torchrun-aware).")
    parser.add_argument("--model", default=None, help="checkpoint directory or hub name (default: the bundled model)")
    parser.add_argument("--revision", default=None, help="a hub branch, tag or commit of --model (e.g. a Pythia step)")
    parser.add_argument("--corpus", default=None,
                        help="a text file or a folder of .txt files (default: the bundled held-out text)")
    parser.add_argument("--layers", type=int, nargs="*", default=None)
    parser.add_argument("--neurons", type=int, nargs="*", default=None, help="neuron ids (with --sae: feature ids)")
    parser.add_argument("--sae", default=None,
                        help="an SAE directory (SAELens format): scan its features at its hook point instead of neurons")
    parser.add_argument("-k", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", required=True, help="output .safetensors path (written by rank 0)")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    if args.sae is not None and args.layers:
        parser.error("--layers does not apply to --sae: the SAE's hook point fixes the layer")

    from probe import DEFAULT_MODEL

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        backend = "nccl" if args.device and args.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend)
        if backend == "nccl":
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(args.device)
    try:
        model = HookedDecoder.from_pretrained(args.model or DEFAULT_MODEL, device=args.device, revision=args.revision).eval()
        sae = None if args.sae is None else SparseAutoencoder.from_pretrained(args.sae, device=model.device)
        result = top_triggers(model, args.corpus, args.layers or None, args.neurons or None, k=args.k,
                              batch_size=args.batch_size, window=args.window, save_path=args.out,
                              overwrite=args.overwrite, sae=sae)
        if not _distributed() or _distributed().get_rank() == 0:
            print(f"scanned {result.n_tokens} tokens; wrote {args.out}")
        if _distributed():
            # every rank waits for the others (rank 0 may still be writing) before tearing the group
            # down: gloo can abort a process whose peer closes its connections mid-exchange. Only on
            # success: after an error the ranks' collectives no longer match, and torchrun stops them.
            _distributed().barrier()
    finally:
        if _distributed():
            _distributed().destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
