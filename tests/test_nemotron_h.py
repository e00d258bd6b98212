"""NVIDIA's Nemotron-H (probe/checkpoint_nemotron_h.py): one sublayer per layer, Mamba-2 (M), attention without
positions (*), a relu^2 MLP (-) or ungated experts routed as DeepSeek-V3 routes (E). The logits and every residual of
each case are compared with transformers in test_variants.py (CASES) with saving; here: transformers' own experts
and their routing, weights strong enough that the recurrence shows, the config spellings transformers reads, the
cache, generation, padding, TL 4's bridge hook by hook and in compatibility mode, the ledger, the report and the
analyses that run or refuse by name."""
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
LATENT = {"moe_latent_size": 16, "mlp_bias": True, "layers_block_type": ["mamba", "moe", "attention", "moe"]}


def strengthened(hf, directory):
    """The Mamba layers' projections scaled up, so B . C and the decay shape the output rather than the D skip alone;
    saved to `directory`."""
    with torch.no_grad():
        for layer in hf.model.layers:
            if layer.block_type == "linear_attention":
                layer.mixer.in_proj.weight.mul_(25)
                layer.mixer.conv1d.weight.mul_(4)
    hf.save_pretrained(directory)
    return hf


@pytest.mark.parametrize("overrides", [{}, LATENT])
def test_the_experts_and_their_routing_are_transformers_own(overrides, tmp_path):
    """Each MoE layer's input and output are those of transformers' NemotronHMoE module in its forward, and the
    experts each token runs are its router's (the groups and the selection bias bite: the bias changes choices)."""
    hf = build("nemotron_h", tmp_path, **overrides)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    layers = [l for l, layer in enumerate(hf.model.layers) if layer.block_type == "moe"]
    modules = {**{f"moe{l}": hf.model.layers[l].mixer for l in layers},
               **{f"gate{l}": hf.model.layers[l].mixer.gate for l in layers}}
    seen = seen_in_forward(hf, TOKENS, modules)
    names = [f"blocks.{l}.{point}" for l in layers for point in ("ln2.hook_out", "hook_mlp_out", "mlp.hook_expert_indices",
                                                                  "mlp.hook_expert_weights")]
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS, names=names)
    for l in layers:
        (moe_in,), moe_out = seen[f"moe{l}"]
        torch.testing.assert_close(cache[f"blocks.{l}.ln2.hook_out"], moe_in, atol=1e-5, rtol=0)
        torch.testing.assert_close(cache[f"blocks.{l}.hook_mlp_out"], moe_out, atol=1e-4, rtol=0)
        _, weights, chosen = seen[f"gate{l}"][1]
        ours = cache[f"blocks.{l}.mlp.hook_expert_indices"]
        assert torch.equal(ours.sort(-1).values, chosen.sort(-1).values)
        unbiased = cache[f"blocks.{l}.mlp.hook_expert_weights"].topk(2, dim=-1).indices
        assert not torch.equal(unbiased.sort(-1).values, ours.sort(-1).values)  # the bias and groups changed some
        assert ("fc1_latent_proj" in dict(model.blocks[l].mlp.named_children())) == ("moe_latent_size" in overrides)


def test_a_strong_recurrence_is_transformers(tmp_path):
    hf = strengthened(build("nemotron_h", tmp_path / "src"), tmp_path / "strong")
    model = HookedDecoder.from_pretrained(tmp_path / "strong").eval()
    tokens = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(tokens, output_hidden_states=True)
        ours, cache = model.run_with_cache(tokens)
        skip_only = model.blocks[0].mixer.D[:, None] * cache["blocks.0.mixer.hook_conv"][..., :128].unflatten(-1, (8, 16))
    torch.testing.assert_close(ours, theirs.logits, atol=1e-4, rtol=0)
    for layer in range(4):
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_resid_pre"], theirs.hidden_states[layer], atol=1e-4,
                                   rtol=0)
    recurrence = cache["blocks.0.mixer.hook_scan_out"] - skip_only
    assert recurrence.abs().mean() > 0.2 * skip_only.abs().mean()


def test_each_layer_is_a_block_of_its_one_sublayer(tmp_path):
    build("nemotron_h", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path)
    assert model.cfg.sublayers == ("mixer", "mlp", "attn", "mlp")
    assert [type(b).__name__ for b in model.blocks] == ["StateSpaceOnlyBlock", "MLPOnlyBlock", "AttnOnlyBlock",
                                                         "MLPOnlyBlock"]
    names = set(model.hook_names)
    assert {"blocks.0.hook_attn_out", "blocks.1.hook_mlp_out", "blocks.2.attn.hook_pattern", "blocks.3.mlp.hook_post",
            "blocks.1.mlp.experts.0.hook_pre"} <= names
    assert not {"blocks.0.hook_mlp_out", "blocks.1.hook_attn_out", "blocks.2.hook_resid_mid", "blocks.3.ln1.hook_out",
                "blocks.2.attn.hook_rot_q", "blocks.1.mlp.experts.0.hook_gate"} & names
    with pytest.raises(AttributeError, match="MLP-only layer: it has no attention heads"):
        model.blocks[1].attn


@pytest.mark.parametrize("legacy", [False, True])
def test_the_released_spellings_read_as_transformers_reads_them(legacy, tmp_path):
    """hybrid_override_pattern, and (legacy) the mamba_* spellings of the earliest files, read as transformers'
    NemotronHConfig reads them; the fields transformers' forward ignores (expand, mamba_proj_bias, attention_bias,
    n_shared_experts, residual_in_fp32) change nothing."""
    import transformers as tf

    hf = build("nemotron_h", tmp_path, n_groups=1, time_step_limit=(0.01, 0.5), conv_kernel=3)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config["hybrid_override_pattern"] = "ME*-"
    del config["layers_block_type"]
    config.update(expand=7, mamba_proj_bias=True, attention_bias=True, n_shared_experts=3, residual_in_fp32=True)
    if legacy:
        for new, old in (("n_groups", "mamba_n_groups"), ("conv_kernel", "mamba_d_conv"),
                         ("time_step_limit", "mamba_dt_limit"), ("use_conv_bias", "mamba_conv_bias")):
            config[old] = config.pop(new)
    path.write_text(json.dumps(config))
    theirs = tf.NemotronHConfig.from_pretrained(tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    space = model.cfg.state_space
    assert (space.n_groups, space.conv_kernel, space.dt_min, space.dt_max) == (
        theirs.n_groups, theirs.conv_kernel, *theirs.time_step_limit) == (1, 3, 0.01, 0.5)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(TOKENS).logits, atol=1e-4, rtol=0)


def test_prediction_layers_are_set_aside_and_stacked_experts_read(tmp_path):
    """A file with multi-token-prediction tensors (`mtp.*`, which transformers never builds) and each MoE layer's
    experts stacked in one tensor (transformers' in-memory layout) loads as the file save_pretrained writes."""
    from safetensors.torch import load_file, save_file

    hf = build("nemotron_h", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    for proj in ("up_proj", "down_proj"):
        names = [f"backbone.layers.1.mixer.experts.{e}.{proj}.weight" for e in range(4)]
        tensors[f"model.layers.1.mixer.experts.{proj}"] = torch.stack([tensors.pop(n) for n in names])
    tensors["mtp.layers.0.norm.weight"] = torch.ones(64)
    save_file(tensors, file, metadata={"format": "pt"})
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(TOKENS).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("overrides", [{}, LATENT])
def test_generation_and_processing_are_transformers(overrides, tmp_path):
    hf = build("nemotron_h", tmp_path, **overrides)
    with pytest.warns(UserWarning, match="center_writing_weights"):
        assert_generation_and_processing_match(hf, tmp_path)


def test_a_cached_prefix_then_its_continuation_is_one_forward(tmp_path):
    """The cache carries the Mamba layer's window and state and the attention layer's keys; an MLP-only first layer
    keeps nothing, and the cache's length is still the positions seen."""
    strengthened(build("nemotron_h", tmp_path / "src", layers_block_type=["mlp", "mamba", "attention", "moe"]),
                 tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, prefix = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.layers[0].length == 0 and cache.layers[1].seen == 13 and cache.layers[2].k.shape[1] == 13
    assert prefix.layers[1].seen == 10


def test_left_padded_batched_generation_is_transformers(tmp_path):
    hf = strengthened(build("nemotron_h", tmp_path / "src"), tmp_path)
    assert_left_padded_generation_matches(hf, tmp_path)


def test_every_shared_hook_and_bridge_name_matches_the_bridge(tmp_path):
    """TL 4's bridge hook by hook: every layer a block whose one sublayer is `mixer` (a passthrough on attention and
    MLP layers), its one norm `norm`; probe's names for those points and the Mamba-2 mixer's inner ones."""
    from transformer_lens.model_bridge import TransformerBridge

    from probe.hooks import UnknownNameError

    directory = tokenized_checkpoint("nemotron_h", tmp_path / "nh")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(directory).eval()
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, ours = model.run_with_cache(tokens)
        left_out = [n for n in theirs if not has_point(model, n)]  # (what probe hooks elsewhere, saying where)
        _, named = model.run_with_cache(tokens, names=[n for n in theirs if n not in left_out])
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    assert left_out == ["blocks.0.mixer.inner_norm.hook_in", "blocks.0.mixer.inner_norm.hook_gate"]
    for name in (n for n in theirs if n in named):  # every other point the bridge fires, by the bridge's own name
        torch.testing.assert_close(named[name], theirs[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    assert len(theirs) > 60 and {"blocks.2.mixer.hook_out", "blocks.3.norm.hook_scale", "blocks.0.mixer.out_proj.hook_in",
                                 "blocks.1.hook_mixer_in"} <= set(theirs)
    shared = [n for n in ours if n in theirs]
    assert {"blocks.0.hook_resid_post", "blocks.3.hook_resid_pre", "ln_final.hook_scale"} <= set(shared)
    torch.testing.assert_close(named["blocks.1.mixer.hook_out"], ours["blocks.1.hook_mlp_out"])
    torch.testing.assert_close(named["blocks.2.norm.hook_out"], ours["blocks.2.ln1.hook_out"])
    for name, hint in (("blocks.0.mixer.hook_ssm_state", "hook_dt"), ("blocks.2.mixer.hook_ssm_state", "keeps no state"),
                       ("blocks.1.mixer.hook_ssm_write", "an MLP \\(or experts\\)")):
        with pytest.raises(UnknownNameError, match=hint):
            model.hook_point(name)


def has_point(model, name: str) -> bool:
    from probe.hooks import UnknownNameError

    try:
        model.hook_point(name)
    except UnknownNameError:
        return False
    return True


def test_compatibility_mode_skips_fold_ln_as_the_bridge_does(tmp_path):
    """The bridge leaves NemotronH's block norms unfolded, folding only the final norm into the unembedding: probe
    skips fold_ln (saying so) and every other shared point, the block norms' included, is the bridge's."""
    directory = tokenized_checkpoint("nemotron_h", tmp_path / "nh")
    model, ours, our_cache, theirs, their_cache = caches_in_compatibility_mode(directory, TOKENS)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    shared = [n for n in our_cache if n in their_cache and not n.startswith(("ln_final.", "unembed.hook_in"))]
    for name in shared:
        torch.testing.assert_close(our_cache[name], their_cache[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    assert {"blocks.0.mixer.hook_in", "blocks.3.hook_resid_post", "blocks.2.attn.hook_pattern"} & set(shared)


def test_the_ledger_counts_what_transformers_holds(tmp_path):
    for overrides in ({}, LATENT):
        hf = build("nemotron_h", tmp_path / str(len(overrides)), **overrides)
        model = HookedDecoder.from_pretrained(tmp_path / str(len(overrides)))
        book = model.ledger()
        assert book.total_params == sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
        attention = sum(1 for layer in hf.model.layers if layer.block_type == "full_attention")
        assert book.kv_bytes_per_token == attention * 2 * 2 * 16 * 4  # keys and values of 2 heads of 16, float32


def test_analyses_of_heads_refuse_and_analyses_of_layers_run(tmp_path):
    """Head analyses name the layers without heads; the residual decomposition has one component per Mamba-2 and
    MLP layer and the attention layer's heads, and direct logit attribution adds up to transformers' logit
    difference; a lens has no mid-layer sites to read."""
    import probe.analyses as A

    hf = build("nemotron_h", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with pytest.raises(ValueError, match=r"layers \[0, 1, 3\] of this hybrid model are state-space \(Mamba-2\) or "
                                         r"MLP-only layers"):
        A.head_scores(model, "induction", n_samples=4)
    dla = A.direct_logit_attribution(model, TOKENS, torch.tensor([5, 5]), torch.tensor([9, 9]))
    with torch.no_grad():
        logits = hf(TOKENS).logits[:, -1]
    torch.testing.assert_close(dla.total, logits[:, 5] - logits[:, 9], atol=1e-4, rtol=0)
    components = list(dla.to_frame()["component"])  # (a row per prompt, each with the fixed terms after)
    assert components[:8] == ["embed", "L0 mixer", "L1 mlp", "L2H0", "L2H1", "L2H2", "L2H3", "L3 mlp"]
    patterns = A.attention_patterns(model, TOKENS[0])
    assert patterns.layers == [2]
    with pytest.raises(ValueError, match=r"layers \[1\] are linear-attention or MLP-only layers"):
        A.attention_patterns(model, TOKENS[0], layers=[1])
    with pytest.raises(ValueError, match="holds one sublayer"):
        A.logit_lens(model, TOKENS, include_mid=True)


def test_a_model_of_attention_and_mlp_layers_alone_refuses_head_analyses_by_name(tmp_path):
    import probe.analyses as A

    build("nemotron_h", tmp_path, layers_block_type=["attention", "mlp", "attention", "moe"])
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with pytest.raises(ValueError, match=r"layers \[1, 3\] of this hybrid model are MLP-only layers"):
        A.ablate_heads(model, TOKENS, [(0, 0)])


def test_config_errors_name_the_fix():
    base = dict(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, positions="rotary", norm="rms")
    space = dict(layers=(True, False), n_heads=4, d_head=8, d_state=16)
    cfg = DecoderConfig(**base, state_space=space, sublayers=["mixer", "attn"])
    assert cfg.sublayers == ("mixer", "attn") and DecoderConfig.from_dict(cfg.to_dict()) == cfg
    for bad, match in (({"sublayers": ("mixer", "conv")}, "one of 'mixer', 'attn', 'mlp'"),
                       ({"sublayers": ("attn", "mixer")}, "state_space.layers must say True there"),
                       ({"sublayers": ("mixer", "attn"), "attn_only": True}, "set attn_only=False"),
                       ({"sublayers": ("mixer", "attn", "mlp")}, "each of the n_layers=2")):
        with pytest.raises(ValueError, match=match):
            DecoderConfig(**base, state_space=space, **bad)
    experts = dict(n=4, per_token=2, layers=(False, True), gated=False)
    with pytest.raises(ValueError, match="experts.layers must be True only in 'mlp' layers"):
        DecoderConfig(**base, state_space=dict(space, layers=(True, False)), experts=dict(experts, layers=(True, False)),
                      sublayers=("mixer", "mlp"))
    with pytest.raises(ValueError, match=r"ungated experts \(Experts\(gated=False\)\) go with gated_mlp=False"):
        DecoderConfig(**base, gated_mlp=True, experts=experts)


def test_a_model_the_format_cannot_hold_is_refused_by_name(tmp_path):
    from probe.checkpoint_nemotron_h import nemotron_h_config_to_hf

    build("nemotron_h", tmp_path)
    cfg = HookedDecoder.from_pretrained(tmp_path).cfg
    with pytest.raises(ValueError, match="one sublayer per layer"):
        nemotron_h_config_to_hf(dataclasses.replace(cfg, sublayers=None, state_space=None, experts=None), None)
    with pytest.raises(ValueError, match="experts are ungated, chosen by sigmoid score"):
        nemotron_h_config_to_hf(dataclasses.replace(cfg, experts=dataclasses.replace(cfg.experts, scoring="softmax")),
                                None)
    with pytest.raises(ValueError, match="qkv_bias=True"):
        nemotron_h_config_to_hf(dataclasses.replace(cfg, qkv_bias=True), None)


def test_hook_shapes_predict_every_point(tmp_path):
    build("nemotron_h", tmp_path, **LATENT)
    _, _, cache, predicted = cache_of_everything(tmp_path)
    for name, value in cache.items():  # (an expert's points hold the rows routed to it: at most every token)
        rows = value.shape[0] if ".experts." not in name else predicted[name][0]
        assert value.shape[0] <= rows and (rows, *value.shape[1:]) == predicted[name], name
    assert "blocks.3.mlp.experts.0.hook_post" in cache and "blocks.0.mixer.hook_scan_out" in cache


def test_compatibility_mode_and_the_report(tmp_path):
    directory = tokenized_checkpoint("nemotron_h", tmp_path / "nh")
    page = report_page(directory, tmp_path / "out")
    assert ("Not run: head ablation reads every layer&#x27;s attention heads, and layers [0, 1, 3] of this hybrid "
            "model are state-space (Mamba-2) or MLP-only layers") in page
    assert (tmp_path / "out" / "patching.csv").exists() and (tmp_path / "out" / "patterns.csv").exists()


def test_the_model_on_the_device_is_transformers_there(tmp_path, device_under_test):
    """On the GPU (the GPU list): a prompt longer than a chunk, and its greedy continuation through the cache, against
    transformers' model on the same device."""
    hf = build("nemotron_h", tmp_path, max_position_embeddings=200, **LATENT)
    assert_on_the_device_as_transformers(hf, tmp_path, device_under_test, 150)
