"""Falcon checkpoints (probe/checkpoint_falcon.py): three blocks and three key/value layouts. The oracles:
transformers (test_variants.py: logits and every residual for each; here each saved back and read by transformers,
and greedy generation) and TL 4's bridge over the same checkpoint, hook by hook."""
from __future__ import annotations

import json

import pytest
import torch

from family_checks import assert_generation_and_processing_match
from probe import HookedDecoder
from probe.config_file import CheckpointError
from test_family_defaults import GPT_FILES, tokenized_checkpoint
from test_transformer_lens import compare_with_transformer_lens
from test_variants import build

VARIANTS = {"falcon-7b": {}, "falcon-40b": {"new_decoder_architecture": True, "num_kv_heads": 2},
            "sequential": {"multi_query": False, "parallel_attn": False, "bias": True}}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_layout_saves_back_as_transformers_reads_it(variant, tmp_path):
    hf = build("falcon", tmp_path / "source", **VARIANTS[variant])
    saved = HookedDecoder.from_pretrained(tmp_path / "source").save_pretrained(tmp_path / "saved")
    again = type(hf).from_pretrained(saved).eval()
    written = json.loads((saved / "config.json").read_text())
    assert written["new_decoder_architecture"] == (variant == "falcon-40b")
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, atol=1e-5, rtol=0)


def test_every_hook_matches_the_bridge(tmp_path):
    """Falcon-7B's layout (the bridge fails to boot the new architecture's grouped heads). Its block has one norm,
    as TL 4's Phi and GPT-J blocks: probe's copy ln2 has no counterpart there."""
    directory = tokenized_checkpoint("falcon", tmp_path / "checkpoint", GPT_FILES)
    missing, theirs = compare_with_transformer_lens(directory, 12, seed=3)
    # (nor has the bridge points after the rotation here, as on GPT-NeoX)
    assert missing == {f"blocks.{l}.{p}" for l in range(2) for p in ("ln2.hook_scale", "ln2.hook_normalized",
                                                                      "attn.hook_rot_q", "attn.hook_rot_k")}, missing
    assert "blocks.1.attn.hook_k" in theirs


def test_cached_greedy_generation_and_processing_keep_transformers_numbers(tmp_path):
    assert_generation_and_processing_match(build("falcon", tmp_path, **VARIANTS["falcon-40b"]), tmp_path)


def test_falcon_rws_alibi_is_refused(tmp_path):
    build("falcon", tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "alibi": True}))
    with pytest.raises(CheckpointError, match="alibi=true .*Falcon-RW"):
        HookedDecoder.from_pretrained(tmp_path)
