"""probe/checkpoint_mistral3.py: the language model of Mistral 3's multimodal checkpoints, against `transformers`'
own Mistral3ForConditionalGeneration on text (logits, every residual, greedy generation), its save read back by
MistralForCausalLM, and transformer-lens 4's bridge over the same directory."""
from __future__ import annotations

import json

import pytest
import torch

from probe import HookedDecoder
from probe.config_file import CheckpointError
from test_variants import perturbed


def multimodal(directory, tied: bool = False, **text):
    import transformers as tf

    vision = tf.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=32, patch_size=16, head_dim=16)
    settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=40, sliding_window=None)
    config = tf.Mistral3Config(vision_config=vision, text_config=tf.MistralConfig(**{**settings, **text}),
                               image_token_index=100, spatial_merge_size=1, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = perturbed(tf.Mistral3ForConditionalGeneration(config))
    model.save_pretrained(directory)
    return tf.Mistral3ForConditionalGeneration.from_pretrained(directory, attn_implementation="eager").eval()


@pytest.mark.parametrize("tied, window", [(False, 6), (True, None)])  # (without a window, Llama's format holds it too)
def test_the_language_model_loads_and_saves_as_text_only_mistral(tied, window, tmp_path):
    import transformers as tf

    hf = multimodal(tmp_path / "multimodal", tied, sliding_window=window)
    stored = json.loads((tmp_path / "multimodal" / "config.json").read_text())
    assert stored["architectures"] == ["Mistral3ForConditionalGeneration"]
    ours = HookedDecoder.from_pretrained(tmp_path / "multimodal").eval()
    assert ours.cfg.sliding_window == window and ours.cfg.tied_embeddings == tied
    toks = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))  # (no image token: 100)
    with torch.no_grad():
        expected = hf(input_ids=toks, output_hidden_states=True)
        logits, cache = ours.run_with_cache(toks)
        torch.testing.assert_close(logits, expected.logits, atol=1e-4, rtol=0)
        for l in range(2):
            torch.testing.assert_close(cache[f"blocks.{l}.hook_resid_pre"], expected.hidden_states[l], atol=1e-4, rtol=0)
        assert torch.equal(ours.generate(toks, max_new_tokens=6, do_sample=False, verbose=False),
                           hf.generate(input_ids=toks, max_new_tokens=6, do_sample=False, pad_token_id=0))
    saved = ours.save_pretrained(tmp_path / "text")
    assert json.loads((saved / "config.json").read_text())["architectures"] == ["MistralForCausalLM"]
    again = tf.MistralForCausalLM.from_pretrained(saved).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(toks).logits, expected.logits, atol=1e-4, rtol=0)


def test_hooks_match_the_bridge(tmp_path):
    from probe.tokenizer import Tokenizer
    from test_family_defaults import LLAMA_FILES, tokenizer_dir
    from test_transformer_lens import compare_with_transformer_lens

    directory = tokenizer_dir(tmp_path / "checkpoint", *LLAMA_FILES)  # (the bridge loads the tokenizer too)
    multimodal(directory, vocab_size=len(Tokenizer.from_directory(directory)))
    missing, theirs = compare_with_transformer_lens(directory, 10, seed=4)
    assert {"blocks.1.attn.hook_pattern", "blocks.1.hook_mlp_out"} <= theirs
    assert not {n for n in missing if n.startswith("blocks.1.") and ".attn." not in n}, missing


def test_another_text_model_is_refused_by_name(tmp_path):
    multimodal(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["model_type"] = "ministral3"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="text_config.model_type='ministral3' is not supported"):
        HookedDecoder.from_pretrained(tmp_path)
