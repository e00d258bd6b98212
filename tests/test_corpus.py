"""probe.analyses.corpus: a corpus file read a chunk at a time and tokenised a span at a time gives the
tokens of reading it whole, for both of its users (FFN memory scans and head pruning).

The oracle throughout is the tokenizer run on the whole file's text at once (its bytes decoded,
then `encode`), and for pruning the BOS windows cut by hand from that token stream.
"""
from __future__ import annotations

import builtins

import pytest
import torch

from probe.analyses import corpus, head_importance, iter_documents, memories, token_batches

LONG_WORD = "the" * 100  # one word longer than a span, so cut blind, inside a token ("th|e")


def _long_text(n: int = 60) -> str:
    """Lines of every kind a cut meets: LF and CRLF endings, blank lines, indentation, tabs,
    contractions, markup, 2-, 3- and 4-byte characters, and lines longer than the spans."""
    lines = []
    for i in range(n):
        lines.append(f"{i}. The quick brown fox's café jumps over 日本 the lazy 😀 dog, and the dog sleeps on.")
        lines.append("" if i % 3 else "   indented\tline <b>with</b> markup ")
        if i % 7 == 0:
            lines.append("To be, or not to be, that is the question: " * 6)  # longer than a span
        if i % 5 == 0:
            lines.append(LONG_WORD)
    half = len(lines) // 2
    return "\r\n".join(lines[:half]) + "\r\n" + "\n".join(lines[half:]) + "\n"


def _tiny_chunks(monkeypatch, read: int = 64, span: int = 200) -> None:
    monkeypatch.setattr(corpus, "CORPUS_CHUNK_BYTES", read)
    monkeypatch.setattr(corpus, "CORPUS_SPAN_CHARS", span)


class SpyFile:
    """A file whose reads are recorded in `reads`."""

    def __init__(self, f, reads: list):
        self.f, self.reads = f, reads

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def read(self, n=-1):
        self.reads.append(n)
        return self.f.read(n)


def spy_on_reads(monkeypatch) -> list:
    """The sizes asked of every read of a corpus file from now on."""
    reads = []
    monkeypatch.setattr(corpus, "open", lambda *a, **kw: SpyFile(builtins.open(*a, **kw), reads), raising=False)
    return reads


# ---- reading and tokenising ---------------------------------------------------------------------
def test_a_file_read_in_pieces_tokenises_as_a_whole(tiny_model, tmp_path, monkeypatch):
    """The oracle is the tokenizer run on the whole text at once. A word longer than a span offers
    no cut, so the scan cuts it blind: its tokens at that cut are the one documented difference."""
    tokenizer = tiny_model.tokenizer
    clean = _long_text().replace(LONG_WORD, "the " * 100)
    path = tmp_path / "long.txt"
    for text, exact in ((clean, True), (_long_text(), False)):
        path.write_bytes(text.encode("utf-8"))
        _tiny_chunks(monkeypatch)
        pieces = list(corpus._read_text_pieces(path))
        assert len(pieces) > 50 and "".join(pieces) == text
        spans = list(corpus.encode_document(tokenizer, pieces))
        assert len(spans) > 10
        ids = [i for span in spans for i in span]
        if exact:
            assert ids == tokenizer.encode(text, add_special_tokens=False)
        else:  # different tokens at the blind cuts, but nothing lost or doubled
            assert ids != tokenizer.encode(text, add_special_tokens=False) and tokenizer.decode(ids) == text


@pytest.mark.parametrize("char", ["é", "日", "😀"])
def test_a_character_split_between_two_reads_decodes_whole(tmp_path, monkeypatch, char):
    monkeypatch.setattr(corpus, "CORPUS_CHUNK_BYTES", 8)
    n = len(char.encode("utf-8"))
    for before in range(8 - n + 1, 8):  # the character's first byte in the first read, the rest in the next
        text = "x" * before + char + " tail " + char * 9
        path = tmp_path / f"split{before}.txt"
        path.write_bytes(text.encode("utf-8"))
        pieces = list(corpus._read_text_pieces(path))
        assert "".join(pieces) == text and pieces[0] == "x" * before
        assert [t for _, t in iter_documents(path)] == [text]


def test_a_large_file_is_read_in_bounded_memory(tmp_path, monkeypatch):
    """A 20 MB file is read a chunk at a time: no read asks for more, and the Python heap peaks far
    below the file's size."""
    import tracemalloc

    block = ("ROMEO. But soft, what light through yonder window breaks? 日本 😀\n" * 400).encode("utf-8")
    path = tmp_path / "huge.txt"
    with open(path, "wb") as f:
        for _ in range(20_000_000 // len(block)):
            f.write(block)
    size = path.stat().st_size
    reads = spy_on_reads(monkeypatch)
    monkeypatch.setattr(corpus, "CORPUS_CHUNK_BYTES", 1 << 20)
    tracemalloc.start()
    try:
        n_chars = sum(len(piece) for piece in corpus._read_text_pieces(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n_chars == len(block.decode("utf-8")) * (size // len(block))
    assert reads and all(0 < n <= 1 << 20 for n in reads) and len(reads) > 18
    assert peak < 16 << 20 < size, f"reading peaked at {peak} bytes of Python memory for a {size}-byte file"


def test_the_tokenising_stage_never_sees_more_than_a_span(tiny_model, tmp_path, monkeypatch):
    """Both users tokenise a file a span at a time (no encode is handed more) into the tokens of
    the whole file."""
    text = ("ROMEO. But soft, what light through yonder window breaks? 日本 😀\n" * 4000)  # ~260k characters
    path = tmp_path / "part.txt"
    path.write_text(text, encoding="utf-8")
    ids = tiny_model.tokenizer.encode(text, add_special_tokens=False)
    monkeypatch.setattr(corpus, "CORPUS_SPAN_CHARS", 4096)
    seen = []
    encode = tiny_model.tokenizer.encode
    monkeypatch.setattr(tiny_model.tokenizer, "encode", lambda t, **kw: seen.append(len(t)) or encode(t, **kw))
    windows = list(memories.scan_windows(tiny_model, path, tiny_model.cfg.n_ctx, True, (0, 0), 0, 1))
    assert max(seen) <= 4096 and len(seen) > 50
    assert [i for w in windows for i in w[3]] == ids  # the memory scan's windows are the whole file's
    seen.clear()
    rows = torch.cat(token_batches(tiny_model, path, seq_len=tiny_model.cfg.n_ctx))
    assert max(seen) <= 4096 and len(seen) > 50
    assert rows.tolist() == bos_windows([[tiny_model.tokenizer.bos_id] + ids], tiny_model.tokenizer.bos_id,
                                        tiny_model.cfg.n_ctx)


# ---- head pruning reads files through the same path ---------------------------------------------
def bos_windows(streams: list[list[int]], bos: int, seq_len: int) -> list[list[int]]:
    """The oracle: the documents' token streams joined, cut into BOS + seq_len - 1 tokens, the
    ragged tail dropped."""
    stream = [i for s in streams for i in s]
    body = seq_len - 1
    return [[bos] + stream[i * body:(i + 1) * body] for i in range(len(stream) // body)]


@pytest.mark.parametrize("seq_len", [2, 7, 48])
def test_pruning_windows_of_a_file_equal_those_of_reading_it_whole(tiny_model, tmp_path, monkeypatch, seq_len):
    tok = tiny_model.tokenizer
    text = _long_text(20).replace(LONG_WORD, "the " * 100)
    path = tmp_path / "long.txt"
    path.write_bytes(text.encode("utf-8"))
    # decoded, not read_text(): universal newlines would turn the CRLF lines into LF ones
    expected = bos_windows([[tok.bos_id] + tok.encode(path.read_bytes().decode("utf-8"), add_special_tokens=False)], tok.bos_id, seq_len)
    _tiny_chunks(monkeypatch)
    batches = token_batches(tiny_model, path, batch_size=5, seq_len=seq_len)
    assert [len(b) for b in batches[:-1]] == [5] * (len(batches) - 1)
    assert torch.cat(batches).tolist() == expected
    assert torch.cat(token_batches(tiny_model, path, seq_len=seq_len, max_windows=3)).tolist() == expected[:3]
    # the same text passed as a string
    assert torch.cat(token_batches(tiny_model, text, seq_len=seq_len)).tolist() == expected


def test_pruning_reads_a_folder_as_one_document_per_file(tiny_model, tmp_path, monkeypatch):
    tok = tiny_model.tokenizer
    texts = ["To be, or not to be, that is the question.\n" * 7, "The quick brown fox jumps over the lazy dog.\n" * 5]
    folder = tmp_path / "plays"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(texts[0], encoding="utf-8")
    (folder / "sub" / "b.txt").write_text(texts[1], encoding="utf-8")
    (folder / "notes.md").write_text("not part of the corpus")
    _tiny_chunks(monkeypatch)
    rows = torch.cat(token_batches(tiny_model, folder, seq_len=9))
    assert rows.tolist() == bos_windows([[tok.bos_id] + tok.encode(t, add_special_tokens=False) for t in texts], tok.bos_id, 9)


def test_pruning_stops_reading_once_max_windows_are_full(tiny_model, tmp_path, monkeypatch):
    """Two windows of a 4 MB file need its first kilobytes only: the rest is never read."""
    line = "ROMEO. But soft, what light through yonder window breaks?\n"
    path = tmp_path / "big.txt"
    path.write_text(line * (4_000_000 // len(line)), encoding="utf-8")
    monkeypatch.setattr(corpus, "CORPUS_CHUNK_BYTES", 1 << 16)
    reads = spy_on_reads(monkeypatch)
    rows = torch.cat(token_batches(tiny_model, path, seq_len=16, max_windows=2))
    tok = tiny_model.tokenizer
    assert rows.tolist() == bos_windows([[tok.bos_id] + tok.encode(line * 10, add_special_tokens=False)], tok.bos_id, 16)[:2]
    assert 0 < len(reads) <= 2, f"{len(reads)} reads of 64 KiB for two windows of 15 tokens"


def test_pruning_names_a_bad_file_and_where(tiny_model, tmp_path, monkeypatch):
    good = "To be, or not to be, that is the question.\n" * 40
    (tmp_path / "latin1.txt").write_bytes(good.encode() + "caf\xe9".encode("latin-1"))
    (tmp_path / "blank.txt").write_bytes(b" \n\t \n")
    monkeypatch.setattr(corpus, "CORPUS_CHUNK_BYTES", 64)
    with pytest.raises(ValueError, match=rf"latin1.txt is not UTF-8 text \(byte {len(good) + 3}:"):
        head_importance(tiny_model, tmp_path / "latin1.txt", progress=False)
    with pytest.raises(ValueError, match="blank.txt is empty"):
        head_importance(tiny_model, tmp_path / "blank.txt", progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        token_batches(tiny_model, tmp_path / "missing.txt")
