"""Rows of the bad-input matrix (docs/robustness.md) that cut across the analyses and the command."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

from analyses import Site, ablate_heads, direct_logit_attribution, patch, logit_diff_metric
from scripts import cli


@pytest.mark.parametrize("heads", [[(0, 99)], [(-20, 0)], [(99, 0)]])
def test_ablating_a_head_that_does_not_exist(tiny_model, tokens, heads):
    with pytest.raises(ValueError, match="layer|head"):
        ablate_heads(tiny_model, tokens, heads)
    torch.testing.assert_close(tiny_model(tokens), tiny_model(tokens))  # still usable
    assert not any(tiny_model.hook_point(n).active for n in tiny_model.hook_names)


def test_patching_a_site_that_does_not_exist(tiny_model, tokens):
    metric = logit_diff_metric(tiny_model, 1, 2)
    clean, corrupted = tokens[:1], tokens[1:2]
    with pytest.raises(ValueError, match="head=99"):
        patch(tiny_model, clean, corrupted, metric, sites=[Site("z", 0, head=99)])
    with pytest.raises(ValueError, match="layer=-20"):
        patch(tiny_model, clean, corrupted, metric, sites=[Site("resid_pre", -20)])


def test_an_answer_outside_the_vocabulary(tiny_model, tokens):
    with pytest.raises(ValueError, match="10000"):
        direct_logit_attribution(tiny_model, tokens, answer=10_000)


@pytest.mark.parametrize("args,message", [
    (["ablate", "--heads", "0.99"], "head 99 is outside"),
    (["ablate", "--heads", "-20.0"], "layer -20 is outside"),
    (["ablate", "--heads", "zero"], "LAYER.HEAD"),
    (["contributions", "--answer", "100000"], "not a token id"),
])
def test_command_line_bad_heads_and_answers(tiny_dir, tmp_path, capsys, args, message):
    code = cli.main([args[0], "--model", str(tiny_dir), "--prompt", "To be, or not", "--out", str(tmp_path / "o"), *args[1:]])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_command_line_corpus_file_bad_deep_inside(tiny_dir, tmp_path, capsys, monkeypatch):
    """A corpus file is read a chunk at a time: a bad byte found after the scan has begun is still
    a one-line error naming the file and the byte, and no result is written."""
    from analyses import corpus

    monkeypatch.setattr(corpus, "CORPUS_CHUNK_BYTES", 64)
    monkeypatch.setattr(corpus, "CORPUS_SPAN_CHARS", 64)
    good = "To be, or not to be, that is the question.\n" * 40
    for name, data, message in (("latin1.txt", good.encode() + "caf\xe9".encode("latin-1"), "is not UTF-8 text (byte"),
                                ("nul.txt", good.encode() + b"\x00\x01", "looks binary (a NUL byte at byte")):
        (tmp_path / name).write_bytes(data)
        out = tmp_path / f"out-{name}"
        code = cli.main(["memories", "--model", str(tiny_dir), "--triggers", "--corpus", str(tmp_path / name),
                         "--out", str(out), "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        assert f"{name} {message} {len(good.encode()) + (3 if name == 'latin1.txt' else 0)}" in err
        assert not (out / "triggers.csv").exists()


def three_documents(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text(f"Document {i}: to be, or not to be, that is the question.\n" * 40)
    return corpus


def interrupted_on_second_document(encode, interrupt):
    """The corpus reader `encode`, calling `interrupt()` as the second document starts (the user's Ctrl-C, a kill)."""
    seen = []

    def encode_then_interrupt(tokenizer, pieces):
        seen.append(1)
        if len(seen) == 2:
            interrupt()
        yield from encode(tokenizer, pieces)

    return encode_then_interrupt


def test_command_line_ctrl_c_during_a_corpus_scan(tiny_dir, tmp_path, capsys, monkeypatch):
    """Ctrl-C in the middle of `probe memories --triggers`: exit 130 without a traceback, the part
    scanned so far kept under a name that says it is partial, no final result files, and a result
    written earlier in another directory untouched."""
    from analyses import memories

    def press_ctrl_c():
        raise KeyboardInterrupt

    corpus = three_documents(tmp_path)
    real_encode = memories._encode_document
    encode_then_interrupt = interrupted_on_second_document(real_encode, press_ctrl_c)

    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "triggers.csv").write_text("an earlier result\n")
    monkeypatch.setattr(memories, "_encode_document", encode_then_interrupt)
    out = tmp_path / "out"
    code = cli.main(["memories", "--model", str(tiny_dir), "--triggers", "--corpus", str(corpus), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 130 and "interrupted" in err and "Traceback" not in err, err
    assert sorted(p.name for p in out.iterdir()) == ["triggers.partial.csv"]
    partial = pd.read_csv(out / "triggers.partial.csv")
    assert len(partial) > 0  # the first document's windows were folded before the interrupt
    assert (earlier / "triggers.csv").read_text() == "an earlier result\n"
    # the scan rerun into the same directory completes: its result supersedes the partial one, which goes
    monkeypatch.setattr(memories, "_encode_document", real_encode)
    code = cli.main(["memories", "--model", str(tiny_dir), "--triggers", "--corpus", str(corpus), "--out", str(out), "--force"])
    err = capsys.readouterr().err
    assert code == 0 and "removed" in err and "triggers.partial.csv" in err
    names = sorted(p.name for p in out.iterdir())
    assert "triggers.csv" in names and "triggers.partial.csv" not in names
    assert len(pd.read_csv(out / "triggers.csv")) >= len(partial)


def test_sigterm_during_a_corpus_scan_is_handled_like_ctrl_c(tiny_dir, tmp_path, capsys, monkeypatch):
    """kill / timeout / a scheduler send SIGTERM: the same clean-up as Ctrl-C (the partial scan kept under its
    partial name, no final files, no traceback), exit 143, and the previous SIGTERM handler back afterwards."""
    import os
    import signal

    from analyses import memories

    corpus = three_documents(tmp_path)
    encode_then_terminate = interrupted_on_second_document(memories._encode_document,
                                                           lambda: os.kill(os.getpid(), signal.SIGTERM))
    monkeypatch.setattr(memories, "_encode_document", encode_then_terminate)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "out"
    code = cli.main(["memories", "--model", str(tiny_dir), "--triggers", "--corpus", str(corpus), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 143 and "terminated" in err and "Traceback" not in err, err
    assert sorted(p.name for p in out.iterdir()) == ["triggers.partial.csv"]
    assert len(pd.read_csv(out / "triggers.partial.csv")) > 0
    assert signal.getsignal(signal.SIGTERM) is before
