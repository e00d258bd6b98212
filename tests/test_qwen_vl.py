"""Qwen3-VL, Qwen3-VL-MoE and Qwen2.5-VL (probe/checkpoint_qwen_vl.py): their language model read from the multimodal files, its
logits on token ids transformers' multimodal model's (whose multimodal rope turns every frequency by the one position
of a text token), saved as the text-only Qwen3 / Qwen3-MoE that transformers loads with the same logits, generation,
and TL 4's bridge (which delegates attention, as Gemma 4's does) name by name."""
from __future__ import annotations

import json

import pytest
import torch

from probe import HookedDecoder
from family_checks import compared_with_the_delegating_bridge
from test_family_defaults import LLAMA_FILES
from test_tokenizer_surface import tokenizer_dir

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, deepstack_visual_indexes=[0])


def build_vl(moe, directory, vocab: int = 101):
    """A random Qwen3-VL (or Qwen3-VL-MoE, its router's weights drawn: transformers starts them at zero; or, with
    moe="qwen2.5", Qwen2.5-VL) in `directory`: the mrope sections interleaved, as the released files' are, and a
    rope base far from the default."""
    import transformers as tf

    text = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True})
    if moe == "qwen2.5":
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
        hf = tf.Qwen2_5_VLForConditionalGeneration(tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision))
    elif moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12)
        hf = tf.Qwen3VLMoeForConditionalGeneration(tf.Qwen3VLMoeConfig(text_config=text, vision_config=VISION))
    else:
        hf = tf.Qwen3VLForConditionalGeneration(tf.Qwen3VLConfig(text_config=text, vision_config=VISION))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "language_model" in name:
                param.add_(0.2 * torch.randn_like(param))  # norms away from 1, the router away from its zeros
    hf = hf.eval()
    hf.save_pretrained(directory)
    return hf


@pytest.mark.parametrize("moe", [False, True, "qwen2.5"])
def test_the_language_model_is_transformers_on_text_and_saves_as_the_text_format(moe, tmp_path):
    """(transformers saves Qwen2.5-VL in its released layout, the language model under `model.`, the vision tower
    under `visual.`; Qwen3-VL's under `model.language_model.` and `model.visual.`)"""
    import transformers as tf

    hf = build_vl(moe, tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = hf(input_ids=TOKENS).logits
        torch.testing.assert_close(model(TOKENS), expected, atol=1e-4, rtol=0)
        text_class = {False: tf.Qwen3ForCausalLM, True: tf.Qwen3MoeForCausalLM, "qwen2.5": tf.Qwen2ForCausalLM}[moe]
        again = text_class.from_pretrained(model.save_pretrained(tmp_path / "saved")).eval()
        torch.testing.assert_close(again(TOKENS).logits, expected, atol=1e-4, rtol=0)
    assert (model.cfg.experts is not None) == (moe is True) and model.cfg.qk_norm == (moe != "qwen2.5")
    assert model.cfg.qkv_bias == (moe == "qwen2.5")


def test_greedy_generation_is_transformers(tmp_path):
    hf = build_vl(True, tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    hf.generation_config.eos_token_id = None
    prompt = TOKENS[:, :6]
    with torch.no_grad():
        expected = hf.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False, verbose=False), expected)


@pytest.mark.parametrize("moe", [False, True, "qwen2.5"])
def test_every_bridge_name_is_the_bridges_value_or_says_what_to_hook(moe, tmp_path):
    from probe.tokenizer import Tokenizer

    directory = tokenizer_dir(tmp_path / "vl", *LLAMA_FILES)
    build_vl(moe, directory, vocab=len(Tokenizer.from_directory(directory)))
    compared = compared_with_the_delegating_bridge(directory, TOKENS)
    assert {"attn.hook_pattern", "attn.hook_attn_scores", "hook_resid_post"} <= compared
    assert moe == "qwen2.5" or {"attn.q_norm.hook_in", "attn.k_norm.hook_out"} <= compared


def test_a_router_that_does_not_renormalise_is_refused_by_name(tmp_path):
    from probe.config_file import CheckpointError

    build_vl(True, tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config["text_config"]["norm_topk_prob"] = False
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="norm_topk_prob=false: Qwen3-VL-MoE's router always renormalises"):
        HookedDecoder.from_pretrained(tmp_path)


@pytest.mark.parametrize("moe", [False, True, "qwen2.5"])
def test_a_text_config_without_its_rope_eps_and_widths_reads_as_transformers(moe, tmp_path):
    """The keys a text_config may leave out read as transformers' Qwen3VLTextConfig / Qwen3VLMoeTextConfig fill
    them (the oracle: AutoConfig on the very file)."""
    import transformers as tf

    from probe.loading import config_from_hf

    build_vl(moe, tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    for key in ("rope_parameters", "rms_norm_eps", "head_dim", "num_experts_per_tok"):
        config["text_config"].pop(key, None)
    path.write_text(json.dumps(config))
    theirs = tf.AutoConfig.from_pretrained(tmp_path).text_config
    ours = config_from_hf(config, tmp_path)
    assert ours.rotary_base == theirs.rope_parameters["rope_theta"] and ours.eps == theirs.rms_norm_eps
    assert ours.d_head == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
    assert moe is not True or ours.experts.per_token == theirs.num_experts_per_tok
