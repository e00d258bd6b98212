"""Strict hook-name lookup with suggestions."""
from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Union

# what selects hook points: a name, a list of names, or a predicate on names
NameFilter = Union[str, Sequence[str], Callable[[str], bool]]


class UnknownNameError(KeyError):
    """A name that is not a hook point (or not in a cache); the message lists the closest valid names."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


def unknown_name_error(name: str, valid: Sequence[str], what: str = "hook point") -> UnknownNameError:
    valid = list(valid)
    close = difflib.get_close_matches(str(name), valid, n=5, cutoff=0.5)
    hint = f"closest valid names: {', '.join(close)}" if close else f"{len(valid)} valid names, e.g. {', '.join(valid[:5])}"
    return UnknownNameError(f"unknown {what} {name!r}; {hint}")
