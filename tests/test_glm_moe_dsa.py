"""GLM-5's sparse attention (probe/sparse_indexer.py) and its checkpoints (probe/checkpoint_glm_dsa.py). The logits and
every residual are compared with transformers' eager forward in test_variants.py (CASES: index_topk 5 and 3 of up to 40
keys, so the indexer drops most of them), with saving; here: the chosen keys against transformers' indexer, hook edits,
layers that share a choice, generation through the cache (the indexer's keys cached too), left padding, TL 4's
GlmMoeDsaAttentionBridge hook by hook, compatibility mode, the ledger, config errors and the report."""
from __future__ import annotations

import json

import pytest
import torch

from probe import DecoderConfig, HookedDecoder, SparseIndexer
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, assert_on_the_device_as_transformers,
                           cache_of_everything, caches_in_compatibility_mode, report_page, seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import CASES, build

SHARED = CASES["glm-moe-dsa-shared-choice-yarn-biases-tied"][1]  # layers 1 and 3 read the layer before's keys
TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))
LONG = torch.randint(0, 101, (2, 30), generator=torch.Generator().manual_seed(4))


def chosen_mask(indices: torch.Tensor, n_keys: int) -> torch.Tensor:
    """[batch query_pos key_pos] bool: the chosen keys a causal query may see (transformers' indexer also returns
    unseen keys for a query that sees fewer than topk, and the attention hides them)."""
    mask = torch.zeros(*indices.shape[:2], n_keys, dtype=torch.bool).scatter(-1, indices.long(), True)
    return mask & torch.ones(indices.shape[1], n_keys, dtype=torch.bool).tril(n_keys - indices.shape[1])


@pytest.mark.parametrize("overrides", [{}, SHARED], ids=["own-indexers", "shared-choices"])
def test_generation_and_processing_are_transformers(overrides, tmp_path):
    hf = build("glm_moe_dsa", tmp_path, **overrides)
    with pytest.warns(UserWarning, match="center_writing_weights"):  # (processing folds ln1 into the indexer too)
        assert_generation_and_processing_match(hf, tmp_path)


@pytest.mark.parametrize("overrides", [{}, SHARED], ids=["own-indexers", "shared-choices"])
def test_the_chosen_keys_and_patterns_are_transformers(overrides, tmp_path):
    """Each layer reads the keys transformers' indexer returns (shared layers the layer before's), and no others:
    its pattern is transformers' and zero off the chosen keys, which are topk of the 30 for the later queries."""
    hf = build("glm_moe_dsa", tmp_path, **overrides)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    layers = hf.model.layers
    seen = seen_in_forward(hf, LONG, {l: layer.self_attn.indexer for l, layer in enumerate(layers)
                                      if layer.self_attn.indexer is not None})
    with torch.no_grad():
        theirs = hf(LONG, output_attentions=True)
        _, cache = model.run_with_cache(LONG)
    topk = model.cfg.latent_attention.indexer.topk
    for l in range(model.cfg.n_layers):
        source = max(s for s in seen if s <= l)  # the layer whose indexer chose this layer's keys
        ours = chosen_mask(cache[f"blocks.{l}.attn.hook_topk_indices"], 30)
        assert torch.equal(ours, chosen_mask(seen[source][1], 30)), l
        assert ours[:, topk:].sum(-1).eq(topk).all()
        pattern = cache[f"blocks.{l}.attn.hook_pattern"]
        torch.testing.assert_close(pattern, theirs.attentions[l], atol=1e-5, rtol=0)
        assert pattern.masked_select(~ours[:, None]).abs().max() == 0
    last = model.cfg.n_layers - 1  # (its keys chosen by another indexer than layer 0's)
    assert not torch.equal(cache["blocks.0.attn.hook_topk_indices"], cache[f"blocks.{last}.attn.hook_topk_indices"])


def test_the_indexers_points_hold_transformers_values(tmp_path):
    """Its normed keys are transformers' k_norm's output rotated; its queries read the attention's query latent; its
    weights are weights_proj's output over sqrt(index heads); its scores rank the chosen keys first."""
    hf = build("glm_moe_dsa", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    indexer = hf.model.layers[1].self_attn.indexer
    seen = seen_in_forward(hf, TOKENS, {"k": indexer.k_norm, "w": indexer.weights_proj, "q": indexer.wq_b,
                                        "latent": hf.model.layers[1].self_attn.q_a_layernorm})
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS)
    a = "blocks.1.attn.indexer"
    torch.testing.assert_close(cache[f"{a}.hook_k"][..., 8:], seen["k"][1][..., 8:], atol=1e-5, rtol=0)  # unrotated
    at_0 = seen["k"][1][:, 0]  # position 0 is not turned, but its rotated pairs are written evens first
    torch.testing.assert_close(cache[f"{a}.hook_k"][:, 0, :8], torch.cat([at_0[:, 0:8:2], at_0[:, 1:8:2]], -1), atol=1e-5,
                               rtol=0)
    torch.testing.assert_close(seen["q"][0][0], seen["latent"][1], atol=0, rtol=0)
    torch.testing.assert_close(cache[f"{a}.hook_q"][..., 8:], seen["q"][1].unflatten(-1, (4, 16))[..., 8:], atol=1e-5,
                               rtol=0)
    torch.testing.assert_close(cache[f"{a}.hook_weights"], seen["w"][1] / 2, atol=1e-5, rtol=0)
    scores, chosen = cache[f"{a}.hook_scores"], cache["blocks.1.attn.hook_topk_indices"]
    by_hand = torch.einsum("bqh,bqhk->bqk", cache[f"{a}.hook_weights"],
                           torch.einsum("bqhd,bkd->bqhk", cache[f"{a}.hook_q"], cache[f"{a}.hook_k"]).div(4).relu())
    visible = torch.ones(13, 13, dtype=torch.bool).tril()
    torch.testing.assert_close(scores[:, visible], by_hand[:, visible], atol=1e-5, rtol=0)
    assert torch.equal(scores.topk(5, dim=-1).indices, chosen)
    assert scores[:, 3, 4:].eq(float("-inf")).all() and scores[:, 3, :4].isfinite().all()


def test_folding_ln1_reaches_the_indexers_readers(tmp_path):
    """fold_ln folds ln1's weights into the indexer's key and weight projections too (they read the normed residual),
    so the processed model chooses the same keys and gives transformers' log-probs over 30 positions."""
    hf = build("glm_moe_dsa", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with pytest.warns(UserWarning, match="center_writing_weights"):
        processed = HookedDecoder.from_pretrained(tmp_path, fold_ln=True, center_writing_weights=True).eval()
    names = lambda n: n.endswith("hook_topk_indices")  # noqa: E731
    with torch.no_grad():
        _, chosen = model.run_with_cache(LONG, names=names)
        logits, folded = processed.run_with_cache(LONG, names=names)
        torch.testing.assert_close(logits.log_softmax(-1), hf(LONG).logits.log_softmax(-1), atol=1e-4, rtol=0)
    for name in chosen:
        assert torch.equal(folded[name], chosen[name]), name


def test_editing_the_choice_changes_what_is_read(tmp_path):
    """hook_dsa_mask is added to the scores, as the bridge's: zeros everywhere give every visible key, the model
    transformers builds with an index_topk past the context; an edit of hook_topk_indices reaches the layer after
    it that shares the choice, as transformers passes the edited indices on."""
    import transformers as tf

    build("glm_moe_dsa", tmp_path, **SHARED)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    dense = tf.GlmMoeDsaForCausalLM.from_pretrained(tmp_path, index_topk=64, attn_implementation="eager").eval()
    every = [(f"blocks.{l}.attn.hook_dsa_mask", lambda mask, hook: torch.zeros_like(mask)) for l in range(4)]

    def first_key(indices, hook):
        return torch.zeros_like(indices)

    with torch.no_grad():
        sparse = model(LONG)
        with model.hooks(fwd_hooks=every):
            torch.testing.assert_close(model(LONG), dense(LONG).logits, atol=1e-4, rtol=0)
        with model.hooks(fwd_hooks=[("blocks.0.attn.hook_topk_indices", first_key)]):
            _, cache = model.run_with_cache(LONG, names=lambda n: "pattern" in n)
    assert (sparse - dense(LONG).logits).abs().max() > 1e-2  # the choice matters
    for l in (0, 1):  # each query reads the first key alone
        torch.testing.assert_close(cache[f"blocks.{l}.attn.hook_pattern"][..., 0], torch.ones(2, 4, 30))
    assert cache["blocks.2.attn.hook_pattern"][:, :, 10:, 0].max() < 1


def test_shared_layers_need_the_layer_before_in_the_same_pass(tmp_path):
    """A run from a shared layer has no choice to read and says where to start; a run from a layer with an indexer
    gives the whole run's logits."""
    build("glm_moe_dsa", tmp_path, **SHARED)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    assert not hasattr(model.blocks[1].attn, "indexer") and hasattr(model.blocks[2].attn, "indexer")
    with torch.no_grad():
        logits, cache = model.run_with_cache(TOKENS, names=lambda n: n.endswith("hook_resid_pre"))
        torch.testing.assert_close(model(cache["blocks.2.hook_resid_pre"], start_at_layer=2), logits, atol=1e-5,
                                   rtol=0)
        with pytest.raises(ValueError, match="layer 1 runs no indexer of its own: .*start_at_layer"):
            model(cache["blocks.1.hook_resid_pre"], start_at_layer=1)
    assert model.blocks[0].attn.relay.chosen is None  # (nothing held after a pass)


def test_a_cached_prefix_then_its_continuation_is_one_forward(tmp_path):
    """The cache keeps each indexer's keys beside the attention's, so the choice among cached keys is the one a whole
    pass makes; a shared layer keeps none of its own."""
    build("glm_moe_dsa", tmp_path, **SHARED)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, prefix = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.layers[0].index_k.shape == (2, 13, 16) and cache.layers[1].index_k is None
    assert prefix.layers[2].index_k.shape == (2, 10, 16)


def test_left_padded_batched_generation_is_transformers(tmp_path):
    hf = build("glm_moe_dsa", tmp_path, index_topk=3)
    assert_left_padded_generation_matches(hf, tmp_path)


def test_every_shared_hook_matches_the_bridge(tmp_path):
    """TL 4's GlmMoeDsaAttentionBridge hook by hook, its chosen keys and their mask too (the bridge's
    hook_topk_indices are transformers' indexer's: compared where a query sees at least topk keys; its scores where
    a query reads a key)."""
    from transformer_lens.model_bridge import TransformerBridge

    directory = tokenized_checkpoint("glm_moe_dsa", tmp_path / "dsa", **SHARED)
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.from_pretrained(directory).eval()
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, ours = model.run_with_cache(tokens)
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    compared = set()
    for name in (n for n in ours if n in theirs and not n.endswith("hook_expert_weights")):
        a, b = ours[name], theirs[name]
        if name.endswith("hook_expert_indices") or name.endswith("hook_topk_indices"):
            a, b = a.sort(-1).values, b.sort(-1).values.to(a.dtype)
            if name.endswith("hook_topk_indices"):
                a, b = a[:, 2:], b[:, 2:]  # (topk 3: the first two queries see fewer keys)
        elif name.endswith(("attn.hook_q", "attn.hook_k", "attn.hook_v")):
            b = b.transpose(1, 2)
        elif name.endswith("attn.hook_z"):
            a, b = a.flatten(-2), b.flatten(-2)
        elif name.endswith(("hook_attn_scores", "hook_dsa_mask")):
            read = ours[name.replace("hook_attn_scores", "hook_dsa_mask")].eq(0) & torch.ones(13, 13).tril().bool()
            read = read[:, None].expand(a.shape) if a.dim() == 4 else read
            a, b = a[read], b[read]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
        compared.add(name.split(".", 2)[-1])
    assert {"attn.hook_topk_indices", "attn.hook_dsa_mask", "attn.hook_q_latent", "attn.hook_kv_latent",
            "attn.hook_rot_q", "attn.hook_rot_k", "attn.hook_q", "attn.hook_attn_scores", "attn.hook_pattern",
            "attn.hook_z", "hook_resid_post"} <= compared


def test_compatibility_mode_processes_as_the_bridge_does(tmp_path):
    directory = tokenized_checkpoint("glm_moe_dsa", tmp_path / "dsa")
    model, ours, cache, theirs, their_cache = caches_in_compatibility_mode(directory, LONG)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for name in ("blocks.0.attn.hook_topk_indices", "blocks.1.attn.hook_pattern", "blocks.1.hook_resid_post",
                 "ln_final.hook_out"):
        a, b = cache[name], their_cache[name]
        if name.endswith("hook_topk_indices"):
            a, b = a[:, 4:].sort(-1).values, b[:, 4:].sort(-1).values.to(a.dtype)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=name)


def test_the_ledger_counts_every_parameter_and_transformers_cache(tmp_path):
    """Parameters: the model's own (the indexers' too); KV-cache bytes per token: what transformers' cache holds
    after a prompt, the indexers' keys with the latents."""
    hf = build("glm_moe_dsa", tmp_path, **SHARED)
    model = HookedDecoder.from_pretrained(tmp_path)
    ledger = model.ledger()
    assert ledger.total_params == sum(p.numel() for p in model.parameters())
    assert ledger.total_params == sum(p.numel() for p in hf.parameters())  # (the tied unembedding counted once)
    with torch.no_grad():
        cache = hf(TOKENS[:1], use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values, layer.indexer_keys) if t is not None)
    assert ledger.kv_bytes_per_token == held // TOKENS.shape[1]


def test_hook_shapes_predict_the_indexers_points(tmp_path):
    build("glm_moe_dsa", tmp_path, **SHARED)
    model, _, cache, shapes = cache_of_everything(tmp_path)
    indexer_points = [n for n in cache if "indexer." in n or "topk" in n or "dsa_mask" in n]
    assert len(indexer_points) == 4 * 2 + 2 * 4
    for name in indexer_points:
        assert tuple(cache[name].shape) == shapes[name], name


def test_config_errors_name_the_fix(tmp_path):
    base = dict(n_layers=2, d_model=32, n_heads=4, d_head=8, d_vocab=50, n_ctx=16, positions="rotary", norm="rms",
                gated_mlp=True)
    latent = dict(kv_rank=16, d_nope=8, d_rope=4, q_rank=12, indexer=dict(n_heads=2, d_head=8, topk=3))
    cfg = DecoderConfig(**base, latent_attention=latent)
    assert cfg.latent_attention.indexer == SparseIndexer(n_heads=2, d_head=8, topk=3)
    for bad, match in ((dict(latent, q_rank=None), "reads its queries from the attention's query latent"),
                       (dict(latent, indexer=dict(n_heads=2, d_head=2, topk=3)), "d_head=2 must be at least"),
                       (dict(latent, indexer=dict(n_heads=2, d_head=8, topk=0)), "topk must be a positive int"),
                       (dict(latent, indexer=dict(n_heads=2, d_head=8, topk=3, shared=(True, False))), "the first"),
                       (dict(latent, indexer=dict(n_heads=2, d_head=8, topk=3, shared=(False,) * 3)), "gives 3 layers")):
        with pytest.raises(ValueError, match=match):
            DecoderConfig(**base, latent_attention=bad)
    model = HookedDecoder(cfg).eval()
    with pytest.raises(ValueError, match="heads cannot read inputs of their own here"):
        model.run_with_cache(torch.arange(6)[None], names=["blocks.0.hook_q_input"])
    from probe.checkpoints import FAMILIES

    with pytest.raises(ValueError, match="without a sparse indexer"):
        FAMILIES["deepseek_v3"].config_to_hf(cfg, None)
    plain = DecoderConfig(**base, latent_attention=dict(latent, indexer=None, deinterleaved=True))
    with pytest.raises(ValueError, match="and a sparse indexer"):
        FAMILIES["glm_moe_dsa"].config_to_hf(plain, None)


def test_saving_keeps_the_shared_layers_and_reads_transformers_schedules(tmp_path):
    """indexer_types come back from a saved file; index_topk_pattern and index_topk_freq / index_skip_topk_offset
    (what released files may give instead) are read as transformers reads them."""
    import transformers as tf

    hf = build("glm_moe_dsa", tmp_path / "src", **SHARED)
    model = HookedDecoder.from_pretrained(tmp_path / "src")
    saved = model.save_pretrained(tmp_path / "saved")
    assert json.loads((saved / "config.json").read_text())["indexer_types"] == ["full", "shared", "full", "shared"]
    again = tf.GlmMoeDsaForCausalLM.from_pretrained(saved).eval()
    assert again.model.layers[1].self_attn.indexer is None
    with torch.no_grad():
        torch.testing.assert_close(again(LONG).logits, hf(LONG).logits, atol=1e-5, rtol=0)
    from probe.checkpoint_glm_dsa import indexer_types

    for fields in (dict(index_topk_pattern="FSSF"), dict(index_topk_freq=2, index_skip_topk_offset=1), {}):
        theirs = tf.GlmMoeDsaConfig(num_hidden_layers=4, **fields).indexer_types
        assert indexer_types(dict(num_hidden_layers=4, **fields)) == theirs, fields


def test_weight_analyses_refuse_by_name_and_activation_analyses_run(tmp_path):
    """Analyses of W_Q, W_K and W_V refuse, naming the indexer; the heads' activations work: direct logit attribution
    adds up to transformers' logit difference, and head patching runs."""
    import probe.analyses as A

    hf = build("glm_moe_dsa", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    corrupted = LONG.clone()
    corrupted[:, 4] = (corrupted[:, 4] + 5) % 101
    metric = A.logit_diff_metric(model, torch.tensor([5, 5]), torch.tensor([9, 9]))
    for call in (lambda: A.composition_scores(model), lambda: A.edge_attribution(model, LONG, corrupted, metric)):
        with pytest.raises(ValueError, match="a sparse indexer .* chooses the keys each query reads, so its heads"):
            call()
    dla = A.direct_logit_attribution(model, LONG, torch.tensor([5, 5]), torch.tensor([9, 9]))
    with torch.no_grad():
        logits = hf(LONG).logits[:, -1]
    torch.testing.assert_close(dla.total, logits[:, 5] - logits[:, 9], atol=1e-4, rtol=0)
    assert A.patch(model, LONG, corrupted, metric, "heads").to_frame().shape[0] == 2 * 4


def test_a_multi_token_prediction_layer_in_the_file_is_not_read(tmp_path):
    """GLM-5's released files carry the MTP layer after the last one (transformers ignores `model.layers.78.*`);
    probe sets it aside too, whether or not config.json counts it."""
    from safetensors.torch import load_file, save_file

    hf = build("glm_moe_dsa", tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights.update({k.replace("layers.1.", "layers.2."): v.clone() for k, v in weights.items() if ".layers.1." in k})
    weights["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(weights, str(tmp_path / "model.safetensors"))
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(LONG), hf(LONG).logits, atol=1e-4, rtol=0)


def test_the_report_says_why_it_leaves_out_the_circuit(tmp_path):
    page = report_page(tokenized_checkpoint("glm_moe_dsa", tmp_path / "dsa"), tmp_path / "out")
    assert "Not run. Circuit discovery: this model&#x27;s latent attention reads queries" in page
    assert (tmp_path / "out" / "patching.csv").exists() and (tmp_path / "out" / "heads_induction.csv").exists()


def test_the_sparse_model_on_the_device_is_transformers_there(tmp_path, device_under_test):
    """On the GPU (the GPU list): GLM-5's indexers, shared choices and routed experts against transformers' model on
    the same device, and the greedy continuation through the cache."""
    assert_on_the_device_as_transformers(build("glm_moe_dsa", tmp_path, **SHARED), tmp_path, device_under_test, 40)
