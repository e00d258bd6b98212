"""Logit lens and tuned lens, checked against `transformers`' hidden states on the same checkpoint."""
from __future__ import annotations

import json
import time

import pytest
import torch

from hf_oracle import hf_forward_states
import torch.nn.functional as F

from probe.analyses.lens import (
    TunedLens, compare_lenses, heldout_split, lens_sites, logit_lens, train_tuned_lens,
)
from probe import HELDOUT_TEXT

ATOL = 1e-4


def hf_states(hf, tokens):
    """Hidden states the lens reads, straight from transformers: the embeddings, after every block,
    after every attention sublayer, and the final residual before ln_f (HF's last hidden state is after it)."""
    logits, attn_out, hidden, final = hf_forward_states(hf, tokens)
    posts = list(hidden[1:-1]) + [final]
    mids = [hidden[l] + attn_out[l] for l in range(len(attn_out))]
    return logits, hidden[0], mids, posts


def hf_lens(hf, resid):
    with torch.no_grad():
        return hf.lm_head(hf.transformer.ln_f(resid))


def test_logit_lens_matches_transformers(tiny_model, tiny_hf, tokens):
    result = logit_lens(tiny_model, tokens, include_mid=True)
    logits, embed, mids, posts = hf_states(tiny_hf, tokens)
    expected = [embed]
    for mid, post in zip(mids, posts):
        expected += [mid, post]
    assert result.sites == lens_sites(tiny_model.cfg.n_layers, include_mid=True)
    assert result.logits.shape == (3, 1 + 2 * tiny_model.cfg.n_layers, tokens.shape[1], tiny_model.cfg.d_vocab)
    for layer, resid in enumerate(expected[:-1]):
        torch.testing.assert_close(result.logits[:, layer], hf_lens(tiny_hf, resid), atol=ATOL, rtol=0)
    torch.testing.assert_close(result.logits[:, -1], logits, atol=ATOL, rtol=0)
    assert torch.equal(result.logits[:, -1], tiny_model(tokens))  # the last row is the model's output itself


def test_frozen_final_scale(tiny_model, tiny_hf, tokens):
    result = logit_lens(tiny_model, tokens, norm="frozen")
    _, embed, _, posts = hf_states(tiny_hf, tokens)
    ln = tiny_hf.transformer.ln_f
    final = posts[-1]
    scale = (final.var(-1, unbiased=False, keepdim=True) + ln.eps).sqrt()
    for layer, resid in enumerate([embed] + posts[:-1]):
        by_hand = ((resid - resid.mean(-1, keepdim=True)) / scale * ln.weight + ln.bias) @ tiny_hf.lm_head.weight.T
        torch.testing.assert_close(result.logits[:, layer], by_hand, atol=ATOL, rtol=0)
    recomputed = logit_lens(tiny_model, tokens)
    assert not torch.allclose(recomputed.logits[:, 0], result.logits[:, 0], atol=1e-3)  # the option changes something


def test_top_k_target_rank_and_kl_brute_force(tiny_model, tokens):
    k = 4
    result = logit_lens(tiny_model, tokens, k=k)
    probs = result.logits.double().softmax(-1)
    ranked = probs.argsort(-1, descending=True)
    assert torch.equal(result.top_tokens, ranked[..., :k])
    torch.testing.assert_close(result.top_probs.double(), probs.gather(-1, ranked[..., :k]), atol=1e-6, rtol=0)
    # default target: the next input token, and the model's own prediction at the last position
    target = torch.cat([tokens[:, 1:], tiny_model(tokens)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(result.target, target)
    position_of_target = (ranked == target[:, None, :, None]).float().argmax(-1)
    assert torch.equal(result.target_rank, position_of_target)
    torch.testing.assert_close(result.target_prob.double(),
                               probs.gather(-1, target[:, None, :, None].expand(-1, probs.shape[1], -1, 1))[..., 0],
                               atol=1e-6, rtol=0)
    final = probs[:, -1:].expand_as(probs)
    kl = F.kl_div(probs.log(), final, reduction="none").sum(-1)  # KL(final || layer)
    torch.testing.assert_close(result.kl.double(), kl, atol=1e-5, rtol=0)
    assert float(result.kl[:, -1].abs().max()) == 0.0


def test_bfloat16_lens_ranks_count_the_logits_above_the_target(tiny_model, tokens):
    """bfloat16 logits tie often; the rank counts the tokens strictly above the target, on the logits themselves."""
    import copy

    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    result = logit_lens(model, tokens, k=3, include_mid=True)
    assert result.logits.dtype == torch.bfloat16
    logits = result.logits.float()
    target = result.target[:, None, :, None].expand(-1, logits.shape[1], -1, 1)
    chosen = logits.gather(-1, target)
    assert torch.equal(result.target_rank, (logits > chosen).sum(-1))
    probs = logits.double().softmax(-1)
    torch.testing.assert_close(result.top_probs.double(), probs.topk(3, dim=-1).values, atol=1e-6, rtol=0)
    torch.testing.assert_close(result.target_prob.double(), probs.gather(-1, target)[..., 0], atol=1e-6, rtol=0)
    picked = logits.gather(-1, result.top_tokens)  # ties may come in either order; their logits may not differ
    assert torch.equal(picked, logits.topk(3, dim=-1).values)


def test_fixed_target_and_frame(tiny_model, tokens):
    result = logit_lens(tiny_model, tokens, target=7)
    assert bool((result.target == 7).all())
    frame = result.to_frame()
    assert len(frame) == tokens.numel() * len(result.sites)
    assert {"prompt", "layer", "site", "label", "position", "token", "top_token", "top_prob", "target",
            "target_prob", "target_rank", "kl"} <= set(frame.columns)
    row = frame[(frame.prompt == 2) & (frame.layer == 1) & (frame.position == 5)].iloc[0]
    assert row.target_prob == pytest.approx(float(result.logits[2, 1, 5].float().softmax(-1)[7]), abs=1e-6)
    assert len(result.to_frame(top_k=True)) == len(frame) * 5


def test_padded_batch_matches_single_prompts(tiny_model):
    prompts = ["To be, or not to be, that is the question", "The quick brown fox"]
    batched = logit_lens(tiny_model, prompts)
    for i, prompt in enumerate(prompts):
        alone = logit_lens(tiny_model, prompt)
        n = alone.tokens.shape[1]
        torch.testing.assert_close(batched.logits[i, :, :n], alone.logits[0], atol=ATOL, rtol=0)
        assert torch.equal(batched.target[i, :n], alone.target[0])
    frame = batched.to_frame()
    assert len(frame) == int(batched.mask.sum()) * len(batched.sites)  # padding is not an observation


def test_figures_escape_tokens(tiny_model):
    result = logit_lens(tiny_model, "<script>alert('x')</script> & <b>markup</b>")
    heat = result.figure()
    shown = list(heat.data[0].x) + [t for row in heat.data[0].text for t in row]
    assert shown and not any("<" in s or ">" in s for s in shown)
    assert any("&lt;" in s for s in heat.data[0].x)
    assert list(heat.data[0].y) == result.labels
    for fig in (result.figure(color="target_logprob"), result.figure("target"), result.figure("kl")):
        assert "<script" not in (fig.layout.title.text or "")
    with pytest.raises(ValueError, match="kind"):
        result.figure("bogus")


def test_target_figure_plots_every_rank_on_its_log_axis(tiny_model, tokens):
    """The rank panel is on a log axis, where a rank of 0 (the top token) would vanish: it plots rank + 1."""
    result = logit_lens(tiny_model, tokens[:1], target=int(tokens[0, 3]))
    fig = result.figure("target", position=2)
    expected = result.target_rank[0, :, 2].numpy() + 1
    assert list(fig.data[1].y) == list(expected)
    assert fig.layout.yaxis2.type == "log" and min(fig.data[1].y) >= 1
    top = logit_lens(tiny_model, tokens[:1])  # default target at the last position: the final layer's own top token
    assert top.figure("target", position=-1).data[1].y[-1] == 1


def test_figures_show_control_characters(tiny_model):
    """Byte-level BPE has tokens that are lone control bytes; plotly fails to draw them raw."""
    strings = tiny_model.tokenizer.token_strings(list(range(tiny_model.cfg.d_vocab)))
    odd = [i for i, s in enumerate(strings) if not s.isprintable() and s not in ("\n", "\t")]
    assert odd
    fig = logit_lens(tiny_model, torch.tensor([odd[:20]]), target=odd[0]).figure()
    shown = list(fig.data[0].x) + [t for row in fig.data[0].text for t in row] + [h for row in fig.data[0].hovertext for h in row]
    assert all(s.isprintable() for s in shown)
    assert any("&lt;0x" in s for s in fig.data[0].x)  # shown as <0x07>


def test_bad_arguments(tiny_model, tokens):
    with pytest.raises(ValueError, match="norm"):
        logit_lens(tiny_model, tokens, norm="fixed")
    with pytest.raises(ValueError, match="k="):
        logit_lens(tiny_model, tokens, k=0)
    with pytest.raises(ValueError, match="not one"):
        logit_lens(tiny_model, tokens, target=" question mark")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        logit_lens(tiny_model, tokens, target=10**6)


# ---- tuned lens -----------------------------------------------------------------------------------
def test_tuned_lens_translates_by_hand(tiny_model, tiny_hf, tokens):
    lens = TunedLens.for_model(tiny_model, include_mid=False)
    identity = logit_lens(tiny_model, tokens, lens=lens)
    torch.testing.assert_close(identity.logits, logit_lens(tiny_model, tokens).logits, atol=1e-5, rtol=0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        lens.A.copy_(0.1 * torch.randn(lens.A.shape, generator=gen))
        lens.b.copy_(0.1 * torch.randn(lens.b.shape, generator=gen))
    result = logit_lens(tiny_model, tokens, lens=lens)
    _, embed, _, posts = hf_states(tiny_hf, tokens)
    for layer, h in enumerate([embed] + posts[:-1]):
        translated = h + h @ lens.A[layer] + lens.b[layer]
        torch.testing.assert_close(result.logits[:, layer], hf_lens(tiny_hf, translated), atol=ATOL, rtol=0)
    torch.testing.assert_close(result.logits[:, -1], tiny_model(tokens), atol=0, rtol=0)
    assert result.lens_name == "tuned lens"
    with pytest.raises(ValueError, match="include_mid=True"):
        logit_lens(tiny_model, tokens, lens=lens, include_mid=True)


def test_save_load_round_trip_never_overwrites(tiny_model, tmp_path):
    lens = TunedLens.for_model(tiny_model, include_mid=True, training={"note": "test"})
    with torch.no_grad():
        lens.A.normal_()
        lens.b.normal_()
    path = lens.save(tmp_path / "tuned_lens")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "translators.safetensors"]
    config = json.loads((path / "config.json").read_text())
    assert config["sites"] == list(lens.sites) and config["training"] == {"note": "test"}
    loaded = TunedLens.load(path, tiny_model)
    assert torch.equal(loaded.A, lens.A) and torch.equal(loaded.b, lens.b) and loaded.config == lens.config
    before = (path / "translators.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        TunedLens.for_model(tiny_model).save(path)
    assert (path / "translators.safetensors").read_bytes() == before
    TunedLens.for_model(tiny_model).save(path, overwrite=True)
    assert TunedLens.load(path).sites == tuple(lens_sites(tiny_model.cfg.n_layers)[:-1])
    assert not list(tmp_path.glob(".tuned_lens.*"))  # no temporary directory left behind
    with pytest.raises(FileNotFoundError, match="config.json"):
        TunedLens.load(tmp_path / "nowhere")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a tuned-lens config"):
        TunedLens.load(path)


def test_lens_refuses_another_checkpoint(tiny_model, tmp_path):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import TINY, build_hf_checkpoint
    from probe import HookedDecoder

    other = HookedDecoder.from_pretrained(build_hf_checkpoint(tmp_path / "other", seed=5, **TINY))
    lens = TunedLens.for_model(other)
    with pytest.raises(ValueError, match="different checkpoint"):
        logit_lens(tiny_model, "To be", lens=lens)
    deeper = HookedDecoder.from_pretrained(build_hf_checkpoint(tmp_path / "deeper", seed=5, **{**TINY, "n_layer": 3}))
    with pytest.raises(ValueError, match="n_layers"):
        logit_lens(tiny_model, "To be", lens=TunedLens.for_model(deeper))


def test_training_lowers_kl_and_leaves_model_alone(tiny_model):
    from tests.conftest import TOKENIZER_TEXT

    params = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    text = " ".join(TOKENIZER_TEXT * 6)
    lens = train_tuned_lens(tiny_model, text, steps=25, batch_tokens=128, lr=3e-3, seed=1, include_mid=True)
    once, again = (train_tuned_lens(tiny_model, text[:500], steps=2, batch_tokens=16, seed=2) for _ in range(2))
    assert torch.equal(once.A, again.A) and not torch.equal(once.A, torch.zeros_like(once.A))  # a fixed seed reproduces it
    assert all(torch.equal(p, params[n]) for n, p in tiny_model.named_parameters())
    assert all(p.grad is None for p in tiny_model.parameters())
    comparison = compare_lenses(tiny_model, lens, " ".join(reversed(TOKENIZER_TEXT)))
    assert comparison.sites == lens_sites(tiny_model.cfg.n_layers, include_mid=True)
    assert bool((comparison.tuned_kl[:-1] < comparison.logit_kl[:-1]).all())
    assert float(comparison.logit_kl[-1]) == 0.0 == float(comparison.tuned_kl[-1])
    # compare_lenses's logit-lens numbers are logit_lens's, averaged over the same (non-BOS) tokens
    short = TOKENIZER_TEXT[1]
    ids = torch.tensor([[tiny_model.tokenizer.bos_id] + tiny_model.tokenizer.encode(short, add_special_tokens=False)])
    assert ids.shape[1] <= tiny_model.cfg.n_ctx
    by_lens = logit_lens(tiny_model, ids, include_mid=True)
    torch.testing.assert_close(compare_lenses(tiny_model, lens, short).logit_kl, by_lens.kl[0, :, 1:].mean(-1),
                               atol=1e-5, rtol=1e-4)
    frame = comparison.to_frame()
    assert set(frame.lens) == {"logit lens", "tuned lens"} and len(frame) == 2 * len(comparison.sites)
    comparison.figure()


# ---- the bundled model ----------------------------------------------------------------------------
def test_logit_lens_kl_falls_with_depth(bundled_model):
    tokens = bundled_model.to_tokens(heldout_split()[1])[:, : bundled_model.cfg.n_ctx]
    kl = logit_lens(bundled_model, tokens).mean_kl()
    depth = torch.arange(len(kl), dtype=kl.dtype)
    slope = ((depth - depth.mean()) * (kl - kl.mean())).sum() / ((depth - depth.mean()) ** 2).sum()
    assert float(slope) < 0, kl
    assert float(kl[0]) > float(kl[-2]) > 0.0, kl


@pytest.mark.slow
def test_tuned_lens_beats_logit_lens_on_bundled_model(bundled_model, tmp_path):
    assert HELDOUT_TEXT.is_file()
    start = time.process_time()  # CPU time: the machine may be shared, the budget is the work done
    lens = train_tuned_lens(bundled_model)  # the defaults: bundled held-out text, training part, seed 0
    assert time.process_time() - start < 300  # the default training stays short on a CPU
    comparison = compare_lenses(bundled_model, lens)  # the evaluation part, never trained on
    assert bool((comparison.tuned_kl[:-1] < comparison.logit_kl[:-1]).all()), comparison.to_frame()
    loaded = TunedLens.load(lens.save(tmp_path / "lens"), bundled_model)
    assert torch.equal(loaded.A, lens.A.cpu()) and torch.equal(loaded.b, lens.b.cpu())


def test_target_ids_must_be_integers(tiny_model, tokens):
    """A float tensor used to be cast with .long(), so target 3.9 silently became token 3."""
    import numpy as np

    with pytest.raises(TypeError, match="integer token ids"):
        logit_lens(tiny_model, tokens, target=torch.full(tokens.shape, 3.9))
    with pytest.raises(TypeError, match="integer token ids"):
        logit_lens(tiny_model, tokens, target=torch.ones(tokens.shape, dtype=torch.bool))
    by_numpy = logit_lens(tiny_model, tokens, target=np.int64(7))
    assert bool((by_numpy.target == 7).all())
    probs = by_numpy.logits.double().softmax(-1)[..., 7]
    torch.testing.assert_close(by_numpy.target_prob.double(), probs, atol=1e-6, rtol=0)


def test_training_arguments_are_checked(tiny_model):
    text = "To be, or not to be, that is the question"
    with pytest.raises(ValueError, match="n_ctx=1"):  # was a ZeroDivisionError
        train_tuned_lens(tiny_model, text, steps=1, n_ctx=1)
    with pytest.raises(ValueError, match="batch_tokens=0"):  # was a lens trained on nothing, final KL NaN
        train_tuned_lens(tiny_model, text, steps=1, batch_tokens=0)
    with pytest.raises(ValueError, match="n_ctx=-3"):
        compare_lenses(tiny_model, TunedLens.for_model(tiny_model), text, n_ctx=-3)


def test_tuned_lens_trains_on_text_without_a_bos(no_bos_model):
    """GPT-1's vocabulary has no BOS: every position of the text is a training token (none is skipped)."""
    from probe.analyses.tuned_lens_training import collect_residuals

    text = "To be, or not to be, that is the question. " * 4
    n_tokens = len(no_bos_model.tokenizer.encode(text, add_special_tokens=False))
    sites = lens_sites(no_bos_model.cfg.n_layers)
    resid = collect_residuals(no_bos_model, text, sites, max_tokens=10_000, n_ctx=16)
    assert resid.shape == (n_tokens, len(sites), no_bos_model.cfg.d_model)
    _, cache = no_bos_model.run_with_cache(no_bos_model.to_tokens(text)[:, :16], names=sites)
    torch.testing.assert_close(resid[:16, 0], cache[sites[0]][0], atol=1e-6, rtol=0)  # the first window, from position 0
    lens = train_tuned_lens(no_bos_model, text, steps=2, batch_tokens=32, n_ctx=16, seed=0)
    assert all(v == v for v in lens.config.training.values() if isinstance(v, float))  # no NaN recorded


def test_logit_lens_on_parallel_blocks_matches_transformers(tmp_path):
    """GPT-NeoX (Pythia): the lens reads transformers' hidden states through its own final norm and head;
    with parallel blocks there is no residual between attention and MLP, so include_mid is refused."""
    from test_variants import build

    from probe import HookedDecoder

    hf = build("neox", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, hf.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    result = logit_lens(model, tokens)
    with torch.no_grad():
        out = hf(tokens, output_hidden_states=True)
        for layer, resid in enumerate(out.hidden_states[:-1]):  # the last is after the final norm
            expected = hf.lm_head(hf.gpt_neox.final_layer_norm(resid))
            torch.testing.assert_close(result.logits[:, layer], expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(result.logits[:, -1], out.logits, atol=ATOL, rtol=0)
    for call in (lambda: logit_lens(model, tokens, include_mid=True),
                 lambda: train_tuned_lens(model, "some text " * 20, include_mid=True, steps=1),
                 lambda: TunedLens.for_model(model, include_mid=True)):
        with pytest.raises(ValueError, match="parallel .*leave include_mid=False"):
            call()


def test_ranks_and_top_k_follow_the_logits_through_near_ties(tiny_model, tokens):
    """Every token gets a twin whose logit is 2e-7 higher: distinct float32 logits, but their log-probs
    (logit - logsumexp, near -5.8 where a float32 step is 4.8e-7) round together. Ranks and the top-k were
    read off the log-probs, so a target's twin above it was not counted (rank 1 too good) and twins came in
    either order; numpy on the lens's own logits is the oracle."""
    import copy

    import numpy as np
    from torch import nn

    model = copy.deepcopy(tiny_model)
    with torch.no_grad():
        weight = model.unembed.weight.detach().clone()
        weight[1::2] = weight[0::2][: weight[1::2].shape[0]]
        bias = torch.zeros(weight.shape[0])
        bias[1::2] = 2e-7
    model.unembed.weight, model.unembed.bias = nn.Parameter(weight), nn.Parameter(bias)  # untied, on the copy only
    result = logit_lens(model, tokens, k=6, include_mid=True)
    logits = result.logits.double().numpy()
    assert (logits[..., 1::2] > logits[..., 0::2]).all()  # the twins really are apart in the logits
    target = result.target.numpy()[:, None, :, None].repeat(logits.shape[1], 1)
    chosen = np.take_along_axis(logits, target, -1)
    np.testing.assert_array_equal(result.target_rank.numpy(), (logits > chosen).sum(-1))
    np.testing.assert_array_equal(np.take_along_axis(logits, result.top_tokens.numpy(), -1), -np.sort(-logits, -1)[..., :6])
    probs = torch.from_numpy(logits).softmax(-1)
    torch.testing.assert_close(result.top_probs.double(), probs.gather(-1, result.top_tokens), atol=1e-6, rtol=0)
