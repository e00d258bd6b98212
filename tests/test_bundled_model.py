"""The model shipped inside the package (probe.DEFAULT_MODEL), checked on its own merits.

Every number here is computed by the test from the shipped files (weights, tokenizer.json,
heldout.txt) with oracles of its own: n-gram baselines fit here, random token sequences drawn
here, attention patterns cross-checked against `transformers`. Nothing is read from metrics.json
except to check that the training record exists, and nothing touches the network or ../shared.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import probe
from probe import HookedDecoder

MODEL_DIR = Path(probe.DEFAULT_MODEL)
N_CTX_EVAL = 128  # window length for text evaluation: long enough for context to matter, short enough to be fast


@pytest.fixture(scope="module")
def model() -> HookedDecoder:
    torch.manual_seed(0)
    return HookedDecoder.from_pretrained(probe.DEFAULT_MODEL).eval()


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel.from_pretrained(MODEL_DIR, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def heldout() -> str:
    return Path(probe.HELDOUT_TEXT).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def heldout_ids(model, heldout) -> torch.Tensor:
    return torch.tensor(model.tokenizer.encode(heldout, add_special_tokens=False), dtype=torch.long)


def bos_windows(ids: torch.Tensor, bos: int, n_ctx: int, max_rows: int) -> torch.Tensor:
    body = n_ctx - 1
    n = min(len(ids) // body, max_rows)
    rows = ids[: n * body].view(n, body)
    return torch.cat([torch.full((n, 1), bos, dtype=torch.long), rows], dim=1)


def repeated_random(model, n_seqs=16, length=50, seed=1234) -> torch.Tensor:
    """BOS + `length` random non-special tokens + the same tokens again."""
    gen = torch.Generator().manual_seed(seed)
    vocab, bos = model.cfg.d_vocab, model.tokenizer.bos_id
    ids = [i for i in range(vocab) if i != bos]
    body = torch.tensor(ids)[torch.randint(0, len(ids), (n_seqs, length), generator=gen)]
    return torch.cat([torch.full((n_seqs, 1), bos, dtype=torch.long), body, body], dim=1)


def patterns(model, tokens) -> torch.Tensor:
    """[layer batch head query key] from probe's activation cache."""
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names=lambda n: n.endswith("attn.hook_pattern"))
    return torch.stack([cache[f"blocks.{l}.attn.hook_pattern"] for l in range(model.cfg.n_layers)])


# ---- the files ------------------------------------------------------------------------------------
def test_directory_is_a_small_gpt2_checkpoint():
    files = {p.name for p in MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "training_args.json", "metrics.json"} <= files
    assert json.loads((MODEL_DIR / "config.json").read_text())["model_type"] == "gpt2"
    size = sum(p.stat().st_size for p in MODEL_DIR.rglob("*") if p.is_file())
    assert size < 20 * 2**20, f"{MODEL_DIR} is {size / 2**20:.1f} MiB; the package budget is 20 MiB"
    args = json.loads((MODEL_DIR / "training_args.json").read_text())
    assert args["seed"] is not None and args["corpus_files_heldout"]
    assert not set(args["corpus_files_heldout"]) & set(args["corpus_files_train"])


def test_loads_offline_with_the_documented_shape(model, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = HookedDecoder.from_pretrained(probe.DEFAULT_MODEL)
    cfg = again.cfg
    assert 3 <= cfg.n_layers <= 6 and 192 <= cfg.d_model <= 384 and cfg.n_ctx >= 256
    assert cfg.tied_embeddings and cfg.activation.value == "gelu_new"
    assert again.tokenizer.backend.token_to_id("<|endoftext|>") == again.tokenizer.bos_id
    assert 1000 <= cfg.d_vocab <= 16384 and cfg.d_vocab == again.tokenizer.vocab_size


def test_tokenizer_round_trips_heldout_text(model, heldout):
    for text in (heldout[:20000], "Odd  spacing,\ttabs\n\n and é — ünïcode <|endoftext|>!"):
        assert model.tokenizer.decode(model.tokenizer.encode(text, add_special_tokens=False)) == text
    chars_per_token = 20000 / len(model.tokenizer.encode(heldout[:20000], add_special_tokens=False))
    assert chars_per_token > 2.5, "a BPE trained on this corpus should compress its own language"


def test_heldout_text_is_a_few_plays(heldout):
    assert 100_000 < len(heldout.encode()) < 1_000_000
    speakers = re.findall(r"^[A-Z][A-Za-z]+\.$", heldout, flags=re.M)
    assert len(speakers) > 500  # play format: a speaker line, then the speech


def test_logits_match_transformers(model, hf_model, heldout_ids):
    tokens = bos_windows(heldout_ids, model.tokenizer.bos_id, 256, max_rows=2)
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf_model(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


# ---- what it learned ------------------------------------------------------------------------------
def test_heldout_loss_beats_bigram_fit_on_the_same_plays(model, heldout_ids):
    """Bigram counts from the first half of the held-out plays, scored on the second half (so the
    baseline has seen these very plays' names and words, the model has not). Its add-k constant is
    the best of a grid on the scored text itself, which flatters it further."""
    vocab, bos = model.cfg.d_vocab, model.tokenizer.bos_id
    half = len(heldout_ids) // 2
    fit, scored = heldout_ids[:half], heldout_ids[half:]
    rows = bos_windows(scored, bos, N_CTX_EVAL, max_rows=64)
    with torch.no_grad():
        logits = model(rows)[:, :-1]
    model_loss = float(F.cross_entropy(logits.reshape(-1, vocab), rows[:, 1:].reshape(-1)))

    codes = fit[:-1] * vocab + fit[1:]
    uniq, counts = torch.unique(codes, return_counts=True)
    prev, nxt = rows[:, :-1].reshape(-1), rows[:, 1:].reshape(-1)
    query = prev * vocab + nxt
    pos = torch.searchsorted(uniq, query).clamp(max=len(uniq) - 1)
    pair_count = torch.where(uniq[pos] == query, counts[pos], 0).double()
    prev_count = torch.bincount(fit[:-1], minlength=vocab).double()[prev]
    bigram = min(float(-torch.log((pair_count + k) / (prev_count + k * vocab)).mean()) for k in (1e-3, 1e-2, 0.03, 0.1, 0.3, 1))
    uni = torch.bincount(fit, minlength=vocab).double()
    unigram = float(-torch.log((uni[nxt] + 1) / (uni.sum() + vocab)).mean())

    assert model_loss < unigram - 1.0, (model_loss, unigram)
    assert model_loss < bigram - 0.25, f"model {model_loss:.3f} nats/token vs add-k bigram {bigram:.3f}"


def test_in_context_learning_on_repeated_random_tokens(model):
    length = 50
    tokens = repeated_random(model, length=length)
    with torch.no_grad():
        logits = model(tokens)
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
    # target at position p has loss losses[:, p - 1]; copy 1 is positions 1..L, copy 2 is L+1..2L;
    # each copy's first token is unpredictable, so both means skip it
    first = losses[:, 1:length].mean()
    second = losses[:, length + 1:].mean()
    assert second < 0.5 * first, f"second copy {second:.2f} vs first copy {first:.2f} nats"


def induction_scores(pattern: torch.Tensor, length: int) -> torch.Tensor:
    """pattern [... batch head query key] -> [... head]: attention from each second-copy token to the
    token right after its first occurrence (query q, key q - length + 1)."""
    q = torch.arange(length + 1, 2 * length + 1)
    return pattern[..., q, q - length + 1].mean(dim=(-3, -1))


def test_attention_patterns_match_transformers(model, hf_model):
    tokens = repeated_random(model, n_seqs=4, seed=7)
    ours = patterns(model, tokens)
    with torch.no_grad():
        theirs = hf_model(tokens, output_attentions=True).attentions
    for layer in range(model.cfg.n_layers):
        torch.testing.assert_close(ours[layer], theirs[layer], atol=1e-4, rtol=0)


def test_an_induction_head_exists_and_transformers_agrees(model, hf_model):
    length = 50
    tokens = repeated_random(model, length=length, seed=99)
    scores = induction_scores(patterns(model, tokens), length)  # [layer head]
    layer, head = divmod(int(scores.argmax()), model.cfg.n_heads)
    with torch.no_grad():
        hf_pattern = hf_model(tokens, output_attentions=True).attentions[layer]
    hf_score = induction_scores(hf_pattern, length)[head]
    assert abs(float(hf_score) - float(scores[layer, head])) < 1e-4  # the same head, scored from transformers
    assert scores[layer, head] >= 0.5, f"best induction head {layer}.{head} scores {scores.max():.2f}"
    # the first layer cannot be an induction head: it needs a previous-token head to compose with
    assert scores[0].max() < 0.5


def test_a_previous_token_head_exists(model, heldout_ids):
    tokens = bos_windows(heldout_ids[5000:], model.tokenizer.bos_id, N_CTX_EVAL, max_rows=8)
    pattern = patterns(model, tokens)
    q = torch.arange(1, tokens.shape[1])
    scores = pattern[..., q, q - 1].mean(dim=(1, 3))  # [layer head]
    assert scores.max() >= 0.5, f"best previous-token head scores {scores.max():.2f}"
    # and it is specific: the same head does not also attend to the current token or 2 back as much
    layer, head = divmod(int(scores.argmax()), model.cfg.n_heads)
    q2 = q[1:]
    assert pattern[layer, :, head, q2, q2 - 2].mean() < 0.5 * scores[layer, head]


PROMPT = (
    "DUKE.\nIf music be the food of love, play on;\nGive me excess of it, that, surfeiting,\n"
    "The appetite may sicken and so die.\n\nCURIO.\nWill you go hunt, my lord?\n\nDUKE.\nWhat, Curio?\n\n"
)


def test_greedy_continuation_looks_like_a_play(model):
    tokens = model.to_tokens(PROMPT)
    with torch.no_grad():
        for _ in range(80):
            next_token = model(tokens)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
    text = model.tokenizer.decode(tokens[0].tolist())
    assert text.startswith("<|endoftext|>" + PROMPT)
    lines = text[len("<|endoftext|>" + PROMPT):].split("\n")
    speaker = re.compile(r"^[A-Z][A-Za-z']*(?: [A-Z][A-Za-z']*)*\.$")  # "CURIO.", "SIR TOBY.", "Macb."
    at = [i for i, line in enumerate(lines) if speaker.match(line)]
    assert at, f"no speaker line in the continuation: {lines!r}"
    speech = [line for line in lines[at[0] + 1:] if line and not speaker.match(line)]
    assert speech and len(re.findall(r"[A-Za-z']+", speech[0])) >= 3, f"no speech after the speaker line: {lines!r}"


# ---- the training script --------------------------------------------------------------------------
def test_strip_gutenberg_removes_the_frame():
    from probe.cli.tiny_corpus import strip_gutenberg as strip

    framed = ("The Project Gutenberg EBook of Hamlet\r\nLicence blah\r\n"
              "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n\r\nHAMLET\r\n\r\nHam.\r\nWords.\r\n"
              "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\nMore licence\r\n")
    assert strip(framed) == "HAMLET\n\nHam.\nWords.\n"
    assert strip("HAMLET\n\nHam.\nWords.\n") == "HAMLET\n\nHam.\nWords.\n"


@pytest.mark.slow
def test_training_script_runs_end_to_end(tmp_path, monkeypatch):
    """A few steps of scripts/train_tiny.py on a made-up corpus: it writes a loadable checkpoint."""
    from probe.cli import train_tiny
    from probe.cli.tiny_corpus import HELDOUT_PLAYS

    corpus = tmp_path / "texts"
    corpus.mkdir()
    words = "love death king crown night sword heaven blood grace honour father daughter".split()
    gen = torch.Generator().manual_seed(0)
    for name in ("hamlet", "lear", "othello") + HELDOUT_PLAYS:
        lines = []
        for _ in range(300):
            picks = torch.randint(0, len(words), (7,), generator=gen).tolist()
            lines.append(f"{name.upper()}.\n" + " ".join(words[i] for i in picks).capitalize() + ".\n")
        (corpus / f"{name}_gut.txt").write_text("\n".join(lines))
    out, held = tmp_path / "model", tmp_path / "heldout.txt"
    train_tiny.main(["--corpus", str(corpus), "--out", str(out), "--heldout-out", str(held), "--steps", "4",
                     "--vocab-size", "300", "--n-layers", "2", "--d-model", "32", "--n-heads", "2",
                     "--n-ctx", "128", "--batch-size", "4", "--min-span", "5", "--max-span", "20",
                     "--warmup", "2", "--log-every", "2"])
    loaded = HookedDecoder.from_pretrained(out)
    assert loaded.cfg.n_layers == 2 and loaded.cfg.d_vocab == 300
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps_done"] == 4 and metrics["val_loss"] > 0
    assert held.read_text().startswith(HELDOUT_PLAYS[0].upper())


def test_training_script_never_overwrites_without_being_asked(tmp_path):
    """Its defaults are the shipped model and held-out text: an existing --out or --heldout-out is
    refused before any training, and kept as it was."""
    from probe.cli import train_tiny

    out, held = tmp_path / "model", tmp_path / "heldout.txt"
    out.mkdir()
    (out / "config.json").write_text("{}")
    for args in (["--out", str(out), "--heldout-out", str(tmp_path / "new.txt")],
                 ["--out", str(tmp_path / "new"), "--heldout-out", str(held)], []):
        held.write_text("earlier")
        with pytest.raises(SystemExit) as exit_info:
            train_tiny.main(["--corpus", str(tmp_path / "no-such-corpus"), *args])
        assert exit_info.value.code == 2
        assert held.read_text() == "earlier" and (out / "config.json").read_text() == "{}"
    assert not (tmp_path / "new").exists() and not (tmp_path / "new.txt").exists()


def test_training_batches_hold_the_promised_rows():
    """sample_batch's three kinds of rows: plain text windows, text with a span copied later, and a
    random span repeated to fill the row (checked from the rows themselves, not from the code's
    bookkeeping): every row starts with BOS and no other position holds it."""
    from probe.cli.tiny_corpus import sample_batch

    bos, vocab, n_ctx = 0, 500, 64
    stream = torch.arange(1, 5001) % (vocab - 1) + 1  # strictly periodic text: a copy is visible as a jump
    gen = torch.Generator().manual_seed(0)
    rows = sample_batch(stream, 8, n_ctx, bos, gen, repeat_frac=0.25, min_span=5, max_span=10,
                       random_span_frac=0.0, vocab=vocab, pure_repeat_frac=0.5)
    assert rows.shape == (8, n_ctx) and (rows[:, 0] == bos).all() and (rows[:, 1:] != bos).all()

    def period(row):  # the smallest p with row[i] == row[i + p] everywhere after BOS
        body = row[1:]
        return next(p for p in range(1, len(body)) if torch.equal(body[:-p], body[p:]))

    for row in rows[4:]:  # pure repeats: a 5-10 token span, then the same span again and again
        assert 5 <= period(row) <= 10
    for row in rows[2:4]:  # untouched text windows: consecutive stream tokens
        assert ((row[2:] - row[1:-1]) % (vocab - 1) == 1).all()
    for row in rows[:2]:  # a copied span breaks the stream's +1 steps in at most two places
        jumps = int(((row[2:] - row[1:-1]) % (vocab - 1) != 1).sum())
        assert 1 <= jumps <= 2
