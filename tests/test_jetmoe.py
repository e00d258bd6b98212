"""JetMoE (probe/checkpoint_jetmoe.py): a mixture of attention heads (probe/mixture_of_attention.py) and a mixture of
gated experts with an output bias in every layer. The logits and every residual of each case are compared with
transformers in test_variants.py (CASES); here: the attention layer's routing, queries, pattern and output against
transformers' own JetMoeAttention and its router, the experts' MLP against JetMoeMoE, the per-head results summing
to the layer's write, rerouting at hook_expert_indices, TL 4's bridge hook by hook, compatibility mode, generation
through the cache, left padding, the ledger, the report, and what is refused."""
from __future__ import annotations

import json

import pytest
import torch

from probe import HookedDecoder
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, cache_of_everything, caches_in_compatibility_mode,
                           compared_with_the_delegating_bridge, report_page, seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import CASES, build

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))
CASE_NAMES = ["jetmoe-attention-and-mlp-experts-top2-untied", "jetmoe-top3-of-5-one-kv-head-tied-theta"]


@pytest.fixture(params=CASE_NAMES)
def pair(request, tmp_path):
    hf = build("jetmoe", tmp_path, **CASES[request.param][1])
    return hf, HookedDecoder.from_pretrained(tmp_path).eval()


def test_attention_is_transformers_moa_module_by_module(pair):
    """Each layer's router logits, chosen experts and their weights (JetMoeTopKGating), pattern
    (output_attentions: slot heads, transformers' order) and write (JetMoeAttention's output) are transformers'."""
    hf, ours = pair
    layers = hf.model.layers
    modules = {f"{l}.attn": layers[l].self_attention for l in range(len(layers))}
    modules.update({f"{l}.router": layers[l].self_attention.experts.router for l in range(len(layers))})
    modules.update({f"{l}.mlp": layers[l].mlp for l in range(len(layers))})
    seen = seen_in_forward(hf, TOKENS, modules)
    with torch.no_grad():
        attentions = hf(TOKENS, output_attentions=True).attentions
        _, cache = ours.run_with_cache(TOKENS)
    k = ours.cfg.mixture_of_attention.per_token
    for l in range(len(layers)):
        a = f"blocks.{l}.attn"
        logits = seen[f"{l}.router"][1][4]  # (JetMoeTopKGating's 5-tuple ends with its logits)
        top, chosen = logits.topk(k, dim=-1)
        torch.testing.assert_close(cache[f"{a}.hook_expert_indices"], chosen)
        torch.testing.assert_close(cache[f"{a}.hook_expert_weights"].gather(1, chosen), top.softmax(-1), atol=1e-6, rtol=0)
        assert (cache[f"{a}.hook_expert_weights"] > 0).sum(-1).eq(k).all()
        torch.testing.assert_close(cache[f"{a}.hook_pattern"], attentions[l], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache[f"blocks.{l}.hook_attn_out"], seen[f"{l}.attn"][1][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache[f"blocks.{l}.hook_mlp_out"], seen[f"{l}.mlp"][1], atol=1e-5, rtol=0)
        # the slots' distinct experts: a pattern that differs between slot 0's and slot 1's first head
        assert not torch.allclose(cache[f"{a}.hook_pattern"][:, 0], cache[f"{a}.hook_pattern"][:, ours.cfg.n_kv_heads])


def test_queries_are_each_chosen_experts_projection(pair):
    """hook_q's head slot * n_kv_heads + h at a token is the query projection of the expert the token chose in that
    slot (transformers' input_linear), head h's rows; the keys and values are kv_proj's halves."""
    hf, ours = pair
    with torch.no_grad():
        _, cache = ours.run_with_cache(TOKENS)
    attn = hf.model.layers[0].self_attention
    normed = ours.blocks[0].ln1(cache["blocks.0.hook_resid_pre"])
    x = normed.reshape(-1, ours.cfg.d_model)
    chosen = cache["blocks.0.attn.hook_expert_indices"]
    q = cache["blocks.0.attn.hook_q"].reshape(x.shape[0], -1)
    width = ours.cfg.n_kv_heads * ours.cfg.d_head
    for token in range(x.shape[0]):
        for slot, expert in enumerate(chosen[token].tolist()):
            expected = x[token] @ attn.experts.input_linear.weight[expert].T
            torch.testing.assert_close(q[token, slot * width:(slot + 1) * width], expected, atol=1e-5, rtol=0)
    k, v = attn.kv_proj(normed).detach().chunk(2, dim=-1)
    torch.testing.assert_close(cache["blocks.0.attn.hook_k"].flatten(2), k, atol=1e-6, rtol=0)
    torch.testing.assert_close(cache["blocks.0.attn.hook_v"].flatten(2), v, atol=1e-6, rtol=0)


def test_head_results_sum_to_the_layers_write_and_an_edit_reroutes(pair):
    """hook_result's slot heads (each weighted by its slot's routing weight) and b_O sum to hook_attn_out; a new
    choice written at hook_expert_indices changes the write, and sending every token to the experts it chose anyway
    changes nothing."""
    _, ours = pair
    with torch.no_grad():
        # (without hook_result: the layer's write as the model computes it unobserved)
        _, cache = ours.run_with_cache(TOKENS, names=lambda n: n.startswith("blocks.0.") and "result" not in n)
        result = ours.run_with_cache(TOKENS, names=["blocks.0.attn.hook_result"])[1]["blocks.0.attn.hook_result"]
    attn, d_head, kv_heads = ours.blocks[0].attn, ours.cfg.d_head, ours.cfg.n_kv_heads
    assert result.shape == (*TOKENS.shape, ours.cfg.n_heads, ours.cfg.d_model)
    torch.testing.assert_close(result.sum(2) + attn.b_O, cache["blocks.0.hook_attn_out"], atol=1e-5, rtol=0)
    chosen, weights = cache["blocks.0.attn.hook_expert_indices"], cache["blocks.0.attn.hook_expert_weights"]
    z = cache["blocks.0.attn.hook_z"].flatten(0, 1)
    for token, slot, head in ((0, 0, 0), (5, 1, kv_heads - 1), (17, 1, 0)):  # one head's write, by hand
        expert, h = int(chosen[token, slot]), slot * kv_heads + head
        w_o = attn.out_experts.weight[expert][:, head * d_head:(head + 1) * d_head]
        expected = weights[token, expert] * (z[token, h] @ w_o.T)
        torch.testing.assert_close(result.flatten(0, 1)[token, h], expected, atol=1e-6, rtol=0)
    plain = ours(TOKENS)
    with torch.no_grad():
        same = ours.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.attn.hook_expert_indices", lambda t, hook: t.clone())])
        n = ours.cfg.mixture_of_attention.n
        moved = ours.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.attn.hook_expert_indices",
                                                        lambda t, hook: (t + 1) % n)])
    torch.testing.assert_close(same, plain)
    assert (moved - plain).abs().max() > 1e-3
    assert chosen.shape == (TOKENS.numel(), ours.cfg.mixture_of_attention.per_token)


def test_hook_shapes_predicts_every_points_shape(tmp_path):
    """(each MLP expert's points hold the tokens routed to it, which hook_shapes bounds by all of them)"""
    build("jetmoe", tmp_path)
    _, _, cache, predicted = cache_of_everything(tmp_path)
    cache = {name: value for name, value in cache.items() if ".mlp.experts." not in name}
    assert {name: tuple(value.shape) for name, value in cache.items()} == {name: predicted.get(name) for name in cache}
    assert {"blocks.1.attn.hook_expert_weights", "blocks.1.attn.hook_expert_indices", "blocks.1.attn.hook_result"} <= set(cache)


def test_residual_decomposition_sums_to_transformers_residual(pair):
    """The slot heads' weighted writes, each layer's b_O ('attn bias') and the MLPs' writes sum to the residual that
    enters transformers' final norm; each layer's heads and bias to its JetMoeAttention output."""
    from probe.analyses.attribution import residual_decomposition

    hf, ours = pair
    layers = hf.model.layers
    seen = seen_in_forward(hf, TOKENS, {"final": hf.model.norm, **{str(l): layers[l].self_attention
                                                                    for l in range(len(layers))}})
    result = residual_decomposition(ours, TOKENS)
    torch.testing.assert_close(result.total(), seen["final"][0][0], atol=1e-5, rtol=0)
    names = result.index.names
    for l in range(len(layers)):
        cols = [i for i, n in enumerate(names) if n.startswith(f"L{l}H") or n == f"L{l} attn bias"]
        assert len(cols) == ours.cfg.n_heads + 1
        torch.testing.assert_close(result.components[:, :, cols].sum(2), seen[str(l)][1][0], atol=1e-5, rtol=0)


def test_every_bridge_name_is_the_bridges_value_or_says_what_to_hook(tmp_path):
    """TL 4's JetMoE adapter (the mixture of attention delegated to transformers) point by point under its own names:
    the pattern (slot heads), the attention's input and output, the MLP's; the routers' logits and the fused
    key/value projection say what to hook in probe."""
    directory = tokenized_checkpoint("jetmoe", tmp_path / "jetmoe")
    compared = compared_with_the_delegating_bridge(directory, TOKENS)
    assert {"ln1.hook_scale", "ln2.hook_normalized", "attn.hook_in", "attn.hook_out", "attn.hook_pattern",
            "attn.hook_attn_scores", "mlp.hook_in", "mlp.hook_out", "hook_resid_mid"} <= compared
    model = HookedDecoder.from_pretrained(directory)
    for name in ("blocks.0.attn.experts.router.hook_out", "blocks.1.attn.hook_kv", "blocks.0.mlp.gate.hook_out"):
        with pytest.raises(Exception, match="hook_expert|hook_k"):
            model.hook_point(name)


def test_compatibility_mode_is_the_bridges(tmp_path):
    """enable_compatibility_mode on both: the bridge's adapter folds no norm (its experts' 3-D projections), so probe
    skips fold_ln too (with the warning), and centres the unembedding as the bridge does."""
    directory = tokenized_checkpoint("jetmoe", tmp_path / "jetmoe")
    model, ours, cache, theirs, their_cache = caches_in_compatibility_mode(directory, TOKENS[:, :7] % 300)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for name in ("blocks.0.ln1.hook_out", "blocks.1.attn.hook_pattern", "blocks.1.hook_resid_post"):
        torch.testing.assert_close(cache[name], their_cache[name], atol=1e-4, rtol=0, msg=name)


def test_fold_ln_moves_the_norms_into_the_router_experts_and_keys_exactly(tmp_path):
    """probe's own fold_ln (which the bridge skips) scales the attention router's, each attention expert's query
    projection's and the key/value projection's inputs by ln1's weight, the MLP's router's and experts' by ln2's:
    the logits stay transformers'."""
    hf = build("jetmoe", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    model.process_weights(fold_ln=True, center_writing_weights=False, center_unembed=False)
    assert all(bool((block.ln1.w == 1).all() and (block.ln2.w == 1).all()) for block in model.blocks)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(TOKENS).logits, atol=1e-4, rtol=0)


def test_generation_cache_and_left_padding_are_transformers(tmp_path):
    hf = build("jetmoe", tmp_path)
    assert_generation_and_processing_match(hf, tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, _ = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.length == TOKENS.shape[1]
    assert_left_padded_generation_matches(hf, tmp_path)


def test_on_the_device_is_transformers_there(tmp_path, device_under_test):
    """On the GPU (the GPU list): the logits of 20 positions and a greedy continuation through the cache, against
    transformers' model on the same device (the fused attention kernel, the experts' index_put on the device)."""
    from family_checks import assert_on_the_device_as_transformers

    assert_on_the_device_as_transformers(build("jetmoe", tmp_path), tmp_path, device_under_test, 20)


def test_the_ledger_counts_transformers_parameters_and_cache(tmp_path):
    hf = build("jetmoe", tmp_path)
    ledger = HookedDecoder.from_pretrained(tmp_path).ledger()
    assert ledger.total_params == sum(p.numel() for p in hf.parameters())
    with torch.no_grad():
        cache = hf(TOKENS[:1, :3], use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert ledger.kv_bytes_per_token == held // 3


def test_the_report_runs(tmp_path):
    directory = tokenized_checkpoint("jetmoe", tmp_path / "jetmoe")
    page = report_page(directory, tmp_path / "out")
    assert "Expert routing" in page
    assert "Not run. Circuit discovery: this model&#x27;s mixture of attention heads (JetMoE) routes each token" in page


def test_analyses_that_read_fixed_head_weights_refuse_it_by_name(tmp_path):
    from probe.analyses.architecture import require_head_weights
    from probe.analyses.circuits import ov_circuit

    build("jetmoe", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="mixture of attention heads"):
        require_head_weights(model, "prune_heads")
    with pytest.raises(ValueError, match="mixture of attention heads"):
        ov_circuit(model, 0, 0)
    with pytest.raises(AttributeError, match="no W_Q"):
        model.blocks[0].attn.W_Q


def test_per_head_inputs_and_ungrouped_keys_are_refused_by_name(tmp_path):
    """Each token's one input is routed to its experts: heads cannot read inputs of their own, nor keys and values
    be hooked per query head."""
    build("jetmoe", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="cannot read inputs of their own"):
        model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.hook_q_input", lambda t, hook: t)])
    with pytest.raises(ValueError, match="keep ungroup_grouped_query_attention off"):
        model.set_ungroup_grouped_query_attention(True)
    with model.grouped_key_values():  # (what the circuit analyses do: a no-op here)
        pass


@pytest.mark.parametrize("change, match", [
    ({"num_experts_per_tok": 5}, "more than num_local_experts"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "whole heads"),
])
def test_settings_transformers_would_not_run_as_written_are_refused(change, match, tmp_path):
    from probe.config_file import CheckpointError

    build("jetmoe", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=match):
        HookedDecoder.from_pretrained(tmp_path)


def test_a_model_with_attention_experts_saves_as_jetmoe_alone(tmp_path):
    """A mixture of attention heads is JetMoE's: saved with other experts in the MLP, it is refused by name rather than
    written in a format that would drop it."""
    import dataclasses

    from probe.config import Experts

    build("jetmoe", tmp_path / "src")
    model = HookedDecoder.from_pretrained(tmp_path / "src")
    fresh = HookedDecoder(model.cfg)  # (a new model's biases start at zero, its experts' weights drawn)
    assert not fresh.blocks[0].attn.b_O.any() and not fresh.blocks[0].mlp.out_bias.bias.any()
    assert 0 < fresh.blocks[0].attn.q_experts.weight.std() < 1
    other = HookedDecoder(dataclasses.replace(model.cfg, experts=Experts(n=4, per_token=2)))
    with pytest.raises(ValueError, match="routed as its attention's are"):
        other.save_pretrained(tmp_path / "saved")


def test_the_stacked_query_weights_name_the_experts(tmp_path):
    """model.W_Q (every layer's, stacked) says where the routed query weights are, not a bare missing attribute."""
    build("jetmoe", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model.W_Q: .*q_experts"):
        model.W_Q
    assert model.W_K.shape[0] == model.cfg.n_layers  # (keys and values are shared: they stack)

