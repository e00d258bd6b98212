"""Gemma 4 (probe/checkpoint_gemma4.py, probe/per_layer_block.py, probe/shared_attention.py,
probe/experts_beside.py): the logits and every residual of each variant are compared with transformers in
test_variants.py (CASES) with saving; here: generation through the cache (layers that reuse earlier layers' keys
too), processing, left padding, each new point against transformers' own modules, TL 4's bridge name by name, runs
from a residual, heads' own inputs, the ledger, the multimodal and encoder-free files, and the analyses that work or
refuse by name."""
from __future__ import annotations

import pytest
import torch

from probe import HookedDecoder
from probe.kv_cache import KVCache
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, cache_of_everything, caches_in_compatibility_mode,
                           compared_with_the_delegating_bridge, report_page, runs_with_one_heads_input_swapped,
                           seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import CASES, build

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))
SHARED, KEYS_AS_VALUES, EXPERTS = (CASES[f"gemma4-{case}"][1] for case in (
    "shared-kv-per-layer-inputs", "values-from-keys", "experts-beside-mlp"))
VARIANTS = {"shared": SHARED, "keys-as-values": KEYS_AS_VALUES, "experts": EXPERTS}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_generation_and_processing_are_transformers(variant, tmp_path):
    hf = build("gemma4", tmp_path, **VARIANTS[variant])
    with pytest.warns(UserWarning, match="fold_value_biases=True .*a norm on the values"):
        assert_generation_and_processing_match(hf, tmp_path)


def test_a_cached_prefix_then_its_continuation_is_one_forward(tmp_path):
    """The layers that reuse keys read their source's from the cache and keep none of their own."""
    build("gemma4", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, prefix = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.length == 13 and prefix.length == 10
    assert cache.layers[3].k.shape == (2, 13, 2, 8) and cache.layers[2].k.shape == (2, 13, 1, 16)
    assert cache.layers[4].k is None and cache.layers[5].k is None


def test_left_padded_batched_generation_is_transformers(tmp_path):
    hf = build("gemma4", tmp_path)
    assert_left_padded_generation_matches(hf, tmp_path)


def test_the_points_hold_transformers_values(tmp_path):
    """hook_v_normed is transformers' v_norm output (its input, in a full layer, the key projection's), the pattern
    of a layer reusing keys is its attention weights, the per-layer inputs what the model hands each layer."""
    hf = build("gemma4", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    layers = hf.model.layers
    seen = seen_in_forward(hf, TOKENS, {"v0": layers[0].self_attn.v_norm, "v2": layers[2].self_attn.v_norm,
                                        "k2": layers[2].self_attn.k_proj, "gate": layers[1].per_layer_input_gate})
    with torch.no_grad():
        theirs = hf(TOKENS, output_attentions=True)
        per_layer = hf.model.project_per_layer_inputs(hf.model.embed_tokens(TOKENS), hf.model.get_per_layer_inputs(TOKENS))
        _, cache = model.run_with_cache(TOKENS)
    torch.testing.assert_close(cache["blocks.0.attn.hook_v_normed"], seen["v0"][1], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["blocks.2.attn.hook_v_normed"], seen["v2"][1], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["blocks.2.attn.hook_v"].flatten(-2), seen["k2"][1], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["blocks.1.per_layer.hook_in"], seen["gate"][0][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["per_layer_embed.hook_out"], per_layer, atol=1e-5, rtol=0)
    for layer in (2, 4, 5):
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_pattern"], theirs.attentions[layer], atol=1e-4, rtol=0)
    assert cache["blocks.2.attn.hook_q"].shape == (2, 13, 4, 16) and "blocks.4.attn.hook_k" not in cache


def test_the_experts_route_as_transformers_does(tmp_path):
    """The router's softmax over every expert (hook_expert_weights) and the experts' weighted sum are transformers'."""
    hf = build("gemma4", tmp_path, **EXPERTS)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    seen = seen_in_forward(hf, TOKENS, {"router": hf.model.layers[1].router, "experts": hf.model.layers[1].experts})
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS, names=["blocks.1.experts.hook_expert_weights",
                                                       "blocks.1.experts.hook_expert_indices",
                                                       "blocks.1.post_feedforward_layernorm_2.hook_in"])
    torch.testing.assert_close(cache["blocks.1.experts.hook_expert_weights"], seen["router"][1][0], atol=1e-5, rtol=0)
    assert torch.equal(cache["blocks.1.experts.hook_expert_indices"].sort(-1).values, seen["router"][1][2].sort(-1).values)
    torch.testing.assert_close(cache["blocks.1.post_feedforward_layernorm_2.hook_in"].flatten(0, 1), seen["experts"][1],
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", ["shared", "experts"])
def test_every_bridge_name_is_the_bridges_value_or_says_what_to_hook(variant, tmp_path):
    """TL 4's delegated Gemma 4 bridge, point by point under its own names. Its hook_attn_scores holds the pattern
    (the bridge delegates attention to transformers, which has no scores): probe's are the scores, so that name is
    compared with probe's pattern; its flattened router and expert points are left out, saying where probe has them."""
    directory = tokenized_checkpoint("gemma4", tmp_path / variant, **VARIANTS[variant])
    compared = compared_with_the_delegating_bridge(directory, TOKENS)
    wanted = {"attn.v_norm.hook_out", "attn.q_norm.hook_out", "ln2_post.hook_out", "hook_mlp_out", "hook_resid_post"}
    if variant == "shared":
        wanted |= {"per_layer_input_gate.hook_out", "per_layer_projection.hook_in", "post_per_layer_input_norm.hook_out"}
    else:
        wanted |= {"router.hook_out", "post_feedforward_layernorm_1.hook_in", "pre_feedforward_layernorm_2.hook_out"}
    assert wanted <= compared


def test_a_run_from_a_residual_starts_where_the_reused_keys_are_computed(tmp_path):
    """Layers 4 and 5 attend over layers 3's and 2's keys and values: a run from layer 2 (its per-layer inputs from
    tokens=) is the whole forward's; from layer 3 layer 2's keys are nowhere, and from a residual without tokens the
    per-layer inputs, and each says so."""
    build("gemma4", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        whole, cache = model.run_with_cache(TOKENS)
        resumed = model(cache["blocks.2.hook_resid_pre"], start_at_layer=2, tokens=TOKENS)
        torch.testing.assert_close(resumed, whole, atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="layer 2's keys and values .* run from a layer at or before 2"):
            model(cache["blocks.3.hook_resid_pre"], start_at_layer=3, tokens=TOKENS)
        with pytest.raises(ValueError, match="per-layer embedding .* tokens="):
            model(cache["blocks.1.hook_resid_pre"], start_at_layer=1)
        # a frozen cache keeps no keys of the pass that fills it for the next one: a later run from layer 3 cannot
        # read layer 2's keys of that pass either
        prefix = KVCache.init_cache(model.cfg, batch_size=2)
        model(TOKENS[:, :10], past_kv_cache=prefix)
        prefix.freeze()
        model(TOKENS[:, 10:], past_kv_cache=prefix)
        with pytest.raises(ValueError, match="layer 2's keys and values"):
            model(cache["blocks.3.hook_resid_pre"][:, 10:], start_at_layer=3, tokens=TOKENS[:, 10:],
                  past_kv_cache=prefix)
    assert [model.cfg.resume_layer(layer) for layer in range(6)] == [0, 1, 2, 2, 2, 2]


def test_heads_reading_their_own_inputs_compute_what_one_input_does(tmp_path):
    """With split inputs nothing changes, in the layers whose values are their keys' projection and in those that
    reuse keys; one key/value head's value input replaced by another prompt's residual gives that head the other
    prompt's values and leaves its keys and the other head's values as they were."""
    build("gemma4", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    plain, base, split, cache, theirs, edited = runs_with_one_heads_input_swapped(model, TOKENS, "blocks.0.hook_v_input", 0)
    torch.testing.assert_close(split, plain, atol=1e-4, rtol=0)
    torch.testing.assert_close(cache["blocks.5.attn.hook_z"], base["blocks.5.attn.hook_z"], atol=1e-4, rtol=0)
    v = edited["blocks.0.attn.hook_v"]
    torch.testing.assert_close(v[:, :, 0], theirs["blocks.0.attn.hook_v"][:, :, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(v[:, :, 1], cache["blocks.0.attn.hook_v"][:, :, 1], atol=0, rtol=0)
    torch.testing.assert_close(edited["blocks.0.attn.hook_k"], cache["blocks.0.attn.hook_k"], atol=0, rtol=0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_ledger_counts_every_parameter_and_transformers_cache(variant, tmp_path):
    """Parameters: transformers' count; KV-cache bytes per token: what transformers' cache holds after a prompt
    shorter than the window (the layers reusing keys hold none, the full layers' heads are wider)."""
    hf = build("gemma4", tmp_path, **VARIANTS[variant])
    model = HookedDecoder.from_pretrained(tmp_path)
    ledger = model.ledger()
    assert ledger.total_params == sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        cache = hf(TOKENS[:1, :3], use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers if getattr(layer, "keys", None) is not None
               for t in (layer.keys, layer.values))
    assert ledger.kv_bytes_per_token == held // 3


def test_the_hook_shapes_are_predicted(tmp_path):
    build("gemma4", tmp_path, **EXPERTS)
    _, _, cache, predicted = cache_of_everything(tmp_path)
    for name, value in cache.items():  # (an expert's points hold the rows routed to it: at most every token)
        rows = value.shape[0] if ".experts.experts." not in name else predicted[name][0]
        assert value.shape[0] <= rows and (rows, *value.shape[1:]) == predicted[name], name
    assert "blocks.2.attn.hook_v_normed" in cache and "blocks.1.experts.experts.0.hook_post" in cache


def _text(**overrides) -> dict:
    return dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=4, max_position_embeddings=40,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"], **overrides)


@pytest.mark.parametrize("unified", [False, True])
def test_the_multimodal_files_language_model_is_read(unified, tmp_path):
    """Gemma4ForConditionalGeneration (a vision tower beside it, per-layer inputs in its text_config) and the
    encoder-free Gemma4UnifiedForConditionalGeneration: probe reads the language model, its logits transformers',
    and saves it as the text-only format, which transformers loads with the same logits."""
    import transformers as tf

    if unified:
        hf = tf.Gemma4UnifiedForConditionalGeneration(tf.Gemma4UnifiedConfig(text_config=_text()))
    else:
        vision = tf.Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=2, head_dim=8)
        config = tf.Gemma4Config(text_config=_text(vocab_size_per_layer_input=101, hidden_size_per_layer_input=4),
                                 vision_config=vision.to_dict(), audio_config=None)
        hf = tf.Gemma4ForConditionalGeneration(config)
    hf = hf.eval()
    hf.save_pretrained(tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(input_ids=TOKENS).logits, atol=1e-4, rtol=0)
    assert (model.cfg.per_layer_inputs is None) == unified
    again = tf.Gemma4ForCausalLM.from_pretrained(model.save_pretrained(tmp_path / "saved")).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, hf(input_ids=TOKENS).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("change, match", [
    ({"use_bidirectional_attention": "all"}, "embedding model"),
    ({"per_layer_config": {"2": {"head_dim": 16}, "5": {"head_dim": 32}}}, "per_layer_config must give every"),
    ({"per_layer_config": {"1": {"head_dim": 16}, "2": {"head_dim": 16}, "5": {"head_dim": 16}}},
     "per_layer_config must give every"),
])
def test_config_settings_that_cannot_load_are_refused_by_name(change, match, tmp_path):
    import json

    from probe.config_file import CheckpointError

    build("gemma4", tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(CheckpointError, match=match):
        HookedDecoder.from_pretrained(tmp_path)


def test_config_errors_name_the_fix():
    from probe import DecoderConfig

    base = dict(n_layers=4, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, positions="rotary", sliding_window=2,
                sliding_layers=(True, False, True, False))
    with pytest.raises(ValueError, match="global_layers .* needs a sliding_window"):
        DecoderConfig(**{**base, "sliding_window": None, "sliding_layers": None}, global_layers={"d_head": 8})
    with pytest.raises(ValueError, match="layer 2 is windowed, but no layer before 2 is"):
        DecoderConfig(**{**base, "sliding_layers": (False, False, True, False)}, shared_kv={"layers": 2})
    with pytest.raises(ValueError, match="shared_kv.layers=4 must be a positive int below n_layers=4"):
        DecoderConfig(**base, shared_kv={"layers": 4})
    with pytest.raises(ValueError, match="do not combine with latent_attention, heads_per_layer or attn_only"):
        DecoderConfig(**base, layer_scalars=True, attn_only=True)


def test_compatibility_mode_skips_fold_ln_as_the_bridge_does(tmp_path):
    """The bridge's Gemma 4 adapter folds no norms (its per-layer inputs and scalars are not fold-safe): probe says it
    skips fold_ln, and gives the bridge's logits and activations."""
    directory = tokenized_checkpoint("gemma4", tmp_path / "g4")
    model, ours, cache, theirs, their_cache = caches_in_compatibility_mode(directory, TOKENS)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for name in ("blocks.0.ln1.hook_out", "blocks.2.attn.hook_pattern", "blocks.4.hook_resid_post", "ln_final.hook_out"):
        torch.testing.assert_close(cache[name], their_cache[name], atol=1e-4, rtol=0, msg=name)


def test_the_direct_attributions_add_up_to_the_logit_through_the_scalars(tmp_path):
    """Every block multiplies the whole residual by its scalar: each component is stacked as the final residual holds
    it, so the attributions (per-layer inputs among them) add up to the logit, and the accumulated sums at each layer
    are that layer's residual read through the final norm at its frozen scale."""
    import probe.analyses as A

    build("gemma4", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    attribution = A.direct_logit_attribution(model, TOKENS, answer=5, counterfactual=7)
    total = attribution.contributions.sum(-1) + attribution.ln_bias + attribution.unembed_bias
    torch.testing.assert_close(total, attribution.actual, atol=1e-4, rtol=0)
    assert "L3 per_layer" in attribution.index.names
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS)
        resid = cache["blocks.2.hook_resid_post"][:, -1] / cache["ln_final.hook_scale"][:, -1]
        lens = model.unembed.uncapped(resid * model.ln_final.w)  # (the accumulated sums are before the logit cap too)
    torch.testing.assert_close(attribution.accumulated[:, 6], lens[:, 5] - lens[:, 7], atol=1e-4, rtol=0)  # (site L2)


def test_the_analyses_that_read_every_heads_keys_refuse_by_name_and_the_report_says_why(tmp_path):
    import probe.analyses as A

    directory = tokenized_checkpoint("gemma4", tmp_path / "g4")
    model = HookedDecoder.from_pretrained(directory)
    with pytest.raises(ValueError, match=r"composition_scores: layers \[4, 5\] compute no keys or values"):
        A.composition_scores(model)
    with pytest.raises(AttributeError, match="it attends over layer 3's .* model.blocks\\[3\\].attn.W_K"):
        model.blocks[4].attn.W_K
    with pytest.raises(ValueError, match="circuit discovery: this model \\(Gemma 4\\) normalises each head's values"):
        A.edge_attribution(model, TOKENS % model.cfg.d_vocab, TOKENS.flip(-1) % model.cfg.d_vocab, lambda logits: logits[:, -1, 0])
    page = report_page(directory, tmp_path / "out")
    assert "Not run. Circuit discovery: this model (Gemma 4) normalises each head&#x27;s values" in page and "MLPs differ in width between layers" in page
    assert (tmp_path / "out" / "patching.csv").exists() and (tmp_path / "out" / "ablation.csv").exists()


def test_the_transformer_lens_state_dict_round_trips_and_stacks_refuse_by_name(tmp_path):
    """The TL layout holds each layer's projections as it has them (no W_K / W_V where a layer reuses keys, no W_V
    where its values are its keys), and loads back into the same logits; stacks over layers and the cache's
    decomposition into sublayer writes say why they do not apply."""
    build("gemma4", tmp_path, **{**EXPERTS, "attention_bias": True, "hidden_size_per_layer_input": 4, "num_kv_shared_layers": 2})
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    state = model.state_dict()
    assert state["blocks.2.attn._W_K"].shape == (1, 32, 16) and "blocks.2.attn._W_V" not in state
    assert "blocks.4.attn._W_K" not in state and state["blocks.4.attn.W_Q"].shape == (4, 32, 8)
    again = HookedDecoder(model.cfg).eval()
    again.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS), model(TOKENS), atol=1e-6, rtol=0)
        _, cache = model.run_with_cache(TOKENS)
    with pytest.raises(ValueError, match=r"model.W_K: layers \[4, 5\] compute no keys or values"):
        model.W_K
    with pytest.raises(ValueError, match="Gemma 4's wider full-attention heads"):
        model.W_Q
    with pytest.raises(ValueError, match="decompose_resid: every block of this model .* by its scalar"):
        cache.decompose_resid()


def test_gemma4_on_the_device_is_transformers_there(tmp_path, device_under_test):
    """On the GPU (the GPU list): the E2B-like model (per-layer inputs, layers reusing keys, values from keys) and the
    experts beside its MLPs, against transformers' model on the same device, and the greedy continuation through the
    cache."""
    from family_checks import assert_on_the_device_as_transformers

    assert_on_the_device_as_transformers(build("gemma4", tmp_path, **{**EXPERTS, "hidden_size_per_layer_input": 4,
                                                                        "num_kv_shared_layers": 2}),
                                         tmp_path, device_under_test, 40)
