"""Attention-only blocks (probe/blocks.py: AttnOnlyBlock) and shortformer positions (probe/embedding.py), as
transformer-lens's `HookedTransformerConfig(attn_only=True, positional_embedding_type="shortformer", ...)` builds
them for ARENA 1.2's induction-head model, and a config's `tokenizer_name`.

The oracles: HookedTransformer itself (transformer-lens 3, in the SAELens virtualenv: tests/saelens_oracle.py's
`induction` command runs tests/induction_idioms.py on it), and the weights by hand."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from induction_idioms import induction_idioms
import probe
from probe import DEFAULT_MODEL, DecoderConfig, HookedDecoder, HookedTransformerConfig
from probe.shapes import hook_shapes
from test_sae_training import needs_saelens, oracle
from test_tl_state_dict import built_by_hooked_transformer
from toy_helpers import randomised

SEQ_LEN = 8
ARENA = dict(d_model=32, d_head=8, n_heads=4, n_layers=2, n_ctx=64, d_vocab=60, attention_dir="causal",
             attn_only=True, seed=398, use_attn_result=True, normalization_type=None,
             positional_embedding_type="shortformer")  # ARENA 1.2's config at a small size (768 / 64 / 12 / 2048 there)
CASES = {
    "arena-shortformer-no-norm": ARENA,
    "shortformer-ln": dict(ARENA, normalization_type="LN"),  # Neel Nanda's attn-only-2l
    "standard-ln": dict(ARENA, normalization_type="LN", positional_embedding_type="standard"),
}


def repeated_tokens(batch: int = 3, d_vocab: int = 60, seed: int = 3) -> torch.Tensor:
    """[batch 1 + 2 SEQ_LEN]: token 0, then random tokens repeated once (ARENA's generate_repeated_tokens)."""
    half = torch.randint(1, d_vocab, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(seed))
    return torch.cat([torch.zeros(batch, 1, dtype=torch.long), half, half], dim=1)


def trained(settings: dict) -> HookedDecoder:
    return randomised(HookedDecoder(HookedTransformerConfig(**settings)), seed=11)


@needs_saelens
@pytest.mark.parametrize("case", sorted(CASES))
def test_arena_induction_analyses_agree_with_hooked_transformer(case, tmp_path):
    """ARENA 1.2's induction-head section (detectors, induction scores by hook, logit attribution from the cached
    results, value ablations, the full OV circuit, the positional QK pattern, the decomposed q/k inputs,
    composition scores one by one and batched, an ablation read from hook.ctx, input_to_embed and a run from the
    residual) as one function on HookedTransformer and on probe, the same config and weights."""
    settings = CASES[case]
    tokens = repeated_tokens()
    state = built_by_hooked_transformer(settings, tokens, tmp_path)
    oracle("induction", json.dumps(settings), tmp_path / "state.safetensors", tmp_path / "tokens.safetensors",
           SEQ_LEN, tmp_path / "theirs.safetensors")
    theirs = load_file(str(tmp_path / "theirs.safetensors"))

    model = HookedDecoder(HookedTransformerConfig(**settings)).eval()
    model.load_state_dict(state, strict=True)
    ours = induction_idioms(model, tokens, SEQ_LEN)
    assert set(ours) == set(theirs)
    shortformer = settings["positional_embedding_type"] == "shortformer"
    if shortformer:
        # transformer-lens stacks pos_embed as a component of the residual stream, which a shortformer model's
        # positions never join, so its stack does not add up; probe leaves it out (the rest agrees)
        assert theirs["decompose_resid_n"].item() == ours["decompose_resid_n"].item() + 1
        theirs["decompose_resid"] = torch.cat([theirs["decompose_resid"][:1], theirs["decompose_resid"][2:]])
        theirs["decompose_resid_n"] -= 1
    for name, value in ours.items():
        torch.testing.assert_close(value, theirs[name], atol=1e-4, rtol=1e-4, msg=name)
    # and probe's stack is the residual stream the unembedding reads, by construction of the model
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(ours["decompose_resid"].sum(0), cache["blocks.1.hook_resid_post"], atol=1e-5, rtol=1e-5)


def test_shortformer_positions_join_queries_and_keys_only():
    """Layer 0's q, k and v by hand from the weights: the positions are added to ln1's output for q and k, not for
    v, and the residual stream never holds them."""
    model = trained(CASES["shortformer-ln"])
    tokens = repeated_tokens(batch=2)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
        embed = model.W_E[tokens]
        torch.testing.assert_close(cache["blocks.0.hook_resid_pre"], embed)
        normed = torch.nn.functional.layer_norm(embed, (32,), model.blocks[0].ln1.w, model.blocks[0].ln1.b, eps=1e-5)
        pos = model.W_pos[: tokens.shape[1]]
        attn = model.blocks[0].attn
        q = torch.einsum("bpd,hde->bphe", normed + pos, attn.W_Q) + attn.b_Q
        k = torch.einsum("bpd,hde->bphe", normed + pos, attn.W_K) + attn.b_K
        v = torch.einsum("bpd,hde->bphe", normed, attn.W_V) + attn.b_V
    for name, by_hand in (("q", q), ("k", k), ("v", v)):
        torch.testing.assert_close(cache[f"blocks.0.attn.hook_{name}"], by_hand, atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(cache["hook_pos_embed"], pos.expand(2, -1, -1))


def test_an_attention_only_block_has_no_mlp_and_its_points_are_known_in_advance():
    model = trained(ARENA)
    tokens = repeated_tokens(batch=2)
    assert not any(("mlp" in name or "resid_mid" in name or "ln2" in name) for name in model.hook_names)
    assert not hasattr(model.blocks[0], "mlp")
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(cache["blocks.1.hook_resid_post"],
                               cache["blocks.1.hook_resid_pre"] + cache["blocks.1.hook_attn_out"], atol=0, rtol=0)
    shapes = hook_shapes(model.cfg, *tokens.shape)
    assert set(cache) <= set(shapes) and set(model.hook_names) == set(shapes)
    assert all(tuple(cache[name].shape) == shapes[name] for name in cache)
    with pytest.raises(KeyError, match="resid_mid"):
        cache["resid_mid", 0]  # transformer-lens's attn-only model never fires it either
    with pytest.raises(ValueError, match="attention-only model has no MLPs"):
        cache.decompose_resid(layer=1, mlp_input=True)
    with pytest.raises(ValueError, match="no MLPs, so no neurons"):
        cache.stack_neuron_results(layer=1)
    with pytest.raises(ValueError, match="model.W_in: this attention-only model has no MLPs"):
        model.W_in
    torch.testing.assert_close(model.accumulated_bias(2), model.blocks[0].attn.b_O + model.blocks[1].attn.b_O)
    # the ledger counts what the model holds, and transformer-lens's n_params the attention weights alone
    assert model.ledger().total_params == sum(p.numel() for p in model.parameters())
    assert model.cfg.n_params == 2 * 4 * 32 * 8 * 4


def test_a_run_from_the_residual_computes_or_takes_the_shortformer_positions():
    model = trained(ARENA)
    tokens = repeated_tokens(batch=2)
    with torch.no_grad():
        logits = model(tokens)
        residual, _, positions, _ = model.input_to_embed(tokens)
        torch.testing.assert_close(positions, model.W_pos[: tokens.shape[1]].expand(2, -1, -1))
        torch.testing.assert_close(model(residual, start_at_layer=0), logits, atol=1e-6, rtol=0)
        torch.testing.assert_close(model(residual, start_at_layer=0, shortformer_pos_embed=positions), logits,
                                   atol=1e-6, rtol=0)
        # given positions are used as they are: zero ones remove them from every layer's queries and keys
        no_positions = model(residual, start_at_layer=0, shortformer_pos_embed=torch.zeros_like(positions))
        assert not torch.allclose(no_positions, logits, atol=1e-3)
        resid_1 = model(tokens, stop_at_layer=1)
        torch.testing.assert_close(model(resid_1, start_at_layer=1), logits, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="goes with start_at_layer"):
        model(tokens, shortformer_pos_embed=positions)
    with pytest.raises(ValueError, match=r"needs \[2, 17, 32\]"):
        model(residual, start_at_layer=0, shortformer_pos_embed=positions[:, :3])
    standard = trained(CASES["standard-ln"])
    assert standard.input_to_embed(tokens)[2] is None
    with pytest.raises(ValueError, match="for shortformer models.*'standard'"):
        standard(residual, start_at_layer=0, shortformer_pos_embed=positions)


def test_generation_and_left_padding_count_shortformer_positions_along_real_tokens():
    model = trained(ARENA)
    prompt = repeated_tokens(batch=1)[:, :12]
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=5, do_sample=False, verbose=False)
        by_hand = prompt  # greedy decoding by full forwards, no key/value cache
        for _ in range(5):
            by_hand = torch.cat([by_hand, model(by_hand)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert generated.tolist() == by_hand.tolist()
        padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1)
        mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(prompt)], dim=1)
        torch.testing.assert_close(model(padded, attention_mask=mask)[:, -1], model(prompt)[:, -1], atol=1e-5, rtol=0)


def test_processing_leaves_shortformer_positions_where_they_act():
    """fold_ln cannot move ln1's weight into W_Q and W_K past the positions: refused by probe.process_weights, skipped
    by TL's methods, asked for or by default (as transformer-lens skips it). Centring the writers leaves W_pos alone (transformer-lens
    centres it, which changes the queries and keys); the log-probabilities stay the model's own."""
    model = trained(CASES["shortformer-ln"])
    tokens = repeated_tokens(batch=2)
    with torch.no_grad():
        before = model(tokens).log_softmax(-1)
    W_pos = model.W_pos.detach().clone()
    with pytest.raises(ValueError, match="fold_ln: shortformer positions.*pass fold_ln=False"):
        probe.process_weights(model, fold_ln=True)
    with pytest.warns(UserWarning, match=r"skipping fold_ln=True \(given\)"):  # TL's own method skips it too
        model.process_weights_(fold_ln=True, center_writing_weights=False, center_unembed=False)
    with pytest.warns(UserWarning, match="skipping fold_ln"):
        model.process_weights_()
    assert torch.equal(model.W_pos, W_pos)
    assert model.W_E.mean(-1).abs().max() < 1e-6  # the writers were centred
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).log_softmax(-1), before, atol=1e-4, rtol=1e-4)


def test_attention_only_configs_are_checked_and_their_weights_saved_as_state_dicts(tmp_path):
    with pytest.raises(ValueError, match="attn_only blocks are pre-norm.*norm_placement='pre'"):
        DecoderConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=4, attn_only=True, norm_placement="parallel")
    with pytest.raises(ValueError, match="attn_only must be a bool"):
        DecoderConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=4, attn_only="yes")
    plain = HookedDecoder(DecoderConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=4, attn_only=True))
    with pytest.raises(ValueError, match="no Hugging Face checkpoint format holds attention-only blocks"):
        plain.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
    model = trained(ARENA)
    save_file(model.state_dict(), str(tmp_path / "weights.safetensors"))
    again = HookedDecoder(HookedTransformerConfig(**ARENA))
    again.load_state_dict(load_file(str(tmp_path / "weights.safetensors")), strict=True)
    tokens = repeated_tokens()
    with torch.no_grad():
        assert torch.equal(again(tokens), model(tokens))


def _tokenizer_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "tokenizer"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(DEFAULT_MODEL) / name).exists():
            shutil.copy(Path(DEFAULT_MODEL) / name, directory / name)
    return directory


def test_a_config_naming_a_tokenizer_builds_a_model_with_it(tmp_path, monkeypatch):
    """HookedTransformerConfig(tokenizer_name=...) as transformer-lens reads it: the model loads that tokenizer, and
    d_vocab left out is its largest id + 1. The oracle is transformers' tokenizer of the same files."""
    import huggingface_hub
    from transformers import AutoTokenizer

    local = _tokenizer_dir(tmp_path)
    theirs = AutoTokenizer.from_pretrained(str(local))
    settings = {k: v for k, v in ARENA.items() if k != "d_vocab"}
    model = HookedDecoder(HookedTransformerConfig(**settings, tokenizer_name=str(local)))
    assert model.cfg.d_vocab == max(theirs.get_vocab().values()) + 1
    assert model.cfg.tokenizer_name == str(local)
    text = "ROMEO. But soft, what light"
    assert model.to_tokens(text, prepend_bos=False)[0].tolist() == theirs.encode(text)
    # a hub repository's name (ARENA's "EleutherAI/gpt-neox-20b") asks the hub for the tokenizer files only
    asked = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, **_):
        asked.append((repo_id, tuple(allow_patterns or ())))
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    hub = HookedDecoder(HookedTransformerConfig(**ARENA, tokenizer_name="EleutherAI/gpt-neox-20b"))
    assert hub.tokenizer is not None and asked and all(repo == "EleutherAI/gpt-neox-20b" for repo, _ in asked)
    assert all("model.safetensors" not in patterns for _, patterns in asked)
    # a loaded checkpoint says where its tokenizer came from, as transformer-lens's cfg does
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert HookedDecoder.from_pretrained(DEFAULT_MODEL).cfg.tokenizer_name == str(DEFAULT_MODEL)
