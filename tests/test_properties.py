"""Property-based tests over random decoder configs and inputs (hypothesis).

The CI profile runs in well under a minute; `HYPOTHESIS_PROFILE=thorough pytest tests/test_properties.py`
runs many more examples by hand.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from probe import DecoderConfig, HookedDecoder, NormPlacement
from probe.checkpoints import family_for_config

settings.register_profile("ci", max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@st.composite
def configs(draw):
    n_kv_heads = draw(st.sampled_from([1, 2]))
    n_heads = n_kv_heads * draw(st.sampled_from([1, 2, 3]))
    d_head = draw(st.sampled_from([2, 4, 8]))
    gated = draw(st.booleans())
    heads_per_layer = None
    n_layers = draw(st.integers(1, 3))
    positions = draw(st.sampled_from(["learned", "sinusoidal", "rotary", "shortformer", "alibi"]))
    if n_kv_heads == n_heads and positions != "alibi" and draw(st.booleans()):  # ALiBi slopes follow head indices
        heads_per_layer = tuple(draw(st.integers(0, n_heads)) for _ in range(n_layers))
    window = draw(st.sampled_from([None, None, 1, 3]))
    placement = draw(st.sampled_from(["pre", "post", "parallel", "sandwich"]))
    attn_only = placement == "pre" and draw(st.booleans())  # attention-only blocks are pre-norm
    scale_embed = draw(st.booleans())
    experts = None if attn_only or not gated or not draw(st.booleans()) else \
        {"n": draw(st.integers(1, 4)), "per_token": 1} if draw(st.booleans()) else {"n": 3, "per_token": 2,
                                                                                    "renormalize": draw(st.booleans())}
    if experts is not None and draw(st.booleans()):  # GPT-OSS's: chosen by logit, a clamped GLU biting at 0.05
        experts = {**experts, "renormalize": False, "softmax_over": "chosen", "clamped_glu": {"alpha": 1.702, "limit": 0.05}}
    bidirectional = window is None and draw(st.booleans())  # a window counts back from the query: causal only
    rotary_dim = draw(st.sampled_from([None] + [r for r in (2, 4) if r <= d_head])) if positions == "rotary" else None
    # SmolLM3's layers without positions among the rotary ones
    rotary_layers = tuple(i % 2 == 0 for i in range(n_layers)) if positions == "rotary" and draw(st.booleans()) else None
    return DecoderConfig(
        n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head,
        d_model=draw(st.sampled_from([8, 12, 16])), d_mlp=draw(st.sampled_from([8, 20])),
        d_vocab=draw(st.integers(5, 40)), n_ctx=draw(st.integers(4, 24)),
        activation="silu" if gated else draw(st.sampled_from(["gelu_new", "gelu", "relu"])), gated_mlp=gated,
        norm=draw(st.sampled_from(["layer", "rms"])), norm_placement=placement, attn_only=attn_only,
        bidirectional=bidirectional,
        final_norm=draw(st.booleans()), positions=positions, rotary_dim=rotary_dim, rotary_layers=rotary_layers,
        qkv_bias=draw(st.booleans()), out_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()),
        tied_embeddings=draw(st.booleans()), heads_per_layer=heads_per_layer,
        sliding_window=window, sliding_layers=None if window is None or n_layers == 1 else draw(
            st.sampled_from([None, tuple(i % 2 == 0 for i in range(n_layers))])),
        scale_embed=scale_embed, embed_norm=not scale_embed and draw(st.booleans()), experts=experts, attn_scale_dim=draw(st.sampled_from([None, 3.0])),
        attn_softcap=draw(st.sampled_from([None, 2.0])), logit_softcap=draw(st.sampled_from([None, 5.0])),
        attn_sinks=draw(st.booleans()),
    )


@st.composite
def model_and_tokens(draw):
    cfg = draw(configs())
    torch.manual_seed(draw(st.integers(0, 2**16)))
    model = HookedDecoder(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases, so every parameter matters
        for name, p in model.named_parameters():
            if name.endswith((".w", ".b", "bias")):
                p.add_(0.1 * torch.randn_like(p))
    batch, pos = draw(st.integers(1, 3)), draw(st.integers(1, cfg.n_ctx))
    tokens = torch.randint(0, cfg.d_vocab, (batch, pos))
    return model, tokens


@given(model_and_tokens())
def test_forward_is_finite_and_paths_agree(case):
    model, tokens = case
    cfg = model.cfg
    with torch.no_grad():
        fast = model(tokens)
        cached, cache = model.run_with_cache(tokens, names=lambda n: True)
        identity = model.run_with_hooks(tokens, fwd_hooks=[(lambda n: True, lambda x, hook: x)])
    assert fast.shape == (*tokens.shape, cfg.d_vocab) and torch.isfinite(fast).all()
    torch.testing.assert_close(cached, fast, atol=1e-5, rtol=1e-5)  # explicit attention + cache == SDPA
    torch.testing.assert_close(identity, fast, atol=1e-5, rtol=1e-5)
    if cfg.attn_only:
        for l in range(cfg.n_layers):
            c = lambda n: cache[f"blocks.{l}.{n}"]  # noqa: E731
            torch.testing.assert_close(c("hook_resid_post"), c("hook_resid_pre") + c("hook_attn_out"), atol=1e-5, rtol=1e-5)
    elif cfg.norm_placement in (NormPlacement.PRE, NormPlacement.SANDWICH):
        for l in range(cfg.n_layers):
            c = lambda n: cache[f"blocks.{l}.{n}"]  # noqa: E731
            torch.testing.assert_close(c("hook_resid_mid"), c("hook_resid_pre") + c("hook_attn_out"), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(c("hook_resid_post"), c("hook_resid_mid") + c("hook_mlp_out"), atol=1e-5, rtol=1e-5)
    if cfg.norm_placement is NormPlacement.PARALLEL:  # both sublayers read resid_pre, and both write to it
        for l in range(cfg.n_layers):
            c = lambda n: cache[f"blocks.{l}.{n}"]  # noqa: E731
            torch.testing.assert_close(c("hook_resid_post"), c("hook_resid_pre") + c("hook_attn_out") + c("hook_mlp_out"),
                                       atol=1e-5, rtol=1e-5)
            block = model.blocks[l]
            if cfg.experts is None:  # (a mixture of experts' points hold only the rows routed to each expert)
                reads = (block.mlp.gate if cfg.gated_mlp else block.mlp.fc_in)(block.ln2(c("hook_resid_pre")))
                torch.testing.assert_close(c("mlp.hook_pre"), reads, atol=1e-5, rtol=1e-5)
            assert f"blocks.{l}.hook_resid_mid" not in model.hook_names
    assert not any(model.hook_point(n).active for n in model.hook_names)


@given(model_and_tokens(), st.data())
def test_padded_batch_matches_each_prompt_alone(case, data):
    model, tokens = case
    lengths = [data.draw(st.integers(1, tokens.shape[1])) for _ in range(tokens.shape[0])]
    left = data.draw(st.booleans())
    mask = torch.zeros_like(tokens)
    for i, n in enumerate(lengths):
        if left:
            mask[i, tokens.shape[1] - n:] = 1
        else:
            mask[i, :n] = 1
    with torch.no_grad():
        batched = model(tokens, attention_mask=mask)
        # the explicit attention path (taken whenever a pattern is hooked) masks padding on its own
        explicit, _ = model.run_with_cache(tokens, attention_mask=mask, names=lambda n: n.endswith("hook_pattern"))
        for i, n in enumerate(lengths):
            real = mask[i].bool()
            alone = model(tokens[i][real][None])
            torch.testing.assert_close(batched[i][real], alone[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(explicit[i][real], alone[0], atol=1e-5, rtol=1e-5)
    # padded positions are meaningless but finite, so a masked mean over positions is never NaN
    assert bool(torch.isfinite(batched).all()) and bool(torch.isfinite(explicit).all())


@given(model_and_tokens(), st.integers(0, 5))
def test_hooks_never_leak_through_errors(case, failing_at):
    model, tokens = case
    names = model.hook_names
    calls = []

    def sometimes_fails(x, hook):
        calls.append(hook.name)
        if len(calls) > failing_at:
            raise RuntimeError("boom")

    try:
        with model.hooks([(names[0], lambda x, h: x)]):
            with model.hooks([(lambda n: True, sometimes_fails)]):
                model(tokens)
    except RuntimeError:
        pass
    try:
        model.run_with_cache(tokens, names=[names[-1], "not.a.hook"])
    except KeyError:
        pass
    assert not any(model.hook_point(n).active for n in names)


@given(case=model_and_tokens())
def test_save_load_round_trip_is_bit_exact(case, tmp_path_factory):
    model, tokens = case
    try:
        family_for_config(model.cfg)
    except ValueError:
        with pytest.raises(ValueError, match="no Hugging Face checkpoint format"):
            model.save_pretrained(tmp_path_factory.mktemp("unsavable"))
        return
    again = HookedDecoder.from_pretrained(model.save_pretrained(tmp_path_factory.mktemp("saved") / "m")).eval()
    assert again.cfg == model.cfg
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        assert torch.equal(again(tokens), model(tokens))
