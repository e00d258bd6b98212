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


def compare_with_transformer_lens(directory, n_pos: int, seed: int, skip=(), flattened=()) -> tuple[set, set]:
    """Run probe and TL's TransformerBridge on the same checkpoint; assert equal logits and equal values at every
    hook both have but those ending in `skip` (where the bridge hooks something else under the name), reading
    those ending in `flattened` (which the bridge gives with batch and position merged) in our shape. Returns
    (our hooks TL lacks, TL's hook names)."""
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    ours = HookedDecoder.from_pretrained(directory).eval()
    tokens = torch.randint(0, ours.cfg.d_vocab, (2, n_pos), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, cache = ours.run_with_cache(tokens)
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    allowed = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    for hook in (n for n in cache if n in theirs and not n.endswith(tuple(skip))):
        a, b = cache[hook], theirs[hook]
        if hook.endswith(tuple(flattened)):
            b = b.reshape(a.shape)
        elif hook.endswith(("_normed", "q_norm.hook_scale", "q_norm.hook_normalized", "k_norm.hook_scale",
                          "k_norm.hook_normalized")) and a.dim() == 4:
            b = b.transpose(1, 2)  # TL's bridge keeps Qwen3's per-head norms in [batch head pos ...]
        assert a.shape == b.shape, hook
        if hook.endswith("hook_attn_scores"):  # masked entries differ by convention (-inf here, finfo.min there)
            a, b = a[..., allowed], b[..., allowed]
            finite = torch.isfinite(a)  # a sliding window masks more than the causal triangle
            a, b = a[finite], b[finite]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m: f"{hook}: {m}")
    return {n for n in cache if n not in theirs}, set(theirs)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_shared_hook_matches_transformer_lens(name, tmp_path):
    directory = build_hf_checkpoint(tmp_path, seed=3, **CONFIGS[name])
    missing, _ = compare_with_transformer_lens(directory, CONFIGS[name]["n_positions"], seed=4)
    assert missing == set(), f"hooks transformer-lens lacks: {missing}"


def test_gpt_neox_hooks_match_transformer_lens(tmp_path):
    """Pythia's layout (parallel blocks, partial rotary, q/k/v interleaved per head) through TL's own loader:
    every hook both have agrees, and neither has a residual between attention and MLP."""
    from test_variants import build

    build("neox", tmp_path)
    missing, theirs = compare_with_transformer_lens(tmp_path, 20, seed=5)
    # TL's bridge has no hook after the rotation for this family; everything else of ours it has
    assert missing == {f"blocks.{l}.attn.hook_rot_{p}" for l in range(2) for p in "qk"}
    assert not any("resid_mid" in n for n in theirs)


def test_gemma2_hooks_match_transformer_lens(tmp_path):
    """Gemma 2 through TL's own loader: scaled embeddings, (1 + w) norms, the write norms ln1_post / ln2_post,
    capped scores and logits, a window on every other layer: every hook of ours TL has, and they agree."""
    from test_variants import build

    build("gemma2", tmp_path)
    missing, theirs = compare_with_transformer_lens(tmp_path, 20, seed=6)
    assert missing == set() and "blocks.2.ln1_post.hook_scale" in theirs


def test_qwen3_hooks_match_transformer_lens(tmp_path):
    """Qwen3's per-head q and k norms: hook_q is the projection, hook_q_normed what rotary reads, as in TL."""
    from test_variants import build

    build("qwen3", tmp_path)
    missing, theirs = compare_with_transformer_lens(tmp_path, 20, seed=7)
    assert missing == set() and "blocks.1.attn.hook_q_normed" in theirs


def test_olmo_hooks_match_transformer_lens(tmp_path):
    """OLMo's LayerNorms learn nothing: probe's LNPre norms (no w, b in the state dict) give TL's values at every hook."""
    from test_family_defaults import GPT_FILES, tokenized_checkpoint

    directory = tokenized_checkpoint("olmo", tmp_path / "checkpoint", GPT_FILES)
    missing, theirs = compare_with_transformer_lens(directory, 20, seed=8)
    assert missing == set() and "blocks.1.ln2.hook_scale" in theirs
    assert not any(".ln1.w" in name for name in HookedDecoder.from_pretrained(directory).state_dict())


@pytest.mark.parametrize("kind", ["olmo2", "olmo3"])
def test_olmo2_hooks_match_transformer_lens(kind, tmp_path):
    """OLMo 2: sublayers read the residual itself and each write is RMS-normalised (ln1_post / ln2_post, the
    bridge's names; ln1 and ln2 are identities, unlisted), q and k normalised over all heads together. The bridge
    gives hook_q_normed / hook_k_normed flattened over the heads ([batch pos (head d_head)]); probe keeps
    [batch pos head d_head], as hook_q has it: the same values. OLMo 3 adds sliding layers with their own rope and
    YaRN on the full ones."""
    from test_family_defaults import GPT_FILES, tokenized_checkpoint

    directory = tokenized_checkpoint(kind, tmp_path / "checkpoint", GPT_FILES, num_key_value_heads=2)
    missing, theirs = compare_with_transformer_lens(directory, 20, seed=9, flattened=("hook_q_normed", "hook_k_normed"))
    assert missing == set() and {"blocks.1.ln2_post.hook_scale", "blocks.0.attn.q_norm.hook_scale"} <= theirs
    assert not any(".ln1.hook_scale" in name for name in theirs)
