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


# ---- XGLM: OPT's names, scaled embeddings, fixed sinusoids for positions ----------------------------------------
def test_xglms_hooks_match_transformer_lens(tmp_path):
    from test_family_defaults import tokenized_checkpoint

    directory = tokenized_checkpoint("xglm", tmp_path / "checkpoint")
    # (its hook_attn_scores holds the softmaxed pattern here, as on OPT; the pattern itself is compared)
    missing, theirs = compare_with_transformer_lens(directory, 12, seed=3, skip=("hook_attn_scores",))
    assert {"hook_embed", "blocks.1.attn.hook_pattern", "blocks.1.hook_mlp_out"} <= theirs  # (no hook_pos_embed)
    assert not {n for n in missing if n.startswith("blocks.1.")}, missing


def test_xglms_positions_and_embeddings_are_transformers(tmp_path):
    """hook_pos_embed is transformers' own sinusoidal module's output for positions 0.. (its table's rows 2 on),
    hook_embed its token embedding (times sqrt(d_model)); generation and processing as transformers'."""
    import pytest

    from family_checks import assert_generation_and_processing_match

    hf = build("xglm", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    toks = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
        positions = hf.model.embed_positions(torch.arange(12)[None])
        torch.testing.assert_close(cache["hook_pos_embed"], positions.expand(2, -1, -1), atol=1e-6, rtol=0)
        torch.testing.assert_close(cache["hook_embed"], hf.model.embed_tokens(toks), atol=1e-6, rtol=0)
    assert hf.config.scale_embedding and model.cfg.scale_embed
    assert_generation_and_processing_match(hf, tmp_path, pad_token_id=1)
    with torch.no_grad():
        model.pos_embed.W_pos[3] += 0.1
    with pytest.raises(ValueError, match="XGLM checkpoint's positions are fixed sinusoids.*W_pos differs"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


def test_xglm_without_scaled_embeddings_saves_as_it_loads(tmp_path):
    import transformers as tf

    hf = build("xglm", tmp_path / "original", scale_embedding=False)
    saved = HookedDecoder.from_pretrained(tmp_path / "original").save_pretrained(tmp_path / "saved")
    assert json.loads((saved / "config.json").read_text())["scale_embedding"] is False
    again = tf.XGLMForCausalLM.from_pretrained(saved).eval()
    toks = torch.randint(3, 101, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(again(toks).logits, hf(toks).logits, atol=1e-5, rtol=0)
