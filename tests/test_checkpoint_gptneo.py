"""probe/checkpoint_gptneo.py: GPT-Neo checkpoints (EleutherAI's GPT-Neo, the TinyStories models), against
`transformers`' own GPTNeoForCausalLM modules and transformer-lens 4's bridge over the same directory (the logits
and the save round trip: tests/test_variants.py; TL 3.9's own converter: tests/test_tl_state_dict.py)."""
from __future__ import annotations

import json

import pytest
import torch

from probe import HookedDecoder
from probe.loading import CheckpointError
from test_transformer_lens import compare_with_transformer_lens
from test_variants import _edit_config, build
from tl_oracle import bridge


def test_every_hook_matches_transformer_lens(tmp_path):
    build("gptneo", tmp_path)
    # the bridge's hook_attn_scores on this family holds the softmaxed pattern: the scores are checked by hand below
    missing, theirs = compare_with_transformer_lens(tmp_path, 20, seed=5, skip=("hook_attn_scores",))
    assert missing == set() and "blocks.2.attn.hook_pattern" in theirs


def test_scores_are_unscaled_and_local_layers_see_only_the_window(tmp_path):
    """q.k from transformers' own q_proj / k_proj, not divided by sqrt(d_head); a local layer's query sees itself
    and the window_size - 1 keys before it (transformers' mask buffer says which), a global layer every earlier key."""
    hf = build("gptneo", tmp_path)
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(tokens, output_hidden_states=True, output_attentions=True)
        _, cache = ours.run_with_cache(tokens)
    assert [layer.attn.attention_type for layer in hf.transformer.h] == ["global", "local", "local"]
    for l, layer in enumerate(hf.transformer.h):
        attention = layer.attn.attention
        with torch.no_grad():
            x = layer.ln_1(expected.hidden_states[l])
            q, k = (p(x).view(2, 16, 4, 16) for p in (attention.q_proj, attention.k_proj))
        by_hand = torch.einsum("bqhd,bkhd->bhqk", q, k)
        allowed = attention.bias[0, 0, :16, :16]
        scores = cache["attn_scores", l]
        torch.testing.assert_close(scores[..., allowed], by_hand[..., allowed], atol=1e-5, rtol=0)
        assert torch.isneginf(scores[..., ~allowed]).all()
        assert int(allowed.sum(-1).max()) == (5 if l else 16)
        torch.testing.assert_close(cache["pattern", l], expected.attentions[l], atol=1e-6, rtol=0)


def test_a_config_file_as_the_hub_ships_it_loads(tmp_path):
    """EleutherAI's and the TinyStories config.json: intermediate_size null (4 * hidden_size), the expanded
    attention_layers beside attention_types, the 256-key window."""
    import transformers as tf

    build("gptneo", tmp_path, num_layers=4, attention_types=[[["global", "local"], 2]], window_size=256,
          max_position_embeddings=300)
    _edit_config(tmp_path, intermediate_size=None, attention_layers=["global", "local"] * 2, embed_dropout=0,
                 gradient_checkpointing=False)
    hf = tf.GPTNeoForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    assert (ours.cfg.d_mlp, ours.cfg.sliding_window, ours.cfg.sliding_layers) == (256, 256, (False, True, False, True))
    tokens = torch.randint(0, 101, (1, 270), generator=torch.Generator().manual_seed(3))  # past the window
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-4, rtol=0)


def test_transformer_lens_config_names_are_transformer_lens_own(tmp_path):
    """The bridge's, and for the local layers TL 3.9's own (convert_hf_model_config: the settings
    tests/test_tl_state_dict.py runs through HookedTransformer against transformers' logits); the bridge says
    use_attn_scale=True and use_local_attn=False, leaving the scale and the window to transformers."""
    from test_tl_state_dict import tl_config

    hf = build("gptneo", tmp_path)
    ours, theirs = HookedDecoder.from_pretrained(tmp_path).cfg, bridge(str(tmp_path)).cfg
    for name in ("window_size", "d_mlp", "normalization_type", "positional_embedding_type", "act_fn", "eps", "n_heads",
                 "d_head"):
        assert getattr(ours, name) == getattr(theirs, name), name
    for name, value in tl_config("neo", hf).items():
        assert getattr(ours, name) == value, name
    assert (ours.use_attn_scale, ours.use_local_attn, ours.attn_types) == (False, True, ["global", "local", "local"])


@pytest.mark.parametrize("attention_types, match", [
    ([[["global", "sparse"], 1], [["local"], 1]], r"names \['sparse'\]"),
    ([[["global", "local"], 1]], "gives 2 layers but num_layers=3"),
    ([[["global", "local"], 1000000]], "giving each of the num_layers=3 layers a kind"),
    ([["global", 3]], r"list of \[\[kind, ...\], repeats\] pairs"),
    ("global", r"list of \[\[kind, ...\], repeats\] pairs"),
])
def test_attention_types_that_name_no_layer_kinds_are_refused(attention_types, match, tmp_path):
    build("gptneo", tmp_path)
    _edit_config(tmp_path, attention_types=attention_types)
    with pytest.raises(CheckpointError, match=match):
        HookedDecoder.from_pretrained(tmp_path)


def test_saving_writes_each_layers_kind_and_a_model_only_gpt_neo_holds_is_saved_as_gpt_neo(tmp_path):
    build("gptneo", tmp_path / "original", attention_types=[[["local"], 1], [["global"], 2]])
    ours = HookedDecoder.from_pretrained(tmp_path / "original")
    saved = json.loads((ours.save_pretrained(tmp_path / "saved") / "config.json").read_text())
    assert saved["model_type"] == "gpt_neo" and saved["window_size"] == 5
    assert saved["attention_types"] == [[["local"], 1], [["global"], 2]]
    assert HookedDecoder.from_pretrained(tmp_path / "saved").cfg == ours.cfg
