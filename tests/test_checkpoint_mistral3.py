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
    config["text_config"]["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="text_config.model_type='llama' is not supported"):
        HookedDecoder.from_pretrained(tmp_path)


def ministral3(directory, **overrides):
    """A random Ministral 3 checkpoint: its YaRN rope and a query temperature large enough to bite past the pretraining
    context, 16 positions."""
    import transformers as tf

    settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                     "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 3.0})
    torch.manual_seed(0)
    model = perturbed(tf.Ministral3ForCausalLM(tf.Ministral3Config(**{**settings, **overrides})))
    model.save_pretrained(directory)
    return tf.Ministral3ForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


def test_ministral3_is_transformers_within_its_pretraining_context_and_refuses_beyond(tmp_path):
    """Within the pretraining context the query temperature is 1: probe's logits, residuals and greedy continuation
    are transformers'; its n_ctx is that context, so a longer input is refused by name (transformers' temperature
    would then change the scores), and it saves as Mistral, which transformers reads back to the same logits."""
    import transformers as tf

    hf = ministral3(tmp_path / "hf")
    hf.generation_config.eos_token_id = None
    model = HookedDecoder.from_pretrained(tmp_path / "hf").eval()
    assert model.cfg.n_ctx == 16 and model.cfg.rotary_scaling.kind == "yarn"
    toks = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(toks, output_hidden_states=True)
        logits, cache = model.run_with_cache(toks)
        torch.testing.assert_close(logits, expected.logits, atol=1e-4, rtol=0)
        for l in range(2):
            torch.testing.assert_close(cache[f"blocks.{l}.hook_resid_pre"], expected.hidden_states[l], atol=1e-4, rtol=0)
        assert torch.equal(model.generate(toks[:, :8], max_new_tokens=8, do_sample=False, verbose=False),
                           hf.generate(toks[:, :8], max_new_tokens=8, do_sample=False, pad_token_id=0))
        longer = torch.randint(0, 101, (1, 20), generator=torch.Generator().manual_seed(2))
        beyond = hf(longer).logits[0, 16:]
        plain = tf.MistralForCausalLM.from_pretrained(model.save_pretrained(tmp_path / "ours")).eval()
        assert not torch.allclose(plain(longer).logits[0, 16:], beyond, atol=1e-3)  # the temperature bites there
        torch.testing.assert_close(plain(toks).logits, expected.logits, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="n_ctx"):
        model(longer)


def test_ministral3_without_the_temperature_keeps_its_whole_context(tmp_path):
    ministral3(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert HookedDecoder.from_pretrained(tmp_path).cfg.n_ctx == 64


def test_ministral3_as_a_multimodal_language_model_and_against_the_bridge(tmp_path):
    """Mistral 3's multimodal files with a ministral3 text_config (the Ministral 3 releases) read it as Ministral 3;
    hook by hook against TL 4's bridge on the text-only checkpoint."""
    import transformers as tf

    from probe.tokenizer import Tokenizer
    from test_family_defaults import LLAMA_FILES, tokenizer_dir
    from test_transformer_lens import compare_with_transformer_lens

    text = ministral3(tmp_path / "text").config
    vision = tf.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=32, patch_size=16, head_dim=16)
    torch.manual_seed(0)
    whole = perturbed(tf.Mistral3ForConditionalGeneration(tf.Mistral3Config(
        vision_config=vision, text_config=text, image_token_index=100, spatial_merge_size=1)))
    whole.save_pretrained(tmp_path / "multimodal")
    model = HookedDecoder.from_pretrained(tmp_path / "multimodal").eval()
    toks = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(toks), whole(input_ids=toks).logits, atol=1e-4, rtol=0)
    assert model.cfg.n_ctx == 16
    directory = tokenizer_dir(tmp_path / "checkpoint", *LLAMA_FILES)
    ministral3(directory, vocab_size=len(Tokenizer.from_directory(directory)))
    missing, theirs = compare_with_transformer_lens(directory, 12, seed=4)
    assert "blocks.1.attn.hook_pattern" in theirs
    assert not {n for n in missing if not n.endswith(("hook_rot_q", "hook_rot_k"))}, missing
