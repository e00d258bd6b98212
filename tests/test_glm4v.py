"""GLM-4V's language model (probe/checkpoint_glm.py, `glm4v`): on token ids the logits, every residual and greedy
generation are transformers' multimodal model's (whose multimodal rope turns each adjacent pair by a text token's one
position), it saves as the text-only GLM-4 that transformers reads back to the same logits, the defaults a text_config
leaves out read as transformers' own, and TL 4's bridge agrees hook by hook."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from probe import HookedDecoder
from test_variants import perturbed

TOKENS = torch.randint(0, 90, (2, 11), generator=torch.Generator().manual_seed(6))
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4, image_size=16)


def build_glm4v(directory, vocab=101, rope=None, **top):
    """A random GLM-4V: heads 16 wide, the multimodal rope's sections uneven (as the released [8, 12, 12])."""
    import transformers as tf

    rope = {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5, "mrope_section": [1, 2, 1]} \
        if rope is None else rope
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rope_parameters=rope)
    torch.manual_seed(0)
    hf = perturbed(tf.Glm4vForConditionalGeneration(tf.Glm4vConfig(text_config=text, vision_config=VISION, **top)))
    hf.save_pretrained(directory)
    return tf.Glm4vForConditionalGeneration.from_pretrained(directory, attn_implementation="eager").eval()


@pytest.mark.parametrize("rope", [None, {"rope_type": "default", "rope_theta": 300.0, "mrope_section": [2, 3, 3]}],
                         ids=["half-rotary", "whole-heads"])
def test_the_language_model_is_transformers_on_text_and_saves_as_glm4(rope, tmp_path):
    import transformers as tf

    hf = build_glm4v(tmp_path / "multimodal", rope=rope)
    hf.generation_config.eos_token_id = None
    model = HookedDecoder.from_pretrained(tmp_path / "multimodal").eval()
    assert model.cfg.rotary_dim == (8 if rope is None else 16) and model.cfg.qkv_bias
    with torch.no_grad():
        expected = hf(input_ids=TOKENS, output_hidden_states=True)
        logits, cache = model.run_with_cache(TOKENS)
        torch.testing.assert_close(logits, expected.logits, atol=1e-4, rtol=0)
        for layer in range(2):
            torch.testing.assert_close(cache[f"blocks.{layer}.hook_resid_pre"], expected.hidden_states[layer],
                                       atol=1e-4, rtol=0)
        prompt = TOKENS[:, :5]
        assert torch.equal(model.generate(prompt, max_new_tokens=7, do_sample=False, verbose=False),
                           hf.generate(input_ids=prompt, max_new_tokens=7, do_sample=False, pad_token_id=0))
        saved = model.save_pretrained(tmp_path / "text")
        assert json.loads((saved / "config.json").read_text())["architectures"] == ["Glm4ForCausalLM"]
        again = tf.Glm4ForCausalLM.from_pretrained(saved).eval()
        torch.testing.assert_close(again(TOKENS).logits, expected.logits, atol=1e-4, rtol=0)


def test_a_head_tied_in_text_config_alone_is_tied(tmp_path):
    """(GLM-4V's config copies text_config's tie_word_embeddings up, as its pre-v5 files kept it there)"""
    import transformers as tf

    build_glm4v(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config["text_config"]["tie_word_embeddings"] = True
    path.write_text(json.dumps(config))
    state = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    hf = tf.Glm4vForConditionalGeneration.from_pretrained(tmp_path).eval()
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    assert model.cfg.tied_embeddings
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(input_ids=TOKENS).logits, atol=1e-4, rtol=0)


def test_a_text_config_without_its_rope_eps_and_heads_reads_as_transformers(tmp_path):
    import transformers as tf

    from probe.loading import config_from_hf

    build_glm4v(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    for key in ("rope_parameters", "rms_norm_eps", "num_key_value_heads", "hidden_act"):
        config["text_config"].pop(key)
    path.write_text(json.dumps(config))
    theirs = tf.AutoConfig.from_pretrained(tmp_path).text_config
    ours = config_from_hf(config, tmp_path)
    assert ours.rotary_base == theirs.rope_parameters["rope_theta"] and ours.eps == theirs.rms_norm_eps
    assert ours.n_kv_heads == theirs.num_key_value_heads and ours.rotary_dim == ours.d_head == 16
    assert ours.activation.value == theirs.hidden_act


def test_every_bridge_name_is_the_bridges_value_or_says_what_to_hook(tmp_path):
    """TL 4's GLM-4V adapter delegates attention to transformers (as Qwen2.5-VL's): its hook_attn_scores holds the
    pattern, compared with probe's hook_pattern."""
    from probe.tokenizer import Tokenizer
    from family_checks import compared_with_the_delegating_bridge
    from test_family_defaults import QWEN_FILES, tokenizer_dir

    directory = tokenizer_dir(tmp_path / "checkpoint", *QWEN_FILES)
    build_glm4v(directory, vocab=len(Tokenizer.from_directory(directory)))
    compared = compared_with_the_delegating_bridge(directory, TOKENS)
    assert {"attn.hook_pattern", "attn.hook_attn_scores", "hook_mlp_out", "hook_resid_post", "attn.hook_z"} <= compared


def test_compatibility_mode_is_the_bridges(tmp_path):
    """TL 4's GLM-4V adapter declares fold_ln unsupported (its sandwich norms), so its compatibility mode leaves the
    norms; probe's skips fold_ln too, with a warning, and the two agree activation by activation."""
    from probe.tokenizer import Tokenizer
    from family_checks import caches_in_compatibility_mode
    from test_family_defaults import QWEN_FILES, tokenizer_dir

    directory = tokenizer_dir(tmp_path / "checkpoint", *QWEN_FILES)
    build_glm4v(directory, vocab=len(Tokenizer.from_directory(directory)))
    model, ours, cache, theirs, their_cache = caches_in_compatibility_mode(directory, TOKENS)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for name in ("blocks.0.ln1.hook_out", "blocks.0.attn.hook_z", "blocks.1.ln2_post.hook_out",
                 "blocks.1.hook_resid_post", "ln_final.hook_out"):
        torch.testing.assert_close(cache[name], their_cache[name], atol=1e-4, rtol=0, msg=name)
