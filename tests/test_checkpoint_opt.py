"""probe/checkpoint_opt.py: OPT checkpoints, against `transformers`' own OPTForCausalLM modules and transformer-lens
4's bridge over the same directory (the logits of every layout and the save round trip: tests/test_variants.py;
TL 3.9's own converter: tests/test_tl_state_dict.py)."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from probe import HookedDecoder
from test_transformer_lens import compare_with_transformer_lens
from test_variants import build


def test_every_hook_matches_transformer_lens(tmp_path):
    build("opt", tmp_path)
    # the bridge's hook_attn_scores on this family holds the softmaxed pattern (the scores are checked by hand
    # below), and it gives ln2's hooks with batch and position merged
    missing, theirs = compare_with_transformer_lens(tmp_path, 20, seed=5, skip=("hook_attn_scores",),
                                                    flattened=("ln2.hook_scale", "ln2.hook_normalized"))
    assert missing == set() and "blocks.1.ln2.hook_normalized" in theirs


def test_scores_positions_and_the_projected_embedding_are_transformers(tmp_path):
    """On OPT-350m's layout (post-norm, embeddings projected from 32 wide): hook_embed is project_in of the token
    embedding, the position table is transformers' from its third row, the scores are its q.k / sqrt(d_head)."""
    hf = build("opt", tmp_path, word_embed_proj_dim=32, do_layer_norm_before=False)
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    decoder = hf.model.decoder
    tokens = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(tokens, output_hidden_states=True)
        _, cache = ours.run_with_cache(tokens)
        torch.testing.assert_close(cache["hook_embed"], decoder.project_in(decoder.embed_tokens(tokens)), atol=1e-6, rtol=0)
        torch.testing.assert_close(cache["hook_pos_embed"][0], decoder.embed_positions.weight[2:14], atol=0, rtol=0)
        for l, layer in enumerate(decoder.layers):
            x = expected.hidden_states[l]  # post-norm: attention reads the residual itself
            q, k = (p(x).view(2, 12, 4, 16) for p in (layer.self_attn.q_proj, layer.self_attn.k_proj))
            by_hand = torch.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
            causal = torch.ones(12, 12, dtype=torch.bool).tril()
            torch.testing.assert_close(cache["attn_scores", l][..., causal], by_hand[..., causal], atol=1e-5, rtol=0)
    assert not ours.cfg.tied_embeddings and ours.cfg.d_model == 64


def test_left_padding_numbers_positions_as_transformers_does(tmp_path):
    """transformers numbers OPT's positions by the attention mask's running sum, so a left-padded prompt's real
    tokens get the positions they have alone: probe's padded forward gives the same logits."""
    hf = build("opt", tmp_path)
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(3, 101, (2, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    tokens[1, :4] = 1  # OPT's pad id
    with torch.no_grad():
        expected = hf(tokens, attention_mask=mask).logits
        logits = ours(tokens, attention_mask=mask)
        alone = ours(tokens[1:, 4:])
    torch.testing.assert_close(logits[mask.bool()], expected[mask.bool()], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1, 4:], alone[0], atol=1e-4, rtol=0)


def test_saving_writes_opt_with_its_two_unused_position_rows(tmp_path):
    """An OPT model is saved as OPT (GPT-2's format would hold its weights, not its positions under padding); the
    projection folded on loading is saved unprojected, and transformers reads the file back to the same logits."""
    import transformers as tf

    hf = build("opt", tmp_path / "original", word_embed_proj_dim=32)
    ours = HookedDecoder.from_pretrained(tmp_path / "original").eval()
    out = ours.save_pretrained(tmp_path / "saved")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["word_embed_proj_dim"], config["tie_word_embeddings"]) == ("opt", 64, False)
    positions = load_file(str(out / "model.safetensors"))["model.decoder.embed_positions.weight"]
    assert positions.shape == (42, 64) and not positions[:2].any()
    again = tf.OPTForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(3, 101, (1, 15), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, atol=1e-4, rtol=0)
