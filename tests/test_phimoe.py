"""LongRoPE (Phi-3's long-context models, Phi-3.5-mini, Phi-4-mini; probe.rotary.LongRopeRotary) and PhiMoE
(probe/checkpoint_phimoe.py: sparsemixer routing, LayerNorms, biases). The logits and every residual of each case
are compared with transformers in test_variants.py (CASES); here: the frequencies against transformers' own LongRoPE
function, the switch at the threshold for the whole call, saving, the key/value cache across the threshold (a
forward, and generation), TL 4's bridge hook by hook; PhiMoE's router against transformers' sparsemixer and its
router module, its long regime, generation, left padding, compatibility mode, the ledger and the report."""
from __future__ import annotations

import json

import pytest
import torch

from probe import HookedDecoder
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, compared_with_the_delegating_bridge, report_page,
                           seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import CASES, PHI3_LONGROPE, PHIMOE_LONGROPE, build

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))
LONG = CASES["phi3-longrope-long"][1]  # a pretraining context of 16 positions


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens) if isinstance(model, HookedDecoder) else model(tokens).logits


# ---- LongRoPE ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", [1.0, 0.75])
def test_longrope_frequencies_and_factor_are_transformers(fraction, tmp_path):
    """Both regimes' frequencies and the attention factor (derived from max_position_embeddings over the pretraining
    context, as no factor is given) are what transformers' own _compute_longrope_parameters returns, partial rotary
    (phi-4-mini's) included."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    pairs = int(16 * fraction) // 2
    rope = {**PHI3_LONGROPE, "partial_rotary_factor": fraction, "short_factor": PHI3_LONGROPE["short_factor"][:pairs],
            "long_factor": PHI3_LONGROPE["long_factor"][:pairs]}
    hf = build("phi3", tmp_path, original_max_position_embeddings=16, rope_parameters=rope)
    rotary = HookedDecoder.from_pretrained(tmp_path).blocks[0].attn.rotary
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](hf.config, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf.config, "cpu", seq_len=17)
    assert rotary.dim == 2 * pairs and not torch.allclose(short, long)
    torch.testing.assert_close(rotary.inv_freq, short, rtol=1e-6, atol=0)
    torch.testing.assert_close(rotary.long_inv_freq, long, rtol=1e-6, atol=0)
    assert rotary.amplitude == rotary.long_amplitude == pytest.approx(factor) == pytest.approx(hf.model.rotary_emb.attention_scaling)
    assert factor > 1.1  # (40 / 16: sqrt(1 + ln 2.5 / ln 16))


def test_longrope_switches_for_the_whole_call_at_the_threshold(tmp_path):
    """Within the pretraining context (16 positions) every position turns the short way, past it every position the
    long way, the earlier ones too: 16 and 17 tokens are transformers' logits, and the 17-token call's first 16
    positions differ from the 16-token call's (a batch switches together: its longest row decides)."""
    hf = build("phi3", tmp_path, **LONG)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(4))
    for length in (16, 17):
        torch.testing.assert_close(_logits(model, tokens[:, :length]), _logits(hf, tokens[:, :length]), atol=1e-4, rtol=0)
    assert (_logits(model, tokens)[:, :16] - _logits(model, tokens[:, :16])).abs().max() > 1e-3


def test_longrope_is_written_back_for_transformers_in_both_spellings(tmp_path):
    """Saved, a LongRoPE model (read from transformers 5's rope_parameters, or an older file's "su" rope_scaling with
    rope_theta beside it, which transformers 5 rewrites on saving) is read back by transformers as the same model in
    both regimes: config.json names the pretraining context beside the rope dict, where Phi3Config reads it (it
    would otherwise take its own 4096)."""
    import transformers as tf

    tokens = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(5))
    for spelling in ("longrope", "su"):
        hf = build("phi3", tmp_path / spelling, **LONG)
        if spelling == "su":
            config = json.loads((tmp_path / spelling / "config.json").read_text())
            theta = config.pop("rope_parameters")["rope_theta"]
            config.update(rope_theta=theta, rope_scaling={"type": "su", "short_factor": PHI3_LONGROPE["short_factor"],
                                                          "long_factor": PHI3_LONGROPE["long_factor"]})
            (tmp_path / spelling / "config.json").write_text(json.dumps(config))
            hf = tf.Phi3ForCausalLM.from_pretrained(tmp_path / spelling).eval()
        model = HookedDecoder.from_pretrained(tmp_path / spelling).eval()
        torch.testing.assert_close(_logits(model, tokens), _logits(hf, tokens), atol=1e-4, rtol=0)
        out = model.save_pretrained(tmp_path / f"{spelling}-saved")
        written = json.loads((out / "config.json").read_text())
        assert written["original_max_position_embeddings"] == 16 and written["rope_parameters"]["rope_type"] == "longrope"
        again = tf.Phi3ForCausalLM.from_pretrained(out).eval()
        for length in (12, 40):
            torch.testing.assert_close(_logits(again, tokens[:, :length]), _logits(hf, tokens[:, :length]), atol=1e-5,
                                       rtol=0)


def test_phi3s_own_pretraining_context_overrides_the_rope_dicts(tmp_path):
    """Phi3Config keeps original_max_position_embeddings beside the rope dict, 4096 unless config.json says, and
    puts it over the dict's: a file naming 16 only inside the dict turns the short way at 40 positions in
    transformers, and in probe."""
    import transformers as tf

    build("phi3", tmp_path, **LONG)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["original_max_position_embeddings"]
    config["rope_parameters"]["original_max_position_embeddings"] = 16
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = tf.Phi3ForCausalLM.from_pretrained(tmp_path).eval()
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    assert model.cfg.rotary_scaling.original_n_ctx == 4096
    torch.testing.assert_close(_logits(model, TOKENS), _logits(hf, TOKENS), atol=1e-4, rtol=0)


def test_a_phi3_yarn_rope_is_read_as_longrope_as_transformers_reads_it(tmp_path):
    """Phi3Config renames a "yarn" rope (as "su") to LongRoPE: such a file is the LongRoPE model."""
    import transformers as tf

    build("phi3", tmp_path, **LONG)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"]["rope_type"] = "yarn"
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = tf.Phi3ForCausalLM.from_pretrained(tmp_path).eval()
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    assert model.cfg.rotary_scaling.kind == "longrope"
    tokens = torch.randint(0, 101, (2, 20), generator=torch.Generator().manual_seed(11))  # (past the threshold)
    torch.testing.assert_close(_logits(model, tokens), _logits(hf, tokens), atol=1e-4, rtol=0)


def test_a_cached_forward_across_the_threshold_is_transformers(tmp_path):
    """A key/value cache keeps keys as their own pass rotated them: a prompt within the pretraining context, then a
    pass that crosses it (its new keys and queries the long way, the cached keys still the short way), as
    transformers' forward with its cache gives; it then differs from one forward of the whole sequence."""
    from transformers import DynamicCache

    from probe.kv_cache import KVCache

    hf = build("phi3", tmp_path, **LONG)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (2, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        theirs_cache = DynamicCache(config=hf.config)
        hf(tokens[:, :12], past_key_values=theirs_cache)
        theirs = hf(tokens[:, 12:], past_key_values=theirs_cache).logits
        cache = KVCache.init_cache(model.cfg, batch_size=2)
        model(tokens[:, :12], past_kv_cache=cache)
        ours = model(tokens[:, 12:], past_kv_cache=cache)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert (ours - _logits(model, tokens)[:, 12:]).abs().max() > 1e-3


def test_generation_across_the_threshold_restarts_the_cache_as_transformers_does(tmp_path):
    """transformers' Phi-3 generation drops its cache when the sequence first passes the pretraining context and reads
    the whole sequence again (every key then turns the long way); probe's does the same, so each step's logits are one
    forward's of the sequence so far, with or without the cache, and the continuation is transformers'."""
    hf = build("phi3", tmp_path, **LONG)
    hf.generation_config.eos_token_id = None
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    prompt = torch.randint(4, 101, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
        cached = model.generate(prompt, max_new_tokens=10, do_sample=False, verbose=False, output_logits=True)
        uncached = model.generate(prompt, max_new_tokens=10, do_sample=False, verbose=False, output_logits=True,
                                  use_past_kv_cache=False)
    assert torch.equal(cached.sequences, expected) and torch.equal(uncached.sequences, expected)
    for step, (a, b) in enumerate(zip(cached.logits, uncached.logits)):  # (past the threshold at step 5)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m: f"step {step}: {m}")


def test_longrope_phi3_hooks_match_the_bridge(tmp_path):
    """TL 4's Phi-3 adapter on a LongRoPE checkpoint, past the threshold (20 positions) and within it (12): every point
    both have, hook by hook; probe alone has the rotated q and k."""
    from test_transformer_lens import compare_with_transformer_lens

    directory = tokenized_checkpoint("phi3", tmp_path / "checkpoint", **LONG)
    for n_pos in (20, 12):
        missing, theirs = compare_with_transformer_lens(directory, n_pos, seed=6)
        assert missing == {f"blocks.{l}.attn.hook_rot_{p}" for l in range(2) for p in "qk"}
        assert "blocks.1.attn.hook_pattern" in theirs


def test_longrope_is_refused_where_it_cannot_apply():
    from probe import DecoderConfig

    scaling = {"kind": "longrope", "factor": 2.0, "original_n_ctx": 4, "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]}
    with pytest.raises(ValueError, match="rotary_adjacent_pairs=False"):
        DecoderConfig(n_layers=1, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, positions="rotary",
                      rotary_adjacent_pairs=True, rotary_scaling=scaling)
    cfg = DecoderConfig(n_layers=1, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, positions="rotary",
                        rotary_scaling=scaling)
    assert DecoderConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


# ---- PhiMoE --------------------------------------------------------------------------------------------------
def test_sparsemixer_is_transformers_on_any_logits():
    """probe's routing against transformers' sparsemixer function (inference) on logits of both signs, ties of the
    mask's edge included, for masks from none to every expert."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    from probe.config import DecoderConfig

    logits = torch.randn(300, 6, generator=torch.Generator().manual_seed(8)) * torch.tensor([0.05, 1, 3, 10, -1, 2])
    logits[:50] -= 4  # (every logit negative: the mask's denominator is then |logit|)
    for eps in (0.0, 0.01, 0.1, 0.5, 3.0):
        cfg = DecoderConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=11, n_ctx=8, gated_mlp=True, experts={
            "n": 6, "per_token": 2, "softmax_over": "sparsemixer", "sparsemixer_eps": eps})
        from probe.moe import MoEMLP

        weights, chosen = MoEMLP(cfg).route(logits)
        expected_weights, expected = sparsemixer(logits, jitter_eps=eps, training=False)
        assert torch.equal(chosen, expected), eps
        torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=0, msg=lambda m: f"eps={eps}: {m}")


@pytest.mark.parametrize("case", ["phimoe-sparsemixer", "phimoe-biases-window-wide-mask"])
def test_the_routing_points_are_transformers_router(case, tmp_path):
    """hook_expert_indices is the choice transformers' router returns (the first choice first), hook_expert_weights
    its two weights at the chosen experts and 0 elsewhere; with the wide mask the weights are not one softmax's."""
    hf = build("phimoe", tmp_path, **CASES[case][1])
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    layer = hf.model.layers[1]
    seen = seen_in_forward(hf, TOKENS, {"router": layer.mlp.router})
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS)
    logits, weights, chosen = seen["router"][1]
    assert torch.equal(cache["blocks.1.mlp.hook_expert_indices"], chosen)
    ours = cache["blocks.1.mlp.hook_expert_weights"]
    torch.testing.assert_close(ours.gather(1, chosen), weights, atol=1e-6, rtol=0)
    assert (ours > 0).sum(-1).max() == 2
    plain = logits.softmax(-1).gather(1, chosen)
    assert (plain - weights).abs().max() > 1e-2  # (the masks change the weights)


def test_phimoe_past_the_threshold_turns_the_long_way_unlike_transformers_5(tmp_path, monkeypatch):
    """Past the pretraining context probe turns every position by long_factor, times long_mscale, as Microsoft's code
    and transformers 4 do: transformers 5.25's PhimoeRotaryEmbedding recomputes its frequencies without the sequence
    length (short_factor's) and switches only the factor. Its forward, given the length again, is probe's; as
    released, it is not."""
    from transformers.models.phimoe import modeling_phimoe

    hf = build("phimoe", tmp_path, rope_parameters=PHIMOE_LONGROPE)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (2, 30), generator=torch.Generator().manual_seed(9))
    as_released = _logits(hf, tokens)

    def rotary_with_the_length(self, x, position_ids=None):  # transformers 4.46's forward, on 5.25's module
        rope = self.config.rope_parameters
        seq_len = int(position_ids.max()) + 1
        mscale = rope["long_mscale"] if seq_len > rope["original_max_position_embeddings"] else rope["short_mscale"]
        inv_freq, _ = self.rope_init_fn(self.config, x.device, seq_len=seq_len)
        angles = position_ids[..., None].float() * inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        return (emb.cos() * mscale).to(x.dtype), (emb.sin() * mscale).to(x.dtype)

    monkeypatch.setattr(modeling_phimoe.PhimoeRotaryEmbedding, "forward", rotary_with_the_length)
    torch.testing.assert_close(_logits(model, tokens), _logits(hf, tokens), atol=1e-4, rtol=0)
    assert (_logits(model, tokens) - as_released).abs().max() > 1e-3
    torch.testing.assert_close(_logits(model, tokens[:, :16]), _logits(hf, tokens[:, :16]), atol=1e-4, rtol=0)


def test_phimoes_rope_and_routing_are_written_back_for_transformers(tmp_path):
    """Saved, PhiMoE's LongRoPE keeps its two attention factors as short_mscale and long_mscale, and its mask width as
    router_jitter_noise: transformers reads back the same model within and past the threshold."""
    import transformers as tf

    rope = CASES["phimoe-longrope-long-mscale"][1]["rope_parameters"]
    hf = build("phimoe", tmp_path / "original", rope_parameters=rope, router_jitter_noise=0.2)
    out = HookedDecoder.from_pretrained(tmp_path / "original").save_pretrained(tmp_path / "saved")
    written = json.loads((out / "config.json").read_text())
    assert (written["rope_parameters"]["short_mscale"], written["rope_parameters"]["long_mscale"]) == (1.1, 1.35)
    again = tf.PhimoeForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 101, (2, 30), generator=torch.Generator().manual_seed(10))
    for length in (12, 30):
        torch.testing.assert_close(_logits(again, tokens[:, :length]), _logits(hf, tokens[:, :length]), atol=1e-5, rtol=0)


def test_the_rotary_tables_are_a_full_contexts(tmp_path):
    """transformer-lens's attn.rotary_cos / rotary_sin hold every position up to n_ctx, so a LongRoPE model's are the
    long regime's, its attention factor (PhiMoE's long_mscale) included: transformers' rotary embedding on a full
    context."""
    hf = build("phimoe", tmp_path, **CASES["phimoe-longrope-long-mscale"][1])
    attn = HookedDecoder.from_pretrained(tmp_path).blocks[0].attn
    with torch.no_grad():
        cos, sin = hf.model.rotary_emb(torch.zeros(1), torch.arange(40)[None])
    torch.testing.assert_close(attn.rotary_cos, cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(attn.rotary_sin, sin[0], atol=1e-6, rtol=0)
    assert attn.rotary_cos[0, 0] == pytest.approx(1.35)


@pytest.mark.parametrize("case", ["phimoe-sparsemixer", "phimoe-biases-window-wide-mask"])
def test_generation_and_processing_are_transformers(case, tmp_path):
    hf = build("phimoe", tmp_path, **CASES[case][1])
    assert_generation_and_processing_match(hf, tmp_path)


def test_generation_across_phimoes_threshold_is_transformers(tmp_path):
    """A 6-token prompt and 8 new tokens past a 10-token pretraining context: the cache restarts where transformers'
    does (the factors equal in both regimes, as transformers 5.25 turns both the short way; the mscale switches)."""
    rope = {**PHIMOE_LONGROPE, "original_max_position_embeddings": 10, "long_factor": PHIMOE_LONGROPE["short_factor"]}
    hf = build("phimoe", tmp_path, rope_parameters=rope)
    assert_generation_and_processing_match(hf, tmp_path, processing=False)


def test_a_cached_prefix_and_left_padding_are_transformers(tmp_path):
    hf = build("phimoe", tmp_path, **CASES["phimoe-biases-window-wide-mask"][1])
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, _ = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.length == 13
    assert_left_padded_generation_matches(hf, tmp_path)


def test_every_bridge_name_is_the_bridges_value_or_says_what_to_hook(tmp_path):
    """TL 4's PhiMoE adapter (attention delegated to transformers; it boots from the releases' PhiMoEForCausalLM)
    point by point under its own names; the router's points it holds (the chosen experts' weights, the logits) say
    what to hook in probe."""
    directory = tokenized_checkpoint("phimoe", tmp_path / "phimoe", attention_bias=True, lm_head_bias=True)
    compared = compared_with_the_delegating_bridge(directory, TOKENS)
    assert {"ln1.hook_scale", "ln2.hook_normalized", "attn.q.hook_out", "attn.o.hook_out", "attn.hook_pattern",
            "attn.hook_z", "mlp.hook_in", "mlp.hook_out", "mlp.gate.hook_expert_indices", "hook_resid_mid"} <= compared


def test_compatibility_mode_is_the_bridges_but_where_it_cannot_fold(tmp_path):
    """enable_compatibility_mode on both. The bridge's PhiMoE adapter folds ln1 and the final norm, but not ln2 into
    the router and experts (a LayerNorm with a bias: "fold_ln could not reach the expert weights"), and leaves the
    experts' writes uncentred; probe folds and centres every layer, as transformer-lens 3 does (one basis for the
    whole residual stream). So the logits, ln1's output, the patterns and every residual less its mean are the
    bridge's; ln2's output is its normalised input in probe and w x + b in the bridge."""
    import warnings

    from transformer_lens.model_bridge import TransformerBridge

    directory = tokenized_checkpoint("phimoe", tmp_path / "phimoe", attention_bias=True, lm_head_bias=True)
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(str(directory))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.enable_compatibility_mode()
    bridge.enable_compatibility_mode()
    assert not model.cfg.default_prepend_bos and not bridge.cfg.default_prepend_bos  # (TL 4's adapter's)
    with torch.no_grad():
        ours, cache = model.run_with_cache(TOKENS)
        theirs, their_cache = bridge.run_with_cache(TOKENS)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for name in ("blocks.0.ln1.hook_out", "blocks.1.attn.hook_pattern", "blocks.1.ln2.hook_normalized"):
        torch.testing.assert_close(cache[name], their_cache[name], atol=1e-4, rtol=0, msg=name)
    for name in ("blocks.0.hook_resid_post", "blocks.1.hook_resid_post"):
        centred = [x - x.mean(-1, keepdim=True) for x in (cache[name], their_cache[name])]
        torch.testing.assert_close(*centred, atol=1e-4, rtol=0, msg=name)
    torch.testing.assert_close(cache["blocks.1.ln2.hook_out"], cache["blocks.1.ln2.hook_normalized"])
    assert (cache["blocks.1.ln2.hook_out"] - their_cache["blocks.1.ln2.hook_out"]).abs().max() > 0.1


def test_the_ledger_counts_transformers_parameters_and_cache(tmp_path):
    hf = build("phimoe", tmp_path, attention_bias=True, lm_head_bias=True)
    ledger = HookedDecoder.from_pretrained(tmp_path).ledger()
    assert ledger.total_params == sum(p.numel() for p in hf.parameters())
    with torch.no_grad():
        cache = hf(TOKENS[:1, :3], use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert ledger.kv_bytes_per_token == held // 3


@pytest.mark.parametrize("kind, case", [("phi3", "phi3-longrope-long"), ("phimoe", "phimoe-longrope-long-mscale")])
def test_longrope_on_the_device_is_transformers_there(kind, case, tmp_path, device_under_test):
    """On the GPU (the GPU list): 20 positions past a 16-position pretraining context, and a 9-token prompt's greedy
    continuation through the cache across it (the regime picked on the device, the cache restarted), against
    transformers' model on the same device."""
    from family_checks import assert_on_the_device_as_transformers

    assert_on_the_device_as_transformers(build(kind, tmp_path, **CASES[case][1]), tmp_path, device_under_test, 20)


@pytest.mark.parametrize("change, match", [
    ({"num_experts_per_tok": 1}, "always chooses two experts per token"),
    ({"rope_parameters": {**PHIMOE_LONGROPE, "long_mscale": None}}, "short_mscale and long_mscale"),
    ({"partial_rotary_factor": 0.5}, "rotates whole heads"),
])
def test_settings_transformers_would_not_run_as_written_are_refused(change, match, tmp_path):
    from probe.config_file import CheckpointError

    build("phimoe", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=match):
        HookedDecoder.from_pretrained(tmp_path)


def test_the_report_runs(tmp_path):
    directory = tokenized_checkpoint("phimoe", tmp_path / "phimoe")
    page = report_page(directory, tmp_path / "out")
    assert "Expert routing" in page


@pytest.mark.parametrize("softmax_over", ["sparsemixer", "chosen"])
def test_routing_no_format_holds_is_refused_on_saving(softmax_over, tmp_path):
    """An RMS-normed model whose experts route as PhiMoE's (or GPT-OSS's) is not Mixtral's, OLMoE's or Qwen's: each
    of those formats would save it and transformers read back other routing, so saving names the routing instead."""
    from probe.config import DecoderConfig, Experts

    cfg = DecoderConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=11, n_ctx=8, positions="rotary", norm="rms",
                        gated_mlp=True, activation="silu", experts=Experts(4, 2, softmax_over=softmax_over))
    with pytest.raises(ValueError, match=f"softmax_over='{softmax_over}'"):
        HookedDecoder(cfg).save_pretrained(tmp_path / "saved")
