"""The corpus scans feed a GPU without waiting on it (issue 21): at most one host synchronisation per batch, and
the corpus read, tokenised and laid out in a background thread (`analyses.prefetch`) in the order it would be.

There is no GPU here, so a synchronisation is counted by what would cause one: an operator that reads a device
value back to the host (`aten._local_scalar_dense`, behind `.item()`, `int()`, `bool()`), one whose output shape
depends on the data (`nonzero`, boolean indexing, `unique`, ...), and the Tensor methods that copy to the host
(`.tolist()`, `.numpy()`, `.cpu()`). Operators are seen by a TorchDispatchMode, which is thread-local: the
background thread's work on host tensors (what stays on the host in a GPU run too) is not counted; the methods
are counted on the calling thread only. A deliberate `.item()` per layer shows the counter can fail.
"""
from __future__ import annotations

import importlib
import math
import threading
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from probe.analyses import feature_scan, top_triggers
from probe.analyses.prefetch import prefetch
from probe.analyses.streaming_topk import candidates, fold
from probe.analyses.trigger_scan import scan_batches, scan_windows
from probe.analyses.trigger_scanner import Scanner, layout_windows
from test_memories import CORPUS
from test_sae import random_sae

feature_scan_module = importlib.import_module("probe.analyses.feature_scan")  # the package's attribute is the function

# operators that make the host wait for the device (or size their output from its data)
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
            "unique_consecutive", "bincount", "equal", "allclose", "is_nonzero", "item", "histc"}
COPY_METHODS = ("tolist", "numpy", "cpu")


class SyncCounter(TorchDispatchMode):
    """Records, in order, each would-be synchronisation on this thread and each `mark()`."""

    def __init__(self):
        super().__init__()
        self.events: list[str] = []
        self.thread = threading.current_thread()
        self.saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in _flat(args[1]))
        if name in SYNC_OPS or bool_index:
            self.events.append(name)
        return func(*args, **(kwargs or {}))

    def mark(self) -> None:
        self.events.append("|")

    def per_batch(self) -> list[list[str]]:
        """The events between consecutive marks."""
        cuts = [i for i, e in enumerate(self.events) if e == "|"]
        return [self.events[a + 1:b] for a, b in zip(cuts, cuts[1:])]

    def __enter__(self):
        for method in COPY_METHODS:
            original = getattr(torch.Tensor, method)
            self.saved[method] = torch.Tensor.__dict__.get(method)  # None: inherited from torch._C.TensorBase

            def counted(tensor, *args, _original=original, _method=method, **kwargs):
                if threading.current_thread() is self.thread:
                    self.events.append(_method)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, method, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for method, own in self.saved.items():
            if own is None:
                delattr(torch.Tensor, method)
            else:
                setattr(torch.Tensor, method, own)
        return super().__exit__(*exc)


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


def marked(monkeypatch, counter: SyncCounter, owner, name: str, before: bool = True):
    """Mark the counter when `owner.name` is entered (or, with before=False, when it returns)."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if before:
            counter.mark()
        out = original(*args, **kwargs)
        if not before:
            counter.mark()
        return out

    monkeypatch.setattr(owner, name, wrapper)


def scan_syncs(monkeypatch, model, extra_hooks=(), **args) -> list[list[str]]:
    """The would-be synchronisations of each batch of a trigger scan: from a batch's send to the device to
    the next one's, the last up to the end of its fold."""
    counter = SyncCounter()
    marked(monkeypatch, counter, Scanner, "send")
    marked(monkeypatch, counter, Scanner, "folded", before=False)
    with model.hooks(list(extra_hooks)), counter:
        top_triggers(model, CORPUS, progress=False, **args)
    # marks: send, fold end, send, fold end, ...: a batch is from its send to the next send (the last: its fold's end)
    cuts = [i for i, e in enumerate(counter.events) if e == "|"]
    starts, end = cuts[0::2], cuts[-1]
    return [[e for e in counter.events[a + 1:b] if e != "|"] for a, b in zip(starts, starts[1:] + [end])]


@pytest.mark.parametrize("args", [
    dict(layers=[0, 1], neurons=None, k=5, batch_size=2),  # every neuron of two layers
    dict(layers=[1, 0], neurons=[3, 40, 200], k=30, batch_size=1),  # a subset, k above some windows' length
])
def test_the_trigger_scan_synchronises_at_most_once_per_batch(tiny_model, monkeypatch, args):
    batches = scan_syncs(monkeypatch, tiny_model, **args)
    assert len(batches) >= 4, "the scan should take several batches"
    assert max(map(len, batches)) <= 1, batches
    assert sum(map(len, batches)) >= 1  # the forward's check of the token ids reads two numbers back, once


def test_the_counter_catches_a_read_back_per_layer(tiny_model, monkeypatch):
    """The oracle for the counter: an `.item()` in each layer's hook is counted in every batch, and so is a
    `.tolist()`, which no operator records."""
    def read_one(post, hook):
        post[0, 0, 0].item()

    def list_two(post, hook):
        post[0, 0, :2].tolist()

    reads = [(f"blocks.{l}.mlp.hook_post", read_one) for l in (0, 1)]
    batches = scan_syncs(monkeypatch, tiny_model, reads, layers=[0, 1], neurons=[3, 4], k=3, batch_size=2)
    assert all(b.count("_local_scalar_dense") == 2 for b in batches) and min(map(len, batches)) == 3
    listed = [("blocks.1.mlp.hook_post", list_two)]
    batches = scan_syncs(monkeypatch, tiny_model, listed, layers=[1], neurons=[3], k=3, batch_size=2)
    assert all(b.count("tolist") == 2 for b in batches)  # the hook's and the token check's


def test_the_sae_trigger_scan_synchronises_at_most_once_per_batch(tiny_model, monkeypatch):
    for architecture in ("standard", "topk", "jumprelu"):
        sae = random_sae(architecture, hook="blocks.1.hook_resid_pre", seed=2)
        batches = scan_syncs(monkeypatch, tiny_model, k=4, batch_size=2, neurons=[1, 5, 9], sae=sae)
        assert len(batches) >= 4 and max(map(len, batches)) <= 1, (architecture, batches)


def test_the_feature_scan_synchronises_at_most_once_per_batch(tiny_model, monkeypatch):
    counter = SyncCounter()
    marked(monkeypatch, counter, tiny_model, "run_with_cache")
    marked(monkeypatch, counter, feature_scan_module._Folder, "fold", before=False)
    with counter:
        feature_scan(tiny_model, random_sae(seed=5), CORPUS, None, k=4, window=16, batch_size=2, progress=False)
    cuts = [i for i, e in enumerate(counter.events) if e == "|"]
    batches = [counter.events[a + 1:b] for a, b in zip(cuts[0::2], cuts[1::2])]  # each forward to its fold's end
    assert len(batches) >= 4 and max(map(len, batches)) <= 1, batches
    between = [counter.events[a + 1:b] for a, b in zip(cuts[1::2], cuts[2::2])]  # a fold's end to the next forward
    assert not any(between), between


# ---- the running top-k -----------------------------------------------------------------------------
@pytest.mark.parametrize("k, n_rows", [(1, 7), (4, 9), (6, 3), (8, 40)])
def test_the_running_top_k_equals_sorting_everything_seen(k, n_rows):
    """Batches of small integers (ties everywhere, also straddling the k-th slot) with masked (-inf) entries,
    folded one by one: each unit's kept (value, row) equal sorting all it saw by (value desc, row asc)."""
    gen = torch.Generator().manual_seed(100 * k + n_rows)
    n_units, n_batches = 5, 6
    kept, kept_rows = torch.full((n_units, k), -math.inf), torch.full((n_units, k), -1)
    seen = [[] for _ in range(n_units)]
    for b in range(n_batches):
        x = torch.randint(0, 4, (n_units, n_rows), generator=gen).float()
        x[torch.rand(x.shape, generator=gen) < 0.25] = -math.inf
        x[0, :] = 2.0  # one unit all tied
        values, from_kept, index = fold(kept, *candidates(x, k), k)
        rows = torch.where(from_kept, kept_rows.gather(1, index.clamp(max=k - 1)), index + b * n_rows)
        kept, kept_rows = values, torch.where(torch.isfinite(values), rows, -1)
        for u in range(n_units):
            seen[u] += [(v, b * n_rows + r) for r, v in enumerate(x[u].tolist()) if v > -math.inf]
    for u in range(n_units):
        best = sorted(seen[u], key=lambda e: (-e[0], e[1]))[:k]
        best += [(-math.inf, -1)] * (k - len(best))
        assert list(zip(kept[u].tolist(), kept_rows[u].tolist())) == best, u


# ---- the background thread ------------------------------------------------------------------------
def test_prefetched_batches_are_the_synchronous_ones_in_order(tiny_model):
    """The thread's batches equal laying the windows out in the loop, one by one, in corpus order."""
    windows = list(scan_windows(tiny_model, CORPUS, 12, True, (0, 0), 0, 1))
    tok = tiny_model.tokenizer
    got = list(prefetch(scan_batches(iter(windows), 3, tok.bos_id, tok.pad_id, 12, False), depth=2))
    expected = [windows[i:i + 3] for i in range(0, len(windows), 3)]
    assert [batch for batch, _ in got] == expected
    for (_, packed), batch in zip(got, expected):
        # by hand: BOS, the ids, padding; the next ids, -1 after them; then doc, offset, length
        for row, (doc, _, start, ids, nxt) in zip(packed.tolist(), batch):
            assert row[:12] == [tok.bos_id] + ids + [tok.pad_id] * (11 - len(ids))
            assert row[12:24] == [-1] + nxt + [-1] * (11 - len(nxt))
            assert row[24:] == [doc, start, len(ids)]
    assert torch.equal(got[0][1], layout_windows([(d, s, i, n) for d, _, s, i, n in expected[0]], tok.bos_id,
                                                 tok.pad_id, 12))


def test_prefetch_keeps_order_and_raises_the_producers_error_in_the_caller():
    def items():
        yield from range(50)
        raise OSError("disk gone at item 50")

    seen = []
    with pytest.raises(OSError, match="disk gone at item 50") as info:
        for item in prefetch(items(), depth=3):
            seen.append(item)
    assert seen == list(range(50))  # everything before the error, in order
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "items" in frames  # the original traceback, down to the line that raised
    with pytest.raises(ValueError, match="depth=0"):
        next(prefetch([], depth=0))


def test_prefetch_stops_its_thread_when_the_caller_stops():
    produced = []

    def items():
        for i in range(10_000):
            produced.append(i)
            yield i

    stream = prefetch(items(), depth=2)
    assert [next(stream) for _ in range(3)] == [0, 1, 2]
    stream.close()
    assert not [t for t in threading.enumerate() if t.name == "probe-prefetch"]  # joined
    assert len(produced) <= 3 + 2 + 1  # what was yielded, what the queue holds, the one in the producer's hand


def test_an_error_in_the_corpus_surfaces_in_the_scan(tiny_model):
    def corpus():
        yield CORPUS[0]
        yield CORPUS[1]
        raise RuntimeError("the corpus reader broke")

    with pytest.raises(RuntimeError, match="the corpus reader broke"):
        top_triggers(tiny_model, corpus(), layers=[0], neurons=[1], k=2, progress=False)
    with pytest.raises(RuntimeError, match="the corpus reader broke"):
        feature_scan(tiny_model, random_sae(seed=5), corpus(), [1], k=2, progress=False)
