"""head_scores: each detector against a brute-force score of transformers' output_attentions."""
from __future__ import annotations

import pytest
import torch

from probe.analyses import head_scores
from probe.analyses.heads import repeated_random_tokens

KINDS = ["previous_token", "first_token", "duplicate_token", "induction"]


def brute_force_scores(hf, tokens: torch.Tensor, kind: str) -> torch.Tensor:
    """[layer head]: loops over prompts, queries and keys, straight from the definitions."""
    with torch.no_grad():
        attn = torch.stack(hf(tokens, output_attentions=True).attentions).double()  # [layer batch head q k]
    total = torch.zeros(attn.shape[0], attn.shape[2], dtype=torch.float64)
    count = 0
    ids = tokens.tolist()
    for b, row in enumerate(ids):
        for q in range(len(row)):
            if kind == "previous_token":
                keys = [q - 1] if q >= 1 else []
            elif kind == "first_token":
                keys = [0] if q >= 1 else []
            elif kind == "duplicate_token":
                keys = [k for k in range(q) if row[k] == row[q]]
            else:
                keys = [k for k in range(1, q + 1) if row[k - 1] == row[q]]
            if keys:
                count += 1
                total += attn[:, b, :, q, keys].sum(dim=-1)
    return (total / count).float()


@pytest.mark.parametrize("kind", KINDS)
def test_scores_on_repeated_random_tokens_match_transformers(tiny_model, tiny_hf, kind):
    result = head_scores(tiny_model, kind, n_samples=3, seq_len=9, seed=5, batch_size=2)
    expected = brute_force_scores(tiny_hf, result.tokens, kind)
    torch.testing.assert_close(result.scores, expected, atol=1e-5, rtol=1e-4)
    frame = result.to_frame()
    assert list(frame.columns) == ["layer", "head", "label", "score"]
    row = frame[(frame["layer"] == 1) & (frame["head"] == 3)]
    assert row.score.item() == pytest.approx(float(expected[1, 3]), abs=1e-5) and row.label.item() == "L1H3"


@pytest.mark.parametrize("kind", ["duplicate_token", "induction"])
def test_scores_on_given_tokens_match_transformers(tiny_model, tiny_hf, kind):
    text = "the dog and the cat and the dog and the cat sleep"
    tokens = tiny_model.to_tokens(text)
    result = head_scores(tiny_model, kind, text)
    torch.testing.assert_close(result.scores, brute_force_scores(tiny_hf, tokens, kind), atol=1e-5, rtol=1e-4)


def test_random_sequences_repeat_after_bos_and_follow_the_seed(tiny_model):
    rows = repeated_random_tokens(tiny_model, n_samples=4, seq_len=7, seed=1)
    bos = tiny_model.tokenizer.bos_id
    assert rows.shape == (4, 15) and (rows[:, 0] == bos).all() and (rows[:, 1:] != bos).all()
    assert torch.equal(rows[:, 1:8], rows[:, 8:])
    assert torch.equal(rows, repeated_random_tokens(tiny_model, 4, 7, seed=1))
    assert not torch.equal(rows, repeated_random_tokens(tiny_model, 4, 7, seed=2))


def test_bad_kind_and_lengths_are_explained(tiny_model):
    with pytest.raises(ValueError, match="previous_token"):
        head_scores(tiny_model, "copying")
    with pytest.raises(ValueError, match="seq_len"):
        head_scores(tiny_model, "induction", seq_len=tiny_model.cfg.n_ctx)
    with pytest.raises(ValueError, match="no query"):
        head_scores(tiny_model, "induction", torch.arange(5))


def test_heatmap_has_layers_down_heads_across(tiny_model):
    result = head_scores(tiny_model, "previous_token", n_samples=2, seq_len=5)
    fig = result.figure()
    assert torch.allclose(torch.tensor(fig.data[0].z, dtype=torch.float32), result.scores)
    assert fig.layout.xaxis.title.text == "head" and fig.layout.yaxis.title.text == "layer"


@pytest.fixture(scope="module")
def bundled_hf(bundled_model):
    from transformers import GPT2LMHeadModel

    from probe import DEFAULT_MODEL

    return GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL, attn_implementation="eager").eval()


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_bundled_model_scores_match_transformers(bundled_model, bundled_hf, kind):
    result = head_scores(bundled_model, kind, n_samples=4, seq_len=40)
    torch.testing.assert_close(result.scores, brute_force_scores(bundled_hf, result.tokens, kind), atol=1e-4, rtol=1e-3)


@pytest.mark.slow
def test_bundled_model_has_induction_and_previous_token_heads(bundled_model):
    """The trained model's circuits, not the code: an induction head puts at least 30% of its weight on
    the one induction target (uniform attention would put ~1/pos, about 2%), and needs a
    previous-token head before it, so it sits above layer 0."""
    from probe import HELDOUT_TEXT

    induction = head_scores(bundled_model, "induction", n_samples=16, seq_len=50)
    best = induction.top(1).iloc[0]
    assert best.score > 0.3 and best.layer >= 1, induction.top(3)
    text = HELDOUT_TEXT.read_text()[:4000]
    previous = head_scores(bundled_model, "previous_token", [text[i:i + 400] for i in range(0, 4000, 400)])
    assert previous.top(1).iloc[0].score > 0.3, previous.top(3)


def test_pruned_heads_have_no_score():
    from probe import DecoderConfig, HookedDecoder

    cfg = DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=24, heads_per_layer=(1, 3))
    result = head_scores(HookedDecoder(cfg).eval(), "previous_token", n_samples=2, seq_len=6)
    assert result.scores[0, 1:].isnan().all() and result.scores[1, 3].isnan()
    assert not result.scores[0, 0].isnan() and not result.scores[1, :3].isnan().any()
    assert len(result.to_frame()) == 4
