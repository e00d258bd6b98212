"""GPT-2 with scale_attn_by_inverse_layer_idx (Stanford CRFM's GPT-2 runs, `stanford-gpt2-small-a` ...: layer l's
q.k also divided by l + 1; their configs set reorder_and_upcast_attn too): against transformers' own forward and
attention weights on a random checkpoint, its save_pretrained round trip, and HookedTransformer's
`HookedTransformerConfig(scale_attn_by_inverse_layer_idx=True)`."""
from __future__ import annotations

import json

import pytest
import torch

from probe import DecoderConfig, HookedDecoder, HookedTransformerConfig
from test_sae_training import needs_saelens
from test_tl_state_dict import built_by_hooked_transformer


def stanford_like(directory):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=101, n_embd=64, n_layer=3, n_head=4, n_positions=32,
                        scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True)
    model = tf.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # sharper attention than the initialisation's, so the per-layer scale shows
        for name, p in model.named_parameters():
            if "c_attn" in name:
                p.mul_(8.0)
    model.save_pretrained(directory)
    return model


def test_logits_and_patterns_match_transformers(tmp_path):
    hf = stanford_like(tmp_path)
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    assert ours.cfg.attn_scale_by_layer and ours.cfg.scale_attn_by_inverse_layer_idx
    tokens = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(tokens, output_attentions=True)
        logits, cache = ours.run_with_cache(tokens)
    torch.testing.assert_close(logits, theirs.logits, atol=1e-4, rtol=1e-4)
    for layer, attentions in enumerate(theirs.attentions):
        torch.testing.assert_close(cache["pattern", layer], attentions, atol=1e-5, rtol=1e-4)
    # without the per-layer scale the later layers' patterns differ: the test can tell
    plain = HookedDecoder(DecoderConfig.from_dict(dict(ours.cfg.to_dict(), attn_scale_by_layer=False))).eval()
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert not torch.allclose(plain(tokens), theirs.logits, atol=1e-2)


def test_save_pretrained_keeps_the_scale_for_transformers(tmp_path):
    import transformers as tf

    stanford_like(tmp_path / "original")
    ours = HookedDecoder.from_pretrained(tmp_path / "original").eval()
    ours.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["scale_attn_by_inverse_layer_idx"] is True
    again = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "saved").eval()
    tokens = torch.randint(0, 101, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), again(tokens).logits, atol=1e-4, rtol=1e-4)


def test_other_formats_refuse_the_scale():
    cfg = DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, attn_scale_by_layer=True,
                        norm="rms", gated_mlp=True, activation="silu", positions="rotary", qkv_bias=False,
                        out_bias=False, mlp_bias=False)
    with pytest.raises(ValueError, match="cannot hold this model: attn_scale_by_layer=True"):
        HookedDecoder(cfg).save_pretrained("/nonexistent/never-written")
    with pytest.raises(ValueError, match="attn_scale_by_layer must be a bool"):
        DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, attn_scale_by_layer=1)


@needs_saelens
def test_hooked_transformer_config_builds_the_same_scale(tmp_path):
    settings = dict(n_layers=3, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="gelu",
                    scale_attn_by_inverse_layer_idx=True)
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    state = built_by_hooked_transformer(settings, tokens, tmp_path)
    from safetensors.torch import load_file

    theirs = load_file(str(tmp_path / "built.safetensors"))["logits"]
    model = HookedDecoder(HookedTransformerConfig(**settings)).eval()
    model.load_state_dict(state, strict=True)
    assert model.cfg.scale_attn_by_inverse_layer_idx
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), theirs, atol=1e-4, rtol=1e-4)
