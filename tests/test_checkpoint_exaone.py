"""probe/checkpoint_exaone.py: EXAONE 3.0 / 3.5 checkpoints, against `transformers` (which runs Llama on them:
logits, every residual and the save round trip in tests/test_variants.py; the released files' config spelling here)
and transformer-lens 4's bridge over the same directory."""
from __future__ import annotations

import json

import pytest

import torch
from safetensors.torch import load_file

from probe import HookedDecoder
from family_checks import assert_generation_and_processing_match
from test_variants import build


def test_the_released_spelling_loads_and_saves(tmp_path):
    """config.json as the hub's files spell it (ExaoneForCausalLM, num_layers, layer_norm_epsilon,
    activation_function) and the tensors under transformer.h.{l}...: read, generated from and saved in that spelling,
    which transformers reads back. (A file transformers saved says LlamaForCausalLM, and saves as Llama's.)"""
    import transformers as tf

    hf = build("exaone", tmp_path / "original", rms_norm_eps=1e-4)
    config = json.loads((tmp_path / "original" / "config.json").read_text())
    renamed = {"num_hidden_layers": "num_layers", "rms_norm_eps": "layer_norm_epsilon", "hidden_act": "activation_function"}
    released = {**{renamed.get(k, k): v for k, v in config.items()}, "architectures": ["ExaoneForCausalLM"]}
    (tmp_path / "original" / "config.json").write_text(json.dumps(released))  # (transformers writes LlamaForCausalLM)
    assert "transformer.h.1.mlp.c_fc_0.weight" in load_file(str(tmp_path / "original" / "model.safetensors"))
    ours = HookedDecoder.from_pretrained(tmp_path / "original").eval()
    assert ours.cfg.n_layers == 2 and ours.cfg.eps == 1e-4
    assert_generation_and_processing_match(hf, tmp_path / "original")
    saved = ours.save_pretrained(tmp_path / "saved")
    written = json.loads((saved / "config.json").read_text())
    assert written["num_layers"] == 2 and written["layer_norm_epsilon"] == 1e-4 and "num_hidden_layers" not in written
    assert set(load_file(str(saved / "model.safetensors"))) == set(load_file(str(tmp_path / "original" / "model.safetensors")))
    again = tf.AutoModelForCausalLM.from_pretrained(saved).eval()
    toks = torch.randint(0, 101, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(again(toks).logits, hf(toks).logits, atol=1e-5, rtol=0)


def test_every_hook_matches_transformer_lens(tmp_path):
    from test_family_defaults import tokenized_checkpoint
    from test_transformer_lens import compare_with_transformer_lens

    directory = tokenized_checkpoint("exaone", tmp_path / "checkpoint")
    missing, theirs = compare_with_transformer_lens(directory, 12, seed=3)
    assert {"blocks.1.attn.hook_rot_q", "blocks.1.mlp.hook_post", "blocks.1.hook_resid_post"} <= theirs
    assert not {n for n in missing if n.startswith("blocks.1.")}, missing


def test_exaone4_generation_and_processing_are_transformers(tmp_path):

    hf = build("exaone4", tmp_path)
    with pytest.warns(UserWarning, match="center_writing_weights"):  # RMSNorm: nothing to centre, as in TL
        assert_generation_and_processing_match(hf, tmp_path)


@pytest.mark.parametrize("case", ["exaone4-windows-nope-full-layers", "exaone4-global-tied"])
def test_exaone4_hooks_match_the_bridge_and_saves_through_transformers(case, tmp_path):
    """EXAONE 4.0 hook by hook against TL 4's bridge (its windowed layers rotate, its full ones have no positions),
    and saved and read back by transformers' own class."""
    from test_family_defaults import LLAMA_FILES, tokenized_checkpoint
    from test_transformer_lens import compare_with_transformer_lens
    from test_variants import CASES

    kind, overrides = CASES[case]
    directory = tokenized_checkpoint(kind, tmp_path / "checkpoint", LLAMA_FILES, **overrides)
    missing, _ = compare_with_transformer_lens(directory, 12, seed=4)
    rotating = {f"blocks.{l}.attn.hook_rot_{p}" for l in range(4) for p in "qk"}
    assert missing <= rotating  # (the bridge hooks no rotation for this family)
    model = HookedDecoder.from_pretrained(directory)
    assert [model.cfg.layer_rotates(l) for l in range(4)] == ([True] * 3 + [False] if "windows" in case else [True] * 4)
    import transformers as tf

    again = tf.Exaone4ForCausalLM.from_pretrained(model.save_pretrained(tmp_path / "ours")).eval()
    theirs = tf.Exaone4ForCausalLM.from_pretrained(directory).eval()
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, theirs(tokens).logits, atol=1e-5, rtol=0)
