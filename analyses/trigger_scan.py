"""`top_triggers`: every chosen FFN neuron's (or SAE feature's) top-k activating prefixes over a corpus, streamed.

The corpus is cut into windows (`scan_windows`) and batches (`scan_batches`) in a background thread,
folded batch by batch into a running top-k on the device (`analyses.trigger_scanner`), interruptible and
resumable, sharded or run under torch.distributed (the ranks' results gathered and merged,
`analyses.trigger_results.merge`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from probe.analyses.corpus import Corpus, encode_document, iter_document_pieces
from probe.analyses.sae_checks import check_sae, feature_ids
from probe.analyses.memory_units import Layers, layer_list, neuron_tensor
from probe.analyses.trigger_results import MLP_SOURCE, TopTriggers, kept_names, merge
from probe.analyses.prefetch import prefetch
from probe.analyses.trigger_scanner import Scanner, layout_windows, sae_layer
from probe import HookedDecoder, SparseAutoencoder


def scan_windows(model: HookedDecoder, corpus: Corpus, window: int, prepend_bos: bool, skip: tuple[int, int],
                 rank: int, world: int):
    """(doc index, name, doc_start, ids, next ids) for every window of every document of this rank,
    from token `skip[1]` of document `skip[0]` on. Documents are tokenised a span at a time, so
    memory holds one span's ids however long the document."""
    tokenizer = model._require_tokenizer()
    per_window = window - 1 if prepend_bos else window
    for doc, (name, pieces) in enumerate(iter_document_pieces(corpus)):
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
        for span in encode_document(tokenizer, pieces):
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


def scan_batches(windows, batch_size: int, bos: Optional[int], pad_id: int, n_pos: int, pin: bool):
    """(windows, packed host tensor) for every `batch_size` windows of `scan_windows` (the last batch may be
    shorter), laid out by `layout_windows`. A partial batch at an exception is dropped with it, as when
    the windows are batched in the loop that folds them."""
    batch = []
    for item in windows:
        batch.append(item)
        if len(batch) == batch_size:
            yield batch, layout_windows([(d, s, ids, nxt) for d, _, s, ids, nxt in batch], bos, pad_id, n_pos, pin)
            batch = []
    if batch:
        yield batch, layout_windows([(d, s, ids, nxt) for d, _, s, ids, nxt in batch], bos, pad_id, n_pos, pin)


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
    last chosen layer, and each layer's activations are folded into a running top-k on the model's
    device (`analyses.streaming_topk`), so memory is O(layers x neurons x k) however long the corpus,
    and a GPU waits for the host once per batch (the forward's check of the token ids). The corpus is
    read, tokenised and laid out a few batches ahead in a background thread (`analyses.prefetch`), a
    file a piece at a time (`analyses.corpus`), so one larger than memory scans too, to the same tokens
    as reading it whole (see `analyses.corpus._cut` for the one exception).

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
        hook_name = check_sae(model, sae)  # an SAE, for a point this model has, and not spliced in
        if layers is not None:
            raise ValueError(f"layers={layers!r}: an SAE scan reads the features at the SAE's hook point "
                             f"{hook_name!r}; leave layers=None")
        layer_ids = [sae_layer(model, hook_name)]
        neuron_ids = torch.arange(sae.cfg.d_sae) if neurons is None else feature_ids(sae, neurons)
        source = hook_name
    else:
        layer_ids = layer_list(model, layers, "top_triggers of FFN neurons (no sae=)")
        neuron_ids = neuron_tensor(model, neurons)
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
    dist = distributed()
    if dist is not None and shard is not None:
        raise ValueError("under torch.distributed each rank is its own shard; leave shard=None")
    if dist is not None and resume is not None:
        raise ValueError("resume= is for single-process scans; resume each rank's shard with shard=(rank, world)")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (shard or (0, 1))
    if not (isinstance(world, int) and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"shard={shard!r} must be (index, count) with 0 <= index < count")

    digest = "" if sae is None else sae.digest()  # after the cheap checks: it reads every weight
    scanner = Scanner(model, layer_ids, neuron_ids, k, context, sae)
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

    shown = progress and (dist is None or rank == 0)
    total = _scan_total(model, texts, window, prepend_bos, (skip, skip_start), rank, world) if shown else None
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc="top_triggers", disable=not shown)
    done_docs, done_start = skip, skip_start  # where the folded windows end: (document, token offset)
    complete = True
    bos = tokenizer.bos_id if prepend_bos else None

    def run(batch, packed) -> None:
        nonlocal n_tokens, done_docs, done_start
        state = scanner.folded(scanner.send(packed, bos is not None))
        for doc, name, *_ in batch:
            if not name.startswith("doc "):  # file names are worth keeping; "doc i" is implied by i
                doc_names[doc] = name
        n_batch = sum(len(w[3]) for w in batch)
        doc, _, start, ids, nxt = batch[-1]
        # a document ends in the window whose last next id is -1
        done = (doc + 1, 0) if nxt[-1] == -1 else (doc, start + len(ids))
        # one statement without a call: a Ctrl-C (or SIGTERM) lands before or after it, so the state and
        # the count of what it holds never disagree, and a resumed scan never counts a window twice
        scanner.state, n_tokens, (done_docs, done_start) = state, n_tokens + n_batch, done
        bar.update(n_batch)

    windows = scan_windows(model, texts, window, prepend_bos, (skip, skip_start), rank, world)
    # the corpus is read, tokenised and laid out a few batches ahead, in a thread of its own
    batches = prefetch(scan_batches(windows, batch_size, bos, tokenizer.pad_id, window, scanner.pin()))
    try:
        for batch, packed in batches:
            run(batch, packed)
    except KeyboardInterrupt:
        complete = False
        bar.write(f"top_triggers interrupted after {n_tokens} tokens: returning the top-k folded so far "
                  f"({done_docs} documents complete; pass the result as resume= to continue)")
    finally:
        batches.close()
        bar.close()

    state = {n: t.cpu() for n, t in scanner.state.items()}
    result = TopTriggers(layers=layer_ids, neurons=neuron_ids, **state, n_docs=done_docs, resume_start=done_start,
                         n_tokens=n_tokens, complete=complete, doc_names=kept_names(doc_names, state["docs"]),
                         source=source, sae_digest=digest)
    if dist is not None and complete:
        result = _gather(dist, result, world)
    if save_path is not None and (dist is None or rank == 0):
        result.save(save_path, overwrite=overwrite)
    return result


# a corpus up to this many bytes (or characters) is tokenised once more before a scan, for the progress
# bar's total and ETA: tokenising costs a few percent of the forwards; a larger corpus scans without a total
SCAN_COUNT_LIMIT = 64 << 20


def _scan_total(model: HookedDecoder, corpus: Corpus, window: int, prepend_bos: bool, skip: tuple[int, int],
                rank: int, world: int) -> Optional[int]:
    """How many tokens the scan will fold (as its bar counts them), when the corpus can be read twice and is
    at most SCAN_COUNT_LIMIT: a path, a folder, or a list/tuple of strings and paths; else None."""
    from probe import HELDOUT_TEXT

    def size(item) -> Optional[int]:
        if isinstance(item, (str, os.PathLike)) and (item is corpus or isinstance(item, os.PathLike)):
            path = Path(item)
            files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
            return sum(f.stat().st_size for f in files if f.is_file())
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            return len(item["text"])
        return len(item) if isinstance(item, str) else None

    corpus = HELDOUT_TEXT if corpus is None else corpus
    try:
        sizes = [size(corpus)] if isinstance(corpus, (str, os.PathLike)) else \
            [size(item) for item in corpus] if isinstance(corpus, (list, tuple)) else [None]
    except OSError:
        return None  # the scan itself names the problem
    if None in sizes or sum(sizes) > SCAN_COUNT_LIMIT:
        return None
    return sum(len(w[3]) for w in scan_windows(model, corpus, window, prepend_bos, skip, rank, world))



def distributed():
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
