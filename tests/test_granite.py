"""IBM Granite and GraniteMoE (probe/checkpoint_granite.py): Llama's layers with an embedding multiplier, a residual multiplier on
each sublayer's write, the scores' own scale and a logit divisor, the linear three folded into the weights.

The oracles: transformers (test_variants.py compares logits and every residual on a tied and an untied case and saves
through it; here greedy generation, TL-default processing, and each scaled write against transformers' own modules)
and TL 4's bridge over the same checkpoint, hook by hook (it exposes the scaled writes under the same names)."""
from __future__ import annotations

import json

import pytest
import torch

from probe import HookedDecoder
from family_checks import assert_generation_and_processing_match, seen_in_forward
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
    modules = {"embed": hf.model.embed_tokens, "head": hf.lm_head,
               **{f"attn{l}": layer.self_attn for l, layer in enumerate(hf.model.layers)},
               **{f"mlp{l}": layer.mlp for l, layer in enumerate(hf.model.layers)}}
    toks = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    seen = {k: o[0] if isinstance(o, tuple) else o for k, (_, o) in seen_in_forward(hf, toks, modules).items()}
    with torch.no_grad():
        logits, cache = model.run_with_cache(toks)
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


@pytest.mark.parametrize("kind", ["granite", "granitemoe"])
def test_hooks_match_the_bridge(kind, tmp_path):
    from test_family_defaults import tokenized_checkpoint
    from test_transformer_lens import compare_with_transformer_lens

    directory = tokenized_checkpoint(kind, tmp_path / "checkpoint")
    # (the bridge's unembed.hook_out is lm_head's output before logits_scaling divides it, probe's the logits; its
    # routing hooks read transformers 5's router outputs, (logits, weights, indices), in the order of older ones
    # (indices first), so its hook_expert_indices holds the logits: probe's routing is compared with transformers'
    # router below)
    missing, theirs = compare_with_transformer_lens(directory, 10, seed=4, skip=(
        "unembed.hook_out", "hook_expert_weights", "hook_expert_indices"))
    assert {"hook_embed", "blocks.1.hook_attn_out", "blocks.1.hook_mlp_out", "blocks.1.hook_resid_post"} <= theirs
    assert not {n for n in missing if n.startswith("blocks.1.") and not n.startswith(("blocks.1.attn.",
                                                                                        "blocks.1.mlp."))}, missing


def test_granitemoes_routing_and_experts_are_transformers(tmp_path):
    """Each token's chosen experts and their weights are transformers' router's top logits and the softmax over them;
    each expert's rows through its gate and up halves of input_linear; generation and processing as transformers'."""
    hf = build("granitemoe", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    toks = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
        for layer in range(2):
            theirs = hf.model.layers[layer].block_sparse_moe
            x = model.blocks[layer].ln2(cache[f"blocks.{layer}.hook_resid_mid"]).reshape(-1, 64)
            _, weights, chosen = theirs.router(x)
            assert torch.equal(cache[f"blocks.{layer}.mlp.hook_expert_indices"], chosen)
            torch.testing.assert_close(cache[f"blocks.{layer}.mlp.hook_expert_weights"].gather(1, chosen), weights,
                                       atol=1e-6, rtol=0)
            for e in range(4):
                rows = torch.cat([(chosen[:, k] == e).nonzero()[:, 0] for k in range(2)])
                gate, up = (x[rows] @ theirs.experts.gate_up_proj[e].T).chunk(2, dim=-1)
                torch.testing.assert_close(cache[f"blocks.{layer}.mlp.experts.{e}.hook_gate"], gate, atol=1e-5, rtol=0)
                torch.testing.assert_close(cache[f"blocks.{layer}.mlp.experts.{e}.hook_pre"], up, atol=1e-5, rtol=0)
    assert_generation_and_processing_match(hf, tmp_path)
