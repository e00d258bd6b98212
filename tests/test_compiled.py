"""Compiled forwards (probe.compiled): the same logits and cache as the eager model, and a clear refusal of hooks
they would not run. Compiled with torch.compile's "eager" backend (dynamo's tracing, which is where our code could go
wrong; inductor's code generation is torch's and takes minutes on a CPU): the benchmark's workload 23 runs inductor,
and CUDA graphs on a GPU."""
from __future__ import annotations

import pytest
import torch

from probe import DecoderConfig, HookedDecoder
from probe.compiled import compile_forwards


@pytest.fixture(scope="module")
def one_layer():
    """A one-layer random model: tracing time grows with the layers, and one layer has every kind of hook point."""
    torch.manual_seed(0)
    cfg = DecoderConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=40, n_ctx=16, d_mlp=32)
    model = HookedDecoder(cfg).eval()
    with torch.no_grad():  # norms away from (1, 0), so a lost affine step shows
        for name, param in model.named_parameters():
            if name.endswith((".w", ".b")):
                param.add_(torch.randn_like(param) * 0.3)
    return model


@pytest.fixture(scope="module")
def fast(one_layer):
    return compile_forwards(one_layer, backend="eager")


@pytest.fixture
def tokens():
    return torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
def test_compiled_forwards_equal_the_eager_forward_and_cache(fast, one_layer, tokens):
    """Against the eager model (itself held to transformers' forward in test_hf_equivalence): logits, and every cached
    name and value; a second call gets its own tensors."""
    with torch.no_grad():
        expected, eager = one_layer.run_with_cache(tokens)
        torch.testing.assert_close(fast(tokens), expected, rtol=0, atol=1e-5)
        logits, cache = fast.run_with_cache(tokens)
        again, cache_again = fast.run_with_cache((tokens + 1) % 40)
        _, eager_again = one_layer.run_with_cache((tokens + 1) % 40)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert list(cache) == list(eager) == list(cache_again) and len(cache) > 20
    for name in eager:
        torch.testing.assert_close(cache[name], eager[name], rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(cache_again[name], eager_again[name], rtol=0, atol=1e-5, msg=name)
    assert sum(len(one_layer.hook_point(n).handles) for n in one_layer.hook_names) == 0  # nothing left attached


def test_hooks_attached_to_the_model_are_refused_by_name(fast, one_layer, tokens):
    with one_layer.hooks([("blocks.0.hook_mlp_out", lambda x, hook: None)]):
        with pytest.raises(RuntimeError, match=r"blocks\.0\.hook_mlp_out.*eager model"):
            fast(tokens)
        with pytest.raises(RuntimeError, match=r"blocks\.0\.hook_mlp_out"):
            fast.run_with_cache(tokens)
    one_layer.add_hook("hook_embed", lambda x, hook: None)
    try:
        with pytest.raises(RuntimeError, match="hook_embed.*reset_hooks"):
            fast(tokens)
    finally:
        one_layer.reset_hooks()


def test_per_call_cache_choices_are_refused_and_names_checked_when_compiling(fast, one_layer, tokens):
    with pytest.raises(TypeError, match="names="):
        fast.run_with_cache(tokens, names=["hook_embed"])
    with pytest.raises(Exception, match="blocks.0.hook_resid_pree"):
        compile_forwards(one_layer, names=["blocks.0.hook_resid_pree"], backend="eager")


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_forwards_equal_eager_and_outlive_the_next_replay(one_layer, tokens):
    """mode="reduce-overhead": the outputs are copied out of the graph's memory, so a kept cache is not overwritten
    by the next call's replay."""
    import copy

    model = copy.deepcopy(one_layer).cuda()
    fast = compile_forwards(model, mode="reduce-overhead")
    tokens = tokens.cuda()
    with torch.no_grad():
        expected, eager = model.run_with_cache(tokens)
        for _ in range(3):  # CUDA graph trees record on a later call than the first
            logits = fast(tokens)
            _, cache = fast.run_with_cache(tokens)
        fast.run_with_cache((tokens + 1) % 40)
        fast((tokens + 1) % 40)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    for name in eager:
        torch.testing.assert_close(cache[name], eager[name], rtol=0, atol=1e-5, msg=name)
