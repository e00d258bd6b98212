"""FFN key-value memories: value tokens, lookups and corpus triggers against independent oracles.

The oracles are `transformers`' GPT2LMHeadModel on the same checkpoint (forward hooks on its MLP
activation and output) and its raw weights, and a brute-force scan that keeps every activation.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from probe.analyses import agreement, iter_documents, memory_lookup, memory_report, merge, sub_updates, top_triggers, value_tokens
from probe.analyses.common import escape_token
from probe.analyses import corpus
from probe.analyses.memories import TopTriggers
from test_corpus import LONG_WORD, _long_text, _tiny_chunks

REPO = Path(__file__).resolve().parents[1]

CORPUS = [
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 3,  # longer than n_ctx: 3+ windows
    "To be, or not to be, that is the question.",
    "<script>alert('x')</script> & other <b>markup</b> should stay text.",
    "When in the course of human events it becomes necessary for one people to dissolve the bands "
    "which have connected them with another.",
    "Numbers 0123456789 and punctuation !?.,;:'\"()[]{} appear too.",
]


# ---- oracles -------------------------------------------------------------------------------------
def hf_mlp_activations(hf, ids: list[int], layers):
    """transformers' MLP coefficients act(c_fc x) [pos d_mlp] and MLP outputs [pos d_model] per layer."""
    acts, outs, final_in = {}, {}, {}
    handles = []
    for l in layers:
        mlp = hf.transformer.h[l].mlp
        handles.append(mlp.act.register_forward_hook(lambda m, i, o, l=l: acts.__setitem__(l, o[0].detach())))
        handles.append(mlp.register_forward_hook(lambda m, i, o, l=l: outs.__setitem__(l, o[0].detach())))
    handles.append(hf.transformer.ln_f.register_forward_pre_hook(lambda m, i: final_in.__setitem__(0, i[0][0].detach())))
    try:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0]
    finally:
        for h in handles:
            h.remove()
    return acts, outs, final_in[0], logits


def brute_force_triggers(hf, tokenizer, docs, layers, neurons, k, window, context):
    """Every activation of every window (each run alone, unpadded), sorted by (-value, doc, pos)."""
    per_window = window - 1
    found = {(l, n): [] for l in layers for n in neurons}
    for d, text in enumerate(docs):
        ids = tokenizer.encode(text, add_special_tokens=False)
        for start in range(0, len(ids), per_window):
            chunk = ids[start:start + per_window]
            acts, _, _, _ = hf_mlp_activations(hf, [tokenizer.bos_id] + chunk, layers)
            for l in layers:
                values = acts[l][1:, neurons].T.tolist()  # [neuron pos], BOS dropped
                for n, column in zip(neurons, values):
                    for p, value in enumerate(column):
                        pos = start + p
                        ctx = ids[max(start, pos - context + 1):pos + 1]
                        nxt = ids[pos + 1] if pos + 1 < len(ids) else -1
                        found[(l, n)].append((value, d, pos, ctx, nxt))
    return {key: sorted(v, key=lambda e: (-e[0], e[1], e[2]))[:k] for key, v in found.items()}


# ---- value_tokens --------------------------------------------------------------------------------
@pytest.mark.parametrize("through_final_norm", [False, True])
def test_value_tokens_equal_topk_of_values_times_unembedding(tiny_model, tiny_hf, through_final_norm):
    layer, neurons, k = 1, [0, 5, 17, 255], 6
    values = tiny_hf.transformer.h[layer].mlp.c_proj.weight.detach()  # Conv1D [d_mlp d_model]: row i is v_i
    if through_final_norm:
        values = (values - values.mean(-1, keepdim=True)) * tiny_hf.transformer.ln_f.weight.detach()
    logits = values[neurons] @ tiny_hf.lm_head.weight.detach().T  # [neuron vocab]
    result = value_tokens(tiny_model, layer, neurons, k, through_final_norm=through_final_norm)
    top, bottom = logits.topk(k, dim=-1), logits.topk(k, dim=-1, largest=False)
    assert torch.equal(result.top_ids, top.indices)
    assert torch.equal(result.bottom_ids, bottom.indices)
    torch.testing.assert_close(result.top_logits, top.values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result.bottom_logits, bottom.values, rtol=1e-5, atol=1e-5)
    frame = result.to_frame()
    assert len(frame) == len(neurons) * k * 2
    row = frame[(frame.neuron == 17) & (frame.direction == "promoted") & (frame["rank"] == 1)].iloc[0]  # ranks from 1
    assert row.token_id == int(top.indices[2, 0])
    assert row.token == tiny_model.tokenizer.token_strings([row.token_id])[0]
    fig = result.figure()
    cells = [cell for row in fig.data[0].text for cell in row]
    assert cells == [escape_token(t) for strings in result.token_strings for t in strings[:k]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("through_final_norm", [False, True])
def test_value_tokens_of_a_half_precision_model_rank_its_weights_exactly(tiny_model, dtype, through_final_norm,
                                                                        monkeypatch):
    """The oracle is float64 arithmetic on the half-precision model's own weights: the ranking is a
    property of those weights, and rounding v W_U to 8 bits (bfloat16) ties and reorders near-equal tokens."""
    from probe.analyses import vocab_projection

    # a small budget: several chunks of neurons, and the unembedding converted in slices of 100 columns
    monkeypatch.setattr(vocab_projection, "LOGIT_CHUNK", tiny_model.cfg.d_model * 100)
    model = copy.deepcopy(tiny_model).to(dtype)
    layer, k = 1, 10
    values = model.blocks[layer].mlp.W_out.detach().double()  # [d_mlp d_model]
    if through_final_norm:
        values = (values - values.mean(-1, keepdim=True)) * model.ln_final.w.detach().double()
    logits = values @ model.unembed.weight.detach().double().T  # [d_mlp vocab]
    result = value_tokens(model, layer, k=k, through_final_norm=through_final_norm)
    assert result.top_logits.dtype == torch.float32
    for ids, got, largest in ((result.top_ids, result.top_logits, True), (result.bottom_ids, result.bottom_logits, False)):
        # the exact logits of the tokens chosen are the k most extreme, in order, up to float32 rounding
        # (ids alone could differ where two tokens' logits agree to float32 precision)
        chosen = logits.gather(-1, ids)
        torch.testing.assert_close(chosen, logits.topk(k, dim=-1, largest=largest).values, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(got.double(), chosen, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_memory_lookup_effect_of_a_half_precision_model_adds_no_rounding(tiny_model, dtype):
    """The direct effect from the model's own half-precision coefficients and weights, in float64."""
    model = copy.deepcopy(tiny_model).to(dtype)
    text, position = "To be, or not to be, that is the question", 6
    result = memory_lookup(model, text, position, k=20)
    _, cache = model.run_with_cache(model.to_tokens(text), names=["blocks.1.mlp.hook_post", "ln_final.hook_scale"])
    neurons = result.neurons[1]
    values = model.blocks[1].mlp.W_out.detach().double()[neurons]
    direction = (values - values.mean(-1, keepdim=True)) * model.ln_final.w.detach().double()
    unembed = model.unembed.weight.detach().double()[result.predicted_token]
    scale = cache["ln_final.hook_scale"][0, position].double()
    effect = cache["blocks.1.mlp.hook_post"][0, position, neurons].double() * (direction @ unembed) / scale
    torch.testing.assert_close(result.prediction_effect[1].double(), effect, rtol=1e-5, atol=1e-7)


def test_value_tokens_all_neurons_and_bad_arguments(tiny_model, tiny_hf):
    values = tiny_hf.transformer.h[0].mlp.c_proj.weight.detach()
    expected = (values @ tiny_hf.lm_head.weight.detach().T).argmax(-1)
    assert torch.equal(value_tokens(tiny_model, 0, k=1).top_ids[:, 0], expected)
    with pytest.raises(ValueError, match="layer 7"):
        value_tokens(tiny_model, 7)
    with pytest.raises(ValueError, match="neuron 256"):
        value_tokens(tiny_model, 0, [256])


# ---- memory_lookup -------------------------------------------------------------------------------
def test_memory_lookup_coefficients_sub_updates_and_ranking(tiny_model, tiny_hf):
    text = "To be, or not to be, that is the question"
    ids = tiny_model.to_tokens(text)[0].tolist()
    position, k = 6, 7
    acts, outs, final_in, hf_logits = hf_mlp_activations(tiny_hf, ids, [0, 1])
    result = memory_lookup(tiny_model, text, position, k=k)
    assert result.layers == [0, 1]
    for li, layer in enumerate(result.layers):
        mlp = tiny_hf.transformer.h[layer].mlp
        torch.testing.assert_close(result.coefficients[li], acts[layer][position], rtol=1e-5, atol=1e-5)
        # the sum of every sub-update m_i v_i plus the output bias is the MLP's output
        total = sub_updates(tiny_model, layer, result.coefficients[li]).sum(0) + mlp.c_proj.bias.detach()
        torch.testing.assert_close(total, outs[layer][position], rtol=1e-4, atol=1e-5)
        sizes = acts[layer][position].abs() * mlp.c_proj.weight.detach().norm(dim=-1)
        expected = sizes.topk(k)
        assert torch.equal(result.neurons[li], expected.indices)
        torch.testing.assert_close(result.sizes[li], expected.values, rtol=1e-5, atol=1e-6)
    # the direct effect on the predicted token's logit, through the final norm at this position's scale
    predicted = int(hf_logits[position].argmax())
    assert result.predicted_token == predicted
    scale = (final_in[position].var(unbiased=False) + tiny_hf.config.layer_norm_epsilon).sqrt()
    w_f, unembed = tiny_hf.transformer.ln_f.weight.detach(), tiny_hf.lm_head.weight.detach()[predicted]
    values = tiny_hf.transformer.h[1].mlp.c_proj.weight.detach()[result.neurons[1]]
    effect = acts[1][position, result.neurons[1]] * ((values - values.mean(-1, keepdim=True)) * w_f @ unembed) / scale
    torch.testing.assert_close(result.prediction_effect[1], effect, rtol=1e-4, atol=1e-6)
    frame = result.to_frame()
    assert list(frame.columns[:3]) == ["layer", "rank", "neuron"] and len(frame) == 2 * k
    assert (frame.pushes_prediction == (frame.prediction_effect > 0)).all()
    fig = result.figure()
    assert len(fig.data) == 2


def test_memory_lookup_one_layer_and_errors(tiny_model):
    result = memory_lookup(tiny_model, "the dog sleeps", -1, layer=1, k=3)
    assert result.layers == [1] and result.neurons.shape == (1, 3)
    with pytest.raises(ValueError, match="one prompt"):
        memory_lookup(tiny_model, ["a b", "c d"])
    with pytest.raises(ValueError, match="position 99"):
        memory_lookup(tiny_model, "the dog", 99)


# ---- top_triggers --------------------------------------------------------------------------------
def _check_against_brute_force(result, expected, layers, neurons, context):
    for li, layer in enumerate(layers):
        for ni, neuron in enumerate(neurons):
            rows = expected[(layer, neuron)]
            got_docs = result.docs[li, ni].tolist()
            got_pos = result.positions[li, ni].tolist()
            assert list(zip(got_docs, got_pos)) == [(e[1], e[2]) for e in rows], (layer, neuron)
            torch.testing.assert_close(result.activations[li, ni], torch.tensor([e[0] for e in rows]),
                                       rtol=1e-5, atol=1e-5)
            assert result.next_tokens[li, ni].tolist() == [e[4] for e in rows]
            for r, e in enumerate(rows):
                ctx = result.contexts[li, ni, r].tolist()
                assert ctx == [-1] * (context - len(e[3])) + e[3]


@pytest.mark.parametrize("window,n_docs", [(None, len(CORPUS)), (12, 2)])
def test_top_triggers_equal_brute_force(tiny_model, tiny_hf, window, n_docs):
    layers, neurons, k, context, corpus = [0, 1], [3, 40, 200], 5, 6, CORPUS[:n_docs]
    result = top_triggers(tiny_model, corpus, layers, neurons, k=k, batch_size=2, window=window, context=context,
                          progress=False)
    expected = brute_force_triggers(tiny_hf, tiny_model.tokenizer, corpus, layers, neurons, k,
                                    window or tiny_model.cfg.n_ctx, context)
    _check_against_brute_force(result, expected, layers, neurons, context)
    n_tokens = sum(len(tiny_model.tokenizer.encode(t, add_special_tokens=False)) for t in corpus)
    assert result.complete and result.n_tokens == n_tokens and result.n_docs == len(corpus)
    # a corpus with fewer positions than k leaves empty slots, marked and ordered last
    short = top_triggers(tiny_model, ["to be"], 1, [3], k=5, progress=False)
    n_short = len(tiny_model.tokenizer.encode("to be", add_special_tokens=False))
    assert short.docs[0, 0].tolist() == [0] * n_short + [-1] * (5 - n_short)
    assert torch.isinf(short.activations[0, 0, n_short:]).all()


def test_ties_break_by_document_then_position(tmp_path_factory):
    """ReLU neurons are exactly 0 at many positions: the kept zeros must be the earliest (doc, pos),
    in one scan, in brute force, and in shards merged back together."""
    from conftest import build_hf_checkpoint
    from transformers import GPT2LMHeadModel

    from probe import HookedDecoder

    directory = build_hf_checkpoint(tmp_path_factory.mktemp("relu-gpt2"), seed=3, activation_function="relu",
                                    n_layer=1, n_embd=32, n_head=2, n_positions=32)
    model = HookedDecoder.from_pretrained(directory).eval()
    hf = GPT2LMHeadModel.from_pretrained(directory, attn_implementation="eager").eval()
    acts = hf_mlp_activations(hf, model.to_tokens(CORPUS[1])[0].tolist(), [0])[0][0]
    neurons = (acts == 0).float().mean(0).argsort(descending=True)[:4].tolist()  # the most often silent
    args = dict(layers=[0], neurons=neurons, k=60, context=4, progress=False)
    result = top_triggers(model, CORPUS, batch_size=3, **args)
    assert (result.activations == 0).sum() > 20  # there are ties to break
    expected = brute_force_triggers(hf, model.tokenizer, CORPUS, [0], neurons, 60, model.cfg.n_ctx, 4)
    _check_against_brute_force(result, expected, [0], neurons, 4)
    merged = merge([top_triggers(model, CORPUS, shard=(r, 2), batch_size=2, **args) for r in (1, 0)])
    assert torch.equal(merged.docs, result.docs) and torch.equal(merged.positions, result.positions)


def test_top_triggers_is_independent_of_batching(tiny_model):
    base = top_triggers(tiny_model, CORPUS, [1], k=4, batch_size=1, progress=False)
    other = top_triggers(tiny_model, CORPUS, [1], k=4, batch_size=5, progress=False)
    assert torch.equal(base.docs, other.docs) and torch.equal(base.positions, other.positions)
    torch.testing.assert_close(base.activations, other.activations, rtol=1e-5, atol=1e-6)


def interrupting(texts, stop: str):
    """(corpus, hook) for a Ctrl-C: the corpus generator raises KeyboardInterrupt before document n ("doc n"),
    the hook on its nth call ("forward n")."""
    where, n = stop.split()

    def corpus():
        for i, text in enumerate(texts):
            if where == "doc" and i == int(n):
                raise KeyboardInterrupt
            yield text

    calls = []

    def interrupt(activation, hook):
        calls.append(1)
        if where == "forward" and len(calls) == int(n):
            raise KeyboardInterrupt

    return corpus, interrupt


@pytest.mark.parametrize("stop", ["doc 1", "doc 3", "forward 2"])
def test_top_triggers_interrupt_then_resume_equals_one_scan(tiny_model, tmp_path, stop):
    """Ctrl-C between documents, mid-document (doc 0 spans 3 windows, batches hold 2) or inside a
    forward, after layer 0 folded the batch and before layer 1 did: resuming gives the one-scan result."""
    args = dict(layers=None, neurons=[0, 9, 100], k=4, batch_size=2, progress=False)
    full = top_triggers(tiny_model, CORPUS, **args)
    corpus, interrupt = interrupting(CORPUS, stop)

    path = tmp_path / "partial.safetensors"
    with tiny_model.hooks([("blocks.1.mlp.hook_post", interrupt)]):
        partial = top_triggers(tiny_model, corpus(), save_path=path, **args)
    assert not partial.complete and 0 < partial.n_tokens < full.n_tokens
    loaded = TopTriggers.load(path)  # the partial result was written
    assert torch.equal(loaded.activations, partial.activations) and loaded.n_docs == partial.n_docs
    resumed = top_triggers(tiny_model, CORPUS, resume=loaded, **args)
    assert resumed.complete and resumed.n_tokens == full.n_tokens
    for name in ("activations", "docs", "positions", "contexts", "next_tokens"):
        assert torch.equal(getattr(resumed, name), getattr(full, name)), name
    with pytest.raises(FileExistsError, match="overwrite=True"):
        full.save(path)


def test_merge_of_shards_equals_one_scan(tiny_model):
    args = dict(layers=[0, 1], neurons=[1, 2, 3], k=6, batch_size=2, progress=False)
    whole = top_triggers(tiny_model, CORPUS, **args)
    shards = [top_triggers(tiny_model, CORPUS, shard=(rank, 3), **args) for rank in range(3)]
    assert {d for s in shards for d in s.docs.unique().tolist()} - {-1} <= set(range(len(CORPUS)))
    assert all(set(s.docs.unique().tolist()) - {-1} <= set(range(r, len(CORPUS), 3)) for r, s in enumerate(shards))
    merged = merge(shards[::-1])  # any order
    for name in ("docs", "positions", "contexts", "next_tokens"):
        assert torch.equal(getattr(merged, name), getattr(whole, name)), name
    torch.testing.assert_close(merged.activations, whole.activations, rtol=1e-5, atol=1e-6)
    assert merged.n_tokens == whole.n_tokens and merged.n_docs == whole.n_docs == len(CORPUS)
    with pytest.raises(ValueError, match="same layers"):
        merge([whole, top_triggers(tiny_model, CORPUS, [1], [1, 2, 3], k=6, progress=False)])


def test_corpus_sources_and_errors(tiny_model, tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, text in enumerate(CORPUS[:3]):
        (folder / f"{i}.txt").write_text(text, encoding="utf-8")
    from_folder = top_triggers(tiny_model, folder, 1, [7], k=3, progress=False)
    from_list = top_triggers(tiny_model, CORPUS[:3], 1, [7], k=3, progress=False)
    from_iter = top_triggers(tiny_model, (t for t in CORPUS[:3]), 1, [7], k=3, progress=False)
    from_rows = top_triggers(tiny_model, [{"text": t} for t in CORPUS[:3]], 1, [7], k=3, progress=False)
    for other in (from_list, from_iter, from_rows):
        assert torch.equal(from_folder.docs, other.docs) and torch.equal(from_folder.positions, other.positions)
    assert set(from_folder.doc_names.values()) <= {"0.txt", "1.txt", "2.txt"} and from_folder.doc_names
    assert [name for name, _ in iter_documents(folder / "1.txt")] == ["1.txt"]

    (tmp_path / "binary.txt").write_bytes(b"\x00\x01\x02abc")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "nothing").mkdir()
    for path, match in (("binary.txt", "binary.txt looks binary"), ("latin1.txt", "latin1.txt is not UTF-8"),
                        ("empty.txt", "empty.txt is empty"), ("nothing", "holds no .txt files")):
        with pytest.raises(ValueError, match=match):
            top_triggers(tiny_model, tmp_path / path, progress=False)
    with pytest.raises(FileNotFoundError, match=r"pass it in a list: \[text\]"):
        top_triggers(tiny_model, "no such corpus", progress=False)
    with pytest.raises(TypeError, match="document 1 is a int"):
        top_triggers(tiny_model, ["fine", 3], progress=False)
    with pytest.raises(ValueError, match="document 0 is an empty string"):
        top_triggers(tiny_model, [""], progress=False)


# ---- huge corpus files: streamed in bounded memory ----------------------------------------------
def test_a_file_scanned_in_pieces_equals_brute_force(tiny_model, tiny_hf, tmp_path, monkeypatch):
    text = _long_text(20).replace(LONG_WORD, "the " * 100)
    path = tmp_path / "long.txt"
    path.write_bytes(text.encode("utf-8"))
    args = dict(layers=[0, 1], neurons=[3, 40, 200], k=5, context=6, batch_size=3, progress=False)
    _tiny_chunks(monkeypatch)
    result = top_triggers(tiny_model, path, **args)
    expected = brute_force_triggers(tiny_hf, tiny_model.tokenizer, [text], [0, 1], [3, 40, 200], 5,
                                    tiny_model.cfg.n_ctx, 6)
    _check_against_brute_force(result, expected, [0, 1], [3, 40, 200], 6)
    assert result.complete and result.n_tokens == len(tiny_model.tokenizer.encode(text, add_special_tokens=False))
    assert result.doc_names == {0: "long.txt"}
    monkeypatch.undo()  # the same text as a string, in one span: the same result
    whole = top_triggers(tiny_model, [text], **args)
    for name in ("activations", "docs", "positions", "contexts", "next_tokens"):
        assert torch.equal(getattr(result, name), getattr(whole, name)), name

    # Ctrl-C in the middle of the file, then resume= over the same file: the one-scan result
    _tiny_chunks(monkeypatch)
    calls = []

    def interrupt(activation, hook):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt

    with tiny_model.hooks([("blocks.1.mlp.hook_post", interrupt)]):
        partial = top_triggers(tiny_model, path, **args)
    assert not partial.complete and partial.n_docs == 0 and partial.resume_start > 0
    resumed = top_triggers(tiny_model, path, resume=partial, **args)
    for name in ("activations", "docs", "positions", "contexts", "next_tokens"):
        assert torch.equal(getattr(resumed, name), getattr(result, name)), name
    assert resumed.n_tokens == result.n_tokens


@pytest.mark.parametrize("data", [
    b"x" * 100 + b"\xff" + b"y" * 50,  # a byte never valid in UTF-8, past the first read
    b"x" * 63 + "日".encode()[:2] + b"z" * 40,  # a character begun in one read, broken in the next
    b"x" * 100 + "日".encode()[:2],  # a character cut off by the end of the file
])
def test_invalid_utf8_past_the_first_read_names_the_byte(tiny_model, tmp_path, monkeypatch, data):
    path = tmp_path / "bad.txt"
    path.write_bytes(data)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        where = err.start  # the oracle: Python decoding the whole file at once
    monkeypatch.setattr(corpus, "CORPUS_CHUNK_BYTES", 64)
    with pytest.raises(ValueError, match=rf"bad.txt is not UTF-8 text \(byte {where}:"):
        top_triggers(tiny_model, path, progress=False)


def test_nul_and_whitespace_past_the_first_read(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "CORPUS_CHUNK_BYTES", 8)
    (tmp_path / "late.txt").write_bytes(b"plain text, then " + b"\x00" + b"more")
    with pytest.raises(ValueError, match=r"late.txt looks binary \(a NUL byte at byte 17\)"):
        top_triggers(tiny_model, tmp_path / "late.txt", progress=False)
    (tmp_path / "blank.txt").write_bytes(b" \n\t \r\n   \n  \x0c ")  # all whitespace, over several reads
    with pytest.raises(ValueError, match="blank.txt is empty"):
        list(iter_documents(tmp_path / "blank.txt"))
    with pytest.raises(ValueError, match="blank.txt is empty"):
        top_triggers(tiny_model, tmp_path / "blank.txt", progress=False)
    (tmp_path / "leading.txt").write_bytes(b" \n\t \r\n   \n  hello")  # leading whitespace kept
    assert [t for _, t in iter_documents(tmp_path / "leading.txt")] == [" \n\t \r\n   \n  hello"]
    # a bad file in another shard's documents still stops this shard (and every rank of torchrun)
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "0.txt").write_text(CORPUS[1], encoding="utf-8")
    (tmp_path / "shards" / "1.txt").write_bytes(b"\x00")
    with pytest.raises(ValueError, match="1.txt looks binary"):
        top_triggers(tiny_model, tmp_path / "shards", shard=(0, 2), progress=False)


# ---- agreement and report ------------------------------------------------------------------------
def test_agreement_counts_top_value_token_equal_next_token(tiny_model, tiny_hf):
    triggers = top_triggers(tiny_model, CORPUS, None, list(range(0, 256, 5)), k=8, progress=False)
    result = agreement(tiny_model, triggers)
    unembed = tiny_hf.lm_head.weight.detach()
    for li, layer in enumerate(triggers.layers):
        top = (tiny_hf.transformer.h[layer].mlp.c_proj.weight.detach() @ unembed.T).argmax(-1)
        matches = examples = baseline = 0
        neurons = triggers.neurons.tolist()
        for ni, neuron in enumerate(neurons):
            for r in range(triggers.k):
                nxt = int(triggers.next_tokens[li, ni, r])
                if nxt < 0 or int(triggers.docs[li, ni, r]) < 0:
                    continue
                examples += 1
                matches += nxt == int(top[neuron])
                baseline += nxt == int(top[neurons[ni - 1]])
        assert (int(result.matches[li]), int(result.examples[li]), int(result.baseline_matches[li])) == \
            (matches, examples, baseline)
    frame = result.to_frame()
    assert frame.agreement.tolist() == pytest.approx((result.matches / result.examples).tolist())
    assert len(result.figure().data) == 2


def test_report_escapes_text_and_highlights_trigger(tiny_model, tmp_path):
    triggers = top_triggers(tiny_model, CORPUS, [1], [3, 40], k=40, context=12, progress=False)
    path = tmp_path / "memories.html"
    page = memory_report(tiny_model, triggers, path, n_examples=40)
    assert path.read_text(encoding="utf-8") == page
    assert "<script" not in page and "<b>" not in page  # corpus markup arrives as text
    assert "&lt;" in page and page.count("<mark>") == 80
    assert 'id="L1N3"' in page and 'id="L1N40"' in page
    with pytest.raises(FileExistsError, match="overwrite=True"):
        memory_report(tiny_model, triggers, path)
    fig = triggers.figure(tiny_model, 1, 3)
    hover = " ".join(fig.data[0].hovertext) + " ".join(fig.data[0].x)
    assert "<script" not in hover and "<b>" not in hover
    frame = triggers.to_frame(tiny_model)
    assert len(frame) == 2 * 40 and {"prefix", "trigger_token", "next_token"} <= set(frame.columns)


# ---- distributed ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_torchrun_two_ranks_equal_one_process(tiny_model, tiny_dir, tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, text in enumerate(CORPUS):
        (folder / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "merged.safetensors"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "probe.analyses.memories", "--model", str(tiny_dir), "--corpus", str(folder),
           "--neurons", "0", "3", "40", "200", "-k", "6", "--batch-size", "2", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = TopTriggers.load(out)
    single = top_triggers(tiny_model, folder, None, [0, 3, 40, 200], k=6, batch_size=2, progress=False)
    for name in ("docs", "positions", "contexts", "next_tokens"):
        assert torch.equal(getattr(merged, name), getattr(single, name)), name
    torch.testing.assert_close(merged.activations, single.activations, rtol=0, atol=0)
    assert merged.n_tokens == single.n_tokens and merged.n_docs == single.n_docs
    assert merged.doc_names == single.doc_names


# ---- bundled model -------------------------------------------------------------------------------
@pytest.mark.slow
def test_bundled_model_triggers_and_lookup(bundled_model):
    from transformers import GPT2LMHeadModel

    from probe import DEFAULT_MODEL, HELDOUT_TEXT

    hf = GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL, attn_implementation="eager").eval()
    n_layers = bundled_model.cfg.n_layers
    triggers = top_triggers(bundled_model, None, None, [0, 1, 2], k=3, batch_size=4, progress=False)
    assert triggers.complete and triggers.n_tokens == len(bundled_model.tokenizer.encode(HELDOUT_TEXT.read_text(), add_special_tokens=False))
    # the top trigger of each neuron, recomputed by transformers on its window alone
    ids = bundled_model.tokenizer.encode(HELDOUT_TEXT.read_text(), add_special_tokens=False)
    per_window = bundled_model.cfg.n_ctx - 1
    for li in range(n_layers):
        for ni, neuron in enumerate([0, 1, 2]):
            pos = int(triggers.positions[li, ni, 0])
            start = pos - pos % per_window
            acts, _, _, _ = hf_mlp_activations(hf, [bundled_model.tokenizer.bos_id] + ids[start:start + per_window], [li])
            assert float(acts[li][pos - start + 1, neuron]) == pytest.approx(float(triggers.activations[li, ni, 0]), abs=1e-4)
            assert float(acts[li][1:, neuron].max()) <= float(triggers.activations[li, ni, 0]) + 1e-4
    lookup = memory_lookup(bundled_model, "ROMEO:\nBut soft, what light through yonder window", -1, k=5)
    assert lookup.neurons.shape == (n_layers, 5)


# ---- other final norms ---------------------------------------------------------------------------
@pytest.mark.parametrize("config", [dict(norm="rms"), dict(final_norm=False)])
def test_direct_effect_through_an_rms_final_norm_or_none(config):
    """The oracle is the model's own forward: the sub-update m_i v_i added to the last residual with
    the final norm's scale held at its value there; the change in the predicted token's logit is
    the direct effect. (An RMSNorm does not centre: the values get a mean so that centring shows.)"""
    from probe import DecoderConfig, HookedDecoder

    torch.manual_seed(0)
    cfg = DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, **config)
    model = HookedDecoder(cfg).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
        model.blocks[1].mlp.W_out.add_(0.3)
    tokens = torch.randint(0, 50, (1, 10))
    position, k = 5, 4
    result = memory_lookup(model, tokens, position, layer=1, k=k)
    predicted = result.predicted_token
    scale_name = ["ln_final.hook_scale"] if cfg.final_norm else []
    with torch.no_grad():
        base, cache = model.run_with_cache(tokens, names=scale_name)
        for j, neuron in enumerate(result.neurons[0].tolist()):
            update = result.coefficients[0, neuron] * model.blocks[1].mlp.W_out[neuron]

            def add(resid, hook):
                resid = resid.clone()
                resid[0, position] += update
                return resid

            hooks = [("blocks.1.hook_resid_post", add)]
            if cfg.final_norm:
                hooks.append(("ln_final.hook_scale", lambda scale, hook: cache["ln_final.hook_scale"]))
            logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
            effect = float(logits[0, position, predicted] - base[0, position, predicted])
            assert float(result.prediction_effect[0, j]) == pytest.approx(effect, rel=1e-4, abs=1e-6)
        # and the value tokens read through the same norm
        values = model.blocks[1].mlp.W_out[:3] * (model.ln_final.w if cfg.final_norm else 1.0)
        expected = (values @ model.unembed.W_U).topk(5, dim=-1).indices
        assert torch.equal(value_tokens(model, 1, [0, 1, 2], 5, through_final_norm=True).top_ids, expected)


@pytest.mark.parametrize("kind", ["gemma2", "olmo2"])
def test_sandwich_memories_write_through_the_write_norm(kind, tmp_path):
    """In a sandwich block (Gemma 2; OLMo 2, whose MLP reads the residual itself) the residual receives
    ln2_post(MLP output): with its scale frozen, memory i writes m_i v_i * ln2_post.w / scale. Oracle: the
    sub-updates of all neurons add up to hook_mlp_out, and their direct effects to the whole write's effect on the
    predicted logit (before Gemma 2's logit cap)."""
    from test_variants import build

    from probe import HookedDecoder

    build(kind, tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(4))
    position, layer, d_mlp = 7, 1, model.cfg.d_mlp
    result = memory_lookup(model, tokens, position, layer=layer, k=d_mlp)
    _, cache = model.run_with_cache(tokens)
    block = model.blocks[layer]
    write_scale = cache[f"blocks.{layer}.ln2_post.hook_scale"][0, position]
    coefficients = cache[f"blocks.{layer}.mlp.hook_post"][0, position]
    writes = coefficients[:, None] * block.mlp.W_out * block.ln2_post.w / write_scale  # [d_mlp d_model]
    torch.testing.assert_close(writes.sum(0), cache[f"blocks.{layer}.hook_mlp_out"][0, position], atol=1e-5, rtol=0)
    order = result.neurons[0]
    torch.testing.assert_close(result.sizes[0], writes.norm(dim=-1)[order], atol=1e-5, rtol=1e-5)
    direction = model.ln_final.w * model.unembed.W_U[:, result.predicted_token] / cache["ln_final.hook_scale"][0, position]
    whole = cache[f"blocks.{layer}.hook_mlp_out"][0, position] @ direction
    torch.testing.assert_close(result.prediction_effect[0].sum(), whole.detach(), atol=1e-4, rtol=0)


def test_neuron_ids_that_are_not_ints_are_refused_not_truncated(tiny_model):
    """[3.7] used to become neuron 3 and True neuron 1, without a word."""
    for bad in ([3.7], [True], torch.tensor([2.0])):
        with pytest.raises(TypeError, match="neuron"):
            value_tokens(tiny_model, 0, bad)
