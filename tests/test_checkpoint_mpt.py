"""MPT checkpoints (probe/checkpoint_mpt.py): ALiBi, no biases, an exact-GELU MLP. The oracles: transformers
(test_variants.py: logits and every residual, with a softmax_scale too, and the save round trip; here greedy
generation of left-padded prompts through a KV cache) and TL 4's bridge over the same checkpoint, hook by hook."""
from __future__ import annotations

import json

import pytest
import torch

from probe import HookedDecoder
from probe.config_file import CheckpointError
from test_family_defaults import GPT_FILES, tokenized_checkpoint
from test_transformer_lens import compare_with_transformer_lens
from test_variants import build


def test_every_hook_matches_the_bridge(tmp_path):
    """The bridge's scores add transformers' slope * (key - last position), probe's slope * (key - query): each row
    shifted by a constant, the same pattern (compared), as on Bloom."""
    directory = tokenized_checkpoint("mpt", tmp_path / "checkpoint", GPT_FILES)
    missing, theirs = compare_with_transformer_lens(directory, 12, seed=3, skip=("hook_attn_scores",))
    assert missing == set() and "blocks.1.attn.hook_pattern" in theirs


def test_left_padded_greedy_generation_is_transformers(tmp_path):
    hf = build("mpt", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    prompt = torch.randint(0, 101, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        ours = model.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False, verbose=False)
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("change, match", [
    (dict(attn_config={"alibi": False}), r"MPT's alibi=False is not supported"),
    (dict(attn_config={"alibi": True, "qk_ln": True}), r"MPT's qk_ln=True is not supported"),
    (dict(n_heads=4, d_model=48), None),  # 2^k heads: loads
    (dict(logit_scale=0.5), r"MPT's logit_scale=0.5 is not supported"),
])
def test_settings_it_cannot_hold_are_refused_by_name(change, match, tmp_path):
    build("mpt", tmp_path, **{k: v for k, v in change.items() if k in ("n_heads", "d_model")})
    hf = json.loads((tmp_path / "config.json").read_text())
    attn = {**hf["attn_config"], **change.get("attn_config", {})}
    (tmp_path / "config.json").write_text(json.dumps({**hf, **change, "attn_config": attn}))
    if match is None:
        HookedDecoder.from_pretrained(tmp_path)
        return
    with pytest.raises(CheckpointError, match=match):
        HookedDecoder.from_pretrained(tmp_path)


def test_heads_not_a_power_of_two_and_norm_biases_are_refused(tmp_path):
    build("mpt", tmp_path / "six", n_heads=6, d_model=48)
    with pytest.raises(CheckpointError, match=r"n_heads=6 \(not a power of two\)"):
        HookedDecoder.from_pretrained(tmp_path / "six")
    build("mpt", tmp_path / "ok")
    model = HookedDecoder.from_pretrained(tmp_path / "ok")
    assert not model.blocks[0].ln1.b.any()  # MPT's norms have no biases: zeros here
    with torch.no_grad():
        model.blocks[1].ln2.b.add_(0.1)
    with pytest.raises(ValueError, match="LayerNorms have no biases, but this model's blocks.1.ln2.b is not zero"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
