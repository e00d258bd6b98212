"""StableLM checkpoints (probe/checkpoint_stablelm.py). The oracles: transformers (test_variants.py: logits and every
residual, sequential and parallel blocks, and the save round trip; here greedy generation through a KV cache and
weight processing) and TL 4's bridge over the same checkpoint, hook by hook."""
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
    directory = tokenized_checkpoint("stablelm", tmp_path / "checkpoint", GPT_FILES)
    missing, theirs = compare_with_transformer_lens(directory, 12, seed=3)
    assert missing == set(), missing
    assert "blocks.1.ln2.hook_scale" in theirs


def test_cached_greedy_generation_and_processing_keep_transformers_numbers(tmp_path):
    hf = build("stablelm", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    prompt = torch.randint(0, 101, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False, verbose=False), expected)
        processed = HookedDecoder.from_pretrained(tmp_path, fold_ln=True, center_writing_weights=True,
                                                  center_unembed=True, fold_value_biases=True).eval()
        torch.testing.assert_close(processed(prompt).log_softmax(-1), hf(prompt).logits.log_softmax(-1), atol=1e-4, rtol=0)


def test_each_heads_own_qk_layernorm_is_refused(tmp_path):
    build("stablelm", tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "qk_layernorm": True}))
    with pytest.raises(CheckpointError, match="qk_layernorm=true .* not supported"):
        HookedDecoder.from_pretrained(tmp_path)
