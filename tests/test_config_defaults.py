"""A config.json without the keys a family may leave out (its norms' epsilon, whether the embeddings are tied) is read
with the defaults transformers' own config class of that family fills in: the oracle is transformers' AutoConfig on
the very file. (Released files name these keys; hand-written and converted ones often do not.)"""
from __future__ import annotations

import json

import pytest

from probe.loading import config_from_hf
from test_variants import build

EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", "norm_eps")
# every family built by test_variants.build whose config names one of these, but Cohere's, which probe unties on
# purpose (its logit scale is folded into W_U)
KINDS = ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "gemma4", "afmoe", "laguna", "llama4", "olmo2", "olmo3", "smollm3", "arcee",
         "apertus", "granite", "granitemoe", "exaone", "exaone4", "hunyuan", "jais2", "seed_oss", "ernie4_5", "glm", "glm4", "starcoder2", "nemotron",
         "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "youtu", "granitemoehybrid", "bamba", "falcon_h1", "jamba", "nemotron_h", "zamba2", "lfm2", "lfm2_moe", "recurrent_gemma",
         "qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "flex_olmo", "mixtral", "olmoe", "qwen3_moe", "qwen2_moe", "glm4_moe", "minimax_m2", "ernie4_5_moe",
         "gpt_oss", "phi3", "phimoe", "jetmoe", "modernbert_decoder",
         "stablelm", "neox", "phi", "falcon", "gptj", "codegen", "opt", "xglm", "gptneo", "bloom", "bigcode"]


@pytest.mark.parametrize("kind", KINDS)
def test_left_out_keys_read_as_transformers_defaults(kind, tmp_path):
    import transformers as tf

    build(kind, tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    dropped = [key for key in (*EPS_KEYS, "tie_word_embeddings") if config.pop(key, None) is not None]
    path.write_text(json.dumps(config))
    theirs = tf.AutoConfig.from_pretrained(tmp_path)
    ours = config_from_hf(json.loads(path.read_text()), tmp_path)
    eps = next((getattr(theirs, key) for key in EPS_KEYS if key in dropped), None)
    if eps is not None:
        assert ours.eps == pytest.approx(eps, rel=1e-9), f"{kind}: eps"
    if "tie_word_embeddings" in dropped:
        assert ours.tied_embeddings == theirs.tie_word_embeddings, f"{kind}: tied embeddings"
    assert dropped


SHAPE_KEYS = ("rope_parameters", "rope_theta", "rope_scaling", "hidden_act", "hidden_activation", "attention_bias",
              "mlp_bias", "use_bias", "head_dim", "partial_rotary_factor")


@pytest.mark.parametrize("kind", KINDS)
def test_left_out_rope_head_width_and_biases_read_as_transformers_defaults(kind, tmp_path):
    """The rotary base and fraction, the heads' width, the activation and the attention biases of a config.json that
    leaves their keys out (Qwen3's head_dim 128, Mixtral's rope_theta 1e6, GPT-OSS's YaRN rope and biases, ...)."""
    import transformers as tf

    from probe.checkpoint_source import GPT_ACTIVATIONS

    build(kind, tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    for key in SHAPE_KEYS:
        config.pop(key, None)
    path.write_text(json.dumps(config))
    theirs = tf.AutoConfig.from_pretrained(tmp_path)
    if getattr(theirs, "is_heterogeneous", False):  # Gemma 4's: its global values are the windowed layers', as probe's
        theirs.allow_global_per_layer_attribute_access = True
    ours = config_from_hf(json.loads(path.read_text()), tmp_path)
    rope = getattr(theirs, "rope_parameters", None) or {}
    if ours.positions.value == "rotary" and "rope_theta" in rope:
        assert ours.rotary_base == pytest.approx(rope["rope_theta"]), f"{kind}: rope_theta"
        fraction = rope.get("partial_rotary_factor", getattr(theirs, "partial_rotary_factor", None))
        if fraction is not None:
            assert ours.rotary_dim == int(ours.d_head * fraction), f"{kind}: rotary fraction"
        assert (ours.rotary_scaling is None) == (rope.get("rope_type", "default") == "default"), f"{kind}: rope type"
    if isinstance(getattr(theirs, "head_dim", None), int):  # (latent attention's: the rotated part, d_head the values')
        width = ours.d_head if ours.latent_attention is None else ours.latent_attention.d_rope
        assert width == theirs.head_dim, f"{kind}: head_dim"
    act = next((getattr(theirs, k) for k in ("hidden_act", "hidden_activation") if getattr(theirs, k, None)), None)
    if act in GPT_ACTIVATIONS and not kind.startswith("gemma"):  # (Gemma reads "gelu" as the tanh one)
        assert ours.activation is GPT_ACTIVATIONS[act], f"{kind}: activation"
    if isinstance(getattr(theirs, "attention_bias", None), bool):
        assert ours.qkv_bias == theirs.attention_bias, f"{kind}: attention biases"
