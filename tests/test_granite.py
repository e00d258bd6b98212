"""IBM Granite (probe/checkpoint_granite.py): Llama's layers with an embedding multiplier, a residual multiplier on
each sublayer's write, the scores' own scale and a logit divisor, the linear three folded into the weights.

The oracles: transformers (test_variants.py compares logits and every residual on a tied and an untied case and saves
through it; here greedy generation, TL-default processing, and each scaled write against transformers' own modules)
and TL 4's bridge over the same checkpoint, hook by hook (it exposes the scaled writes under the same names)."""
from __future__ import annotations

import json

import torch

from probe import HookedDecoder
from family_checks import assert_generation_and_processing_match
from test_variants import build


def test_generation_and_processing_are_transformers(tmp_path):
    hf = build("granite", tmp_path)
    assert_generation_and_processing_match(hf, tmp_path)


def test_the_writes_the_residual_receives_are_scaled(tmp_path):
    """hook_embed is transformers' embedding times embedding_multiplier, hook_attn_out and hook_mlp_out each of its
    sublayers' outputs times residual_multiplier, and the logits its lm_head's over logits_scaling (each read off
    transformers' own modules in its forward); the scores' scale is attention_multiplier."""
    hf = build("granite", tmp_path)
    c = hf.config
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    assert not model.cfg.tied_embeddings and model.cfg.attn_scale_dim == c.attention_multiplier ** -2
    seen = {}
    modules = {"embed": hf.model.embed_tokens, "head": hf.lm_head,
               **{f"attn{l}": layer.self_attn for l, layer in enumerate(hf.model.layers)},
               **{f"mlp{l}": layer.mlp for l, layer in enumerate(hf.model.layers)}}
    handles = [m.register_forward_hook(lambda m, i, o, k=k: seen.__setitem__(k, o[0] if isinstance(o, tuple) else o))
               for k, m in modules.items()]
    toks = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    try:
        with torch.no_grad():
            logits, cache = model.run_with_cache(toks)
            hf(toks)
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(cache["hook_embed"], seen["embed"] * c.embedding_multiplier, atol=1e-5, rtol=0)
    for l in range(c.num_hidden_layers):
        for ours, theirs in (("attn_out", "attn"), ("mlp_out", "mlp")):
            torch.testing.assert_close(cache[f"blocks.{l}.hook_{ours}"], seen[f"{theirs}{l}"] * c.residual_multiplier,
                                       atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, seen["head"] / c.logits_scaling, atol=1e-5, rtol=0)


def test_saving_writes_the_folded_weights_with_unit_multipliers(tmp_path):
    hf = build("granite", tmp_path / "hf")
    model = HookedDecoder.from_pretrained(tmp_path / "hf")
    saved = json.loads((model.save_pretrained(tmp_path / "ours") / "config.json").read_text())
    assert saved["architectures"] == ["GraniteForCausalLM"] and saved["tie_word_embeddings"] is False
    assert [saved[k] for k in ("embedding_multiplier", "residual_multiplier", "logits_scaling")] == [1.0, 1.0, 1.0]
    assert saved["attention_multiplier"] == hf.config.attention_multiplier
    again = HookedDecoder.from_pretrained(tmp_path / "ours")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[key], value, atol=0, rtol=0, msg=key)


def test_hooks_match_the_bridge(tmp_path):
    from test_family_defaults import tokenized_checkpoint
    from test_transformer_lens import compare_with_transformer_lens

    directory = tokenized_checkpoint("granite", tmp_path / "checkpoint")
    # (the bridge's unembed.hook_out is lm_head's output before logits_scaling divides it; probe's, the logits)
    missing, theirs = compare_with_transformer_lens(directory, 10, seed=4, skip=("unembed.hook_out",))
    assert {"hook_embed", "blocks.1.hook_attn_out", "blocks.1.hook_mlp_out", "blocks.1.hook_resid_post"} <= theirs
    assert not {n for n in missing if n.startswith("blocks.1.") and not n.startswith("blocks.1.attn.")}, missing
