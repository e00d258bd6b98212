"""DeepSeek-style routing in probe's mixture of experts (probe/moe.py: sigmoid scores, a selection bias, groups,
a scaling factor, ungated shared experts), dense layers among sparse ones, and the GLM-4.5 family (glm4_moe).

The oracles: transformers' own routers (DeepseekV3TopkRouter, Glm4MoeTopkRouter, DeepseekV2TopkRouter) on the same
weights, its Glm4Moe modules and greedy generation, its config classes' defaults, and TL 4's bridge over the same
checkpoint (compatibility mode and its own names). test_variants.py compares logits and every residual with
transformers' on GLM-4.5 and on Qwen2/3-MoE files with dense layers, and saves through it."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from probe import DecoderConfig, HookedDecoder
from probe.checkpoint_moe import deepseek_experts, deepseek_sparse_layers
from probe.moe import MoEMLP
from family_checks import assert_generation_and_processing_match
from test_variants import CASES, build

D = 32


def routers(kind: str, **fields):
    """(transformers' config, its router module) of `kind` with the routing `fields`."""
    import transformers as tf
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config_class, router = {"deepseek_v3": (tf.DeepseekV3Config, DeepseekV3TopkRouter),
                            "glm4_moe": (tf.Glm4MoeConfig, Glm4MoeTopkRouter),
                            "deepseek_v2": (tf.DeepseekV2Config, DeepseekV2TopkRouter)}[kind]
    config = config_class(hidden_size=D, num_attention_heads=4, num_hidden_layers=2, **fields)
    return config, router(config).eval()


ROUTERS = {  # kind, routing fields
    "v3-groups-bias-renormalised-scaled": ("deepseek_v3", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                                                topk_group=2, norm_topk_prob=True,
                                                                routed_scaling_factor=2.5)),
    "v3-unrenormalised-eight-groups": ("deepseek_v3", dict(n_routed_experts=16, num_experts_per_tok=3, n_group=8,
                                                            topk_group=3, norm_topk_prob=False,
                                                            routed_scaling_factor=0.7)),
    "glm4-moe-one-group": ("glm4_moe", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                                            routed_scaling_factor=1.5)),
    "glm4-moe-groups": ("glm4_moe", dict(n_routed_experts=12, num_experts_per_tok=3, n_group=3, topk_group=1)),
    "v2-group-limited-greedy": ("deepseek_v2", dict(n_routed_experts=12, num_experts_per_tok=3, n_group=4,
                                                    topk_group=2, topk_method="group_limited_greedy",
                                                    routed_scaling_factor=16.0)),
    "v2-greedy": ("deepseek_v2", dict(n_routed_experts=8, num_experts_per_tok=2, topk_method="greedy")),
}


def our_router(experts) -> MoEMLP:
    cfg = DecoderConfig(n_layers=1, d_model=D, n_heads=4, d_vocab=11, n_ctx=8, gated_mlp=True, mlp_bias=False,
                        d_mlp=16, experts=experts)
    return MoEMLP(cfg).eval()


def dense(weights: torch.Tensor, chosen: torch.Tensor, n: int) -> torch.Tensor:
    """[tokens experts]: each chosen expert's weight, 0 for the others (transformers' order of the chosen is not
    ours: theirs is topk's unsorted one)."""
    return torch.zeros(weights.shape[0], n).scatter(1, chosen.long(), weights.float())


@pytest.mark.parametrize("case", sorted(ROUTERS))
def test_the_routing_rule_is_transformers_routers(case):
    """The same experts chosen, with the same weights, as transformers' router module on the same weights (and the
    config's fields read by probe's reader, deepseek_experts); the bias and the group limit change the choice."""
    kind, fields = ROUTERS[case]
    config, theirs = routers(kind, **fields)
    experts = deepseek_experts(config.to_dict(), kind)
    ours = our_router(experts)
    gen = torch.Generator().manual_seed(0)
    n = experts.n
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(n, D, generator=gen) * 0.3)
        ours.W_gate.weight.copy_(theirs.weight)
        if experts.selection_bias:  # a bias large enough to change which experts run
            theirs.e_score_correction_bias.copy_(torch.randn(n, generator=gen) * 0.3)
            ours.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
        x = torch.randn(64, D, generator=gen)
        _, their_weights, their_chosen = theirs(x)
        our_weights, our_chosen = ours.route(ours.W_gate(x))
        scores = ours.score(ours.W_gate(x))
    torch.testing.assert_close(dense(our_weights, our_chosen, n), dense(their_weights, their_chosen, n), atol=1e-6,
                               rtol=0)
    assert torch.equal(our_chosen.sort(-1).values, their_chosen.sort(-1).values)
    # the rule is exercised, not only the plain top-k of the scores
    plain = scores.topk(experts.per_token, dim=-1).indices.sort(-1).values
    biased = (scores + ours.e_score_correction_bias if experts.selection_bias else scores).topk(
        experts.per_token, dim=-1).indices.sort(-1).values
    if experts.selection_bias:
        assert (plain != biased).any(-1).float().mean() > 0.2, "the bias changes few choices"
    if experts.groups is not None:
        assert (our_chosen.sort(-1).values != biased).any(-1).float().mean() > 0.1, "the groups exclude few experts"


def test_deepseek_style_config_fields_read_as_transformers_fills_them(tmp_path):
    """A GLM-4.5 config.json that leaves out every routing field reads as transformers' config class fills them:
    128 experts, 8 a token, one group, scaling 1, renormalised, one shared expert, the first layer dense."""
    import transformers as tf

    from probe.loading import config_from_hf

    build("glm4_moe", tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    for key in ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
                "norm_topk_prob", "n_shared_experts", "first_k_dense_replace", "moe_intermediate_size"):
        config.pop(key)
    path.write_text(json.dumps(config))
    theirs = tf.AutoConfig.from_pretrained(tmp_path)
    ours = config_from_hf(json.loads(path.read_text()), tmp_path)
    experts = ours.experts
    assert (experts.n, experts.per_token, experts.scaling, experts.renormalize) == (
        theirs.n_routed_experts, theirs.num_experts_per_tok, theirs.routed_scaling_factor, theirs.norm_topk_prob)
    assert experts.groups is None and theirs.n_group == theirs.topk_group == 1
    assert ours.expert_width == theirs.moe_intermediate_size and ours.d_mlp == theirs.intermediate_size
    assert experts.shared == theirs.n_shared_experts * theirs.moe_intermediate_size and not experts.shared_gate
    assert [ours.layer_sparse(l) for l in range(ours.n_layers)] == [l >= theirs.first_k_dense_replace
                                                                    for l in range(theirs.num_hidden_layers)]
    assert experts.scoring == "sigmoid" and experts.selection_bias
    # and DeepSeek-V3's defaults, which differ
    v3 = tf.DeepseekV3Config()
    ours_v3 = deepseek_experts({}, "deepseek_v3")
    assert (ours_v3.n, ours_v3.groups.n, ours_v3.groups.kept, ours_v3.scaling) == (
        v3.n_routed_experts, v3.n_group, v3.topk_group, v3.routed_scaling_factor)
    assert deepseek_sparse_layers({"num_hidden_layers": 5}, "deepseek_v3") == (False,) * 3 + (True,) * 2


def mlp_input(model, cache, layer: int) -> torch.Tensor:
    return model.blocks[layer].ln2(cache[f"blocks.{layer}.hook_resid_mid"]).reshape(-1, model.cfg.d_model)


def test_glm4_moe_sublayers_by_hand_from_transformers_modules(tmp_path):
    """Each sparse layer's write is transformers' experts on its router's choice plus its shared experts, unweighted;
    the dense layer's points are its gated MLP's; hook_expert_weights is the sigmoid before the bias."""
    hf = build("glm4_moe", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    assert [type(block.mlp).__name__ for block in model.blocks] == ["GatedMLP", "MoEMLP", "MoEMLP"]
    toks = torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
        theirs, x = hf.model.layers[0].mlp, mlp_input(model, cache, 0)
        torch.testing.assert_close(cache["blocks.0.mlp.hook_pre"].reshape(-1, 96), theirs.gate_proj(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(cache["blocks.0.mlp.hook_post"].reshape(-1, 96),
                                   F.silu(theirs.gate_proj(x)) * theirs.up_proj(x), atol=1e-5, rtol=0)
        for layer in (1, 2):
            theirs, x = hf.model.layers[layer].mlp, mlp_input(model, cache, layer)
            logits, weights, chosen = theirs.gate(x)
            torch.testing.assert_close(cache[f"blocks.{layer}.mlp.hook_expert_weights"], logits.sigmoid(), atol=1e-6,
                                       rtol=0)
            assert torch.equal(cache[f"blocks.{layer}.mlp.hook_expert_indices"].sort(-1).values, chosen.sort(-1).values)
            by_hand = theirs.experts(x, chosen, weights) + theirs.shared_experts(x)
            torch.testing.assert_close(cache[f"blocks.{layer}.hook_mlp_out"].reshape(-1, 64), by_hand, atol=1e-5, rtol=0)
            shared = theirs.shared_experts
            torch.testing.assert_close(cache[f"blocks.{layer}.mlp.shared_expert.hook_post"],
                                       F.silu(shared.gate_proj(x)) * shared.up_proj(x), atol=1e-5, rtol=0)


def test_hook_shapes_follow_each_layers_kind(tmp_path):
    """hook_shapes predicts every point of a model with a dense layer among sparse ones, an ungated shared expert
    (no hook_shared_expert_gate) and experts narrower than d_mlp."""
    from family_checks import cache_of_everything

    build("glm4_moe", tmp_path)
    model, toks, cache, predicted = cache_of_everything(tmp_path)
    assert set(cache) <= set(predicted) and "blocks.1.mlp.hook_shared_expert_gate" not in predicted
    for name, t in cache.items():
        if ".experts." in name:
            assert t.shape[0] <= predicted[name][0] and t.shape[1:] == predicted[name][1:], name
        else:
            assert tuple(t.shape) == predicted[name], name
    assert cache["blocks.0.mlp.hook_post"].shape[-1] == 96 and cache["blocks.1.mlp.experts.0.hook_post"].shape[-1] == 24
    assert cache["blocks.1.mlp.shared_expert.hook_post"].shape[-1] == 48
    assert sum(cache[f"blocks.2.mlp.experts.{e}.hook_post"].shape[0] for e in range(8)) == 3 * toks.numel()


def test_glm4_moe_hooks_match_the_bridge(tmp_path):
    """TL 4's bridge over the same GLM-4.5 checkpoint, in compatibility mode: every hook both have agrees (the dense
    layer's neurons, partial rotary, the routing); the chosen experts agree as sets (transformers' router leaves
    them unsorted), and the bridge's weights are the chosen experts' final weights, renormalised and scaled."""
    from test_family_defaults import QWEN_FILES, tokenized_checkpoint
    from test_transformer_lens import compare_with_transformer_lens
    from family_checks import caches_of_both

    directory = tokenized_checkpoint("glm4_moe", tmp_path / "checkpoint", QWEN_FILES)
    missing, theirs = compare_with_transformer_lens(directory, 10, seed=4,
                                                    skip=("hook_expert_weights", "hook_expert_indices"))
    assert {n for n in missing if ".experts." not in n and ".shared_expert." not in n} == set()
    assert {"blocks.0.mlp.hook_pre", "blocks.0.mlp.hook_pre_linear", "blocks.0.attn.hook_rot_q",
            "blocks.2.mlp.hook_expert_indices"} <= theirs
    model = HookedDecoder.from_pretrained(directory)
    cache, their_cache = caches_of_both(directory, torch.randint(0, model.cfg.d_vocab, (2, 7),
                                                                 generator=torch.Generator().manual_seed(5)))
    experts = model.cfg.experts
    for layer in (1, 2):
        scores, chosen = cache[f"blocks.{layer}.mlp.hook_expert_weights"], cache[f"blocks.{layer}.mlp.hook_expert_indices"]
        assert torch.equal(chosen.sort(-1).values, their_cache[f"blocks.{layer}.mlp.hook_expert_indices"].sort(-1).values)
        top = scores.gather(-1, chosen)
        used = dense(top / top.sum(-1, keepdim=True) * experts.scaling, chosen, experts.n)
        torch.testing.assert_close(their_cache[f"blocks.{layer}.mlp.hook_expert_weights"], used, atol=1e-6, rtol=0)


def test_glm4_moe_bridge_names_hold_the_bridges_values(tmp_path):
    """TL 4's own names without compatibility mode: the dense layer's `mlp.dense_gate` / `dense_in` / `dense_out`
    points and the sparse layers' MoE block hold the bridge's values; the chosen experts agree as sets; a name probe
    has no point for says what to hook instead."""
    from probe.hooks import UnknownNameError
    from test_bridge_names import classic_names, native_bridge
    from test_family_defaults import QWEN_FILES, tokenized_checkpoint
    from tl_oracle import assert_same

    directory = tokenized_checkpoint("glm4_moe", tmp_path / "checkpoint", QWEN_FILES)
    ours, theirs = HookedDecoder.boot_transformers(directory).eval(), native_bridge(directory)
    toks = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, our_cache = ours.run_with_cache(toks)
        _, their_cache = theirs.run_with_cache(toks)
    compared = set()
    for name in sorted(set(their_cache.keys()) - classic_names(ours)):
        if name not in our_cache:
            with pytest.raises(UnknownNameError, match=f"no hook point {name!r}: .*hook"):
                ours.hook_point(name)
            continue
        ours_value, theirs_value = our_cache[name], their_cache[name]
        if name.endswith("hook_expert_indices"):
            ours_value, theirs_value = ours_value.sort(-1).values, theirs_value.sort(-1).values
        assert_same(ours_value, theirs_value, what=f"glm4_moe: {name}")
        compared.add(name)
    assert {"blocks.0.mlp.dense_gate.hook_out", "blocks.0.mlp.dense_in.hook_out", "blocks.0.mlp.dense_out.hook_in",
            "blocks.0.mlp.dense_out.hook_out", "blocks.1.mlp.hook_in", "blocks.1.mlp.hook_out",
            "blocks.2.mlp.gate.hook_expert_indices"} <= compared


@pytest.mark.parametrize("case", ["glm4-moe-dense-first-sigmoid-groups-scaled",
                                  "glm4-moe-unrenormalised-qk-norm-biases-tied", "qwen3-moe-mlp-only-layers"])
def test_generation_through_a_kv_cache_is_transformers_greedy(case, tmp_path):
    kind, overrides = CASES[case]
    assert_generation_and_processing_match(build(kind, tmp_path, **overrides), tmp_path, processing=False)


@pytest.mark.parametrize("case", ["glm4-moe-unrenormalised-qk-norm-biases-tied", "qwen3-moe-mlp-only-layers",
                                  "qwen2-moe-sparse-step-shared"])
def test_dense_layers_and_routing_save_through_transformers(case, tmp_path):
    """The second GLM-4.5 case and the Qwen files with dense layers, saved and read back by transformers' own class
    (test_variants.py's round trip saves each family's default case)."""
    kind, overrides = CASES[case]
    hf = build(kind, tmp_path / "hf", **overrides)
    model = HookedDecoder.from_pretrained(tmp_path / "hf")
    saved = model.save_pretrained(tmp_path / "ours")
    config = json.loads((saved / "config.json").read_text())
    if kind == "glm4_moe":
        assert (config["first_k_dense_replace"], config["n_group"], config["topk_group"], config["norm_topk_prob"],
                config["routed_scaling_factor"], config["use_qk_norm"]) == (2, 2, 1, False, 0.7, True)
    else:
        assert config["mlp_only_layers"] == [0] and config["intermediate_size"] == 96
    again = type(hf).from_pretrained(saved).eval()
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, atol=1e-5, rtol=0)
    assert HookedDecoder.from_pretrained(saved).cfg == model.cfg


def test_fused_experts_read_as_the_per_expert_file(tmp_path):
    """A GLM-4.5 file whose experts are fused per layer (transformers 5's modules' layout: `experts.gate_up_proj`,
    gates first, and `experts.down_proj`) loads the same model as the per-expert file transformers saves."""
    from safetensors.torch import load_file, save_file

    build("glm4_moe", tmp_path)
    before = HookedDecoder.from_pretrained(tmp_path).state_dict()
    state = load_file(tmp_path / "model.safetensors")
    for layer in (1, 2):
        t = f"model.layers.{layer}.mlp.experts"
        names = [[f"{t}.{e}.{p}_proj.weight" for e in range(8)] for p in ("gate", "up", "down")]
        gate, up, down = ([state.pop(n) for n in group] for group in names)
        state[f"{t}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        state[f"{t}.down_proj"] = torch.stack(down)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    after = HookedDecoder.from_pretrained(tmp_path).state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_multi_token_prediction_layers_are_left_unread(tmp_path):
    """GLM-4.5's released files hold a multi-token-prediction layer after the last (num_nextn_predict_layers);
    transformers ignores it, and so does probe."""
    from safetensors.torch import load_file, save_file

    hf = build("glm4_moe", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state.update({f"model.layers.3.{k.split('.', 3)[3]}": v.clone() for k, v in state.items()
                  if k.startswith("model.layers.2.")})
    state["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    tokens = torch.randint(0, 101, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(HookedDecoder.from_pretrained(tmp_path)(tokens), hf(tokens).logits, atol=1e-4, rtol=0)


def test_the_selection_bias_stays_float32_in_a_bfloat16_model(tmp_path):
    """As transformers keeps it (its routers add it in float32): bfloat16 would round DeepSeek-V3's biases, which
    differ in the fourth digit of values near 1, and change which experts run."""
    hf = build("glm4_moe", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16)
    bias = model.blocks[1].mlp.e_score_correction_bias
    assert bias.dtype == torch.float32 and model.blocks[1].mlp.W_gate.weight.dtype == torch.bfloat16
    assert torch.equal(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    assert model.to(torch.float16).blocks[2].mlp.e_score_correction_bias.dtype == torch.float32
    assert model.float().state_dict()["blocks.1.mlp.e_score_correction_bias"].dtype == torch.float32


def test_folding_the_norms_into_experts_shared_experts_and_the_dense_layer_keeps_transformers_log_probs(tmp_path):
    hf = build("glm4_moe", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path, fold_ln=True, center_writing_weights=False, center_unembed=True,
                                          fold_value_biases=True).eval()
    toks = torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(toks).log_softmax(-1), hf(toks).logits.log_softmax(-1), atol=1e-4, rtol=0)


def test_expert_routing_reads_the_sparse_layers_with_their_scaled_weights(tmp_path):
    from probe.analyses import expert_routing

    hf = build("glm4_moe", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    toks = torch.randint(0, 101, (1, 11), generator=torch.Generator().manual_seed(4))
    routing = expert_routing(model, toks)
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
        for row, layer in enumerate((1, 2)):
            _, weights, chosen = hf.model.layers[layer].mlp.gate(mlp_input(model, cache, layer))
            torch.testing.assert_close(dense(routing.weights[row], routing.chosen[row], 8), dense(weights, chosen, 8),
                                       atol=1e-6, rtol=0)
    assert routing.layer_numbers == [1, 2] and set(routing.to_frame()["layer"]) == {1, 2}
    assert [a.text for a in routing.figure().layout.annotations][:2] == ["L1: weights by token", "L1: share of tokens"]


@pytest.mark.parametrize("experts, match", [
    (dict(n=8, per_token=2, groups=dict(n=3, kept=1)), r"cannot split into ExpertGroups\(n=3\) equal groups"),
    (dict(n=8, per_token=3, groups=dict(n=4, kept=1)), r"kept=1\) of 2 experts each leave fewer than per_token=3"),
    (dict(n=8, per_token=2, groups=dict(n=8, kept=4)), r"score='top2_sum'\) sums each group's two best.*use score='max'"),
    (dict(n=8, per_token=2, groups=dict(n=4, kept=5)), r"keeps more groups than there are"),
    (dict(n=8, per_token=2, groups=dict(n=4, kept=2, score="mean")), r"score='mean' is not supported"),
    (dict(n=8, per_token=2, shared_gate=False), r"shared_gate=False.*shared=None: give the shared expert's width"),
    (dict(n=8, per_token=2, scoring="relu"), r"scoring='relu' is not supported; choose 'softmax' or 'sigmoid'"),
    (dict(n=8, per_token=2, scaling=0), r"scaling must be a positive number"),
    (dict(n=8, per_token=2, softmax_over="chosen", scoring="sigmoid"), r"softmax_over='chosen'.*: scoring"),
    (dict(n=8, per_token=2, layers=[False, False]), r"with at least one True \(else leave experts None\)"),
    (dict(n=8, per_token=2, layers=[False, True, True]), r"must give each of the n_layers=2 layers"),
    (dict(n=8, per_token=2, width=0), r"Experts.width must be a positive int"),
])
def test_bad_routing_settings_are_refused_by_name(experts, match):
    with pytest.raises(ValueError, match=match):
        DecoderConfig(n_layers=2, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, gated_mlp=True, experts=experts)


def test_the_dense_and_sparse_layers_count_as_transformer_lens_counts_them():
    """n_params (TL's count: attention and MLP weights, a router's, no biases or shared experts) per layer kind."""
    cfg = DecoderConfig(n_layers=3, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, gated_mlp=True, d_mlp=40,
                        experts=dict(n=4, per_token=2, width=8, layers=(False, True, True)))
    attention = 4 * 16 * 16
    assert cfg.n_params == 3 * attention + 3 * 16 * 40 + 2 * (3 * 16 * 8 + 16) * 4
    # and the expert width a saved config keeps
    assert DecoderConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
