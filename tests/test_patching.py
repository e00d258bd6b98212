"""Activation and attribution patching against transformers runs patched by hand (one per site)."""
from __future__ import annotations

import pytest
import torch

from probe.analyses import Site, attribution_patch, compare_patching, logit_diff_metric, patch

ANSWERS, COUNTERFACTUALS = [5, 9], [7, 2]
CORRUPTED_POS = 6


@pytest.fixture(scope="module")
def prompts(tiny_model):
    gen = torch.Generator().manual_seed(21)
    clean = torch.randint(0, tiny_model.cfg.d_vocab, (2, 11), generator=gen)
    corrupted = clean.clone()
    corrupted[:, CORRUPTED_POS] = (clean[:, CORRUPTED_POS] + 17) % tiny_model.cfg.d_vocab
    return clean, corrupted


@pytest.fixture(scope="module")
def metric(tiny_model):
    return logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)


def hf_metric(logits: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(logits.shape[0])
    return (logits[rows, -1, ANSWERS] - logits[rows, -1, COUNTERFACTUALS]).mean()


class HFRun:
    """A transformers forward that records (and optionally overwrites) one site, by module hooks."""

    def __init__(self, hf):
        self.hf, self.dh = hf, hf.config.n_embd // hf.config.n_head

    def _module_and_slice(self, site: Site):
        block = self.hf.transformer.h[site.layer]
        pos = slice(None) if site.pos is None else site.pos
        if site.act == "z":
            return block.attn.c_proj, "input", (slice(None), pos, slice(site.head * self.dh, (site.head + 1) * self.dh))
        if site.act == "resid_pre":
            return block, "input", (slice(None), pos)
        return (block.mlp if site.act == "mlp_out" else block.attn), "output", (slice(None), pos)

    def run(self, tokens, site: Site, replace=None, grad=False):
        """(metric, the site's full activation); `replace` is a full activation to copy the site's slice from."""
        module, where, index = self._module_and_slice(site)
        seen = {}

        def pre(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            if replace is not None:
                x = x.clone()
                x[index] = replace[index]
            seen["act"] = x
            return ((x,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

        def post(mod, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if replace is not None:
                out = out.clone()
                out[index] = replace[index]
            seen["act"] = out
            return (out,) + tuple(output[1:]) if isinstance(output, tuple) else out

        handle = (module.register_forward_pre_hook(pre, with_kwargs=True) if where == "input"
                  else module.register_forward_hook(post))
        try:
            with torch.set_grad_enabled(grad):
                value = hf_metric(self.hf(tokens).logits)
        finally:
            handle.remove()
        return value, seen["act"]


def hf_exact(hf, clean, corrupted, site):
    run = HFRun(hf)
    clean_value, clean_act = run.run(clean, site)
    corrupted_value, _ = run.run(corrupted, site)
    patched, _ = run.run(corrupted, site, replace=clean_act)
    return float((patched - corrupted_value) / (clean_value - corrupted_value))


def hf_attribution(hf, clean, corrupted, site):
    run = HFRun(hf)
    clean_value, clean_act = run.run(clean, site)
    corrupted_value, act = run.run(corrupted, site, grad=True)
    (grad,) = torch.autograd.grad(corrupted_value, act)
    _, _, index = run._module_and_slice(site)
    delta = ((clean_act - act.detach()) * grad)[index].sum()
    return float(delta / (clean_value.detach() - corrupted_value.detach()))


def test_head_sweep_matches_transformers(tiny_model, tiny_hf, prompts, metric):
    clean, corrupted = prompts
    result = patch(tiny_model, clean, corrupted, metric, sites="heads", max_rows=3 * clean.shape[0])
    cfg = tiny_model.cfg
    expected = torch.tensor([hf_exact(tiny_hf, clean, corrupted, Site("z", l, head=h))
                             for l in range(cfg.n_layers) for h in range(cfg.n_heads)])
    torch.testing.assert_close(result.recovered, expected, atol=1e-4, rtol=1e-3)
    with torch.no_grad():
        assert result.clean == pytest.approx(float(hf_metric(tiny_hf(clean).logits)), abs=1e-4)
    frame = result.to_frame()
    assert list(frame[["layer", "head"]].itertuples(index=False, name=None)) == [
        (l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads)]


@pytest.mark.parametrize("sweep", ["resid_pre", "mlp_out", "attn_out"])
def test_layer_by_position_sweeps_match_transformers(tiny_model, tiny_hf, prompts, metric, sweep):
    clean, corrupted = prompts
    result = patch(tiny_model, clean, corrupted, metric, sites=sweep)
    n = clean.shape[1]
    assert len(result.sites) == tiny_model.cfg.n_layers * n
    for i in [CORRUPTED_POS, n + CORRUPTED_POS, n + n - 1, n + 2]:
        expected = hf_exact(tiny_hf, clean, corrupted, result.sites[i])
        assert float(result.recovered[i]) == pytest.approx(expected, abs=1e-4)
    # positions before the corrupted token saw identical prompts: nothing there to restore
    early = torch.tensor([s.pos < CORRUPTED_POS for s in result.sites])
    assert result.recovered[early].abs().max() < 1e-5


def test_whole_residual_at_layer_0_recovers_everything(tiny_model, prompts, metric):
    clean, corrupted = prompts
    result = patch(tiny_model, clean, corrupted, metric, sites=[Site("resid_pre", 0), Site("resid_pre", 1, pos=CORRUPTED_POS - 1)])
    assert float(result.recovered[0]) == pytest.approx(1.0, abs=1e-5)
    assert float(result.recovered[1]) == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("sites", ["heads", [Site("resid_pre", 1, pos=CORRUPTED_POS), Site("mlp_out", 0),
                                             Site("z", 1, head=2, pos=10), Site("attn_out", 1, pos=10)]])
def test_attribution_matches_transformers_gradients(tiny_model, tiny_hf, prompts, metric, sites):
    clean, corrupted = prompts
    result = attribution_patch(tiny_model, clean, corrupted, metric, sites=sites)
    expected = torch.tensor([hf_attribution(tiny_hf, clean, corrupted, s) for s in result.sites])
    torch.testing.assert_close(result.recovered, expected, atol=1e-4, rtol=1e-3)
    assert result.method == "attribution"


def test_figures_show_the_grid_and_the_comparison(tiny_model, prompts, metric):
    clean, corrupted = prompts
    exact = patch(tiny_model, clean, corrupted, metric, sites="resid_pre")
    estimate = attribution_patch(tiny_model, clean, corrupted, metric, sites="resid_pre")
    heat = exact.figure()
    n = clean.shape[1]
    assert torch.allclose(torch.tensor(heat.data[0].z, dtype=torch.float32), exact.recovered.view(-1, n))
    assert list(heat.data[0].x) == exact.labels and len(exact.labels) == n
    scatter = compare_patching(exact, estimate).data[1]
    assert torch.allclose(torch.tensor(scatter.x, dtype=torch.float32), exact.recovered)
    assert torch.allclose(torch.tensor(scatter.y, dtype=torch.float32), estimate.recovered)
    heads = patch(tiny_model, clean, corrupted, metric, sites="heads").figure()
    assert torch.tensor(heads.data[0].z).shape == (tiny_model.cfg.n_layers, tiny_model.cfg.n_heads)


def test_text_prompts_are_escaped_in_figures(tiny_model):
    metric = logit_diff_metric(tiny_model, " dog", " the")
    result = patch(tiny_model, "<b>the</b> dog", "<i>the</i> dog", metric, sites="resid_pre")
    text = result.figure().to_json()
    assert "<b>" not in text and "<i>" not in text and "&lt;" in text


def test_bad_requests_are_explained(tiny_model, prompts, metric):
    clean, corrupted = prompts
    with pytest.raises(ValueError, match="same shape"):
        patch(tiny_model, clean, corrupted[:, :-1], metric)
    with pytest.raises(ValueError, match="nothing to recover"):
        patch(tiny_model, clean, clean, metric)
    with pytest.raises(ValueError, match="nothing to recover"):
        patch(tiny_model, clean, clean, lambda logits, tokens, mask: torch.zeros(logits.shape[0]))
    tiny = lambda logits, tokens, mask: 1e-6 * metric(logits, tokens, mask)  # noqa: E731  small, and still moving
    result = patch(tiny_model, clean, corrupted, tiny, sites="resid_pre")
    reference = patch(tiny_model, clean, corrupted, metric, sites="resid_pre")
    torch.testing.assert_close(result.recovered, reference.recovered, atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match="head="):
        patch(tiny_model, clean, corrupted, metric, sites=[Site("mlp_out", 0, head=1)])
    with pytest.raises(ValueError, match="not a sweep"):
        patch(tiny_model, clean, corrupted, metric, sites="neurons")
    with pytest.raises(ValueError, match="different sites"):
        compare_patching(patch(tiny_model, clean, corrupted, metric, sites=[Site("mlp_out", 0)]),
                         patch(tiny_model, clean, corrupted, metric, sites=[Site("mlp_out", 1)]))


def test_pruned_model_sweeps_only_existing_heads(prompts):
    from probe import DecoderConfig, HookedDecoder

    torch.manual_seed(1)
    cfg = DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=20, heads_per_layer=(2, 3))
    model = HookedDecoder(cfg).eval()
    clean, corrupted = (p % cfg.d_vocab for p in prompts)
    metric = logit_diff_metric(model, [1, 2], [3, 4])
    result = patch(model, clean, corrupted, metric, sites="heads")
    assert [(s.layer, s.head) for s in result.sites] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    z = torch.tensor(result.figure().data[0].z, dtype=torch.float64)
    assert z.shape == (2, 3) and torch.isnan(z[0, 2]) and not torch.isnan(z[1]).any()
    estimate = attribution_patch(model, clean, corrupted, metric, sites="heads")
    assert estimate.recovered.shape == (5,)


def test_a_lambda_metric_does_not_put_a_tag_into_the_figure(tiny_model, prompts):
    clean, corrupted = prompts
    result = patch(tiny_model, clean, corrupted, lambda logits, tokens, mask: logits[:, -1, 3] - logits[:, -1, 4],
                   sites=[Site("resid_pre", 1, pos=CORRUPTED_POS)])
    assert "<lambda>" not in result.figure().to_json()


def test_frame_holds_raw_token_strings(tiny_model):
    """The frame is data (CSV), not HTML: its token column is the token itself, unescaped and unsuffixed."""
    metric = logit_diff_metric(tiny_model, " dog", " the")
    result = patch(tiny_model, "<b>the</b> dog", "<i>the</i> dog", metric, sites="resid_pre")
    tokens = tiny_model.to_tokens("<i>the</i> dog")[0]
    strings = tiny_model.tokenizer.token_strings(tokens.tolist())
    frame = result.to_frame()
    assert list(frame.token) == [strings[s.pos] for s in result.sites]
    assert any("<" in t for t in frame.token) and not any("&lt;" in t for t in frame.token)


def test_padded_token_ids_with_their_mask_match_each_pair_alone(tiny_model, tiny_hf):
    """Left-padded token ids and their attention_mask: the batch's patched metric is the mean of each
    (clean, corrupted) pair patched alone, the pairs checked against transformers."""
    pairs = [("To be, or not to be, that is the dog", "To be, or not to be, that is the the"),
             ("The quick brown the", "The quick brown dog")]
    dog, the = tiny_model.tokenizer.encode(" dog", add_special_tokens=False)[0], tiny_model.tokenizer.encode(" the", add_special_tokens=False)[0]
    clean, mask = tiny_model.to_tokens([c for c, _ in pairs], return_attention_mask=True, padding_side="left")
    corrupted, mask2 = tiny_model.to_tokens([x for _, x in pairs], return_attention_mask=True, padding_side="left")
    assert torch.equal(mask, mask2) and not bool(mask.all())
    metric = logit_diff_metric(tiny_model, the, dog)
    sites = [Site("z", 0, head=1), Site("z", 1, head=3), Site("mlp_out", 0)]
    for method in ("exact", "attribution"):
        batched = patch(tiny_model, clean, corrupted, metric, sites=sites, method=method, attention_mask=mask)
        alone = [patch(tiny_model, c, x, metric, sites=sites, method=method) for c, x in pairs]
        torch.testing.assert_close(batched.patched, (alone[0].patched + alone[1].patched) / 2, atol=1e-5, rtol=0)
        assert batched.corrupted == pytest.approx((alone[0].corrupted + alone[1].corrupted) / 2, abs=1e-5)
    for c, x in pairs:  # the single pairs against transformers, as the other tests do for fixed answers
        c_ids, x_ids = tiny_model.to_tokens(c), tiny_model.to_tokens(x)
        with torch.no_grad():
            hf_clean, hf_corrupted = tiny_hf(c_ids).logits[0, -1], tiny_hf(x_ids).logits[0, -1]
        single = patch(tiny_model, c, x, metric, sites=sites)
        assert single.clean == pytest.approx(float(hf_clean[the] - hf_clean[dog]), abs=1e-4)
        assert single.corrupted == pytest.approx(float(hf_corrupted[the] - hf_corrupted[dog]), abs=1e-4)


def test_a_metric_must_give_one_value_per_row(tiny_model, prompts):
    clean, corrupted = prompts
    for method in ("exact", "attribution"):
        with pytest.raises(ValueError, match=r"one value per row, shape \(2,\)"):
            patch(tiny_model, clean, corrupted, lambda logits, tokens, mask: logits[:, -1, :2], method=method)


def test_a_single_site_is_patched_like_a_list_of_one(tiny_model, tiny_hf, prompts, metric):
    """`sites=Site(...)` alone (not in a list) was a bare "'Site' object is not iterable"."""
    clean, corrupted = prompts
    site = Site("z", 1, head=2, pos=CORRUPTED_POS)
    for method, oracle in (("exact", hf_exact), ("attribution", hf_attribution)):
        result = patch(tiny_model, clean, corrupted, metric, sites=site, method=method)
        assert result.sites == [site]
        assert float(result.recovered[0]) == pytest.approx(oracle(tiny_hf, clean, corrupted, site), abs=1e-4)
