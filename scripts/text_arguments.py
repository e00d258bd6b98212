"""The command line's text arguments must be UTF-8: what is wrong with one that is not, naming its flag and byte."""
from __future__ import annotations

import argparse
from typing import Optional


def non_utf8_argument(args: argparse.Namespace) -> Optional[str]:
    """The error for the first text argument that is not UTF-8, or None. Python hands a command-line byte that is
    not over as a lone surrogate (U+DC80 + the byte), which a tokenizer then refuses with a message naming neither
    the flag nor the byte."""
    for dest, value in vars(args).items():
        for text in value if isinstance(value, (list, tuple)) else [value]:
            if not isinstance(text, str):
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                bad = ord(text[err.start])
                shown = f"byte 0x{bad - 0xDC00:02X}" if 0xDC80 <= bad <= 0xDCFF else f"U+{bad:04X}"
                return (f"--{dest.replace('_', '-')} is not UTF-8 text ({shown} at character {err.start}); "
                        "pass it in UTF-8 (e.g. convert it with iconv -t UTF-8)")
    return None
