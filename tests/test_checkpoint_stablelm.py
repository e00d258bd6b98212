"""StableLM checkpoints (probe/checkpoint_stablelm.py). The oracles: transformers (test_variants.py: logits and every
residual, sequential and parallel blocks, and the save round trip; here greedy generation through a KV cache and
weight processing) and TL 4's bridge over the same checkpoint, hook by hook."""
from __future__ import annotations

import json

import pytest

from family_checks import assert_generation_and_processing_match
from probe import HookedDecoder
from probe.config_file import CheckpointError
from test_family_defaults import GPT_FILES, tokenized_checkpoint
from test_transformer_lens import compare_with_transformer_lens
from test_variants import build


def test_every_hook_matches_the_bridge(tmp_path):
    directory = tokenized_checkpoint("stablelm", tmp_path / "checkpoint", GPT_FILES)
    missing, theirs = compare_with_transformer_lens(directory, 12, seed=3)
    assert missing == set(), missing
    assert "blocks.1.ln2.hook_scale" in theirs


def test_cached_greedy_generation_and_processing_keep_transformers_numbers(tmp_path):
    assert_generation_and_processing_match(build("stablelm", tmp_path), tmp_path)


def test_each_heads_own_qk_layernorm_is_refused(tmp_path):
    build("stablelm", tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "qk_layernorm": True}))
    with pytest.raises(CheckpointError, match="qk_layernorm=true .* not supported"):
        HookedDecoder.from_pretrained(tmp_path)
