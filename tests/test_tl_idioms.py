"""More transformer-lens idioms, run unchanged on probe and on transformer-lens's bridge over the same directory
(compatibility mode, unprocessed weights): edits made in place inside hooks, run_with_cache(pos_slice=...), the
use_* inputs by short key, the model-level biases and accumulated_bias, and a block called on its own. Where the
bridge is wrong (an edit at hook_resid_mid), transformers' own forward is the oracle instead."""
from __future__ import annotations

import copy
import dataclasses
import pickle
from functools import partial

import pytest
import torch

from probe import DEFAULT_MODEL, HookedDecoder, HookedTransformerConfig
from test_tl_compat import PROMPT, PROMPTS, classic, clean_and_corrupted, logit_diff, models  # noqa: F401 (a fixture)
from tl_oracle import assert_same


# ---- a hook edits its activation in place, as TL tutorials do ---------------------------------------------
def zero_head(activation, hook, head):
    activation[:, :, head] = 0.0  # in place, returning None: TL keeps the edited tensor


def case_edit_values_queries_and_keys_in_place(model):
    # with gradients on (the default), as a patching notebook runs it
    return (model.run_with_hooks(PROMPT, fwd_hooks=[("blocks.1.attn.hook_v", partial(zero_head, head=2))]),
            model.run_with_hooks(PROMPT, fwd_hooks=[("blocks.2.attn.hook_q", partial(zero_head, head=0)),
                                                    ("blocks.0.attn.hook_k", partial(zero_head, head=5))]))


def case_edited_values_reach_the_loss_gradient(model):
    # the in-place edit is on the autograd graph: the gradient reaching the first block's input sees it
    delta = torch.zeros(1, len(model.to_str_tokens(PROMPT)), model.cfg.d_model, requires_grad=True)
    model.run_with_hooks(PROMPT, return_type="loss", fwd_hooks=[
        ("blocks.0.hook_resid_pre", lambda resid, hook: resid + delta),
        ("blocks.1.attn.hook_v", partial(zero_head, head=2))]).backward()
    model.zero_grad()
    return delta.grad


# ---- run_with_cache(pos_slice=...) -----------------------------------------------------------------------
BRIDGE_ONLY = ("attn.hook_hidden_states", "hook_unembed")  # the bridge's own points, which HookedTransformer lacks


def sliced(model, pos_slice, **kwargs):
    _, cache = model.run_with_cache(PROMPT, pos_slice=pos_slice, **kwargs)
    return classic({name: cache[name] for name in cache.keys() if not name.endswith(BRIDGE_ONLY)})


def case_pos_slice_last(model):
    return sliced(model, -1)  # an int keeps the position axis; pattern and attn_scores slice the query axis


def case_pos_slice_forms(model):
    return sliced(model, (1, 4)), sliced(model, [0, 2, 5]), sliced(model, slice(3, None)), sliced(
        model, -2, remove_batch_dim=True)


def case_pos_slice_then_the_cache_methods(model):
    _, cache = model.run_with_cache(PROMPTS[1], pos_slice=-1)
    stack, labels = cache.decompose_resid(layer=-1, return_labels=True)
    return labels, cache.apply_ln_to_stack(stack, layer=-1), cache.accumulated_resid(layer=3, apply_ln=True)


def case_pos_slice_of_gradients(model):
    _, cache = model.run_with_cache(PROMPT, pos_slice=[1, 4], incl_bwd=True, return_type="loss",
                                    names_filter=lambda name: name.endswith(("resid_post", "hook_pattern")))
    model.zero_grad()
    return classic({name: cache[name] for name in cache.keys()})


# ---- the use_* inputs by short key, model-level weights ---------------------------------------------------
def case_use_inputs_by_short_key(model):
    model.set_use_hook_mlp_in(True)
    model.set_use_split_qkv_input(True)
    try:
        _, cache = model.run_with_cache(PROMPT)
    finally:
        model.set_use_hook_mlp_in(False)
        model.set_use_split_qkv_input(False)
    return cache["mlp_in", 1], cache["q_input", 0], cache["k_input", 2], cache["v_input", 3]


def case_switches_show_in_the_config(model):
    # circuit-discovery code checks model.cfg.use_attn_result (and the rest) before it hooks per-head values
    names = ("use_attn_result", "use_split_qkv_input", "use_attn_in", "use_hook_mlp_in")
    seen = [{name: getattr(model.cfg, name) for name in names}]
    for name in names:
        getattr(model, "set_" + name)(True)
        seen.append({name: getattr(model.cfg, name) for name in names})
        getattr(model, "set_" + name)(False)
    return seen + [{name: getattr(model.cfg, name) for name in names}]


def case_switches_assigned_to_the_config(model):
    # EAP's setup turns the switches on by assigning to model.cfg, then caches per-head writes and inputs
    model.cfg.use_split_qkv_input = True
    model.cfg.use_attn_result = True
    model.cfg.use_hook_mlp_in = True
    model.cfg.ungroup_grouped_query_attention = True  # set for every model: nothing to ungroup in GPT-2
    try:
        _, cache = model.run_with_cache(PROMPT)
        seen = [model.cfg.use_attn_result, model.cfg.use_split_qkv_input, model.cfg.use_hook_mlp_in,
                model.cfg.ungroup_grouped_query_attention]
        # the bridge also caches its own aliases of the per-head inputs (attn.hook_q_input): the classic names only
        names = sorted(k for k in cache.keys() if k.endswith(("attn.hook_result", "hook_mlp_in"))
                       or k.split(".")[2:] in (["hook_q_input"], ["hook_k_input"], ["hook_v_input"]))
        out = [seen, names, cache["result", 1], cache["q_input", 0], cache["v_input", 1], cache["mlp_in", 1]]
    finally:
        model.cfg.use_split_qkv_input = False
        model.cfg.use_attn_result = False
        model.cfg.use_hook_mlp_in = False
        model.cfg.ungroup_grouped_query_attention = False
    _, cache = model.run_with_cache(PROMPT)
    return out + [[k for k in cache.keys() if k.endswith(("hook_result", "hook_q_input", "hook_mlp_in"))]]


def case_n_ctx_narrowed_around_to_tokens(model):
    # EAP-IG's tokenisation: n_ctx set to the longest it wants, to_tokens(truncate=True), n_ctx put back
    old = model.cfg.n_ctx
    model.cfg.n_ctx = 4
    try:
        tokens = model.to_tokens(["When Mary and John went to the store", "hi"], truncate=True)
        narrowed = model.cfg.n_ctx
    finally:
        model.cfg.n_ctx = old
    return [tokens, narrowed, model.cfg.n_ctx, model(tokens)]


def case_logits_by_hand_with_b_U(model):
    # Exploratory_Analysis_Demo's lens by hand: the final norm, then W_U plus b_U (GPT-2 has none: zeros)
    _, cache = model.run_with_cache(PROMPT)
    return model.ln_final(cache["resid_post", 2]) @ model.W_U + model.b_U, model.b_U


def case_head_write_by_hand_with_b_O(model):
    _, cache = model.run_with_cache(PROMPT)
    return torch.einsum("bphd,hdm->bpm", cache["z", 1], model.W_O[1]) + model.b_O[1]


def case_accumulated_bias(model):
    return [(model.accumulated_bias(layer), model.accumulated_bias(layer, mlp_input=True),
             model.accumulated_bias(layer, include_mlp_biases=False)) for layer in range(model.cfg.n_layers)] + [
        model.accumulated_bias(model.cfg.n_layers)]


def case_token_and_position_table(model):
    return model.W_E_pos


# ---- the forward's first step, and caching hooks to attach by hand ------------------------------------------
def case_input_to_embed(model):
    residual, tokens, shortformer, mask = model.input_to_embed(PROMPT)
    # the rest of the forward from that residual (start_at_layer=0: the input is the residual entering block 0)
    return (residual, tokens, shortformer, mask, model(residual, start_at_layer=0),
            model(residual, start_at_layer=0, stop_at_layer=2))


def case_input_to_embed_with_left_padding_side(model):
    model.tokenizer.padding_side = "left"  # nothing padded: the mask is all ones, not None
    try:
        return model.input_to_embed(PROMPT)[1:], model.input_to_embed(model.to_tokens(PROMPT), padding_side="right")[3]
    finally:
        model.tokenizer.padding_side = "right"


def case_negative_start_at_layer(model):
    _, cache = model.run_with_cache(PROMPT)
    last = model.cfg.n_layers - 1  # -1 runs the last block alone, as a slice blocks[-1:]
    return model(cache[f"blocks.{last}.hook_resid_pre"], start_at_layer=-1)


def case_default_prepend_bos_assigned(model):
    model.cfg.default_prepend_bos = False  # TL code turns BOS off for a whole analysis so
    try:
        return model.to_tokens(PROMPT), model(PROMPT)
    finally:
        model.cfg.default_prepend_bos = True


def case_get_caching_hooks_attached_by_hand(model):
    cache, fwd, bwd = model.get_caching_hooks(lambda name: name.endswith(("hook_z", "hook_resid_post")), incl_bwd=True)
    with model.hooks(fwd_hooks=fwd, bwd_hooks=bwd):
        model(PROMPT, return_type="loss").backward()
    model.zero_grad()
    sliced, fwd, _ = model.get_caching_hooks(lambda name: name.endswith("hook_pattern"), remove_batch_dim=True,
                                             pos_slice=-1)
    model.run_with_hooks(PROMPT, fwd_hooks=fwd)
    return classic(cache), classic(sliced)


def case_direct_path_patching_of_transformer_lens_4(model):
    # TL 4's own path patching hooks the bridge's names for the per-head inputs (blocks.l.attn.hook_q_input)
    import transformer_lens.patching as patching

    clean, corrupted = clean_and_corrupted(model)
    _, clean_cache = model.run_with_cache(clean)
    _, corrupted_cache = model.run_with_cache(corrupted)
    return [patching.get_act_patch_direct_path(model, corrupted, clean_cache, corrupted_cache, logit_diff, src_layer=0,
                                               src_head=2, component=part, verbose=False) for part in "qkv"] + [
        patching.get_act_patch_direct_path_all_sources(model, corrupted, clean_cache, corrupted_cache, logit_diff,
                                                       component="v", verbose=False)]


def case_hooks_that_take_the_point_by_keyword(model):
    # TL calls hook(activation, hook=point); TL 4's own hooks are written `def fn(x, *, hook)`
    def scale(activation, *, hook):
        return activation * (1 + hook.layer())

    def count(activation, **kwargs):
        kwargs["hook"].ctx["seen"] = kwargs["hook"].name

    return model.run_with_hooks(PROMPT, fwd_hooks=[("blocks.1.hook_mlp_out", scale), ("blocks.2.attn.hook_z", count)])


def case_node_attribution_patching_of_transformer_lens_4(model):
    from transformer_lens.tools.analysis.attribution_patching import attribution_patch

    clean, corrupted = clean_and_corrupted(model)
    result = attribution_patch(model, clean, corrupted, logit_diff)
    return sorted((repr(node), float(score)) for node, score in result.node_scores.items())


def case_edge_attribution_patching_of_transformer_lens_4(model):
    # TL 4's EAP hooks every point its graph needs by the names in model.hook_dict, the bridge's aliases among them
    from transformer_lens.tools.analysis.attribution_patching import EdgeAttributionConfig, attribution_patch

    clean, corrupted = clean_and_corrupted(model)
    result = attribution_patch(model, clean, corrupted, logit_diff, EdgeAttributionConfig(granularity="edge"))
    return sorted((repr(edge), float(score)) for edge, score in result.edge_scores.items())


def case_faithfulness_of_transformer_lens_4(model):
    from transformer_lens.tools.analysis.attribution_patching import (EdgeAttributionConfig, FaithfulnessConfig,
                                                                     attribution_patch, faithfulness)

    clean, corrupted = clean_and_corrupted(model)
    scores = attribution_patch(model, clean, corrupted, logit_diff, EdgeAttributionConfig(granularity="edge"))
    circuit = [edge for edge, _ in sorted(scores.edge_scores.items(), key=lambda item: (-abs(item[1]), repr(item[0])))]
    result = faithfulness(model, clean, corrupted, logit_diff, circuit[:40], FaithfulnessConfig(ablation="corrupt"))
    return result.recovered, result.full_metric, result.corrupt_metric, result.circuit_size, result.total_edges


def case_interchange_intervention_of_transformer_lens_4(model):
    # TL 4's causal-abstraction tools: activations at one position, then a rank-4 subspace of them swapped in
    from transformer_lens.tools.analysis.interchange import (SubspaceInterchange, collect_activations,
                                                             intervened_logits, random_basis)

    tokens = model.to_tokens(PROMPTS)
    at = torch.full((tokens.shape[0],), 3)
    task = lambda batch: model(batch)[:, -1, :10]  # noqa: E731
    source = collect_activations(model, "blocks.1.hook_resid_post", tokens.flip(0), task, positions=at)
    swap = SubspaceInterchange(random_basis(model.cfg.d_model, 4, seed=0))
    return source, intervened_logits(model, "blocks.1.hook_resid_post", swap, tokens, source, task, positions=at)


def case_head_subspace_affinity_of_transformer_lens_4(model):
    from transformer_lens.tools.analysis.projection_kernel import attention_head_subspace_affinity

    results = [attention_head_subspace_affinity(model, target_role=role) for role in "QKV"]
    return [(result.scores, result.normalized, result.source_ranks, result.target_ranks) for result in results]


def case_backward_hooks_run_through_the_graph_after_their_block(model):
    # circuit-tracer's way: the forward inside the block, the backward passes after it; and run_with_hooks's output
    grads = {}

    def keep(grad, hook, name):  # (the bridge's hook.name is its own spelling of the point)
        grads.setdefault(name, []).append(grad.detach().clone())

    names = ("blocks.0.hook_resid_pre", "blocks.2.attn.hook_z", "blocks.1.hook_mlp_out")
    with model.hooks(bwd_hooks=[(name, partial(keep, name=name)) for name in names[:2]]):
        logits = model(PROMPT)
    logits[0, -1, 5].backward(retain_graph=True)
    logits[0, -2, 9].backward()
    model.run_with_hooks(PROMPT, bwd_hooks=[(names[2], partial(keep, name=names[2]))])[0, -1].logsumexp(-1).backward()
    model(PROMPT)[0, -1, 5].backward()  # a forward after the blocks: none of the hooks
    model.zero_grad()
    return grads


def case_a_cache_of_everything_under_inference_mode(model):
    # activation dumpers and attention-SAE dashboards cache inside torch.inference_mode(), where tensors keep no
    # version counter
    with torch.inference_mode():
        logits, cache = model.run_with_cache(PROMPT)
    return logits.clone(), classic({name: cache[name].clone() for name in cache.keys() if not name.endswith(BRIDGE_ONLY)})


def case_caching_hooks_kept_until_reset(model):
    cache = model.add_caching_hooks(lambda name: name.endswith("hook_resid_pre"))
    everything = {}
    model.cache_some(everything, lambda name: name.endswith("attn.hook_pattern"), incl_bwd=True)
    model(PROMPT, return_type="loss").backward()
    model.zero_grad()
    model.reset_hooks()
    model(PROMPTS[1])  # after reset_hooks nothing is stored
    return classic(cache), classic(everything)


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_transformer_lens_idiom_runs_unchanged(models, name):  # noqa: F811
    ours, theirs = models
    assert_same(CASES[name](ours), classic(CASES[name](theirs)), what=name)


def test_input_to_embed_of_left_padded_prompts_counts_positions_along_real_tokens(models):  # noqa: F811
    # as HookedTransformer does (the bridge ignores the padding here): the oracle is the weights, by hand
    ours, _ = models
    residual, tokens, _, mask = ours.input_to_embed(PROMPTS, padding_side="left")
    lengths = [len(ours.to_tokens(prompt)[0]) for prompt in PROMPTS]
    assert mask.sum(1).tolist() == lengths and all(row[-n:].all() for row, n in zip(mask, lengths))
    W_E, W_pos = ours.W_E.detach(), ours.W_pos.detach()
    for row, n in enumerate(lengths):
        by_hand = W_E[tokens[row, -n:]] + W_pos[:n]
        torch.testing.assert_close(residual[row, -n:], by_hand, rtol=0, atol=1e-6)
        torch.testing.assert_close(ours(residual, start_at_layer=0, attention_mask=mask)[row, -n:],
                                   ours(ours.to_tokens(PROMPTS[row]))[0], rtol=0, atol=1e-4)


def test_the_bridges_names_for_the_per_head_inputs_reach_the_block_points(models):  # noqa: F811
    ours, _ = models
    seen = []
    ours.run_with_hooks(PROMPT, fwd_hooks=[("blocks.1.attn.hook_k_input", lambda x, hook: seen.append(hook.name))])
    assert seen == ["blocks.1.attn.hook_k_input"]  # a hook sees the name it was attached by, and a cache lists it
    _, cache = ours.run_with_cache(PROMPT, names=["blocks.2.attn.hook_v_input"])
    assert list(cache.keys()) == ["blocks.2.attn.hook_v_input"]
    assert cache["blocks.2.hook_v_input"] is cache["blocks.2.attn.hook_v_input"]  # the point's own name answers too
    assert ours.hook_dict["blocks.1.attn.hook_k_input"] is ours.hook_dict["blocks.1.hook_k_input"]  # as the bridge's


def test_pos_slice_stores_the_positions_asked_for(models):  # noqa: F811
    # beyond the oracle: the stored tensors are the full cache's, at those positions (query positions of a pattern)
    ours, _ = models
    _, full = ours.run_with_cache(PROMPT)
    _, last = ours.run_with_cache(PROMPT, pos_slice=-1)
    assert last["resid_pre", 1].shape == (1, 1, ours.cfg.d_model)
    torch.testing.assert_close(last["resid_pre", 1], full["resid_pre", 1][:, -1:], rtol=0, atol=0)
    torch.testing.assert_close(last["pattern", 2], full["pattern", 2][:, :, -1:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="pos_slice"):
        ours.run_with_cache(PROMPT, pos_slice=1.5)


def test_a_block_called_on_its_own(models):  # noqa: F811
    # `model.blocks[l](resid)`: positions 0, 1, ... and plain causal attention. HookedTransformer's block returns the
    # residual; the bridge's wraps it in a one-element tuple, which is the only difference
    ours, theirs = models
    _, cache = ours.run_with_cache(PROMPT)
    resid = cache["resid_pre", 1]
    (expected,) = theirs.blocks[1](resid)
    assert_same(ours.blocks[1](resid), expected, what="blocks[1](resid)")


def test_a_rotary_block_called_on_its_own_counts_positions_from_zero(tmp_path):
    from test_variants import build

    build("llama", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 9))
    _, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(model.blocks[1](cache["resid_pre", 1]), cache["resid_post", 1], rtol=0, atol=1e-5)


def test_an_edit_at_resid_mid_reaches_the_mlp_and_the_residual_as_in_transformers(models):  # noqa: F811
    # transformers' GPT-2 block as the oracle (transformer-lens 4.3's bridge passes an edit at hook_resid_mid to the
    # MLP's input only, not to the residual sum): the delta's gradient is the loss's through both paths
    from transformers import AutoModelForCausalLM

    ours, _ = models
    tokens = ours.to_tokens(PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL)).eval()
    grads = []
    for run in ("ours", "transformers"):
        delta = torch.zeros(1, tokens.shape[1], ours.cfg.d_model, requires_grad=True)
        if run == "ours":
            loss = ours.run_with_hooks(tokens, return_type="loss",
                                       fwd_hooks=[("blocks.2.hook_resid_mid", lambda x, hook: x + delta)])
        else:
            block = hf.transformer.h[2]
            handles = [block.ln_2.register_forward_pre_hook(lambda module, args: (args[0] + delta,)),
                       block.mlp.register_forward_hook(lambda module, args, out: out + delta)]  # the skip path
            loss = hf(tokens, labels=tokens).loss
            for handle in handles:
                handle.remove()
        loss.backward()
        grads.append(delta.grad)
    ours.zero_grad()
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-6)
    assert grads[0].abs().max() > 1e-3


def test_accumulated_bias_refuses_where_biases_do_not_add_up(tmp_path):
    from test_variants import build

    build("gemma2", tmp_path / "gemma2")
    sandwich = HookedDecoder.from_pretrained(tmp_path / "gemma2")
    with pytest.raises(ValueError, match="sandwich"):
        sandwich.accumulated_bias(1)
    build("neox", tmp_path / "neox")
    parallel = HookedDecoder.from_pretrained(tmp_path / "neox")
    assert parallel.accumulated_bias(1).shape == (parallel.cfg.d_model,)
    with pytest.raises(ValueError, match="parallel block"):
        parallel.accumulated_bias(1, mlp_input=True)
    with pytest.raises(ValueError, match="layer=7"):
        parallel.accumulated_bias(7)


def test_hook_points_and_mod_dict(models):  # noqa: F811
    # the bridge lists points of its own beside the classic ones (hook_hidden_states, attn.hook_q_input, ...):
    # every point of probe's is one of the bridge's (its hook_dict names some under aliases of its own naming)
    ours, theirs = models
    names = [point.name for point in ours.hook_points()]
    aliases = {f"blocks.{layer}.attn.hook_{part}" for layer in range(ours.cfg.n_layers)
               for part in ("q_input", "k_input", "v_input", "attn_in")}
    classic = [name for name in ours.hook_names if not ours.hook_point(name).bridge_only]  # not booted: TL 3's list
    assert set(ours.hook_dict) == set(names) | aliases and len(names) == len(set(names)) == len(classic)
    assert set(names) <= set(theirs.hook_dict) and len(theirs.hook_points()) > 0
    assert all(ours.mod_dict[name] is ours.hook_dict[name] for name in names)
    assert aliases <= set(theirs.hook_dict)  # the bridge's own names for the per-head inputs
    assert all(name in theirs.mod_dict for name in names)  # the bridge's mod_dict holds the same points by name
    assert ours.mod_dict["blocks.0.attn"] is ours.blocks[0].attn


def test_a_switch_assigned_through_any_name_for_the_config_reaches_its_model_alone(models):  # noqa: F811
    ours, _ = models
    copy_ = copy.deepcopy(ours)
    cfg = ours.cfg
    cfg.use_attn_result = True
    try:
        assert ours.cfg.use_attn_result is True and copy_.cfg.use_attn_result is False
        assert "blocks.0.attn.hook_result" in ours.run_with_cache(PROMPT)[1]
        assert "blocks.0.attn.hook_result" not in copy_.run_with_cache(PROMPT)[1]
        assert pickle.loads(pickle.dumps(ours.cfg)) == ours.cfg  # the owner is a weak reference, left out
    finally:
        cfg.use_attn_result = False
    assert "blocks.0.attn.hook_result" not in ours.run_with_cache(PROMPT)[1]


def test_the_architecture_stays_frozen_and_the_device_follows_the_weights(models):  # noqa: F811
    ours, _ = models
    with pytest.raises(AttributeError, match=r"dataclasses\.replace"):
        ours.cfg.n_layers = 2
    with pytest.raises(AttributeError, match=r"model\.to\(device\)"):
        ours.cfg.device = "cuda"
    assert ours.cfg.n_layers == 4 and ours.cfg.device == "cpu"


def test_a_config_built_ungrouped_gives_a_model_that_hooks_keys_per_query_head():
    # HookedTransformerConfig(ungroup_grouped_query_attention=True), or the switch assigned to a config no model owns
    # yet: the model built from it follows; its key for query head h is key/value head h // 2's
    settings = dict(n_layers=1, d_model=16, d_head=4, n_key_value_heads=2, n_ctx=8, d_vocab=11, act_fn="relu")
    grouped = HookedDecoder(HookedTransformerConfig(**settings))
    free = HookedTransformerConfig(**settings)
    free.ungroup_grouped_query_attention = True
    tokens = torch.tensor([[1, 2, 3]])
    k = grouped.run_with_cache(tokens)[1]["k", 0]
    assert k.shape[2] == 2
    for model in (HookedDecoder(HookedTransformerConfig(**settings, ungroup_grouped_query_attention=True)), HookedDecoder(free)):
        model.load_state_dict(grouped.state_dict())
        assert model.cfg.ungroup_grouped_query_attention
        torch.testing.assert_close(model.run_with_cache(tokens)[1]["k", 0], k[:, :, [0, 0, 1, 1]])



def test_n_ctx_narrows_the_inputs_within_the_positions_the_model_holds(tmp_path):
    model = HookedDecoder.from_pretrained(DEFAULT_MODEL)
    table = model.W_pos.shape[0]
    with pytest.raises(ValueError, match=f"give at most {table}"):
        model.cfg.n_ctx = table + 1
    model.cfg.n_ctx = 6
    with pytest.raises(ValueError, match="n_ctx=6; truncate it"):
        model(torch.arange(7)[None])
    with pytest.raises(ValueError, match=f"set model.cfg.n_ctx = {table} before saving"):
        model.save_pretrained(tmp_path / "narrowed")
    assert not (tmp_path / "narrowed").exists()
    with pytest.raises(AttributeError, match=r"model\.cfg\.n_ctx = n"):
        dataclasses.replace(model.cfg).n_ctx = 3  # a config no model owns describes weights yet to be built
    model.cfg.n_ctx = table
    model.save_pretrained(tmp_path / "restored")
    assert HookedDecoder.from_pretrained(tmp_path / "restored").cfg == model.cfg


def test_switches_and_device_named_on_a_config_before_building_turn_on_in_the_model():
    # TL code loading a trained toy model: cfg = HookedTransformerConfig(...); cfg.device = ...; cfg.use_* = True
    cfg = HookedTransformerConfig(n_layers=2, d_model=16, d_head=4, n_ctx=8, d_vocab=11, act_fn="relu", seed=0)
    cfg.device = "cpu"
    cfg.use_attn_result = True
    cfg.use_split_qkv_input = True
    model = HookedDecoder(cfg)
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    _, cache = model.run_with_cache(tokens)
    assert {"blocks.1.attn.hook_result", "blocks.1.hook_q_input"} <= set(cache.keys())
    # the oracle: each head's write by hand, z_h W_O[h] (the per-head write omits b_O, as TL's does)
    by_hand = torch.einsum("bphd,hdm->bphm", cache["z", 1], model.blocks[1].attn.W_O)
    torch.testing.assert_close(cache["result", 1], by_hand, rtol=0, atol=1e-6)
    torch.testing.assert_close(cache["result", 1].sum(2) + model.blocks[1].attn.b_O, cache["attn_out", 1], rtol=0, atol=1e-5)
