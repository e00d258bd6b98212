"""Scratch buffers that outlive a call, for CPU work whose temporaries are a few MiB each.

glibc gives freed memory at the top of its heap back to the system once more than its trim threshold lies free
(twice the largest block freed so far: a few MiB in a process that has only handled small tensors), so the next
call touches every page of its temporaries afresh, a minor page fault and a zeroed page each. A small-model
EAP-IG call made ~1,460 such faults, ~980 of them in the edge contraction's buffers, about a tenth of its time.

A buffer kept here serves the next request of the same name, whatever shape that needs, while its capacity
suffices. Only CPU memory is kept (CUDA's caching allocator already reuses its blocks), at most LIMIT_BYTES per
thread, and each thread has its own (two threads never share a buffer). The rules for a caller: a name's buffer is
in use by one caller at a time, its contents are whatever was left in it (as torch.empty's are), and neither it nor
a view of it is returned to the caller's own caller. `held()` and `held_bytes()` say what is kept;
`release()` frees it.
"""
from __future__ import annotations

import math
import threading

import torch

LIMIT_BYTES = 32 * 2**20


class _Held(threading.local):
    def __init__(self):
        self.buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}


_HELD = _Held()


def scratch(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of `shape`, from the buffer kept under (`name`, `dtype`) when it is large enough; on
    another device than the CPU, a fresh one."""
    if torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    key = (name, dtype)
    held = _HELD.buffers.get(key)
    if held is None or held.numel() < numel:
        with torch.inference_mode(False):  # kept for callers in and out of inference mode alike
            held = torch.empty(numel, dtype=dtype)
        others = sum(b.numel() * b.element_size() for k, b in _HELD.buffers.items() if k != key)
        if others + held.numel() * held.element_size() <= LIMIT_BYTES:
            _HELD.buffers[key] = held
    return held[:numel].view(shape)


def held() -> list[torch.Tensor]:
    """The buffers this thread keeps (the tensors themselves, flat)."""
    return list(_HELD.buffers.values())


def held_bytes() -> int:
    """Bytes this thread keeps in scratch buffers."""
    return sum(b.numel() * b.element_size() for b in held())


def release() -> None:
    """Free this thread's scratch buffers (later calls allocate them again)."""
    _HELD.buffers.clear()
