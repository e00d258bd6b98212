"""VaultGemma (`vaultgemma`: Gemma 2's settings in a pre-norm block, probe/checkpoint_llama.py): against transformers in
test_variants' CASES, round trip and config defaults; here hook by hook against TL 4's bridge, whose adapter names its
norms as Gemma 2's less the two after the sublayers."""
from __future__ import annotations

from probe import HookedDecoder
from test_family_defaults import tokenized_checkpoint
from test_transformer_lens import compare_with_transformer_lens


def test_hooks_match_the_bridge(tmp_path):
    directory = tokenized_checkpoint("vaultgemma", tmp_path / "checkpoint")
    missing, theirs = compare_with_transformer_lens(directory, 10, seed=4)
    assert {"blocks.2.attn.hook_pattern", "blocks.2.hook_mlp_out", "blocks.2.ln2.hook_normalized",
            "blocks.2.hook_resid_mid"} <= theirs
    assert not {n for n in missing if n.startswith("blocks.2.") and ".attn." not in n}, missing


def test_text_defaults_are_the_bridges(tmp_path):
    """(TL 4's VaultGemma adapter refuses compatibility mode, which test_family_defaults compares through)"""
    from transformer_lens.model_bridge import TransformerBridge

    directory = tokenized_checkpoint("vaultgemma", tmp_path / "checkpoint")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.from_pretrained(directory)
    texts = ["Hello there", "a longer second text"]
    assert model.cfg.default_prepend_bos == bridge.cfg.default_prepend_bos is True
    assert model.to_tokens(texts).tolist() == bridge.to_tokens(texts).tolist()


def test_it_saves_as_vaultgemma(tmp_path):
    """(logits after the round trip: test_variants' round trip; here the file's own names for it)"""
    import json

    directory = tokenized_checkpoint("vaultgemma", tmp_path / "checkpoint")
    saved = HookedDecoder.from_pretrained(directory).save_pretrained(tmp_path / "saved")
    config = json.loads((saved / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("vaultgemma", ["VaultGemmaForCausalLM"])
