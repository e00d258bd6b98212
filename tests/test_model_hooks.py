"""Hook points of the decoder: names, shapes, identities between them, and the fast/explicit paths."""
from __future__ import annotations

import pytest
import torch
from einops import einsum

from probe.hooks import UnknownNameError


def expected_shapes(cfg, batch, pos):
    shapes = {"hook_embed": (batch, pos, cfg.d_model), "hook_pos_embed": (batch, pos, cfg.d_model),
              "ln_final.hook_scale": (batch, pos, 1), "ln_final.hook_normalized": (batch, pos, cfg.d_model)}
    for l in range(cfg.n_layers):
        b = f"blocks.{l}"
        for name in ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out", "hook_mlp_in"):
            shapes[f"{b}.{name}"] = (batch, pos, cfg.d_model)
        for name in ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input"):
            shapes[f"{b}.{name}"] = (batch, pos, cfg.n_heads, cfg.d_model)
        for ln in ("ln1", "ln2"):
            shapes[f"{b}.{ln}.hook_scale"] = (batch, pos, 1)
            shapes[f"{b}.{ln}.hook_normalized"] = (batch, pos, cfg.d_model)
        for name in ("hook_q", "hook_k", "hook_v", "hook_z"):
            shapes[f"{b}.attn.{name}"] = (batch, pos, cfg.n_heads, cfg.d_head)
        shapes[f"{b}.attn.hook_attn_scores"] = (batch, cfg.n_heads, pos, pos)
        shapes[f"{b}.attn.hook_pattern"] = (batch, cfg.n_heads, pos, pos)
        shapes[f"{b}.attn.hook_result"] = (batch, pos, cfg.n_heads, cfg.d_model)
        shapes[f"{b}.mlp.hook_pre"] = (batch, pos, cfg.d_mlp)
        shapes[f"{b}.mlp.hook_post"] = (batch, pos, cfg.d_mlp)
        # the norms' ends and each projection's own input: transformer-lens 4's bridge names them
        for end in (f"{b}.ln1.hook_in", f"{b}.ln1.hook_out", f"{b}.ln2.hook_in", f"{b}.ln2.hook_out",
                    f"{b}.attn.q.hook_in", f"{b}.attn.k.hook_in", f"{b}.attn.v.hook_in"):
            shapes[end] = (batch, pos, cfg.d_model)
    shapes["ln_final.hook_in"] = shapes["ln_final.hook_out"] = (batch, pos, cfg.d_model)
    shapes["embed.hook_in"] = shapes["pos_embed.hook_in"] = (batch, pos)  # token and position ids
    shapes["unembed.hook_in"] = (batch, pos, cfg.d_model)
    shapes["unembed.hook_out"] = (batch, pos, cfg.d_vocab)
    return shapes


def test_every_documented_hook_exists_with_its_shape(tiny_model, tokens):
    shapes = expected_shapes(tiny_model.cfg, *tokens.shape)
    assert sorted(tiny_model.hook_names) == sorted(shapes)
    with torch.no_grad():
        _, cache = tiny_model.run_with_cache(tokens, names=lambda n: True)
    # a predicate never selects the per-head inputs (they give each head its own norm): only their names do; nor the
    # points only transformer-lens 4's bridge names, unless the model names its hooks as the bridge does (the
    # unembedding's two, transformer-lens 3.9's too, are always there)
    per_head = {n: shapes.pop(n) for n in list(shapes) if n.endswith(("_input", "hook_attn_in"))}
    bridge_only = {n: shapes.pop(n) for n in list(shapes)
                   if n.endswith((".hook_in", ".hook_out")) and not n.startswith("unembed.")}
    assert {name: tuple(t.shape) for name, t in cache.items()} == shapes
    with torch.no_grad():
        _, cache = tiny_model.run_with_cache(tokens, names=list(per_head) + ["blocks.0.ln1.hook_scale"])
    assert {n: tuple(cache[n].shape) for n in per_head} == per_head
    assert cache["blocks.0.ln1.hook_scale"].shape == (*tokens.shape, tiny_model.cfg.n_heads, 1)  # as in TL
    try:
        tiny_model.bridge_names = True
        with torch.no_grad():
            _, cache = tiny_model.run_with_cache(tokens, names=lambda n: True)
    finally:
        tiny_model.bridge_names = False
    assert {n: tuple(cache[n].shape) for n in bridge_only} == bridge_only


def test_residual_identities(tiny_model, tokens):
    with torch.no_grad():
        _, cache = tiny_model.run_with_cache(tokens)
    torch.testing.assert_close(cache["blocks.0.hook_resid_pre"], cache["hook_embed"] + cache["hook_pos_embed"])
    for l in range(tiny_model.cfg.n_layers):
        b = f"blocks.{l}"
        torch.testing.assert_close(cache[f"{b}.hook_resid_mid"], cache[f"{b}.hook_resid_pre"] + cache[f"{b}.hook_attn_out"])
        torch.testing.assert_close(cache[f"{b}.hook_resid_post"], cache[f"{b}.hook_resid_mid"] + cache[f"{b}.hook_mlp_out"])


def test_default_cache_skips_per_head_results(tiny_model, tokens):
    _, cache = tiny_model.run_with_cache(tokens)
    assert not any(name.endswith("hook_result") for name in cache)


def test_head_results_sum_to_attention_output(tiny_model, tokens):
    attn = tiny_model.blocks[1].attn
    with torch.no_grad():
        _, cache = tiny_model.run_with_cache(tokens, names=["blocks.1.attn.hook_result", "blocks.1.attn.hook_z", "blocks.1.hook_attn_out"])
    result = cache["blocks.1.attn.hook_result"]
    torch.testing.assert_close(result.sum(dim=2) + attn.b_O, cache["blocks.1.hook_attn_out"], atol=1e-5, rtol=0)
    # head 0's write computed by hand from its z and its slice of the output projection
    d_head = tiny_model.cfg.d_head
    by_hand = cache["blocks.1.attn.hook_z"][:, :, 0] @ attn.out.weight[:, :d_head].T
    torch.testing.assert_close(result[:, :, 0], by_hand, atol=1e-5, rtol=0)


def test_pattern_is_causal_softmax_of_masked_scores(tiny_model, tokens):
    with torch.no_grad():
        _, cache = tiny_model.run_with_cache(tokens, names=["blocks.0.attn.hook_q", "blocks.0.attn.hook_k",
                                                            "blocks.0.attn.hook_attn_scores", "blocks.0.attn.hook_pattern"])
    q, k = cache["blocks.0.attn.hook_q"], cache["blocks.0.attn.hook_k"]
    scores = einsum(q, k, "batch query_pos head d_head, batch key_pos head d_head -> batch head query_pos key_pos")
    scores = scores / tiny_model.cfg.d_head**0.5
    n = tokens.shape[1]
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    stored = cache["blocks.0.attn.hook_attn_scores"]
    assert torch.isinf(stored[..., future]).all() and (stored[..., future] < 0).all()
    torch.testing.assert_close(stored[..., ~future], scores[..., ~future], atol=1e-5, rtol=0)
    pattern = cache["blocks.0.attn.hook_pattern"]
    torch.testing.assert_close(pattern, scores.masked_fill(future, float("-inf")).softmax(-1), atol=1e-6, rtol=0)
    assert (pattern[..., future] == 0).all()


def test_sdpa_path_equals_explicit_path(tiny_model, tokens):
    with torch.no_grad():
        fast = tiny_model(tokens)
        explicit, cache = tiny_model.run_with_cache(tokens, names=lambda n: n.endswith("hook_pattern"))
    assert len(cache) == tiny_model.cfg.n_layers
    torch.testing.assert_close(fast, explicit, atol=1e-5, rtol=0)


def test_scale_hook_path_equals_fused_layernorm(tiny_model, tokens):
    with torch.no_grad():
        fused = tiny_model(tokens)
        explicit, _ = tiny_model.run_with_cache(tokens, names=lambda n: n.endswith("hook_scale"))
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=0)


def test_hooks_that_only_read_a_norm_leave_every_later_number_bit_for_bit(tiny_model, tokens):
    # TL's Main_Demo asserts (torch.equal) that layer 0's pattern cached alone is the one in a cache of everything,
    # where every norm's scale is hooked too: reading a norm must not move the numbers after it, gradients on or off
    patterns = [f"blocks.{layer}.attn.hook_pattern" for layer in range(tiny_model.cfg.n_layers)]
    norms = [name for name in tiny_model.hook_names if name.endswith(("hook_scale", "hook_normalized"))]
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            _, everything = tiny_model.run_with_cache(tokens)
            _, alone = tiny_model.run_with_cache(tokens, names_filter=[patterns[0]], stop_at_layer=1)
            logits, plain = tiny_model.run_with_cache(tokens, names_filter=patterns)
            read, _ = tiny_model.run_with_cache(tokens, names_filter=patterns + norms)
        assert torch.equal(everything[patterns[0]], alone[patterns[0]])
        assert all(torch.equal(everything[name], plain[name]) for name in patterns)
        assert torch.equal(logits, read)


def test_a_norm_follows_hooks_that_edit_or_replace_its_scale_and_differentiates_through_them(tiny_model):
    ln = tiny_model.blocks[0].ln1
    x = torch.randn(2, 5, tiny_model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    w, b = ln.w.detach(), ln.b.detach()
    centred = x - x.mean(-1, keepdim=True)
    std = (centred.pow(2).mean(-1, keepdim=True) + ln.eps).sqrt()
    edits = {"scale, in place": ("hook_scale", lambda s, hook: s.mul_(2), centred / (2 * std) * w + b),
             "scale, replaced": ("hook_scale", lambda s, hook: s * 2, centred / (2 * std) * w + b),
             "normalized, in place": ("hook_normalized", lambda n, hook: n.add_(1), (centred / std + 1) * w + b)}
    for what, (point, edit, by_hand) in edits.items():
        # and under torch.inference_mode(), whose tensors keep no version counter to show an edit in place
        for mode in (torch.no_grad, torch.inference_mode):
            with mode(), tiny_model.hooks([(f"blocks.0.ln1.{point}", edit)]):
                torch.testing.assert_close(ln(x), by_hand, atol=1e-5, rtol=0, msg=lambda m: f"{what}, {mode}: {m}")
    # a hook that keeps the normalized input for its gradient gets d(loss)/d(normalized) = r * w, and the input's
    # gradient is the unhooked norm's
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    kept, inputs = {}, [x.clone().requires_grad_(), x.clone().requires_grad_()]
    (ln(inputs[0]) * r).sum().backward()
    def keep(normalized, hook):
        normalized.retain_grad()
        kept["n"] = normalized

    with tiny_model.hooks([("blocks.0.ln1.hook_normalized", keep)]):
        (ln(inputs[1]) * r).sum().backward()
    tiny_model.zero_grad(set_to_none=True)
    torch.testing.assert_close(kept["n"].grad, r * w, atol=1e-6, rtol=0)
    torch.testing.assert_close(inputs[1].grad, inputs[0].grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scale_hook_path_keeps_half_precision_norms_exact(tiny_dir, dtype):
    from probe import HookedDecoder

    model = HookedDecoder.from_pretrained(tiny_dir, dtype=dtype).eval()
    ln = model.blocks[0].ln1
    # residual entries of a few hundred, as trained GPT-2s have: their squares overflow float16
    x = (300 * torch.randn(2, 5, model.cfg.d_model, generator=torch.Generator().manual_seed(0))).to(dtype)
    x64, w, b = x.double(), ln.w.double(), ln.b.double()
    centred = x64 - x64.mean(-1, keepdim=True)
    std = (centred.pow(2).mean(-1, keepdim=True) + ln.eps).sqrt()
    by_hand = centred / std * w + b
    seen = {}
    with torch.no_grad(), model.hooks([("blocks.0.ln1.hook_scale", lambda s, hook: seen.setdefault("scale", s))]):
        hooked = ln(x)
    tol = 4 * torch.finfo(dtype).eps * by_hand.abs().max().item()
    torch.testing.assert_close(hooked.double(), by_hand, atol=tol, rtol=0)
    assert seen["scale"].dtype == dtype  # hooks see the model's dtype
    torch.testing.assert_close(seen["scale"].double(), std, atol=0, rtol=torch.finfo(dtype).eps)


def test_identity_hooks_everywhere_change_nothing(tiny_model, tokens):
    with torch.no_grad():
        plain = tiny_model(tokens)
        hooked = tiny_model.run_with_hooks(tokens, fwd_hooks=[(lambda n: True, lambda x, hook: x.clone())])
    torch.testing.assert_close(plain, hooked, atol=1e-5, rtol=0)


def test_patching_a_neuron_changes_only_downstream(tiny_model, tokens):
    def patch(post, hook):
        post = post.clone()
        post[:, :, 5] = 10.0
        return post

    with torch.no_grad():
        _, clean = tiny_model.run_with_cache(tokens)
        _, patched = tiny_model.run_with_cache(tokens, fwd_hooks=[("blocks.1.mlp.hook_post", patch)])
    torch.testing.assert_close(patched["blocks.1.hook_resid_mid"], clean["blocks.1.hook_resid_mid"])
    assert (patched["blocks.1.mlp.hook_post"][:, :, 5] == 10.0).all()
    assert not torch.allclose(patched["blocks.1.hook_resid_post"], clean["blocks.1.hook_resid_post"])


def test_unknown_hook_name_on_decoder(tiny_model, tokens):
    with pytest.raises(UnknownNameError, match="blocks.0.attn.hook_pattern"):
        tiny_model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_patern", lambda x, h: x)])
    with pytest.raises(UnknownNameError):
        tiny_model.run_with_cache(tokens, names=["blocks.9.hook_resid_pre"])


def test_no_hook_left_after_errors(tiny_model, tokens):
    def wrong_shape(x, hook):
        return x[:, :-1]

    with pytest.raises(ValueError, match="blocks.0.hook_resid_mid"):
        tiny_model.run_with_cache(tokens, fwd_hooks=[("blocks.0.hook_resid_mid", wrong_shape)])
    assert not any(tiny_model.hook_point(n).active for n in tiny_model.hook_names)


def test_gradients_flow_through_hooks(tiny_model, tokens):
    grads = {}

    def keep(x, hook):
        x.retain_grad()
        grads["resid"] = x

    logits = tiny_model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_pre", keep)])
    logits[:, -1].logsumexp(-1).sum().backward()
    assert grads["resid"].grad is not None and grads["resid"].grad.abs().sum() > 0
    tiny_model.zero_grad(set_to_none=True)


def test_start_and_stop_at_layer_compose_to_the_full_forward(tiny_model, tokens):
    with torch.no_grad():
        full, cache = tiny_model.run_with_cache(tokens, names="blocks.1.hook_resid_pre")
        resid = tiny_model(tokens, stop_at_layer=1)
        torch.testing.assert_close(resid, cache["blocks.1.hook_resid_pre"])
        torch.testing.assert_close(tiny_model(resid, start_at_layer=1), full, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="residual stream"):
        tiny_model(tokens, start_at_layer=1)
    with pytest.raises(ValueError, match="start_at_layer=7"):
        tiny_model(resid, start_at_layer=7)
    with torch.no_grad():  # negative counts from the end, as in a slice
        torch.testing.assert_close(tiny_model(tokens, stop_at_layer=-1), resid)
    for start, stop in ((0, 3), (0, -3), (2, 1)):  # past the last layer, before the first, before the start
        with pytest.raises(ValueError, match=f"stop_at_layer={stop} must be in"):
            tiny_model(tokens if start == 0 else resid, start_at_layer=start or None, stop_at_layer=stop)


def test_start_at_layer_takes_a_stored_residual_and_a_mask(tiny_model, tokens):
    from probe.kv_cache import KVCache

    mask = torch.ones_like(tokens)
    mask[1, -5:] = 0
    with torch.no_grad():
        full = tiny_model(tokens, attention_mask=mask)
        resid = tiny_model(tokens, attention_mask=mask, stop_at_layer=1)
        torch.testing.assert_close(tiny_model(resid, attention_mask=mask, start_at_layer=1), full, atol=1e-5, rtol=0)
        # a residual cached in bfloat16 is the float32 residual rounded once, nothing else
        _, cache = tiny_model.run_with_cache(tokens, attention_mask=mask, names="blocks.1.hook_resid_pre", dtype=torch.bfloat16)
        stored = cache["blocks.1.hook_resid_pre"]
        rounded = tiny_model(stored.float(), attention_mask=mask, start_at_layer=1)
        assert torch.equal(tiny_model(stored, attention_mask=mask, start_at_layer=1), rounded)
        one = tiny_model(resid[:1], attention_mask=mask[0], start_at_layer=1)  # a [pos] mask for one prompt
        torch.testing.assert_close(one, full[:1], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 5\).*\(3, 17\)"):
        tiny_model(resid, attention_mask=mask[:, :5], start_at_layer=1)
    with pytest.raises(ValueError, match="kv_cache needs a pass through every layer"):
        tiny_model(resid, start_at_layer=1, kv_cache=KVCache(tiny_model.cfg.n_layers))
    with pytest.raises(ValueError, match="kv_cache needs a pass through every layer"):
        tiny_model(tokens, stop_at_layer=1, kv_cache=KVCache(tiny_model.cfg.n_layers))


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_cache_estimate_is_exact_for_a_half_precision_model(norm, tokens):
    from probe import DecoderConfig, HookedDecoder

    cfg = DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=400, n_ctx=32, norm=norm)
    model = HookedDecoder(cfg).to(torch.bfloat16).eval()  # RMSNorm computes (and hooks) in float32, as Llama does
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names=lambda n: True)
    assert model.estimate_cache_bytes(list(cache), None, tokens) == sum(t.numel() * t.element_size() for t in cache.values())


def test_hook_shapes_predict_the_cache(tiny_model, tokens):
    from probe.shapes import hook_shapes

    with torch.no_grad():
        _, cache = tiny_model.run_with_cache(tokens, names=lambda n: True)
    predicted = hook_shapes(tiny_model.cfg, *tokens.shape)
    assert {n: tuple(t.shape) for n, t in cache.items()} == {n: s for n, s in predicted.items() if n in cache}
    assert set(predicted) - set(cache) == {n for n in predicted if n.endswith(("_input", "hook_attn_in"))
                                           or tiny_model.hook_point(n).bridge_only}
    try:
        tiny_model.bridge_names = True  # the bridge's own points too
        with torch.no_grad():
            _, cache = tiny_model.run_with_cache(tokens, names=lambda n: True)
    finally:
        tiny_model.bridge_names = False
    assert {n: tuple(cache[n].shape) for n in predicted if tiny_model.hook_point(n).bridge_only} == {
        n: s for n, s in predicted.items() if tiny_model.hook_point(n).bridge_only}
    per_head = hook_shapes(tiny_model.cfg, *tokens.shape, per_head_input_layers=[1])
    assert per_head["blocks.1.ln1.hook_scale"] == (*tokens.shape, tiny_model.cfg.n_heads, 1)
    assert per_head["blocks.0.ln1.hook_scale"] == (*tokens.shape, 1)
    estimate = tiny_model.estimate_cache_bytes(list(cache), None, tokens)  # the bridge's names too: each point once
    assert estimate == cache.nbytes == sum(t.numel() * t.element_size() for name, t in cache.items()
                                           if cache.own_name(name) == name)


def test_oversized_cache_is_refused_before_running(tiny_model, tokens):
    from probe.hooks import CacheTooLargeError

    ran = []
    with pytest.raises(CacheTooLargeError, match="names=.*bfloat16.*max_cache_bytes"):
        tiny_model.run_with_cache(tokens, max_cache_bytes=1000, fwd_hooks=[("hook_embed", lambda x, h: ran.append(1))])
    assert ran == [] and not any(tiny_model.hook_point(n).active for n in tiny_model.hook_names)
    _, small = tiny_model.run_with_cache(tokens, names="blocks.0.hook_resid_pre", max_cache_bytes=10**6)
    assert len(small) == 1


def test_cache_estimate_counts_the_keys_already_in_a_kv_cache(tiny_model, tokens):
    """With a KV cache, a pattern's key axis spans the cached positions too; the estimate must count them."""
    from probe.kv_cache import KVCache

    kv = KVCache(tiny_model.cfg.n_layers)
    names = ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_attn_scores", "blocks.0.hook_resid_pre"]
    with torch.no_grad():
        tiny_model(tokens[:, :-2], kv_cache=kv)
        estimate = tiny_model.estimate_cache_bytes(names, None, tokens[:, -2:], kv_cache=kv)
        _, cache = tiny_model.run_with_cache(tokens[:, -2:], kv_cache=kv, names=names)
    assert cache["blocks.0.attn.hook_pattern"].shape[-2:] == (2, tokens.shape[1])
    assert estimate == sum(t.numel() * t.element_size() for t in cache.values())


def test_gradients_match_transformers_autograd(tiny_model, tiny_hf, tokens):
    """Backward hooks and run_with_cache(grads_of=...) see d(log-prob of the next tokens) / d(activation)
    as transformers' own autograd computes it, for the residual stream and the attention pattern
    (a pattern hook also switches the decoder from the fused kernel to the explicit path)."""
    from hf_oracle import hf_gradients, next_token_logprob

    resid_grads, pattern_grads = hf_gradients(tiny_hf, tokens)
    names = [f"blocks.{l}.hook_resid_pre" for l in range(tiny_model.cfg.n_layers)]
    names += [f"blocks.{l}.attn.hook_pattern" for l in range(tiny_model.cfg.n_layers)]
    expected = dict(zip(names, resid_grads + pattern_grads))

    _, cache = tiny_model.run_with_cache(tokens, names=names, grads_of=lambda logits: next_token_logprob(logits, tokens))
    seen = {}
    with tiny_model.hooks(bwd_hooks=[(names, lambda grad, hook: seen.__setitem__(hook.name, grad.clone()))]):
        value = next_token_logprob(tiny_model(tokens), tokens)
        torch.autograd.grad(value, tiny_model.embed.W_E)  # a backward through every point; no .grad written
    for name, grad in expected.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(cache[f"{name}_grad"], grad, atol=1e-5 * scale, rtol=1e-4, msg=lambda s: f"{name}: {s}")
        torch.testing.assert_close(seen[name], grad, atol=1e-5 * scale, rtol=1e-4, msg=lambda s: f"{name}: {s}")
    assert all(p.grad is None for p in tiny_model.parameters())


@pytest.mark.parametrize("storage", [dict(dtype=torch.bfloat16), dict(device="cpu", dtype=torch.float16)])
def test_converted_cache_keeps_one_copy_of_a_tensor_seen_at_two_points(tiny_model, tokens, storage):
    """resid_post of block l is resid_pre of block l + 1: stored in another dtype, it is converted once."""
    _, plain = tiny_model.run_with_cache(tokens)
    _, cache = tiny_model.run_with_cache(tokens, **storage)
    post, pre = cache["blocks.0.hook_resid_post"], cache["blocks.1.hook_resid_pre"]
    assert post.data_ptr() == pre.data_ptr() and post.dtype == storage["dtype"]
    assert torch.equal(post, plain["blocks.0.hook_resid_post"].to(storage["dtype"]))
    q, k = cache["blocks.0.attn.hook_q"], cache["blocks.0.attn.hook_k"]
    assert q.data_ptr() != k.data_ptr()  # different tensors stay different


@pytest.mark.parametrize("frozen", [False, True])
def test_cached_gradient_of_mlp_in_is_the_mlps_share_as_transformers_autograd_has_it(tiny_model, tiny_hf, tokens, frozen):
    """hook_mlp_in is what the MLP reads (resid_mid's tensor, which the residual sum reads too): its cached gradient is
    d value / d (the MLP's input) alone, as a backward hook at the point sees it and as transformers' autograd gives
    through a node of its own in front of ln_2; hook_resid_mid's is the whole residual's. Frozen weights (each cached
    point a leaf) must agree too."""
    import copy

    from hf_oracle import next_token_logprob

    mlp_in, kept = {}, []
    for l, block in enumerate(tiny_hf.transformer.h):  # ln_2 reads the residual; the MLP path alone runs through it
        def own(mod, args, l=l):
            mlp_in[l] = args[0].view_as(args[0])
            return (mlp_in[l],)
        kept.append(block.ln_2.register_forward_pre_hook(own))
    try:
        out = tiny_hf(tokens, output_hidden_states=True)
    finally:
        for handle in kept:
            handle.remove()
    L = tiny_model.cfg.n_layers
    expected = torch.autograd.grad(next_token_logprob(out.logits, tokens), [mlp_in[l] for l in range(L)])
    model = copy.deepcopy(tiny_model).requires_grad_(False) if frozen else tiny_model
    names = [f"blocks.{l}.{kind}" for l in range(L) for kind in ("hook_resid_mid", "hook_mlp_in")]
    _, cache = model.run_with_cache(tokens, names=names, grads_of=lambda logits: next_token_logprob(logits, tokens))
    seen = {}
    with tiny_model.hooks(bwd_hooks=[(names, lambda grad, hook: seen.__setitem__(hook.name, grad.clone()))]):
        torch.autograd.grad(next_token_logprob(tiny_model(tokens), tokens), tiny_model.embed.W_E)
    for l in range(L):
        scale = float(expected[l].abs().max())
        for name in (f"blocks.{l}.hook_mlp_in", f"blocks.{l}.hook_resid_mid"):
            torch.testing.assert_close(cache[f"{name}_grad"], seen[name], atol=1e-5 * scale, rtol=1e-4, msg=name)
        torch.testing.assert_close(cache[f"blocks.{l}.hook_mlp_in_grad"], expected[l], atol=1e-5 * scale, rtol=1e-4)
    assert all(p.grad is None for p in tiny_model.parameters())


# where each family's MLP reads its input in transformers: a pre-hook there edits the MLP's input alone
MLP_INPUT_MODULE = {"gpt2": lambda hf, l: hf.transformer.h[l].ln_2, "neox": lambda hf, l: hf.gpt_neox.layers[l].post_attention_layernorm,
                    "gemma2": lambda hf, l: hf.model.layers[l].pre_feedforward_layernorm, "gpt1": lambda hf, l: hf.transformer.h[l].mlp}


@pytest.mark.parametrize("kind", sorted(MLP_INPUT_MODULE))
def test_an_in_place_edit_at_mlp_in_reaches_the_mlp_alone(kind, tiny_dir, tiny_hf, tmp_path):
    # transformer-lens hooks a copy at hook_mlp_in, and EAP-IG's circuit evaluation adds to it in place: the
    # residual stream that flows past the MLP must keep its value (pre-norm, parallel, sandwich and post-norm blocks)
    from probe import HookedDecoder
    from test_variants import build

    hf = tiny_hf if kind == "gpt2" else build(kind, tmp_path)
    ours = HookedDecoder.from_pretrained(tiny_dir if kind == "gpt2" else tmp_path).eval()
    tokens = torch.tensor([[5, 17, 3, 42, 8, 11]])
    delta = torch.linspace(-1, 1, ours.cfg.d_model) * 10.0  # not constant: a norm would remove a constant shift

    def edit_ours(activation, hook):
        activation[:, -2:] += delta  # in place, returning None

    def edit_theirs(module, args):
        x = args[0].clone()
        x[:, -2:] += delta
        return (x,)

    handle = MLP_INPUT_MODULE[kind](hf, 0).register_forward_pre_hook(edit_theirs)
    try:
        with torch.no_grad():
            expected = hf(tokens).logits
    finally:
        handle.remove()
    with torch.no_grad():
        got = ours.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_mlp_in", edit_ours)])
        assert (got - ours(tokens)).abs().max() > 1e-2  # the edit matters (GPT-1's random MLP answers weakly)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_hook_shapes_predict_the_cache_of_q_and_k_norms_over_all_heads(tmp_path):
    """OLMo 2's q and k norms see each position's heads flattened ([batch pos 1] scales), its write norms are
    ln1_post / ln2_post: every point a cache of everything holds has the predicted shape."""
    from probe import HookedDecoder
    from probe.shapes import hook_shapes
    from test_variants import build

    build("olmo2", tmp_path, num_key_value_heads=2)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names=lambda n: True)
    predicted = hook_shapes(model.cfg, *tokens.shape)
    assert {n: tuple(t.shape) for n, t in cache.items()} == {n: s for n, s in predicted.items() if n in cache}
    assert cache["blocks.0.attn.k_norm.hook_scale"].shape == (2, 7, 1) and "blocks.1.ln2_post.hook_scale" in cache
