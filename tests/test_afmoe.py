"""AFMoE (Arcee's Trinity; probe/checkpoint_afmoe.py). The logits and every residual of each case are compared with
transformers in test_variants.py (CASES) with saving; here: generation through the cache, processing, left padding,
the router's points against transformers' router, TL 4's bridge name by name, compatibility mode, the ledger and the
report."""
from __future__ import annotations

import pytest
import torch

from probe import HookedDecoder
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, cache_of_everything, caches_in_compatibility_mode,
                           compared_with_the_delegating_bridge, report_page, seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import CASES, build

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("case", ["afmoe-trinity", "afmoe-mup-biases-tied"])
def test_generation_and_processing_are_transformers(case, tmp_path):
    hf = build("afmoe", tmp_path, **CASES[case][1])
    # RMSNorm: nothing to centre, as in TL; the value biases pass through each head's gate, so they do not fold
    with pytest.warns(UserWarning, match="center_writing_weights"), pytest.warns(UserWarning, match="output gate"):
        assert_generation_and_processing_match(hf, tmp_path)


def test_a_cached_prefix_and_left_padding_are_transformers(tmp_path):
    """A prompt, then two tokens, then the rest through one cache give one forward's logits (past the window of the
    sliding layers, whose keys rotate, and through the full ones, whose keys do not); a left-padded batch generates
    as transformers does."""
    hf = build("afmoe", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    assert [model.cfg.layer_rotates(layer) for layer in range(4)] == [True, False, True, False]
    cache, _ = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.length == 13
    assert_left_padded_generation_matches(hf, tmp_path)


def test_the_routing_and_the_gates_are_transformers(tmp_path):
    """hook_expert_weights is the router's sigmoid of its logits (before the selection bias), hook_expert_indices its
    choice (with the bias), the gate's logits what transformers' gate_proj returns."""
    hf = build("afmoe", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    layer = hf.model.layers[1]
    seen = seen_in_forward(hf, TOKENS, {"router": layer.mlp.router, "gate": layer.self_attn.gate_proj})
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS)
    logits, _, chosen = seen["router"][1]
    torch.testing.assert_close(cache["blocks.1.mlp.hook_expert_weights"], logits.sigmoid(), atol=1e-5, rtol=0)
    assert torch.equal(cache["blocks.1.mlp.hook_expert_indices"].sort(-1).values, chosen.sort(-1).values)
    torch.testing.assert_close(cache["blocks.1.attn.hook_q_gate"].flatten(-2), seen["gate"][1], atol=1e-5, rtol=0)
    assert "blocks.1.attn.hook_rot_q" not in cache and "blocks.0.attn.hook_rot_q" in cache  # (NoPE full layers)


def test_every_bridge_name_is_the_bridges_value_or_says_what_to_hook(tmp_path):
    """TL 4's AFMoE adapter (attention delegated to transformers: its hook_attn_scores holds the pattern, compared
    with probe's pattern) point by point under its own names; the names probe leaves out say what to hook."""
    compared = compared_with_the_delegating_bridge(tokenized_checkpoint("afmoe", tmp_path / "afmoe"), TOKENS)
    assert {"attn.q_norm.hook_out", "attn.k_norm.hook_in", "attn.gate.hook_in", "ln1_post.hook_out", "ln2_post.hook_out",
            "mlp.hook_out", "attn.hook_pattern", "attn.hook_z"} <= compared


def test_compatibility_mode_skips_fold_ln_as_the_bridge_does(tmp_path):
    directory = tokenized_checkpoint("afmoe", tmp_path / "afmoe")
    _, ours, cache, theirs, their_cache = caches_in_compatibility_mode(directory, TOKENS)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for name in ("blocks.0.ln1.hook_out", "blocks.1.attn.hook_pattern", "blocks.3.hook_resid_post"):
        torch.testing.assert_close(cache[name], their_cache[name], atol=1e-4, rtol=0, msg=name)


def test_the_ledger_counts_transformers_parameters_but_the_selection_bias(tmp_path):
    """transformers keeps the selection bias as a parameter it never trains (requires_grad=False); probe, as for
    DeepSeek-V3, as a buffer: the ledger counts every other parameter, and the cache transformers keeps."""
    hf = build("afmoe", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path)
    ledger = model.ledger()
    biases = sum(p.numel() for n, p in hf.named_parameters() if n.endswith("expert_bias"))
    assert biases == 3 * 4 and ledger.total_params == sum(p.numel() for p in hf.parameters()) - biases
    with torch.no_grad():
        cache = hf(TOKENS[:1, :3], use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert ledger.kv_bytes_per_token == held // 3


def test_the_report_runs(tmp_path):
    directory = tokenized_checkpoint("afmoe", tmp_path / "afmoe")
    page = report_page(directory, tmp_path / "out")
    assert "Expert routing" in page and (tmp_path / "out" / "edges.csv").exists()


def test_hook_shapes_predicts_every_points_shape_gated_heads_included(tmp_path):
    """(each expert's points hold the tokens routed to it, which hook_shapes bounds by all of them)"""
    build("afmoe", tmp_path)
    _, _, cache, predicted = cache_of_everything(tmp_path)
    cache = {name: value for name, value in cache.items() if ".mlp.experts." not in name}
    assert {name: tuple(value.shape) for name, value in cache.items()} == {name: predicted.get(name) for name in cache}
    assert {"blocks.1.attn.hook_q_gate"} <= set(cache)
