"""The analyses on attention-only models (no MLPs) and on shortformer positions (added to every layer's queries and
keys, never to the residual stream): each either gives the number a hand computation from the weights and a plain
forward gives, or refuses up front saying why and what to do instead.

Two tiny random models, as transformer-lens's toy models are built: attention-only with shortformer positions and no
norm, and attention-only with learned positions and LayerNorm; and, for the refusals and the attribution graph of
shortformer positions alone, a shortformer model with MLPs."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from probe import HookedDecoder, HookedTransformerConfig, SAEConfig, SparseAutoencoder
from probe.analyses import (
    Site, ablate_heads, agreement, attention_patterns, attribution_graph, attribution_patch,
    direct_logit_attribution, feature_inputs, feature_logits,
    head_ablation_effects, intervene, logit_diff_metric, logit_lens, memory_lookup, memory_report, patch,
    prune_heads, residual_decomposition, sae_features, steer, steering_vector, sub_updates, top_triggers,
    train_tuned_lens, value_tokens,
)
from probe.analyses.residual_components import Components, has_pos_embed
from toy_helpers import assert_graph_complete, attribution_by_hand, copied_from, random_transcoders, randomised, zero_head

KINDS = ("shortformer", "layernorm")
ANSWER, WRONG = 3, 5
NO_MLPS = "this attention-only model has no MLPs"


@functools.cache
def attn_only(kind: str) -> HookedDecoder:
    cfg = HookedTransformerConfig(
        d_model=32, d_head=8, n_heads=4, n_layers=2, n_ctx=64, d_vocab=60, attn_only=True, use_attn_result=True,
        normalization_type=None if kind == "shortformer" else "LN",
        positional_embedding_type="shortformer" if kind == "shortformer" else "standard")
    return randomised(HookedDecoder(cfg), seed=1)


@functools.cache
def shortformer_with_mlps(norm) -> HookedDecoder:
    cfg = HookedTransformerConfig(d_model=32, d_head=8, n_heads=4, n_layers=2, n_ctx=64, d_vocab=60, d_mlp=64,
                                  act_fn="gelu", normalization_type=norm, positional_embedding_type="shortformer")
    return randomised(HookedDecoder(cfg), seed=2).double()


@pytest.fixture(params=KINDS)
def model(request) -> HookedDecoder:
    return attn_only(request.param)


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 9 tokens, the first left-padded by 2: its positions count from its first real token."""
    tokens = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :2] = 0
    return tokens, mask


def layer_norm(x: torch.Tensor, norm, scale=None) -> torch.Tensor:
    """The model's LayerNorm written out (its own scale when given: the frozen linearisation)."""
    centred = x - x.mean(-1, keepdim=True)
    scale = centred.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() if scale is None else scale
    return centred / scale * norm.w + norm.b


def logit_diff(model: HookedDecoder, tokens, mask, fwd_hooks=()) -> torch.Tensor:
    """[batch] logit(ANSWER) - logit(WRONG) at each prompt's last token, from the model's full logits."""
    logits = model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=list(fwd_hooks))
    return logits[:, -1, ANSWER] - logits[:, -1, WRONG]


def head_writes(model: HookedDecoder, cache, layer: int) -> torch.Tensor:
    """[batch pos head d_model]: each head's write, from hook_z and W_O (not the cached hook_result)."""
    return torch.einsum("bphd,hdm->bphm", cache[f"blocks.{layer}.attn.hook_z"], model.blocks[layer].attn.W_O)


# ---- residual decomposition and direct logit attribution -----------------------------------------------------
def test_the_components_are_what_the_residual_stream_holds(model):
    shortformer = model.cfg.positional_embedding_type == "shortformer"
    expected = ["embed"] + ([] if shortformer else ["pos_embed"])
    for layer in range(2):
        expected += [f"L{layer}H{h}" for h in range(4)] + [f"L{layer} attn bias"]
    assert Components.for_model(model).names == expected  # no `L{l} mlp`; no pos_embed where positions stay out
    assert has_pos_embed(model) is not shortformer
    assert "hook_pos_embed" in model.hook_names  # it fires all the same: the old test by name counted it


@torch.no_grad()
def test_the_decomposition_adds_up_to_the_residual_after_every_block(model):
    tokens, mask = batch()
    result = residual_decomposition(model, tokens, attention_mask=mask)
    _, cache = model.run_with_cache(tokens, attention_mask=mask)
    index = result.index.names
    comps = result.components  # [batch pos component d_model]
    assert torch.equal(comps[:, :, index.index("embed")], model.W_E[tokens])
    if "pos_embed" in index:  # each prompt's positions count its real tokens: the padded one starts later
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        assert torch.allclose(comps[:, :, index.index("pos_embed")], model.W_pos[positions])
    for layer in range(2):
        writes = head_writes(model, cache, layer)
        for h in range(4):
            assert torch.allclose(comps[:, :, index.index(f"L{layer}H{h}")], writes[:, :, h], atol=1e-5)
    real = mask.bool()
    final = cache["blocks.1.hook_resid_post"]
    assert torch.allclose(result.total()[real], final[real], atol=1e-4)
    sites = ["blocks.0.hook_resid_pre", "blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    accumulated = result.accumulated()  # [batch site pos d_model]
    for i, site in enumerate(sites):
        assert torch.allclose(accumulated[:, i][real], cache[site][real], atol=1e-4)
    with pytest.raises(ValueError, match=f"{NO_MLPS}.*leave include_mid=False"):
        result.accumulated(include_mid=True)


@torch.no_grad()
def test_direct_logit_attribution_is_each_write_through_the_frozen_final_norm(model):
    tokens, mask = batch(1)
    result = direct_logit_attribution(model, tokens, ANSWER, WRONG, attention_mask=mask)
    _, cache = model.run_with_cache(tokens, attention_mask=mask)
    direction = model.W_U[:, ANSWER] - model.W_U[:, WRONG]
    has_norm = model.cfg.normalization_type is not None
    scale = cache["ln_final.hook_scale"][:, -1] if has_norm else None  # [batch 1]

    def direct(write: torch.Tensor) -> torch.Tensor:  # [batch d_model] -> [batch]: its share of the logit difference
        if has_norm:
            write = (write - write.mean(-1, keepdim=True)) / scale * model.ln_final.w
        return write @ direction

    positions = mask.cumsum(1)[:, -1] - 1
    writes = {"embed": model.W_E[tokens[:, -1]]}
    if has_pos_embed(model):
        writes["pos_embed"] = model.W_pos[positions]
    for layer in range(2):
        for h in range(4):
            writes[f"L{layer}H{h}"] = head_writes(model, cache, layer)[:, -1, h]
        writes[f"L{layer} attn bias"] = model.blocks[layer].attn.b_O.expand(2, -1)
    assert list(writes) == result.index.names
    expected = torch.stack([direct(w) for w in writes.values()], dim=1)
    assert torch.allclose(result.contributions, expected, atol=1e-4)
    ln_bias = model.ln_final.b @ direction if has_norm else torch.zeros(())
    assert torch.allclose(result.ln_bias, ln_bias.expand(2), atol=1e-5)
    assert torch.allclose(result.unembed_bias, (model.unembed.bias[ANSWER] - model.unembed.bias[WRONG]).expand(2))
    # everything adds up to the model's own logit difference, from a plain forward
    assert torch.allclose(result.total, logit_diff(model, tokens, mask), atol=1e-4)
    # and read after each block through the same frozen norm
    for i, site in enumerate(["blocks.0.hook_resid_pre", "blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]):
        resid = cache[site][:, -1]
        normed = layer_norm(resid, model.ln_final, scale) if has_norm else resid
        want = normed @ direction + result.unembed_bias
        assert torch.allclose(result.accumulated[:, i], want, atol=1e-4)


# ---- lenses and attention ------------------------------------------------------------------------------------
@torch.no_grad()
def test_the_logit_lens_decodes_each_residual_through_the_final_norm(model):
    tokens, _ = batch(2)
    result = logit_lens(model, tokens)
    _, cache = model.run_with_cache(tokens)
    assert result.sites == ["blocks.0.hook_resid_pre", "blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    for i, site in enumerate(result.sites):
        resid = cache[site]
        normed = layer_norm(resid, model.ln_final) if model.cfg.normalization_type else resid
        assert torch.allclose(result.logits[:, i], normed @ model.W_U + model.unembed.bias, atol=1e-4)
    with pytest.raises(ValueError, match=f"include_mid=True: {NO_MLPS}.*leave include_mid=False"):
        logit_lens(model, tokens, include_mid=True)
    with pytest.raises(ValueError, match=f"include_mid=True: {NO_MLPS}"):
        train_tuned_lens(model, include_mid=True)


def test_a_read_between_attention_and_mlp_is_refused_for_the_missing_mlps_not_for_parallel_blocks(model):
    """`probe lens --mid` said these blocks were parallel; the one check behind the library and the command names
    the reason: no MLP, so nothing between attention and MLP."""
    from probe.analyses.lens import require_resid_mid

    with pytest.raises(ValueError, match=rf"^--mid with --model toy: {NO_MLPS}, so its blocks have no residual between "
                                         r"attention and MLP \(hook_resid_mid.*; drop --mid$") as refused:
        require_resid_mid(model, "--mid with --model toy", "drop --mid")
    assert "parallel" not in str(refused.value)


@torch.no_grad()
def test_shortformer_positions_join_the_queries_and_keys_of_every_layer():
    model = attn_only("shortformer")
    tokens = batch(3)[0][1]
    result = attention_patterns(model, tokens)
    n = len(tokens)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    x, p = model.W_E[tokens], model.W_pos[:n]  # no norm: ln1 is the identity
    attn = model.blocks[0].attn
    q = torch.einsum("pm,hmd->hpd", x + p, attn.W_Q) + attn.b_Q[:, None]
    k = torch.einsum("pm,hmd->hpd", x + p, attn.W_K) + attn.b_K[:, None]
    scores = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~causal, -math.inf)
    assert torch.allclose(result.pattern[0], scores.softmax(-1), atol=1e-5)
    # and only there: the values read the tokens alone, so layer 0 writes z = pattern @ (x W_V + b_V)
    _, cache = model.run_with_cache(tokens[None])
    v = torch.einsum("pm,hmd->hpd", x, attn.W_V) + attn.b_V[:, None]
    assert torch.allclose(cache["blocks.0.attn.hook_z"][0], (scores.softmax(-1) @ v).transpose(0, 1), atol=1e-5)


# ---- ablation, patching, pruning -----------------------------------------------------------------------------
@torch.no_grad()
def test_head_ablation_is_a_hand_written_hook_zeroing_hook_z(model):
    tokens, mask = batch(4)  # padded: the runs restarting at a layer must place the positions as a full forward does
    metric = logit_diff_metric(model, ANSWER, WRONG)
    logits = ablate_heads(model, tokens, [(0, 1), (1, 2)], attention_mask=mask)
    by_hand = model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=[("blocks.0.attn.hook_z", zero_head(1)),
                                                                           ("blocks.1.attn.hook_z", zero_head(2))])
    real = mask.bool()
    assert torch.allclose(logits[real], by_hand[real], atol=1e-4)
    effects = head_ablation_effects(model, tokens, metric, attention_mask=mask)
    clean = logit_diff(model, tokens, mask)
    assert torch.allclose(effects.baseline, clean, atol=1e-4)
    for layer in range(2):
        for h in range(4):
            ablated = logit_diff(model, tokens, mask, [(f"blocks.{layer}.attn.hook_z", zero_head(h))])
            assert torch.allclose(effects.per_prompt[layer, h], ablated, atol=1e-4)


def test_patching_is_a_hand_written_patch_and_its_gradient_estimate(model):
    clean, mask = batch(5)
    corrupted = clean.clone()
    corrupted[:, 4:] = torch.randint(0, 60, (2, 5), generator=torch.Generator().manual_seed(6))
    metric = logit_diff_metric(model, ANSWER, WRONG)
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean, attention_mask=mask)

    def patched_value(name: str, where) -> float:
        with torch.no_grad():
            return float(logit_diff(model, corrupted, mask, [(name, copied_from(clean_cache, name, where))]).mean())

    heads = patch(model, clean, corrupted, metric, "heads", attention_mask=mask)
    for site, value in zip(heads.sites, heads.patched.tolist()):
        assert value == pytest.approx(patched_value(site.hook_name, (slice(None), slice(None), site.head)), abs=1e-4)
    sites = [Site("resid_pre", 1, pos=6), Site("attn_out", 0, pos=8), Site("attn_out", 1)]
    exact = patch(model, clean, corrupted, metric, sites, attention_mask=mask)
    for site, value in zip(sites, exact.patched.tolist()):
        where = (slice(None), slice(None)) if site.pos is None else (slice(None), site.pos)
        assert value == pytest.approx(patched_value(site.hook_name, where), abs=1e-4)

    # attribution patching: (clean - corrupted) . d metric / d z, the gradient taken by hand
    estimate = attribution_patch(model, clean, corrupted, metric, "heads", attention_mask=mask)
    names = ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]
    expected = attribution_by_hand(lambda hooks: logit_diff(model, corrupted, mask, hooks).mean(), clean_cache, names,
                                   estimate.sites)
    for got, value in zip(estimate.patched.tolist(), expected):
        assert got == pytest.approx(value, abs=1e-4)


@torch.no_grad()
def test_a_structurally_pruned_model_equals_the_heads_zeroed(model):
    tokens, mask = batch(7)
    pruned = prune_heads(model, [(0, 3), (1, 0)])
    by_hand = model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=[("blocks.0.attn.hook_z", zero_head(3)),
                                                                           ("blocks.1.attn.hook_z", zero_head(0))])
    real = mask.bool()
    assert torch.allclose(pruned(tokens, attention_mask=mask)[real], by_hand[real], atol=1e-4)


# ---- SAE features on the residual stream ---------------------------------------------------------------------
def sae_at(hook_name: str) -> SparseAutoencoder:
    sae = SparseAutoencoder(SAEConfig(d_in=32, d_sae=16, hook_name=hook_name))
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for param in sae.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    return sae


@torch.no_grad()
def test_an_sae_on_the_residual_stream_reads_and_writes_through_the_weights(model):
    """feature_logits and feature_inputs looked for every block's ln2 and MLP: an AttributeError on these models."""
    sae = sae_at("blocks.1.hook_resid_pre")
    features = [0, 5]
    logits = feature_logits(model, sae, features, k=4)
    rows = sae.W_dec[features]
    if model.cfg.normalization_type:  # centred and scaled by ln_final.w, as value_tokens(through_final_norm=True)
        rows = (rows - rows.mean(-1, keepdim=True)) * model.ln_final.w
    want = (rows @ model.W_U).topk(4, dim=-1)
    assert torch.equal(logits.top_ids, want.indices)
    assert torch.allclose(logits.top_logits, want.values, atol=1e-5)
    inputs = feature_inputs(model, sae, features, k=4)
    scores = (model.W_E @ sae.W_enc[:, features]).T.topk(4, dim=-1)
    assert torch.equal(inputs.top_ids, scores.indices)
    assert torch.allclose(inputs.top_logits, scores.values, atol=1e-5)


# ---- refusals ------------------------------------------------------------------------------------------------
def mlp_sae(model):
    return sae_at("blocks.0.hook_mlp_out")


def mlp_transcoder(model):
    return SparseAutoencoder(SAEConfig(d_in=32, d_sae=16, hook_name="blocks.0.hook_mlp_in", apply_b_dec_to_input=False,
                                       hook_name_out="blocks.0.hook_mlp_out", d_out=32))


def diff(model):
    return logit_diff_metric(model, ANSWER, WRONG)


TOKENS = torch.randint(0, 60, (1, 8), generator=torch.Generator().manual_seed(9))
OTHER = torch.randint(0, 60, (1, 8), generator=torch.Generator().manual_seed(10))
REFUSED = {
    "patch mlp_out sweep": (lambda m: patch(m, TOKENS, OTHER, diff(m), "mlp_out"),
                            f"sites='mlp_out': {NO_MLPS}, so no mlp_out to patch; sweep 'attn_out'"),
    "patch mlp_out site": (lambda m: attribution_patch(m, TOKENS, OTHER, diff(m), [Site("mlp_out", 1)]),
                           f"{NO_MLPS}, so no mlp_out to patch; patch 'attn_out'"),
    "steer resid_mid": (lambda m: steer(m, torch.ones(32), layers=1, site="resid_mid"),
                        f"steering site 'blocks.1.hook_resid_mid': {NO_MLPS}.*choose resid_pre"),
    "steering_vector mlp_out": (lambda m: steering_vector(m, TOKENS, OTHER, 0, site="mlp_out"), f"{NO_MLPS}"),
    "sae at mlp_out": (lambda m: sae_features(m, mlp_sae(m), TOKENS),
                       f"the SAE reads 'blocks.0.hook_mlp_out': {NO_MLPS}.*trained on a point this model has"),
    "value_tokens": (lambda m: value_tokens(m, 0), f"value_tokens: {NO_MLPS}, so no FFN neurons"),
    "memory_lookup": (lambda m: memory_lookup(m, TOKENS), f"memory_lookup: {NO_MLPS}.*read its heads instead"),
    "sub_updates": (lambda m: sub_updates(m, 0, torch.ones(4)), f"sub_updates: {NO_MLPS}"),
    "top_triggers": (lambda m: top_triggers(m, ["text"], progress=False), f"top_triggers of FFN neurons.*{NO_MLPS}"),
    # the model is refused before the scan is read
    "agreement": (lambda m: agreement(m, None), f"agreement: {NO_MLPS}"),
    "memory_report": (lambda m: memory_report(m, None), f"memory_report: {NO_MLPS}"),
    "attribution_graph": (lambda m: attribution_graph(m, mlp_transcoder(m), TOKENS[0]),
                          f"attribution graphs .*: {NO_MLPS}, so no MLP for a transcoder to replace"),
    "intervene": (lambda m: intervene(m, mlp_transcoder(m), TOKENS[0], []), f"attribution graphs .*{NO_MLPS}"),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_what_needs_an_mlp_is_refused_up_front_saying_what_to_do(model, what):
    call, match = REFUSED[what]
    with pytest.raises(ValueError, match=match):
        call(model)


def test_shortformer_positions_are_refused_where_they_would_be_wrong():
    model = shortformer_with_mlps("LN")
    sae = sae_at("hook_pos_embed").double()
    with pytest.raises(ValueError, match="feature_logits of an SAE at 'hook_pos_embed': .*shortformer positions.*never "
                                         "reach the unembedding"):
        feature_logits(model, sae, [0])


@pytest.mark.parametrize("norm", [None, "LN"])
def test_an_attribution_graph_with_shortformer_positions_explains_the_models_logits(norm):
    """The positions steer only the patterns, which the linearisation freezes: the graph is exact as it stands."""
    model = shortformer_with_mlps(norm)
    gen = torch.Generator().manual_seed(11)
    reads = "blocks.{layer}.ln2.hook_normalized" if norm else "blocks.{layer}.hook_mlp_in"
    transcoders = [sae.double() for sae in random_transcoders(model, gen, reads)]
    tokens = torch.randint(0, 60, (9,), generator=gen)
    graph = attribution_graph(model, transcoders, tokens, batch_size=8)  # it takes its gradients itself
    with torch.no_grad():
        logits = model(tokens[None])[0, -1]
    assert_graph_complete(graph, logits)
