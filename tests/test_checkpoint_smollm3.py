"""SmolLM3 checkpoints (probe/checkpoint_llama.py's smollm3_config): Llama's layers, some without positions (NoPE,
DecoderConfig.rotary_layers). The oracles: transformers (test_variants.py: logits and every residual, and the save
round trip; here greedy generation through a KV cache) and TL 4's bridge over the same checkpoint, hook by hook."""
from __future__ import annotations

from family_checks import assert_generation_and_processing_match
from probe import HookedDecoder
from test_family_defaults import LLAMA_FILES, tokenized_checkpoint
from test_transformer_lens import compare_with_transformer_lens
from test_variants import build


def test_every_hook_matches_the_bridge_and_nope_layers_rotate_nothing(tmp_path):
    directory = tokenized_checkpoint("smollm3", tmp_path / "checkpoint", LLAMA_FILES)
    model = HookedDecoder.from_pretrained(directory)
    assert model.cfg.rotary_layers == (True, True, True, False)
    assert model.blocks[3].attn.rotary is None and "blocks.3.attn.hook_rot_q" not in model.hook_names
    assert "blocks.2.attn.hook_rot_q" in model.hook_names
    missing, theirs = compare_with_transformer_lens(directory, 10, seed=4)
    assert missing == set() and "blocks.2.attn.hook_rot_k" in theirs


def test_cached_greedy_generation_is_transformers(tmp_path):
    hf = build("smollm3", tmp_path, no_rope_layers=[0, 1, 0, 1])
    assert_generation_and_processing_match(hf, tmp_path, pad_token_id=1, processing=False)  # RMS: centring refused
