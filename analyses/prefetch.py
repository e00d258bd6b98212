"""Producing a stream's next items in a background thread while the caller works on the current one.

The corpus scans read and tokenise their corpus, and lay each batch out in (pinned) host memory, ahead of
the forward that consumes it, so a GPU does not wait for the tokenizer. `prefetch(items)` yields exactly
what iterating `items` would, in the same order; it only moves the iterating to another thread.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

_ITEM, _DONE, _ERROR = range(3)
_POLL_S = 0.1  # how often a producer blocked on a full queue looks whether the caller has gone


def prefetch(items: Iterable[T], depth: int = 4) -> Iterator[T]:
    """Iterate `items` in a background thread, at most `depth` items ahead of the caller.

    An exception raised while producing (a bad corpus file, a KeyboardInterrupt raised by a corpus
    generator) is raised here, in the caller, with its original traceback, once the items produced
    before it have been yielded. When the caller stops early (a break, an exception, Ctrl-C, which
    Python delivers to the main thread only), the thread stops after the item it is producing."""
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth={depth!r} must be a positive integer")
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(entry) -> bool:
        while not stop.is_set():
            try:
                ready.put(entry, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        source = iter(items)
        try:
            for item in source:
                if not put((_ITEM, item)):
                    break
            else:
                put((_DONE, None))
        except BaseException as err:  # KeyboardInterrupt too: it belongs to the caller
            put((_ERROR, err))
        finally:
            close = getattr(source, "close", None)
            if close is not None:  # a generator left early releases what it holds (an open corpus file) here
                close()

    thread = threading.Thread(target=produce, name="probe-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = ready.get()
            if kind == _ITEM:
                yield value
            elif kind == _DONE:
                return
            else:
                raise value
    finally:
        stop.set()
        thread.join(timeout=5 * _POLL_S)  # a producer inside a slow read finishes that read alone (daemon)
