"""Generation with a KV cache: every step equals a full forward; greedy equals transformers' generate."""
from __future__ import annotations

import pytest
import torch

from probe import HookedDecoder
from probe.kv_cache import KVCache

from test_variants import build


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    hf = build("llama", directory)
    return hf, HookedDecoder.from_pretrained(directory).eval()


@pytest.fixture(scope="module")
def neox_pair(tmp_path_factory):
    directory = tmp_path_factory.mktemp("neox")
    hf = build("neox", directory)
    return hf, HookedDecoder.from_pretrained(directory).eval()


@pytest.fixture(scope="module")
def mistral_pair(tmp_path_factory):  # a 6-token sliding window: the cached steps must drop old keys
    directory = tmp_path_factory.mktemp("mistral")
    hf = build("mistral", directory)
    return hf, HookedDecoder.from_pretrained(directory).eval()


@pytest.fixture(scope="module")
def gemma2_pair(tmp_path_factory):  # a window on every other layer, soft caps
    directory = tmp_path_factory.mktemp("gemma2")
    hf = build("gemma2", directory)
    return hf, HookedDecoder.from_pretrained(directory).eval()


@pytest.fixture(scope="module")
def gptneo_pair(tmp_path_factory):  # a 5-key window on two of three layers, unscaled scores
    directory = tmp_path_factory.mktemp("gptneo")
    hf = build("gptneo", directory)
    return hf, HookedDecoder.from_pretrained(directory).eval()


@pytest.fixture(scope="module")
def opt_pair(tmp_path_factory):  # positions numbered by the mask's running sum
    directory = tmp_path_factory.mktemp("opt")
    hf = build("opt", directory)
    return hf, HookedDecoder.from_pretrained(directory).eval()


@pytest.fixture(scope="module")
def phi_pair(tmp_path_factory):  # one norm read by both parallel sublayers, partial rotary
    directory = tmp_path_factory.mktemp("phi")
    hf = build("phi", directory)
    return hf, HookedDecoder.from_pretrained(directory).eval()


@pytest.fixture(scope="module")
def phi3_pair(tmp_path_factory):  # fused projections, a 6-key window on every layer, partial rotary
    directory = tmp_path_factory.mktemp("phi3")
    hf = build("phi3", directory, sliding_window=6,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})
    return hf, HookedDecoder.from_pretrained(directory).eval()


@pytest.fixture(scope="module")
def gemma3_pair(tmp_path_factory):  # local layers with their own rotary base, a full layer rescaled
    directory = tmp_path_factory.mktemp("gemma3")
    hf = build("gemma3", directory, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
    return hf, HookedDecoder.from_pretrained(directory).eval()


@pytest.fixture(scope="module")
def olmo2_pair(tmp_path_factory):  # write norms only, q and k normalised over all heads
    directory = tmp_path_factory.mktemp("olmo2")
    hf = build("olmo2", directory, num_key_value_heads=2)
    return hf, HookedDecoder.from_pretrained(directory).eval()


def pair_of(which, tiny_hf, tiny_model, request):
    return (tiny_hf, tiny_model) if which == "gpt2" else request.getfixturevalue(f"{which}_pair")


def decode_step_by_step(model, tokens, mask, n_new):
    """Prefill, then one-token passes through the cache; returns every step's logits and the tokens."""
    cache = KVCache(model.cfg.n_layers)
    step_logits = [model(tokens, attention_mask=mask, kv_cache=cache)[:, -1]]
    for _ in range(n_new):
        nxt = step_logits[-1].argmax(-1, keepdim=True)
        tokens, mask = torch.cat([tokens, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
        step_logits.append(model(nxt, kv_cache=cache)[:, -1])
    return step_logits, tokens, mask


@pytest.mark.parametrize("which", ["gpt2", "llama", "neox", "mistral", "gemma2", "gptneo", "opt", "phi", "phi3",
                                   "gemma3", "olmo2"])
def test_each_cached_step_equals_a_full_forward(which, tiny_model, tiny_hf, request):
    model = pair_of(which, tiny_hf, tiny_model, request)[1]
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(1, model.cfg.d_vocab, (2, 7), generator=gen)
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0  # the second prompt is left-padded
    with torch.no_grad():
        step_logits, all_tokens, all_mask = decode_step_by_step(model, tokens, mask, n_new=6)
        for i, logits in enumerate(step_logits):
            n = tokens.shape[1] + i
            full = model(all_tokens[:, :n], attention_mask=all_mask[:, :n])[:, -1]
            torch.testing.assert_close(logits, full, atol=1e-4, rtol=0)
        # the padded prompt continues exactly as it would alone
        alone = model(all_tokens[1:, 3:])[:, -1]
    torch.testing.assert_close(step_logits[-1][1:], alone, atol=1e-4, rtol=0)


@pytest.mark.parametrize("which", ["gpt2", "llama", "neox", "mistral", "gemma2", "gptneo", "opt", "phi", "phi3",
                                   "gemma3", "olmo2"])
def test_greedy_equals_transformers_generate(which, tiny_model, tiny_hf, request):
    hf, model = pair_of(which, tiny_hf, tiny_model, request)
    prompt = torch.randint(0, model.cfg.d_vocab, (2, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    ours = model.generate(prompt, max_new_tokens=12)
    assert ours.tolist() == expected.tolist()
    assert model.generate(prompt, max_new_tokens=12, use_cache=False).tolist() == expected.tolist()


def test_text_in_text_out_and_batched_prompts(tiny_model):
    prompts = ["To be, or not", "The quick brown fox jumps over the"]
    batched = tiny_model.generate(prompts, max_new_tokens=5)
    alone = [tiny_model.generate(p, max_new_tokens=5) for p in prompts]
    assert batched == alone
    assert all(out.startswith(p) for out, p in zip(batched, prompts))


def test_hooks_fire_on_every_pass_with_continuing_positions(tiny_model):
    seen = []
    prompt = torch.randint(0, tiny_model.cfg.d_vocab, (1, 4), generator=torch.Generator().manual_seed(7))
    record = lambda x, hook: seen.append(x.shape[1])  # noqa: E731
    out, caches = tiny_model.generate(prompt, max_new_tokens=3, fwd_hooks=[("hook_pos_embed", record)],
                                      cache_names=["hook_pos_embed", "blocks.0.attn.hook_pattern"])
    assert seen == [4, 1, 1]  # the prompt in one pass, then one token per pass
    assert len(caches) == 3
    W_pos = tiny_model.pos_embed.W_pos
    torch.testing.assert_close(caches[2]["hook_pos_embed"][0, 0], W_pos[5])  # position 5, not 0
    assert caches[2]["blocks.0.attn.hook_pattern"].shape[-2:] == (1, 6)  # one query over all keys so far
    assert not any(tiny_model.hook_point(n).active for n in tiny_model.hook_names)


def test_sampling_is_seeded_and_respects_top_k(tiny_model):
    prompt = torch.zeros(3, 2, dtype=torch.long)
    a = tiny_model.generate(prompt, max_new_tokens=8, temperature=1.0, seed=1)
    b = tiny_model.generate(prompt, max_new_tokens=8, temperature=1.0, seed=1)
    assert a.tolist() == b.tolist()
    greedy = tiny_model.generate(prompt, max_new_tokens=8)
    assert tiny_model.generate(prompt, max_new_tokens=8, temperature=1.0, top_k=1, seed=3).tolist() == greedy.tolist()
    assert tiny_model.generate(prompt, max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=3).tolist() == greedy.tolist()


def test_generation_errors(tiny_model):
    with pytest.raises(ValueError, match="n_ctx=48"):
        tiny_model.generate(torch.zeros(1, 40, dtype=torch.long), max_new_tokens=10)
    with pytest.raises(ValueError, match="top_p"):
        tiny_model.generate("hi", max_new_tokens=2, temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny_model.generate("hi", max_new_tokens=-1)


def test_hooks_given_as_a_generator_fire_on_every_pass(tiny_model):
    passes = []
    prompt = torch.randint(0, tiny_model.cfg.d_vocab, (1, 4), generator=torch.Generator().manual_seed(8))
    hooks = ((name, lambda x, hook: passes.append(x.shape[1])) for name in ["hook_embed"])
    tiny_model.generate(prompt, max_new_tokens=4, fwd_hooks=hooks)
    assert passes == [4, 1, 1, 1]  # the prompt, then one pass per new token but the last


def test_generation_refuses_right_padding_and_takes_a_one_dimensional_mask(tiny_model, tiny_hf):
    prompt = torch.randint(1, tiny_model.cfg.d_vocab, (2, 6), generator=torch.Generator().manual_seed(9))
    right = torch.ones_like(prompt)
    right[1, -2:] = 0
    with pytest.raises(ValueError, match=r"last position of prompt\(s\) \[1\].*padding_side='left'"):
        tiny_model.generate(prompt, max_new_tokens=3, attention_mask=right)
    with pytest.raises(ValueError, match="attention_mask is built for you"):
        tiny_model.generate("To be", max_new_tokens=3, attention_mask=torch.ones(1, 3))
    with torch.no_grad():
        expected = tiny_hf.generate(prompt[:1], max_new_tokens=5, do_sample=False, pad_token_id=0,
                                    attention_mask=torch.ones_like(prompt[:1]))
    ours = tiny_model.generate(prompt[0], max_new_tokens=5, attention_mask=torch.ones(6, dtype=torch.long))
    assert ours.tolist() == expected.tolist()


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, None, None), (1.5, 6, None), (1.0, None, 0.6), (0.8, 8, 0.7)])
def test_sampled_tokens_follow_the_tempered_truncated_softmax(tiny_model, temperature, top_k, top_p):
    """The first sampled token of many copies of one prompt, against softmax(logits / T) restricted by hand to
    the top_k tokens and to the smallest set reaching top_p. The unembedding is scaled up so the distribution
    is peaked: with the near-uniform logits of random weights, T and the cut-offs would barely show."""
    import copy

    model = copy.deepcopy(tiny_model)
    with torch.no_grad():  # scaling the final norm's affine map scales the logits (the unembedding is tied to W_E)
        model.ln_final.w.mul_(6)
        model.ln_final.b.mul_(6)
    prompt = torch.randint(0, model.cfg.d_vocab, (1, 5), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        logits = model(prompt)[0, -1].double() / temperature
    allowed = torch.ones_like(logits, dtype=torch.bool)
    if top_k is not None:
        allowed &= logits >= logits.topk(top_k).values[-1]
    if top_p is not None:
        probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
        order = probs.argsort(descending=True)
        before = probs[order].cumsum(0) - probs[order]  # mass of the more likely tokens
        nucleus = torch.zeros_like(allowed)
        nucleus[order[before < top_p]] = True
        allowed &= nucleus
    expected = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    assert 2 <= int(allowed.sum()) and float(expected.max()) < 0.9  # a distribution worth sampling
    n = 20000
    out = model.generate(prompt.expand(n, -1), max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, seed=0)
    freq = torch.bincount(out[:, -1], minlength=model.cfg.d_vocab).double() / n
    assert set(freq.nonzero().flatten().tolist()) <= set(allowed.nonzero().flatten().tolist())
    sigma = (expected * (1 - expected) / n).sqrt()
    assert bool(((freq - expected).abs() <= 5 * sigma + 1e-3).all()), (freq - expected).abs().max()
