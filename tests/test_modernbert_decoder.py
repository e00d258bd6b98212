"""ModernBERT decoders (probe/checkpoint_modernbert.py, probe/prediction_head.py: the Ettin decoders). The logits and
every residual of each case are compared with transformers in test_variants.py (CASES) with saving; here: the points
against transformers' own modules (the embedding's norm, layer 0 without an attention norm, Wi's halves, the
prediction head), the window (half of local_attention) and its rotary bases, generation through the cache across
the window, left padding, processing, TL 4's bridge hook by hook and in compatibility mode, the ledger against
transformers, the report, and the analyses that run through the head or refuse it by name."""
from __future__ import annotations

import pytest
import torch

from probe import DecoderConfig, HookedDecoder
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, assert_on_the_device_as_transformers,
                           cache_of_everything, report_page, seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import build

KIND = "modernbert_decoder"
TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))  # (the window is 4 keys)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers' model, the directory, probe's model) of build("modernbert_decoder") with every bias."""
    directory = tmp_path_factory.mktemp("modernbert")
    hf = build(KIND, directory, norm_bias=True, attention_bias=True, mlp_bias=True, classifier_bias=True)
    return hf, directory, HookedDecoder.from_pretrained(directory).eval()


def test_the_config_reads_the_window_as_transformers_halves_it_and_each_kind_its_base(checkpoint):
    hf, _, model = checkpoint
    cfg = model.cfg
    assert cfg.sliding_window == hf.config.sliding_window == 4  # local_attention 8
    assert cfg.sliding_layers == (False, True, False, True) and (cfg.rotary_base, cfg.sliding_rotary_base) == (1000.0, 50.0)
    assert cfg.embed_norm is True and cfg.first_ln1 is False and cfg.prediction_head.activation == "gelu"
    with torch.no_grad():
        theirs = hf(TOKENS, output_attentions=True).attentions
        _, cache = model.run_with_cache(TOKENS, names=lambda n: n.endswith("hook_pattern"))
    for layer in range(4):
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_pattern"], theirs[layer], atol=1e-5, rtol=0)
    # a windowed layer's query sees its own key and the 3 before it; a full layer's every earlier one
    assert (cache["blocks.1.attn.hook_pattern"][0, 0, 12] > 0).sum() == 4
    assert (cache["blocks.2.attn.hook_pattern"][0, 0, 12] > 0).sum() == 13


def test_left_out_keys_read_as_transformers_defaults(tmp_path):
    """A config.json without rope_parameters, local_attention, layer_types or the head's keys (older files name
    global_rope_theta / local_rope_theta, or nothing): each kind's base, the window and the layer kinds are what
    transformers' config class fills in."""
    import json

    import transformers as tf

    from probe.loading import config_from_hf

    build(KIND, tmp_path, num_hidden_layers=5)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "local_attention", "sliding_window", "layer_types", "classifier_activation",
                "classifier_bias", "decoder_bias", "norm_eps", "hidden_activation"):
        config.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs, ours = tf.AutoConfig.from_pretrained(tmp_path), config_from_hf(config, tmp_path)
    assert (ours.rotary_base, ours.sliding_rotary_base) == (theirs.rope_parameters["full_attention"]["rope_theta"],
                                                            theirs.rope_parameters["sliding_attention"]["rope_theta"])
    assert ours.sliding_window == theirs.sliding_window and ours.eps == theirs.norm_eps
    assert [ours.layer_window(l) is not None for l in range(5)] == [t == "sliding_attention" for t in theirs.layer_types]
    assert ours.prediction_head.activation == theirs.classifier_activation and ours.unembed_bias == theirs.decoder_bias
    config.update(global_rope_theta=500.0, local_rope_theta=20.0, global_attn_every_n_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs, ours = tf.AutoConfig.from_pretrained(tmp_path), config_from_hf(config, tmp_path)
    assert (ours.rotary_base, ours.sliding_rotary_base) == (500.0, 20.0) == (
        theirs.rope_parameters["full_attention"]["rope_theta"], theirs.rope_parameters["sliding_attention"]["rope_theta"])
    assert [ours.layer_window(l) is not None for l in range(5)] == [t == "sliding_attention" for t in theirs.layer_types]


def test_the_points_hold_transformers_values(checkpoint):
    """The embedding's norm is hook_embed; layer 0's ln1 passes the residual through (its scale ones, by name);
    mlp.hook_pre is the first half of Wi's output (the activated one), hook_pre_linear the second; the head's points
    are transformers' lm_head's dense output, activation and output, what the decoder reads."""
    hf, _, model = checkpoint
    layer = hf.model.layers[1]
    seen = seen_in_forward(hf, TOKENS, {"embed": hf.model.embeddings, "wi": layer.mlp.Wi, "attn_norm": layer.attn_norm,
                                        "dense": hf.lm_head.dense, "act": hf.lm_head.act, "head": hf.lm_head,
                                        "final": hf.model.final_norm})
    names = ["hook_embed", "blocks.0.hook_resid_pre", "blocks.1.ln1.hook_out", "blocks.1.mlp.hook_pre",
             "blocks.1.mlp.hook_pre_linear", "ln_final.hook_out", "unembed.head.hook_pre", "unembed.head.hook_post",
             "unembed.hook_in"] + [f"blocks.0.ln1.{p}" for p in ("hook_scale", "hook_normalized", "hook_out")]
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS, names=names)
    close = lambda ours, theirs: torch.testing.assert_close(cache[ours], theirs, atol=1e-5, rtol=0)  # noqa: E731
    close("hook_embed", seen["embed"][1])
    close("blocks.0.ln1.hook_out", cache["blocks.0.hook_resid_pre"])
    close("blocks.0.ln1.hook_normalized", cache["blocks.0.hook_resid_pre"])
    assert torch.equal(cache["blocks.0.ln1.hook_scale"], torch.ones(2, 13, 1))
    close("blocks.1.ln1.hook_out", seen["attn_norm"][1])
    first, second = seen["wi"][1].chunk(2, dim=-1)
    close("blocks.1.mlp.hook_pre", first)
    close("blocks.1.mlp.hook_pre_linear", second)
    close("ln_final.hook_out", seen["final"][1])
    close("unembed.head.hook_pre", seen["dense"][1])
    close("unembed.head.hook_post", seen["act"][1])
    close("unembed.hook_in", seen["head"][1])
    assert model.blocks[0].ln1.__class__.__name__ == "NoNorm" and not any(n.startswith("blocks.0.ln1.") for n, _ in
                                                                          model.named_parameters())


def test_generation_through_the_window_and_processing_are_transformers(checkpoint):
    """Greedy generation past the window (6 + 8 tokens, a window of 4) through probe's cache; TL's default
    processing skips fold_ln (the final norm feeds the head) and centring the writers (layer 0 reads the residual
    itself), centres the unembedding, and keeps the log-probs."""
    hf, directory, _ = checkpoint
    with pytest.warns(UserWarning, match="fold_ln") as caught:
        assert_generation_and_processing_match(hf, directory)
    assert any("center_writing_weights" in str(w.message) for w in caught)


def test_a_cached_prefix_then_its_continuation_is_one_forward(checkpoint):
    _, _, model = checkpoint
    assert_cached_parts_are_one_forward(model, TOKENS)


def test_left_padded_batched_generation_is_transformers(checkpoint):
    hf, directory, _ = checkpoint
    assert_left_padded_generation_matches(hf, directory)


def test_processing_refuses_what_the_head_and_layer_0_break_and_centres_the_unembedding(checkpoint):
    from probe.processing import process_weights

    hf, directory, model = checkpoint
    with pytest.raises(ValueError, match="fold_ln: the final norm feeds a prediction head's dense layer"):
        process_weights(HookedDecoder.from_pretrained(directory), fold_ln=True, center_writing_weights=False)
    with pytest.raises(ValueError, match=r"first_ln1=False \(False: layer 0's attention reads the residual itself\)"):
        process_weights(HookedDecoder.from_pretrained(directory), fold_ln=False, center_writing_weights=True)
    centred = process_weights(HookedDecoder.from_pretrained(directory), fold_ln=False, center_writing_weights=False,
                              center_unembed=True).eval()
    assert centred.unembed.W_U.mean(-1).abs().max() < 1e-6
    with torch.no_grad():
        torch.testing.assert_close(centred(TOKENS).log_softmax(-1), hf(TOKENS).logits.log_softmax(-1), atol=1e-5,
                                   rtol=0)


def test_every_point_the_bridge_fires_holds_its_value_or_says_what_to_hook(tmp_path):
    """TL 4's adapter, hook by hook: its delegated attention's hook_attn_scores holds the pattern; its mlp.hook_pre
    is Wi's whole output, probe's hook_pre and hook_pre_linear side by side; its prediction_head's ends are
    ln_final's output and the unembedding's input; layer 0's ln1 fires its input with a scale of ones."""
    from transformer_lens.model_bridge import TransformerBridge

    from probe.hooks import UnknownNameError

    directory = tokenized_checkpoint(KIND, tmp_path / "tok", attention_bias=True, classifier_bias=True)
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.from_pretrained(directory).eval()
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
    compared, ours_of = set(), {}
    for name in theirs:
        short = name.split(".", 2)[-1] if name.startswith("blocks.") else name
        try:
            ours_of[name] = model.hook_point(name).name
        except UnknownNameError as err:  # (what to hook instead, never a bare unknown name)
            assert "hook" in str(err) and "closest valid names" not in str(err), name
            compared.add(f"refused {short}")
    with torch.no_grad():
        our_logits, ours = model.run_with_cache(tokens, names=sorted({*ours_of.values(), *(
            f"blocks.{l}.{p}" for l in range(4) for p in ("mlp.hook_pre_linear", "attn.hook_pattern"))}))
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    for name, ours_name in ours_of.items():
        short = name.split(".", 2)[-1] if name.startswith("blocks.") else name
        mine = ours[ours_name]
        if name.endswith("mlp.hook_pre"):
            mine = torch.cat([mine, ours[ours_name + "_linear"]], dim=-1)
        elif name.endswith("hook_attn_scores"):
            mine = ours[ours_name.replace("hook_attn_scores", "hook_pattern")]
        torch.testing.assert_close(mine, theirs[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
        compared.add(short)
    assert {"embed_ln.hook_normalized", "ln1.hook_scale", "attn.hook_attn_scores", "mlp.hook_pre", "mlp.hook_post",
            "prediction_head.hook_in", "prediction_head.hook_out", "unembed.hook_in", "unembed.hook_out",
            "refused mlp.in.hook_out", "refused rotary_emb.hook_cos"} <= compared


def test_compatibility_mode_is_the_bridges(tmp_path):
    """The adapter declares fold_ln and centring the writers unsupported: probe skips both, saying so, centres the
    unembedding as the bridge does, and gives the bridge's logits and activations."""
    from transformer_lens.model_bridge import TransformerBridge

    directory = tokenized_checkpoint(KIND, tmp_path / "tok")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(str(directory))
    with pytest.warns(UserWarning, match="skipping fold_ln, center_writing_weights, which transformer-lens 4's bridge"):
        model.enable_compatibility_mode()
    bridge.enable_compatibility_mode()
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        (ours, cache), (theirs, their_cache) = model.run_with_cache(tokens), bridge.run_with_cache(tokens)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for name in ("embed_ln.hook_out", "blocks.0.ln1.hook_out", "blocks.1.ln1.hook_out", "blocks.3.hook_resid_post",
                 "ln_final.hook_out", "prediction_head.hook_out", "unembed.hook_out"):
        torch.testing.assert_close(cache[name], their_cache[name], atol=1e-4, rtol=0, msg=name)


def test_a_cache_of_everything_has_the_predicted_shapes(checkpoint):
    _, directory, _ = checkpoint
    _, _, cache, shapes = cache_of_everything(directory)
    assert {"unembed.head.hook_pre", "unembed.head.hook_post", "unembed.head.ln.hook_scale"} <= set(cache)
    for name in cache:
        assert tuple(cache[name].shape) == tuple(shapes[name]), name


def test_the_ledger_counts_every_parameter_and_transformers_cache(checkpoint):
    hf, _, model = checkpoint
    ledger = model.ledger()
    assert ledger.total_params == sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
    assert ledger.group_params("unembedding") == 64 * 64 + 64 + 2 * 64 + 101  # the head, and the decoder's bias
    with torch.no_grad():
        cache = hf(TOKENS[:1, :3], use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert ledger.kv_bytes_per_token == held // 3


def test_analyses_through_the_head_run_and_linear_readings_refuse_by_name(checkpoint):
    import probe.analyses as A
    from probe.analyses.metric_reads import read_logits

    hf, _, model = checkpoint
    with torch.no_grad():
        logits = hf(TOKENS).logits
        lens = A.logit_lens(model, TOKENS)
        _, cache = model.run_with_cache(TOKENS)
        final = model(TOKENS, stop_at_layer=model.cfg.n_layers)
        positions, columns = torch.tensor([12, 5]), torch.tensor([[3, 7], [9, 1]])
        read = read_logits(model, final, positions, columns)
    # the lens's last site is the model's own output, through the head
    torch.testing.assert_close(lens.logits[:, -1], logits.log_softmax(-1) if lens.logits[:, -1].max() <= 0 else
                               logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(read, logits[torch.arange(2)[:, None], positions[:, None], columns], atol=1e-5, rtol=0)
    with torch.no_grad():  # (what reads the logits before a cap reads them through the head too)
        torch.testing.assert_close(model.unembed.uncapped(model.ln_final(final)), logits, atol=1e-5, rtol=0)
    decomposition = A.residual_decomposition(model, TOKENS)
    torch.testing.assert_close(decomposition.components.sum(-2), cache["blocks.3.hook_resid_post"], atol=1e-4, rtol=0)
    refusal = "prediction head .* before W_U, so its logits are no linear function"
    for call in (lambda: A.direct_logit_attribution(model, TOKENS, 5, 9), lambda: A.value_tokens(model, 1, k=3),
                 lambda: cache.logit_attrs(cache.decompose_resid(), 5), lambda: A.memory_lookup(model, TOKENS[:1]),
                 lambda: A.copying_scores(model)):
        with pytest.raises(ValueError, match=refusal):
            call()


def test_the_report_says_why_it_leaves_out_the_linear_readings(tmp_path):
    page = report_page(tokenized_checkpoint(KIND, tmp_path / "tok"), tmp_path / "out")
    assert "Not run: direct logit attribution splits the logits" in page
    assert "Not run. Edge attribution pulls head gradients back through LayerNorm, RMSNorm or no norm" in page
    assert "Not run: FFN memories read each value vector" in page
    assert (tmp_path / "out" / "logit_lens.csv").exists() and (tmp_path / "out" / "patching.csv").exists()


def test_config_errors_name_the_fix():
    base = dict(n_layers=2, d_model=16, n_heads=2, d_vocab=11, n_ctx=8)
    with pytest.raises(ValueError, match="prediction_head=.*activation must be one of"):
        DecoderConfig(**base, prediction_head={"activation": "solu"})
    with pytest.raises(ValueError, match="first_ln1 must be a bool"):
        DecoderConfig(**base, first_ln1=0)
    cfg = DecoderConfig(**base, prediction_head={"activation": "relu", "bias": True}, first_ln1=False)
    assert DecoderConfig.from_dict(cfg.to_dict()) == cfg  # (the head's choices round-trip through JSON's types)
    model = HookedDecoder(cfg)
    assert model.unembed.head.dense.bias is not None and type(model.blocks[0].ln1).__name__ == "NoNorm"
    with pytest.raises(ValueError, match="modernbert-decoder checkpoint has a prediction head"):
        from probe.checkpoint_modernbert import modernbert_decoder_config_to_hf

        modernbert_decoder_config_to_hf(DecoderConfig(**base), None)


def test_the_model_on_the_device_is_transformers_there(checkpoint, device_under_test):
    hf, directory, _ = checkpoint
    assert_on_the_device_as_transformers(hf, directory, device_under_test, 40)
