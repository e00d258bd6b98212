"""probe/checkpoint_phi.py: Phi checkpoints (phi-1, phi-1.5, phi-2), against `transformers`' own PhiForCausalLM and
transformer-lens 4's bridge over the same directory (the logits and the save round trip: tests/test_variants.py;
TL 3.9's own converter: tests/test_tl_state_dict.py)."""
from __future__ import annotations

import pytest
import torch

from probe import HookedDecoder, process_weights
from probe.loading import CheckpointError
from test_transformer_lens import compare_with_transformer_lens
from test_variants import _edit_config, build


def test_every_hook_matches_transformer_lens(tmp_path):
    build("phi", tmp_path)
    missing, theirs = compare_with_transformer_lens(tmp_path, 20, seed=5)
    # the bridge's Phi block has its one norm only, as ln1; probe's ln2 is its copy (checked below)
    assert missing == {f"blocks.{l}.ln2.hook_{p}" for l in range(2) for p in ("scale", "normalized")}
    assert "blocks.1.attn.hook_rot_k" in theirs and not any("resid_mid" in n for n in theirs)


def test_both_sublayers_read_the_one_norm_and_the_head_has_its_bias(tmp_path):
    """ln1 and ln2 hold copies of input_layernorm (separate tensors: editing one leaves the other); the MLP reads
    ln2's output, which is transformers' input_layernorm output; W_U and b_U are lm_head's."""
    hf = build("phi", tmp_path)
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    layer = hf.model.layers[1]
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(tokens, output_hidden_states=True)
        _, cache = ours.run_with_cache(tokens)
        shared = layer.input_layernorm(expected.hidden_states[1])
    block = ours.blocks[1]
    assert torch.equal(block.ln2.w, layer.input_layernorm.weight) and torch.equal(block.ln2.b, layer.input_layernorm.bias)
    assert block.ln2.w.data_ptr() != block.ln1.w.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(block.mlp(block.ln2(cache["blocks.1.hook_resid_pre"])), layer.mlp(shared), atol=1e-5, rtol=0)
    assert torch.equal(ours.b_U, hf.lm_head.bias) and torch.equal(ours.W_U, hf.lm_head.weight.T)


def test_saving_asks_that_the_two_norms_still_agree(tmp_path):
    build("phi", tmp_path / "original")
    ours = HookedDecoder.from_pretrained(tmp_path / "original")
    with torch.no_grad():
        ours.blocks[0].ln2.w.add_(0.1)
    with pytest.raises(ValueError, match="block 0's ln1 and ln2 differ"):
        ours.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


def test_a_head_norm_phi_checkpoint_is_refused_by_name(tmp_path):
    build("phi", tmp_path)
    _edit_config(tmp_path, qk_layernorm=True)
    with pytest.raises(CheckpointError, match="qk_layernorm=true"):
        HookedDecoder.from_pretrained(tmp_path)


def test_processing_keeps_transformers_log_probabilities(tmp_path):
    """TL's default processing folds the shared norm into both sublayers and the final norm into W_U and b_U."""
    hf = build("phi", tmp_path)
    processed = process_weights(HookedDecoder.from_pretrained(tmp_path).eval())
    tokens = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits.log_softmax(-1)
        torch.testing.assert_close(processed(tokens).log_softmax(-1), expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="unembedding bias beside these norms"):  # folded norms: no format holds them
        processed.save_pretrained(tmp_path / "processed")


# ---- Phi-3 ------------------------------------------------------------------------------------------------
def test_phi3_hooks_match_transformer_lens(tmp_path):
    from test_family_defaults import tokenized_checkpoint

    directory = tokenized_checkpoint("phi3", tmp_path / "checkpoint")  # the bridge loads a Phi-3's tokenizer
    missing, theirs = compare_with_transformer_lens(directory, 20, seed=6)
    # as for GPT-NeoX, the bridge has no hook after the rotation; everything else of ours it has
    assert missing == {f"blocks.{l}.attn.hook_rot_{p}" for l in range(2) for p in "qk"}
    assert "blocks.1.mlp.hook_pre_linear" in theirs


def test_phi3_fused_projections_are_split_in_transformers_order(tmp_path):
    """qkv_proj holds q, k, v (probe's fused layout as it is); gate_up_proj the gate, then the up projection (the
    order transformers' chunk reads); saving fuses them back, bit for bit."""
    from safetensors.torch import load_file

    hf = build("phi3", tmp_path / "original", num_key_value_heads=2)
    ours = HookedDecoder.from_pretrained(tmp_path / "original")
    theirs = hf.model.layers[1]
    assert torch.equal(ours.blocks[1].attn.qkv.weight, theirs.self_attn.qkv_proj.weight)
    gate, up = theirs.mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(ours.blocks[1].mlp.gate.weight, gate) and torch.equal(ours.blocks[1].mlp.fc_in.weight, up)
    saved = load_file(str(ours.save_pretrained(tmp_path / "saved") / "model.safetensors"))
    assert torch.equal(saved["model.layers.1.mlp.gate_up_proj.weight"], theirs.mlp.gate_up_proj.weight)
    assert torch.equal(saved["model.layers.1.self_attn.qkv_proj.weight"], theirs.self_attn.qkv_proj.weight)
