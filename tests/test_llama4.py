"""Llama 4 (probe/checkpoint_llama4.py, probe/llama4_attention.py, probe/config_chunked.py). The logits and every
residual of each case are compared with transformers in test_variants.py (CASES) with saving; here: the patterns
(chunk masks, temperature) and the q/k norm against transformers' modules, the routing, generation through the cache
across chunk boundaries, left padding, processing, the multimodal file's language model, TL 4's bridge name by name,
compatibility mode, the ledger, the report, and the analyses that refuse it."""
from __future__ import annotations

import math

import pytest
import torch

from probe import HookedDecoder
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, cache_of_everything,
                           compared_with_the_delegating_bridge, report_page, seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import CASES, build

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))
MAVERICK_LIKE = CASES["llama4-maverick-like-biases-tied"][1]


def test_patterns_norms_and_temperature_are_transformers(tmp_path):
    """Every layer's pattern is transformers' (the rope layers' chunks of 6, the NoPE layer's full view with tuned
    queries); hook_k_normed is transformers' weightless norm of the rotated keys; hook_q_scaled is hook_q times the
    temperature worked out by hand (1 + 0.5 log(1 + floor((pos + 1) / 4)), above 1 from position 3)."""
    hf = build("llama4", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    seen = seen_in_forward(hf, TOKENS, {"qk_norm": hf.model.layers[0].self_attn.qk_norm})  # (its last call: the keys)
    with torch.no_grad():
        expected = hf(TOKENS, output_attentions=True).attentions
        _, cache = model.run_with_cache(TOKENS)
    for layer in range(4):
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_pattern"], expected[layer], atol=1e-5, rtol=0)
    pattern = cache["blocks.0.attn.hook_pattern"]
    assert pattern[:, :, 7, :6].abs().max() == 0 and pattern[:, :, 7, 6:8].min() > 0  # (position 7 is in chunk 1)
    assert cache["blocks.2.attn.hook_pattern"][:, :, 7, :6].min() > 0  # (the NoPE layer sees every earlier key)
    torch.testing.assert_close(cache["blocks.0.attn.hook_k_normed"], seen["qk_norm"][1], atol=1e-6, rtol=0)
    by_hand = torch.tensor([1 + 0.5 * math.log1p(math.floor((pos + 1) / 4)) for pos in range(13)])
    scaled = cache["blocks.2.attn.hook_q"] * by_hand[:, None, None]
    torch.testing.assert_close(cache["blocks.2.attn.hook_q_scaled"], scaled)
    assert "blocks.2.attn.hook_q_normed" not in cache and "blocks.0.attn.hook_q_scaled" not in cache
    assert "blocks.2.attn.hook_rot_q" not in cache


def test_the_hook_shapes_are_predicted(tmp_path):
    build("llama4", tmp_path)
    _, _, cache, predicted = cache_of_everything(tmp_path)
    for name, value in cache.items():  # (an expert's points hold the rows routed to it: at most every token)
        rows = value.shape[0] if ".mlp.experts." not in name else predicted[name][0]
        assert value.shape[0] <= rows and (rows, *value.shape[1:]) == predicted[name], name
    assert "blocks.0.attn.q_norm.hook_scale" in cache and "blocks.2.attn.hook_q_scaled" in cache


def test_the_routing_and_the_shared_expert_are_transformers(tmp_path):
    """hook_expert_weights is the sigmoid of every router logit, hook_expert_indices the largest logit; the chosen
    expert reads its input times that sigmoid (its hook_pre is up_proj of the scaled input); the shared expert's
    points are transformers' shared expert's."""
    hf = build("llama4", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    moe = hf.model.layers[1].feed_forward
    seen = seen_in_forward(hf, TOKENS, {"router": moe.router, "shared": moe.shared_expert.gate_proj})
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS)
    _, logits = seen["router"][1]
    torch.testing.assert_close(cache["blocks.1.mlp.hook_expert_weights"], logits.sigmoid(), atol=1e-6, rtol=0)
    chosen = cache["blocks.1.mlp.hook_expert_indices"]
    assert torch.equal(chosen[:, 0], logits.argmax(-1))
    torch.testing.assert_close(cache["blocks.1.mlp.shared_expert.hook_pre"], seen["shared"][1], atol=1e-6, rtol=0)
    tokens = seen["router"][0][0]  # (what the router and the experts read: ln2's output, flattened)
    rows = (chosen[:, 0] == 2).nonzero().flatten()
    weight = logits.sigmoid()[rows, 2, None]
    up = moe.experts.gate_up_proj[2, :, moe.experts.expert_dim:]
    expected = (tokens[rows] * weight) @ up
    torch.testing.assert_close(cache["blocks.1.mlp.experts.2.hook_pre"], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["llama4-chunks-qk-norm-temperature-moe-every-other",
                                  "llama4-maverick-like-biases-tied"])
def test_generation_through_chunk_boundaries_and_processing_are_transformers(case, tmp_path):
    """Six prompt tokens and eight new ones cross the chunk boundaries at 6 and 12 through the cache."""
    hf = build("llama4", tmp_path, **CASES[case][1])
    with pytest.warns(UserWarning, match="center_writing_weights"):  # (RMSNorm: nothing to centre, as in TL)
        assert_generation_and_processing_match(hf, tmp_path)


def test_a_cached_prefix_is_one_forward_across_chunks(tmp_path):
    """A prompt of 10, then 2 tokens, then 1 through one cache give one forward's logits (chunks end at 6 and 12)."""
    build("llama4", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, _ = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.length == 13


def test_left_padding_counts_chunks_from_the_first_real_token_as_transformers(tmp_path):
    """A left-padded batch generates as transformers does (its chunks, too, start after the padding) where the
    queries are not temperature-tuned, and the padded prompt's continuation is its own alone."""
    hf = build("llama4", tmp_path, **MAVERICK_LIKE)
    assert_left_padded_generation_matches(hf, tmp_path)


def test_left_padding_changes_nothing_with_temperature_tuning(tmp_path):
    """probe counts a query's temperature, as its chunk, in real tokens, so a left-padded prompt continues as it does
    alone (transformers counts the temperature's positions from the padding's start, so its padded rows differ)."""
    build("llama4", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    ids = TOKENS[:, :9].clone()
    ids[1, :3] = 0
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        both = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, verbose=False)
        alone = model.generate(ids[1:, 3:], max_new_tokens=6, do_sample=False, verbose=False)
        torch.testing.assert_close(model(ids, attention_mask=mask)[1, 3:], model(ids[1:, 3:])[0], atol=1e-5, rtol=0)
    assert torch.equal(both[1, 3:], alone[0])


def build_multimodal(directory, vocab: int = 101):
    """A random Llama 4 multimodal file (a one-layer vision model) whose language model is build("llama4")'s shape."""
    import transformers as tf

    text = dict(vocab_size=vocab, hidden_size=32, intermediate_size=24, intermediate_size_mlp=40, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=40,
                num_local_experts=4, interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 1], attention_chunk_size=6,
                floor_scale=4, attn_scale=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    hf = tf.Llama4ForConditionalGeneration(tf.Llama4Config(text_config=text, vision_config=vision,
                                                          image_token_index=vocab - 1))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "language_model" in name:
                param.add_(0.2 * torch.randn_like(param))  # norms away from 1, the router and experts larger
    hf = hf.eval()
    hf.save_pretrained(directory)
    return hf


def test_the_multimodal_files_language_model_is_transformers_and_saves_as_llama4_text(tmp_path):
    import transformers as tf

    hf = build_multimodal(tmp_path / "mm")
    model = HookedDecoder.from_pretrained(tmp_path / "mm").eval()
    assert model.cfg.original_architecture == "Llama4ForConditionalGeneration" and model.cfg.experts.scale_inputs
    with torch.no_grad():
        expected = hf(input_ids=TOKENS).logits
        torch.testing.assert_close(model(TOKENS), expected, atol=1e-4, rtol=0)
        out = model.save_pretrained(tmp_path / "text")
        text = tf.Llama4ForCausalLM.from_pretrained(out).eval()
        assert text.config.model_type == "llama4_text"
        torch.testing.assert_close(text(TOKENS).logits, expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="llama4_text"):
        from probe.checkpoint_llama4 import llama4_multimodal_config_to_hf
        llama4_multimodal_config_to_hf(model.cfg, None)


def test_every_bridge_name_is_the_bridges_value_or_says_what_to_hook(tmp_path):
    """TL 4's Llama 4 adapter (attention delegated to transformers: its hook_attn_scores holds the pattern, compared
    with probe's pattern) point by point under its own names, dense and MoE layers; the names probe leaves out (the
    router's, the shared expert's flattened input and output) say what to hook."""
    compared = compared_with_the_delegating_bridge(tokenized_checkpoint("llama4", tmp_path / "llama4"), TOKENS)
    assert {"attn.hook_pattern", "attn.hook_z", "attn.q.hook_out", "mlp.dense_gate.hook_out", "mlp.hook_post",
            "mlp.shared_expert.gate.hook_out", "mlp.shared_expert.out.hook_in", "mlp.shared_expert.hook_pre_linear",
            "mlp.hook_out"} <= compared
    model = HookedDecoder.from_pretrained(tmp_path / "llama4")
    for name, says in (("blocks.1.mlp.router.hook_out", "hook_expert_weights"),
                       ("blocks.1.mlp.shared_expert.hook_out", "hook_mlp_out")):
        with pytest.raises(Exception, match=says):
            model.hook_point(name)


def test_compatibility_mode_folds_the_norms_as_the_bridge_does(tmp_path):
    """The bridge folds Llama 4's block norms (pre-norm, as Llama's): probe's compatibility mode does too, and every
    point compared holds the bridge's values (the norms' weights are random, so an unfolded model would differ)."""
    from transformer_lens.model_bridge import TransformerBridge

    directory = tokenized_checkpoint("llama4", tmp_path / "llama4")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(str(directory))
    with pytest.warns(UserWarning, match="center_writing_weights"):  # (RMSNorm: nothing to centre, as in TL)
        model.enable_compatibility_mode()
    bridge.enable_compatibility_mode()
    assert not isinstance(model.blocks[0].ln1.w, torch.nn.Parameter)  # (folded: fixed ones)
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        (ours, cache), (theirs, their_cache) = model.run_with_cache(tokens), bridge.run_with_cache(tokens)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for name in ("blocks.0.ln1.hook_out", "blocks.0.attn.hook_q", "blocks.2.attn.hook_pattern", "blocks.1.mlp.hook_out",
                 "blocks.3.hook_resid_post"):
        torch.testing.assert_close(cache[name], their_cache[name], atol=1e-4, rtol=0, msg=name)


def test_the_ledger_counts_transformers_parameters_and_cache(tmp_path):
    import dataclasses

    from probe.ledger import ledger as ledger_of

    hf = build("llama4", tmp_path)
    ledger = HookedDecoder.from_pretrained(tmp_path).ledger()
    assert ledger.total_params == sum(p.numel() for p in hf.parameters())
    with torch.no_grad():
        cache = hf(TOKENS[:1, :3], use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert ledger.kv_bytes_per_token == held // 3
    # the chunked layers' queries read at most 6 keys, the NoPE layer's all 40: the attention term counts them so
    wide = HookedDecoder.from_pretrained(tmp_path).cfg
    unchunked = dataclasses.replace(wide, chunked_attention=dataclasses.replace(wide.chunked_attention, size=None,
                                                                               layers=(False,) * 4))
    per_key = 2 * 2 * wide.n_heads * wide.d_head  # scores and the weighted sum, 2 FLOPs a multiply-add
    assert ledger_of(unchunked).flops_per_token - ledger.flops_per_token == 3 * (40 - 6) * per_key


def test_the_report_runs(tmp_path):
    directory = tokenized_checkpoint("llama4", tmp_path / "llama4")
    page = report_page(directory, tmp_path / "out")
    assert "Expert routing" in page and (tmp_path / "out" / "edges.csv").exists()  # (circuits by the dense engine)


def test_llama4_on_the_device_is_transformers_there(tmp_path, device_under_test):
    """On the GPU (the GPU list): the chunked, temperature-tuned, mixed dense and MoE model against transformers' model
    on the same device, and the greedy continuation through the cache across chunk boundaries."""
    from family_checks import assert_on_the_device_as_transformers

    assert_on_the_device_as_transformers(build("llama4", tmp_path), tmp_path, device_under_test, 40)


def test_the_config_round_trips_and_refuses_what_it_cannot_build(tmp_path):
    """to_dict / from_dict (through JSON) keep the chunked attention and the input-scaled experts; a learned q/k norm
    beside the weightless one, a chunk size of none for chunked layers, and a Llama-format save are refused by name."""
    import dataclasses
    import json

    from probe import DecoderConfig
    from probe.checkpoint_llama import llama_config_to_hf
    from probe.config_file import CheckpointError

    build("llama4", tmp_path)
    cfg = HookedDecoder.from_pretrained(tmp_path).cfg
    again = DecoderConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.chunked_attention.layers == (True, True, False, True) and again.experts.scale_inputs
    with pytest.raises(ValueError, match="qk_norm"):
        dataclasses.replace(cfg, qk_norm=True)
    with pytest.raises(ValueError, match="ChunkedAttention.size"):
        dataclasses.replace(cfg, chunked_attention={"size": None, "layers": (True, False, False, False)})
    with pytest.raises(ValueError, match="chunked_attention"):
        llama_config_to_hf(cfg, None)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "attention_chunk_size": None}))
    with pytest.raises(CheckpointError, match="attention_chunk_size"):
        HookedDecoder.from_pretrained(tmp_path)


@pytest.mark.parametrize("spelling", ["left out", "empty"])
def test_layers_a_config_leaves_out_are_derived_as_transformers_derives_them(spelling, tmp_path):
    """A config.json without no_rope_layers (or with Maverick's empty list), moe_layers and layer_types: every fourth
    layer NoPE, every interleave_moe_layer_step-th sparse, the rope layers chunked, as transformers reads it."""
    import json

    import transformers as tf

    build("llama4", tmp_path, num_hidden_layers=5, no_rope_layers=[1, 0, 1, 1, 0])
    path = tmp_path / "config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("moe_layers", "layer_types")}
    config["no_rope_layers"] = [] if spelling == "empty" else config.pop("no_rope_layers") and None
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    hf = tf.Llama4ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    assert [model.cfg.layer_rotates(l) for l in range(5)] == [True, True, True, False, True]
    assert [model.cfg.layer_sparse(l) for l in range(5)] == [False, True, False, True, False]
    assert model.cfg.chunked_attention.layers == (True, True, True, False, True)
    tokens = torch.randint(0, 101, (1, 24), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=0)
