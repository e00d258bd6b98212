"""Mamba-2 state-space layers (probe/state_space.py) and their checkpoints, IBM's Granite 4.0-H and Bamba
(probe/checkpoint_mamba.py). The logits and every residual of each case are compared with transformers in
test_variants.py (CASES) with saving; here: the chunked scan against transformers' own and against the recurrence by
definition, weights strong enough that the recurrence shows, generation through the state cache, padding, processing,
TL 4's bridge hook by hook and by its names, the ledger, and the analyses that run or refuse by name."""
from __future__ import annotations

import pytest
import torch

from probe import DecoderConfig, HookedDecoder, StateSpace
from probe.kv_cache import KVCache
from probe.state_space import state_space_scan, state_space_scan_stepwise
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, assert_on_the_device_as_transformers,
                           caches_in_compatibility_mode, left_padded_logits, report_page)
from test_family_defaults import tokenized_checkpoint
from test_variants import build

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))


def strengthened(hf, directory):
    """The Mamba layers' projections scaled up, so B . C and the decay shape the output rather than the D skip alone
    (random small weights leave the recurrence's share near nothing); saved to `directory`."""
    with torch.no_grad():
        for layer in hf.model.layers:
            if layer.mamba is not None:
                layer.mamba.in_proj.weight.mul_(25)
                layer.mamba.conv1d.weight.mul_(4)
    hf.save_pretrained(directory)
    return hf


@pytest.mark.parametrize("n", [1, 7, 64, 150])
def test_the_chunked_scan_is_transformers_and_the_definition(n):
    """probe's chunked scan against transformers' torch chunk scan (mamba2_chunk_scan, with its own chunk size) and
    against the recurrence one position at a time, from a carried state."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

    g = torch.Generator().manual_seed(n)
    heads, groups = 4, 2
    x = torch.randn(2, n, heads, 8, generator=g)
    dt = torch.rand(2, n, heads, generator=g)
    A = -torch.rand(heads, generator=g) - 0.1
    B, C = torch.randn(2, n, groups, 16, generator=g), torch.randn(2, n, groups, 16, generator=g)
    state = torch.randn(2, heads, 8, 16, generator=g)
    per_head = [t.repeat_interleave(heads // groups, dim=2) for t in (B, C)]
    ours, final = state_space_scan(x, dt, A, *per_head, state)
    stepwise, final_stepwise = state_space_scan_stepwise(x, dt, A, *per_head, state)
    theirs, their_final = mamba2_chunk_scan(x, dt, A, B, C, chunk_size=32, initial_states=state,
                                            return_final_states=True)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, their_final, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours, stepwise, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, final_stepwise, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("overrides", [{}, {"position_embedding_type": None, "num_local_experts": 0},
                                       {"mamba_proj_bias": True, "mamba_conv_bias": False, "attention_bias": True,
                                        "time_step_limit": (0.01, 0.5), "mamba_n_groups": 1}])
def test_a_strong_recurrence_is_transformers(overrides, tmp_path):
    hf = strengthened(build("granitemoehybrid", tmp_path / "src", **overrides), tmp_path / "strong")
    model = HookedDecoder.from_pretrained(tmp_path / "strong").eval()
    tokens = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(tokens, output_hidden_states=True)
        ours, cache = model.run_with_cache(tokens)
        skip_only = model.blocks[0].mixer.D[:, None] * cache["blocks.0.mixer.hook_conv"][..., :128].unflatten(-1, (8, 16))
    torch.testing.assert_close(ours, theirs.logits, atol=1e-4, rtol=0)
    for layer in range(3):
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_resid_pre"], theirs.hidden_states[layer], atol=1e-4,
                                   rtol=0)
    recurrence = cache["blocks.0.mixer.hook_scan_out"] - skip_only
    assert recurrence.abs().mean() > 0.2 * skip_only.abs().mean()  # the state's read is a real share of y


@pytest.mark.parametrize("kind", ["granitemoehybrid", "bamba", "mamba2"])
def test_generation_and_processing_are_transformers(kind, tmp_path):
    hf = build(kind, tmp_path)
    with pytest.warns(UserWarning, match="center_writing_weights"):
        assert_generation_and_processing_match(hf, tmp_path)


def test_a_cached_prefix_then_its_continuation_is_one_forward(tmp_path):
    """The cache carries each Mamba layer's convolution window and state: a prompt, then two tokens, then one, give
    the whole sequence's logits; a frozen cache reads the prefix and keeps nothing more."""
    strengthened(build("granitemoehybrid", tmp_path / "src"), tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, prefix = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.length == 13 and cache.layers[0].k is None and cache.layers[1].k.shape[1] == 13
    assert prefix.length == 10 and prefix.layers[0].seen == 10


def test_left_padded_batched_generation_is_transformers(tmp_path):
    hf = strengthened(build("granitemoehybrid", tmp_path / "src"), tmp_path)
    assert_left_padded_generation_matches(hf, tmp_path)


def test_every_shared_hook_and_bridge_name_matches_the_bridge(tmp_path):
    """TL 4's bridge (its SSM2MixerBridge under `mixer`) hook by hook, and its own names for the mixer's points. Its
    unembed.hook_out is lm_head's output before logits_scaling divides it (probe's: the logits)."""
    from transformer_lens.model_bridge import TransformerBridge

    from probe.hooks import UnknownNameError

    directory = tokenized_checkpoint("granitemoehybrid", tmp_path / "gh")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(directory).eval()
    tokens = TOKENS % model.cfg.d_vocab
    names = [f"blocks.0.mixer.{n}" for n in ("hook_in", "in_proj.hook_in", "in_proj.hook_out", "inner_norm.hook_out")]
    names += ["blocks.0.hook_in", "blocks.2.hook_out", "blocks.0.shared_mlp.hook_in", "blocks.1.moe.hook_in"]
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, ours = model.run_with_cache(tokens)
        _, named = model.run_with_cache(tokens, names=names)
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    compared = set()
    for name in (n for n in ours if n in theirs and n not in ("unembed.hook_out", "hook_unembed")):
        a, b = ours[name], theirs[name]
        if name.endswith("hook_attn_scores"):
            visible = torch.ones(13, 13, dtype=torch.bool).tril()
            a, b = a[..., visible], b[..., visible]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
        compared.add(name)
    assert {"blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern", "blocks.2.ln1.hook_scale"} <= compared
    for name in names:
        torch.testing.assert_close(named[name], theirs[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(ours["blocks.0.mixer.hook_scan_out"].flatten(-2),
                               theirs["blocks.0.mixer.inner_norm.hook_in"], atol=1e-4, rtol=0)
    # (the bridge's conv1d points do not fire: transformers' path reads the convolution's weights, not its module)
    conv = bridge.original_model.model.layers[0].mamba.conv1d
    channels = theirs["blocks.0.mixer.in_proj.hook_out"][..., 128:128 + 192].mT
    expected = torch.nn.functional.silu(conv(channels)[..., :tokens.shape[1]]).mT
    torch.testing.assert_close(ours["blocks.0.mixer.hook_conv"], expected, atol=1e-5, rtol=0)
    for name, hint in (("mixer.hook_ssm_state", "hook_dt"), ("mixer.conv1d.hook_in", "hook_in_proj"),
                       # the bridge's outputs of the mixer and of attention before Granite's residual multiplier
                       ("mixer.hook_out", "residual_multiplier"), ("attn.hook_out", "residual_multiplier"),
                       ("shared_mlp.hook_pre", "mlp.shared_expert"), ("moe.hook_expert_indices", "router's logits")):
        with pytest.raises(UnknownNameError, match=hint):
            model.hook_point(f"blocks.{1 if name.startswith(('attn', 'moe')) else 0}.{name}")
    # what probe has instead: the bridge's sublayer output times the multiplier (0.5 here)
    torch.testing.assert_close(ours["blocks.0.hook_attn_out"], 0.5 * theirs["blocks.0.mixer.hook_out"], atol=1e-5,
                               rtol=0)


def test_the_ledger_counts_every_parameter(tmp_path):
    for overrides in ({}, {"mamba_proj_bias": True, "mamba_conv_bias": False, "num_local_experts": 0}):
        build("granitemoehybrid", tmp_path / str(len(overrides)), **overrides)
        model = HookedDecoder.from_pretrained(tmp_path / str(len(overrides)))
        assert model.ledger().total_params == sum(p.numel() for p in model.parameters())
        assert model.ledger().kv_bytes_per_token == 2 * 2 * 16 * 4  # the one attention layer's keys and values


def test_analyses_of_heads_refuse_and_analyses_of_layers_run(tmp_path):
    """Head analyses name the Mamba-2 layers; residual decomposition treats each one's write as one component, and
    direct logit attribution adds up to transformers' logit difference."""
    import probe.analyses as A

    hf = build("granitemoehybrid", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with pytest.raises(ValueError, match=r"layers \[0, 2\] of this hybrid model are state-space \(Mamba-2\) layers"):
        A.head_scores(model, "induction", n_samples=4)
    with pytest.raises(AttributeError, match="state-space layer: it has no attention heads"):
        model.blocks[0].attn
    dla = A.direct_logit_attribution(model, TOKENS, torch.tensor([5, 5]), torch.tensor([9, 9]))
    with torch.no_grad():
        logits = hf(TOKENS).logits[:, -1]
    torch.testing.assert_close(dla.total, logits[:, 5] - logits[:, 9], atol=1e-4, rtol=0)
    assert {"L0 mixer", "L1H0", "L2 mixer"} <= set(dla.to_frame()["component"])


def test_config_errors_name_the_fix():
    base = dict(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, positions="rotary", norm="rms",
                gated_mlp=True)
    space = dict(layers=(True, False), n_heads=4, d_head=8, d_state=16)
    assert DecoderConfig(**base, state_space=space).state_space == StateSpace(**space)
    for bad, match in ((dict(space, n_groups=3), "multiple of n_groups=3"), (dict(space, layers=(False, False)),
                                                                              "at least one True"),
                       (dict(space, dt_min=1.0, dt_max=0.5), "dt_min < dt_max"), (dict(space, d_state=0), "d_state")):
        with pytest.raises(ValueError, match=match):
            DecoderConfig(**base, state_space=bad)
    with pytest.raises(ValueError, match="gives 3 layers"):
        DecoderConfig(**base, state_space=dict(space, layers=(True, False, True)))
    with pytest.raises(ValueError, match="settings differ: norm_placement"):
        DecoderConfig(**base, state_space=space, norm_placement="parallel")


def test_compatibility_mode_and_the_report(tmp_path):
    """The bridge's GraniteMoeHybrid adapter leaves the norms unfolded: probe says it skips fold_ln and gives the
    bridge's activations; `probe report` runs and says why its head sections are not run."""
    directory = tokenized_checkpoint("granitemoehybrid", tmp_path / "gh")
    _, _, cache, _, their_cache = caches_in_compatibility_mode(directory, TOKENS)
    for name in ("blocks.0.ln1.hook_out", "blocks.0.mixer.hook_inner_norm", "blocks.1.attn.hook_pattern",
                 "blocks.2.hook_resid_post"):
        torch.testing.assert_close(cache[name], their_cache[name], atol=1e-4, rtol=0, msg=name)
    page = report_page(directory, tmp_path / "out")
    assert ("Not run: head ablation reads every layer&#x27;s attention heads, and layers [0, 2] of this hybrid model "
            "are state-space (Mamba-2) layers") in page
    assert (tmp_path / "out" / "patching.csv").exists() and (tmp_path / "out" / "edges.csv").exists()  # (mixer nodes)


def test_left_padding_writes_nothing_into_the_state_or_the_convolution(tmp_path):
    """A left-padded prompt's logits at its real positions are those of the prompt alone and transformers' on the same
    padded batch: padding reaches neither the state nor the convolution's window."""
    hf = strengthened(build("granitemoehybrid", tmp_path / "src"), tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    padded, alone, theirs = left_padded_logits(model, hf)
    torch.testing.assert_close(padded[1, 4:], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(padded[:, 4:], theirs[:, 4:], atol=1e-4, rtol=0)


def test_bamba_hook_by_hook_and_compatibility_mode_as_the_bridge(tmp_path):
    """Bamba on TL 4's bridge: every shared point (the mixer's under `mixer`, the attention layer's rotating half of
    each head), and enable_compatibility_mode skipping fold_ln as the bridge does."""
    from transformer_lens.model_bridge import TransformerBridge

    directory = tokenized_checkpoint("bamba", tmp_path / "bamba")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(str(directory)).eval()
    tokens = TOKENS % model.cfg.d_vocab
    names = ["blocks.0.mixer.in_proj.hook_out", "blocks.0.mixer.inner_norm.hook_out", "blocks.0.mixer.hook_out"]
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, ours = model.run_with_cache(tokens)
        _, named = model.run_with_cache(tokens, names=names)
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    compared = 0
    for name in [n for n in ours if n in theirs and not n.endswith("hook_attn_scores")] + names:
        torch.testing.assert_close((named if name in names else ours)[name], theirs[name], atol=1e-4, rtol=0,
                                   msg=lambda m: f"{name}: {m}")
        compared += 1
    assert compared > 30 and "blocks.1.attn.hook_rot_q" in ours and ours["blocks.1.attn.hook_rot_q"].shape[-1] == 16
    with pytest.warns(UserWarning, match="skipping fold_ln"):
        model.enable_compatibility_mode()
    bridge.enable_compatibility_mode()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), bridge(tokens), atol=1e-4, rtol=0)


def test_mamba2_hook_by_hook_by_the_bridges_names_and_through_the_cache(tmp_path):
    """Mamba-2's own model on TL 4's bridge: every shared point and its block norm's names (`blocks.L.norm.*`, probe's
    ln1); a cached prefix and its continuation are one forward; the analyses of heads and MLPs say why they cannot
    run, those by layer run."""
    from transformer_lens.model_bridge import TransformerBridge

    import probe.analyses as A

    directory = tokenized_checkpoint("mamba2", tmp_path / "mamba2")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(str(directory)).eval()
    tokens = TOKENS % model.cfg.d_vocab
    names = ["blocks.1.norm.hook_out", "blocks.1.norm.hook_in", "blocks.1.mixer.hook_out", "blocks.1.mixer.in_proj.hook_out"]
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, ours = model.run_with_cache(tokens)
        _, named = model.run_with_cache(tokens, names=names)
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    shared = [n for n in ours if n in theirs]
    for name in shared:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    for name in names:
        torch.testing.assert_close(named[name], theirs[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    assert len(shared) >= 3 * 4 and not any("resid_mid" in n or "mlp" in n for n in ours)
    with torch.no_grad():
        cache = KVCache.init_cache(model.cfg, batch_size=2)
        parts = [model(tokens[:, :9], past_kv_cache=cache), model(tokens[:, 9:], past_kv_cache=cache)]
    torch.testing.assert_close(torch.cat(parts, dim=1), our_logits, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="state-space \\(Mamba-2\\) layers"):
        A.ablate_heads(model, tokens, [(0, 0)])
    dla = A.direct_logit_attribution(model, tokens, torch.tensor([5, 5]), torch.tensor([9, 9]))
    torch.testing.assert_close(dla.total, their_logits[:, -1, 5] - their_logits[:, -1, 9], atol=1e-4, rtol=0)
    assert set(dla.to_frame()["component"]) >= {"embed", "L0 mixer", "L2 mixer"}


def test_the_report_on_a_model_without_attention_says_what_it_leaves_out(tmp_path):
    directory = tokenized_checkpoint("mamba2", tmp_path / "mamba2")
    page = report_page(directory, tmp_path / "out")
    for what in ("attention patterns", "each head detector", "head ablation"):
        assert (f"Not run: {what} reads every layer&#x27;s attention heads, and layers [0, 1, 2] of this hybrid model "
                "are state-space (Mamba-2) layers") in page
    assert "blocks have none (attention or state-space mixers only)" in page
    assert not (tmp_path / "out" / "patterns.csv").exists()
    assert (tmp_path / "out" / "edges.csv").exists()  # (the circuit: every layer a mixer node)


def test_hook_shapes_predict_the_mixers_points(tmp_path):
    from family_checks import cache_of_everything

    build("mamba2", tmp_path)
    _, _, cache, predicted = cache_of_everything(tmp_path)
    assert {name: tuple(value.shape) for name, value in cache.items()} == {name: predicted[name] for name in cache}
    assert "blocks.2.mixer.hook_scan_out" in cache


@pytest.mark.parametrize("kind", ["granitemoehybrid", "mamba2"])
def test_the_state_space_model_on_the_device_is_transformers_there(kind, tmp_path, device_under_test):
    """On the GPU (the GPU list): a prompt longer than a chunk, and its greedy continuation through the state cache,
    against transformers' model on the same device (its chunked torch scan)."""
    hf = build(kind, tmp_path, **({"max_position_embeddings": 200} if kind == "granitemoehybrid" else {}))
    assert_on_the_device_as_transformers(hf, tmp_path, device_under_test, 150)


@pytest.mark.parametrize("kind", ["mamba2", "mamba"])
def test_compatibility_mode_on_mamba_models_is_the_bridges(kind, tmp_path):
    """The bridge leaves Mamba's and Mamba-2's block norms unfolded in compatibility mode (nothing of its weight
    processing reaches a mixer), folding only the final norm into the unembedding: probe says it skips fold_ln (all
    or none here), and every shared point but the final norm's output is the bridge's, the block norms' included."""
    model, ours, our_cache, theirs, their_cache = caches_in_compatibility_mode(tokenized_checkpoint(kind, tmp_path / kind),
                                                                               TOKENS)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    shared = [n for n in our_cache if n in their_cache and our_cache[n].shape == their_cache[n].shape
              and not n.startswith(("ln_final.", "unembed.hook_in"))]  # (the final norm, folded there)
    for name in shared:
        torch.testing.assert_close(our_cache[name], their_cache[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    assert "blocks.1.mixer.hook_in" in shared and model.cfg.normalization_type == "RMS"
