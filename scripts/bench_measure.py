"""Measuring a workload's cases: round-robin timing (median), peak memory above a clean baseline,
and the bytes a returned cache holds."""
from __future__ import annotations

import ctypes
import gc
import math
import statistics
import time
from typing import Any, Callable, Optional, Sequence

from probe.cli.bench_harness import Case, mib


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _timed_call(run: Callable[[], Any], device: str, calls: int) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        out = run()
        del out
    _sync(device)
    return (time.perf_counter() - start) / calls


def _proc_status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def _release_free_memory() -> None:
    from probe.analyses import scratch

    scratch.release()  # the buffers a call keeps for its next call count in its own peak
    gc.collect()
    try:  # glibc keeps freed heap pages; hand them back so the next call's rise is its own
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_extra_bytes(run: Callable[[], Any], device: str) -> tuple[Optional[int], Any]:
    """(peak memory above the starting point during one call, what the call returned)."""
    if device.startswith("cuda"):
        import torch

        _release_free_memory()
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, out
    _release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set (Linux >= 4.0)
        base = _proc_status_kib("VmRSS")
    except OSError:
        return None, run()  # not Linux: time only
    out = run()
    return (_proc_status_kib("VmHWM") - base) * 1024, out


def _storage_key(t) -> tuple:
    storage = t.untyped_storage()
    return storage.device.type, storage.data_ptr()


def unique_storage_bytes(tensors, exclude=()) -> int:
    """Memory the tensors hold: each underlying storage counted once (views and aliases share one),
    leaving out the storages of the tensors in `exclude`."""
    skip = {_storage_key(t) for t in exclude}
    seen: dict[tuple, int] = {}
    for t in tensors:
        key = _storage_key(t)
        if key not in skip:
            seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


def cache_stats(out: Any) -> tuple[Optional[int], Optional[int]]:
    """(bytes held, entries) of the cache in a `(logits, cache)` pair or transformers' hidden states.
    A cache entry that is the returned logits (transformer-lens caches `hook_unembed`) costs nothing
    beyond what a plain forward returns, so its storage is not the cache's."""
    import torch

    if isinstance(out, tuple) and len(out) == 2 and not isinstance(out[1], torch.Tensor):
        cache = out[1]
        tensors = [cache[name] for name in cache.keys()]
        return unique_storage_bytes(tensors, exclude=[out[0]]), len(tensors)
    hidden = getattr(out, "hidden_states", None)
    if hidden is not None:
        return unique_storage_bytes(hidden, exclude=[out.logits]), len(hidden)
    return None, None


def measure(cases: Sequence[Case], device: str, repeats: int, min_run_s: float, log=print) -> list[dict]:
    """Warm every case up, time the timed ones round-robin (median of `repeats` runs), then measure memory."""
    calls: dict[str, int] = {}
    for case in cases:
        warm = _timed_call(case.run, device, 1)
        calls[case.label] = max(1, min(1000, math.ceil(min_run_s / max(warm, 1e-6))))  # short calls run in loops
        log(f"  warm-up {case.label}: {warm:.4f} s -> {calls[case.label]} call(s) per run")
    times: dict[str, list[float]] = {case.label: [] for case in cases}
    for _ in range(repeats):
        for case in cases:
            if case.timed:
                times[case.label].append(_timed_call(case.run, device, calls[case.label]))
    gc.collect()
    gc.freeze()  # the models and libraries live on: later collections need only scan what a call left behind
    try:
        rows = []
        for case in cases:
            peak, out = peak_extra_bytes(case.run, device)
            cache_bytes, entries = cache_stats(out)
            del out
            samples = times[case.label]
            rows.append(dict(
                case=case.label, library=case.library, ratio_to=case.ratio_to,
                median_s=statistics.median(samples) if samples else None, min_s=min(samples) if samples else None,
                runs=len(samples), calls_per_run=calls[case.label] if samples else 0,
                peak_extra_bytes=peak, cache_bytes=cache_bytes, cache_entries=entries, note=case.note,
            ))
            log(f"  {case.label}: median {rows[-1]['median_s']} s, peak +{mib(peak)}")
    finally:
        gc.unfreeze()
    return rows


