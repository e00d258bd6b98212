"""The hook machinery: naming, strict lookup, scoped lifetimes, caching, replacement checks."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from probe.hooks import ActivationCache, HookedRootModule, HookPoint, UnknownNameError


class Toy(HookedRootModule):
    """Two affine steps with a hook point after each: small enough to compute expectations by hand."""

    def __init__(self):
        super().__init__()
        self.hook_in = HookPoint()
        self.inner = nn.Module()
        self.inner.hook_mid = HookPoint()
        self.hook_out = HookPoint()
        self.setup_hooks()

    def forward(self, x):
        x = self.hook_in(x)
        x = self.inner.hook_mid(2 * x)
        return self.hook_out(x + 1)


def attached(model) -> int:
    return sum(len(model.hook_point(n)._fns) for n in model.hook_names)


def test_names_follow_module_paths():
    assert Toy().hook_names == ["hook_in", "inner.hook_mid", "hook_out"]


def test_replacing_an_activation_changes_everything_downstream():
    toy = Toy()
    out = toy.run_with_hooks(torch.ones(2), fwd_hooks=[("inner.hook_mid", lambda x, hook: x * 10)])
    torch.testing.assert_close(out, torch.full((2,), 21.0))
    torch.testing.assert_close(toy(torch.ones(2)), torch.full((2,), 3.0))  # and only for that call
    assert attached(toy) == 0


def test_hook_receives_its_point_with_name():
    seen = []
    Toy().run_with_hooks(torch.ones(1), fwd_hooks=[(lambda n: True, lambda x, hook: seen.append(hook.name))])
    assert seen == ["hook_in", "inner.hook_mid", "hook_out"]


def test_unknown_name_raises_with_suggestions_and_attaches_nothing():
    toy = Toy()
    with pytest.raises(UnknownNameError, match="inner.hook_mid"):
        toy.run_with_hooks(torch.ones(1), fwd_hooks=[("hook_in", lambda x, h: None), ("inner.hook_mdi", lambda x, h: None)])
    assert attached(toy) == 0


def test_hooks_removed_when_forward_raises():
    toy = Toy()

    def boom(x, hook):
        raise RuntimeError("hook failed")

    with pytest.raises(RuntimeError, match="hook failed"):
        toy.run_with_hooks(torch.ones(1), fwd_hooks=[("hook_in", lambda x, h: x), ("hook_out", boom)])
    assert attached(toy) == 0
    with pytest.raises(RuntimeError):
        with toy.hooks([("hook_in", lambda x, h: x)]):
            raise RuntimeError("body failed")
    assert attached(toy) == 0


def test_nested_contexts_unwind_in_order():
    toy = Toy()
    with toy.hooks([("hook_in", lambda x, h: x + 1)]):
        with toy.hooks([("hook_out", lambda x, h: -x)]):
            assert toy(torch.zeros(1)).item() == -3.0
            assert attached(toy) == 2
        assert toy(torch.zeros(1)).item() == 3.0
        assert attached(toy) == 1
    assert attached(toy) == 0


def test_same_function_twice_is_attached_and_removed_twice():
    toy = Toy()
    double = lambda x, h: 2 * x  # noqa: E731
    with toy.hooks([("hook_in", double), ("hook_in", double)]):
        assert toy(torch.ones(1)).item() == 9.0
    assert attached(toy) == 0


def test_inner_block_reattaching_a_function_keeps_the_outer_order():
    toy = Toy()
    plus_one, double = (lambda x, h: x + 1), (lambda x, h: 2 * x)
    with toy.hooks([("hook_in", plus_one), ("hook_in", double)]):
        assert toy(torch.zeros(1)).item() == 5.0  # ((0 + 1) * 2) * 2 + 1
        with toy.hooks([("hook_in", plus_one)]):
            assert toy(torch.zeros(1)).item() == 7.0  # ((0 + 1) * 2 + 1) * 2 + 1
        # the inner block must detach its own attachment, not the outer one (which would run double first: 3)
        assert toy(torch.zeros(1)).item() == 5.0
    assert attached(toy) == 0


def test_wrong_shape_names_the_point_and_both_shapes():
    toy = Toy()
    with pytest.raises(ValueError, match=r"inner\.hook_mid.*\(3,\).*\(2,\)"):
        toy.run_with_hooks(torch.ones(2), fwd_hooks=[("inner.hook_mid", lambda x, h: torch.ones(3))])
    assert attached(toy) == 0


def test_non_tensor_return_is_an_error():
    with pytest.raises(TypeError, match="hook_in"):
        Toy().run_with_hooks(torch.ones(2), fwd_hooks=[("hook_in", lambda x, h: 3)])


def test_non_callable_hook_is_refused():
    with pytest.raises(TypeError, match="callable"):
        with Toy().hooks([("hook_in", "not a function")]):
            pass


def test_run_with_cache_filters_and_stores_detached():
    toy = Toy()
    x = torch.ones(2, requires_grad=True)
    out, cache = toy.run_with_cache(x, names=["inner.hook_mid"])
    assert list(cache) == ["inner.hook_mid"]
    torch.testing.assert_close(cache["inner.hook_mid"], torch.full((2,), 2.0))
    assert not cache["inner.hook_mid"].requires_grad
    assert out.requires_grad  # the output itself keeps its graph
    _, everything = toy.run_with_cache(x)
    assert list(everything) == toy.hook_names
    _, by_predicate = toy.run_with_cache(x, names=lambda n: n.startswith("hook_"))
    assert list(by_predicate) == ["hook_in", "hook_out"]
    assert attached(toy) == 0


def test_cache_shows_edits_made_by_fwd_hooks():
    _, cache = Toy().run_with_cache(torch.ones(1), names="hook_out", fwd_hooks=[("hook_in", lambda x, h: x * 0)])
    assert cache["hook_out"].item() == 1.0


def test_cache_dtype_and_device_options():
    x = torch.tensor([0.3, -1.7])
    _, cache = Toy().run_with_cache(x, dtype=torch.bfloat16, device="cpu")
    assert all(t.dtype == torch.bfloat16 for t in cache.values())
    # the values are the activations rounded once: x, 2x, 2x + 1
    for name, value in (("hook_in", x), ("inner.hook_mid", 2 * x), ("hook_out", 2 * x + 1)):
        assert torch.equal(cache[name], value.to(torch.bfloat16)), name
    stored = cache["hook_out"]
    assert cache.to(dtype=torch.float64) is cache  # in place, as transformer-lens's to(), and returned
    assert cache["hook_out"].dtype == torch.float64 and torch.equal(cache["hook_out"], stored.double())


def test_cache_is_read_only_and_reports_unknown_names():
    cache = ActivationCache({"a.hook_x": torch.zeros(1)})
    with pytest.raises(TypeError):
        cache["b"] = torch.zeros(1)  # type: ignore[index]
    with pytest.raises(KeyError, match="a.hook_x"):
        cache["a.hook_y"]


def test_cache_holds_no_reference_to_the_model():
    toy = Toy()
    _, cache = toy.run_with_cache(torch.ones(2))
    ref = weakref.ref(toy)
    del toy
    gc.collect()
    assert ref() is None
    assert len(cache) == 3


def test_opt_in_points_are_cached_only_when_named():
    class WithOptIn(HookedRootModule):
        def __init__(self):
            super().__init__()
            self.hook_cheap = HookPoint()
            self.hook_costly = HookPoint(opt_in=True)
            self.setup_hooks()

        def forward(self, x):
            x = self.hook_cheap(x)
            return self.hook_costly(x * 3) if self.hook_costly.active else x * 3

    model = WithOptIn()
    _, default = model.run_with_cache(torch.ones(1))
    assert list(default) == ["hook_cheap"]
    _, named = model.run_with_cache(torch.ones(1), names=["hook_costly"])
    assert named["hook_costly"].item() == 3.0


def test_nan_from_a_hook_is_an_error_but_minus_inf_is_allowed():
    toy = Toy()
    with pytest.raises(ValueError, match="inner.hook_mid.*NaN"):
        toy.run_with_hooks(torch.ones(2), fwd_hooks=[("inner.hook_mid", lambda x, h: x * float("nan"))])
    out = toy.run_with_hooks(torch.ones(2), fwd_hooks=[("inner.hook_mid", lambda x, h: x * float("-inf"))])
    assert torch.isinf(out).all()
    assert attached(toy) == 0


def test_an_exception_in_a_hook_keeps_its_type_and_names_the_point():
    def broken(x, hook):
        raise ZeroDivisionError("my bug")

    with pytest.raises(ZeroDivisionError, match="my bug") as info:
        Toy().run_with_hooks(torch.ones(1), fwd_hooks=[("inner.hook_mid", broken)])
    notes = getattr(info.value, "__notes__", [])
    import sys

    if sys.version_info >= (3, 11):
        assert any("inner.hook_mid" in note and "broken" in note for note in notes)


# ---- backward hooks and cached gradients (Toy: mid = 2 x, out = mid + 1; value = sum(out^2)) --------
def toy_value(out):
    return (out**2).sum()


def test_backward_hooks_see_the_gradient_at_their_point():
    toy, x = Toy(), torch.tensor([1.0, -2.0], requires_grad=True)
    seen = {}
    with toy.hooks(bwd_hooks=[(toy.hook_names, lambda grad, hook: seen.__setitem__(hook.name, grad.clone()))]):
        out = toy(x)
        toy_value(out).backward()
    out = (2 * x + 1).detach()  # by hand: d/d out = 2 out, d/d mid = 2 out, d/d in = 4 out
    assert torch.equal(seen["hook_out"], 2 * out) and torch.equal(seen["inner.hook_mid"], 2 * out)
    assert torch.equal(seen["hook_in"], 4 * out) and torch.equal(x.grad, 4 * out)


def test_a_backward_hook_can_replace_the_gradient_flowing_on():
    toy, x = Toy(), torch.tensor([1.0, -2.0], requires_grad=True)
    with toy.hooks(bwd_hooks=[("inner.hook_mid", lambda grad, hook: torch.ones_like(grad))]):
        toy_value(toy(x)).backward()
    assert torch.equal(x.grad, torch.tensor([2.0, 2.0]))  # the replaced gradient (1) times d mid / d x (2)
    with toy.hooks(bwd_hooks=[("inner.hook_mid", lambda grad, hook: grad[:1])]), pytest.raises(ValueError, match="gradient has shape"):
        toy_value(toy(torch.tensor([1.0, -2.0], requires_grad=True))).backward()
    # torch's backward-hook convention, a 1-tuple, as transformer-lens's backward hooks accept it: (g * 0,)
    x = torch.tensor([1.0, -2.0], requires_grad=True)
    with toy.hooks(bwd_hooks=[("inner.hook_mid", lambda grad, hook: (torch.ones_like(grad),))]):
        toy_value(toy(x)).backward()
    assert torch.equal(x.grad, torch.tensor([2.0, 2.0]))
    with toy.hooks(fwd_hooks=[("inner.hook_mid", lambda act, hook: (act,))]), pytest.raises(TypeError, match="returned tuple"):
        toy(torch.tensor([1.0]))  # a forward hook returns the activation itself


def test_backward_hooks_belong_to_the_graph_of_a_forward_made_inside_the_block():
    toy, calls = Toy(), []
    with toy.hooks(bwd_hooks=[("hook_out", lambda grad, hook: calls.append(hook.name))]):
        assert toy.hook_point("hook_out").active  # attached hooks make the point materialise its activation
        out = toy(torch.tensor([1.0], requires_grad=True))
    assert not toy.hook_point("hook_out").active  # the model keeps nothing after the block
    toy_value(out).backward()  # through the block's forward, after it: the hook runs (transformer-lens's way)
    assert calls == ["hook_out"]
    toy_value(toy(torch.tensor([1.0], requires_grad=True))).backward()  # a forward after the block: nothing
    assert calls == ["hook_out"]
    with pytest.raises(RuntimeError, match="inside"):
        with toy.hooks(bwd_hooks=[("hook_out", lambda grad, hook: None)]):
            raise RuntimeError("inside")
    assert not toy.hook_point("hook_out")._bwd_fns
    toy_value(toy.run_with_hooks(torch.ones(1, requires_grad=True), bwd_hooks=[
        ("hook_out", lambda grad, hook: calls.append("run_with_hooks"))])).backward()
    assert calls == ["hook_out", "run_with_hooks"] and not toy.hook_point("hook_out")._bwd_fns


def test_run_with_cache_caches_gradients_without_touching_parameters():
    toy = Toy()
    toy.scale = nn.Parameter(torch.tensor(3.0))  # a parameter the forward does not use must keep grad None
    x = torch.tensor([1.0, -2.0])  # no grad anywhere upstream: each cached point becomes a leaf
    out, cache = toy.run_with_cache(x, grads_of=toy_value)
    by_hand = 2 * (2 * x + 1)
    assert torch.equal(out, 2 * x + 1) and not out.requires_grad
    assert torch.equal(cache["hook_out_grad"], by_hand) and torch.equal(cache["inner.hook_mid_grad"], by_hand)
    assert torch.equal(cache["hook_in_grad"], 2 * by_hand)
    assert set(cache) == {n for name in toy.hook_names for n in (name, f"{name}_grad")}
    assert toy.scale.grad is None
    with pytest.raises(ValueError, match="scalar"):
        toy.run_with_cache(x, grads_of=lambda out: out)


class Chain(HookedRootModule):
    """The same tensor leaves hook_a and enters hook_b, as resid_post of block l enters block l+1."""

    def __init__(self):
        super().__init__()
        self.hook_a, self.hook_b = HookPoint(), HookPoint()
        self.setup_hooks()

    def forward(self, x):
        return (self.hook_b(self.hook_a(3 * x)) ** 2).sum()  # d/d b = d/d a = 2 * 3x; d/d x = 18 x


def test_backward_hooks_on_one_tensor_run_in_backward_order():
    chain, x = Chain(), torch.tensor([1.0, 2.0], requires_grad=True)
    seen, order = {}, []

    def record(grad, hook):
        order.append(hook.name)
        seen[hook.name] = grad.clone()

    with chain.hooks(bwd_hooks=[("hook_a", record), ("hook_b", record)]):
        chain(x).backward()
    assert order == ["hook_b", "hook_a"]  # the later point first, as the gradient flows
    assert torch.equal(seen["hook_a"], 6 * x.detach()) and torch.equal(seen["hook_b"], 6 * x.detach())
    # a replacement at the later point is what the earlier point (the same activation) sees
    x.grad = None
    with chain.hooks(bwd_hooks=[("hook_b", lambda grad, hook: torch.ones_like(grad)), ("hook_a", record)]):
        chain(x).backward()
    assert torch.equal(seen["hook_a"], torch.ones(2)) and torch.equal(x.grad, torch.full((2,), 3.0))


def test_a_gradient_replaced_at_resid_pre_is_what_the_previous_resid_post_sees(tiny_model, tokens):
    seen = {}
    bwd_hooks = [("blocks.1.hook_resid_pre", lambda grad, hook: torch.zeros_like(grad)),
                 ("blocks.0.hook_resid_post", lambda grad, hook: seen.__setitem__(hook.name, grad.clone()))]
    with tiny_model.hooks(bwd_hooks=bwd_hooks):
        logits = tiny_model(tokens)
        torch.autograd.grad(logits.float().log_softmax(-1)[:, :, 0].sum(), tiny_model.embed.W_E)
    grad = seen["blocks.0.hook_resid_post"]  # the same tensor as blocks.1.hook_resid_pre: zeroed
    assert torch.equal(grad, torch.zeros_like(grad))


def test_backward_hooks_leave_nothing_on_the_callers_tensor():
    class Passthrough(HookedRootModule):
        def __init__(self):
            super().__init__()
            self.hook_in = HookPoint()
            self.setup_hooks()

        def forward(self, x):
            return self.hook_in(x).sum()

    model, x = Passthrough(), torch.ones(2, requires_grad=True)
    for _ in range(3):
        with model.hooks(bwd_hooks=[("hook_in", lambda grad, hook: None)]):
            model(x)
    assert not x._backward_hooks


def test_a_copy_of_the_model_made_inside_a_block_keeps_no_hooks():
    import copy

    toy, calls = Toy(), []
    with toy.hooks([("hook_in", lambda x, h: calls.append(h.name) or x * 10)],
                   bwd_hooks=[("hook_out", lambda grad, hook: calls.append(hook.name))]):
        twin = copy.deepcopy(toy)
    x = torch.ones(1, requires_grad=True)
    toy_value(twin(x)).backward()
    assert calls == [] and attached(twin) == 0 and not twin.hook_point("hook_out").active
    assert twin(torch.ones(1)).item() == 3.0  # 2 * 1 + 1: the copy computes without the block's edit
    with twin.hooks([("hook_in", lambda x, h: x * 10)]):  # and can be hooked as usual
        assert twin(torch.ones(1)).item() == 21.0


def test_grads_of_mistakes_are_named():
    toy, x = Toy(), torch.tensor([1.0, -2.0])
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        toy.run_with_cache(x, grads_of=toy_value)
    with pytest.raises(ValueError, match="no autograd graph"):
        toy.run_with_cache(x, grads_of=lambda out: toy_value(out).detach())
    assert attached(toy) == 0
    out, cache = toy.run_with_cache(x, names=[], grads_of=toy_value)  # nothing cached: no gradients to take
    assert len(cache) == 0 and torch.equal(out, 2 * x + 1)


# ---- transformer-lens's persistent hooks: they stay until reset_hooks, and say so ------------------------
def test_add_hook_persists_until_reset_hooks_and_is_listed():
    toy, x = Toy(), torch.ones(3)
    double = lambda t, hook: t * 2  # noqa: E731
    toy.add_hook("inner.hook_mid", double)
    assert torch.equal(toy(x), torch.full((3,), 5.0)) and torch.equal(toy(x), torch.full((3,), 5.0))  # (2*1)*2 + 1
    assert toy.persistent_hooks() == [("inner.hook_mid", "fwd", double, False)]
    toy.reset_hooks()
    assert toy.persistent_hooks() == [] and attached(toy) == 0
    assert torch.equal(toy(x), torch.full((3,), 3.0))


def test_permanent_hooks_survive_reset_hooks_unless_asked():
    toy, x = Toy(), torch.ones(3)
    toy.add_hook(lambda name: name == "hook_out", lambda t, hook: t * 10, is_permanent=True)
    toy.add_hook("hook_in", lambda t, hook: t * 0)
    toy.reset_hooks()
    assert torch.equal(toy(x), torch.full((3,), 30.0))  # hook_in's removed, hook_out's kept
    toy.reset_hooks(including_permanent=True)
    assert attached(toy) == 0


def test_scoped_hooks_still_never_leak_and_reset_hooks_end_false_keeps_them_visibly():
    toy, x = Toy(), torch.ones(3)
    with pytest.raises(RuntimeError):
        with toy.hooks(fwd_hooks=[("hook_in", lambda t, hook: t + 1)], reset_hooks_end=False):
            raise RuntimeError("a failed block leaves nothing behind, whatever it was told")
    assert attached(toy) == 0
    toy.run_with_hooks(x, fwd_hooks=[("hook_in", lambda t, hook: t + 1)])
    assert attached(toy) == 0 and toy.persistent_hooks() == []
    toy.run_with_hooks(x, fwd_hooks=[("hook_in", lambda t, hook: t + 1)], reset_hooks_end=False)
    assert [entry[:2] for entry in toy.persistent_hooks()] == [("hook_in", "fwd")]
    assert torch.equal(toy(x), torch.full((3,), 5.0))  # 2 * (1 + 1) + 1
    toy.reset_hooks()
    assert attached(toy) == 0


def test_hook_point_add_hook_remove_hooks_layer_and_ctx():
    toy = Toy()
    point = toy.hook_point("hook_out")
    point.add_hook(lambda t, hook: hook.ctx.update(seen=t.clone()))
    point.add_hook(lambda g, hook: None, dir="bwd")
    toy(torch.ones(2))
    assert torch.equal(point.ctx["seen"], torch.full((2,), 3.0))
    point.remove_hooks("fwd")
    assert len(point._fns) == 0 and len(point._bwd_fns) == 1
    point.remove_hooks("both")
    assert point.handles == []
    toy.reset_hooks()
    assert point.ctx == {}
    with pytest.raises(ValueError, match="not inside a block"):
        point.layer()
    with pytest.raises(ValueError, match="'fwd' or 'bwd'"):
        point.add_hook(lambda t, hook: None, dir="forward")


def test_has_hooks_answers_as_transformer_lens_3_9_documents(tiny_model):
    # TL 3.9: any attached hook in the direction asked, permanent ones counted unless including_permanent=False
    point = tiny_model.hook_point("blocks.0.attn.hook_z")
    assert not point.has_hooks()
    point.add_perma_hook(lambda z, hook: None)
    assert point.has_hooks() and point.has_hooks("fwd") and not point.has_hooks("bwd")
    assert not point.has_hooks(including_permanent=False)
    with tiny_model.hooks(bwd_hooks=[("blocks.0.attn.hook_z", lambda g, hook: None)]):
        assert point.has_hooks("bwd") and point.has_hooks("both", including_permanent=False)
    assert not point.has_hooks("bwd")
    tiny_model.reset_hooks(including_permanent=True)
    assert not point.has_hooks()
    with pytest.raises(ValueError, match="'fwd', 'bwd' or 'both'"):
        point.has_hooks("forward")


def test_hook_layer_reads_the_block_index(tiny_model):
    layers = []
    tiny_model.run_with_hooks(torch.tensor([[1, 2, 3]]), fwd_hooks=[
        (lambda n: n.endswith("hook_z"), lambda z, hook: layers.append(hook.layer()))])
    assert layers == list(range(tiny_model.cfg.n_layers))


def test_transformer_lens_keywords_probe_lacks_name_the_equivalent(tiny_model):
    tokens = torch.tensor([[1, 2, 3]])
    with pytest.raises(TypeError, match=r"must be probe's KVCache \(probe.TransformerLensKeyValueCache.init_cache"):
        tiny_model(tokens, past_kv_cache=object())  # TL's cache object: its class is imported from probe instead
    with pytest.raises(TypeError, match=r"must be probe's KVCache"):
        tiny_model.input_to_embed(tokens, past_kv_cache=object())
    with pytest.raises(TypeError, match="unexpected keyword argument 'frobnicate'.*from_transformer_lens"):
        tiny_model(tokens, frobnicate=True)
    with pytest.raises(TypeError, match="pos_slice=.*run_with_cache's keyword"):
        tiny_model(tokens, pos_slice=-1)  # the forward's: run_with_cache takes it (tests/test_tl_idioms.py)
    with pytest.raises(ValueError, match="names= or names_filter="):
        tiny_model.run_with_cache(tokens, names="hook_embed", names_filter="hook_embed")
    with pytest.raises(ValueError, match="return_type='logit'"):
        tiny_model(tokens, return_type="logit")
    with pytest.raises(ValueError, match="batch of one prompt"):
        tiny_model.run_with_cache(torch.tensor([[1, 2], [3, 4]]), remove_batch_dim=True)


# ---- threads (issue 24, class 9): a scoped hook belongs to the thread that attached it -------------------------
def _in_thread(fn):
    import threading

    result, error = [], []
    thread = threading.Thread(target=lambda: _capture(fn, result, error))
    thread.start()
    return thread, result, error


def _capture(fn, result, error):
    try:
        result.append(fn())
    except BaseException as err:  # re-raised by the test in the main thread
        error.append(err)


def test_a_thread_running_the_model_does_not_see_another_threads_hooks():
    import threading

    model, x = Toy(), torch.tensor([1.0, 2.0])
    inside, done = threading.Event(), threading.Event()

    def slow_zero(act, hook):  # holds its forward open until the other thread's plain forward has run
        inside.set()
        assert done.wait(10), "the other thread never ran"
        return torch.zeros_like(act)

    def plain():
        assert inside.wait(10)
        try:
            return model(x), [model.hook_point(n).active for n in model.hook_names]
        finally:
            done.set()

    thread, result, error = _in_thread(plain)
    hooked = model.run_with_hooks(x, fwd_hooks=[("inner.hook_mid", slow_zero)])
    thread.join(10)
    assert not error, error
    seen, active = result[0]
    assert torch.equal(seen, 2 * x + 1)  # by hand: no hook ran in the plain thread's forward
    assert active == [False, False, False]  # nor did an opt-in point count as hooked there
    assert torch.equal(hooked, torch.ones(2))  # the hooked thread's own forward: zeros + 1
    assert attached(model) == 0


def test_two_threads_caching_at_once_each_get_their_own_activations():
    import threading

    model = Toy()
    both = threading.Barrier(2, timeout=10)

    def wait_for_the_other(act, hook):
        both.wait()  # both forwards are inside their hooked blocks at the same time
        return None

    def cache(value):
        _, c = model.run_with_cache(torch.full((3,), value), names="inner.hook_mid",
                                    fwd_hooks=[("hook_in", wait_for_the_other)])
        return c["inner.hook_mid"]

    thread, result, error = _in_thread(lambda: cache(5.0))
    mine = cache(1.0)
    thread.join(10)
    assert not error, error
    assert torch.equal(mine, torch.full((3,), 2.0)) and torch.equal(result[0], torch.full((3,), 10.0))
    assert attached(model) == 0


def test_a_persistent_hook_belongs_to_the_model_and_every_thread_sees_it():
    model, x = Toy(), torch.tensor([1.0, 2.0])
    model.add_hook("hook_out", lambda act, hook: act * 3)
    try:
        thread, result, error = _in_thread(lambda: model(x))
        thread.join(10)
        assert not error and torch.equal(result[0], 3 * (2 * x + 1))
    finally:
        model.reset_hooks()
    assert model.persistent_hooks() == []


def test_reset_hooks_end_false_keeps_the_hooks_of_a_block_that_runs_while_an_exception_is_handled():
    """A block (or run_with_hooks) that succeeds inside an `except` clause, where sys.exc_info() names the handled
    error, still keeps its hooks when told to: only an error leaving the block itself removes them."""
    toy, x = Toy(), torch.ones(3)
    plus_one = lambda t, hook: t + 1  # noqa: E731
    try:
        raise KeyError("handled by the caller, not raised in the block")
    except KeyError:
        with toy.hooks([("hook_in", plus_one)], reset_hooks_end=False):
            pass
        toy.run_with_hooks(x, fwd_hooks=[("hook_out", plus_one)], reset_hooks_end=False)
    assert [entry[:2] for entry in toy.persistent_hooks()] == [("hook_in", "fwd"), ("hook_out", "fwd")]
    assert torch.equal(toy(x), 2 * (x + 1) + 1 + 1)  # by hand: both kept hooks run
    toy.reset_hooks()
    assert attached(toy) == 0 and torch.equal(toy(x), 2 * x + 1)
    with pytest.raises(RuntimeError):  # and a block that fails still leaves nothing, inside an except clause too
        try:
            raise KeyError("handled")
        except KeyError:
            with toy.hooks([("hook_in", plus_one)], reset_hooks_end=False):
                raise RuntimeError("the block's own failure")
    assert attached(toy) == 0


def test_list_hooks_shows_what_is_attached_now_by_point_and_direction():
    """transformer-lens's list_hooks: scoped, persistent and permanent hooks, by point; the filters narrow it."""
    model = Toy()
    def f(x, hook):
        return x
    def g(grad, hook):
        return grad
    model.add_hook("hook_in", f)
    model.add_hook("inner.hook_mid", f, is_permanent=True)
    assert {name: [h.fn for h in hs] for name, hs in model.list_hooks().items()} == {"hook_in": [f], "inner.hook_mid": [f]}
    with model.hooks(fwd_hooks=[("hook_out", f)], bwd_hooks=[("hook_out", g)]):
        listed = model.list_hooks()
        assert [h.direction for h in listed["hook_out"]] == ["fwd", "bwd"]
        assert list(model.list_hooks(dir="bwd")) == ["hook_out"]
        assert list(model.list_hooks(lambda name: name.startswith("hook_"), dir="fwd")) == ["hook_in", "hook_out"]
        assert list(model.list_hooks(["inner.hook_mid"])) == ["inner.hook_mid"]
        assert "inner.hook_mid" not in model.list_hooks(including_permanent=False)
    assert "hook_out" not in model.list_hooks()  # the block's hooks went with it
    model.reset_hooks(including_permanent=True)
    assert model.list_hooks() == {}
    with pytest.raises(ValueError, match="dir must be"):
        model.list_hooks(dir="forward")
