"""probe/checkpoint_exaone.py: EXAONE 3.0 / 3.5 checkpoints, against `transformers` (which runs Llama on them:
logits, every residual and the save round trip in tests/test_variants.py; the released files' config spelling here)
and transformer-lens 4's bridge over the same directory."""
from __future__ import annotations

import json

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
