"""Zyphra's Zamba2 (probe/checkpoint_zamba2.py, probe/shared_block.py): Mamba-2 layers, some of which first run a
transformer block shared with other layers, reading the residual beside the original embeddings, with each
invocation's own adapters. The logits and every residual of each case are compared with transformers in
test_variants.py (CASES), with saving; here: the shared weights as one Parameter and counted once, transformers' own
shared blocks and their parts, the file layout on saving, the cache (keys and Mamba states), generation, left
padding, TL 4's bridge hook by hook, the ledger, and the analyses that run or refuse by name."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from probe import DecoderConfig, HookedDecoder
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, assert_on_the_device_as_transformers,
                           cache_of_everything, caches_in_compatibility_mode, report_page, seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import build

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))
NO_ROPE = {"use_shared_attention_adapter": False, "use_mem_rope": False, "num_mem_blocks": 1}


def test_the_shared_weights_are_one_parameter_counted_once(tmp_path):
    """Layers 1 and 4 run block 0, layer 3 block 1: one Parameter each, so the model holds what transformers holds, and
    an edit of block 0 reaches both its layers and no other; the adapters and projections stay each layer's own."""
    hf = build("zamba2", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
    one, three, four = model.blocks[1], model.blocks[3], model.blocks[4]
    assert one.attn.qkv.weight is four.attn.qkv.weight and one.mlp.fc_out.weight is four.mlp.fc_out.weight
    assert one.ln_shared.w is four.ln_shared.w and one.attn.qkv.weight is not three.attn.qkv.weight
    assert one.linear.weight is not four.linear.weight and one.mlp.adapter.up.weight is not four.mlp.adapter.up.weight
    block_1 = three.attn.out.weight.clone()
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS)
        four.attn.out.weight.mul_(2)  # block 0's W_O, through layer 4
        _, after = model.run_with_cache(TOKENS)
    torch.testing.assert_close(after["blocks.1.hook_attn_out"], 2 * cache["blocks.1.hook_attn_out"])
    assert torch.equal(three.attn.out.weight, block_1)


def test_each_part_of_a_hybrid_layer_is_transformers_own(tmp_path):
    """Per hybrid layer: the attention's pattern and output, the MLP's output, the projection into the mixer and the
    mixer's write are those of transformers' modules in its forward; the weight views are the shared weights plus the
    layer's adapter."""
    hf = build("zamba2", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    layers = hf.model.layers
    modules = {f"{l}.{part}": module for l in (1, 3, 4) for part, module in (
        ("attn", layers[l].shared_transformer.self_attn), ("mlp", layers[l].shared_transformer.feed_forward),
        ("linear", layers[l].linear), ("mixer", layers[l].mamba_decoder.mamba))}
    seen = seen_in_forward(hf, TOKENS, modules)
    with torch.no_grad():
        expected = hf(TOKENS, output_attentions=True)
        _, cache = model.run_with_cache(TOKENS)
    for index, l in enumerate((1, 3, 4)):
        for part, point in (("attn", "hook_attn_out"), ("mlp", "hook_mlp_out"), ("linear", "hook_shared_out"),
                            ("mixer", "hook_mixer_out")):
            theirs = seen[f"{l}.{part}"][1]
            theirs = theirs[0] if isinstance(theirs, tuple) else theirs
            torch.testing.assert_close(cache[f"blocks.{l}.{point}"], theirs, atol=1e-5, rtol=0, msg=f"{l} {part}")
        torch.testing.assert_close(cache[f"blocks.{l}.attn.hook_pattern"], expected.attentions[index], atol=1e-5,
                                   rtol=0)
    theirs = layers[3].shared_transformer.self_attn
    adapter = theirs.linear_q_adapter_list[1]
    q = theirs.q_proj.weight + adapter[1].weight @ adapter[0].weight
    torch.testing.assert_close(model.blocks[3].attn.W_Q[2], q[32:48].T)
    gate_up = layers[4].shared_transformer.feed_forward
    extra = gate_up.gate_up_proj_adapter_list[2][1].weight @ gate_up.gate_up_proj_adapter_list[2][0].weight
    torch.testing.assert_close(model.blocks[4].mlp.W_in, (gate_up.gate_up_proj.weight + extra)[48:].T)
    with pytest.raises(AttributeError, match="shared projection plus its own low-rank adapter"):
        model.blocks[3].attn.W_Q = torch.zeros_like(model.blocks[3].attn.W_Q)


def test_saving_writes_each_block_once_where_transformers_keeps_it(tmp_path):
    """The file holds block 0 under layer 1 and block 1 under layer 3 (none under layer 4), the adapters at their
    invocations' indices; transformers reloads the same logits."""
    from safetensors.torch import load_file

    hf = build("zamba2", tmp_path / "src")
    out = HookedDecoder.from_pretrained(tmp_path / "src").save_pretrained(tmp_path / "saved")
    names = set(load_file(str(out / "model.safetensors")))
    assert names == set(load_file(str(tmp_path / "src" / "model.safetensors")))
    assert not any(n.startswith("model.layers.4.shared_transformer") for n in names)
    assert "model.layers.1.shared_transformer.feed_forward.gate_up_proj_adapter_list.2.1.weight" in names
    again = type(hf).from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, hf(TOKENS).logits, atol=1e-5, rtol=0)


def test_untied_files_are_refused_by_name(tmp_path):
    """transformers ties the shared blocks only with tied embeddings: an untied file's hybrid layers each run a copy
    of their own, which probe does not read."""
    build("zamba2", tmp_path, tie_word_embeddings=False, **NO_ROPE)
    with pytest.raises(Exception, match="tie_word_embeddings=false: transformers then ties no shared block"):
        HookedDecoder.from_pretrained(tmp_path)


@pytest.mark.parametrize("overrides", [{}, NO_ROPE])
def test_generation_and_processing_are_transformers(overrides, tmp_path):
    hf = build("zamba2", tmp_path, **overrides)
    assert_generation_and_processing_match(hf, tmp_path, processing=False)


def test_a_cached_prefix_then_its_continuation_is_one_forward(tmp_path):
    """The cache carries every layer's Mamba window and state, and the hybrid layers' keys as well."""
    build("zamba2", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, prefix = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.layers[0].k is None and cache.layers[0].seen == 13
    assert cache.layers[1].k.shape[1] == 13 and cache.layers[1].state is not None and cache.layers[1].seen == 13


@pytest.mark.parametrize("overrides", [{}, NO_ROPE])
def test_left_padded_batched_generation_is_transformers(overrides, tmp_path):
    """The padded prompt's positions count its real tokens, in the rotated shared attention as in transformers', and
    its padding writes nothing into the Mamba states."""
    hf = build("zamba2", tmp_path, **overrides)
    assert_left_padded_generation_matches(hf, tmp_path)


def test_every_shared_hook_and_bridge_name_matches_the_bridge(tmp_path):
    """TL 4's bridge hooks every layer's ends, and the Mamba-2 layers' norm and mixer inside; probe's names for those
    points, by the bridge's name, hold the bridge's values."""
    from transformer_lens.model_bridge import TransformerBridge

    directory = tokenized_checkpoint("zamba2", tmp_path / "z")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(directory).eval()
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, ours = model.run_with_cache(tokens)
        left_out = [n for n in theirs if not has_point(model, n)]  # (what probe hooks elsewhere, saying where)
        _, named = model.run_with_cache(tokens, names=[n for n in theirs if n not in left_out])
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    assert left_out == [f"blocks.{l}.mixer.inner_norm.{p}" for l in (0, 2) for p in ("hook_in", "hook_gate")]
    for name in (n for n in theirs if n in named):
        torch.testing.assert_close(named[name], theirs[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    assert {"blocks.1.hook_in", "blocks.4.hook_out", "blocks.0.mixer.in_proj.hook_out", "blocks.2.norm.hook_out"} <= set(theirs)
    torch.testing.assert_close(named["blocks.3.hook_out"], ours["blocks.3.hook_resid_post"])


def test_compatibility_mode_skips_fold_ln_as_the_bridge_does(tmp_path):
    """The bridge leaves Zamba2's block norms unfolded, folding only the final norm into the unembedding: probe skips
    fold_ln (saying so), and every other point both have holds the bridge's value."""
    directory = tokenized_checkpoint("zamba2", tmp_path / "z")
    model, ours, our_cache, theirs, their_cache = caches_in_compatibility_mode(directory, TOKENS)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    shared = [n for n in our_cache if n in their_cache and not n.startswith(("ln_final.", "unembed.hook_in"))]
    for name in shared:
        torch.testing.assert_close(our_cache[name], their_cache[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    assert {"blocks.0.mixer.hook_in", "blocks.3.hook_resid_post", "blocks.2.norm.hook_out"} <= set(shared)


def test_the_report_runs_and_says_what_it_skips(tmp_path):
    directory = tokenized_checkpoint("zamba2", tmp_path / "z")
    page = report_page(directory, tmp_path / "out")
    assert ("Not run: direct logit attribution takes the residual stream for the sum of its writers&#x27; outputs, "
            "and this model&#x27;s shared transformer blocks (Zamba2&#x27;s)") in page
    assert "layers [0, 2] of this hybrid model are state-space (Mamba-2) layers" in page
    assert "layers have none of their own (their shared blocks&#x27; MLPs write into the mixers&#x27; inputs)" in page
    assert (tmp_path / "out" / "patching.csv").exists() and (tmp_path / "out" / "patterns.csv").exists()


def has_point(model, name: str) -> bool:
    from probe.hooks import UnknownNameError

    try:
        model.hook_point(name)
    except UnknownNameError:
        return False
    return True


def test_the_ledger_counts_what_transformers_holds(tmp_path):
    for overrides in ({}, NO_ROPE, {"num_key_value_heads": 2, "use_shared_attention_adapter": False}):
        hf = build("zamba2", tmp_path / str(len(overrides)), **overrides)
        model = HookedDecoder.from_pretrained(tmp_path / str(len(overrides)))
        book = model.ledger()
        assert book.total_params == sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
        kv_heads = overrides.get("num_key_value_heads", 4)
        assert book.kv_bytes_per_token == 3 * 2 * kv_heads * 16 * 4  # three hybrid layers' keys and values, float32


def test_head_analyses_run_on_the_shared_layers_and_residual_sums_refuse(tmp_path):
    """The shared attention's heads are real heads (patterns, ablation of the layers that run them); analyses that
    read the residual stream as a sum of writes refuse by name, since the shared block writes into the mixer's
    input, not the residual."""
    import probe.analyses as A

    build("zamba2", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    patterns = A.attention_patterns(model, TOKENS[0])
    assert patterns.layers == [1, 3, 4]
    with pytest.raises(ValueError, match="Zamba2"):
        A.direct_logit_attribution(model, TOKENS, torch.tensor([5, 5]), torch.tensor([9, 9]))
    with pytest.raises(ValueError, match="Zamba2"):
        A.residual_decomposition(model, TOKENS)
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS)
    with pytest.raises(ValueError, match="are no residual writes"):
        cache.decompose_resid()


def test_what_the_shared_blocks_do_not_allow_is_skipped_or_refused_by_name(tmp_path):
    """A shared block's norms are one weight read by the shared projections and every layer's own adapters: fold_ln
    is skipped, saying so, and the logits stay; its attention reads [residual; embeddings], so there are no per-head
    copies of the residual to switch on."""
    build("zamba2", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        before = model(TOKENS)
    with pytest.warns(UserWarning, match="skipping fold_ln=True"):
        model.process_weights(fold_ln=True, center_writing_weights=False, center_unembed=False)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), before, atol=1e-5, rtol=0)
    with pytest.raises(AttributeError, match="no per-head copies of its input"):
        model.set_use_split_qkv_input(True)


def test_a_run_from_a_residual_needs_the_tokens(tmp_path):
    build("zamba2", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        logits, cache = model.run_with_cache(TOKENS)
        resid = cache["blocks.2.hook_resid_pre"]
        torch.testing.assert_close(model(resid, start_at_layer=2, tokens=TOKENS), logits)
        with pytest.raises(ValueError, match="reads the original token embeddings"):
            model(resid, start_at_layer=2)


def test_config_errors_name_the_fix():
    space = dict(layers=(True,) * 3, n_heads=4, d_head=16, d_state=8)
    base = dict(n_layers=3, d_model=32, n_heads=4, d_head=16, d_vocab=50, n_ctx=16, norm="rms", gated_mlp=True,
                attn_only=True, positions="rotary", qkv_bias=False, out_bias=False, mlp_bias=False, state_space=space)
    cfg = DecoderConfig(**base, shared_blocks=dict(layers=(False, True, True), n_blocks=2, adapter_rank=4))
    assert DecoderConfig.from_dict(cfg.to_dict()) == cfg and cfg.shared_blocks.block_of(2) == 1
    for bad, match in (({"d_head": 8}, r"n_heads \* d_head"), ({"attn_only": False}, "attn_only"),
                       ({"state_space": dict(space, layers=(True, False, True))}, "state_space")):
        with pytest.raises(ValueError, match=match):
            DecoderConfig(**{**base, **bad}, shared_blocks=dict(layers=(False, True, True)))
    with pytest.raises(ValueError, match="at least one True"):
        DecoderConfig(**base, shared_blocks=dict(layers=(False,) * 3))


def test_files_the_reader_refuses_say_why(tmp_path):
    build("zamba2", tmp_path, add_bias_linear=True)
    with pytest.raises(Exception, match="add_bias_linear"):
        HookedDecoder.from_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "add_bias_linear": False, "rms_norm_eps": 1e-4}))
    with pytest.raises(Exception, match="only 1e-5 is read"):
        HookedDecoder.from_pretrained(tmp_path)


def test_hook_shapes_predict_every_point(tmp_path):
    build("zamba2", tmp_path)
    _, _, cache, predicted = cache_of_everything(tmp_path)
    for name, value in cache.items():
        assert tuple(value.shape) == predicted[name], name
    assert "blocks.1.hook_shared_in" in cache and cache["blocks.1.hook_shared_in"].shape[-1] == 64


def test_a_model_the_format_cannot_hold_is_refused_by_name(tmp_path):
    from probe.checkpoint_zamba2 import zamba2_config_to_hf

    build("zamba2", tmp_path)
    cfg = HookedDecoder.from_pretrained(tmp_path).cfg
    with pytest.raises(ValueError, match="shared_blocks=None"):
        zamba2_config_to_hf(dataclasses.replace(cfg, shared_blocks=None), None)
    with pytest.raises(ValueError, match="eps="):
        zamba2_config_to_hf(dataclasses.replace(cfg, eps=1e-4), None)


def test_the_model_on_the_device_is_transformers_there(tmp_path, device_under_test):
    """On the GPU (the GPU list): a prompt longer than a chunk, and its greedy continuation through the cache, against
    transformers' model on the same device."""
    hf = build("zamba2", tmp_path, max_position_embeddings=200)
    assert_on_the_device_as_transformers(hf, tmp_path, device_under_test, 150)
