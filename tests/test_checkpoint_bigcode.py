"""GPTBigCode checkpoints (probe/checkpoint_bigcode.py: SantaCoder, StarCoder): multi-query attention in GPT-2's block.
The oracles: transformers (test_variants.py: logits and every residual, with and without multi-query, and the save
round trip; here greedy generation through a KV cache and weight processing) and TL 4's bridge over the same
checkpoint, hook by hook."""
from __future__ import annotations

from probe import HookedDecoder
from family_checks import assert_generation_and_processing_match
from test_family_defaults import GPT_FILES, tokenized_checkpoint
from test_transformer_lens import compare_with_transformer_lens
from test_variants import build


def test_every_hook_matches_the_bridge(tmp_path):
    """(The bridge loads multi-query checkpoints only, as released; test_variants.py has the multi-head layout.)"""
    directory = tokenized_checkpoint("bigcode", tmp_path / "checkpoint", GPT_FILES)
    assert HookedDecoder.from_pretrained(directory).cfg.n_kv_heads == 1
    missing, theirs = compare_with_transformer_lens(directory, 12, seed=3)
    assert missing == set() and "blocks.1.attn.hook_k" in theirs


def test_cached_greedy_generation_and_processing_keep_transformers_numbers(tmp_path):
    assert_generation_and_processing_match(build("bigcode", tmp_path), tmp_path)
