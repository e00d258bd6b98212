"""The hook points' fast paths: an unhooked point skips nn.Module's dispatch unless torch's own module hooks are
attached, and a cache stores what passes without the replacing-hook machinery, detached only where autograd is on."""
from __future__ import annotations

import threading

import torch

from probe.hooks import HookPoint
from probe.hooks.hook_point import Store


def test_torch_module_hooks_on_a_hook_point_still_run(tiny_model, tokens):
    """The fast path must not skip `register_forward_hook` / pre-hooks that a user (or baukit-style code) attaches."""
    point = tiny_model.hook_point("blocks.1.hook_resid_mid")
    seen, ours = {}, {}
    pre = point.register_forward_pre_hook(lambda module, args: seen.__setitem__("pre", args[0].clone()))
    post = point.register_forward_hook(lambda module, args, out: seen.__setitem__("post", out.clone()))
    try:
        with torch.no_grad():
            tiny_model.run_with_hooks(tokens, fwd_hooks=[(point.name, lambda x, hook: ours.__setitem__("x", x.clone()))])
    finally:
        pre.remove()
        post.remove()
    torch.testing.assert_close(seen["pre"], ours["x"], rtol=0, atol=0)
    torch.testing.assert_close(seen["post"], ours["x"], rtol=0, atol=0)


def test_an_unhooked_point_is_the_identity_and_a_hooked_one_still_replaces():
    point = HookPoint()
    x = torch.randn(2, 3)
    assert point(x) is x
    handle = point.add(lambda t, hook: t * 2)
    torch.testing.assert_close(point(x), x * 2)
    handle.remove()
    assert point(x) is x


def test_the_cache_equals_hooks_that_copy_every_activation(tiny_model, tokens):
    """run_with_cache's store (no device/dtype, no gradients) against plain hooks cloning what they see, with grad on:
    the stored tensors are detached (no graph kept), and equal."""
    names = tiny_model.select_hook_names(None)
    copies = {}
    with torch.no_grad():
        tiny_model.run_with_hooks(tokens, fwd_hooks=[(names, lambda x, hook: copies.__setitem__(hook.name, x.clone()))])
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            logits, cache = tiny_model.run_with_cache(tokens)
        assert logits.requires_grad == grad
        assert list(cache) == list(copies)
        for name, copy in copies.items():
            assert not cache[name].requires_grad and cache[name].grad_fn is None, name
            torch.testing.assert_close(cache[name], copy, rtol=0, atol=0, msg=name)


def test_a_store_sees_what_the_hooks_before_it_wrote():
    """A Store is an ordinary hook too: after a replacing hook it keeps the replacement, and it replaces nothing."""
    point = HookPoint()
    point.name = "p"
    kept = {}
    point.add(lambda t, hook: t + 1)
    point.add(Store(kept))
    x = torch.zeros(3)
    out = point(x)
    torch.testing.assert_close(out, torch.ones(3))
    torch.testing.assert_close(kept["p"], torch.ones(3))


def test_a_store_that_keeps_the_graph_gives_the_gradient_a_backward_hook_sees(tiny_model, tokens):
    """Store(detach=False) keeps the live tensor: the gradient taken with respect to it equals the one a backward hook
    at the same point receives (the hook machinery's own path, the oracle)."""
    name = "blocks.1.attn.hook_q"
    kept, seen = {}, {}
    with torch.enable_grad():
        with tiny_model.hooks([(name, Store(kept, detach=False))],
                              bwd_hooks=[(name, lambda g, hook: seen.__setitem__("grad", g.clone()))]):
            logits = tiny_model(tokens)
            assert kept[name].requires_grad and kept[name].grad_fn is not None
            # inside the block, so its backward hook sees this pass; autograd.grad leaves the shared model's .grad alone
            (grad,) = torch.autograd.grad(logits[:, -1, 3].sum(), [kept[name]])
    torch.testing.assert_close(grad, seen["grad"], rtol=1e-6, atol=1e-7)
    detached = {}
    with torch.enable_grad(), tiny_model.hooks([(name, Store(detached))]):
        tiny_model(tokens)
    assert not detached[name].requires_grad


def test_another_threads_cache_is_not_filled_by_this_threads_forward(tiny_model, tokens):
    """Scopes stay context-local: a cache open in a thread (blocked inside its forward) gets nothing from ours."""
    inside, release, result = threading.Event(), threading.Event(), {}

    def block(x, hook):
        inside.set()
        release.wait(10)

    def other():
        with torch.no_grad():
            result["out"] = tiny_model.run_with_cache(tokens[:1], fwd_hooks=[("blocks.0.hook_resid_pre", block)],
                                                      names=["blocks.1.hook_resid_post"])

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert inside.wait(10)
        with torch.no_grad():
            _, ours = tiny_model.run_with_cache(tokens, names=["blocks.0.hook_resid_post"])
    finally:
        release.set()
        thread.join(10)
    assert list(ours) == ["blocks.0.hook_resid_post"]
    theirs = result["out"][1]
    assert list(theirs) == ["blocks.1.hook_resid_post"] and theirs["blocks.1.hook_resid_post"].shape[0] == 1
