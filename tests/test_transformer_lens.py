"""probe against transformer-lens (TransformerBridge on the same local checkpoint), hook by hook."""
from __future__ import annotations

import pytest
import torch

from probe import HookedDecoder

from conftest import build_hf_checkpoint

CONFIGS = {
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, n_positions=48),
    "wide-heads": dict(n_layer=3, n_embd=96, n_head=3, n_positions=40),
    "relu-odd-mlp": dict(n_layer=2, n_embd=40, n_head=5, n_positions=24, activation_function="relu", n_inner=72),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_shared_hook_matches_transformer_lens(name, tmp_path):
    from transformer_lens.model_bridge import TransformerBridge

    directory = build_hf_checkpoint(tmp_path, seed=3, **CONFIGS[name])
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    ours = HookedDecoder.from_pretrained(directory).eval()
    tokens = torch.randint(0, ours.cfg.d_vocab, (2, ours.cfg.n_ctx), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, cache = ours.run_with_cache(tokens)
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)

    shared = [n for n in cache if n in theirs]
    assert set(cache) - set(shared) == set(), f"hooks transformer-lens lacks: {set(cache) - set(shared)}"
    allowed = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).tril()
    for hook in shared:
        a, b = cache[hook], theirs[hook]
        assert a.shape == b.shape, hook
        if hook.endswith("hook_attn_scores"):  # masked entries differ by convention (-inf here, finfo.min there)
            a, b = a[..., allowed], b[..., allowed]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m: f"{hook}: {m}")


def test_gpt_neox_hooks_match_transformer_lens(tmp_path):
    """Pythia's layout (parallel blocks, partial rotary, q/k/v interleaved per head) through TL's own loader:
    every hook both have agrees, and neither has a residual between attention and MLP."""
    from transformer_lens.model_bridge import TransformerBridge

    from test_variants import build

    build("neox", tmp_path)
    bridge = TransformerBridge.boot_transformers(str(tmp_path), device="cpu")
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, ours.cfg.d_vocab, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, cache = ours.run_with_cache(tokens)
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    # TL's bridge has no hook after the rotation for this family; everything else of ours it has
    assert {n for n in cache if n not in theirs} == {f"blocks.{l}.attn.hook_rot_{p}" for l in range(2) for p in "qk"}
    assert not any("resid_mid" in n for n in theirs)
    allowed = torch.ones(20, 20, dtype=torch.bool).tril()
    for hook in (n for n in cache if n in theirs):
        a, b = cache[hook], theirs[hook]
        if hook.endswith("hook_attn_scores"):
            a, b = a[..., allowed], b[..., allowed]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m: f"{hook}: {m}")


def test_gemma2_hooks_match_transformer_lens(tmp_path):
    """Gemma 2 through TL's own loader: scaled embeddings, (1 + w) norms, the write norms ln1_post / ln2_post,
    capped scores and logits, a window on every other layer: every hook of ours TL has, and they agree."""
    from transformer_lens.model_bridge import TransformerBridge

    from test_variants import build

    build("gemma2", tmp_path)
    bridge = TransformerBridge.boot_transformers(str(tmp_path), device="cpu")
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, ours.cfg.d_vocab, (2, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, cache = ours.run_with_cache(tokens)
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    assert set(cache) <= set(theirs), set(cache) - set(theirs)
    assert "blocks.2.ln1_post.hook_scale" in cache
    allowed = torch.ones(20, 20, dtype=torch.bool).tril()
    for hook in cache:
        a, b = cache[hook], theirs[hook]
        if hook.endswith("hook_attn_scores"):
            a, b = a[..., allowed], b[..., allowed]
            finite = torch.isfinite(a)  # the windowed layers mask more than the causal triangle
            a, b = a[finite], b[finite]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m: f"{hook}: {m}")
