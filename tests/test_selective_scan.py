"""Mamba-1 mixers (probe/selective_scan.py) and their checkpoints, Mamba and FalconMamba (probe/checkpoint_mamba1.py).
The logits and every residual of each case are compared with transformers in test_variants.py (CASES) with saving;
here: the chunked scan against transformers' own and against the recurrence by definition, the mixer against
transformers' mixer module on the same weights strengthened so the recurrence shows, generation through the state
cache, padding, processing, TL 4's bridge hook by hook and by its names, hook shapes, the ledger and the report."""
from __future__ import annotations

import pytest
import torch

from probe import DecoderConfig, HookedDecoder
from probe.selective_scan import selective_scan, selective_scan_stepwise
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, cache_of_everything, left_padded_logits, report_page)
from test_family_defaults import tokenized_checkpoint
from test_variants import build

KINDS = ["mamba", "falcon_mamba"]
TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))


def strengthened(hf, directory):
    """The mixers' projections scaled up, so B . C and the decay shape the output rather than the D skip alone
    (random small weights leave the recurrence's share near nothing); saved to `directory`."""
    with torch.no_grad():
        for layer in hf.backbone.layers:
            layer.mixer.in_proj.weight.mul_(2)
            layer.mixer.x_proj.weight.mul_(2)
    hf.save_pretrained(directory)
    return hf


@pytest.mark.parametrize("n", [1, 7, 16, 45])
def test_the_chunked_scan_is_transformers_and_the_definition(n):
    """probe's chunked scan against transformers' torch scan (mamba_selective_scan, from a zero state as it starts)
    and against the recurrence one position at a time, from a carried state."""
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    g = torch.Generator().manual_seed(n)
    x, dt = torch.randn(2, n, 12, generator=g), torch.rand(2, n, 12, generator=g)
    A = -torch.rand(12, 5, generator=g) * 2 - 0.05
    B, C = torch.randn(2, n, 5, generator=g), torch.randn(2, n, 5, generator=g)
    zero, state = torch.zeros(2, 12, 5), torch.randn(2, 12, 5, generator=g)
    theirs, their_final = mamba_selective_scan(x.mT, dt.mT, A, B.mT, C.mT, return_last_state=True,
                                               use_associative_scan=False)
    ours, final = selective_scan(x, dt, A, B, C, zero)
    torch.testing.assert_close(ours, theirs.mT, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, their_final, atol=1e-5, rtol=1e-5)
    ours, final = selective_scan(x, dt, A, B, C, state)
    stepwise, final_stepwise = selective_scan_stepwise(x, dt, A, B, C, state)
    torch.testing.assert_close(ours, stepwise, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, final_stepwise, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_a_strong_recurrence_is_transformers_mixer_by_mixer(kind, tmp_path):
    """Each mixer against transformers' mixer module on the same (strengthened) weights and input, the whole model's
    logits and residuals against transformers', and the state's read a real share of y."""
    hf = strengthened(build(kind, tmp_path / "src", use_bias=True), tmp_path / "strong")
    model = HookedDecoder.from_pretrained(tmp_path / "strong").eval()
    tokens = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(tokens, output_hidden_states=True)
        ours, cache = model.run_with_cache(tokens)
        for layer in range(3):
            normed = model.blocks[layer].ln1(cache[f"blocks.{layer}.hook_resid_pre"])
            torch.testing.assert_close(model.blocks[layer].mixer(normed), hf.backbone.layers[layer].mixer(normed),
                                       atol=1e-5, rtol=0)
    torch.testing.assert_close(ours, theirs.logits, atol=1e-4, rtol=0)
    for layer in range(3):  # (transformers lists each block's output)
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_resid_post"], theirs.hidden_states[layer], atol=1e-4,
                                   rtol=0)
    skip_only = model.blocks[0].mixer.D * cache["blocks.0.mixer.hook_conv"]
    recurrence = cache["blocks.0.mixer.hook_scan_out"] - skip_only
    assert recurrence.abs().mean() > 0.5 * skip_only.abs().mean()  # the state's read is a real share of y


@pytest.mark.parametrize("kind", KINDS)
def test_generation_and_processing_are_transformers(kind, tmp_path):
    hf = build(kind, tmp_path)
    with pytest.warns(UserWarning, match="center_writing_weights"):
        assert_generation_and_processing_match(hf, tmp_path)


@pytest.mark.parametrize("kind", KINDS)
def test_a_cached_prefix_then_its_continuation_is_one_forward(kind, tmp_path):
    """The cache carries each layer's convolution window and state: a prompt, then two tokens, then one, give the
    whole sequence's logits; a frozen cache reads the prefix and keeps nothing more."""
    strengthened(build(kind, tmp_path / "src"), tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, prefix = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.length == 13 and cache.layers[0].k is None and cache.layers[0].state.shape == (2, 64, 8)
    assert prefix.length == 10 and prefix.layers[0].seen == 10


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
def test_left_padding_writes_nothing_into_the_state_or_the_convolution(kind, bias, tmp_path):
    """A left-padded prompt's logits at its real positions are transformers' on the same padded batch (which zeroes
    the mixer's input and its convolved channels at padding, as probe does), and without in_proj's bias (which
    transformers lets into the convolution's window from padding) those of the prompt alone, and generation from it
    through the cache is transformers'."""
    hf = strengthened(build(kind, tmp_path / "src", use_bias=bias), tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    padded, alone, theirs = left_padded_logits(model, hf)
    torch.testing.assert_close(padded[:, 4:], theirs[:, 4:], atol=1e-4, rtol=0)
    if not bias:
        torch.testing.assert_close(padded[1, 4:], alone[0], atol=1e-5, rtol=0)
        assert_left_padded_generation_matches(hf, tmp_path)


@pytest.mark.parametrize("kind", KINDS)
def test_every_shared_hook_and_bridge_name_matches_the_bridge(kind, tmp_path):
    """TL 4's bridge (its SSMMixerBridge under `mixer`) hook by hook, its own names for the mixer's points and the
    block's norm (`blocks.L.norm.*`, probe's ln1); the names probe has not say what to use instead."""
    from transformer_lens.model_bridge import TransformerBridge

    from probe.hooks import UnknownNameError

    directory = tokenized_checkpoint(kind, tmp_path / kind)
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(str(directory)).eval()
    tokens = TOKENS % model.cfg.d_vocab
    names = [f"blocks.1.{n}" for n in ("norm.hook_out", "hook_mixer_in", "hook_mixer_out", "mixer.hook_in_proj",
                                       "mixer.x_proj.hook_in", "mixer.x_proj.hook_out", "mixer.out_proj.hook_in",
                                       "mixer.hook_ssm_out", "hook_in", "hook_out")]
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
    assert {"blocks.0.mixer.hook_in_proj", "blocks.0.mixer.hook_x_proj"} <= set(shared)
    assert not any("resid_mid" in n or "mlp" in n for n in ours)
    for name, match in (("blocks.0.mixer.dt_proj.hook_out", "blocks.0.mixer.hook_dt"),
                        ("blocks.0.mixer.hook_ssm_state", "does not keep the state at every position"),
                        ("blocks.0.mixer.conv1d.hook_out", "blocks.0.mixer.hook_conv")):
        with pytest.raises(UnknownNameError, match=match):
            model.run_with_cache(tokens, names=[name])


@pytest.mark.parametrize("kind", KINDS)
def test_hook_shapes_and_the_ledger(kind, tmp_path):
    build(kind, tmp_path / "a")
    build(kind, tmp_path / "b", use_bias=True, use_conv_bias=False, tie_word_embeddings=False)
    for directory in (tmp_path / "a", tmp_path / "b"):
        model, _, cache, shapes = cache_of_everything(directory)
        assert {n: tuple(t.shape) for n, t in cache.items()} == {n: shapes[n] for n in cache}
        assert {n for n in cache if ".mixer." in n} == {n for n in shapes if ".mixer." in n}
        assert "blocks.0.mixer.hook_dt" in shapes and cache["blocks.0.mixer.hook_dt"].dtype == torch.float32
        assert model.ledger().total_params == sum(p.numel() for p in model.parameters())
        assert model.ledger().kv_bytes_per_token == 0


def test_config_errors_name_the_fix():
    base = dict(n_layers=2, d_model=32, n_heads=1, d_vocab=50, n_ctx=16, positions="rotary", norm="rms",
                attn_only=True)
    space = dict(layers=(True, True), n_heads=64, d_head=1, d_state=8, kind="mamba1", dt_rank=4)
    assert DecoderConfig(**base, state_space=space).state_space.d_inner == 64
    for bad, match in ((dict(space, kind="mamba3"), "give 'mamba2'"), (dict(space, dt_rank=0), "dt_rank must be"),
                       (dict(space, d_head=2), "set n_heads to the mixer's d_inner"),
                       (dict(space, dt_max=1.0), "no step limits"), (dict(space, bcdt_norm_eps=0), "bcdt_norm_eps"),
                       (dict(space, kind="mamba2"), "set kind='mamba1'")):
        with pytest.raises(ValueError, match=match):
            DecoderConfig(**base, state_space=bad)


def test_the_report_says_what_it_leaves_out_and_a_mamba2_format_refuses(tmp_path):
    from probe.checkpoint_mamba import mamba2_config_to_hf

    directory = tokenized_checkpoint("falcon_mamba", tmp_path / "falcon_mamba")
    page = report_page(directory, tmp_path / "out")
    for what in ("attention patterns", "each head detector", "head ablation"):
        assert (f"Not run: {what} reads every layer&#x27;s attention heads, and layers [0, 1, 2] of this hybrid model "
                "are state-space") in page
    assert not (tmp_path / "out" / "patterns.csv").exists()
    model = HookedDecoder.from_pretrained(directory)
    with pytest.raises(ValueError, match="Mamba-1's format: mamba or falcon_mamba"):
        mamba2_config_to_hf(model.cfg, None)


@pytest.mark.parametrize("kind", KINDS)
def test_saving_writes_every_setting_transformers_reads(kind, tmp_path):
    """Settings off transformers' defaults (the norms' eps, the step's rank, the kernel, biases, an untied head) survive
    probe's save into transformers."""
    extra = {"mixer_rms_eps": 1e-2} if kind == "falcon_mamba" else {}
    hf = strengthened(build(kind, tmp_path / "src", use_bias=True, use_conv_bias=False, time_step_rank=5,
                            conv_kernel=3, state_size=6, tie_word_embeddings=False, layer_norm_epsilon=1e-3,
                            **extra), tmp_path / "strong")
    out = HookedDecoder.from_pretrained(tmp_path / "strong").save_pretrained(tmp_path / "saved")
    again = type(hf).from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, hf(TOKENS).logits, atol=1e-5, rtol=0)
