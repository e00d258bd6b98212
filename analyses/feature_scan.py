"""One streaming pass of a dictionary's features over a corpus: what a feature dashboard shows.

For each chosen feature of an SAE or transcoder (its activations read at `hook_name`, as `sae.encode`
computes them), over the first `max_tokens` tokens of a corpus:

- the k contexts where it is most active, each with the feature's activation at every token of the
  context (`before` tokens before the trigger and `after` after it, inside the trigger's window);
- its density, the fraction of tokens where it is active (activation > 0), and the mean activation there;
- a histogram of its activations where active, in BINS bins of width w = 2^e, the smallest power of two
  with BINS * w > its largest activation (bins [i w, (i + 1) w)). Bins of a power-of-two width merge
  exactly in pairs when a later batch raises the maximum, so the counts are exact in one pass.

Each document is cut into windows of `window` tokens (BOS first when the tokenizer has one; BOS never
counted). A document's first window counts all its tokens; each later one starts `before` tokens early (at
most half a window, `overlap_of`) and counts only the tokens after those, so every counted token has its
`before` tokens of context inside its own window, as a reader needs them, rather than a window's first
token firing on a context of BOS alone. Memory is O(features x (k x context + BINS)) however long the corpus.
The corpus is read, tokenised and laid out ahead in a background thread (`analyses.prefetch`), and each batch
is folded on the model's device with fixed shapes (`analyses.streaming_topk`): a GPU waits for the host once
per batch, in the forward's check of the token ids.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch

from probe.analyses.common import escape_token, token_decoder
from probe.analyses.corpus import Corpus, iter_documents
from probe.analyses.features import check_sae, feature_ids
from probe.analyses.prefetch import prefetch
from probe.analyses.streaming_topk import candidates, fold
from probe import HookedDecoder, SparseAutoencoder

BINS = 32  # a power of two: the bin width is then 2^e with BINS * 2^e > max read off frexp(max) exactly
_PAD = -1


@dataclass
class FeatureScan:
    """Each scanned feature's top contexts, density and histogram; dimensions `feature k context bin`.
    Slots past a feature's active tokens (fewer than k) have activation 0 and doc -1."""

    hook_name: str
    hook_name_out: Optional[str]  # a transcoder: the point it writes
    features: torch.Tensor  # [feature]
    n_tokens: int  # tokens scanned, BOS not counted
    active: torch.Tensor  # [feature] int64: tokens where the feature is active
    active_sum: torch.Tensor  # [feature] float64: the sum of its activations there
    bin_width: torch.Tensor  # [feature] float64: a power of two (0 for a feature never active)
    histogram: torch.Tensor  # [feature bin] int64: active tokens with activation in [i w, (i + 1) w)
    top_activations: torch.Tensor  # [feature k] float32, largest first (ties: corpus order)
    top_docs: torch.Tensor  # [feature k] int64: document index in corpus order, -1 in an empty slot
    top_positions: torch.Tensor  # [feature k] int64: the trigger's token index in its document (BOS not counted)
    context_ids: torch.Tensor  # [feature k context] int64: the tokens around the trigger, -1 outside its window
    context_activations: torch.Tensor  # [feature k context] float32: the feature there; NaN outside the window
    before: int  # the trigger is context index `before`
    doc_names: dict[int, str]  # index -> name of every document scanned
    context_strings: list[list[list[str]]]  # [feature][k][context]: raw token strings ("" outside the window)

    @property
    def k(self) -> int:
        return self.top_activations.shape[1]

    @property
    def density(self) -> torch.Tensor:
        """[feature] float64: the fraction of scanned tokens where the feature is active."""
        return self.active.double() / max(self.n_tokens, 1)

    @property
    def max_activation(self) -> torch.Tensor:
        """[feature] float32: its largest activation (0 for a feature never active)."""
        return self.top_activations[:, 0]

    def index(self, feature: int) -> int:
        hits = (self.features == feature).nonzero()
        if not len(hits):
            raise ValueError(f"feature {feature} was not scanned; scanned: {self.features.tolist()[:20]}")
        return int(hits[0, 0])

    def select(self, features: Sequence[int]) -> "FeatureScan":
        """The same scan restricted to `features` (scanned ones), in that order."""
        rows = [self.index(int(f)) for f in features]
        index = torch.tensor(rows, dtype=torch.long)
        return dataclasses.replace(
            self, **{name: getattr(self, name)[index] for name in (
                "features", "active", "active_sum", "bin_width", "histogram", "top_activations", "top_docs",
                "top_positions", "context_ids", "context_activations")},
            context_strings=[self.context_strings[r] for r in rows])

    def densities_frame(self) -> pd.DataFrame:
        """One row per feature: tokens scanned, active tokens, density, mean activation when active, maximum."""
        mean = torch.where(self.active > 0, self.active_sum / self.active.clamp(min=1), float("nan"))
        return pd.DataFrame(dict(feature=self.features.tolist(), n_tokens=self.n_tokens, active_tokens=self.active.tolist(),
                                 density=self.density.tolist(), mean_active_activation=mean.tolist(),
                                 max_activation=self.max_activation.tolist()))

    def histogram_frame(self) -> pd.DataFrame:
        """One row per (feature, bin) up to the feature's last non-empty bin: its edges and count."""
        rows = []
        for fi, feature in enumerate(self.features.tolist()):
            counts, width = self.histogram[fi], float(self.bin_width[fi])
            used = int(counts.nonzero().max()) + 1 if bool(counts.any()) else 0
            rows += [(feature, i * width, (i + 1) * width, int(counts[i])) for i in range(used)]
        return pd.DataFrame(rows, columns=["feature", "bin_start", "bin_end", "count"])

    def contexts_frame(self) -> pd.DataFrame:
        """One row per token of each filled top context: the feature, the context's rank (from 1), where it is, the token's
        offset from the trigger (0 = the trigger), id, raw string and the feature's activation there."""
        rows = []
        for fi, feature in enumerate(self.features.tolist()):
            for r in range(self.k):
                doc = int(self.top_docs[fi, r])
                if doc < 0:
                    continue
                base = (feature, r + 1, float(self.top_activations[fi, r]), doc, self.doc_names.get(doc, f"doc {doc}"),
                        int(self.top_positions[fi, r]))
                for c, token in enumerate(self.context_ids[fi, r].tolist()):
                    if token != _PAD:
                        rows.append(base + (c - self.before, token, self.context_strings[fi][r][c],
                                            float(self.context_activations[fi, r, c])))
        return pd.DataFrame(rows, columns=["feature", "rank", "trigger_activation", "doc", "doc_name", "trigger_position",
                                           "offset", "token_id", "token", "activation"])

    def figure(self) -> go.Figure:
        """Each feature as a point: its density (log scale) against its largest activation."""
        live = self.active > 0
        fig = go.Figure(go.Scatter(
            x=self.density[live].tolist(), y=self.max_activation[live].tolist(), mode="markers",
            text=[f"F{f}" for f in self.features[live].tolist()],
            hovertemplate="%{text}<br>density %{x:.3g}<br>max activation %{y:.4g}<extra></extra>"))
        dead = int((~live).sum())
        fig.update_xaxes(type="log", title="density (fraction of tokens where active)")
        fig.update_yaxes(title="largest activation")
        fig.update_layout(title=f"Features at {escape_token(self.hook_name)} over {self.n_tokens} tokens"
                                + (f" ({dead} never active, not shown)" if dead else ""))
        return fig


def _document_ids(tokenizer, text: str, limit: int) -> list[int]:
    """The first `limit` token ids of `text`. A long text is encoded from a prefix first: the ids of a prefix
    agree with the whole text's except near the cut, so a prefix yielding plenty more than `limit` suffices."""
    cut = 8 * limit + 4096
    if len(text) > cut:
        ids = tokenizer.encode(text[:cut], add_special_tokens=False)
        if len(ids) > limit + 64:
            return ids[:limit]
    return tokenizer.encode(text, add_special_tokens=False)[:limit]


def overlap_of(window: int, before: int, bos: bool) -> int:
    """How many tokens each window after a document's first repeats from the one before: `before`, so every
    scanned token has its context in its own window, but at most half the window."""
    return min(before, (window - bos) // 2)


def _windows(model: HookedDecoder, corpus: Corpus, window: int, overlap: int, max_tokens: int
             ) -> Iterator[tuple[int, str, int, int, list[int]]]:
    """(doc index, doc name, offset of the window's first token in the document, how many of its first tokens
    are context only, ids) of every window: a document's first window counts all its tokens, each later one
    repeats the `overlap` tokens before the ones it counts."""
    tokenizer = model.tokenizer
    per_window = window - (tokenizer.bos_id is not None)
    left = max_tokens
    for doc, (name, text) in enumerate(iter_documents(corpus)):
        if left <= 0:
            return
        ids = _document_ids(tokenizer, text, left)
        left -= len(ids)
        yield doc, name, 0, 0, ids[:per_window]
        for start in range(per_window, len(ids), per_window - overlap):  # `start`: the first token counted
            yield doc, name, start - overlap, overlap, ids[start - overlap:start - overlap + per_window]


def _batches(windows: Iterator, batch_size: int, bos: Optional[int], pad_id: int, window: int, pin: bool
             ) -> Iterator[tuple[list, torch.Tensor, int]]:
    """(windows, packed, tokens counted) for every `batch_size` windows of `_windows`: packed [5 window pos] int64
    holds the tokens (right-padded, BOS first when the tokenizer has one), whether each is the document's
    (real), whether it is scanned (counted), its document and its position there; pinned with `pin`."""
    def layout(batch: list) -> tuple[list, torch.Tensor, int]:
        offset = int(bos is not None)
        packed = torch.zeros((5, len(batch), window), dtype=torch.long)
        tokens, real, counted, docs, positions = packed.unbind(0)
        tokens.fill_(pad_id)
        for row, (doc, _, start, lead, chunk) in enumerate(batch):
            if bos is not None:
                tokens[row, 0] = bos
            tokens[row, offset:offset + len(chunk)] = torch.tensor(chunk)
            real[row, offset:offset + len(chunk)] = 1
            counted[row, offset + lead:offset + len(chunk)] = 1
            docs[row], positions[row] = doc, torch.arange(window) + start - offset
        return batch, packed.pin_memory() if pin else packed, int(counted.sum())

    batch = []
    for item in windows:
        batch.append(item)
        if len(batch) == batch_size:
            yield layout(batch)
            batch = []
    if batch:
        yield layout(batch)


def _stop_at_layer(model: HookedDecoder, name: str) -> Optional[int]:
    """Where the forward can stop once `name` has run: after its block, before the blocks for the embeddings,
    never (None) for the final norm's points. Found by the point's identity."""
    point = model.hook_point(name)
    for layer, block in enumerate(model.blocks):
        if any(point is module for module in block.modules()):
            return layer + 1
    before = [getattr(model, attr, None) for attr in ("hook_embed", "hook_pos_embed")]
    return 0 if any(point is p for p in before) else None


class _Folder:
    """The running state of a scan, folded one batch at a time on the device, with fixed shapes only
    (`analyses.streaming_topk`): no step waits for the host."""

    def __init__(self, n: int, k: int, context: int, device):
        self.k, self.context = k, context
        self.active = torch.zeros(n, dtype=torch.long, device=device)
        self.active_sum = torch.zeros(n, dtype=torch.float64, device=device)
        self.exponent = torch.full((n,), -1074, dtype=torch.long, device=device)  # below any float's: nothing seen
        self.histogram = torch.zeros(n, BINS, dtype=torch.long, device=device)
        self.values = torch.zeros(n, k, device=device)
        self.docs = torch.full((n, k), -1, dtype=torch.long, device=device)  # -1: an empty slot
        self.positions = torch.full((n, k), -1, dtype=torch.long, device=device)
        self.ids = torch.full((n, k, context), _PAD, dtype=torch.long, device=device)
        self.acts = torch.full((n, k, context), math.nan, device=device)
        self.neg_inf = torch.full((), -math.inf, device=device)

    def fold(self, acts: torch.Tensor, tokens: torch.Tensor, real: torch.Tensor, counted: torch.Tensor,
             docs: torch.Tensor, positions: torch.Tensor, before: int) -> None:
        """acts [batch pos feature]; the others [batch pos]: `real` the document's tokens (contexts show them),
        `counted` those scanned (BOS, padding and a window's leading context-only tokens are not). The batch
        comes after every token folded before it, and its rows [(batch pos)] are in corpus order."""
        n_pos = acts.shape[1]
        flat = acts.masked_fill(~counted[..., None], 0.0).flatten(0, 1)  # [(batch pos) feature]
        on = flat > 0
        self.active += on.sum(0)
        flat64 = flat.double()
        self.active_sum += flat64.sum(0)
        self._histogram(flat64, on)
        # only an active token can enter: [feature row], written feature-major for the top-k's reads
        x = torch.empty(flat.shape[::-1], dtype=flat.dtype, device=flat.device)
        torch.where(on.T, flat.T, self.neg_inf, out=x)
        kept = torch.where(self.docs >= 0, self.values, -math.inf)
        values, from_kept, index = fold(kept, *candidates(x, self.k), self.k)  # an equal value loses to the kept one
        empty = ~torch.isfinite(values)
        slot = index.clamp(max=self.k - 1)  # the kept slot, where from_kept
        row = torch.where(from_kept | empty, 0, index)  # the batch row, where new
        b, p = row // n_pos, row % n_pos
        at = p[..., None] + torch.arange(self.context, device=acts.device) - before  # [feature k context]
        inside = (at >= 0) & (at < n_pos)
        at = at.clamp(0, n_pos - 1)
        inside &= real[b[..., None], at]
        feature = torch.arange(len(values), device=acts.device)[:, None, None]
        new = dict(values=values, docs=docs[b, p], positions=positions[b, p],
                   ids=torch.where(inside, tokens[b[..., None], at], _PAD),
                   acts=torch.where(inside, acts[b[..., None], at, feature].float(), math.nan))
        for name, blank in (("values", 0.0), ("docs", -1), ("positions", -1), ("ids", _PAD), ("acts", math.nan)):
            old = getattr(self, name)
            pick = from_kept if old.dim() == 2 else from_kept[..., None]
            kept_value = old.gather(1, slot if old.dim() == 2 else slot[..., None].expand(-1, -1, self.context))
            gone = empty if old.dim() == 2 else empty[..., None]
            setattr(self, name, torch.where(pick, kept_value, new[name]).masked_fill(gone, blank))

    def _histogram(self, flat: torch.Tensor, on: torch.Tensor) -> None:
        """Widen each feature's bins to 2^e with BINS * 2^e > the batch's maximum (pairs merge exactly), then count.
        `flat` [(batch pos) feature] float64."""
        top = flat.max(0).values
        needed = torch.where(top > 0, torch.frexp(top).exponent.long() - int(math.log2(BINS)), self.exponent)
        shift = (needed - self.exponent).clamp(0, 62)  # 0: this feature's bins stay
        target = torch.arange(BINS, device=flat.device) >> shift[:, None]  # [feature bin]: old bin i lands in i >> shift
        self.histogram = torch.zeros_like(self.histogram).scatter_add_(1, target, self.histogram)
        self.exponent = torch.maximum(self.exponent, needed)
        width = torch.ldexp(torch.ones_like(self.exponent, dtype=torch.float64), self.exponent)
        # exact: a division by a power of two; a token not active adds 0 to its feature's first bin
        bins = (flat / width).floor_().clamp_(0, BINS - 1).long()
        self.histogram.scatter_add_(1, bins.T, on.T.long())


@torch.no_grad()
def feature_scan(
    model: HookedDecoder,
    sae: SparseAutoencoder,
    corpus: Corpus = None,
    features: Optional[Sequence[int]] = None,
    *,
    k: int = 10,
    max_tokens: int = 1 << 17,
    window: Optional[int] = None,
    batch_size: int = 8,
    before: int = 20,
    after: int = 5,
    progress: bool = True,
) -> FeatureScan:
    """See the module docstring. `corpus` is anything `iter_documents` reads (None = the bundled held-out
    text); `features` None scans all d_sae (a TopK SAE encodes all of them anyway)."""
    name = check_sae(model, sae)
    ids = torch.arange(sae.cfg.d_sae) if features is None else feature_ids(sae, features)
    for value, what, low in ((k, "k", 1), (max_tokens, "max_tokens", 1), (batch_size, "batch_size", 1),
                             (before, "before", 0), (after, "after", 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{what}={value!r} must be an integer >= {low}")
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError("feature_scan reads a text corpus: the model needs a tokenizer")
    bos = tokenizer.bos_id
    window = model.cfg.n_ctx if window is None else window
    if not isinstance(window, int) or not 1 + (bos is not None) <= window <= model.cfg.n_ctx:
        raise ValueError(f"window={window!r} must be an integer in [{1 + (bos is not None)}, n_ctx={model.cfg.n_ctx}]")
    stop = _stop_at_layer(model, name)
    every = len(ids) == sae.cfg.d_sae and bool((ids == torch.arange(len(ids))).all())
    device = model.device
    folder = _Folder(len(ids), k, before + 1 + after, device)
    doc_names: dict[int, str] = {}
    n_tokens = 0

    from tqdm.auto import tqdm

    bar = tqdm(total=max_tokens, unit="tok", unit_scale=True, desc="feature_scan", disable=not progress)

    def run(packed: torch.Tensor, done: int) -> None:
        nonlocal n_tokens
        tokens, real, counted, docs, positions = packed.to(device, non_blocking=True).unbind(0)
        real, counted = real.bool(), counted.bool()
        # right padding: a causal model's real positions never see it, a bidirectional model's are kept from it by
        # the mask (its document's tokens and the BOS); the forward stops after the hook's block
        mask = None
        if model.cfg.bidirectional:
            mask = real.long()
            mask[:, 0] = 1
        _, cache = model.run_with_cache(tokens, attention_mask=mask, names=name, stop_at_layer=stop)
        x = cache[name].to(sae.W_enc.device)
        acts = sae.feature_activations(x, None if every else ids.to(sae.W_enc.device)).float().to(device)
        folder.fold(acts, tokens, real, counted, docs, positions, before)
        n_tokens += done
        bar.update(done)

    windows = _windows(model, corpus, window, overlap_of(window, before, bos is not None), max_tokens)
    # the corpus is read, tokenised and laid out a few batches ahead, in a thread of its own
    batches = prefetch(_batches(windows, batch_size, bos, tokenizer.pad_id, window, device.type == "cuda"))
    try:
        for batch, packed, done in batches:
            doc_names.update((doc, doc_name) for doc, doc_name, *_ in batch)
            run(packed, done)
    finally:
        batches.close()
        bar.close()
    if n_tokens == 0:
        raise ValueError("the corpus holds no tokens to scan")
    decode = token_decoder(model)
    strings = [[["" if t == _PAD else s for t, s in zip(row, decode([max(t, 0) for t in row]))]
                for row in slots] for slots in folder.ids.cpu().tolist()]
    width = torch.where(folder.exponent > -1074, torch.ldexp(torch.ones(len(ids), dtype=torch.float64),
                                                             folder.exponent.cpu()), 0.0)
    return FeatureScan(
        hook_name=name, hook_name_out=sae.cfg.hook_name_out, features=ids,
        n_tokens=n_tokens, active=folder.active.cpu(), active_sum=folder.active_sum.cpu(), bin_width=width,
        histogram=folder.histogram.cpu(), top_activations=folder.values.cpu(), top_docs=folder.docs.cpu(),
        top_positions=folder.positions.cpu(), context_ids=folder.ids.cpu(), context_activations=folder.acts.cpu(),
        before=before, doc_names=doc_names, context_strings=strings,
    )
