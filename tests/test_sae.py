"""Sparse autoencoders: the formulas by hand in float64, SAELens's files, and splicing into the model."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from probe import SAEConfig, SparseAutoencoder, spliced

D_SAE = 96
HOOK = "blocks.0.hook_resid_post"


def random_sae(architecture="standard", hook=HOOK, d_in=64, seed=0, **extra):
    cfg = SAEConfig(d_in=d_in, d_sae=D_SAE, hook_name=hook, architecture=architecture,
                    k=12 if architecture == "topk" else None, **extra)
    scales = {"W_enc": 0.3, "W_dec": 0.3, "b_enc": 0.2, "b_dec": 0.2, "threshold": 0.1}
    return randomised(SparseAutoencoder(cfg), seed, lambda name: scales[name], threshold=0.15)


def randomised(sae, seed, scale, threshold):
    """Every parameter drawn from scale(name) x N(0, 1) in name order (one seeded generator), thresholds offset by
    `threshold` so JumpReLU lets some features through."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sae.named_parameters():
            param.copy_(scale(name) * torch.randn(param.shape, generator=gen) + (threshold if name == "threshold" else 0.0))
    return sae


def by_hand(sae, x):
    """Features and reconstruction in float64, written out from the parameters."""
    W_enc, b_enc, W_dec, b_dec = (getattr(sae, n).double() for n in ("W_enc", "b_enc", "W_dec", "b_dec"))
    x = x.double()
    pre = (x - b_dec * sae.cfg.apply_b_dec_to_input) @ W_enc + b_enc
    if sae.cfg.architecture == "standard":
        features = pre.clamp(min=0)
    elif sae.cfg.architecture == "jumprelu":
        features = torch.where(pre > sae.threshold.double(), pre, torch.zeros_like(pre)).clamp(min=0)
    else:
        kth = pre.sort(dim=-1, descending=True).values[..., sae.cfg.k - 1: sae.cfg.k]
        features = torch.where(pre >= kth, pre, torch.zeros_like(pre)).clamp(min=0)
    return features, features @ W_dec + b_dec


@pytest.mark.parametrize("architecture", ["standard", "jumprelu", "topk"])
@pytest.mark.parametrize("apply_b_dec_to_input", [True, False])
def test_encode_and_decode_follow_the_formulas(architecture, apply_b_dec_to_input):
    sae = random_sae(architecture, apply_b_dec_to_input=apply_b_dec_to_input)
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1))
    features, reconstruction = by_hand(sae, x)
    with torch.no_grad():
        got = sae.encode(x)
        torch.testing.assert_close(got.double(), features, atol=1e-5, rtol=0)
        torch.testing.assert_close(sae.decode(got).double(), reconstruction, atol=1e-5, rtol=0)
        torch.testing.assert_close(sae(x).double(), reconstruction, atol=1e-5, rtol=0)
    active = (features > 0).sum(-1)
    if architecture == "topk":
        assert bool((active <= 12).all())
    assert 0 < float(active.float().mean()) < D_SAE  # sparse, and not dead: the test sees the activation function


def test_spliced_model_runs_on_the_reconstruction_and_caches_the_features(tiny_model, tokens):
    sae = random_sae()
    features_name = f"{HOOK}.hook_sae_acts_post"
    with torch.no_grad():
        original, cache = tiny_model.run_with_cache(tokens, names=HOOK)
        _, reconstruction = by_hand(sae, cache[HOOK])
        expected = tiny_model.run_with_hooks(tokens, fwd_hooks=[(HOOK, lambda x, hook: reconstruction.float())])
        with spliced(tiny_model, sae):
            logits, spliced_cache = tiny_model.run_with_cache(tokens, names=[features_name, f"{HOOK}.hook_sae_input"])
        after = tiny_model(tokens)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert not torch.allclose(logits, original, atol=1e-3)  # the reconstruction is not the activation
    torch.testing.assert_close(spliced_cache[f"{HOOK}.hook_sae_input"], cache[HOOK])
    torch.testing.assert_close(spliced_cache[features_name].double(), by_hand(sae, cache[HOOK])[0], atol=1e-5, rtol=0)
    # the block is over: the names are gone, the SAE's points have their own names back, the model is itself
    assert features_name not in tiny_model.hook_names and sae.hook_point("hook_sae_acts_post").name == "hook_sae_acts_post"
    assert torch.equal(after, original)


def test_error_term_keeps_the_model_and_an_edit_acts_through_the_decoder(tiny_model, tokens):
    """With the error term the model computes what it did without the SAE; zeroing feature j then moves the
    activation by exactly -f_j W_dec[j], as a hand-written hook on the plain model does."""
    sae = random_sae(seed=2)
    with torch.no_grad():
        original, cache = tiny_model.run_with_cache(tokens, names=HOOK)
        features, _ = by_hand(sae, cache[HOOK])
        j = int(features.reshape(-1, D_SAE).gt(0).sum(0).argmax())  # the feature active most often

        def zero_feature(f, hook):
            f = f.clone()
            f[..., j] = 0
            return f

        with spliced(tiny_model, sae, use_error_term=True):
            unchanged = tiny_model(tokens)
            edited = tiny_model.run_with_hooks(tokens, fwd_hooks=[(f"{HOOK}.hook_sae_acts_post", zero_feature)])
        shift = -features[..., j:j + 1] * sae.W_dec[j].double()
        expected = tiny_model.run_with_hooks(tokens, fwd_hooks=[(HOOK, lambda x, hook: (x.double() + shift).float())])
    torch.testing.assert_close(unchanged, original, atol=1e-5, rtol=0)
    torch.testing.assert_close(edited, expected, atol=1e-4, rtol=0)
    assert not torch.allclose(edited, original, atol=1e-3)


def test_feature_gradients_are_the_decoder_applied_to_the_activation_gradient(tiny_model, tokens):
    """d metric / d f = W_dec (d metric / d output): cached by name like any activation's gradient."""
    sae = random_sae(seed=3)
    names = [f"{HOOK}.hook_sae_acts_post", f"{HOOK}.hook_sae_output"]
    with spliced(tiny_model, sae, use_error_term=True):
        _, cache = tiny_model.run_with_cache(tokens, names=names, grads_of=lambda logits: logits[:, -1, 5].sum())
    expected = cache[f"{HOOK}.hook_sae_output_grad"] @ sae.W_dec.detach().T
    torch.testing.assert_close(cache[f"{HOOK}.hook_sae_acts_post_grad"], expected, atol=1e-5, rtol=0)
    assert float(expected.abs().max()) > 0


def test_an_sae_on_hook_z_reads_the_heads_flattened(tiny_model, tokens):
    hook = "blocks.1.attn.hook_z"
    sae = random_sae(hook=hook, d_in=64)  # 4 heads x 16
    with torch.no_grad():
        _, cache = tiny_model.run_with_cache(tokens, names=hook)
        _, reconstruction = by_hand(sae, cache[hook].flatten(-2))
        expected = tiny_model.run_with_hooks(tokens, fwd_hooks=[(hook, lambda z, h: reconstruction.float().view_as(z))])
        with spliced(tiny_model, sae):
            got = tiny_model(tokens)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_splicing_refuses_what_cannot_work_and_leaves_nothing_behind(tiny_model, tokens):
    with pytest.raises(KeyError, match="blocks.0.hook_resid_posst"):
        with spliced(tiny_model, random_sae(hook="blocks.0.hook_resid_posst")):
            pass
    with pytest.raises(ValueError, match="same hook point"):
        with spliced(tiny_model, [random_sae(), random_sae(seed=1)]):
            pass
    with pytest.raises(ValueError, match="reads 32 dimensions, but the activation at 'blocks.0.hook_resid_post' has 64"):
        with spliced(tiny_model, random_sae(d_in=32)):
            tiny_model(tokens)
    with pytest.raises(RuntimeError, match="boom"):
        with spliced(tiny_model, random_sae()):
            raise RuntimeError("boom")
    assert not any("hook_sae" in name for name in tiny_model.hook_names)
    assert not any(tiny_model.hook_point(name).active for name in tiny_model.hook_names)


def write_saelens(directory, cfg: dict, state: dict):
    directory.mkdir(parents=True)
    (directory / "cfg.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "sae_weights.safetensors"))
    return directory


def test_saelens_files_of_several_versions_load_and_round_trip(tmp_path):
    jump = random_sae("jumprelu", seed=4)
    state = {name: p.detach() for name, p in jump.named_parameters()}
    # SAELens 6: metadata nested under "meta"; Gemma Scope's jumprelu does not subtract b_dec first
    v6 = write_saelens(tmp_path / "v6", {"architecture": "jumprelu", "d_in": 64, "d_sae": D_SAE, "dtype": "float32",
                                          "apply_b_dec_to_input": False, "normalize_activations": "none",
                                          "meta": {"hook_name": HOOK, "model_name": "tiny"}}, state)
    loaded = SparseAutoencoder.from_pretrained(v6)
    assert loaded.cfg == SAEConfig(d_in=64, d_sae=D_SAE, hook_name=HOOK, architecture="jumprelu",
                                   apply_b_dec_to_input=False, model_name="tiny")
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode(x).double(), by_hand(loaded, x)[0], atol=1e-5, rtol=0)
    again = SparseAutoencoder.from_pretrained(loaded.save_pretrained(tmp_path / "saved"))
    assert again.cfg == loaded.cfg and all(torch.equal(a, b) for a, b in zip(again.parameters(), loaded.parameters()))
    with pytest.raises(FileExistsError):
        loaded.save_pretrained(tmp_path / "saved")
    # SAELens 3-5: hook_name at the top, topk spelled as an activation function with its k
    top = random_sae("topk", seed=6)
    v5 = write_saelens(tmp_path / "v5", {"d_in": 64, "d_sae": D_SAE, "hook_name": HOOK, "activation_fn_str": "topk",
                                          "activation_fn_kwargs": {"k": 12}, "apply_b_dec_to_input": True},
                       {name: p.detach() for name, p in top.named_parameters()})
    assert SparseAutoencoder.from_pretrained(v5).cfg.k == 12
    # SAELens before 3: hook_point; and a scaling_factor of ones, which some versions saved and ignore
    old = write_saelens(tmp_path / "v2", {"d_in": 64, "d_sae": D_SAE, "hook_point": HOOK, "hook_point_layer": 0},
                        {**{name: p.detach() for name, p in random_sae().named_parameters()},
                         "scaling_factor": torch.ones(D_SAE)})
    assert SparseAutoencoder.from_pretrained(old).cfg.hook_name == HOOK
    # a training checkpoint keeps log(threshold)
    log_state = {**state, "log_threshold": state["threshold"].clamp(min=1e-3).log()}
    del log_state["threshold"]
    logged = write_saelens(tmp_path / "log", {"architecture": "jumprelu", "d_in": 64, "d_sae": D_SAE, "hook_name": HOOK},
                           log_state)
    torch.testing.assert_close(SparseAutoencoder.from_pretrained(logged).threshold, state["threshold"].clamp(min=1e-3))


@pytest.mark.parametrize("breakage, match", [
    (lambda cfg, state: cfg.update(architecture="gated"), "architecture 'gated' is not supported"),
    (lambda cfg, state: cfg.pop("hook_name"), "names no hook_name"),
    (lambda cfg, state: cfg.update(normalize_activations="constant_norm_rescale"), "normalize_activations"),
    (lambda cfg, state: state.update(W_dec=torch.zeros(D_SAE, 63)), r"misshapen W_dec \(96, 63\)"),
    (lambda cfg, state: state.pop("b_enc"), "missing b_enc"),
    (lambda cfg, state: cfg.pop("d_sae"), "lacks the field 'd_sae'"),
    (lambda cfg, state: cfg.update(hook_head_index=0), "one head"),
    (lambda cfg, state: cfg.update(hook_point_head_index=3), "one head"),
    (lambda cfg, state: cfg.update(activation_fn_str="tanh-relu"), "activation 'tanh-relu' is not supported"),
    (lambda cfg, state: cfg.update(hook_name_out="blocks.0.hook_mlp_out", d_out=64), "transcoder"),
    (lambda cfg, state: state.update(scaling_factor=torch.full((D_SAE,), 2.0)), "scaling_factor other than 1"),
    (lambda cfg, state: cfg.update(architecture="topk"), "a topk SAE needs k"),
    (lambda cfg, state: cfg.update(rescale_acts_by_decoder_norm=True), "rescale_acts_by_decoder_norm"),
    (lambda cfg, state: state.update(extra=torch.zeros(3)), "unexpected extra"),
])
def test_broken_sae_files_get_clear_errors(tmp_path, breakage, match):
    sae = random_sae()
    cfg = {"architecture": "standard", "d_in": 64, "d_sae": D_SAE, "hook_name": HOOK}
    state = {name: p.detach() for name, p in sae.named_parameters()}
    breakage(cfg, state)
    with pytest.raises(ValueError, match=match):
        SparseAutoencoder.from_pretrained(write_saelens(tmp_path / "broken", cfg, state))
    with pytest.raises(FileNotFoundError, match="cfg.json"):
        SparseAutoencoder.from_pretrained(tmp_path / "nothing")


def test_a_bfloat16_sae_with_its_error_term_leaves_a_float32_model_exact(tiny_model, tokens):
    """The error x - reconstruction is taken in the wider dtype: rounding x to bfloat16 moved logits by ~1e-2."""
    sae = random_sae(seed=7).to(torch.bfloat16)
    with torch.no_grad():
        original = tiny_model(tokens)
        with spliced(tiny_model, sae, use_error_term=True):
            unchanged = tiny_model(tokens)
    torch.testing.assert_close(unchanged, original, atol=1e-5, rtol=0)


def test_a_copy_made_inside_the_block_does_not_keep_the_sae_names(tiny_model, tokens):
    import copy

    sae = random_sae()
    with spliced(tiny_model, sae):
        twin = copy.deepcopy(tiny_model)
    assert not any("hook_sae" in name for name in twin.hook_names)
    with spliced(twin, sae):  # the copy can splice it itself: no name is taken
        _, cache = twin.run_with_cache(tokens, names=f"{HOOK}.hook_sae_acts_post")
    assert cache[f"{HOOK}.hook_sae_acts_post"].shape == (3, 17, D_SAE)


def test_the_cache_estimate_counts_the_sae_points(tiny_model, tokens):
    from probe.hooks.root import CacheTooLargeError

    sae = random_sae()
    names = [f"{HOOK}.hook_sae_acts_pre", f"{HOOK}.hook_sae_acts_post", f"{HOOK}.hook_sae_input"]
    with spliced(tiny_model, sae):
        assert tiny_model.estimate_cache_bytes(names, None, tokens) == 3 * 17 * (D_SAE * 2 + 64) * 4
        with pytest.raises(CacheTooLargeError):
            tiny_model.run_with_cache(tokens, names=names, max_cache_bytes=1000)


def test_a_hook_z_sae_hands_its_error_and_output_back_with_the_heads(tiny_model, tokens):
    hook = "blocks.1.attn.hook_z"
    shapes = {}
    with spliced(tiny_model, random_sae(hook=hook, d_in=64), use_error_term=True):
        tiny_model.run_with_hooks(tokens, fwd_hooks=[(lambda n: n.startswith(hook + "."),
                                                      lambda x, h: shapes.__setitem__(h.name.rsplit(".", 1)[1], tuple(x.shape)))])
    assert shapes["hook_sae_error"] == shapes["hook_sae_output"] == (3, 17, 4, 16)
    assert shapes["hook_sae_recons"] == (3, 17, 64) and shapes["hook_sae_acts_post"] == (3, 17, D_SAE)


def test_a_config_that_is_not_json_and_a_second_splice_at_one_point_are_named(tiny_model, tmp_path):
    broken = write_saelens(tmp_path / "broken", {}, {name: p.detach() for name, p in random_sae().named_parameters()})
    (broken / "cfg.json").write_text("{not json")
    with pytest.raises(ValueError, match="cfg.json is not valid JSON"):
        SparseAutoencoder.from_pretrained(broken)
    with spliced(tiny_model, random_sae()):
        with pytest.raises(ValueError, match="hook point names already in use: blocks.0.hook_resid_post.hook_sae_input"):
            with spliced(tiny_model, random_sae(seed=1)):
                pass
        assert f"{HOOK}.hook_sae_input" in tiny_model.hook_names  # the outer splice is intact
    assert f"{HOOK}.hook_sae_input" not in tiny_model.hook_names


# ---- transcoders ---------------------------------------------------------------------------------
def random_transcoder(layer=1, skip=False, architecture="standard", seed=0):
    cfg = SAEConfig(d_in=64, d_sae=D_SAE, hook_name=f"blocks.{layer}.ln2.hook_normalized", architecture=architecture,
                    k=12 if architecture == "topk" else None, apply_b_dec_to_input=False,
                    hook_name_out=f"blocks.{layer}.hook_mlp_out", d_out=64, skip=skip)
    return randomised(SparseAutoencoder(cfg), seed, lambda name: 0.2, threshold=0.15)


@pytest.mark.parametrize("skip, architecture", [(False, "standard"), (True, "jumprelu"), (True, "topk")])
def test_a_spliced_transcoder_replaces_the_mlp_output_by_its_prediction(tiny_model, tokens, tmp_path, skip, architecture):
    sae = random_transcoder(skip=skip, architecture=architecture)
    read, written = sae.cfg.hook_name, sae.cfg.hook_name_out
    with torch.no_grad():
        original, cache = tiny_model.run_with_cache(tokens, names=[read, written])
        x = cache[read].double()
        features, _ = by_hand(sae, x)  # apply_b_dec_to_input=False: the formula reads x as it is
        prediction = features @ sae.W_dec.double() + sae.b_dec.double()
        if skip:
            prediction = prediction + x @ sae.W_skip.double().T
        expected = tiny_model.run_with_hooks(tokens, fwd_hooks=[(written, lambda a, hook: prediction.float())])
        with spliced(tiny_model, sae):
            logits, got = tiny_model.run_with_cache(tokens, names=[f"{written}.hook_sae_acts_post"])  # SAELens's name
        with spliced(tiny_model, sae, use_error_term=True):
            unchanged = tiny_model(tokens)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(got[f"{written}.hook_sae_acts_post"].double(), features, atol=1e-5, rtol=0)
    torch.testing.assert_close(unchanged, original, atol=1e-5, rtol=0)
    sae.save_pretrained(tmp_path / "tc")
    loaded = SparseAutoencoder.from_pretrained(tmp_path / "tc")
    assert loaded.cfg == sae.cfg and all(torch.equal(a, b) for a, b in zip(loaded.parameters(), sae.parameters()))
    assert json.loads((tmp_path / "tc" / "cfg.json").read_text())["architecture"] == \
        {"standard": "transcoder", "jumprelu": "jumprelu_skip_transcoder", "topk": "topk_skip_transcoder"}[architecture]


def test_transcoder_configs_that_cannot_work_are_named():
    with pytest.raises(ValueError, match="both hook_name_out and d_out"):
        SAEConfig(d_in=4, d_sae=8, hook_name="blocks.0.ln2.hook_normalized", hook_name_out="blocks.0.hook_mlp_out")
    with pytest.raises(ValueError, match="apply_b_dec_to_input=False"):
        SAEConfig(d_in=4, d_sae=8, hook_name="blocks.0.ln2.hook_normalized", hook_name_out="blocks.0.hook_mlp_out", d_out=4)
    with pytest.raises(ValueError, match="skip=True"):
        SAEConfig(d_in=4, d_sae=8, hook_name=HOOK, skip=True)
    with pytest.raises(ValueError, match="pass target"):
        random_transcoder()(torch.zeros(2, 64), use_error_term=True)
