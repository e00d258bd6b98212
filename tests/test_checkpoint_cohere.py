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


@pytest.mark.parametrize("kind", ["cohere", "cohere2"])
def test_every_hook_matches_transformer_lens(kind, tmp_path):
    directory = tokenized_checkpoint(kind, tmp_path / "checkpoint")
    # (the bridge's unembed.hook_out is lm_head's output before logit_scale multiplies it; probe's, the logits)
    missing, theirs = compare_with_transformer_lens(directory, 12, seed=3, skip=("unembed.hook_out",))
    # the bridge's block has its one norm, as ln1 (probe's ln2 is its copy)
    assert {n for n in missing if n.startswith("blocks.1.")} <= {"blocks.1.ln2.hook_scale", "blocks.1.ln2.hook_normalized",
                                                                 "blocks.1.hook_resid_mid"}, missing
    assert {"blocks.1.attn.hook_rot_q", "blocks.1.hook_mlp_out", "blocks.1.ln1.hook_normalized"} <= theirs
    if kind == "cohere2":  # its full layer has no positions: no rotation, so no points after one
        assert "blocks.3.attn.hook_rot_q" not in HookedDecoder.from_pretrained(directory).hook_dict


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


def test_cohere2_generates_past_its_window_as_transformers_does(tmp_path):
    """Greedy generation through probe's KV cache, 14 tokens past a window of 5, with the full layer unrotated; and
    the windowed layers' patterns reach back 5 keys, the full layer's to the first."""
    hf = build("cohere2", tmp_path)
    assert_generation_and_processing_match(hf, tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(2)))
    assert (cache["blocks.0.attn.hook_pattern"][0, :, 11, :7] == 0).all()
    assert (cache["blocks.3.attn.hook_pattern"][0, :, 11] > 0).all()


def test_cohere2_saves_only_windows_that_rotate(tmp_path):
    import dataclasses

    build("cohere2", tmp_path / "original")
    model = HookedDecoder.from_pretrained(tmp_path / "original")
    moved = HookedDecoder(dataclasses.replace(model.cfg, rotary_layers=None))  # every layer rotating
    with pytest.raises(ValueError, match="cohere2 checkpoint rotates exactly its windowed layers"):
        moved.save_pretrained(tmp_path / "saved")


def test_cohere2_reads_the_older_files_window_pattern(tmp_path):
    """Hub files from before layer_types say sliding_window_pattern (every n-th layer full); transformers reads it."""
    import transformers as tf

    build("cohere2", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps(dict(config, sliding_window_pattern=2)))
    theirs = tf.Cohere2ForCausalLM.from_pretrained(tmp_path).eval()
    assert theirs.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    assert ours.cfg.rotary_layers == (True, False, True, False)
    toks = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(ours(toks), theirs(toks).logits, atol=1e-4, rtol=0)
