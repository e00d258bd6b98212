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


def decode_step_by_step(model, tokens, mask, n_new):
    """Prefill, then one-token passes through the cache; returns every step's logits and the tokens."""
    cache = KVCache(model.cfg.n_layers)
    step_logits = [model(tokens, attention_mask=mask, kv_cache=cache)[:, -1]]
    for _ in range(n_new):
        nxt = step_logits[-1].argmax(-1, keepdim=True)
        tokens, mask = torch.cat([tokens, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
        step_logits.append(model(nxt, kv_cache=cache)[:, -1])
    return step_logits, tokens, mask


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_each_cached_step_equals_a_full_forward(which, tiny_model, llama_pair):
    model = tiny_model if which == "gpt2" else llama_pair[1]
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


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_greedy_equals_transformers_generate(which, tiny_model, tiny_hf, llama_pair):
    hf, model = (tiny_hf, tiny_model) if which == "gpt2" else llama_pair
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
