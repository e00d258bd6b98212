"""Falcon-H1 (probe/checkpoint_falcon_h1.py, probe.blocks.ParallelHybridBlock): attention and a Mamba-2 mixer side by
side in every layer, its muP multipliers folded into the weights. The logits and every residual of each variant are
compared with transformers in test_variants.py (CASES) with saving; here: the multipliers a few at a time against
transformers, transformers' own submodules' outputs against the hooks, the gated norm's forms against transformers'
module, a recurrence strong enough to show, generation through the cache, padding, TL 4's bridge hook by hook (and
what differs by a folded multiplier, by exactly that multiplier), compatibility mode, the ledger, the analyses and the
report."""
from __future__ import annotations

import pytest
import torch

from probe import DecoderConfig, HookedDecoder, StateSpace
from probe.hooks import UnknownNameError
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, cache_of_everything, left_padded_logits, report_page,
                           seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import build

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))
ONES = dict(embedding_multiplier=1.0, lm_head_multiplier=1.0, key_multiplier=1.0, attention_in_multiplier=1.0,
            attention_out_multiplier=1.0, ssm_in_multiplier=1.0, ssm_out_multiplier=1.0, mlp_multipliers=[1.0, 1.0],
            ssm_multipliers=[1.0] * 5)


def strengthened(hf, directory):
    """The mixers' projections scaled up, so B . C and the decay shape their output rather than the D skip alone;
    saved to `directory`."""
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mamba.in_proj.weight.mul_(12)
            layer.mamba.conv1d.weight.mul_(4)
    hf.save_pretrained(directory)
    return hf


def mup(hf) -> torch.Tensor:
    """transformers' factor on each of in_proj's rows (its mup_vector)."""
    return hf.model.layers[0].mamba.mup_vector.flatten()


@pytest.mark.parametrize("multipliers", [
    dict(embedding_multiplier=3.0, lm_head_multiplier=0.3, key_multiplier=2.5),
    dict(attention_in_multiplier=3.0, attention_out_multiplier=0.4, mlp_multipliers=[3.0, 0.4]),
    dict(ssm_in_multiplier=3.0, ssm_out_multiplier=0.4, ssm_multipliers=[3.0, 0.5, 2.0, 0.7, 1.5])])
def test_each_multiplier_apart_is_transformers(multipliers, tmp_path):
    """A third of the multipliers far from 1 at a time, every other at 1, so no fold's error hides behind another's."""
    hf = build("falcon_h1", tmp_path, **{**ONES, **multipliers})
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        theirs = hf(TOKENS, output_hidden_states=True)
        ours, cache = model.run_with_cache(TOKENS, names=lambda n: n.endswith("hook_resid_pre"))
    torch.testing.assert_close(ours, theirs.logits, atol=1e-4, rtol=0)
    for layer in range(3):
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_resid_pre"], theirs.hidden_states[layer], atol=1e-4,
                                   rtol=0)


@pytest.mark.parametrize("overrides", [{}, {"mamba_rms_norm": True}, {"mamba_rms_norm": True,
                                                                        "mamba_norm_before_gate": False}])
def test_each_write_and_read_is_transformers_submodules(overrides, tmp_path):
    """Against transformers' own modules in its forward: the mixer's, attention's and the MLP's outputs times their
    output multipliers are probe's writes; in_proj's output times its muP factors is hook_in_proj; what out_proj reads
    (the gated norm's output, or y * silu(z) without one) is hook_inner_norm; and a strong recurrence's logits."""
    hf = strengthened(build("falcon_h1", tmp_path / "src", **overrides), tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    layer = hf.model.layers[1]
    seen = seen_in_forward(hf, TOKENS, {"mamba": layer.mamba, "attn": layer.self_attn, "mlp": layer.feed_forward,
                                        "in_proj": layer.mamba.in_proj, "out_proj": layer.mamba.out_proj})
    with torch.no_grad():
        ours, cache = model.run_with_cache(TOKENS)
        logits = hf(TOKENS).logits
    torch.testing.assert_close(ours, logits, atol=1e-4, rtol=0)
    config = hf.config
    for name, theirs in (("hook_mixer_out", seen["mamba"][1] * config.ssm_out_multiplier),
                         ("hook_attn_out", seen["attn"][1][0] * config.attention_out_multiplier),
                         ("hook_mlp_out", seen["mlp"][1]), ("mamba.hook_in_proj", seen["in_proj"][1] * mup(hf)),
                         ("mamba.hook_inner_norm", seen["out_proj"][0][0])):
        torch.testing.assert_close(cache[f"blocks.1.{name}"], theirs, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    recurrence = cache["blocks.1.mamba.hook_scan_out"] - model.blocks[1].mamba.D[:, None] * \
        cache["blocks.1.mamba.hook_conv"][..., :96].unflatten(-1, (6, 16))
    assert recurrence.abs().mean() > 0.15 * cache["blocks.1.mamba.hook_scan_out"].abs().mean()
    assert hasattr(model.blocks[1].mamba.norm, "w") == overrides.get("mamba_rms_norm", False)
    calls = []  # ln1 runs once, read by attention and the mixer both
    with torch.no_grad(), model.hooks([("blocks.1.ln1.hook_out", lambda x, hook: calls.append(x.shape))]):
        model(TOKENS)
    assert calls == [(2, 13, 64)]


@pytest.mark.parametrize("before_gate", [True, False])
def test_the_gated_norm_is_transformers_module(before_gate):
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated

    from probe.state_space import INNER_NORMS

    g = torch.Generator().manual_seed(0)
    y, gate, w = torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 32, generator=g), torch.randn(32, generator=g)
    theirs = FalconH1RMSNormGated(32, eps=1e-3, n_groups=2, norm_before_gate=before_gate)
    ours = INNER_NORMS["before_gate" if before_gate else "after_gate"](32, 2, 1e-3)
    with torch.no_grad():
        theirs.weight.copy_(w)
        ours.w.copy_(w)
    torch.testing.assert_close(ours(y, gate), theirs(y, gate), atol=1e-6, rtol=0)


def test_generation_processing_cache_and_padding_are_transformers(tmp_path):
    """Greedy generation and TL's processing (ln1 folded into attention and the mixer both), a cached prefix and its
    continuation as one forward, and a left-padded batch whose padding reaches neither the state nor the keys."""
    hf = strengthened(build("falcon_h1", tmp_path / "src", mamba_rms_norm=True), tmp_path)
    with pytest.warns(UserWarning, match="center_writing_weights"):
        assert_generation_and_processing_match(hf, tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, prefix = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.layers[0].k.shape[1] == 13 and cache.layers[0].state is not None and prefix.layers[2].seen == 10
    assert_left_padded_generation_matches(hf, tmp_path)
    padded, alone, theirs = left_padded_logits(model, hf)  # padding reaches neither the state, the window nor the keys
    torch.testing.assert_close(padded[1, 4:], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(padded[:, 4:], theirs[:, 4:], atol=1e-4, rtol=0)
    with torch.no_grad():  # each head's own input copies (TL's split q/k/v inputs) leave the outputs as they were
        whole = model(TOKENS)
        model.set_use_split_qkv_input(True)
        torch.testing.assert_close(model(TOKENS), whole, atol=1e-5, rtol=0)


def test_every_shared_hook_is_the_bridges_and_the_rest_differ_by_their_multiplier(tmp_path):
    """TL 4's bridge (its FalconH1 adapter: the mixer under `mamba`) hook by hook. Where probe folds a multiplier the
    bridge's value is before it: those names are left out, saying where to look, and the classic names the two share
    (hook_embed, hook_attn_out, mlp.hook_pre, hook_rot_k, each projection's input) differ by exactly the multiplier."""
    from transformer_lens.model_bridge import TransformerBridge

    directory = tokenized_checkpoint("falcon_h1", tmp_path / "fh", mamba_rms_norm=True)
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(directory).eval()
    tokens = TOKENS % model.cfg.d_vocab
    names = [f"blocks.0.mamba.{n}" for n in ("hook_in", "inner_norm.hook_out", "out_proj.hook_in")]
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, ours = model.run_with_cache(tokens)
        _, named = model.run_with_cache(tokens, names=names)
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    # probe's value = the bridge's times: (the bridge's rotated keys carry key_multiplier, its q/k/v inputs
    # attention_in_multiplier; probe's scores and W_Q, W_K, W_V hold them)
    scaled = {"hook_unembed": 0.5, "unembed.hook_out": 0.5, "hook_embed": 2.0, "embed.hook_out": 2.0,
              ".hook_attn_out": 0.8, ".mlp.hook_pre": 1.2, ".hook_rot_k": 1 / 0.7, ".q.hook_in": 1 / 1.3,
              ".k.hook_in": 1 / 1.3, ".v.hook_in": 1 / 1.3, ".hook_in_proj": mup(bridge.original_model)}
    compared = set()
    for name in (n for n in ours if n in theirs):
        factor = next((f for end, f in scaled.items() if name.endswith(end)), None)
        a, b = ours[name], theirs[name] if factor is None else theirs[name] * factor
        if name.endswith("hook_attn_scores"):
            visible = torch.ones(13, 13, dtype=torch.bool).tril()
            a, b = a[..., visible], b[..., visible]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
        compared.add(name)
    assert {"blocks.0.hook_resid_mid", "blocks.1.attn.hook_pattern", "blocks.2.attn.hook_k",
            "blocks.0.mamba.hook_in_proj", "blocks.1.mamba.hook_inner_norm", "blocks.2.hook_mlp_out", "blocks.0.hook_attn_out"} <= compared
    torch.testing.assert_close(ours["blocks.1.hook_mlp_out"], theirs["blocks.1.mlp.hook_out"], atol=1e-5, rtol=0)
    # (the bridge's conv1d points do not fire: transformers' path reads the convolution's weights, not its module)
    conv = bridge.original_model.model.layers[0].mamba.conv1d
    channels = ours["blocks.0.mamba.hook_in_proj"][..., 96:96 + 160].mT
    expected = torch.nn.functional.silu(conv(channels)[..., :tokens.shape[1]]).mT
    torch.testing.assert_close(ours["blocks.0.mamba.hook_conv"], expected, atol=1e-5, rtol=0)
    for name in names:
        torch.testing.assert_close(named[name], theirs[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    # the bridge's values before a folded multiplier: left out, and probe's are them times it
    for name, ours_name, factor in (("mamba.hook_out", "hook_mixer_out", 0.6), ("attn.hook_out", "hook_attn_out", 0.8),
                                    ("mlp.out.hook_out", "hook_mlp_out", 0.9)):
        with pytest.raises(UnknownNameError, match="times it"):
            model.hook_point(f"blocks.1.{name}")
        torch.testing.assert_close(ours[f"blocks.1.{ours_name}"], factor * theirs[f"blocks.1.{name}"], atol=1e-5,
                                   rtol=0)
    for name, hint in (("mamba.in_proj.hook_out", "hook_in_proj"), ("mamba.in_proj.hook_in", "ln1.hook_out"),
                       ("attn.hook_in", "attention_in_multiplier"), ("mamba.hook_ssm_state", "hook_dt"),
                       ("mlp.gate.hook_out", "mlp.hook_pre"), ("mamba.inner_norm.hook_gate", "hook_in_proj")):
        with pytest.raises(UnknownNameError, match=hint):
            model.hook_point(f"blocks.0.{name}")


def test_compatibility_mode_folds_ln1_into_the_mixer_too_and_the_report(tmp_path):
    """enable_compatibility_mode processes the weights as HookedTransformer would, ln1 folded into attention's and the
    mixer's projections both (TL 4.3's bridge folds it into attention's alone, or fails on grouped-query heads):
    transformers' log-probs. `probe report` runs, and says why edge attribution does not."""
    directory = tokenized_checkpoint("falcon_h1", tmp_path / "fh")
    model = HookedDecoder.boot_transformers(directory)
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        expected = model(tokens).log_softmax(-1)
    with pytest.warns(UserWarning, match="center_writing_weights"):
        model.enable_compatibility_mode()
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(logits.log_softmax(-1), expected, atol=1e-4, rtol=0)
    assert not model.cfg.norm_weights and torch.equal(cache["blocks.0.ln1.hook_normalized"],
                                                      cache["blocks.0.ln1.hook_out"])
    page = report_page(directory, tmp_path / "out")
    assert ("Not run. Circuit discovery: layers [0, 1, 2] of this model (Falcon-H1&#x27;s parallel hybrid) also write "
            "a Mamba-2 mixer&#x27;s output") in page
    assert "L1 mamba" in (tmp_path / "out" / "attribution.csv").read_text()
    assert (tmp_path / "out" / "ablation.csv").exists() and not (tmp_path / "out" / "edges.csv").exists()


def test_the_ledger_counts_every_parameter_and_the_keys(tmp_path):
    for overrides in ({}, {"mamba_rms_norm": True, "mamba_proj_bias": True, "mamba_conv_bias": False,
                           "attention_bias": True, "mlp_bias": True}, {"projectors_bias": True}):
        directory = tmp_path / str(len(overrides))
        hf = build("falcon_h1", directory, **overrides)
        model = HookedDecoder.from_pretrained(directory)
        book = model.ledger()
        assert book.total_params == sum(p.numel() for p in model.parameters())
        assert book.total_params == sum(p.numel() for p in hf.parameters())
        assert book.kv_bytes_per_token == 3 * 2 * 2 * 16 * 4  # every layer's keys and values (the state: fixed size)


def test_analyses_name_the_mixers_and_refuse_what_has_no_node_for_them(tmp_path):
    """Direct logit attribution and the residual decomposition list each mixer's write beside the heads and add up
    to transformers' logit difference; the cache's decompose_resid sums to the residual; head analyses run; a
    per-component decomposition and circuit discovery refuse by name."""
    import probe.analyses as A

    hf = build("falcon_h1", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    dla = A.direct_logit_attribution(model, TOKENS, torch.tensor([5, 5]), torch.tensor([9, 9]))
    with torch.no_grad():
        logits = hf(TOKENS).logits[:, -1]
        _, cache = model.run_with_cache(TOKENS)
    torch.testing.assert_close(dla.total, logits[:, 5] - logits[:, 9], atol=1e-4, rtol=0)
    frame = dla.to_frame()
    assert {"L0 mamba", "L2 mamba", "L1H3", "L2 mlp"} <= set(frame["component"])
    assert set(frame.loc[frame["component"] == "L0 mamba", "kind"]) == {"mamba"}
    stack, labels = cache.decompose_resid(2, return_labels=True)
    assert labels[:4] == ["embed", "0_attn_out", "0_mixer_out", "0_mlp_out"]
    torch.testing.assert_close(stack.sum(0), cache["blocks.2.hook_resid_pre"], atol=1e-5, rtol=0)
    mid = cache.decompose_resid(1, mlp_input=True)
    torch.testing.assert_close(mid.sum(0), cache["blocks.1.hook_resid_mid"], atol=1e-5, rtol=0)
    assert A.head_scores(model, "previous_token", n_samples=2).to_frame().shape[0] > 0
    with pytest.raises(ValueError, match=r"layers \[0, 1, 2\] write a Mamba-2 mixer's output beside their heads"):
        cache.get_full_resid_decomposition()
    with pytest.raises(ValueError, match="circuit discovery: layers \\[0, 1, 2\\] of this model \\(Falcon-H1"):
        A.edge_attribution(model, TOKENS[:1], TOKENS[1:], A.logit_diff_metric(model, 5, 9))


def test_hook_shapes_predict_the_mixers_points(tmp_path):
    build("falcon_h1", tmp_path, head_dim=24)
    _, _, cache, predicted = cache_of_everything(tmp_path)
    assert {name: tuple(value.shape) for name, value in cache.items()} == {name: predicted[name] for name in cache}
    assert cache["blocks.2.mamba.hook_in_proj"].shape[-1] == 96 + 96 + 2 * 2 * 16 + 6
    assert cache["blocks.1.attn.hook_q"].shape[-1] == 24


def test_config_errors_and_formats_name_the_fix(tmp_path):
    base = dict(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, positions="rotary", norm="rms",
                gated_mlp=True, activation="silu")
    space = dict(layers=(True, True), n_heads=4, d_head=8, d_state=16, inner_norm=None, out_bias=True)
    cfg = DecoderConfig(**base, parallel_state_space=space)
    assert cfg.parallel_state_space == StateSpace(**space) and cfg.layer_has_parallel_mixer(1)
    model = HookedDecoder(cfg).eval()
    assert model.blocks[0].mamba.out_proj.bias is not None and not hasattr(model.blocks[0].mamba.norm, "w")
    again = HookedDecoder.from_pretrained(model.save_pretrained(tmp_path / "saved")).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS % 50), model(TOKENS % 50), atol=1e-5, rtol=0)
    assert again.cfg.original_architecture == "FalconH1ForCausalLM"
    for bad, match in ((dict(base, norm="layer"), "settings differ: norm"),
                       (dict(base, state_space=dict(space, layers=(True, False))), "settings differ: state_space")):
        with pytest.raises(ValueError, match=match):
            DecoderConfig(**bad, parallel_state_space=space)
    with pytest.raises(ValueError, match="inner_norm='middle'"):
        StateSpace(**dict(space, inner_norm="middle"))
    with pytest.raises(ValueError, match="give each of the n_layers=2"):
        DecoderConfig(**base, parallel_state_space=dict(space, layers=(True,)))
    from probe.checkpoints import FAMILIES

    with pytest.raises(ValueError, match="beside attention in every layer"):
        FAMILIES["falcon_h1"].config_to_hf(DecoderConfig(**base), None)
    from probe.config_file import CheckpointError

    with pytest.raises(CheckpointError, match="key_multiplier=-0.5"):
        FAMILIES["falcon_h1"].config_from_hf({**hf_config(), "key_multiplier": -0.5})


def hf_config() -> dict:
    import transformers as tf

    return tf.FalconH1Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=32, mamba_n_heads=4,
                             mamba_d_state=8).to_dict()


def test_the_parallel_hybrid_on_the_device_is_transformers_there(tmp_path, device_under_test):
    """On the GPU (the GPU list): a prompt longer than a chunk, and its greedy continuation through the cache (keys,
    values, the convolution's window and the state), against transformers' model on the same device."""
    from family_checks import assert_on_the_device_as_transformers

    hf = build("falcon_h1", tmp_path, max_position_embeddings=200, mamba_rms_norm=True)
    assert_on_the_device_as_transformers(hf, tmp_path, device_under_test, 150)
