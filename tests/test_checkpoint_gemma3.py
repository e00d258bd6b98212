"""probe/checkpoint_gemma3.py: Gemma 3 text checkpoints (gemma-3-270m, gemma-3-1b), against `transformers`' own
Gemma3ForCausalLM and transformer-lens 4's bridge over the same directory (the logits of both rotary layouts and
the save round trip: tests/test_variants.py; TL 3.9's converter and forward on probe's exported state dict, through
`probe.HookedTransformer`: tests/test_tl_class.py)."""
from __future__ import annotations

import pytest
import torch

from probe import HookedDecoder
from probe.loading import CheckpointError
from test_family_defaults import tokenized_checkpoint
from test_transformer_lens import compare_with_transformer_lens
from test_variants import _DROP, _edit_config, build

SCALED = {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}


def test_every_hook_matches_transformer_lens(tmp_path):
    directory = tokenized_checkpoint("gemma3", tmp_path / "checkpoint", **SCALED)  # the bridge loads its tokenizer
    missing, theirs = compare_with_transformer_lens(directory, 20, seed=5)
    assert missing == set() and {"blocks.1.attn.hook_k_normed", "blocks.2.ln2_post.hook_scale"} <= theirs


def test_each_layer_rotates_by_its_own_base(tmp_path):
    """Against the frequencies written out by hand in float64: a sliding layer's angle is position * base_local
    ^ (-2i / d_head), unscaled; a full layer's position / 8 * base ^ (-2i / d_head)."""
    build("gemma3", tmp_path, **SCALED)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    for layer, (base, factor) in enumerate([(100.0, 1.0), (1e6, 8.0), (100.0, 1.0)]):
        k = cache["k_normed", layer].double()
        half = k.shape[-1] // 2
        angles = torch.arange(30, dtype=torch.float64)[:, None] / factor * base ** (-2 * torch.arange(half) / (2 * half))
        cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
        by_hand = torch.cat([k[..., :half] * cos - k[..., half:] * sin, k[..., half:] * cos + k[..., :half] * sin], -1)
        torch.testing.assert_close(cache["rot_k", layer].double(), by_hand, atol=1e-5, rtol=0)


def test_older_config_files_are_read_as_transformers_reads_them(tmp_path):
    """The released gemma-3-1b config.json: rope_theta, rope_local_base_freq and rope_scaling beside each other (the
    scaling for full layers only), sliding_window_pattern instead of layer_types, an attn_logit_softcapping
    transformers never applies."""
    import transformers as tf

    build("gemma3", tmp_path, num_hidden_layers=4, layer_types=None)
    _edit_config(tmp_path, rope_parameters=_DROP, layer_types=_DROP, sliding_window_pattern=3, rope_theta=1e5,
                 rope_local_base_freq=50.0, rope_scaling={"rope_type": "linear", "factor": 4.0}, attn_logit_softcapping=2.0)
    hf = tf.Gemma3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    assert ours.cfg.sliding_layers == (True, True, False, True) and ours.cfg.attn_softcap is None
    assert (ours.cfg.rotary_base, ours.cfg.sliding_rotary_base, ours.cfg.rotary_scaling.factor) == (1e5, 50.0, 4.0)
    tokens = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("change, match", [
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=true"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), r"naming \['chunked_attention'\]"),
    (dict(layer_types=["full_attention"]), "got 1 entries"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "rescaled rope on the sliding layers"),
])
def test_settings_that_cannot_load_are_refused_by_name(change, match, tmp_path):
    build("gemma3", tmp_path)
    _edit_config(tmp_path, **change)
    with pytest.raises(CheckpointError, match=match):
        HookedDecoder.from_pretrained(tmp_path)


def build_multimodal(directory, **text):
    """A random multimodal Gemma 3 (a tiny vision tower beside the language model), saved as transformers saves it:
    the language model's tensors under language_model.model., its settings in text_config."""
    import transformers as tf

    from test_variants import perturbed

    text = {**dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=40, sliding_window=6,
                   query_pre_attn_scalar=20, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
            **text}
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=100,
                             boi_token_index=98, eoi_token_index=99)
    torch.manual_seed(0)
    perturbed(tf.Gemma3ForConditionalGeneration(config)).save_pretrained(directory)


def test_a_multimodal_checkpoints_language_model_loads_and_saves_as_text_only(tmp_path):
    """gemma-3-4b and larger hold a vision tower beside the language model (text_config; tensors under
    language_model.model.): the language model is read, its logits on text are transformers' multimodal model's, and
    it saves as a text-only Gemma 3 that Gemma3ForCausalLM loads to the same logits."""
    import json

    import transformers as tf

    build_multimodal(tmp_path / "multimodal", **SCALED)
    hf = tf.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "multimodal", attn_implementation="eager").eval()
    ours = HookedDecoder.from_pretrained(tmp_path / "multimodal").eval()
    assert ours.cfg.sliding_rotary_base == 100.0 and ours.cfg.original_architecture == "Gemma3ForConditionalGeneration"
    tokens = torch.randint(0, 98, (2, 20), generator=torch.Generator().manual_seed(6))  # text: no image tokens
    with torch.no_grad():
        expected = hf(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, atol=1e-4, rtol=0)
    saved = ours.save_pretrained(tmp_path / "saved")
    assert json.loads((saved / "config.json").read_text())["model_type"] == "gemma3_text"
    again = tf.Gemma3ForCausalLM.from_pretrained(saved, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, expected, atol=1e-4, rtol=0)


def test_a_text_config_that_names_only_a_few_fields_gets_transformers_defaults(tmp_path):
    """gemma-3-4b's text_config names five fields; transformers fills the rest from Gemma3TextConfig's defaults, and
    so does probe (checkpoint_gemma3.TEXT_DEFAULTS, compared here with transformers' own)."""
    import json

    import transformers as tf

    from probe.checkpoint_gemma3 import TEXT_DEFAULTS

    defaults = tf.Gemma3TextConfig()
    assert TEXT_DEFAULTS == {key: getattr(defaults, key) for key in TEXT_DEFAULTS}
    named = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "sliding_window", "layer_types")
    build_multimodal(tmp_path, num_hidden_layers=2, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                     **{key: getattr(defaults, key) for key in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                                "query_pre_attn_scalar", "max_position_embeddings")})
    written = json.loads((tmp_path / "config.json").read_text())
    written["text_config"] = {key: written["text_config"][key] for key in (*named, "model_type")}  # the hub's few
    (tmp_path / "config.json").write_text(json.dumps(written))
    hf = tf.Gemma3ForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    assert (ours.cfg.d_head, ours.cfg.n_heads, ours.cfg.n_kv_heads, ours.cfg.attn_scale) == (256, 8, 4, 16.0)
    tokens = torch.randint(0, 98, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-4, rtol=0)


def test_a_multimodal_config_without_a_text_config_object_is_refused_by_name(tmp_path):
    build_multimodal(tmp_path)
    _edit_config(tmp_path, text_config="gemma")
    with pytest.raises(CheckpointError, match="multimodal Gemma 3 config.json needs text_config"):
        HookedDecoder.from_pretrained(tmp_path)
