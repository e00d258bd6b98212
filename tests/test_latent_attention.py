"""Multi-head latent attention (probe/latent_attention.py) and its checkpoints (probe/checkpoint_deepseek.py:
DeepSeek-V2, DeepSeek-V3, GLM-4.7-Flash, Youtu). The logits and every residual of each case are compared with
transformers in test_variants.py (CASES) with saving; here: generation through the cache, processing, each hook point
against transformers' own modules and TL 4's MLAAttentionBridge, heads reading their own inputs, the ledger against
transformers' cache, and the analyses that work or refuse by name."""
from __future__ import annotations

import json

import pytest
import torch

from probe import DecoderConfig, HookedDecoder, LatentAttention
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, assert_on_the_device_as_transformers,
                           caches_in_compatibility_mode, report_page, runs_with_one_heads_input_swapped,
                           seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import build

KINDS = ["deepseek_v2", "deepseek_v3", "glm4_moe_lite", "youtu"]
TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kind", KINDS)
def test_generation_and_processing_are_transformers(kind, tmp_path):
    hf = build(kind, tmp_path)
    with pytest.warns(UserWarning, match="center_writing_weights"):  # RMSNorm: nothing to centre, as in TL
        assert_generation_and_processing_match(hf, tmp_path)


def test_a_cached_prefix_then_its_continuation_is_one_forward(tmp_path):
    """The cache keeps each layer's expanded keys and values: a prompt, then two tokens, then one, give the logits of
    the whole sequence in one pass; a frozen cache reads the prefix without keeping more."""
    build("deepseek_v3", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, prefix = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.length == 13 and cache.layers[1].k.shape == (2, 13, 4, 20)
    assert prefix.length == 10


def test_left_padded_batched_generation_is_transformers(tmp_path):
    hf = build("deepseek_v2", tmp_path)
    assert_left_padded_generation_matches(hf, tmp_path)


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2"])
def test_the_points_hold_transformers_values(kind, tmp_path):
    """The latents are what transformers' q_a_layernorm and kv_a_layernorm return, hook_z what its o_proj reads and
    the pattern its attention weights."""
    hf = build(kind, tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    attn = hf.model.layers[1].self_attn
    seen = seen_in_forward(hf, TOKENS, {"q": attn.q_a_layernorm, "kv": attn.kv_a_layernorm, "o": attn.o_proj})
    with torch.no_grad():
        theirs = hf(TOKENS, output_attentions=True)
        _, cache = model.run_with_cache(TOKENS)
    torch.testing.assert_close(cache["blocks.1.attn.hook_q_latent"], seen["q"][1], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["blocks.1.attn.hook_kv_latent"], seen["kv"][1], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["blocks.1.attn.hook_z"].flatten(-2), seen["o"][0][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["blocks.1.attn.hook_pattern"], theirs.attentions[1], atol=1e-5, rtol=0)
    assert cache["blocks.1.attn.hook_q"].shape == (2, 13, 4, 20) and cache["blocks.1.attn.hook_v"].shape == (2, 13, 4, 16)


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2", "glm4_moe_lite"])
def test_every_shared_hook_matches_the_bridge(kind, tmp_path):
    """TL 4's MLAAttentionBridge hook by hook, experts too. Its hook_q, hook_k and hook_v are [batch head pos d]
    (probe's [batch pos head d]) and its hook_z o_proj's flat input; the rest are compared as they are."""
    from transformer_lens.model_bridge import TransformerBridge

    directory = tokenized_checkpoint(kind, tmp_path / kind)
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.from_pretrained(directory).eval()
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, ours = model.run_with_cache(tokens)
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    compared = set()
    # (the bridge's hook_expert_weights are the chosen experts' final weights, probe's the scores of every expert, as
    # TL 3.9 hooks them: test_moe_routing.py; its chosen experts come unsorted)
    for name in (n for n in ours if n in theirs and not n.endswith("hook_expert_weights")):
        a, b = ours[name], theirs[name]
        if name.endswith("hook_expert_indices"):
            a, b = a.sort(-1).values, b.sort(-1).values
        elif name.endswith(("attn.hook_q", "attn.hook_k", "attn.hook_v")):
            b = b.transpose(1, 2)
        elif name.endswith("attn.hook_z"):
            a, b = a.flatten(-2), b.flatten(-2)
        elif name.endswith("hook_attn_scores"):
            visible = torch.ones(13, 13, dtype=torch.bool).tril()
            a, b = a[..., visible], b[..., visible]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
        compared.add(name.split(".", 2)[-1])
    assert {"attn.hook_q_latent", "attn.hook_kv_latent", "attn.hook_rot_q", "attn.hook_rot_k", "attn.hook_q", "attn.hook_k", "attn.hook_v",
            "attn.hook_pattern", "attn.hook_z"} <= compared
    assert kind != "glm4_moe_lite" or "mlp.hook_expert_indices" in compared  # (its router bridge hooks them)


def test_bridge_names_of_the_projections_hold_the_bridges_values_or_say_what_to_hook(tmp_path):
    from transformer_lens.model_bridge import TransformerBridge

    from probe.hooks import UnknownNameError

    directory = tokenized_checkpoint("deepseek_v3", tmp_path / "v3")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(directory).eval()
    tokens = TOKENS % model.cfg.d_vocab
    names = [f"blocks.1.attn.{n}" for n in ("q_a_proj.hook_out", "q_a_layernorm.hook_in", "q_a_layernorm.hook_out",
                                             "q_b_proj.hook_in", "kv_a_layernorm.hook_in", "kv_a_layernorm.hook_out",
                                             "kv_b_proj.hook_in")]
    with torch.no_grad():
        _, theirs = bridge.run_with_cache(tokens, names_filter=lambda n: n in names)
        _, ours = model.run_with_cache(tokens, names=names)
    for name in names:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
    for name, hint in (("q_b_proj.hook_out", "hook_q"), ("kv_b_proj.hook_out", "hook_v"),
                       ("kv_a_proj_with_mqa.hook_out", "hook_rot_k"), ("q_a_proj.hook_in", "ln1.hook_out")):
        with pytest.raises(UnknownNameError, match=hint):
            model.hook_point(f"blocks.1.attn.{name}")


def test_heads_reading_their_own_inputs_compute_what_one_input_does(tmp_path):
    """With split inputs nothing changes; one head's key input replaced by another prompt's residual gives that head
    the other prompt's key and leaves every other head's key and every value as they were."""
    build("deepseek_v3", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    plain, base, split, cache, theirs, edited = runs_with_one_heads_input_swapped(model, TOKENS, "blocks.1.hook_k_input", 2)
    torch.testing.assert_close(split, plain, atol=1e-6, rtol=0)
    for name in ("hook_q", "hook_k", "hook_v"):
        torch.testing.assert_close(cache[f"blocks.1.attn.{name}"], base[f"blocks.1.attn.{name}"], atol=1e-6, rtol=0)
    k = edited["blocks.1.attn.hook_k"]
    torch.testing.assert_close(k[:, :, 2], theirs["blocks.1.attn.hook_k"][:, :, 2], atol=1e-6, rtol=0)
    torch.testing.assert_close(k[:, :, [0, 1, 3]], cache["blocks.1.attn.hook_k"][:, :, [0, 1, 3]], atol=0, rtol=0)
    torch.testing.assert_close(edited["blocks.1.attn.hook_v"], cache["blocks.1.attn.hook_v"], atol=0, rtol=0)


def test_the_ledger_counts_every_parameter_and_transformers_cache(tmp_path):
    """Parameters: the model's own; KV-cache bytes per token: what transformers' cache holds after a prompt (the
    latent and the shared rotated key part per layer), not per-head keys and values."""
    hf = build("deepseek_v3", tmp_path, attention_bias=True)
    model = HookedDecoder.from_pretrained(tmp_path)
    ledger = model.ledger()
    assert ledger.total_params == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        cache = hf(TOKENS[:1], use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert ledger.kv_bytes_per_token == held // TOKENS.shape[1]


def test_weight_analyses_refuse_by_name_and_activation_analyses_run(tmp_path):
    import probe.analyses as A

    build("deepseek_v3", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    corrupted = TOKENS.clone()
    corrupted[:, 4] = (corrupted[:, 4] + 5) % 101
    metric = A.logit_diff_metric(model, torch.tensor([5, 5]), torch.tensor([9, 9]))
    for call in (lambda: A.composition_scores(model), lambda: A.ov_circuit(model, 1, 0),
                 lambda: A.copying_scores(model), lambda: A.prune_heads(model, [(0, 1)]),
                 lambda: A.edge_attribution(model, TOKENS, corrupted, metric)):
        with pytest.raises(ValueError, match="latent attention .* no W_Q, W_K or W_V"):
            call()
    with pytest.raises(AttributeError, match="hook_q, hook_k, hook_v"):
        model.blocks[0].attn.W_Q
    # the heads' activations: DLA's rows add up to transformers' logit difference, head patching runs
    dla = A.direct_logit_attribution(model, TOKENS, torch.tensor([5, 5]), torch.tensor([9, 9]))
    hf = build("deepseek_v3", tmp_path / "again")
    with torch.no_grad():
        logits = hf(TOKENS).logits[:, -1]
    torch.testing.assert_close(dla.total, logits[:, 5] - logits[:, 9], atol=1e-4, rtol=0)
    patched = A.patch(model, TOKENS, corrupted, metric, "heads")
    assert patched.to_frame().shape[0] == 2 * 4


def test_config_errors_name_the_fix():
    base = dict(n_layers=2, d_model=32, n_heads=4, d_head=8, d_vocab=50, n_ctx=16, positions="rotary", norm="rms",
                gated_mlp=True)
    latent = dict(kv_rank=16, d_nope=8, d_rope=4, q_rank=12)
    cfg = DecoderConfig(**base, latent_attention=latent)
    assert cfg.rotary_dim == 4 and cfg.latent_attention == LatentAttention(**latent)
    for change, match in ((dict(n_kv_heads=2), "n_kv_heads"), (dict(sliding_window=4), "sliding_window"),
                          (dict(positions="learned"), "positions"), (dict(rotary_dim=8), "rotary_dim"),
                          (dict(qk_norm=True), "qk_norm"), (dict(norm_placement="parallel"), "norm_placement")):
        with pytest.raises(ValueError, match=f"these settings differ: {match}"):
            DecoderConfig(**{**base, **change}, latent_attention=latent)
    for bad, match in ((dict(latent, d_rope=5), "d_rope=5 rotates pairs"), (dict(latent, kv_rank=0), "kv_rank"),
                       (dict(latent, q_rank=1.5), "q_rank must be a positive int or None"),
                       (dict(latent, mscale=0), "mscale")):
        with pytest.raises(ValueError, match=match):
            DecoderConfig(**base, latent_attention=bad)


def test_a_multi_token_prediction_layer_in_the_file_is_not_read(tmp_path):
    """DeepSeek-V3's released files carry the MTP layer after the last one; transformers skips it, and so does probe."""
    from safetensors.torch import load_file, save_file

    hf = build("deepseek_v3", tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights.update({k.replace("layers.1.", "layers.2."): v.clone() for k, v in weights.items() if ".layers.1." in k})
    weights["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(weights, str(tmp_path / "model.safetensors"))
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(TOKENS).logits, atol=1e-4, rtol=0)


def test_saving_keeps_the_rope_layout_and_the_score_scale(tmp_path):
    """A YaRN model's mscale_all_dim comes back from the saved file as the same score scale, and V3's rope_interleave
    and V2's pairs in place stay as they were; a latent model cannot be saved as another format."""
    from probe.checkpoints import FAMILIES

    overrides = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0.8}}
    build("deepseek_v3", tmp_path / "v3", **overrides)
    model = HookedDecoder.from_pretrained(tmp_path / "v3")
    saved = json.loads((model.save_pretrained(tmp_path / "saved") / "config.json").read_text())
    assert saved["rope_interleave"] is True
    assert saved["rope_parameters"]["mscale_all_dim"] == pytest.approx(0.8)
    assert HookedDecoder.from_pretrained(tmp_path / "saved").cfg == model.cfg
    with pytest.raises(ValueError, match="cannot hold this model: .*latent_attention"):
        FAMILIES["llama"].config_to_hf(model.cfg, None)
    with pytest.raises(ValueError, match="rotary pairs in place"):  # V2's pairs are not written back evens first
        FAMILIES["deepseek_v2"].config_to_hf(model.cfg, None)


def test_the_report_says_why_it_leaves_out_the_circuit(tmp_path):
    page = report_page(tokenized_checkpoint("deepseek_v3", tmp_path / "v3"), tmp_path / "out")
    assert "Not run. Circuit discovery: this model&#x27;s latent attention reads queries" in page
    assert (tmp_path / "out" / "patching.csv").exists() and (tmp_path / "out" / "heads_induction.csv").exists()


def test_compatibility_mode_processes_as_the_bridge_does(tmp_path):
    """The bridge's MLA adapters leave the norms unfolded (fold_ln unsupported) and centre the unembedding: probe
    says which step it skips, and gives the bridge's logits and activations."""
    directory = tokenized_checkpoint("deepseek_v3", tmp_path / "v3")
    model, ours, cache, theirs, their_cache = caches_in_compatibility_mode(directory, TOKENS)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for name in ("blocks.0.ln1.hook_out", "blocks.1.attn.hook_kv_latent", "blocks.1.attn.hook_pattern",
                 "blocks.1.hook_resid_post", "ln_final.hook_out"):
        torch.testing.assert_close(cache[name], their_cache[name], atol=1e-4, rtol=0, msg=name)
    assert model.cfg.normalization_type == "RMS" and model.unembed.W_U.mean(-1).abs().max() < 1e-6


@pytest.mark.parametrize("case", ["yarn-mscale", "in-place-pairs"])
def test_sharp_patterns_are_transformers(case, tmp_path):
    """Queries and keys scaled up until the patterns are sharp (random weights leave them near uniform, where the
    score scale and the rotary layout hardly show): the logits and patterns are still transformers'."""
    if case == "yarn-mscale":
        hf = build("deepseek_v3", tmp_path / "src", rope_parameters={
            "rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "mscale": 0.9, "mscale_all_dim": 2.0})
    else:
        hf = build("deepseek_v2", tmp_path / "src")
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_b_proj.weight.mul_(30)
            layer.self_attn.kv_b_proj.weight.mul_(30)
            layer.self_attn.kv_a_proj_with_mqa.weight.mul_(30)
    hf.save_pretrained(tmp_path / "sharp")
    model = HookedDecoder.from_pretrained(tmp_path / "sharp").eval()
    with torch.no_grad():
        theirs = hf(TOKENS, output_attentions=True)
        ours, cache = model.run_with_cache(TOKENS)
    assert theirs.attentions[1][..., 1:, :].amax(-1).mean() > 0.6  # sharp, not near uniform
    torch.testing.assert_close(ours, theirs.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(cache["blocks.1.attn.hook_pattern"], theirs.attentions[1], atol=1e-4, rtol=0)


def test_the_bridges_shared_expert_names_say_where_probe_keeps_it(tmp_path):
    """The bridge hooks DeepSeek's ungated shared experts as `mlp.shared_experts.*`; probe's are mlp.shared_expert's
    points with the tokens flattened (as every expert's), so asking for the bridge's name says so, and the values
    agree with the bridge's once laid out alike."""
    from transformer_lens.model_bridge import TransformerBridge

    from probe.hooks import UnknownNameError

    directory = tokenized_checkpoint("deepseek_v3", tmp_path / "v3")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.from_pretrained(directory).eval()
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        _, theirs = bridge.run_with_cache(tokens)
        _, ours = model.run_with_cache(tokens)
    with pytest.raises(UnknownNameError, match="mlp.shared_expert .*flattened"):
        model.hook_point("blocks.1.mlp.shared_experts.hook_post")
    torch.testing.assert_close(ours["blocks.1.mlp.shared_expert.hook_post"],
                               theirs["blocks.1.mlp.shared_experts.hook_post"].flatten(0, 1), atol=1e-5, rtol=0)


def test_the_latent_model_on_the_device_is_transformers_there(tmp_path, device_under_test):
    """On the GPU (the GPU list): DeepSeek-V3's latent attention and routed experts against transformers' model on the
    same device, and the greedy continuation through the cache."""
    assert_on_the_device_as_transformers(build("deepseek_v3", tmp_path), tmp_path, device_under_test, 40)
