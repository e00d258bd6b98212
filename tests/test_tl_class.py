"""`from probe import HookedTransformer` (probe/tl_class.py): transformer-lens 3 code with only its import changed loads
as TL's class loads. The oracles: transformer-lens 3.9's own bare `HookedTransformer.from_pretrained(name)` (its
default processing) on one of Neel Nanda's toy models, and TL 4's bridge processing the bundled GPT-2 with TL's
defaults (as `test_tl_loading.py` checks HookedDecoder's explicit keywords against)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

from probe import DEFAULT_MODEL, HookedDecoder, HookedSAETransformer, HookedTransformer, HookedTransformerConfig
from config_class_idioms import config_class_idioms
from test_checkpoint_tl import CASES, assert_state_and_logits_are_tls, checkpoint_dir, loaded_by_both
from test_sae_training import needs_saelens, oracle
from test_tl_compat import PROMPT, classic
from test_tl_loading import TL_DEFAULTS, WEIGHTS, processed_bridge
from test_tl_state_dict import built_by_hooked_transformer
from test_tl_state_processing import ARENA_NO_NORMS
from tl_oracle import assert_same


@needs_saelens
def test_a_bare_from_pretrained_processes_as_transformer_lens_3s(tmp_path, monkeypatch):
    directory = checkpoint_dir(tmp_path, CASES["gelu-2l"])
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    # both sides: from_pretrained(name) with no processing keyword
    model, _, out, _ = loaded_by_both("gelu-2l", directory, {}, tokens, tmp_path, monkeypatch, model_class=HookedTransformer)
    assert type(model) is HookedTransformer and model.cfg.normalization_type == "LNPre"
    assert_state_and_logits_are_tls(model, out, tokens)


def test_the_bundled_gpt2_loads_as_transformer_lens_processes_it(capsys):
    ours = HookedTransformer.from_pretrained(DEFAULT_MODEL).eval()
    # TL 3's from_pretrained prints this line (its docstring's example), which notebooks show
    assert capsys.readouterr().out == f"Loaded pretrained model {DEFAULT_MODEL} into HookedTransformer\n"
    theirs = processed_bridge(tuple(TL_DEFAULTS.items()))
    for name in WEIGHTS:
        assert_same(getattr(ours, name), getattr(theirs, name), atol=1e-5, what=name)
    tokens = ours.to_tokens(PROMPT)
    with torch.no_grad():
        logits, cache = ours.run_with_cache(tokens)
        their_logits, their_cache = theirs.run_with_cache(tokens)
    assert_same(logits, their_logits, what="logits")
    theirs_by_name = classic(dict(their_cache.items()))
    for name in ("blocks.0.hook_resid_pre", "blocks.1.hook_resid_mid", "blocks.1.attn.hook_z", "ln_final.hook_normalized"):
        assert_same(cache[name], theirs_by_name[name], what=name)
    # a processing keyword given wins; TL's no-processing load keeps the checkpoint's weights, as HookedDecoder's
    plain = HookedDecoder.from_pretrained(DEFAULT_MODEL)
    for model in (HookedTransformer.from_pretrained_no_processing(DEFAULT_MODEL),
                  HookedSAETransformer.from_pretrained(DEFAULT_MODEL, fold_ln=False, center_writing_weights=False,
                                                       center_unembed=False, fold_value_biases=False)):
        assert_same(model.W_U, plain.W_U, atol=0.0, what="unprocessed W_U")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # GPT-2 takes every default step: nothing skipped, nothing to warn of
        HookedTransformer.from_pretrained(DEFAULT_MODEL)
    assert not torch.allclose(ours.W_U, plain.W_U)  # centred
    with pytest.raises(TypeError):
        HookedTransformer.from_pretrained(DEFAULT_MODEL, "cpu")  # TL's keywords only, by name
    with pytest.raises(TypeError, match=r"HookedTransformer\.from_pretrained\(\)"):  # named as the caller wrote it
        HookedTransformer.from_pretrained(DEFAULT_MODEL, first_n_layers=1)



@needs_saelens
def test_negative_token_ids_count_from_the_end_of_the_vocabulary_as_transformer_lens_3_embeds_them(tmp_path):
    # ARENA's cumulative-sum problem feeds the numbers -5 .. 5 as token ids into an 11-token vocabulary
    tokens = torch.randint(-5, 6, (3, 10), generator=torch.Generator().manual_seed(2))
    assert bool((tokens < 0).any())
    state = built_by_hooked_transformer(ARENA_NO_NORMS, tokens, tmp_path)  # TL's logits on these very ids
    theirs = load_file(str(tmp_path / "built.safetensors"))["logits"]
    model = HookedTransformer(HookedTransformerConfig(**ARENA_NO_NORMS)).eval()
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        assert_same(model(tokens), theirs, what="negative ids")
        assert_same(model(tokens), model(tokens % 11), atol=0.0, what="read from the end")
    plain = HookedDecoder(HookedTransformerConfig(**ARENA_NO_NORMS))
    with pytest.raises(ValueError, match=r"token id -\d is outside the vocabulary \[0, 11\)"):
        plain(tokens)  # probe's own class: most likely a mistake (-100 labels), refused by name
    with pytest.raises(ValueError, match="token id -12 is outside"):
        model(torch.tensor([[-12, 1]]))  # beyond the vocabulary's length: refused by both


@needs_saelens
@pytest.mark.parametrize("kind", ["gemma", "gemma3"])
def test_gemmas_embedding_scale_is_in_w_e_as_transformer_lens_3_converts_it(kind, tmp_path):
    """TL 3 code reads model.W_E[tokens] as what the residual receives (circuit-tracer's token nodes on Gemma). On
    Gemma 3 also its q/k norms and local layers' own rotary base, through TL 3.9's converter and forward."""
    import json

    from safetensors.torch import save_file
    from test_tl_state_dict import tl_config
    from test_variants import build

    hf = build(kind, tmp_path / "gemma")
    ours = HookedTransformer.from_pretrained_no_processing(tmp_path / "gemma").eval()
    plain = HookedDecoder.from_pretrained(tmp_path / "gemma").eval()
    save_file(ours.state_dict(), str(tmp_path / "state.safetensors"))
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    save_file({"tokens": tokens}, str(tmp_path / "tokens.safetensors"))
    oracle("tl_state_dict", "gemma", tmp_path / "gemma", json.dumps(tl_config(kind, hf)),
           tmp_path / "state.safetensors", tmp_path / "tokens.safetensors", tmp_path / "out.safetensors")
    out = load_file(str(tmp_path / "out.safetensors"))
    assert_same(ours.W_E, out["tl.embed.W_E"], atol=1e-6, what="W_E, sqrt(d_model) in it")  # TL's own converter's
    assert_same(plain.W_E * 8.0, ours.W_E, atol=1e-6, what="HookedDecoder keeps the checkpoint's table")
    with torch.no_grad():
        expected = hf(tokens).logits
        assert_same(ours(tokens), expected, what="the same model")
        assert_same(out["logits"], expected, what="TL running probe's exported state dict")
    with pytest.raises(ValueError, match="scale_embed=False"):
        ours.save_pretrained(tmp_path / "saved")  # no longer a Gemma checkpoint's layout: said, not written


@needs_saelens
def test_a_config_is_an_instance_of_hookedtransformerconfig_as_transformer_lens_code_tests_it():
    """EAP-IG's Graph.from_model tells a model, a config and a dict apart by isinstance; TL code rebuilds configs with
    `from_dict` and takes either with `unwrap`. The oracle: transformer-lens 3.9's classes (`config_class`)."""
    config = dict(n_layers=2, d_model=32, d_head=8, n_heads=4, n_ctx=16, d_vocab=50, act_fn="gelu_new")
    theirs = json.loads(oracle("config_class", json.dumps(config)).splitlines()[-1])
    model = HookedTransformer(HookedTransformerConfig(**config))
    assert config_class_idioms(model, HookedTransformer, HookedTransformerConfig) == theirs


@pytest.mark.parametrize("name, kind, n_ctx", [("tiny-stories-1M", "gptneo", 512), ("gemma-3-1b-it", "gemma3", 8192)])
def test_tl_3s_context_for_tinystories_and_gemma_3(name, kind, n_ctx, tmp_path, monkeypatch):
    """TL 3.9's from_pretrained overrides these checkpoints' n_ctx (its loading_from_pretrained: the TinyStories
    models were trained on 512 tokens, its table cut to them; Gemma 3 gets 8192): HookedTransformer gives TL's, so
    code sizing data by model.cfg.n_ctx and the state dict's W_pos are TL 3's; the same directory loaded by path, and
    HookedDecoder, keep the config's."""
    import huggingface_hub

    from test_variants import build

    build(kind, tmp_path / "hub", max_position_embeddings=9000)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **_: str(tmp_path / "hub"))
    model = HookedTransformer.from_pretrained(name).eval()
    by_path = HookedTransformer.from_pretrained(tmp_path / "hub").eval()
    assert (model.cfg.n_ctx, by_path.cfg.n_ctx, HookedDecoder.from_pretrained(name).cfg.n_ctx) == (n_ctx, 9000, 9000)
    if kind == "gptneo":
        assert model.state_dict()["pos_embed.W_pos"].shape[0] == n_ctx
    else:  # TL's rotary tables have a row per position of its context
        assert model.blocks[0].attn.rotary_sin.shape[0] == n_ctx
    tokens = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), by_path(tokens), atol=0, rtol=0)
    with pytest.raises(ValueError, match=f"context is n_ctx={n_ctx}"):
        model(torch.zeros(1, n_ctx + 1, dtype=torch.long))
