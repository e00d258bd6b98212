"""BitNet b1.58, unquantised (probe/checkpoint_bitnet.py: Llama's block with a gated relu^2 MLP and an RMSNorm before
each output projection). The logits and every residual of each case are compared with transformers in
test_variants.py (CASES) with saving; here: the sub-norms against transformers' own modules, generation through the
cache, processing, left padding, TL 4's bridge name by name, the ledger, the report, hook shapes, the analyses, and
the quantised files refused by name."""
from __future__ import annotations

import json
import re

import pytest
import torch

from probe import HookedDecoder
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, cache_of_everything, report_page, seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import CASES, build

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))
PLAIN, BIASED = "bitnet-sub-norms-relu2-gqa", "bitnet-biases-tied-mha-silu"


def test_the_sub_norms_are_transformers_modules(tmp_path):
    """hook_z / hook_z_normed hold what transformers' attn_sub_norm reads and returns (every head's z together),
    mlp.hook_mid / hook_post what its ffn_sub_norm reads and returns, and each head's result adds up to the write."""
    hf = build("bitnet", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    layer = hf.model.layers[1]
    seen = seen_in_forward(hf, TOKENS, {"attn": layer.self_attn.attn_sub_norm, "mlp": layer.mlp.ffn_sub_norm})
    model.set_use_attn_result(True)
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS)
    (z,), normed = seen["attn"]
    torch.testing.assert_close(cache["blocks.1.attn.hook_z"].flatten(-2), z, atol=1e-6, rtol=0)
    torch.testing.assert_close(cache["blocks.1.attn.hook_z_normed"].flatten(-2), normed, atol=1e-5, rtol=0)
    (mid,), post = seen["mlp"]
    torch.testing.assert_close(cache["blocks.1.mlp.hook_mid"], mid, atol=1e-6, rtol=0)
    torch.testing.assert_close(cache["blocks.1.mlp.hook_post"], post, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["blocks.1.attn.hook_result"].sum(2), cache["blocks.1.hook_attn_out"], atol=1e-6,
                               rtol=0)


@pytest.mark.parametrize("case", [PLAIN, BIASED])
def test_generation_and_processing_are_transformers(case, tmp_path):
    """Processing folds each sub-norm's w into the output projection that reads it (W_O, W_out), as the block norms'
    into their readers; the log-probs stay transformers'."""
    hf = build("bitnet", tmp_path, **CASES[case][1])
    # (RMSNorms: nothing to centre, as in TL; a value bias would pass the z norm, so it is not folded)
    with pytest.warns(UserWarning, match="center_writing_weights"):
        if case == BIASED:
            with pytest.warns(UserWarning, match="fold_value_biases"):
                assert_generation_and_processing_match(hf, tmp_path)
        else:
            assert_generation_and_processing_match(hf, tmp_path)


def test_a_cached_prefix_and_left_padding_are_transformers(tmp_path):
    hf = build("bitnet", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, _ = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.length == 13
    assert_left_padded_generation_matches(hf, tmp_path)


def test_every_bridge_name_is_the_bridges_value_or_says_what_to_hook(tmp_path):
    """TL 4's BitNet adapter (Llama's, with attn_sub_norm applied before o) point by point under its own names: its
    o.hook_in is what W_O reads, probe's hook_z_normed (and so is its hook_z, o.hook_in's alias: probe's hook_z is
    the pattern-weighted values, what attn_sub_norm reads); its mlp.out.hook_in (hook_post) what W_out reads, after
    ffn_sub_norm; the bridge hooks neither sub-norm's scale."""
    from transformer_lens.model_bridge import TransformerBridge

    from probe.hooks import UnknownNameError

    directory = tokenized_checkpoint("bitnet", tmp_path / "bitnet")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(directory).eval()
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, ours = model.run_with_cache(tokens, names=lambda n: n in theirs or n.endswith("hook_z_normed"))
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    compared = set()
    for name, value in theirs.items():
        if name not in ours:
            with pytest.raises(UnknownNameError, match="hook"):
                model.hook_point(name)
            continue
        # (the bridge's hook_z is its alias of o.hook_in, after the z norm; probe's is the pattern-weighted values,
        # transformers' attn_sub_norm input, checked above)
        mine = ours[name.replace("hook_z", "hook_z_normed")] if name.endswith("attn.hook_z") else ours[name]
        if name.endswith("hook_attn_scores"):  # (the bridge masks with the dtype's least value, probe with -inf)
            mine, value = mine.clamp(min=-1e4), value.clamp(min=-1e4)
        torch.testing.assert_close(mine, value, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
        compared.add(re.sub(r"^blocks\.\d+\.", "", name))
    assert {"attn.o.hook_in", "attn.hook_z", "mlp.out.hook_in", "mlp.hook_post", "mlp.gate.hook_out",
            "attn.hook_rot_q", "attn.hook_attn_scores", "ln_final.hook_out", "hook_embed"} <= compared


@pytest.mark.parametrize("case", [PLAIN, BIASED])
def test_the_ledger_counts_transformers_parameters_and_cache(case, tmp_path):
    hf = build("bitnet", tmp_path, **CASES[case][1])
    ledger = HookedDecoder.from_pretrained(tmp_path).ledger()
    assert ledger.total_params == sum(p.numel() for p in hf.parameters())
    processed = HookedDecoder.from_pretrained(tmp_path, fold_ln=True, center_writing_weights=False,
                                              center_unembed=False, fold_value_biases=False)
    assert processed.ledger().group_params("norm") == 0 == sum(p.numel() for n, p in processed.named_parameters()
                                                               if n.endswith(".w"))
    assert ledger.group_params("norm") == sum(p.numel() for n, p in hf.named_parameters() if "norm" in n)
    with torch.no_grad():
        cache = hf(TOKENS[:1, :3], use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert ledger.kv_bytes_per_token == held // 3


def test_the_report_runs(tmp_path):
    directory = tokenized_checkpoint("bitnet", tmp_path / "bitnet")
    page = report_page(directory, tmp_path / "out")
    assert "sub_norms" in page and "Not run. Circuit discovery: this model (BitNet) normalises every head" in page


def test_hook_shapes_predicts_every_points_shape(tmp_path):
    build("bitnet", tmp_path)
    _, _, cache, predicted = cache_of_everything(tmp_path)
    assert {name: tuple(value.shape) for name, value in cache.items()} == {name: predicted.get(name) for name in cache}
    assert {"blocks.1.attn.z_norm.hook_scale", "blocks.1.attn.hook_z_normed", "blocks.0.mlp.ln.hook_normalized",
            "blocks.0.mlp.hook_mid"} <= set(cache)


def test_the_residual_decomposes_and_circuits_refuse(tmp_path):
    """Each head's result is what it writes through the z norm (the norm's scale shared by the heads), so the
    decomposition adds up to the residual and the direct logit attribution to transformers' difference; circuit
    discovery refuses it (a head's write depends on every other head's through the norm's one scale)."""
    from probe import analyses

    hf = build("bitnet", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    decomposition = analyses.residual_decomposition(model, TOKENS)
    with torch.no_grad():
        out = hf(TOKENS)
        _, cache = model.run_with_cache(TOKENS)
    torch.testing.assert_close(decomposition.total(), cache["blocks.1.hook_resid_post"], atol=1e-5, rtol=0)
    result = analyses.direct_logit_attribution(model, TOKENS, 5, 9)
    torch.testing.assert_close(result.total, out.logits[:, -1, 5] - out.logits[:, -1, 9], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="circuit discovery: this model \\(BitNet\\) normalises every head's z"):
        analyses.circuit_graph(model)


@pytest.mark.parametrize("mode", [{"linear_class": "autobitlinear", "quantization_mode": "online"},
                                  {"linear_class": "bitlinear", "quantization_mode": "offline"}])
def test_the_quantised_files_are_refused_by_name(mode, tmp_path):
    """The released files (bf16 master weights quantised online, packed ternary ones offline) run transformers'
    BitLinear layers, which probe does not: refused, saying why, not loaded as full-precision Llama layers."""
    from probe.config_file import CheckpointError

    build("bitnet", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "bitnet",
                                                                                        **mode}}))
    with pytest.raises(CheckpointError, match=f"quantised .*{mode['quantization_mode']}.* 8 bits"):
        HookedDecoder.from_pretrained(tmp_path)


def test_the_config_round_trips_and_other_formats_refuse_the_sub_norms(tmp_path):
    import dataclasses

    from probe import DecoderConfig
    from probe.checkpoint_llama import llama_config_to_hf

    build("bitnet", tmp_path)
    cfg = HookedDecoder.from_pretrained(tmp_path).cfg
    again = DecoderConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.sub_norms
    with pytest.raises(ValueError, match="sub_norms"):
        llama_config_to_hf(cfg, None)
    with pytest.raises(ValueError, match="sub_norms must be a bool"):
        dataclasses.replace(cfg, sub_norms="yes")


def test_compatibility_mode_skips_fold_ln_and_centring_as_the_adapter_declares(tmp_path):
    """The bridge's BitNet adapter declares fold_ln and centring unsupported (its sub-norms sit between the heads and
    W_O): probe's compatibility mode skips both, saying so, and keeps transformers' log-probs. TL 4.3's own
    compatibility mode changes them (its adapter leaves that phase out: 'compatibility-mode equivalence is out of
    scope'), so probe's is compared with the model, not with it."""
    from transformer_lens.model_bridge import TransformerBridge

    directory = tokenized_checkpoint("bitnet", tmp_path / "bitnet")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(str(directory))
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        expected = bridge(tokens).log_softmax(-1)
    with pytest.warns(UserWarning, match="skipping fold_ln, center_writing_weights"):
        model.enable_compatibility_mode()
    bridge.enable_compatibility_mode()
    assert isinstance(model.blocks[0].ln1.w, torch.nn.Parameter)  # (not folded)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).log_softmax(-1), expected, atol=1e-5, rtol=0)
        assert (bridge(tokens).log_softmax(-1) - expected).abs().max() > 1e-2


def test_ov_circuits_pass_the_z_norms_weight_and_head_pruning_refuses(tmp_path):
    """A head's OV circuit is W_V diag(w) W_O with the z norm's weight on its channels (its scale, shared by the
    heads, left out, as a sandwich block's write norm's), from transformers' own weights; removing a head would change
    how the others are normalised, so prune_heads refuses by name."""
    from probe import analyses
    from probe.analyses.pruning_structural import prune_heads

    hf = build("bitnet", tmp_path, num_key_value_heads=4)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    attn = hf.model.layers[1].self_attn
    with torch.no_grad():
        v = attn.v_proj.weight.T[:, 16:32]  # head 1's [d_model d_head]
        w = attn.attn_sub_norm.weight[16:32]
        expected = v @ (w[:, None] * attn.o_proj.weight.T[16:32])
    torch.testing.assert_close(analyses.ov_circuit(model, 1, 1), expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="every head's z before W_O"):
        prune_heads(model, {1: [0]})


def test_bitnet_on_the_device_is_transformers_there(tmp_path, device_under_test):
    """On the GPU (the GPU list): the logits and a greedy continuation through the cache against transformers' model
    on the same device."""
    from family_checks import assert_on_the_device_as_transformers

    assert_on_the_device_as_transformers(build("bitnet", tmp_path), tmp_path, device_under_test, 40)
