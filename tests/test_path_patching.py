"""Path patching against the two-pass recipe written out with plain hooks (TransformerLens style)."""
from __future__ import annotations

import pytest
import torch

from probe.analyses import logit_diff_metric
from probe.analyses.path_patching import path_patch
from probe import HookedDecoder
from probe.names import act_name

from test_variants import build

from test_circuit import ANSWERS, COUNTERFACTUALS, prompts, sharp_model  # noqa: F401 (sharp_model: a fixture)


@torch.no_grad()
def two_pass(model, clean, corrupted, metric, sender, receiver):
    """sender (layer, head), or a list of them; receiver ("q" | "k" | "v", layer, head) with head a key/value head for k and v,
    ("mlp", layer) or ("logits",). Pass 1: every head and MLP frozen at its corrupted output except the sender's
    (clean) and the receiver's, the receiver's norm at its corrupted scale; record the receiver. Pass 2: the
    corrupted run with the recorded receiver patched in."""
    everything = lambda name: True  # noqa: E731
    _, clean_cache = model.run_with_cache(clean, names=everything)
    _, corr = model.run_with_cache(corrupted, names=everything)
    L = model.cfg.n_layers
    kind = receiver[0]
    senders = sender if isinstance(sender, list) else [sender]

    def heads(x, hook):
        layer = int(hook.name.split(".")[1])
        out = corr[hook.name].clone()
        for sender_layer, sender_head in senders:
            if layer == sender_layer:
                out[:, :, sender_head] = clean_cache[hook.name][:, :, sender_head]
        return out

    def frozen(x, hook):
        return corr[hook.name]

    hooks = [(act_name("result", l), heads) for l in range(L)]
    hooks += [(act_name("mlp_out", l), frozen) for l in range(L) if not (kind == "mlp" and l == receiver[1])]
    if kind in ("q", "k", "v"):
        hooks.append((act_name("scale", receiver[1], "ln1"), frozen))
    elif kind == "mlp":
        hooks.append((act_name("scale", receiver[1], "ln2"), frozen))
    else:
        hooks.append(("ln_final.hook_scale", frozen))
    seen = {}
    if kind != "logits":
        site = act_name(kind if kind != "mlp" else "mlp_out", receiver[1])
        hooks.append((site, lambda x, hook: seen.__setitem__("x", x)))
    logits = model.run_with_hooks(corrupted, fwd_hooks=hooks)
    mask = torch.ones_like(corrupted, dtype=torch.bool)
    if kind == "logits":
        return metric(logits, corrupted, mask)
    if kind == "mlp":
        patched = [(site, lambda x, hook: seen["x"])]
    else:
        def swap(x, hook):
            x = x.clone()
            x[:, :, receiver[2]] = seen["x"][:, :, receiver[2]]
            return x
        patched = [(site, swap)]
    return metric(model.run_with_hooks(corrupted, fwd_hooks=patched), corrupted, mask)


CASES = [((0, 1), ("q", 1, 2), "L1H2<q"), ((0, 3), ("k", 1, 0), "L1H0<k"), ((0, 2), ("v", 1, 3), "L1H3<v"),
         ((0, 1), ("mlp", 0), "L0 mlp"), ((1, 2), ("logits",), "logits"), ((0, 0), ("mlp", 1), "m1")]


@pytest.mark.parametrize("sender, receiver, name", CASES, ids=[c[2] for c in CASES])
def test_path_patching_matches_the_two_pass_recipe(sharp_model, sender, receiver, name):
    tiny_model = sharp_model
    clean, corrupted = prompts(tiny_model.cfg.d_vocab)
    metric = logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)
    result = path_patch(tiny_model, clean, corrupted, metric, senders=f"L{sender[0]}H{sender[1]}", receivers=name)
    expected = two_pass(tiny_model, clean, corrupted, metric, sender, receiver)
    torch.testing.assert_close(result.patched[0], expected, atol=1e-6, rtol=1e-5)
    assert float((result.patched[0] - result.corrupted).abs().max()) > 1e-5  # the path carries something


@pytest.mark.parametrize("kind", ["llama", "neox", "bloom"])  # grouped, parallel, ALiBi
def test_path_patching_grouped_and_parallel(kind, tmp_path):
    build(kind, tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    receivers = [(("k", 1, 1), "L1KV1<k" if kind == "llama" else "L1H1<k"), (("q", 1, 3), "L1H3<q"),
                 (("mlp", 1), "L1 mlp")]
    for receiver, name in receivers:
        result = path_patch(model, clean, corrupted, metric, senders="L0H2", receivers=name)
        torch.testing.assert_close(result.patched[0], two_pass(model, clean, corrupted, metric, (0, 2), receiver),
                                   atol=1e-6, rtol=1e-5)


def test_sweep_over_heads_matches_single_calls_and_draws(tiny_model):
    clean, corrupted = prompts(tiny_model.cfg.d_vocab)
    metric = logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)
    sweep = path_patch(tiny_model, clean, corrupted, metric, senders="heads", receivers="logits", sweep=True)
    assert len(sweep.senders) == 8
    one = path_patch(tiny_model, clean, corrupted, metric, senders="L1H3", receivers="logits")
    torch.testing.assert_close(sweep.patched[7], one.patched[0])
    frame = sweep.to_frame()
    assert {"senders", "receivers", "metric", "recovered", "change_ci_low", "p_value"} <= set(frame.columns)
    assert sweep.figure().data[0].type == "heatmap"
    both = path_patch(tiny_model, clean, corrupted, metric, senders=["L0H1", "embed"], receivers=["L1H0", "logits"])
    assert both.senders == [["L0H1", "embed"]] and both.receivers == ["L1H0<q", "L1H0<k", "L1H0<v", "logits"]
    both.figure()


def test_path_patching_refuses_impossible_paths(tiny_model):
    clean, corrupted = prompts(tiny_model.cfg.d_vocab)
    metric = logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)
    with pytest.raises(ValueError, match="writes before any of the receivers"):
        path_patch(tiny_model, clean, corrupted, metric, senders="L1H0", receivers="L0H1<q")
    with pytest.raises(ValueError, match="not a writer"):
        path_patch(tiny_model, clean, corrupted, metric, senders="L1H0<q", receivers="logits")


def test_sweep_over_heads_into_a_head_input_takes_the_heads_before_it(sharp_model):
    """senders="heads" into a layer-1 input: the layer-0 heads, each against the two-pass recipe; the layer-1 heads,
    which write after the receiver, are left out (blank in the figure) rather than failing the sweep."""
    model = sharp_model
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    sweep = path_patch(model, clean, corrupted, metric, senders="heads", receivers="L1H2<q", sweep=True)
    assert sweep.senders == [["L0H0"], ["L0H1"], ["L0H2"], ["L0H3"]]
    for head in range(4):
        expected = two_pass(model, clean, corrupted, metric, (0, head), ("q", 1, 2))
        torch.testing.assert_close(sweep.patched[head], expected, atol=1e-6, rtol=1e-5)
    grid = sweep.figure().data[0].z
    assert all(v == v for v in grid[0]) and all(v != v for v in grid[1])  # layer 1: NaN, no path
    with pytest.raises(ValueError, match="no head writes before"):
        path_patch(model, clean, corrupted, metric, senders="heads", receivers="L0H1<q", sweep=True)
    with pytest.raises(ValueError, match="sweep=True"):
        path_patch(model, clean, corrupted, metric, senders="heads", receivers="logits")


def test_a_tuple_of_names_is_several_nodes(sharp_model):
    """("L0H1", "L0H3") names two senders (only a pair of ints is one head, (layer, head)), in a plain call and as one
    set of a sweep; both against the two-pass recipe with the two heads patched together."""
    model = sharp_model
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    expected = two_pass(model, clean, corrupted, metric, [(0, 1), (0, 3)], ("q", 1, 2))
    result = path_patch(model, clean, corrupted, metric, senders=("L0H1", "L0H3"), receivers=("L1H2<q",))
    assert result.senders == [["L0H1", "L0H3"]] and result.receivers == ["L1H2<q"]
    torch.testing.assert_close(result.patched[0], expected, atol=1e-6, rtol=1e-5)
    sweep = path_patch(model, clean, corrupted, metric, senders=[("L0H1", "L0H3"), (0, 2)], receivers="L1H2<q", sweep=True)
    assert sweep.senders == [["L0H1", "L0H3"], ["L0H2"]]
    torch.testing.assert_close(sweep.patched[0], expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sweep.patched[1], two_pass(model, clean, corrupted, metric, (0, 2), ("q", 1, 2)),
                               atol=1e-6, rtol=1e-5)
