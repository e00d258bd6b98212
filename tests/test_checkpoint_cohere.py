"""probe/checkpoint_cohere.py: Cohere checkpoints, against `transformers`' own CohereForCausalLM (logits, every
residual and the save round trip: tests/test_variants.py; generation and processing here) and transformer-lens 4's
bridge over the same directory, hook by hook."""
from __future__ import annotations

import json

import pytest
import torch

from probe import HookedDecoder
from probe.config_file import CheckpointError
from family_checks import assert_generation_and_processing_match
from test_family_defaults import tokenized_checkpoint
from test_transformer_lens import compare_with_transformer_lens
from test_variants import build


def test_every_hook_matches_transformer_lens(tmp_path):
    directory = tokenized_checkpoint("cohere", tmp_path / "checkpoint")
    # (the bridge's unembed.hook_out is lm_head's output before logit_scale multiplies it; probe's, the logits)
    missing, theirs = compare_with_transformer_lens(directory, 12, seed=3, skip=("unembed.hook_out",))
    # the bridge's block has its one norm, as ln1 (probe's ln2 is its copy)
    assert {n for n in missing if n.startswith("blocks.1.")} <= {"blocks.1.ln2.hook_scale", "blocks.1.ln2.hook_normalized",
                                                                 "blocks.1.hook_resid_mid"}, missing
    assert {"blocks.1.attn.hook_rot_q", "blocks.1.hook_mlp_out", "blocks.1.ln1.hook_normalized"} <= theirs


def test_adjacent_pairs_rotate_and_the_logit_scale_is_folded(tmp_path):
    """hook_rot_k against transformers' own rotary module and rotation, on its own k projection; the logits are
    lm_head's times logit_scale, and W_U is the embedding's transpose times it (the checkpoint ties them)."""
    from transformers.models.cohere.modeling_cohere import apply_rotary_pos_emb

    hf = build("cohere", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    toks = torch.randint(0, 101, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        states = hf(toks, output_hidden_states=True).hidden_states
        _, cache = model.run_with_cache(toks)
        layer = hf.model.layers[1]
        x = layer.input_layernorm(states[1])
        q = layer.self_attn.q_proj(x).view(1, 10, 4, 16).transpose(1, 2)
        k = layer.self_attn.k_proj(x).view(1, 10, 2, 16).transpose(1, 2)
        cos, sin = hf.model.rotary_emb(x, torch.arange(10)[None])
        _, rot_k = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(cache["blocks.1.attn.hook_rot_k"], rot_k.transpose(1, 2), atol=1e-5, rtol=0)
    assert not model.cfg.tied_embeddings
    torch.testing.assert_close(model.W_U, hf.model.embed_tokens.weight.T * hf.config.logit_scale, atol=0, rtol=0)
    assert_generation_and_processing_match(hf, tmp_path)


def test_the_shared_norm_and_its_zero_biases_must_hold_to_save(tmp_path):
    build("cohere", tmp_path / "original")
    model = HookedDecoder.from_pretrained(tmp_path / "original")
    assert torch.equal(model.blocks[1].ln2.w, model.blocks[1].ln1.w) and not model.blocks[1].ln1.b.any()
    with torch.no_grad():
        model.blocks[1].ln2.w.add_(0.1)
    with pytest.raises(ValueError, match="Cohere checkpoint has one norm per block.*block 1's ln1 and ln2 differ"):
        model.save_pretrained(tmp_path / "saved")
    with torch.no_grad():
        model.blocks[1].ln2.w.copy_(model.blocks[1].ln1.w)
        model.ln_final.b.add_(0.1)
    with pytest.raises(ValueError, match="Cohere checkpoint's LayerNorms have no biases.*ln_final.b is not zero"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


def test_command_r_plus_qk_norms_are_refused(tmp_path):
    build("cohere", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, use_qk_norm=True)))
    with pytest.raises(CheckpointError, match="use_qk_norm=true.*not supported"):
        HookedDecoder.from_pretrained(tmp_path)
