"""Laguna (poolside's; probe/checkpoint_laguna.py). The logits and every residual of each case are compared with
transformers in test_variants.py (CASES) with saving; here: generation through the cache, processing, left padding,
the softplus gates, the capped router and each layer kind's rotary against transformers' own modules, TL 4's bridge
name by name, compatibility mode, the ledger, the report, hook_shapes and the refusals."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from probe import HookedDecoder
from probe.config import DecoderConfig, Experts, OutputGate
from probe.config_file import CheckpointError
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, cache_of_everything, caches_in_compatibility_mode,
                           compared_with_the_delegating_bridge, report_page, seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import CASES, _edit_config, build

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))
PER_CHANNEL = CASES["laguna-per-channel-gates-uncapped-biases-tied"][1]


@pytest.mark.parametrize("case", ["laguna-per-head-gates-mixed-heads-capped-router",
                                  "laguna-per-channel-gates-uncapped-biases-tied"])
def test_generation_and_processing_are_transformers(case, tmp_path):
    hf = build("laguna", tmp_path, **CASES[case][1])
    # RMSNorm: nothing to centre, as in TL; the value biases pass through each head's gate, so they do not fold
    with pytest.warns(UserWarning, match="center_writing_weights"), pytest.warns(UserWarning, match="output gate"):
        assert_generation_and_processing_match(hf, tmp_path)


def test_a_cached_prefix_and_left_padding_are_transformers(tmp_path):
    """A prompt, then two tokens, then the rest through one cache give one forward's logits (past the sliding layers'
    window of 4, through layers of 4, 8, 2 and 6 heads); a left-padded batch generates as transformers does."""
    hf = build("laguna", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    assert [model.cfg.layer_heads(l) for l in range(4)] == [4, 8, 2, 6]
    assert [model.cfg.layer_window(l) for l in range(4)] == [4, None, 4, None]
    cache, _ = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.length == 13
    assert_left_padded_generation_matches(hf, tmp_path)


@pytest.mark.parametrize("overrides", [{}, PER_CHANNEL], ids=["per-head-capped", "per-channel-uncapped"])
def test_the_gates_router_and_rotary_are_transformers_modules(overrides, tmp_path):
    """hook_q_gate holds g_proj's output per head ([... head 1] or [... head d_head]); hook_expert_weights the sigmoid
    of the router's (capped) logits, hook_expert_indices its choice; each layer kind's rotation is transformers' own
    cos and sin (the full layers rotate half of each head by 1000, the sliding ones whole heads by 100)."""
    from transformers.models.laguna.modeling_laguna import apply_rotary_pos_emb

    hf = build("laguna", tmp_path, **overrides)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    layer = hf.model.layers[1]
    seen = seen_in_forward(hf, TOKENS, {"router": layer.mlp.gate, "gate": layer.self_attn.g_proj})
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS)
    logits, _, chosen = seen["router"][1]
    if overrides:
        assert not model.cfg.output_gate.per_head and model.cfg.experts.router_softcap is None
    else:  # (the cap reached: transformers' logits are the capped ones, within +-0.4 where the raw ones pass 1)
        raw = seen["router"][0][0].reshape(-1, 32) @ layer.mlp.gate.weight.T
        assert model.cfg.output_gate.per_head and logits.abs().max() <= 0.4 < 1 < raw.abs().max()
    torch.testing.assert_close(cache["blocks.1.mlp.hook_expert_weights"], logits.sigmoid(), atol=1e-5, rtol=0)
    assert torch.equal(cache["blocks.1.mlp.hook_expert_indices"].sort(-1).values, chosen.sort(-1).values)
    gate = cache["blocks.1.attn.hook_q_gate"]
    assert gate.shape == (2, 13, 8, 1 if not overrides else 8)
    torch.testing.assert_close(gate.flatten(-2), seen["gate"][1], atol=1e-5, rtol=0)
    positions = torch.arange(13)[None]
    for l, kind in ((0, "sliding_attention"), (1, "full_attention")):
        cos, sin = hf.model.rotary_emb(cache[f"blocks.{l}.hook_resid_pre"], positions, kind)
        q, k = (cache[f"blocks.{l}.attn.hook_{p}_normed"].transpose(1, 2) for p in "qk")
        rot_q, rot_k = apply_rotary_pos_emb(q, k, cos, sin)
        torch.testing.assert_close(cache[f"blocks.{l}.attn.hook_rot_q"], rot_q.transpose(1, 2), atol=1e-5, rtol=0)
        torch.testing.assert_close(cache[f"blocks.{l}.attn.hook_rot_k"], rot_k.transpose(1, 2), atol=1e-5, rtol=0)
        assert model.blocks[l].attn.rotary.inv_freq.shape[0] * 2 == cos.shape[-1] == (8 if l == 0 else 4)


def test_every_bridge_name_is_the_bridges_value_or_says_what_to_hook(tmp_path):
    """TL 4's Laguna adapter (attention delegated to transformers: its hook_attn_scores holds the pattern, compared
    with probe's pattern) point by point under its own names; the names probe leaves out say what to hook."""
    compared = compared_with_the_delegating_bridge(tokenized_checkpoint("laguna", tmp_path / "laguna"), TOKENS)
    assert {"attn.q_norm.hook_out", "attn.k_norm.hook_in", "attn.gate.hook_in", "attn.q.hook_out", "mlp.hook_out",
            "attn.hook_pattern", "attn.hook_z", "attn.o.hook_in"} <= compared


def test_compatibility_mode_skips_fold_ln_as_the_bridge_does(tmp_path):
    directory = tokenized_checkpoint("laguna", tmp_path / "laguna")
    _, ours, cache, theirs, their_cache = caches_in_compatibility_mode(directory, TOKENS)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for name in ("blocks.0.ln1.hook_out", "blocks.1.attn.hook_pattern", "blocks.3.hook_resid_post"):
        torch.testing.assert_close(cache[name], their_cache[name], atol=1e-4, rtol=0, msg=name)


@pytest.mark.parametrize("overrides", [{}, PER_CHANNEL], ids=["per-head", "per-channel-biases"])
def test_the_ledger_counts_transformers_parameters_but_the_selection_bias(overrides, tmp_path):
    """transformers keeps the selection bias as a parameter it never trains; probe, as for DeepSeek-V3, as a buffer:
    the ledger counts every other parameter (a gate per head is n_heads wide), and the cache transformers keeps."""
    hf = build("laguna", tmp_path, **overrides)
    model = HookedDecoder.from_pretrained(tmp_path)
    ledger = model.ledger()
    biases = sum(p.numel() for n, p in hf.named_parameters() if n.endswith("e_score_correction_bias"))
    # (with attention biases probe's gates have one too, zeros, as AFMoE's: transformers' g_proj has none)
    zero_gate_biases = sum(model.cfg.layer_heads(l) * 8 for l in range(4)) if overrides else 0
    assert biases == 2 * 4
    assert ledger.total_params == sum(p.numel() for p in hf.parameters()) - biases + zero_gate_biases
    with torch.no_grad():
        cache = hf(TOKENS[:1, :3], use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert ledger.kv_bytes_per_token == held // 3


def test_the_report_runs(tmp_path):
    directory = tokenized_checkpoint("laguna", tmp_path / "laguna")
    page = report_page(directory, tmp_path / "out")
    assert "Expert routing" in page and (tmp_path / "out" / "edges.csv").exists()


def test_hook_shapes_predicts_every_points_shape_per_head_gates_included(tmp_path):
    """(each expert's points hold the tokens routed to it, which hook_shapes bounds by all of them)"""
    build("laguna", tmp_path)
    _, _, cache, predicted = cache_of_everything(tmp_path)
    cache = {name: value for name, value in cache.items() if ".mlp.experts." not in name}
    assert {name: tuple(value.shape) for name, value in cache.items()} == {name: predicted.get(name) for name in cache}
    assert cache["blocks.1.attn.hook_q_gate"].shape[-2:] == (8, 1)


@pytest.mark.parametrize("change, match", [
    ({"gating": "per-channel"}, "gating='per-channel' is not supported"),
    ({"moe_apply_router_weight_on_input": True}, "moe_apply_router_weight_on_input"),
    ({"mlp_layer_types": ["dense", "moe", "dense", "dense"]}, "mlp_layer_types"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000.0}}}, "'sliding_attention' entry"),
])
def test_settings_that_cannot_load_are_refused_by_name(change, match, tmp_path):
    build("laguna", tmp_path)
    _edit_config(tmp_path, **change)
    with pytest.raises(CheckpointError, match=match):
        HookedDecoder.from_pretrained(tmp_path)


def test_the_new_options_refuse_what_they_cannot_mean():
    base = dict(n_layers=2, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, positions="rotary")
    with pytest.raises(ValueError, match="set attn_output_gate=True"):
        DecoderConfig(**base, output_gate=OutputGate(activation="softplus"))
    with pytest.raises(ValueError, match="OutputGate.activation='tanh'"):
        OutputGate(activation="tanh")
    with pytest.raises(ValueError, match="multiple of them"):
        DecoderConfig(**base, n_kv_heads=2, heads_per_layer=(4, 3))
    with pytest.raises(ValueError, match="sliding_rotary_dim=3"):
        DecoderConfig(**base, sliding_window=4, sliding_rotary_dim=3)
    with pytest.raises(ValueError, match="sliding_rotary_dim=2"):
        DecoderConfig(**base, sliding_rotary_dim=2)  # (no window)
    with pytest.raises(ValueError, match="router_softcap"):
        Experts(n=4, per_token=2, softmax_over="chosen", router_softcap=5.0)
    # the defaults, spelled out, are the defaults
    gated = DecoderConfig(**base, attn_output_gate=True, output_gate=OutputGate())
    assert gated.output_gate is None and gated == dataclasses.replace(gated, output_gate=None)
    grouped = DecoderConfig(**base, n_kv_heads=2, heads_per_layer=(4, 2))
    assert [grouped.layer_kv_heads(l) for l in range(2)] == [2, 2]
    pruned = DecoderConfig(**base, heads_per_layer=(4, 2))
    assert [pruned.layer_kv_heads(l) for l in range(2)] == [4, 2]


def test_another_family_refuses_to_save_laguna_options(tmp_path):
    """A Llama checkpoint holds no output gate, per-head or not, nor a windowed layers' own rotary width."""
    build("laguna", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path)
    from probe.checkpoint_llama import llama_config_to_hf

    plain = dataclasses.replace(model.cfg, qk_norm=False, attn_output_gate=False, output_gate=None, experts=None,
                                heads_per_layer=None, sliding_window=None, sliding_layers=None,
                                sliding_rotary_base=None, sliding_rotary_dim=None, rotary_dim=8)
    llama_config_to_hf(plain, None)  # (the plain part saves)
    with pytest.raises(ValueError, match="sliding_rotary_dim"):
        llama_config_to_hf(dataclasses.replace(plain, sliding_window=4, sliding_rotary_dim=4), None)


def test_a_model_in_memory_loads_under_transformers_module_names(tmp_path):
    """transformers' modules name the selection bias `mlp.gate.e_score_correction_bias` and the shared expert
    `mlp.shared_experts` and fuse the experts, where the files (poolside's, and save_pretrained's) say
    `mlp.experts.e_score_correction_bias`, `mlp.shared_expert` and one tensor per expert: hf_model= reads the former."""
    hf = build("laguna", tmp_path)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in hf.state_dict()
    model = HookedDecoder.from_pretrained(str(tmp_path), hf_model=hf).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(TOKENS).logits, atol=1e-4, rtol=0)


def test_a_config_without_the_laguna_keys_reads_as_transformers_fills_them(tmp_path):
    """Without rope_parameters, gating, the per-layer lists and the router's settings, transformers' LagunaConfig
    fills them in (every layer full attention, rotating half of each head by 500000, a gate per head, as many heads
    in each layer, the first MLP dense, the rest sparse, an uncapped router): so does probe, on the same file."""
    import json

    import transformers as tf

    layout = {"num_attention_heads_per_layer": None, "layer_types": None, "mlp_layer_types": None, "gating": True,
              "rope_parameters": None, "moe_router_logit_softcapping": 0.0, "moe_routed_scaling_factor": 1.0}
    build("laguna", tmp_path, **layout)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in (*layout, "moe_apply_router_weight_on_input", "sliding_window"):
        config.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = tf.LagunaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    assert (model.cfg.rotary_base, model.cfg.rotary_dim, model.cfg.sliding_window) == (500000.0, 4, None)
    assert model.cfg.experts.layers == (False, True, True, True) and model.cfg.output_gate.per_head
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(TOKENS).logits, atol=1e-4, rtol=0)


def test_laguna_on_the_device_is_transformers_there(tmp_path, device_under_test):
    """On the GPU (the GPU list): heads per layer, softplus gates per head, both rotary kinds and the capped router
    against transformers' model on the same device, and the greedy continuation through the cache."""
    from family_checks import assert_on_the_device_as_transformers

    assert_on_the_device_as_transformers(build("laguna", tmp_path), tmp_path, device_under_test, 40)


def test_circuits_run_on_the_hooked_forward_through_per_head_gates(tmp_path):
    """Softplus gates of one logit per head, like Qwen3.5's sigmoid ones, are not computed by the sparse engine:
    `auto` takes the hooked forward over layers of 4, 8, 2 and 6 heads, whose full and empty circuits are the clean
    and corrupted runs (a left-padded prompt among them)."""
    from probe.analyses import logit_diff_metric
    from probe.analyses.faithfulness import CircuitRunner
    from test_circuit_forward import paired

    build("laguna", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    clean, corrupted, mask = paired(101)
    metric = logit_diff_metric(model, [5, 9, 3], [7, 2, 1])
    runner = CircuitRunner.prepare(model, clean, corrupted, metric, attention_mask=mask)
    assert runner.run is None and runner.graph.gated
    assert sum(node.endswith("<q") for node in runner.graph.readers) == 4 + 8 + 2 + 6
    full_and_empty = torch.stack([torch.ones(runner.graph.n_edges, dtype=torch.bool),
                                  torch.zeros(runner.graph.n_edges, dtype=torch.bool)])
    got = runner.evaluate(full_and_empty)
    torch.testing.assert_close(got, torch.stack([runner.clean_values, runner.corrupted_values]), atol=1e-4, rtol=0)
