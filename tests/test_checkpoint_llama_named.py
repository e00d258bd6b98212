"""StarCoder 2 and Nemotron (probe/checkpoint_layernorm_llama.py), GLM and GLM-4 (probe/checkpoint_glm.py), HunYuan
(probe/checkpoint_hunyuan.py), Seed-OSS and ERNIE 4.5 (probe/checkpoint_llama.py): Llama's tensor names with a twist each.

The oracles: transformers (test_variants.py compares logits and every residual on two cases of each and saves through
it; here greedy generation, TL-default processing, and Nemotron's LayerNorm1P against transformers' own module) and
TL 4's bridge over the same checkpoints, hook by hook."""
from __future__ import annotations

import contextlib

import pytest
import torch

from probe import HookedDecoder
from family_checks import assert_generation_and_processing_match, seen_in_forward
from test_transformer_lens import compare_with_transformer_lens
from test_variants import CASES, build

KINDS = ["starcoder2", "nemotron", "seed_oss", "glm", "glm4", "ernie4_5", "hunyuan", "jais2"]


@pytest.mark.parametrize("kind", KINDS)
def test_generation_and_processing_are_transformers(kind, tmp_path):
    hf = build(kind, tmp_path)
    # (Seed-OSS's and GLM's RMSNorms have no mean to centre, so TL's default centring is skipped with a warning)
    rms = pytest.warns(UserWarning, match="center_writing_weights") if kind in ("seed_oss", "glm", "glm4", "ernie4_5", "hunyuan") else \
        contextlib.nullcontext()
    with rms:
        assert_generation_and_processing_match(hf, tmp_path)


@pytest.mark.parametrize("case", ["starcoder2-biases-window-tied", "nemotron-biases-tied-quarter-rotary",
                                  "seed-oss-out-bias-mlp-bias-tied", "glm-biases-adjacent-half-rotary",
                                  "glm4-sandwich-norms", "ernie4-5-biases-untied", "hunyuan-norms-after-rope-alpha",
                                  "jais2-biases-relu2"])
def test_every_shared_hook_matches_the_bridge(case, tmp_path):
    from test_family_defaults import LLAMA_FILES, tokenized_checkpoint

    kind, overrides = CASES[case]
    # (the bridge loads a tokenizer for these families: the checkpoint gets one)
    directory = tokenized_checkpoint(kind, tmp_path / "checkpoint", LLAMA_FILES, **overrides)
    missing, _ = compare_with_transformer_lens(directory, 12, seed=4)
    assert missing == set()


def test_nemotron_norms_are_one_plus_the_stored_weight(tmp_path):
    """LayerNorm1P: hook_normalized times (1 + the stored weight) plus the bias is transformers' own module's output,
    and the saved file stores the weight minus 1 again."""
    hf = build("nemotron", tmp_path / "hf")
    model = HookedDecoder.from_pretrained(tmp_path / "hf").eval()
    layer = hf.model.layers[1]
    seen = {}
    handle = layer.input_layernorm.register_forward_hook(lambda m, i, o: seen.__setitem__("ln1", o))
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    try:
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens, names=["blocks.1.ln1.hook_normalized"])
            hf(tokens)
    finally:
        handle.remove()
    stored = layer.input_layernorm.weight
    by_hand = cache["blocks.1.ln1.hook_normalized"] * (1 + stored) + layer.input_layernorm.bias
    torch.testing.assert_close(by_hand, seen["ln1"], atol=1e-5, rtol=0)
    torch.testing.assert_close(model.blocks[1].ln1.w, stored + 1)
    from safetensors.torch import load_file

    saved = load_file(model.save_pretrained(tmp_path / "ours") / "model.safetensors")
    torch.testing.assert_close(saved["model.layers.1.input_layernorm.weight"], stored)


@pytest.mark.parametrize("case", ["starcoder2-no-bias-untied-whole-window", "nemotron-biases-tied-quarter-rotary",
                                  "seed-oss-out-bias-mlp-bias-tied", "glm-no-bias-tied-whole-rotary",
                                  "glm4-sandwich-no-bias-eps", "ernie4-5-biases-untied",
                                  "hunyuan-plain-rope-biases-tied", "jais2-no-bias-tied-gelu"])
def test_the_other_cases_save_through_transformers(case, tmp_path):
    """The second case of each (biases switched the other way, ties, rotary fractions, eps) saved and read back by
    transformers' own class (the default cases' round trips are in test_variants.py)."""
    kind, overrides = CASES[case]
    hf = build(kind, tmp_path / "hf", **overrides)
    again = type(hf).from_pretrained(HookedDecoder.from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "ours"))
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(tokens).logits, hf(tokens).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_config_without_optional_keys_reads_transformers_defaults(kind, tmp_path):
    """config.json without the keys a family defaults (ties, biases, rotary fraction, eps): probe reads the values
    transformers' own config class gives the same file."""
    import json

    import transformers as tf

    build(kind, tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    for key in ("tie_word_embeddings", "use_bias", "attention_bias", "mlp_bias", "rope_parameters", "norm_epsilon",
                "norm_eps", "rms_norm_eps", "layer_norm_eps", "attention_out_bias"):
        config.pop(key, None)
    path.write_text(json.dumps(config))
    theirs = tf.AutoConfig.from_pretrained(tmp_path)
    ours = HookedDecoder.from_pretrained(tmp_path).cfg
    assert ours.tied_embeddings == theirs.tie_word_embeddings
    assert ours.rotary_dim == int(ours.d_head * theirs.rope_parameters.get("partial_rotary_factor", 1.0))
    assert ours.eps == next(getattr(theirs, k) for k in ("norm_epsilon", "norm_eps", "rms_norm_eps", "layer_norm_eps")
                            if hasattr(theirs, k))
    biases = next(getattr(theirs, k) for k in ("use_bias", "attention_bias") if hasattr(theirs, k))
    assert ours.qkv_bias == biases


@pytest.mark.parametrize("kind", KINDS + ["exaone4", "flex_olmo", "olmo2", "olmo3", "llama", "qwen3"])
def test_compatibility_mode_processes_as_the_bridge_does(kind, tmp_path):
    """`boot_transformers` then `enable_compatibility_mode()` on each family gives the bridge's logits and, at every
    hook both have, its activations: the same processing, where the bridge folds the norms (StarCoder 2, Seed-OSS,
    ERNIE, Llama, Qwen3) and where its adapter declares folding or centring unsupported and skips them (GLM, Nemotron,
    OLMo 2 and 3, FlexOlmo, EXAONE 4)."""
    import warnings

    from transformer_lens.model_bridge import TransformerBridge

    from test_family_defaults import GPT_FILES, LLAMA_FILES, tokenized_checkpoint

    directory = tokenized_checkpoint(kind, tmp_path / "checkpoint", GPT_FILES if "olmo" in kind else LLAMA_FILES)
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(str(directory))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (both say what they skip)
        bridge.enable_compatibility_mode()
        model.enable_compatibility_mode()
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs, their_cache = bridge.run_with_cache(tokens)
        ours, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    compared = 0
    for name in cache:
        if name in their_cache and cache[name].shape == their_cache[name].shape and "attn_scores" not in name:
            torch.testing.assert_close(cache[name], their_cache[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
            compared += 1
    assert compared > 20 and "blocks.1.ln2.hook_out" in cache


def test_hunyuan_normalises_the_rotated_queries_and_keys(tmp_path):
    """HunYuan's query_layernorm and key_layernorm read the rotated q and k: their outputs in transformers' forward
    are probe's hook_q_normed / hook_k_normed, and hook_rot_q is the rotation before them; the alpha rope's base is
    theta * alpha^(d_head / (d_head - 2))."""
    hf = build("hunyuan", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    assert model.cfg.rotary_base == pytest.approx(10000.0 * 50.0 ** (16 / 14))
    attn = hf.model.layers[1].self_attn
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    seen = seen_in_forward(hf, tokens, {"q": attn.query_layernorm, "k": attn.key_layernorm})
    seen = {"q_in": seen["q"][0][0], "q": seen["q"][1], "k": seen["k"][1]}
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(cache["blocks.1.attn.hook_q_normed"], seen["q"].transpose(1, 2), atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["blocks.1.attn.hook_k_normed"], seen["k"].transpose(1, 2), atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["blocks.1.attn.hook_rot_q"], seen["q_in"].transpose(1, 2), atol=1e-5, rtol=0)
