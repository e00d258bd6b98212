"""Metrics computed from the final residual at the logits they read, against the full logits and `transformers`' autograd."""
from __future__ import annotations

import pytest
import torch

from probe import HookedDecoder
from probe.analyses import Site, attribution_patch, head_ablation_effects, logit_diff_metric, patch
from probe.analyses.metric_reads import evaluate_output, logit_reads, read_logits
from probe.processing import process_weights

ANSWERS, COUNTERFACTUALS = [5, 9], [7, 2]


def perturbed_llama(directory):
    """A random Llama (untied unembedding, RMSNorm weights away from 1) saved with transformers, and its reload."""
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=40,
                                            tie_word_embeddings=False))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() == 1 and name.endswith("weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen))
    hf.save_pretrained(directory)
    return tf.LlamaForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    hf = perturbed_llama(directory)
    return hf, HookedDecoder.from_pretrained(directory).eval()


@pytest.fixture(scope="module")
def biased(tiny_model):
    """The tiny GPT-2 with its final LayerNorm folded into the unembedding, which gives it an unembedding bias."""
    model = process_weights(tiny_model, center_writing_weights=False, center_unembed=False, fold_value_biases=False)
    assert model.unembed.bias is not None and float(model.unembed.bias.detach().abs().max()) > 0
    return model


def prompts(model, seed=21, n=11, corrupt_at=6):
    gen = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, model.cfg.d_vocab, (2, n), generator=gen)
    corrupted = clean.clone()
    corrupted[:, corrupt_at] = (clean[:, corrupt_at] + 17) % model.cfg.d_vocab
    return clean, corrupted


def generic(metric):
    """The same metric without its declared reads: analyses then evaluate it on the full logits."""
    return lambda logits, tokens, mask: metric(logits, tokens, mask)


@pytest.fixture(params=["tiny_model", "biased", "llama"])
def model(request):
    return request.getfixturevalue("llama_pair")[1] if request.param == "llama" else request.getfixturevalue(request.param)


def test_read_logits_equal_the_full_logits_at_the_read_positions_and_columns(model):
    tokens, _ = prompts(model)
    mask = torch.ones_like(tokens)
    mask[1, 8:] = 0  # the second prompt right-padded: its last real token is at 7
    with torch.no_grad():
        logits = model(tokens, attention_mask=mask)
        final = model(tokens, attention_mask=mask, stop_at_layer=model.cfg.n_layers)
        positions, columns = torch.tensor([10, 7]), torch.tensor([[1, 4, 4], [0, 3, 99]])
        expected = logits[torch.arange(2)[:, None], positions[:, None], columns]
        torch.testing.assert_close(read_logits(model, final, positions, columns), expected, atol=1e-5, rtol=1e-5)
        metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
        assert logit_reads(metric) is not None and logit_reads(generic(metric)) is None
        torch.testing.assert_close(evaluate_output(model, metric, final, tokens, mask),
                                   logits[[0, 1], [10, 7], ANSWERS] - logits[[0, 1], [10, 7], COUNTERFACTUALS],
                                   atol=1e-5, rtol=1e-5)


def test_read_logits_apply_the_logit_soft_cap(tiny_model):
    import copy

    from probe.softcap import SoftCap

    model = copy.deepcopy(tiny_model)
    model.unembed.cap = SoftCap(0.5)  # small enough that every logit is visibly capped
    tokens, _ = prompts(model)
    with torch.no_grad():
        logits = model(tokens)
        final = model(tokens, stop_at_layer=model.cfg.n_layers)
        columns = torch.tensor([[3, 5], [8, 1]])
        expected = logits[torch.arange(2)[:, None], 4, columns]
        torch.testing.assert_close(read_logits(model, final, torch.tensor([4, 4]), columns), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("sites", ["heads", "resid_pre"])
def test_attribution_from_the_read_columns_equals_the_full_logits_path(model, sites):
    clean, corrupted = prompts(model)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    fast = attribution_patch(model, clean, corrupted, metric, sites=sites)
    slow = attribution_patch(model, clean, corrupted, generic(metric), sites=sites)
    torch.testing.assert_close(fast.patched, slow.patched, atol=1e-5, rtol=1e-5)
    assert fast.clean == pytest.approx(slow.clean, abs=1e-5) and fast.corrupted == pytest.approx(slow.corrupted, abs=1e-5)


def test_exact_patching_from_the_read_columns_equals_the_full_logits_path(biased):
    clean, corrupted = prompts(biased)
    metric = logit_diff_metric(biased, ANSWERS, COUNTERFACTUALS)
    fast = patch(biased, clean, corrupted, metric, sites="heads", max_rows=6)
    slow = patch(biased, clean, corrupted, generic(metric), sites="heads", max_rows=6)
    torch.testing.assert_close(fast.patched, slow.patched, atol=1e-5, rtol=1e-5)


def test_head_ablation_effects_from_the_read_columns_equal_the_full_logits_path(biased):
    tokens, _ = prompts(biased)
    metric = logit_diff_metric(biased, ANSWERS, COUNTERFACTUALS)
    fast = head_ablation_effects(biased, tokens, metric, max_rows=6)
    slow = head_ablation_effects(biased, tokens, generic(metric), max_rows=6)
    torch.testing.assert_close(fast.per_prompt, slow.per_prompt, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.baseline, slow.baseline, atol=1e-5, rtol=1e-5)


def hf_resid_attribution(hf, clean, corrupted, layer, pos):
    """transformers' autograd: (clean - corrupted) . d logit diff / d (decoder layer `layer`'s input) at `pos`,
    over the share of the metric between the runs."""
    seen = {}

    def pre(module, args, kwargs):
        seen["act"] = args[0] if args else kwargs["hidden_states"]

    def run(tokens, grad):
        handle = hf.model.layers[layer].register_forward_pre_hook(pre, with_kwargs=True)
        try:
            with torch.set_grad_enabled(grad):
                logits = hf(tokens).logits
        finally:
            handle.remove()
        rows = torch.arange(logits.shape[0])
        return (logits[rows, -1, ANSWERS] - logits[rows, -1, COUNTERFACTUALS]).mean(), seen["act"]

    clean_value, clean_act = run(clean, False)
    with torch.enable_grad():
        value, act = run(corrupted, True)
        (grad,) = torch.autograd.grad(value, act)
    delta = ((clean_act - act.detach()) * grad)[:, pos].sum()
    return float(delta / (clean_value - value.detach()))


def test_llama_attribution_from_the_read_columns_matches_transformers_autograd(llama_pair):
    hf, model = llama_pair
    clean, corrupted = prompts(model)
    sites = [Site("resid_pre", 1, pos=6), Site("resid_pre", 1, pos=10), Site("resid_pre", 0, pos=6)]
    result = attribution_patch(model, clean, corrupted, logit_diff_metric(model, ANSWERS, COUNTERFACTUALS), sites=sites)
    expected = torch.tensor([hf_resid_attribution(hf, clean, corrupted, s.layer, s.pos) for s in sites])
    torch.testing.assert_close(result.recovered, expected, atol=1e-5, rtol=1e-4)


def test_attribution_never_unembeds_every_position_and_runs_two_forwards(tiny_model):
    clean, corrupted = prompts(tiny_model)
    calls = {"unembed": 0, "block0": 0}

    def count(what):
        def hook(module, args, output):
            calls[what] += 1
        return hook

    handles = [tiny_model.unembed.register_forward_hook(count("unembed")),
               tiny_model.blocks[0].register_forward_hook(count("block0"))]
    try:
        attribution_patch(tiny_model, clean, corrupted, logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS))
        assert calls == {"unembed": 0, "block0": 2}  # the clean run and the corrupted run with its graph
        attribution_patch(tiny_model, clean, corrupted, generic(logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)))
        assert calls == {"unembed": 2, "block0": 4}  # a metric without reads gets the full logits of both runs
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("method", ["eap", "eap-ig-inputs", "eap-ig-activations", "clean-corrupted"])
def test_edge_attribution_refuses_more_answers_than_prompts(tiny_model, tiny_hf, method):
    """Four answers for two prompts: the gradient methods evaluate the metric on stacked runs only (four rows and more),
    where four answers tiled without complaint (the clean rows read answers 0-1, the corrupted rows 2-3); the exact
    method and a metric without declared reads already refused them, naming the two prompts."""
    from probe.analyses.edge_attribution import edge_attribution

    clean, corrupted = prompts(tiny_model)
    four = logit_diff_metric(tiny_model, [5, 9, 11, 12], [7, 2, 3, 4])
    with pytest.raises(ValueError, match="4 answers do not match a batch of 2 prompts"):
        edge_attribution(tiny_model, clean, corrupted, generic(four), method=method, ig_steps=2)  # the reference behaviour
    with pytest.raises(ValueError, match="4 answers do not match a batch of 2 prompts"):
        edge_attribution(tiny_model, clean, corrupted, four, method=method, ig_steps=2)
    # three answers for two prompts: named by the prompts' count, not by the stacked rows' (4, 6, ...)
    with pytest.raises(ValueError, match="3 answers do not match a batch of 2 prompts"):
        edge_attribution(tiny_model, clean, corrupted, logit_diff_metric(tiny_model, [5, 9, 11], [7, 2, 3]),
                         method=method, ig_steps=2)
    # one answer per prompt, or one for all of them, still run: their unpatched values are transformers' logit differences
    with torch.no_grad():
        hf_logits = {name: tiny_hf(tokens).logits[:, -1] for name, tokens in (("clean", clean), ("corrupted", corrupted))}
    rows = torch.arange(2)
    for answers, counters in ((ANSWERS, COUNTERFACTUALS), ([5], [7])):
        scores = edge_attribution(tiny_model, clean, corrupted, logit_diff_metric(tiny_model, answers, counters),
                                  method=method, ig_steps=2)
        a, c = torch.tensor(answers).expand(2), torch.tensor(counters).expand(2)
        for name in ("clean", "corrupted"):
            expected = float((hf_logits[name][rows, a] - hf_logits[name][rows, c]).mean())
            assert getattr(scores, name) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("method", ["eap", "eap-ig-activations"])
def test_a_declared_metric_that_is_not_differentiable_is_refused_by_name(tiny_model, method):
    """A metric declaring its reads whose combine detaches (or takes an argmax): the same function without the
    declaration is refused with an explanation; with it, the backward failed with torch's bare "element 0 of tensors
    does not require grad"."""
    from probe.analyses.edge_attribution import edge_attribution
    from probe.analyses.metric_reads import LogitReads

    clean, corrupted = prompts(tiny_model)
    difference = logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)
    for combine in (lambda v: (v[:, 0] - v[:, 1]).detach(), lambda v: v.argmax(-1).float()):
        def metric(logits, tokens, mask, combine=combine):
            rows = torch.arange(logits.shape[0])
            read = difference.reads.columns(logits.shape[0], logits.device)
            return combine(logits[rows, difference.reads.positions(mask)].float().gather(-1, read))

        with pytest.raises(ValueError, match="does not depend on the logits through differentiable operations"):
            edge_attribution(tiny_model, clean, corrupted, metric, method=method, ig_steps=2)  # the reference behaviour
        metric.reads = LogitReads(positions=difference.reads.positions, columns=difference.reads.columns, combine=combine)
        with pytest.raises(ValueError, match="does not depend on the logits through differentiable operations"):
            edge_attribution(tiny_model, clean, corrupted, metric, method=method, ig_steps=2)
        with pytest.raises(ValueError, match="does not depend on the logits through differentiable operations"):
            attribution_patch(tiny_model, clean, corrupted, metric)
        # where no gradient is wanted it is a metric like any other: head ablation evaluates it as the logits do
        declared = head_ablation_effects(tiny_model, corrupted, metric)
        plain = head_ablation_effects(tiny_model, corrupted, generic(metric))
        torch.testing.assert_close(declared.per_prompt, plain.per_prompt, atol=1e-4, rtol=0)
