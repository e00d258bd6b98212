"""MiniMax-M2 (probe/checkpoint_minimax.py) and ERNIE 4.5 MoE (probe/checkpoint_ernie_moe.py): two more mixtures of
experts, and the routing details they add to probe/moe.py (the renormalising sum's floor, a router and experts
without the MLPs' biases).

The oracles: transformers (test_variants.py compares logits and every residual on each family's cases and saves
through it; here greedy generation, TL-default processing, its routers and MoE modules on the same weights, its config
classes' defaults, the layers its ERNIE model makes sparse, and its loading of files that carry multi-token-prediction
weights) and TL 4's bridge over the same checkpoint, hook by hook."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from probe import DecoderConfig, HookedDecoder
from probe.checkpoint_ernie_moe import ernie4_5_moe_config, ernie4_5_moe_config_to_hf
from probe.checkpoint_minimax import minimax_m2_config
from probe.moe import MoEMLP
from family_checks import assert_generation_and_processing_match
from test_variants import CASES, build

D = 32
GENERATION_CASES = ["minimax-m2-partial-rotary-biased-sigmoid-choice", "minimax-m2-whole-head-mqa-wide-heads-tied",
                    "ernie4-5-moe-dense-first-shared", "ernie4-5-moe-biases-tied-every-other-layer",
                    "ernie4-5-moe-clamped-sum-all-sparse-two-shared-untied"]


@pytest.mark.parametrize("case", GENERATION_CASES)
def test_generation_and_processing_are_transformers(case, tmp_path):
    kind, overrides = CASES[case]
    hf = build(kind, tmp_path, **overrides)
    with pytest.warns(UserWarning, match="center_writing_weights"):  # RMSNorm: nothing to centre, as in TL
        assert_generation_and_processing_match(hf, tmp_path)


# ---- the routing, against transformers' routers on the same weights ------------------------------------------
ROUTERS = {  # kind, routing fields, the selection bias's scale
    "minimax-m2-two-of-eight": ("minimax_m2", dict(num_local_experts=8, num_experts_per_tok=2), 0.3),
    "minimax-m2-three-of-six": ("minimax_m2", dict(num_local_experts=6, num_experts_per_tok=3), 0.3),
    "ernie-4-5-moe-two-of-eight": ("ernie4_5_moe", dict(moe_num_experts=8, moe_k=2), 0.1),
    # a floor above most tokens' chosen scores' sums: the clamp, not the sum, divides them
    "ernie-4-5-moe-clamped-sum": ("ernie4_5_moe", dict(moe_num_experts=8, moe_k=2, moe_norm_min=0.8), 0.1),
}


def routers(kind: str, **fields):
    """(probe's reading of the config's experts, transformers' router module) of `kind` with the routing `fields`."""
    import transformers as tf
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

    config_class, router, reader = {"minimax_m2": (tf.MiniMaxM2Config, MiniMaxM2TopKRouter, minimax_m2_config),
                                    "ernie4_5_moe": (tf.Ernie4_5_MoeConfig, Ernie4_5_MoeTopKRouter,
                                                     ernie4_5_moe_config)}[kind]
    config = config_class(hidden_size=D, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, **fields)
    return reader(config.to_dict()).experts, router(config).eval()


def our_router(experts) -> MoEMLP:
    experts = dataclasses.replace(experts, layers=None, width=None, shared=None, shared_gate=True)
    cfg = DecoderConfig(n_layers=1, d_model=D, n_heads=4, d_vocab=11, n_ctx=8, gated_mlp=True, mlp_bias=False,
                        d_mlp=16, experts=experts)
    return MoEMLP(cfg).eval()


def dense(weights: torch.Tensor, chosen: torch.Tensor, n: int) -> torch.Tensor:
    """[tokens experts]: each chosen expert's weight, 0 for the others (transformers leaves the chosen unsorted)."""
    return torch.zeros(weights.shape[0], n).scatter(1, chosen.long(), weights.float())


@pytest.mark.parametrize("case", sorted(ROUTERS))
def test_the_routing_rule_is_transformers_routers(case):
    """The same experts chosen, with the same weights, as transformers' router on the same weights and a selection
    bias large enough to change the choice; the floor of the renormalising sum changes the weights where it bites."""
    kind, fields, scale = ROUTERS[case]
    experts, theirs = routers(kind, **fields)
    ours = our_router(experts)
    n, gen = experts.n, torch.Generator().manual_seed(0)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(n, D, generator=gen) * 0.3)
        ours.W_gate.weight.copy_(theirs.weight)
        bias = torch.randn(n, generator=gen) * scale
        ours.e_score_correction_bias.copy_(bias)
        x = torch.randn(64, D, generator=gen)
        if kind == "minimax_m2":  # (its bias lives beside the router, in the MoE block)
            _, their_weights, their_chosen = theirs(x, bias)
        else:
            theirs.moe_statics.e_score_correction_bias.copy_(bias[None])
            _, their_weights, their_chosen = theirs(x)
        our_weights, our_chosen = ours.route(ours.W_gate(x))
        scores = ours.score(ours.W_gate(x))
    torch.testing.assert_close(dense(our_weights, our_chosen, n), dense(their_weights, their_chosen, n), atol=1e-6,
                               rtol=0)
    assert torch.equal(our_chosen.sort(-1).values, their_chosen.sort(-1).values)
    plain = scores.topk(experts.per_token, dim=-1).indices.sort(-1).values
    assert (plain != our_chosen.sort(-1).values).any(-1).float().mean() > 0.2, "the bias changes few choices"
    top = scores.gather(1, our_chosen)
    if experts.renormalize_min is not None and experts.renormalize_min > 0.1:
        assert (top.sum(-1) < experts.renormalize_min).float().mean() > 0.5, "the floor clamps few sums"
        assert not torch.allclose(our_weights, top / top.sum(-1, keepdim=True), atol=1e-3)


def mlp_input(model, cache, layer: int) -> torch.Tensor:
    return model.blocks[layer].ln2(cache[f"blocks.{layer}.hook_resid_mid"]).reshape(-1, model.cfg.d_model)


@pytest.mark.parametrize("kind", ["minimax_m2", "ernie4_5_moe"])
def test_sublayers_by_hand_from_transformers_modules(kind, tmp_path):
    """Each sparse layer's write is transformers' experts on its router's choice (plus ERNIE's shared experts);
    hook_expert_weights is the sigmoid (MiniMax) or softmax (ERNIE) before the bias; ERNIE's dense layer's points are
    its gated MLP's; MiniMax's q and k are normalised over every head together, and only their first rotary_dim
    dimensions turn."""
    hf = build(kind, tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    toks = torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(3))
    sparse = [l for l in range(model.cfg.n_layers) if model.cfg.layer_sparse(l)]
    assert sparse == ([0, 1] if kind == "minimax_m2" else [1, 2])
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
        for layer in sparse:
            theirs, x = hf.model.layers[layer].mlp, mlp_input(model, cache, layer)
            if kind == "minimax_m2":
                logits, weights, chosen = theirs.gate(x, theirs.e_score_correction_bias)
                scores, by_hand = logits.sigmoid(), theirs.experts(x, chosen, weights)
            else:
                logits, weights, chosen = theirs.gate(x)
                scores = logits.softmax(-1)
                by_hand = theirs.experts(x, chosen, weights) + theirs.shared_experts(x)
                shared = theirs.shared_experts
                torch.testing.assert_close(cache[f"blocks.{layer}.mlp.shared_expert.hook_post"],
                                           F.silu(shared.gate_proj(x)) * shared.up_proj(x), atol=1e-5, rtol=0)
            torch.testing.assert_close(cache[f"blocks.{layer}.mlp.hook_expert_weights"], scores, atol=1e-6, rtol=0)
            assert torch.equal(cache[f"blocks.{layer}.mlp.hook_expert_indices"].sort(-1).values, chosen.sort(-1).values)
            torch.testing.assert_close(cache[f"blocks.{layer}.hook_mlp_out"].reshape(-1, 64), by_hand, atol=1e-5,
                                       rtol=0)
        if kind == "ernie4_5_moe":
            theirs, x = hf.model.layers[0].mlp, mlp_input(model, cache, 0)
            torch.testing.assert_close(cache["blocks.0.mlp.hook_post"].reshape(-1, 96),
                                       F.silu(theirs.gate_proj(x)) * theirs.up_proj(x), atol=1e-5, rtol=0)
            return
        attn = hf.model.layers[1].self_attn
        x = model.blocks[1].ln1(cache["blocks.1.hook_resid_pre"])
        q = attn.q_norm(attn.q_proj(x)).view(2, 11, 4, 16)
        torch.testing.assert_close(cache["blocks.1.attn.hook_q_normed"], q, atol=1e-5, rtol=0)
        rot_q = cache["blocks.1.attn.hook_rot_q"]
        assert torch.equal(rot_q[..., 8:], cache["blocks.1.attn.hook_q_normed"][..., 8:])
        assert not torch.allclose(rot_q[:, 5:, :, :8], q[:, 5:, :, :8], atol=1e-3)


# ---- TL 4's bridge over the same checkpoints ----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["minimax_m2", "ernie4_5_moe"])
def test_hooks_match_the_bridge(kind, tmp_path):
    """TL 4's bridge in compatibility mode: every hook both have agrees (q/k norms over all heads, partial rotary,
    a dense layer's neurons). MiniMax's bridge hooks the routing: the chosen experts agree as sets (transformers
    leaves them unsorted) and its weights are the chosen experts' final weights, renormalised; ERNIE's hooks none
    (its router is a bare module there), so that transformers' router is the oracle above."""
    from test_family_defaults import LLAMA_FILES, tokenized_checkpoint
    from test_transformer_lens import compare_with_transformer_lens
    from family_checks import caches_of_both

    directory = tokenized_checkpoint(kind, tmp_path / "checkpoint", LLAMA_FILES)
    missing, theirs = compare_with_transformer_lens(directory, 10, seed=4,
                                                    skip=("hook_expert_weights", "hook_expert_indices"),
                                                    flattened=("hook_q_normed", "hook_k_normed"))
    model = HookedDecoder.from_pretrained(directory)
    sparse = [l for l in range(model.cfg.n_layers) if model.cfg.layer_sparse(l)]
    routing = {f"blocks.{l}.mlp.hook_expert_{p}" for l in sparse for p in ("weights", "indices")}
    unmatched = {n for n in missing if ".experts." not in n and ".shared_expert." not in n}
    if kind == "ernie4_5_moe":
        assert unmatched == routing and {"blocks.0.mlp.hook_pre", "blocks.2.attn.hook_rot_q"} <= theirs
        return
    assert unmatched == set() and {"blocks.1.attn.hook_q_normed", "blocks.1.mlp.hook_expert_indices"} <= theirs
    cache, their_cache = caches_of_both(directory, torch.randint(0, model.cfg.d_vocab, (2, 7),
                                                                 generator=torch.Generator().manual_seed(5)))
    for layer in sparse:
        mlp = f"blocks.{layer}.mlp"
        scores, chosen = cache[f"{mlp}.hook_expert_weights"], cache[f"{mlp}.hook_expert_indices"]
        assert torch.equal(chosen.sort(-1).values, their_cache[f"{mlp}.hook_expert_indices"].sort(-1).values)
        top = scores.gather(-1, chosen)
        used = dense(top / top.sum(-1, keepdim=True), chosen, model.cfg.experts.n)
        torch.testing.assert_close(their_cache[f"{mlp}.hook_expert_weights"], used, atol=1e-6, rtol=0)


SHARED_POINTS = {"hook_pre": "hook_pre", "hook_pre_linear": "hook_pre_linear", "hook_post": "hook_post",
                 "gate.hook_out": "hook_pre", "in.hook_out": "hook_pre_linear", "out.hook_in": "hook_post"}


@pytest.mark.parametrize("kind", ["minimax_m2", "ernie4_5_moe"])
def test_bridge_names_hold_the_bridges_values(kind, tmp_path):
    """TL 4's own names without compatibility mode: every one probe answers to holds the bridge's value (ERNIE's
    dense layer's `mlp.dense_gate` / `dense_in` / `dense_out`, MiniMax's `mlp.gate.hook_expert_indices`); the others
    say what to hook instead, but for ERNIE's shared experts' (`mlp.shared_experts.*`, which probe does not answer
    to: its points are `mlp.shared_expert.*`, compared here under the bridge's names)."""
    from probe.hooks import UnknownNameError
    from test_bridge_names import classic_names, native_bridge
    from test_family_defaults import LLAMA_FILES, tokenized_checkpoint
    from tl_oracle import assert_same

    directory = tokenized_checkpoint(kind, tmp_path / "checkpoint", LLAMA_FILES)
    ours, theirs = HookedDecoder.boot_transformers(directory).eval(), native_bridge(directory)
    toks = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, our_cache = ours.run_with_cache(toks)
        _, their_cache = theirs.run_with_cache(toks)
    compared = set()
    for name in sorted(set(their_cache.keys()) - classic_names(ours)):
        block, _, point = name.partition(".mlp.shared_experts.")
        if point in SHARED_POINTS:
            assert_same(our_cache[f"{block}.mlp.shared_expert.{SHARED_POINTS[point]}"], their_cache[name], what=name)
            compared.add(name)
            continue
        if point:  # (its input, output and projections' inputs, and the shared experts' output alone)
            continue
        if name not in our_cache:
            with pytest.raises(UnknownNameError, match=f"no hook point {name!r}: .*hook"):
                ours.hook_point(name)
            continue
        ours_value, theirs_value = our_cache[name], their_cache[name]
        if name.endswith("hook_expert_indices"):
            ours_value, theirs_value = ours_value.sort(-1).values, theirs_value.sort(-1).values
        assert_same(ours_value, theirs_value, what=f"{kind}: {name}")
        compared.add(name)
    expected = {"minimax_m2": {"blocks.0.mlp.gate.hook_expert_indices", "blocks.1.mlp.hook_in",
                               "blocks.1.attn.q.hook_out"},
                "ernie4_5_moe": {"blocks.0.mlp.dense_gate.hook_out", "blocks.0.mlp.dense_in.hook_out",
                                 "blocks.0.mlp.dense_out.hook_in", "blocks.1.mlp.hook_out",
                                 "blocks.2.mlp.shared_experts.hook_post", "blocks.1.mlp.shared_experts.in.hook_out"}}
    assert expected[kind] <= compared


# ---- the multi-token-prediction weights some files carry ----------------------------------------------------
def test_minimax_multi_token_prediction_layers_are_left_unread(tmp_path):
    """A file with num_mtp_modules stores those modules as layers after the last; transformers builds none (it
    leaves the tensors aside), and probe does not read them."""
    from safetensors.torch import load_file, save_file

    hf = build("minimax_m2", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state.update({f"model.layers.2.{k.split('.', 3)[3]}": v.clone() for k, v in state.items()
                  if k.startswith("model.layers.1.")})
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_mtp_modules": 1, "use_mtp": True}))
    again = type(hf).from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = again(tokens).logits
        torch.testing.assert_close(expected, hf(tokens).logits, atol=1e-6, rtol=0)
        torch.testing.assert_close(HookedDecoder.from_pretrained(tmp_path)(tokens), expected, atol=1e-4, rtol=0)


def test_ernie_multi_token_prediction_weights_are_left_unread(tmp_path):
    """ERNIE 4.5 MoE's released files carry an MTP block beside the model (`mtp_block`, `mtp_emb_norm`,
    `mtp_hidden_norm`, `mtp_linear_proj`); transformers leaves every tensor whose name holds "mtp" aside, and so
    does probe."""
    from safetensors.torch import load_file, save_file

    hf = build("ernie4_5_moe", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state.update({f"model.mtp_block.0.{k.split('.', 3)[3]}": v.clone() for k, v in state.items()
                  if k.startswith("model.layers.2.")})
    state.update({"model.mtp_emb_norm.0.weight": torch.ones(64), "model.mtp_hidden_norm.0.weight": torch.ones(64),
                  "model.mtp_linear_proj.0.weight": torch.zeros(64, 128)})
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    again = type(hf).from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = again(tokens).logits
        torch.testing.assert_close(expected, hf(tokens).logits, atol=1e-6, rtol=0)
        torch.testing.assert_close(HookedDecoder.from_pretrained(tmp_path)(tokens), expected, atol=1e-4, rtol=0)


# ---- config.json's fields: transformers' defaults, ERNIE's sparse layers, saving ---------------------------------
def test_left_out_routing_fields_read_as_transformers_fills_them(tmp_path):
    """Config files that leave out every routing field read as transformers' config classes fill them (MiniMax: 256
    experts, 8 a token, intermediate_size 1536 wide, the whole head rotated without rotary_dim; ERNIE: 64 experts, 6
    a token, 2 shared, the first layer dense, the 1e-12 floor, no biases); ERNIE's sparse layers are those
    transformers' own model makes sparse."""
    import transformers as tf

    from probe.loading import config_from_hf

    dropped = {"minimax_m2": ("num_local_experts", "num_experts_per_tok", "intermediate_size", "rotary_dim",
                              "rope_parameters"),
               "ernie4_5_moe": ("moe_num_experts", "moe_k", "moe_num_shared_experts", "moe_intermediate_size",
                                "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval", "moe_norm_min",
                                "use_bias", "intermediate_size")}
    for kind, keys in dropped.items():
        build(kind, tmp_path / kind)
        path = tmp_path / kind / "config.json"
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k not in keys}))
        theirs = tf.AutoConfig.from_pretrained(tmp_path / kind)
        ours = config_from_hf(json.loads(path.read_text()), tmp_path / kind)
        experts = ours.experts
        if kind == "minimax_m2":
            assert (experts.n, experts.per_token, ours.expert_width) == (
                theirs.num_local_experts, theirs.num_experts_per_tok, theirs.intermediate_size)
            assert ours.rotary_dim == int(theirs.head_dim * theirs.rope_parameters.get("partial_rotary_factor", 1.0))
            assert ours.rotary_base == theirs.rope_parameters["rope_theta"] and experts.renormalize
            continue
        assert (experts.n, experts.per_token, ours.expert_width, ours.d_mlp, experts.renormalize_min) == (
            theirs.moe_num_experts, theirs.moe_k, theirs.moe_intermediate_size, theirs.intermediate_size,
            theirs.moe_norm_min)
        assert experts.shared == theirs.moe_num_shared_experts * theirs.moe_intermediate_size
        assert ours.mlp_bias == ours.qkv_bias == ours.unembed_bias == theirs.use_bias
        with torch.device("meta"):
            model = tf.Ernie4_5_MoeForCausalLM(theirs)
        assert [ours.layer_sparse(l) for l in range(ours.n_layers)] == [hasattr(layer.mlp, "gate")
                                                                        for layer in model.model.layers]


def test_minimax_released_config_spelling_reads_as_transformers(tmp_path):
    """MiniMax-M2's released config.json names the rotated width `rotary_dim` beside `rope_theta`, with no rope
    dict; transformers reads it as the fraction rotary_dim / head_dim, and so does probe."""
    build("minimax_m2", tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    path.write_text(json.dumps({**config, "rope_theta": 500.0, "rotary_dim": 4, "qk_norm_type": "per_layer",
                                "scoring_func": "sigmoid", "use_routing_bias": True}))
    import transformers as tf

    hf = tf.MiniMaxM2ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.config.rope_parameters["partial_rotary_factor"] == 0.25 and rope["partial_rotary_factor"] == 0.5
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    assert model.cfg.rotary_dim == 4 and model.cfg.rotary_base == 500.0
    tokens = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=0)


def test_ernie_refuses_a_null_floor(tmp_path):
    from probe.loading import CheckpointError

    build("ernie4_5_moe", tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "moe_norm_min": None}))
    with pytest.raises(CheckpointError, match=r"moe_norm_min=null.*give a positive number"):
        HookedDecoder.from_pretrained(tmp_path)


@pytest.mark.parametrize("layers, start, end, interval", [(5, 0, -1, 2), (5, 1, 3, 1), (6, 2, 4, 2), (7, 0, 5, 3),
                                                          (4, 3, -1, 1)])
def test_ernie_sparse_layers_are_transformers_and_save_as_a_span(layers, start, end, interval):
    """moe_layer_start_index, moe_layer_end_index and moe_layer_interval pick the layers transformers' model makes
    sparse; the writer's span (any that picks the same layers) builds the same model in transformers."""
    import transformers as tf

    def sparse_in_transformers(config) -> list[bool]:
        with torch.device("meta"):
            model = tf.Ernie4_5_MoeForCausalLM(config)
        return [hasattr(layer.mlp, "gate") for layer in model.model.layers]

    config = tf.Ernie4_5_MoeConfig(vocab_size=11, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                                   num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                   moe_num_experts=4, moe_k=2, moe_layer_start_index=start, moe_layer_end_index=end,
                                   moe_layer_interval=interval)
    cfg = ernie4_5_moe_config(config.to_dict())
    ours = [cfg.layer_sparse(l) for l in range(layers)]
    assert ours == sparse_in_transformers(config) and any(ours)
    written = ernie4_5_moe_config_to_hf(cfg, None)
    assert sparse_in_transformers(tf.Ernie4_5_MoeConfig(**written)) == ours
    assert ernie4_5_moe_config(written) == cfg


@pytest.mark.parametrize("case", ["minimax-m2-whole-head-mqa-wide-heads-tied",
                                  "ernie4-5-moe-biases-tied-every-other-layer",
                                  "ernie4-5-moe-clamped-sum-all-sparse-two-shared-untied",
                                  "ernie4-5-moe-dense-last-layer"])
def test_each_case_saves_through_transformers(case, tmp_path):
    """The cases beyond each family's default (which test_variants.py's round trip saves), saved and read back by
    transformers' own class and by probe."""
    kind, overrides = CASES[case]
    hf = build(kind, tmp_path / "hf", **overrides)
    model = HookedDecoder.from_pretrained(tmp_path / "hf")
    saved = model.save_pretrained(tmp_path / "ours")
    config = json.loads((saved / "config.json").read_text())
    wanted = {"minimax-m2-whole-head-mqa-wide-heads-tied": {"rotary_dim": 24, "head_dim": 24, "num_experts_per_tok": 3},
              "ernie4-5-moe-biases-tied-every-other-layer": {"use_bias": True, "moe_layer_interval": 2,
                                                              "moe_num_shared_experts": 0},
              "ernie4-5-moe-clamped-sum-all-sparse-two-shared-untied": {
                  "moe_norm_min": 0.8, "moe_num_shared_experts": 2, "moe_layer_start_index": 0},
              "ernie4-5-moe-dense-last-layer": {"moe_layer_end_index": 1}}[case]
    assert {k: config[k] for k in wanted} == wanted
    again = type(hf).from_pretrained(saved).eval()
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, atol=1e-5, rtol=0)
    assert HookedDecoder.from_pretrained(saved).cfg == model.cfg


def test_formats_refuse_what_they_cannot_hold():
    """ERNIE's writer refuses experts outside one span of layers, a router with biases and shared experts narrower
    than an expert; MiniMax's refuses softmax scores; both say which field."""
    from probe.checkpoint_minimax import minimax_m2_config_to_hf

    base = dict(n_layers=4, d_model=16, n_heads=2, d_vocab=11, n_ctx=8, gated_mlp=True, positions="rotary",
                norm="rms", qkv_bias=False, out_bias=False, mlp_bias=False, rotary_adjacent_pairs=True)
    ernie = dict(n=4, per_token=2, renormalize=True, renormalize_min=1e-12, selection_bias=True)
    with pytest.raises(ValueError, match=r"one span.*layers \[0, 1, 3\]"):
        ernie4_5_moe_config_to_hf(DecoderConfig(**base, experts={**ernie, "layers": (True, True, False, True)}), None)
    with pytest.raises(ValueError, match="routed_bias=True"):
        ernie4_5_moe_config_to_hf(DecoderConfig(**{**base, "qkv_bias": True, "out_bias": True, "mlp_bias": True,
                                                   "unembed_bias": True}, experts=ernie), None)
    with pytest.raises(ValueError, match="shared experts as wide as a whole number of experts"):
        ernie4_5_moe_config_to_hf(DecoderConfig(**base, experts={**ernie, "shared": 24, "shared_gate": False}), None)
    with pytest.raises(ValueError, match="scoring='softmax'"):
        minimax_m2_config_to_hf(DecoderConfig(**{**base, "rotary_adjacent_pairs": False, "qk_norm": True,
                                                 "qk_norm_over_heads": True},
                                              experts=dict(n=4, per_token=2, renormalize=True, selection_bias=True)),
                                None)


# ---- the routing details probe/moe.py gains ------------------------------------------------------------------
@pytest.mark.parametrize("experts, match", [
    (dict(n=8, per_token=2, renormalize_min=1e-12), r"renormalize_min=1e-12 clamps the renormalising sum.*"
                                                    r"renormalize=True"),
    (dict(n=8, per_token=2, renormalize=True, renormalize_min=0), r"renormalize_min=0 .*give a positive number"),
    (dict(n=8, per_token=2, renormalize=True, renormalize_min=True), r"renormalize_min=True"),
    (dict(n=8, per_token=2, routed_bias="no"), r"Experts.routed_bias must be a bool"),
])
def test_bad_routing_settings_are_refused_by_name(experts, match):
    with pytest.raises(ValueError, match=match):
        DecoderConfig(n_layers=2, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, gated_mlp=True, experts=experts)


def test_the_expert_routing_analysis_weighs_by_the_clamped_sum(tmp_path):
    """expert_routing's weights are those transformers' router gives, its floor of the sum included."""
    from probe.analyses import expert_routing

    kind, overrides = CASES["ernie4-5-moe-clamped-sum-all-sparse-two-shared-untied"]
    hf = build(kind, tmp_path, **overrides)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    toks = torch.randint(0, 101, (1, 11), generator=torch.Generator().manual_seed(4))
    routing = expert_routing(model, toks)
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
        for layer in range(3):
            _, weights, chosen = hf.model.layers[layer].mlp.gate(mlp_input(model, cache, layer))
            torch.testing.assert_close(dense(routing.weights[layer], routing.chosen[layer], 6),
                                       dense(weights, chosen, 6), atol=1e-6, rtol=0)
            assert (weights.sum(-1) < 1 - 1e-3).any()  # (the floor bites: some weights sum to less than 1)


def test_folding_a_layernorm_bias_into_unbiased_experts_gives_them_biases():
    """A LayerNorm's bias folded into experts without biases (routed_bias=False) leaves a model whose config says
    they have them now: the same log-probs, and a model rebuilt from its config loads its weights."""
    from probe.processing import process_weights

    cfg = DecoderConfig(n_layers=2, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, gated_mlp=True, mlp_bias=True,
                        experts=dict(n=4, per_token=2, renormalize=True, routed_bias=False))
    torch.manual_seed(0)
    model = HookedDecoder(cfg).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.ln2.b.normal_(0, 0.5)
    assert model.blocks[0].mlp.experts[0].W_in.bias is None
    processed = process_weights(model, fold_ln=True, center_writing_weights=False, center_unembed=False,
                                fold_value_biases=False)
    toks = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(processed(toks).log_softmax(-1), model(toks).log_softmax(-1), atol=1e-5, rtol=0)
    assert processed.cfg.experts.routed_bias and processed.blocks[0].mlp.W_gate.bias is not None
    HookedDecoder(processed.cfg).load_state_dict(processed.state_dict())
