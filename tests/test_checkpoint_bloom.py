"""Bloom checkpoints (probe/checkpoint_bloom.py) and the two things they brought: ALiBi positions (probe/embedding.py's
Alibi, applied in probe/attention.py) and a LayerNorm on the token embeddings (`embed.ln`, transformer-lens's
post_embedding_ln). The oracles: transformers' Bloom (patterns over padding, greedy generation through a KV cache,
its own slopes), HookedTransformer 3.9 (ALiBi and post_embedding_ln toys hook by hook, and processed), TL 4's bridge
over the same checkpoint directory, and scores computed by hand from the weights. test_variants.py compares logits
and every residual with transformers' and saves through it; test_bridge_names.py the bridge's own names."""
from __future__ import annotations

import json

import pytest
import torch

from probe import HookedDecoder, HookedTransformerConfig
from probe.embedding import alibi_slopes
from probe.tl_state_dict import TL_UNWRITTEN
from family_checks import cache_of_everything, caches_of_both
from test_family_defaults import BLOOM_FILES, tokenized_checkpoint
from test_sae_training import needs_saelens
from test_transformer_lens import compare_with_transformer_lens
from test_variants import build
from tl_cases import TL_DEFAULTS, assert_processed_as_hooked_transformer, assert_same_cache, hooked_transformer_outputs, part

SMALL = dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="gelu_fast", normalization_type="LN",
             positional_embedding_type="alibi", post_embedding_ln=True, default_prepend_bos=False)
TL_CASES = {
    "bloom-like": SMALL,
    # ALiBi alone, on an attention-only toy with eight heads (slopes 2^-1 .. 2^-8)
    "alibi-attn-only": dict(n_layers=2, d_model=32, d_head=4, n_ctx=16, d_vocab=50, act_fn="relu", attn_only=True,
                            positional_embedding_type="alibi"),
    # every key seen: a later key's distance reads 0 (TL clamps it), so only earlier ones are penalised
    "alibi-bidirectional": dict(SMALL, attention_dir="bidirectional", post_embedding_ln=False),
    # a norm on the embeddings of a model with learned positions: the positions join after it
    "embed-ln-learned": dict(SMALL, positional_embedding_type="standard"),
}


def tokens(vocab: int = 50, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(seed))


# ---- the slopes, the scores and the patterns -------------------------------------------------------------------
@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 6, 8, 12, 16, 20, 32, 40, 112])
def test_slopes_are_transformers_blooms(n_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    # transformers' bias is slope * key position, so its entry at key 1 is the slope itself
    theirs = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), n_heads, torch.float32)[:, 0, 1]
    torch.testing.assert_close(torch.tensor(alibi_slopes(n_heads)), theirs, atol=1e-7, rtol=1e-6)


def test_scores_are_qk_plus_the_distance_penalty_by_hand(tmp_path):
    """hook_attn_scores as transformer-lens 3 has them: q.k / sqrt(d_head) + slope * (key - query), the distance
    counted in real tokens, hidden keys -inf; and the pattern is transformers' (whose bias is slope * key: the same
    softmax), left padding included."""
    hf = build("bloom", tmp_path, hidden_size=48, n_head=6)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    toks = tokens(101)
    mask = torch.ones_like(toks)
    mask[1, :3] = 0
    with torch.no_grad():
        _, cache = model.run_with_cache(toks, attention_mask=mask)
        expected = hf(toks, attention_mask=mask, output_attentions=True).attentions
    slopes = torch.tensor([0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125])  # four heads' 2^-2k, then eight's odd ones
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    for layer in range(2):
        q, k = cache[f"blocks.{layer}.attn.hook_q"], cache[f"blocks.{layer}.attn.hook_k"]
        by_hand = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8 ** 0.5
        distance = (positions[:, None, :] - positions[:, :, None]).clamp(max=0)  # [batch query key]
        by_hand = by_hand + slopes[None, :, None, None] * distance[:, None]
        visible = torch.ones(11, 11, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]
        visible = visible | torch.eye(11, dtype=torch.bool)
        by_hand = by_hand.masked_fill(~visible, float("-inf"))
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_attn_scores"], by_hand, atol=1e-5, rtol=0)
        real = mask.bool()
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_pattern"][real[:, None, :, None].expand_as(expected[layer])],
                                   expected[layer][real[:, None, :, None].expand_as(expected[layer])], atol=1e-5, rtol=0)


def test_hook_shapes_predict_the_cache(tmp_path):
    build("bloom", tmp_path)
    _, _, cache, predicted = cache_of_everything(tmp_path)
    assert {"embed.ln.hook_scale", "embed.ln.hook_normalized"} <= set(cache) and "hook_pos_embed" not in predicted
    assert {n: tuple(t.shape) for n, t in cache.items()} == {n: s for n, s in predicted.items() if n in cache}


def test_generation_through_a_kv_cache_is_transformers_greedy_left_padded(tmp_path):
    """Each new token's distances reach back over the cached keys, counted in real tokens (left padding skipped)."""
    hf = build("bloom", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    prompt = tokens(101)[:, :6]
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        logits_cached, full = [], prompt
        from probe.kv_cache import KVCache

        cache = KVCache(model.cfg.n_layers)
        step_logits = model(prompt, attention_mask=mask, kv_cache=cache)
        new_mask = torch.ones(2, 1, dtype=torch.long)
        for _ in range(8):
            nxt = step_logits[:, -1].argmax(-1, keepdim=True)
            full = torch.cat([full, nxt], dim=1)
            step_logits = model(nxt, attention_mask=new_mask, kv_cache=cache)
            logits_cached.append(step_logits[:, -1])
        # the cached step's logits equal a fresh pass over the whole padded sequence
        fresh = model(full[:, :-1], attention_mask=torch.cat([mask, torch.ones(2, 7, dtype=torch.long)], dim=1))
    assert torch.equal(full, expected)
    torch.testing.assert_close(logits_cached[-2], fresh[:, -1], atol=1e-5, rtol=0)


# ---- transformer-lens ------------------------------------------------------------------------------------------
def test_hooks_match_the_bridge_and_its_scores_differ_by_a_row_constant(tmp_path):
    """TL 4's bridge over the same checkpoint: every hook both have agrees, but for the scores, where the bridge adds
    transformers' slope * key position and probe TL 3's slope * (key - query): the same pattern, each row shifted by
    -slope * query position."""
    directory = tokenized_checkpoint("bloom", tmp_path / "checkpoint", BLOOM_FILES)
    missing, theirs = compare_with_transformer_lens(directory, 10, seed=4, skip=("hook_attn_scores",))
    # the bridge names the embedding's norm embed_ln (its values: test_bridge_names.py), TL 3.9 embed.ln
    assert missing == {"embed.ln.hook_scale", "embed.ln.hook_normalized"} and "embed_ln.hook_scale" in theirs
    cache, their_cache = caches_of_both(directory, tokens(HookedDecoder.from_pretrained(directory).cfg.d_vocab))
    visible = torch.ones(11, 11, dtype=torch.bool).tril()
    shift = -torch.tensor(alibi_slopes(4))[:, None, None] * torch.arange(11.0)[None, :, None]  # [head query 1]
    for layer in range(2):
        ours, bridges = cache[f"blocks.{layer}.attn.hook_attn_scores"], their_cache[f"blocks.{layer}.attn.hook_attn_scores"]
        torch.testing.assert_close((ours - bridges)[..., visible], shift.expand(2, 4, 11, 11)[..., visible], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def hooked_transformers(tmp_path_factory) -> dict:
    """HookedTransformer 3.9's state dict, logits and cache for each TL case with random weights, and processed
    with TL's defaults (one oracle process)."""
    return hooked_transformer_outputs(tmp_path_factory.mktemp("tl_bloom"), TL_CASES, tokens(), processed=tuple(TL_CASES))[0]


@needs_saelens
@pytest.mark.parametrize("case", sorted(TL_CASES))
def test_every_hook_agrees_with_hooked_transformer(case, hooked_transformers):
    out = part(hooked_transformers, f"{case}/")
    model = HookedDecoder(HookedTransformerConfig(**TL_CASES[case])).eval()
    assert model.cfg.positional_embedding_type == TL_CASES[case]["positional_embedding_type"]
    assert model.cfg.post_embedding_ln == TL_CASES[case].get("post_embedding_ln", False)
    model.load_state_dict(part(out, "state."), strict=True)
    assert set(model.state_dict()) == {key for key in part(out, "state.") if key.rsplit(".", 1)[-1] not in TL_UNWRITTEN}
    assert_same_cache(model, tokens(), part(out, "cache."), out["logits"])


@needs_saelens
@pytest.mark.parametrize("case", sorted(TL_CASES))
def test_tl_default_processing_gives_hooked_transformers_weights_and_activations(case, hooked_transformers):
    """fold_ln folds the blocks' norms and the final one, never embed.ln (a writer: its w and b stay); centring
    centres W_E, which embed.ln normalises anyway. TL's ALiBi models hold a position table they never read."""
    alibi = TL_CASES[case]["positional_embedding_type"] == "alibi"
    assert_processed_as_hooked_transformer(TL_CASES[case], part(hooked_transformers, f"{case}/"), tokens(),
                                           unread="pos_embed.W_pos" if alibi else None)


def test_processing_a_loaded_bloom_keeps_transformers_log_probs(tmp_path):
    hf = build("bloom", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path, fold_ln=True, center_writing_weights=True, center_unembed=True,
                                          fold_value_biases=True).eval()
    toks = tokens(101)
    with torch.no_grad():
        torch.testing.assert_close(model(toks).log_softmax(-1), hf(toks).logits.log_softmax(-1), atol=1e-4, rtol=0)
    assert model.embed.ln.w.requires_grad and model.cfg.normalization_type == "LNPre"


@pytest.mark.parametrize("settings, match", [
    (dict(SMALL, d_model=48, d_head=8), r"alibi.*n_heads=6.*power of two"),  # TL's slopes differ there
])
def test_tl_alibi_configs_whose_slopes_differ_are_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        HookedTransformerConfig(**settings)


@pytest.mark.parametrize("overrides, match", [
    (dict(heads_per_layer=(4, 2)), r"heads_per_layer.*alibi.*slope"),
    (dict(scale_embed=True), r"scale_embed with embed_norm"),
])
def test_configs_alibi_and_embed_norm_cannot_hold_are_refused(overrides, match):
    from probe import DecoderConfig

    with pytest.raises(ValueError, match=match):
        DecoderConfig(n_layers=2, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, positions="alibi", embed_norm=True,
                      **overrides)


def test_bloom_configs_the_format_cannot_hold_are_refused(tmp_path):
    import dataclasses

    from probe.checkpoints import FAMILIES
    from probe.config_file import CheckpointError

    build("bloom", tmp_path / "ok")
    model = HookedDecoder.from_pretrained(tmp_path / "ok")
    hf = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**hf, "apply_residual_connection_post_layernorm": True}))
    with pytest.raises(CheckpointError, match="apply_residual_connection_post_layernorm=True"):
        HookedDecoder.from_pretrained(tmp_path / "ok")

    with pytest.raises(ValueError, match="Bloom checkpoint cannot hold this model: d_mlp=96"):
        FAMILIES["bloom"].config_to_hf(dataclasses.replace(model.cfg, d_mlp=96), None)
    # a model with embed_norm and learned positions has no Hugging Face format: refused, not saved without its norm
    from probe import DecoderConfig

    other = HookedDecoder(DecoderConfig(n_layers=1, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, embed_norm=True))
    with pytest.raises(ValueError, match="embed_norm=True"):
        other.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


def test_the_context_is_config_jsons_seq_length_else_the_2048_bloom_was_trained_on(tmp_path):
    build("bloom", tmp_path)
    assert HookedDecoder.from_pretrained(tmp_path).cfg.n_ctx == 40
    hf = json.loads((tmp_path / "config.json").read_text())
    del hf["seq_length"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    model = HookedDecoder.from_pretrained(tmp_path)
    assert model.cfg.n_ctx == 2048 and model.cfg.positional_embedding_type == "alibi"
    assert json.loads((model.save_pretrained(tmp_path / "saved") / "config.json").read_text())["seq_length"] == 2048
