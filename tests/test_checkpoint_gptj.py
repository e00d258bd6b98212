"""probe/checkpoint_gptj.py: GPT-J and CodeGen checkpoints, against `transformers`' own GPTJForCausalLM and transformer-lens 4's
bridge over the same directory (the logits and the save round trip: tests/test_variants.py; TL 3.9's own converter
and forward: tests/test_tl_state_dict.py)."""
from __future__ import annotations

import pytest
import torch

from probe import HookedDecoder
from test_transformer_lens import compare_with_transformer_lens
from test_variants import build


def test_every_hook_matches_transformer_lens(tmp_path):
    build("gptj", tmp_path)
    # the bridge's hook_attn_scores on this family holds the softmaxed pattern (its pattern and q, k are compared)
    missing, theirs = compare_with_transformer_lens(tmp_path, 20, seed=5, skip=("hook_attn_scores",))
    # the bridge's GPT-J block has its one norm only, as ln1 (probe's ln2 is its copy), and no hook after the rotation
    # (probe's is checked by hand below)
    assert missing == {f"blocks.{l}.{name}" for l in range(2) for name in ("ln2.hook_scale", "ln2.hook_normalized",
                                                                         "attn.hook_rot_q", "attn.hook_rot_k")}
    assert "blocks.1.attn.hook_z" in theirs


def test_adjacent_dimensions_rotate_together_on_the_first_rotary_dim(tmp_path):
    """hook_rot_k against the rotation written out by hand in float64: dimensions 2i and 2i + 1 turned by
    position * 10000^(-2i / rotary_dim), the rest of each head untouched; q and k from transformers' own projections."""
    hf = build("gptj", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        states = hf(tokens, output_hidden_states=True).hidden_states
        _, cache = model.run_with_cache(tokens)
        k = hf.transformer.h[1].attn.k_proj(hf.transformer.h[1].ln_1(states[1])).view(1, 12, 4, 16).double()
    torch.testing.assert_close(cache["k", 1].double(), k, atol=1e-5, rtol=0)
    angles = torch.arange(12, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, 8, 2) / 8)  # [pos 4]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    even, odd = k[..., 0:8:2], k[..., 1:8:2]
    turned = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    torch.testing.assert_close(cache["rot_k", 1].double(), torch.cat([turned, k[..., 8:]], -1), atol=1e-5, rtol=0)


def test_saving_asks_that_the_two_norms_still_agree(tmp_path):
    build("gptj", tmp_path / "original")
    ours = HookedDecoder.from_pretrained(tmp_path / "original")
    assert torch.equal(ours.blocks[1].ln2.w, ours.blocks[1].ln1.w) and ours.cfg.unembed_bias
    with torch.no_grad():
        ours.blocks[1].ln2.b.add_(0.1)
    with pytest.raises(ValueError, match="GPT-J checkpoint has one norm per block.*block 1's ln1 and ln2 differ"):
        ours.save_pretrained(tmp_path / "saved")


# ---- CodeGen: GPT-J's block, q/v/k fused per model-parallel shard ------------------------------------------------
# (TL 4.3's bridge cannot run CodeGen under transformers 5: its adapter reads attn.embed_positions, which transformers
# 5 moved to the model's rotary module; transformers is the oracle here and in test_variants.py)
def test_codegens_shards_hold_q_v_k_in_turn(tmp_path):
    """Each head's q, k and v are the rows of its shard's quarter of transformers' fused projection, in the order
    q, v, k (read off the fused weight by hand), and generation is transformers' greedy one."""
    from family_checks import assert_generation_and_processing_match

    hf = build("codegen", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    fused = hf.transformer.h[1].attn.qkv_proj.weight.detach()  # [3 d_model, d_model]
    quarter = 64 // 4
    for head in range(4):  # d_head 16: head h is shard h's whole quarter
        rows = fused[3 * quarter * head: 3 * quarter * (head + 1)]
        torch.testing.assert_close(model.W_Q[1, head], rows[:quarter].T, atol=0, rtol=0)
        torch.testing.assert_close(model.W_V[1, head], rows[quarter:2 * quarter].T, atol=0, rtol=0)
        torch.testing.assert_close(model.W_K[1, head], rows[2 * quarter:].T, atol=0, rtol=0)
    assert_generation_and_processing_match(hf, tmp_path)
