"""The streaming state of one top-trigger scan: forward hooks that fold each batch into a running top-k."""
from __future__ import annotations

import math
from typing import Optional

import torch
from einops import rearrange

from analyses.trigger_results import EMPTY_DOC, PAD, empty_state, merge_states
from probe import HookedDecoder, SparseAutoencoder
from probe.names import act_name


class Scanner:
    """The streaming state of one scan: hooks that fold each batch's activations into the top-k.

    Without `sae` it reads mlp.hook_post of each of `layers`; with one it reads the SAE's features
    at its hook point (`layers` is then that point's one entry, see `sae_layer`)."""

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
            self.stop_at_layer = layers[0] + 1 if layers[0] >= 0 else stop_outside_blocks(model, sae.cfg.hook_name)
        empty = empty_state(1, len(neurons), k, context, model.device)
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
            docs=b["docs"][flat].masked_fill(empty, EMPTY_DOC)[None],
            positions=b["positions"][flat].masked_fill(empty, EMPTY_DOC)[None],
            contexts=b["contexts"][flat].masked_fill(empty[..., None], PAD)[None],
            next_tokens=b["next_tokens"][flat].masked_fill(empty, -1)[None],
        )
        if touched is None:
            self.staged[li] = merge_states([state, new], self.k, in_corpus_order=True)
        else:
            merged = merge_states([{n: t[:, touched] for n, t in state.items()}, new], self.k, in_corpus_order=True)
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
        shown = tokens.masked_fill(~valid, PAD).to(torch.int32)
        padded = torch.cat([torch.full((n, self.context - 1), PAD, dtype=torch.int32), shown], dim=1)
        contexts = padded.unfold(1, self.context, 1)  # [batch pos context]
        flat = lambda t: rearrange(t, "batch pos ... -> (batch pos) ...").to(device)
        self.batch = dict(valid=flat(valid), docs=flat(docs), positions=flat(positions),
                          contexts=flat(contexts.contiguous()), next_tokens=flat(next_ids))
        self.batch_shape = (n, n_pos)
        return tokens.to(device)


def sae_layer(model: HookedDecoder, hook_name: str) -> int:
    """The index of the block holding the hook point, or -1 for a point outside the blocks. Found by
    the point's identity, so a name the hook point is also known by resolves the same."""
    point = model.hook_point(hook_name)
    for layer, block in enumerate(model.blocks):
        if any(point is module for module in block.modules()):
            return layer
    return -1


def stop_outside_blocks(model: HookedDecoder, hook_name: str) -> Optional[int]:
    """stop_at_layer for a hook point outside the blocks: 0 for the embeddings, which come before
    every block, else None (the final norm's points come after all of them)."""
    point = model.hook_point(hook_name)
    before = [getattr(model, name, None) for name in ("hook_embed", "hook_pos_embed")]
    return 0 if any(point is p for p in before) else None
