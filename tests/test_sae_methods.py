"""SAELens's HookedSAETransformer idioms, run unchanged on probe: run_with_cache_with_saes, run_with_saes (with and
without the error term, and the SAE's own use_error_term), run_with_hooks_with_saes editing a feature, the saes()
block, add_sae / reset_saes / acts_to_saes. The oracle is HookedSAETransformer itself (SAELens 6 over
transformer-lens 3's HookedTransformer, in its own virtualenv) built from the same GPT-2 directory, running the
same idioms (tests/saelens_oracle.py's hooked_sae_idioms, one function run on both) with the same SAE files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from probe import DEFAULT_MODEL, HookedDecoder, SparseAutoencoder
from probe.sae_config import SAEConfig
from saelens_oracle import hooked_sae_idioms
from test_sae_training import needs_saelens, oracle
from tl_oracle import assert_same

BUNDLED_SAE = Path(DEFAULT_MODEL).parent / "saes" / "resid-post-1"
PROMPTS = ["ROMEO. But soft, what light", "JULIET. O Romeo, Romeo! where"]


def standard_transcoder(directory: Path) -> Path:
    """A random standard transcoder from layer 1's MLP input to its output, in SAELens's files."""
    torch.manual_seed(0)
    sae = SparseAutoencoder(SAEConfig(d_in=192, d_sae=64, hook_name="blocks.1.ln2.hook_normalized",
                                      hook_name_out="blocks.1.hook_mlp_out", d_out=192, apply_b_dec_to_input=False))
    with torch.no_grad():
        for param in sae.parameters():
            param.normal_(0.0, 0.1)
    return sae.save_pretrained(directory)


@needs_saelens
@pytest.mark.parametrize("kind", ["topk-sae", "transcoder"])
def test_hooked_sae_transformer_idioms_give_saelens_numbers(kind, tmp_path):
    sae_dir = BUNDLED_SAE if kind == "topk-sae" else standard_transcoder(tmp_path / "transcoder")
    model = HookedDecoder.from_pretrained(DEFAULT_MODEL).eval()
    tokens = model.to_tokens(PROMPTS)
    save_file({"tokens": tokens}, tmp_path / "tokens.safetensors")
    oracle("hooked_sae", DEFAULT_MODEL, sae_dir, tmp_path / "tokens.safetensors", tmp_path / "theirs.safetensors")
    theirs = load_file(tmp_path / "theirs.safetensors")
    sae = SparseAutoencoder.load_from_disk(sae_dir)  # SAELens's loading call, as the oracle makes it
    ours = hooked_sae_idioms(model, sae, tokens)
    assert set(ours) == set(theirs)
    for name in theirs:
        assert_same(ours[name], theirs[name], atol=1e-4, what=f"{kind}: {name}")
    with torch.no_grad():
        plain = model(tokens)
    assert_same(plain, theirs["reset.logits"], what="the model with no SAE")
    assert not torch.allclose(theirs["cached.logits"], plain, atol=1e-3)  # the SAE changes what the model computes
    assert not torch.allclose(theirs["ablated.logits"], theirs["cached.logits"], atol=1e-5)  # and the edit bites
    written = json.loads((Path(sae_dir) / "cfg.json").read_text())["metadata"]  # SAELens's file says where it sits
    assert (sae.cfg.metadata.hook_name, sae.cfg.metadata.hook_name_out) == (written["hook_name"],
                                                                            written.get("hook_name_out"))


@needs_saelens
@pytest.mark.parametrize("kind", ["topk-sae", "transcoder"])
def test_saelens_own_sae_objects_run_on_probe_as_on_hooked_sae_transformer(kind, tmp_path):
    # SAELens code loads its SAEs with sae_lens and hands them to the model's methods; both sides run in the SAELens
    # environment, HookedSAETransformer and probe (from this repository) with the same SAELens object
    sae_dir = BUNDLED_SAE if kind == "topk-sae" else standard_transcoder(tmp_path / "transcoder")
    tokens = HookedDecoder.from_pretrained(DEFAULT_MODEL).to_tokens(PROMPTS)
    save_file({"tokens": tokens}, tmp_path / "tokens.safetensors")
    oracle("hooked_sae", DEFAULT_MODEL, sae_dir, tmp_path / "tokens.safetensors", tmp_path / "theirs.safetensors")
    oracle("probe_with_saelens_sae", DEFAULT_MODEL, sae_dir, tmp_path / "tokens.safetensors", tmp_path / "ours.safetensors")
    theirs, ours = load_file(tmp_path / "theirs.safetensors"), load_file(tmp_path / "ours.safetensors")
    assert set(ours) == set(theirs)
    for name in theirs:
        assert_same(ours[name], theirs[name], atol=1e-4, what=f"{kind}: {name}")
    assert not torch.allclose(theirs["ablated.logits"], theirs["cached.logits"], atol=1e-5)  # the edit bites


def test_anything_else_in_place_of_an_sae_is_refused_by_name():
    model = HookedDecoder.from_pretrained(DEFAULT_MODEL)
    with pytest.raises(TypeError, match="an SAE of SAELens, got Linear"):
        model.run_with_saes("hi", saes=[torch.nn.Linear(2, 2)])


@needs_saelens
def test_fold_W_dec_norm_is_saelens(tmp_path):
    from test_sae_training import random_inference

    x = torch.randn(50, 24, generator=torch.Generator().manual_seed(2))
    save_file({"x": x}, tmp_path / "x.safetensors")
    for i, (architecture, transcoder) in enumerate([("standard", False), ("jumprelu", False), ("jumprelu", True)]):
        sae = random_inference(architecture, transcoder, seed=i)
        sae.save_pretrained(tmp_path / f"sae{i}")
        with torch.no_grad():
            before = sae(x)
        sae.fold_W_dec_norm()
        oracle("fold", tmp_path / f"sae{i}", tmp_path / "x.safetensors", tmp_path / f"folded{i}.safetensors")
        theirs = load_file(tmp_path / f"folded{i}.safetensors")
        with torch.no_grad():
            ours = {"features": sae.encode(x), "output": sae(x), "W_enc": sae.W_enc, "W_dec": sae.W_dec, "b_enc": sae.b_enc,
                    **({"threshold": sae.threshold} if sae.threshold is not None else {})}
        assert set(ours) == set(theirs)
        for name in theirs:
            assert_same(ours[name], theirs[name], atol=1e-5, what=f"{architecture} {name}")
        assert_same(ours["output"], before, atol=1e-5, what="the output is unchanged")
        torch.testing.assert_close(sae.W_dec.norm(dim=-1), torch.ones(sae.cfg.d_sae), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="which k features a TopK SAE keeps"):
        random_inference("topk").fold_W_dec_norm()


def test_an_attached_sae_is_visible_survives_reset_hooks_and_leaves_no_trace(bundled_model):
    model = bundled_model
    sae = SparseAutoencoder.from_pretrained(BUNDLED_SAE)
    tokens = model.to_tokens(PROMPTS)
    with torch.no_grad():
        plain = model(tokens)
        spliced_logits = model.run_with_saes(tokens, saes=[sae])
        model.add_sae(sae)
        try:
            assert model.acts_to_saes == {sae.cfg.hook_name: sae}
            assert {name for name, *_ in model.persistent_hooks()} == {sae.cfg.hook_name}  # visible, permanent
            model.reset_hooks()  # as SAELens's, it leaves SAEs attached
            assert_same(model(tokens), spliced_logits, atol=1e-6)
            model.reset_hooks(including_permanent=True)  # even this: an SAE is not a hook there
            assert_same(model(tokens), spliced_logits, atol=1e-6)
            assert len(model.persistent_hooks()) == 1 and model.acts_to_saes == {sae.cfg.hook_name: sae}
            with model.saes(saes=[sae], use_error_term=True):  # steps in for the attached one, which comes back
                assert_same(model(tokens), plain, atol=1e-4)
            assert_same(model(tokens), spliced_logits, atol=1e-6)
            copy = __import__("copy").deepcopy(model)  # a copy has none of the original's hooks, nor its SAEs
            assert copy.acts_to_saes == {} and not copy.persistent_hooks()
        finally:
            model.reset_saes()
        assert model.acts_to_saes == {} and not model.persistent_hooks()
        assert not any("hook_sae" in name for name in model.hook_names)
        assert_same(model(tokens), plain, atol=0)
    with pytest.raises(ValueError, match="no SAE is attached at blocks.1.hook_resid_post; attached: none"):
        model.reset_saes(sae.cfg.hook_name)
    with pytest.raises(ValueError, match="exclude_special_tokens is not supported"):
        model.run_with_saes(tokens, saes=[sae], exclude_special_tokens=True)
