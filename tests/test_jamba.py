"""AI21's Jamba (probe/checkpoint_jamba.py): Mamba-1 mixers (probe/selective_scan.py) with learned RMS norms on the step's
input, B and C, attention without positions, experts every few layers. The logits and every residual of each case
(periods and offsets, top-1 and top-2 experts, dense everywhere, tied and untied, biases) are compared with
transformers in test_variants.py (CASES) with saving; here: transformers' own submodules (each mixer, its three
norms, the attention, the router and experts) on the same weights strengthened so the recurrence shows, generation
through the cache (attention's keys and values, the mixers' windows and states), left padding, processing, TL 4's
bridge hook by hook and in compatibility mode, hook shapes, the ledger, the analyses that refuse by name and the
report."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from probe import DecoderConfig, HookedDecoder, StateSpace
from probe.checkpoint_jamba import jamba_config_to_hf
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, assert_on_the_device_as_transformers,
                           cache_of_everything, caches_in_compatibility_mode, left_padded_logits, report_page,
                           seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import build

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))
MIXERS, ATTENTION, SPARSE = (0, 2), (1, 3), (1, 3)  # build's layout: attention and experts in the odd layers
NORMS = ("dt", "b", "c")  # the mixers' norms, {norm}_layernorm in transformers and probe


def strengthened(hf, directory):
    """The mixers' input projection and B's and C's norm scales raised, so B . C and the decay shape the output rather
    than the D skip alone (x_proj's scale would not: the norms undo it); saved to `directory`."""
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer, "mamba"):
                layer.mamba.in_proj.weight.mul_(3)
                layer.mamba.b_layernorm.weight.mul_(2)
                layer.mamba.c_layernorm.weight.mul_(2)
    hf.save_pretrained(directory)
    return hf


def test_each_submodule_is_transformers(tmp_path):
    """On strengthened weights: each mixer against transformers' JambaMambaMixer on the same input, its dt/B/C norms'
    outputs against transformers' norm modules in its forward, each attention layer's write, each router's softmax and
    choice, each MLP's write, and the logits; the state's read is a real share of y."""
    hf = strengthened(build("jamba", tmp_path / "src"), tmp_path / "strong")
    model = HookedDecoder.from_pretrained(tmp_path / "strong").eval()
    tokens = torch.randint(0, 101, (2, 30), generator=torch.Generator().manual_seed(1))
    layers = hf.model.layers
    modules = {**{f"{l}.{norm}": getattr(layers[l].mamba, f"{norm}_layernorm") for l in MIXERS for norm in NORMS},
               **{f"{l}.attn": layers[l].self_attn for l in ATTENTION},
               **{f"{l}.router": layers[l].feed_forward.router for l in SPARSE},
               **{f"{l}.mlp": layer.feed_forward for l, layer in enumerate(layers)}}
    seen = seen_in_forward(hf, tokens, modules)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names=lambda n: True)
        ends = [f"blocks.{l}.mixer.{norm}_layernorm.hook_{end}" for l in MIXERS for norm in NORMS for end in ("in", "out")]
        cache = {**cache, **model.run_with_cache(tokens, names=ends)[1]}
        torch.testing.assert_close(logits, hf(tokens).logits, atol=1e-4, rtol=0)
        for l in MIXERS:
            normed = model.blocks[l].ln1(cache[f"blocks.{l}.hook_resid_pre"])
            torch.testing.assert_close(model.blocks[l].mixer(normed), layers[l].mamba(normed), atol=1e-5, rtol=0)
            for norm in NORMS:
                point = f"blocks.{l}.mixer.{norm}_layernorm"
                torch.testing.assert_close(cache[f"{point}.hook_in"], seen[f"{l}.{norm}"][0][0], atol=1e-5, rtol=0)
                torch.testing.assert_close(cache[f"{point}.hook_out"], seen[f"{l}.{norm}"][1], atol=1e-5, rtol=0)
    for l in ATTENTION:
        torch.testing.assert_close(cache[f"blocks.{l}.hook_attn_out"], seen[f"{l}.attn"][1][0], atol=1e-5, rtol=0)
    for l in SPARSE:
        router_logits, _, chosen = seen[f"{l}.router"][1]
        torch.testing.assert_close(cache[f"blocks.{l}.mlp.hook_expert_weights"], router_logits.softmax(-1), atol=1e-5,
                                   rtol=0)
        assert torch.equal(cache[f"blocks.{l}.mlp.hook_expert_indices"].sort(-1).values, chosen.sort(-1).values)
    for l in range(4):
        torch.testing.assert_close(cache[f"blocks.{l}.hook_mlp_out"], seen[f"{l}.mlp"][1], atol=1e-5, rtol=0)
    skip_only = model.blocks[0].mixer.D * cache["blocks.0.mixer.hook_conv"]
    recurrence = cache["blocks.0.mixer.hook_scan_out"] - skip_only
    assert recurrence.abs().mean() > 0.5 * skip_only.abs().mean()


def test_attention_has_no_positions():
    """NoPE: the attention layers rotate nothing (no rotated points), so a pattern over a sequence of one repeated
    token is uniform over the keys: nothing tells their positions apart."""
    cfg = DecoderConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_vocab=20, n_ctx=16, positions="rotary",
                        rotary_layers=(False, False), norm="rms", gated_mlp=True, activation="silu", qkv_bias=False,
                        out_bias=False, mlp_bias=False)
    model = HookedDecoder(cfg).eval()
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.full((1, 6), 3))
    assert "blocks.0.attn.hook_rot_q" not in cache
    torch.testing.assert_close(cache["blocks.1.attn.hook_pattern"][0, :, 5], torch.full((4, 6), 1 / 6))


def test_generation_and_processing_are_transformers(tmp_path):
    hf = build("jamba", tmp_path)
    assert_generation_and_processing_match(hf, tmp_path)


def test_a_cached_prefix_then_its_continuation_is_one_forward(tmp_path):
    """The cache carries the attention layers' keys and values and the mixers' convolution windows and states: a
    prompt, then two tokens, then one, give the whole sequence's logits."""
    strengthened(build("jamba", tmp_path / "src"), tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, prefix = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.layers[0].k is None and cache.layers[0].state.shape == (2, 64, 8)
    assert cache.layers[1].k.shape[1] == 13 and prefix.layers[0].seen == 10


@pytest.mark.parametrize("bias", [False, True])
def test_left_padding_writes_nothing_into_the_state_or_the_convolution(bias, tmp_path):
    """A left-padded prompt's logits at its real positions are transformers' on the same padded batch (the mixers'
    input and convolved channels zeroed at padding, the attention masking it), and without in_proj's bias (which
    transformers lets into the convolution's window from padding) those of the prompt alone; generation from it
    through the cache is transformers'."""
    hf = strengthened(build("jamba", tmp_path / "src", mamba_proj_bias=bias), tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    padded, alone, theirs = left_padded_logits(model, hf)
    torch.testing.assert_close(padded[:, 4:], theirs[:, 4:], atol=1e-4, rtol=0)
    if not bias:
        torch.testing.assert_close(padded[1, 4:], alone[0], atol=1e-5, rtol=0)
        assert_left_padded_generation_matches(hf, tmp_path)


@pytest.mark.parametrize("experts", [4, 1])
def test_every_shared_hook_and_bridge_name_matches_the_bridge(experts, tmp_path):
    """TL 4's bridge (BlockBridge; the mixer an SSMMixerBridge under `mixer` with its three norms; the MLP an MoEBridge,
    the dense layers' projections `dense_*`, or with one expert (Jamba Reasoning's) a gated MLP's `gate`/`in`/`out`)
    hook by hook and by its names; the names probe has not say what to use instead."""
    from transformer_lens.model_bridge import TransformerBridge

    from probe.hooks import UnknownNameError

    directory = tokenized_checkpoint("jamba", tmp_path / "jamba", num_experts=experts)
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(str(directory)).eval()
    tokens = TOKENS % model.cfg.d_vocab
    gate, down = ("dense_gate", "dense_out") if experts > 1 else ("gate", "out")
    names = [f"blocks.0.{n}" for n in ("hook_in", "mixer.hook_in", "mixer.in_proj.hook_out", "mixer.x_proj.hook_in",
                                       "mixer.x_proj.hook_out", "mixer.out_proj.hook_in", "mixer.hook_out",
                                       "mixer.hook_ssm_out", "mlp.hook_in", f"mlp.{gate}.hook_out",
                                       f"mlp.{down}.hook_in", "mlp.hook_out", "hook_out")]
    names += [f"blocks.1.{n}" for n in ("attn.hook_in", "attn.q.hook_out", "attn.o.hook_in", "attn.hook_out",
                                        "mlp.hook_in", "mlp.hook_out")]
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, ours = model.run_with_cache(tokens)
        _, named = model.run_with_cache(tokens, names=names)
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    # (the bridge's scores hold its own mask value where probe's hold -inf)
    shared = [n for n in ours if n in theirs and not n.endswith("hook_attn_scores")]
    for name in shared:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    for name in names:
        torch.testing.assert_close(named[name], theirs[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    assert {f"blocks.{l}.mixer.{n}_layernorm.{p}" for l in MIXERS for n in NORMS
            for p in ("hook_in", "hook_scale", "hook_normalized", "hook_out")} <= set(shared) | set(names)
    assert "blocks.1.attn.hook_pattern" in shared and "blocks.1.attn.hook_rot_q" not in ours
    fired = [n for n in theirs if n not in ours]
    assert fired and all(model.get_hook_point(n) is not None or _left_out(model, n) for n in fired)
    refused = [("blocks.0.mixer.dt_proj.hook_in", "its low-rank input is blocks.0.mixer.dt_layernorm.hook_out"),
               ("blocks.0.mixer.hook_ssm_state", "does not keep the state at every position"),
               (f"blocks.0.mlp.{gate}.hook_in", "blocks.0.ln2.hook_out")]
    if experts > 1:
        refused.append(("blocks.1.mlp.router.hook_out", "blocks.1.mlp.hook_expert_weights"))
    for name, match in refused:
        with pytest.raises(UnknownNameError, match=match):
            model.run_with_cache(tokens, names=[name])


def _left_out(model, name: str) -> bool:
    """Whether probe says what to hook instead of the bridge's `name`."""
    from probe.hooks import UnknownNameError

    try:
        model.hook_point(name)
    except UnknownNameError as err:
        return "closest valid names" not in str(err)
    return True


def test_compatibility_mode_skips_fold_ln_as_the_bridge_does(tmp_path):
    """The bridge's Jamba adapter leaves every norm unfolded (supports_fold_ln False): probe says it skips fold_ln, and
    its points are the bridge's after enable_compatibility_mode on both, the mixers' norms included."""
    directory = tokenized_checkpoint("jamba", tmp_path / "jamba")
    model, ours, our_cache, theirs, their_cache = caches_in_compatibility_mode(directory, TOKENS)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    shared = [n for n in our_cache if n in their_cache and not n.endswith("hook_attn_scores")]
    for name in shared:
        torch.testing.assert_close(our_cache[name], their_cache[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    assert {"blocks.0.mixer.b_layernorm.hook_normalized", "blocks.1.attn.hook_z", "ln_final.hook_normalized"} <= set(
        shared)


def test_hook_shapes_and_the_ledger(tmp_path):
    """Every point's shape as hook_shapes predicts it; the ledger counts transformers' parameters and the attention
    layers' keys and values alone."""
    for overrides in ({}, {"mamba_proj_bias": True, "mamba_conv_bias": False, "tie_word_embeddings": True,
                           "num_experts": 1}):
        directory = tmp_path / str(len(overrides))
        hf = build("jamba", directory, **overrides)
        model, _, cache, shapes = cache_of_everything(directory)
        for name, value in cache.items():  # (an expert's points hold the rows routed to it: at most every token)
            rows = value.shape[0] if ".experts." not in name else shapes[name][0]
            assert value.shape[0] <= rows and (rows, *value.shape[1:]) == shapes[name], name
        # (the norms' ends are the bridge's points alone, cached by name)
        assert {n for n in cache if ".mixer." in n} == {n for n in shapes if ".mixer." in n
                                                         and not n.endswith(("norm.hook_in", "norm.hook_out"))}
        assert model.ledger().total_params == sum(p.numel() for p in hf.parameters()) == sum(
            p.numel() for p in model.parameters())
        assert model.ledger().kv_bytes_per_token == 2 * 2 * 2 * 8 * 4  # two layers' keys and values, 2 heads of 8


def test_analyses_of_heads_refuse_by_name_and_analyses_of_layers_run(tmp_path):
    """Head analyses name the Mamba layers; circuit discovery makes each one a node; direct logit attribution adds up to transformers'
    logit difference, each mixer's write one component beside the attention layers' heads."""
    import probe.analyses as A

    hf = build("jamba", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    hybrid = r"layers \[0, 2\] of this hybrid model are state-space \(Mamba\) layers"
    with pytest.raises(ValueError, match="head_scores: " + hybrid):
        A.head_scores(model, "induction", n_samples=4)
    graph = A.circuit_graph(model)  # circuit discovery makes each Mamba layer one node (tests/test_circuit_mixers.py)
    assert [graph.writers[graph.mixer_writer(l)] for l in (0, 2)] == ["L0 mixer", "L2 mixer"]
    with pytest.raises(AttributeError, match="state-space layer: it has no attention heads"):
        model.blocks[0].attn
    dla = A.direct_logit_attribution(model, TOKENS, torch.tensor([5, 5]), torch.tensor([9, 9]))
    with torch.no_grad():
        logits = hf(TOKENS).logits[:, -1]
    torch.testing.assert_close(dla.total, logits[:, 5] - logits[:, 9], atol=1e-4, rtol=0)
    assert {"L0 mixer", "L1H0", "L2 mixer", "L3H3"} <= set(dla.to_frame()["component"])


def test_the_report_runs_and_says_what_it_leaves_out(tmp_path):
    directory = tokenized_checkpoint("jamba", tmp_path / "jamba")
    page = report_page(directory, tmp_path / "out")
    for what in ("each head detector", "head ablation"):
        assert (f"Not run: {what} reads every layer&#x27;s attention heads, and layers [0, 2] of this hybrid model "
                "are state-space (Mamba) layers") in page
    out = tmp_path / "out"  # (the attention layers' patterns, the residual's patching, the routing: run)
    # (and the circuit: each Mamba layer a mixer node)
    assert all((out / f).exists() for f in ("patterns.csv", "patching.csv", "routing.csv", "edges.csv"))
    assert "and this model&#x27;s sparse layers&#x27; MLPs are mixtures of experts" in page  # (its dense ones are not)


def test_config_errors_and_what_the_format_cannot_hold(tmp_path):
    base = dict(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, positions="rotary", norm="rms",
                gated_mlp=True)
    space = dict(layers=(True, False), n_heads=64, d_head=1, d_state=8, kind="mamba1", dt_rank=4, bcdt_norm_eps=1e-6,
                 bcdt_norm_weights=True)
    assert DecoderConfig(**base, state_space=space).state_space.bcdt_norm_weights
    for bad, match in ((dict(space, bcdt_norm_eps=None), "True only with their bcdt_norm_eps"),
                       (dict(space, bcdt_norm_weights=1), "a bool"),
                       (dict(space, kind="mamba2", d_head=8, n_heads=8, dt_rank=0, bcdt_norm_eps=None),
                        "bcdt_norm_weights=True")):
        with pytest.raises(ValueError, match=match):
            DecoderConfig(**base, state_space=bad)
    build("jamba", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path)
    cfg = model.cfg
    for change, match in ((dict(state_space=dataclasses.replace(cfg.state_space, layers=(True, False, False, True))),
                           r"attention layers are in layers \[1, 2\], which no period gives"),
                          (dict(experts=dataclasses.replace(cfg.experts, renormalize=True)), "unrenormalised"),
                          (dict(state_space=dataclasses.replace(cfg.state_space, bcdt_norm_weights=False)),
                           "dt/B/C norms learned"),
                          (dict(rotary_layers=None), "rotary_layers"),
                          (dict(state_space=StateSpace(layers=cfg.state_space.layers, n_heads=8, d_head=8, d_state=8)),
                           "recurrent layers are Mamba-1 mixers")):
        with pytest.raises(ValueError, match=match):
            jamba_config_to_hf(dataclasses.replace(cfg, **change), None)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(Exception, match="read as silu only"):
        HookedDecoder.from_pretrained(tmp_path)


def test_saving_writes_every_setting_transformers_reads(tmp_path):
    """Settings off transformers' defaults (periods and offsets, the step's rank, kernel, state, eps, biases, a tied
    head, top-1 experts in every layer) survive probe's save into transformers."""
    hf = strengthened(build("jamba", tmp_path / "src", mamba_proj_bias=True, mamba_conv_bias=False, mamba_dt_rank=5,
                            mamba_d_conv=3, mamba_d_state=6, tie_word_embeddings=True, rms_norm_eps=1e-3,
                            attn_layer_period=3, attn_layer_offset=2, expert_layer_period=1, expert_layer_offset=0,
                            num_experts_per_tok=1, num_experts=3), tmp_path / "strong")
    out = HookedDecoder.from_pretrained(tmp_path / "strong").save_pretrained(tmp_path / "saved")
    again = type(hf).from_pretrained(out).eval()
    assert again.config.layers_block_type == hf.config.layers_block_type
    assert again.config.layers_num_experts == hf.config.layers_num_experts
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, hf(TOKENS).logits, atol=1e-5, rtol=0)


def test_jamba_on_the_device_is_transformers_there(tmp_path, device_under_test):
    """On the GPU (the GPU list): a prompt past a scan chunk, and its greedy continuation through the cache, against
    transformers' model on the same device."""
    hf = build("jamba", tmp_path, max_position_embeddings=200)
    assert_on_the_device_as_transformers(hf, tmp_path, device_under_test, 150)
