"""Bidirectional attention (DecoderConfig.bidirectional, transformer-lens's attention_dir="bidirectional"), the
hook_tokens point (use_hook_tokens), HookPoint.add_perma_hook and every module's `.name`, as ARENA's
balanced-bracket classifier uses them.

The oracles: HookedTransformer itself (transformer-lens 3, in the SAELens virtualenv: tests/saelens_oracle.py's
`brackets` command runs tests/brackets_idioms.py on it), and attention computed by hand from the cached q and k."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from brackets_idioms import BRACKETS, CONFIG, PAD, brackets_idioms, tokenize
from probe import DecoderConfig, HookedDecoder, HookedTransformerConfig
from probe.kv_cache import KVCache
from test_sae_training import needs_saelens, oracle
from test_tl_state_dict import built_by_hooked_transformer
from toy_helpers import randomised


def trained(**overrides) -> HookedDecoder:
    return randomised(HookedDecoder(HookedTransformerConfig(**{**CONFIG, **overrides})), seed=5)


@needs_saelens
def test_the_bracket_classifier_section_agrees_with_hooked_transformer(tmp_path):
    """ARENA's bracket-classifier analyses (padding masked by permanent hooks on hook_tokens and attn_scores, the
    classification at the start token, the norms' linear fits found through `layernorm.name`, the output by
    components adding up to ln_final's input, patterns, neuron contributions, decompositions, a pattern hook) as
    one function on HookedTransformer and on probe, the same config and weights."""
    state = built_by_hooked_transformer(CONFIG, tokenize(BRACKETS), tmp_path)
    oracle("brackets", tmp_path / "state.safetensors", tmp_path / "theirs.safetensors")
    theirs = load_file(str(tmp_path / "theirs.safetensors"))
    model = HookedDecoder(HookedTransformerConfig(**CONFIG)).eval()
    model.load_state_dict(state, strict=True)
    ours = brackets_idioms(model, BRACKETS)
    assert set(ours) == set(theirs)
    for name, value in ours.items():
        torch.testing.assert_close(value, theirs[name], atol=1e-4, rtol=1e-4, msg=name)
    assert model.persistent_hooks() == []  # the idioms end with reset_hooks(including_permanent=True)


def test_every_query_sees_every_key_by_hand():
    model = trained()
    tokens = tokenize(["(()())", "))(("])[:, :6]
    with torch.no_grad():
        fused = model(tokens)  # nothing observes the pattern: the fused kernel
        _, cache = model.run_with_cache(tokens)
    q, k = cache["q", 0], cache["k", 0]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / CONFIG["d_head"] ** 0.5
    torch.testing.assert_close(cache["pattern", 0], scores.softmax(-1), atol=1e-6, rtol=1e-5)
    assert bool((cache["pattern", 0][:, :, 0, -1] > 0).all())  # the first query reads the last key
    torch.testing.assert_close(fused, cache_logits(model, tokens), atol=1e-5, rtol=1e-5)
    changed = tokens.clone()
    changed[:, -1] = 3 + (changed[:, -1] == 3).long()  # flip the last bracket
    with torch.no_grad():
        assert not torch.allclose(model(changed)[:, 0], fused[:, 0], atol=1e-4)


def cache_logits(model, tokens):
    with torch.no_grad():
        return model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_pattern", lambda p, hook: p)])


def test_an_attention_mask_hides_padding_as_the_perma_hooks_do():
    """probe's own attention_mask on a padded batch gives each prompt what it gives alone, as ARENA's permanent
    masking hooks do (the oracle: each prompt run alone, unpadded)."""
    model = trained()
    toks = tokenize(BRACKETS)
    mask = (toks != PAD).long()
    with torch.no_grad():
        padded = model(toks, attention_mask=mask)[:, 0]
        alone = torch.cat([model(tokenize([s]))[:, 0] for s in BRACKETS])
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)


def test_right_padded_text_is_masked_in_a_bidirectional_model():
    """Text padded on the right is exact without a mask in a causal model; a bidirectional one's real tokens would
    read the padding after them, so the mask is kept (the oracle: each text run alone)."""
    from probe import DEFAULT_MODEL
    from probe.loading import load_tokenizer

    model = HookedDecoder(DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=4096, n_ctx=32, bidirectional=True),
                          tokenizer=load_tokenizer(DEFAULT_MODEL)).eval()
    texts = ["to be", "the rest is silence, my lord"]
    with torch.no_grad():
        batch = model(texts, padding_side="right")
        for row, text in enumerate(texts):
            alone = model(text)
            torch.testing.assert_close(batch[row, : alone.shape[1]], alone[0], atol=1e-5, rtol=1e-5)


def test_hook_tokens_holds_and_edits_the_token_ids():
    model = trained()
    toks = tokenize(BRACKETS[:3])
    with torch.no_grad():
        _, cache = model.run_with_cache(toks, dtype=torch.bfloat16)
        assert cache["hook_tokens"].dtype == torch.int64 and torch.equal(cache["hook_tokens"], toks)
        swapped = model.run_with_hooks(toks, fwd_hooks=[("hook_tokens", lambda t, hook: torch.where(t == 3, 4, t))])
        torch.testing.assert_close(swapped, model(torch.where(toks == 3, 4, toks)))
    assert model.estimate_cache_bytes(["hook_tokens"], None, toks) == toks.numel() * 8
    plain = HookedDecoder(HookedTransformerConfig(**{**CONFIG, "use_hook_tokens": False}))
    assert "hook_tokens" not in plain.hook_names


def test_permanent_hooks_survive_reset_hooks_and_modules_know_their_names():
    model = trained()
    calls = []
    point = model.hook_dict["blocks.0.hook_resid_pre"]
    point.add_perma_hook(lambda x, hook: calls.append(hook.name))
    model.reset_hooks()
    model(tokenize(["()"]))
    assert calls == ["blocks.0.hook_resid_pre"]
    model.reset_hooks(including_permanent=True)
    model(tokenize(["()"]))
    assert calls == ["blocks.0.hook_resid_pre"]
    assert (model.ln_final.name, model.blocks[1].ln1.name, model.blocks[2].mlp.name) == ("ln_final", "blocks.1.ln1",
                                                                                         "blocks.2.mlp")
    assert not hasattr(model, "name")  # the root has no path, as in transformer-lens


def test_what_a_bidirectional_model_cannot_do_is_refused():
    model = trained(d_vocab_out=5)
    for use_cache in (True, False):
        with pytest.raises(ValueError, match="generate: this model's attention is bidirectional"):
            model.generate(tokenize(["()"]), max_new_tokens=2, use_past_kv_cache=use_cache)
    with pytest.raises(ValueError, match="kv_cache: in a bidirectional model.*cannot be cached"):
        model(tokenize(["()"]), kv_cache=KVCache(model.cfg.n_layers))
    with pytest.raises(ValueError, match="sliding window.*bidirectional"):
        DecoderConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=8, bidirectional=True, sliding_window=4)
    with pytest.raises(ValueError, match="attention_dir='sideways'.*'causal' or 'bidirectional'"):
        HookedTransformerConfig(**{**CONFIG, "attention_dir": "sideways"})
    assert model.cfg.attention_dir == "bidirectional" and HookedDecoder(
        HookedTransformerConfig(**{**CONFIG, "attention_dir": "causal"})).cfg.attention_dir == "causal"
