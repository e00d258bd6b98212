"""Head ablation against transformers: c_proj rows zeroed, or the head's slice of c_proj's input replaced."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from probe.analyses import ablate_heads, head_ablation_effects, logit_diff_metric
from hf_oracle import hf_head_inputs


def d_head(hf) -> int:
    return hf.config.n_embd // hf.config.n_head


def hf_zeroed(hf, heads):
    """A copy of the transformers model whose attention output projection ignores the given heads."""
    hf = copy.deepcopy(hf)
    dh = d_head(hf)
    with torch.no_grad():
        for layer, head in heads:
            hf.transformer.h[layer].attn.c_proj.weight[head * dh:(head + 1) * dh, :] = 0  # Conv1D: [in, out]
    return hf


def hf_logits_with_heads_replaced(hf, tokens, replacements) -> torch.Tensor:
    """replacements: {(layer, head): tensor broadcastable to [batch pos d_head]} written into c_proj's input."""
    dh, handles = d_head(hf), []

    def edit(mod, args, layer):
        merged = args[0].clone()
        for (l, h), value in replacements.items():
            if l == layer:
                merged[..., h * dh:(h + 1) * dh] = value
        return (merged,)

    for layer, block in enumerate(hf.transformer.h):
        handles.append(block.attn.c_proj.register_forward_pre_hook(lambda mod, args, layer=layer: edit(mod, args, layer)))
    try:
        with torch.no_grad():
            return hf(tokens).logits
    finally:
        for h in handles:
            h.remove()


def hf_loss(hf, tokens) -> float:
    with torch.no_grad():
        logits = hf(tokens).logits
    per_prompt = torch.stack([F.cross_entropy(logits[b, :-1], tokens[b, 1:]) for b in range(tokens.shape[0])])
    return float(per_prompt.mean())


@pytest.mark.parametrize("heads", [[(0, 1)], [(0, 1), (1, 3), (1, 0)]])
def test_zero_ablation_matches_transformers_with_c_proj_rows_zeroed(tiny_model, tiny_hf, tokens, heads):
    logits = ablate_heads(tiny_model, tokens, heads, method="zero")
    with torch.no_grad():
        expected = hf_zeroed(tiny_hf, heads)(tokens).logits
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        assert (logits - tiny_hf(tokens).logits).abs().max() > 1e-3  # the ablation did something


def test_mean_ablation_uses_the_reference_mean_per_position(tiny_model, tiny_hf, tokens):
    gen = torch.Generator().manual_seed(11)
    reference = torch.randint(0, tiny_model.cfg.d_vocab, (5, 20), generator=gen)
    heads = [(0, 2), (1, 1)]
    logits = ablate_heads(tiny_model, tokens, heads, method="mean", reference=reference)
    ref = hf_head_inputs(tiny_hf, reference)
    dh, n = d_head(tiny_hf), tokens.shape[1]
    expected = hf_logits_with_heads_replaced(
        tiny_hf, tokens, {(l, h): ref[l][:, :n, h * dh:(h + 1) * dh].mean(dim=0) for l, h in heads})
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_resample_ablation_takes_a_reference_prompt(tiny_model, tiny_hf, tokens):
    gen = torch.Generator().manual_seed(12)
    one = torch.randint(0, tiny_model.cfg.d_vocab, (1, 17), generator=gen)
    logits = ablate_heads(tiny_model, tokens, [(1, 2)], method="resample", reference=one)
    dh = d_head(tiny_hf)
    expected = hf_logits_with_heads_replaced(tiny_hf, tokens, {(1, 2): hf_head_inputs(tiny_hf, one)[1][:, :, 2 * dh:3 * dh]})
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)

    several = torch.randint(0, tiny_model.cfg.d_vocab, (4, 17), generator=gen)
    first = ablate_heads(tiny_model, tokens, [(1, 2)], method="resample", reference=several, seed=3)
    torch.testing.assert_close(first, ablate_heads(tiny_model, tokens, [(1, 2)], method="resample", reference=several, seed=3))
    ref = hf_head_inputs(tiny_hf, several)[1][:, :, 2 * dh:3 * dh]
    for b in range(tokens.shape[0]):  # each prompt got one of the reference prompts' outputs
        options = [hf_logits_with_heads_replaced(tiny_hf, tokens[b:b + 1], {(1, 2): ref[r]}) for r in range(4)]
        assert min(float((first[b] - o[0]).abs().max()) for o in options) < 1e-4


def test_effects_match_one_transformers_run_per_head(tiny_model, tiny_hf, tokens):
    cfg = tiny_model.cfg
    result = head_ablation_effects(tiny_model, tokens, max_rows=3 * tokens.shape[0])  # chunks of 3 heads and 1
    base = hf_loss(tiny_hf, tokens)
    expected = torch.tensor([[hf_loss(hf_zeroed(tiny_hf, [(l, h)]), tokens) - base for h in range(cfg.n_heads)]
                             for l in range(cfg.n_layers)])
    torch.testing.assert_close(result.effects, expected, atol=1e-4, rtol=0)
    assert float(result.baseline.mean()) == pytest.approx(base, abs=1e-4)
    frame = result.to_frame()
    assert len(frame) == cfg.n_layers * cfg.n_heads
    row = frame[(frame["layer"] == 1) & (frame["head"] == 2)]
    assert row.effect.item() == pytest.approx(float(expected[1, 2]), abs=1e-4)
    torch.testing.assert_close(head_ablation_effects(tiny_model, tokens).effects, result.effects, atol=1e-5, rtol=0)
    fig = result.figure()
    assert torch.allclose(torch.tensor(fig.data[0].z, dtype=torch.float32), result.effects)


def test_effects_on_a_logit_difference_with_mean_ablation(tiny_model, tiny_hf, tokens):
    answers, counterfactuals = [5, 9, 40], [7, 2, 41]
    metric = logit_diff_metric(tiny_model, answers, counterfactuals)
    result = head_ablation_effects(tiny_model, tokens, metric, method="mean", max_rows=2 * tokens.shape[0])
    dh = d_head(tiny_hf)
    ref = hf_head_inputs(tiny_hf, tokens)
    rows = torch.arange(3)

    def logit_diff(logits):
        return float((logits[rows, -1, answers] - logits[rows, -1, counterfactuals]).mean())

    with torch.no_grad():
        base = logit_diff(tiny_hf(tokens).logits)
    for l, h in [(0, 0), (0, 3), (1, 1)]:
        mean = ref[l][..., h * dh:(h + 1) * dh].mean(dim=0)
        ablated = logit_diff(hf_logits_with_heads_replaced(tiny_hf, tokens, {(l, h): mean}))
        assert float(result.effects[l, h]) == pytest.approx(ablated - base, abs=1e-4)


def test_padded_text_batch_scores_each_prompt_as_if_alone(tiny_model, tiny_hf):
    texts = ["the dog sleeps on the lazy fox", "To be, or not"]
    result = head_ablation_effects(tiny_model, texts)
    singles = [tiny_model.to_tokens(t) for t in texts]
    for l, h in [(0, 1), (1, 3)]:
        zeroed = hf_zeroed(tiny_hf, [(l, h)])
        expected = sum(hf_loss(zeroed, t) - hf_loss(tiny_hf, t) for t in singles) / len(texts)
        assert float(result.effects[l, h]) == pytest.approx(expected, abs=1e-4)


def test_model_is_left_unchanged(tiny_model, tokens):
    with torch.no_grad():
        before = tiny_model(tokens)
    head_ablation_effects(tiny_model, tokens, method="resample")
    ablate_heads(tiny_model, tokens, [(0, 0)])
    with torch.no_grad():
        torch.testing.assert_close(tiny_model(tokens), before, atol=0, rtol=0)


def test_bad_requests_are_explained(tiny_model, tokens):
    with pytest.raises(ValueError, match="layer < 2"):
        ablate_heads(tiny_model, tokens, [(2, 0)])
    with pytest.raises(ValueError, match="choose one of"):
        ablate_heads(tiny_model, tokens, [(0, 0)], method="noise")
    with pytest.raises(ValueError, match="reference="):
        ablate_heads(tiny_model, tokens[:1], [(0, 0)], method="mean")
    with pytest.raises(ValueError, match="at least as long"):
        ablate_heads(tiny_model, tokens, [(0, 0)], method="mean", reference=tokens[:, :5])
    with pytest.raises(ValueError, match="one token"):
        logit_diff_metric(tiny_model, "the dog", " cat")


def test_pruned_layers_ablate_their_own_heads(tokens):
    """A structurally pruned model (layer 1 keeps 2 of 4 heads): the oracle is weight surgery, the
    head's columns of the output projection zeroed, which never touches hook_z."""
    from probe import DecoderConfig, HookedDecoder

    torch.manual_seed(0)
    cfg = DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=20, heads_per_layer=(4, 2))
    model = HookedDecoder(cfg).eval()
    tokens = tokens % cfg.d_vocab
    result = head_ablation_effects(model, tokens, max_rows=tokens.shape[0])
    assert result.effects[1, 2:].isnan().all() and not result.effects[:, :2].isnan().any()
    assert len(result.to_frame()) == 6

    def loss(m):
        with torch.no_grad():
            logits = m(tokens)
        return float(F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()))

    base = loss(model)
    for layer, head in [(0, 3), (1, 1)]:
        cut = copy.deepcopy(model)
        with torch.no_grad():
            cut.blocks[layer].attn.out.weight[:, head * cfg.d_head:(head + 1) * cfg.d_head] = 0
        assert float(result.effects[layer, head]) == pytest.approx(loss(cut) - base, abs=1e-4)
    with pytest.raises(ValueError, match="head count"):
        ablate_heads(model, tokens, [(1, 2)])


def test_resample_never_hands_a_prompt_a_shorter_references_padding(tiny_model, tiny_hf):
    """References given as text are right-padded: a prompt may only be resampled from a reference that is
    real at all of its positions, else it would receive the padding tokens' activations."""
    prompt = tiny_model.to_tokens("The quick brown fox")
    long, short = "To be, or not to be, that is the question", "To be"
    n, dh = prompt.shape[1], d_head(tiny_hf)
    ref = hf_head_inputs(tiny_hf, tiny_model.to_tokens(long))[1][:, :n, 2 * dh:3 * dh]
    expected = hf_logits_with_heads_replaced(tiny_hf, prompt, {(1, 2): ref})
    for seed in range(8):  # uniform draws over both references would pick the short one about half the time
        logits = ablate_heads(tiny_model, prompt, [(1, 2)], method="resample", reference=[long, short], seed=seed)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_logit_diff_metric_counts_positions_among_real_tokens(tiny_model, tiny_hf):
    """position=-1 is each prompt's last real token and position=k its k-th, on either padding side, as in
    direct_logit_attribution; the oracle is transformers on each prompt alone."""
    texts = ["To be, or not to be, that is the question", "The quick brown fox"]
    answers, counterfactuals = [5, 9], [7, 2]
    alone = []
    with torch.no_grad():
        for text in texts:
            alone.append(tiny_hf(tiny_model.to_tokens(text)).logits[0])
    for side in ("right", "left"):
        tokens, mask = tiny_model.to_tokens(texts, return_attention_mask=True, padding_side=side)
        with torch.no_grad():
            logits = tiny_model(tokens, attention_mask=mask)
        for position in (-1, -3, 2, None):
            values = logit_diff_metric(tiny_model, answers, counterfactuals, position=position)(logits, tokens, mask)
            index = -1 if position is None else position
            expected = torch.stack([alone[b][index, answers[b]] - alone[b][index, counterfactuals[b]] for b in range(2)])
            torch.testing.assert_close(values, expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="past the end"):
        logit_diff_metric(tiny_model, 5, 7, position=15)(logits, tokens, mask)


def test_padded_token_ids_take_an_attention_mask(tiny_model, tiny_hf):
    """Token ids padded by hand (here on the left) with their mask: each prompt scores as if alone."""
    texts = ["the dog sleeps on the lazy fox", "To be, or not"]
    tokens, mask = tiny_model.to_tokens(texts, return_attention_mask=True, padding_side="left")
    result = head_ablation_effects(tiny_model, tokens, attention_mask=mask)
    singles = [tiny_model.to_tokens(t) for t in texts]
    for l, h in [(0, 1), (1, 3)]:
        zeroed = hf_zeroed(tiny_hf, [(l, h)])
        for b, single in enumerate(singles):
            expected = hf_loss(zeroed, single) - hf_loss(tiny_hf, single)
            assert float(result.per_prompt[l, h, b] - result.baseline[b]) == pytest.approx(expected, abs=1e-4)
    logits = ablate_heads(tiny_model, tokens, [(0, 1)], attention_mask=mask)
    with torch.no_grad():
        expected = hf_zeroed(tiny_hf, [(0, 1)])(singles[1]).logits[0]
    torch.testing.assert_close(logits[1, -singles[1].shape[1]:], expected, atol=1e-4, rtol=0)


def test_a_metric_must_give_one_value_per_row(tiny_model, tokens):
    def mean_metric(logits, tokens, mask):  # the common slip: the batch mean instead of per-row values
        return (logits[:, -1, 3] - logits[:, -1, 4]).mean()

    with pytest.raises(ValueError, match=r"one value per row, shape \(3,\)"):
        head_ablation_effects(tiny_model, tokens, mean_metric)


def test_ids_as_numpy_ints_are_accepted_and_bools_or_floats_refused(tiny_model, tokens):
    import numpy as np

    logits = ablate_heads(tiny_model, tokens, [(np.int64(0), np.int64(1))])
    torch.testing.assert_close(logits, ablate_heads(tiny_model, tokens, [(0, 1)]), atol=0, rtol=0)
    with torch.no_grad():
        full = tiny_model(tokens)
    mask = torch.ones_like(tokens)
    by_numpy = logit_diff_metric(tiny_model, np.int64(5), [np.int32(7)])(full, tokens, mask)
    torch.testing.assert_close(by_numpy, full[:, -1, 5] - full[:, -1, 7], atol=0, rtol=0)
    with pytest.raises(ValueError, match="layer"):
        ablate_heads(tiny_model, tokens, [(True, 0)])  # was the hook name 'blocks.True.attn.hook_z'
    with pytest.raises(TypeError, match="not a token id"):
        logit_diff_metric(tiny_model, True, 7)
    with pytest.raises(TypeError, match="integer token ids"):
        logit_diff_metric(tiny_model, torch.tensor([5.7]), torch.tensor([7]))
