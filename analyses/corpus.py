"""Reading and tokenising corpus files, in bounded memory.

A corpus file is read CORPUS_CHUNK_BYTES at a time (`_read_text_pieces`) and each document is
tokenised CORPUS_SPAN_CHARS characters at a time, cut where the tokenizer splits anyway
(`encode_document`), so a file larger than memory gives the token ids of reading it whole (see
`_cut` for the one exception). FFN memory scans (`analyses.memories`) and head pruning
(`analyses.pruning`) both read files through here.
"""
from __future__ import annotations

import codecs
import itertools
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Union

from probe import HELDOUT_TEXT

Corpus = Union[str, os.PathLike, Iterable]

# A corpus file is read this many bytes at a time, and a document tokenised this many characters
# at a time, so a file larger than memory scans in bounded memory (tests set them tiny). The span
# is small because a `tokenizers` encoding costs ~200 bytes a character, and is no faster longer.
CORPUS_CHUNK_BYTES = 1 << 20
CORPUS_SPAN_CHARS = 1 << 16
_ASCII_WHITESPACE = " \t\n\r\x0b\x0c"  # what bytes.strip() strips: an empty file is only these
# characters each side of a candidate cut that must tokenise the same split as joined
_CUT_CHECK = 512
_CUT_TRIES = 32  # candidate cuts of each kind tried per span before cutting blind


def _read_text_pieces(path: Path) -> Iterator[str]:
    """A UTF-8 text file as consecutive pieces, read CORPUS_CHUNK_BYTES at a time when iterated.

    The incremental decoder carries a multi-byte character split between two reads over to the
    next piece, so the pieces join to exactly the decoded file.
    """
    chunk = CORPUS_CHUNK_BYTES
    decoder = codecs.getincrementaldecoder("utf-8")()  # strict: a bad byte raises with its position
    offset = 0  # bytes read before `data`
    held, seen_text = "", False  # leading whitespace waits until the file proves not to be empty
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk)
            final = not data
            nul = data.find(b"\x00")
            if nul >= 0:
                raise ValueError(f"corpus file {path} looks binary (a NUL byte at byte {offset + nul}); "
                                 f"pass UTF-8 text files")
            pending = len(decoder.getstate()[0])  # bytes of a character begun in the previous read
            try:
                text = decoder.decode(data, final=final)
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"corpus file {path} is not UTF-8 text (byte {offset - pending + err.start}: {err.reason}); "
                    f"convert it with `iconv -t utf-8` or pass its decoded text as a string"
                ) from None
            offset += len(data)
            if not seen_text:
                held += text
                seen_text = bool(held.strip(_ASCII_WHITESPACE))
                if not seen_text:
                    if final:
                        raise ValueError(f"corpus file {path} is empty; remove it or pass another file")
                    if len(held) < chunk:
                        continue
                    # more leading whitespace than a chunk: pass it on; an all-whitespace file
                    # then fails at its end rather than holding the whole file here
                text, held = held, ""
            if text:
                yield text
            if final:
                return


def iter_document_pieces(corpus: Corpus = None) -> Iterator[tuple[str, Iterable[str]]]:
    """(name, text pieces) for each document: a file's pieces are read only when iterated."""
    if corpus is None:
        corpus = HELDOUT_TEXT
    if isinstance(corpus, (str, os.PathLike)):
        path = Path(corpus)
        if not path.exists():
            hint = "; to scan a string itself, pass it in a list: [text]" if isinstance(corpus, str) else ""
            raise FileNotFoundError(f"corpus path {str(corpus)[:200]!r} does not exist{hint}")
        if path.is_dir():
            files = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not files:
                raise ValueError(f"corpus folder {path} holds no .txt files")
            for file in files:
                yield str(file.relative_to(path)), _read_text_pieces(file)
        else:
            yield path.name, _read_text_pieces(path)
        return
    if isinstance(corpus, (bytes, bytearray)):
        raise TypeError("the corpus is bytes; decode it to a string and pass [text]")
    try:
        items = iter(corpus)
    except TypeError:
        raise TypeError(
            f"corpus must be a path, a folder, or an iterable of strings, got {type(corpus).__name__}"
        ) from None
    for i, item in enumerate(items):
        if isinstance(item, dict) and "text" in item:  # a Hugging Face dataset row
            item = item["text"]
        if isinstance(item, os.PathLike):
            yield str(item), _read_text_pieces(Path(item))
            continue
        if not isinstance(item, str):
            raise TypeError(f"corpus document {i} is a {type(item).__name__}; documents must be strings or paths")
        if not item:
            raise ValueError(f"corpus document {i} is an empty string; drop it before scanning")
        yield f"doc {i}", (item,)


def check_corpus(corpus: Corpus = None) -> None:
    """Read the corpus's first piece (at most 1 MiB of its first document), so a missing path, an empty or
    binary first file, or a folder without .txt files is named before any work. Later documents are checked
    when the scan reaches them."""
    _, pieces = next(iter_document_pieces(corpus))
    next(iter(pieces), None)


def iter_documents(corpus: Corpus = None) -> Iterator[tuple[str, str]]:
    """(name, text) for each document of a corpus, lazily.

    A corpus is a path (a text file is one document, a folder is its `*.txt` files in sorted
    order), a list or any iterable of strings (each one document) or of paths, or a Hugging Face
    dataset / iterable of dicts with a "text" field. None is the bundled held-out Shakespeare.
    Each text is whole here; `top_triggers` reads files piece by piece instead, in bounded memory.
    """
    for name, pieces in iter_document_pieces(corpus):
        yield name, "".join(pieces)


def _splits_at(tokenizer, text: str, cut: int) -> bool:
    """Whether the tokenizer splits `text` at `cut`: the tokens of the text around the cut equal
    the tokens of its two sides. Byte-level BPE pre-tokenizes with a regex that looks at most a
    few characters past a boundary, so this local test stands for the whole document."""
    left, right = text[max(0, cut - _CUT_CHECK):cut], text[cut:cut + _CUT_CHECK]
    ids = lambda part: tokenizer.encode(part, add_special_tokens=False)
    return ids(left + right) == ids(left) + ids(right)


def _cut(tokenizer, text: str, start: int, end: int) -> int:
    """Where to end the span of `text` that begins at `start` and may reach `end` (< len(text)):
    the last cut before `end` that the tokenizer splits at, trying after a line break first, then
    before a space. A span with neither (a line of CORPUS_SPAN_CHARS characters without a space, or a
    tokenizer that splits nowhere, like one that prepends a space to every text) is cut at `end`,
    and only the tokens at that cut can differ from tokenizing the document whole."""
    for mark, after in (("\n", 1), (" ", 0)):
        i = end
        for _ in range(_CUT_TRIES):
            i = text.rfind(mark, start + 1 - after, i)
            if i < 0:
                break
            if start < i + after <= end and _splits_at(tokenizer, text, i + after):
                return i + after
    return end


def encode_document(tokenizer, pieces: Iterable[str]) -> Iterator[list[int]]:
    """The token ids of a document given as consecutive text pieces, a span of at most
    CORPUS_SPAN_CHARS characters at a time, cut where tokenizing the spans apart gives the ids of
    the whole document (see `_cut`)."""
    limit = CORPUS_SPAN_CHARS
    text, start = "", 0
    for piece in itertools.chain(pieces, (None,)):  # None: the document has ended
        if piece is not None:
            text, start = (text[start:] + piece if start < len(text) else piece), 0  # carried tail + piece
        lookahead = 0 if piece is None else _CUT_CHECK  # so `_splits_at` sees what follows every cut
        while len(text) - start > limit + lookahead:
            cut = _cut(tokenizer, text, start, start + limit)
            yield tokenizer.encode(text[start:cut], add_special_tokens=False)
            start = cut
    if start < len(text):
        yield tokenizer.encode(text[start:], add_special_tokens=False)
