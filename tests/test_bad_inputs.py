"""Rows of the bad-input matrix (docs/robustness.md) that cut across the analyses and the command."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

from probe.analyses import Site, ablate_heads, direct_logit_attribution, patch, logit_diff_metric
from probe.cli import cli


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
    (["ablate", "--heads", "-20.0"], "--heads '-20.0': write heads as L3H1 (or 3.1)"),  # no negative layers
    (["ablate", "--heads", "zero"], "write heads as L3H1 (or 3.1)"),
    (["contributions", "--answer", "100000"], "not an output token id"),
])
def test_command_line_bad_heads_and_answers(tiny_dir, tmp_path, capsys, args, message):
    code = cli.main([args[0], "--model", str(tiny_dir), "--prompt", "To be, or not", "--out", str(tmp_path / "o"), *args[1:]])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_command_line_corpus_file_bad_deep_inside(tiny_dir, tmp_path, capsys, monkeypatch):
    """A corpus file is read a chunk at a time: a bad byte found after the scan has begun is still
    a one-line error naming the file and the byte, and no result is written."""
    from probe.analyses import corpus

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
    from probe.analyses import trigger_scan

    def press_ctrl_c():
        raise KeyboardInterrupt

    corpus = three_documents(tmp_path)
    real_encode = trigger_scan.encode_document
    encode_then_interrupt = interrupted_on_second_document(real_encode, press_ctrl_c)

    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "triggers.csv").write_text("an earlier result\n")
    monkeypatch.setattr(trigger_scan, "encode_document", encode_then_interrupt)
    out = tmp_path / "out"
    code = cli.main(["memories", "--model", str(tiny_dir), "--triggers", "--corpus", str(corpus), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 130 and "interrupted" in err and "Traceback" not in err, err
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["triggers.partial.csv"]
    partial = pd.read_csv(out / "triggers.partial.csv")
    assert len(partial) > 0  # the first document's windows were folded before the interrupt
    assert (earlier / "triggers.csv").read_text() == "an earlier result\n"
    # the scan rerun into the same directory completes: its result supersedes the partial one, which goes
    monkeypatch.setattr(trigger_scan, "encode_document", real_encode)
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

    from probe.analyses import trigger_scan

    corpus = three_documents(tmp_path)
    # the corpus is read ahead in a thread, so the kill comes from the main thread, as the second batch is folded
    fold, calls = trigger_scan.Scanner.folded, []

    def fold_then_terminate(scanner, tokens):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return fold(scanner, tokens)

    monkeypatch.setattr(trigger_scan.Scanner, "folded", fold_then_terminate)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "out"
    code = cli.main(["memories", "--model", str(tiny_dir), "--triggers", "--corpus", str(corpus), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 143 and "terminated" in err and "Traceback" not in err, err
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["triggers.partial.csv"]
    assert len(pd.read_csv(out / "triggers.partial.csv")) > 0
    assert signal.getsignal(signal.SIGTERM) is before


# ---- values that used to change results silently (issue 24, class 3) -------------------------------------------
def assert_nothing_attached(model) -> None:
    assert not any(model.hook_point(n).active for n in model.hook_names)
    assert model.persistent_hooks() == []


@pytest.mark.parametrize("mask,shown", [
    (lambda t: torch.full(t.shape, 2), "got 2"),
    (lambda t: torch.full(t.shape, 0.9), "got 0.9"),
    (lambda t: torch.where(torch.arange(t.shape[1]) < 3, 0.0, -1e4).expand(t.shape), "got -10000;"),  # additive
    (lambda t: torch.where(torch.arange(t.shape[1]) < 3, 0.0, float("-inf")).expand(t.shape), "got -inf"),
    (lambda t: torch.full(t.shape, -1), "got -1"),
], ids=["twos", "fractions", "additive-1e4", "additive-inf", "minus-one"])
def test_an_attention_mask_other_than_ones_and_zeros_is_refused_with_the_fix(tiny_model, tokens, mask, shown):
    from probe.analyses import logit_lens, residual_decomposition

    bad = mask(tokens)
    for run in (lambda: tiny_model(tokens, attention_mask=bad),
                lambda: tiny_model.run_with_cache(tokens, attention_mask=bad),
                lambda: residual_decomposition(tiny_model, tokens, attention_mask=bad),
                lambda: logit_lens(tiny_model, tokens, attention_mask=bad)):
        with pytest.raises(ValueError, match=rf"attention_mask must hold 1 \(real token\) and 0 \(padding\) only, {shown}"
                                             r".*pass \(mask == 0\).long\(\)"):
            run()
        assert_nothing_attached(tiny_model)


def test_masks_of_ones_and_zeros_in_any_dtype_mean_the_same(tiny_model, tokens):
    mask = torch.ones(tokens.shape, dtype=torch.long)
    mask[0, -4:] = 0
    with torch.no_grad():
        expected = tiny_model(tokens, attention_mask=mask)
        for same in (mask.bool(), mask.float(), mask.to(torch.int8), mask.double()):
            assert torch.equal(tiny_model(tokens, attention_mask=same), expected)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8, "float16"])
def test_a_cache_dtype_that_is_not_floating_point_is_refused(tiny_model, tokens, dtype):
    with pytest.raises(TypeError, match=r"run_with_cache\(dtype=.*floating-point dtype"):
        tiny_model.run_with_cache(tokens, dtype=dtype)
    assert_nothing_attached(tiny_model)


@pytest.mark.parametrize("position", [2.5, 2.0, True, torch.tensor(1.0), "2"])
def test_float_and_bool_positions_are_refused_not_truncated(tiny_model, tokens, position):
    from probe.analyses import logit_lens, memory_lookup
    from probe.analyses.steering_sweep import target_logprob_metric

    lens = logit_lens(tiny_model, tokens[:1])
    for run in (lambda: lens.figure("target", position=position),
                lambda: direct_logit_attribution(tiny_model, tokens[:1], 5, 6, position=position),
                lambda: memory_lookup(tiny_model, tokens[0], position=position),
                lambda: logit_diff_metric(tiny_model, 5, 6, position=position),
                lambda: target_logprob_metric(tiny_model, [5], position=position)):
        with pytest.raises((TypeError, ValueError), match="position"):
            run()
        assert_nothing_attached(tiny_model)


@pytest.mark.parametrize("index", [1.0, True, 0.5])
def test_float_and_bool_layers_and_heads_are_refused_not_truncated(tiny_model, tokens, index):
    from probe.analyses import ov_circuit, qk_circuit
    from probe.analyses.attention import attention_patterns

    metric = logit_diff_metric(tiny_model, 1, 2)
    for run in (lambda: ov_circuit(tiny_model, index, 0), lambda: qk_circuit(tiny_model, 0, index),
                lambda: patch(tiny_model, tokens[:1], tokens[1:2], metric, sites=[Site("resid_pre", index)]),
                lambda: patch(tiny_model, tokens[:1], tokens[1:2], metric, sites=[Site("z", 0, head=index)]),
                lambda: patch(tiny_model, tokens[:1], tokens[1:2], metric, sites=[Site("resid_pre", 0, pos=index)]),
                lambda: ablate_heads(tiny_model, tokens, [(index, 0)]),
                lambda: attention_patterns(tiny_model, tokens[:1], layers=[index])):
        with pytest.raises((TypeError, ValueError), match=r"layer|head|pos"):
            run()
        assert_nothing_attached(tiny_model)


# ---- every optional parameter present and non-zero (issue 24, class 10) -------------------------------------------
@pytest.fixture(scope="module")
def biased_model(tiny_model):
    """The tiny GPT-2 after process_weights: the final norm's bias folded into an unembedding bias b_U (non-zero),
    beside GPT-2's own q/k/v, output and MLP biases."""
    from probe import process_weights

    model = process_weights(tiny_model).eval()
    assert model.cfg.unembed_bias and float(model.unembed.bias.detach().abs().min()) > 0
    return model


def _final_layernorm_by_hand(model, x):
    x = x.double()
    centred = x - x.mean(-1, keepdim=True)
    normed = centred / (centred.pow(2).mean(-1, keepdim=True) + model.cfg.eps).sqrt()
    return normed * model.ln_final.w.double() + model.ln_final.b.double()


def test_the_logit_lens_adds_the_unembedding_bias(biased_model, tokens):
    from probe.analyses import logit_lens

    lens = logit_lens(biased_model, tokens[:2])
    _, cache = biased_model.run_with_cache(tokens[:2], names=["blocks.0.hook_resid_post"])
    W_U, b_U = biased_model.unembed.W_U.double(), biased_model.unembed.bias.double()
    by_hand = _final_layernorm_by_hand(biased_model, cache["blocks.0.hook_resid_post"]) @ W_U + b_U
    site = lens.sites.index("blocks.0.hook_resid_post")
    torch.testing.assert_close(lens.logits[:, site].double(), by_hand, atol=1e-4, rtol=0)


def test_direct_logit_attribution_counts_the_unembedding_bias(biased_model, tokens):
    dla = direct_logit_attribution(biased_model, tokens[:2], 5, 6)
    b_U = biased_model.unembed.bias.double()
    assert torch.allclose(dla.unembed_bias.double(), (b_U[5] - b_U[6]).expand(2), atol=1e-6)  # by hand, non-zero
    with torch.no_grad():
        logits = biased_model(tokens[:2])[:, -1].double()
    actual = logits[:, 5] - logits[:, 6]
    parts = dla.contributions.double().sum(-1) + dla.ln_bias.double() + dla.unembed_bias.double()
    torch.testing.assert_close(parts, actual, atol=1e-4, rtol=0)
    torch.testing.assert_close(dla.accumulated[:, -1].double(), actual, atol=1e-4, rtol=0)


def test_feature_logits_are_a_direction_effect_without_the_unembedding_bias(biased_model):
    from probe.analyses import feature_logits
    from probe import SAEConfig, SparseAutoencoder

    sae = SparseAutoencoder(SAEConfig(d_in=64, d_sae=8, hook_name="blocks.1.hook_resid_post"))
    with torch.no_grad():
        sae.W_dec.copy_(torch.randn(8, 64, generator=torch.Generator().manual_seed(3)))
    found = feature_logits(biased_model, sae, [2, 5], k=4)
    d = sae.W_dec.double()[[2, 5]]
    by_hand = ((d - d.mean(-1, keepdim=True)) * biased_model.ln_final.w.double()) @ biased_model.unembed.W_U.double()
    top = by_hand.topk(4, dim=-1)
    torch.testing.assert_close(found.top_logits.double(), top.values, atol=1e-4, rtol=0)
    assert torch.equal(found.top_ids.cpu(), top.indices)
