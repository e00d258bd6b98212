"""NanoChat (probe/checkpoint_nanochat.py: weightless RMSNorms, one after the embedding, q and k normalised after a
rotation the other way, relu^2, soft-capped logits). The logits and every residual of each case are compared with
transformers in test_variants.py (CASES) with saving; here: the rotation and the q/k norms against transformers' own
modules, generation through the cache, processing, left padding, TL 4's bridge name by name, compatibility mode, the
ledger, the report, hook shapes and the config's refusals."""
from __future__ import annotations

import json
import re

import pytest
import torch

from probe import HookedDecoder
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, cache_of_everything, caches_in_compatibility_mode,
                           report_page, seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import CASES, build

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))
CAPPED, UNCAPPED = "nanochat-weightless-norms-clockwise-rope-softcap", "nanochat-mha-biases-tied-uncapped"


def test_the_rotation_and_the_qk_norms_are_transformers_modules(tmp_path):
    """hook_rot_q / hook_rot_k hold what transformers' q_norm / k_norm read (its rotate_half turns the other way from
    Llama's: a Llama-way rotation differs), hook_q_normed / hook_k_normed what they return; the embedding's norm is
    transformers' model.norm on the table's rows."""
    hf = build("nanochat", tmp_path)
    model = HookedDecoder.boot_transformers(tmp_path)  # (the bridge's names: embed.ln.hook_in)
    attn = hf.model.layers[1].self_attn
    seen = seen_in_forward(hf, TOKENS, {"q": attn.q_norm, "k": attn.k_norm})
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS, names=lambda n: True)
    for part in "qk":
        (rotated,), normed = seen[part]
        torch.testing.assert_close(cache[f"blocks.1.attn.hook_rot_{part}"], rotated.transpose(1, 2), atol=1e-5, rtol=0)
        torch.testing.assert_close(cache[f"blocks.1.attn.hook_{part}_normed"], normed.transpose(1, 2), atol=1e-5, rtol=0)
    from probe.rotary import Rotary

    llama_way = Rotary(16, 10000.0)  # (Llama's direction)
    assert not torch.allclose(llama_way(cache["blocks.1.attn.hook_q"]), cache["blocks.1.attn.hook_rot_q"], atol=1e-3)
    with torch.no_grad():
        torch.testing.assert_close(cache["hook_embed"], hf.model.norm(hf.model.embed_tokens(TOKENS)), atol=1e-6, rtol=0)
    assert torch.equal(cache["embed.ln.hook_in"], hf.model.embed_tokens.weight[TOKENS].detach())
    assert not any(name.endswith((".w", ".b")) for name, _ in model.named_parameters())  # (every norm weightless)


@pytest.mark.parametrize("case", [CAPPED, UNCAPPED])
def test_generation_and_processing_are_transformers(case, tmp_path):
    hf = build("nanochat", tmp_path, **CASES[case][1])
    # (weightless RMSNorms: nothing to fold, nor to centre, as in TL)
    with pytest.warns(UserWarning, match="center_writing_weights"):
        assert_generation_and_processing_match(hf, tmp_path)


def test_a_cached_prefix_and_left_padding_are_transformers(tmp_path):
    hf = build("nanochat", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, _ = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.length == 13
    assert_left_padded_generation_matches(hf, tmp_path)


def test_every_bridge_name_is_the_bridges_value_or_says_what_to_hook(tmp_path):
    """TL 4's NanoChat adapter (attention delegated to transformers: its hook_attn_scores holds the pattern) point by
    point under its own names. Its q/k norms' points hold [batch head pos ...], probe's [batch pos head ...]; its
    embed.hook_out is the table's row (probe's embed.ln.hook_in) and hook_embed the same, where probe's hook_embed is
    transformer-lens 3's, after the embedding's norm; its ln_final runs twice (the adapter wraps transformers' one
    norm module, which normalises the embeddings too), and keeps the last run, the final norm's."""
    from transformer_lens.model_bridge import TransformerBridge

    from probe.hooks import UnknownNameError

    directory = tokenized_checkpoint("nanochat", tmp_path / "nanochat")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(directory).eval()
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, ours = model.run_with_cache(tokens, names=lambda n: n in theirs or n.endswith("hook_pattern"))
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    compared, left_out = set(), set()
    for name, value in theirs.items():
        if name not in ours:
            with pytest.raises(UnknownNameError, match="hook"):
                model.hook_point(name)
            left_out.add(re.sub(r"^blocks\.\d+\.", "", name))
            continue
        if name == "hook_embed":
            torch.testing.assert_close(value, ours["embed.ln.hook_in"], atol=1e-6, rtol=0)
            continue
        mine = ours[name.replace("hook_attn_scores", "hook_pattern")]
        if "_norm." in name:  # (transformers normalises q and k transposed)
            mine = mine.transpose(1, 2)
        torch.testing.assert_close(mine, value, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
        compared.add(re.sub(r"^blocks\.\d+\.", "", name))
    assert {"attn.q_norm.hook_scale", "attn.k_norm.hook_normalized", "attn.hook_pattern", "attn.o.hook_in",
            "mlp.in.hook_out", "mlp.out.hook_in", "ln_final.hook_scale", "embed.hook_out", "attn.hook_attn_scores",
            "hook_in"} <= compared
    assert {"attn.q_norm.hook_in", "attn.k_norm.hook_out"} <= left_out
    with pytest.raises(UnknownNameError, match="hook_rot_q"):
        model.hook_point("blocks.0.attn.q_norm.hook_in")


def test_compatibility_mode_skips_fold_ln_as_the_bridge_does(tmp_path):
    directory = tokenized_checkpoint("nanochat", tmp_path / "nanochat")
    _, ours, cache, theirs, their_cache = caches_in_compatibility_mode(directory, TOKENS)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for name in ("blocks.0.ln1.hook_out", "blocks.1.attn.hook_pattern", "blocks.0.hook_mlp_out",
                 "blocks.1.hook_resid_post"):
        torch.testing.assert_close(cache[name], their_cache[name], atol=1e-4, rtol=0, msg=name)


@pytest.mark.parametrize("case", [CAPPED, UNCAPPED])
def test_the_ledger_counts_transformers_parameters_and_cache(case, tmp_path):
    hf = build("nanochat", tmp_path, **CASES[case][1])
    ledger = HookedDecoder.from_pretrained(tmp_path).ledger()
    assert ledger.total_params == sum(p.numel() for p in hf.parameters())
    assert ledger.group_params("norm") == 0
    with torch.no_grad():
        cache = hf(TOKENS[:1, :3], use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert ledger.kv_bytes_per_token == held // 3


def test_the_report_runs(tmp_path):
    directory = tokenized_checkpoint("nanochat", tmp_path / "nanochat")
    page = report_page(directory, tmp_path / "out")
    assert "rotary_clockwise" in page and (tmp_path / "out" / "edges.csv").exists()  # (circuits: the dense engine)


def test_hook_shapes_predicts_every_points_shape(tmp_path):
    build("nanochat", tmp_path)
    _, _, cache, predicted = cache_of_everything(tmp_path)
    assert {name: tuple(value.shape) for name, value in cache.items()} == {name: predicted.get(name) for name in cache}
    assert {"embed.ln.hook_scale", "blocks.1.attn.hook_q_normed", "blocks.1.attn.k_norm.hook_scale"} <= set(cache)


def test_the_config_round_trips_and_refuses_what_it_cannot_build(tmp_path):
    """to_dict / from_dict (through JSON) keep the embedding's norm kind and the rotation's direction; a clockwise
    rotation with adjacent pairs, an embedding norm of no kind, another rope type and a Llama-format save are refused
    by name; a config.json without final_logit_softcapping caps at transformers' default, 15."""
    import dataclasses

    from probe import DecoderConfig
    from probe.checkpoint_llama import llama_config_to_hf
    from probe.config import Norm
    from probe.config_file import CheckpointError

    build("nanochat", tmp_path)
    cfg = HookedDecoder.from_pretrained(tmp_path).cfg
    again = DecoderConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.embed_norm is Norm.RMS and again.rotary_clockwise and not again.post_embedding_ln
    with pytest.raises(ValueError, match="rotary_clockwise"):
        dataclasses.replace(cfg, rotary_adjacent_pairs=True)
    with pytest.raises(ValueError, match="embed_norm='bogus'"):
        dataclasses.replace(cfg, embed_norm="bogus")
    with pytest.raises(ValueError, match="rotary_clockwise"):
        llama_config_to_hf(dataclasses.replace(cfg, chunked_attention=None), None)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                      if k != "final_logit_softcapping"}))
    assert HookedDecoder.from_pretrained(tmp_path).cfg.logit_softcap == 15.0
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}))
    with pytest.raises(CheckpointError, match="rope_type 'linear'"):
        HookedDecoder.from_pretrained(tmp_path)


def test_the_residual_decomposes_from_the_normed_embedding_and_the_graph_is_dense(tmp_path):
    """The embedding's component is its norm's output (what block 0 reads: transformers' hidden_states[0]), the
    writes add up to the final residual, and the direct logit attribution of the capped logits is transformers'
    difference; the circuit graph marks the q/k norms after rotation (no bilinear scores), as Llama 4's, so circuits
    run on the dense engine."""
    from probe import analyses
    from probe.analyses.circuit_forward import sparse_supported

    hf = build("nanochat", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    decomposition = analyses.residual_decomposition(model, TOKENS)
    with torch.no_grad():
        out = hf(TOKENS, output_hidden_states=True)
        _, cache = model.run_with_cache(TOKENS)
    torch.testing.assert_close(decomposition.total(), cache["blocks.1.hook_resid_post"], atol=1e-5, rtol=0)
    torch.testing.assert_close(decomposition.components[:, :, 0], out.hidden_states[0], atol=1e-5, rtol=0)
    uncapped = seen_in_forward(hf, TOKENS, {"head": hf.lm_head})["head"][1][:, -1]  # (the cap comes after lm_head)
    result = analyses.direct_logit_attribution(model, TOKENS, 5, 9)
    torch.testing.assert_close(result.actual, uncapped[:, 5] - uncapped[:, 9], atol=1e-4, rtol=0)
    torch.testing.assert_close(result.total, result.actual, atol=1e-4, rtol=0)
    graph = analyses.circuit_graph(model)
    assert graph.reordered_or_gated and not sparse_supported(graph)


def test_nanochat_on_the_device_is_transformers_there(tmp_path, device_under_test):
    """On the GPU (the GPU list): the logits and a greedy continuation through the cache against transformers' model
    on the same device."""
    from family_checks import assert_on_the_device_as_transformers

    assert_on_the_device_as_transformers(build("nanochat", tmp_path), tmp_path, device_under_test, 40)
