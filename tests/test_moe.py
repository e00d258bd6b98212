"""Mixtures of experts (probe/moe.py) and their checkpoints (probe/checkpoint_moe.py: Mixtral, OLMoE, Qwen3-MoE).

The oracles: HookedTransformer 3.9 (MoE toys built from its config, hook by hook and processed; its own Mixtral and
OLMoE converters and forward on probe's exported state dict), transformers (greedy generation; routing by hand from
its router's weights), and TL 4's bridge over the same checkpoint. test_variants.py compares logits and every
residual with transformers' on each family and saves through it."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from probe import HookedDecoder, HookedTransformerConfig
from probe.processing import process_weights
from probe.tl_state_dict import TL_UNWRITTEN
from family_checks import assert_generation_and_processing_match, cache_of_everything, caches_of_both
from test_sae_training import needs_saelens
from test_variants import build
from tl_cases import TL_DEFAULTS, assert_processed_as_hooked_transformer, assert_same_cache, hooked_transformer_outputs, part

SMALL = dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="silu", normalization_type="RMS",
             positional_embedding_type="rotary", rotary_dim=8, gated_mlp=True, n_key_value_heads=2, num_experts=4,
             experts_per_token=2)
TL_CASES = {
    "mixtral-like": SMALL,
    "renormalised-one-of-three": dict(SMALL, num_experts=3, experts_per_token=1, norm_topk_prob=True),
    # TL builds gated experts whatever gated_mlp says, and LayerNorms around them
    "layernorm-ungated-flag": dict(SMALL, normalization_type="LN", gated_mlp=False, act_fn="gelu"),
}


def tokens(vocab: int = 50, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(seed))


def mlp_input(model, cache, layer: int) -> torch.Tensor:
    """[batch*pos d_model]: what layer's mixture of experts reads, ln2 of the residual."""
    return model.blocks[layer].ln2(cache[f"blocks.{layer}.hook_resid_mid"]).reshape(-1, model.cfg.d_model)


# ---- the routing, by hand ------------------------------------------------------------------------------------
@pytest.mark.parametrize("renormalize", [False, True])
def test_routing_and_each_experts_rows_by_hand(renormalize, tmp_path):
    hf = build("olmoe", tmp_path, norm_topk_prob=renormalize)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    toks = tokens(101)
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
        for layer in range(2):
            mlp, theirs = model.blocks[layer].mlp, hf.model.layers[layer].mlp
            x = mlp_input(model, cache, layer)
            probs = F.softmax(x @ theirs.gate.weight.T, dim=-1)  # transformers' router weights
            torch.testing.assert_close(cache[f"blocks.{layer}.mlp.hook_expert_weights"], probs, atol=1e-6, rtol=0)
            top, chosen = probs.topk(3, dim=-1)
            assert torch.equal(cache[f"blocks.{layer}.mlp.hook_expert_indices"], chosen)
            if renormalize:
                top = top / top.sum(-1, keepdim=True)
            out = torch.zeros_like(x)
            for e in range(6):
                # the tokens that chose e first, then second, then third: its points' rows, in that order
                rows = torch.cat([(chosen[:, k] == e).nonzero()[:, 0] for k in range(3)])
                assert torch.equal(mlp.routing(chosen, e)[1], rows)
                expert = theirs.experts
                gate_up = expert.gate_up_proj[e] if hasattr(expert, "gate_up_proj") else None
                gate, up = (x[rows] @ gate_up.T).chunk(2, dim=-1)
                torch.testing.assert_close(cache[f"blocks.{layer}.mlp.experts.{e}.hook_gate"], gate, atol=1e-5, rtol=0)
                torch.testing.assert_close(cache[f"blocks.{layer}.mlp.experts.{e}.hook_pre"], up, atol=1e-5, rtol=0)
                post = F.silu(gate) * up
                torch.testing.assert_close(cache[f"blocks.{layer}.mlp.experts.{e}.hook_post"], post, atol=1e-5, rtol=0)
                weight = torch.cat([top[chosen[:, k] == e, k] for k in range(3)])
                out.index_add_(0, rows, (post @ expert.down_proj[e].T) * weight[:, None])
            torch.testing.assert_close(cache[f"blocks.{layer}.hook_mlp_out"].reshape(-1, 64), out, atol=1e-5, rtol=0)


def test_an_edit_of_the_routing_weights_changes_which_experts_run(tmp_path):
    build("mixtral", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    toks = tokens(101)

    def only_expert_3(probs, hook):
        forced = torch.zeros_like(probs)
        forced[:, 3], forced[:, 1] = 0.75, 0.25
        return forced

    with torch.no_grad():
        logits, cache = model.run_with_cache(toks, fwd_hooks=[("blocks.0.mlp.hook_expert_weights", only_expert_3)])
        x = mlp_input(model, cache, 0)
        experts = model.blocks[0].mlp.experts
        # renormalised 0.75 / 0.25 of experts 3 and 1, for every token
        by_hand = 0.75 * experts[3](x) + 0.25 * experts[1](x)
    assert torch.equal(cache["blocks.0.mlp.hook_expert_indices"], torch.tensor([[3, 1]]).expand(22, 2))
    assert cache["blocks.0.mlp.experts.0.hook_post"].shape == (0, 48)
    torch.testing.assert_close(cache["blocks.0.hook_mlp_out"].reshape(-1, 64), by_hand, atol=1e-5, rtol=0)


def test_hook_shapes_bound_the_expert_rows_and_fix_the_rest(tmp_path):
    build("mixtral", tmp_path)
    model, toks, cache, predicted = cache_of_everything(tmp_path)
    assert set(cache) <= set(predicted)
    for name, t in cache.items():
        if ".experts." in name:
            assert t.shape[0] <= predicted[name][0] and t.shape[1:] == predicted[name][1:], name
        else:
            assert tuple(t.shape) == predicted[name], name
    routed = sum(cache[f"blocks.0.mlp.experts.{e}.hook_post"].shape[0] for e in range(4))
    assert routed == 2 * 22  # every token in two experts
    assert model.estimate_cache_bytes(list(cache), None, toks) >= cache.nbytes


# ---- transformer-lens -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hooked_transformers(tmp_path_factory) -> dict:
    # TL's fold of a LayerNorm into experts multiplies w only (its b and centring left out): RMS cases processed
    rms = tuple(name for name, settings in TL_CASES.items() if settings["normalization_type"] == "RMS")
    return hooked_transformer_outputs(tmp_path_factory.mktemp("tl_moe"), TL_CASES, tokens(), processed=rms)[0]


@needs_saelens
@pytest.mark.parametrize("case", sorted(TL_CASES))
def test_every_hook_agrees_with_hooked_transformer(case, hooked_transformers):
    out = part(hooked_transformers, f"{case}/")
    cfg = HookedTransformerConfig(**TL_CASES[case])
    assert (cfg.num_experts, cfg.experts_per_token) == (TL_CASES[case]["num_experts"], TL_CASES[case]["experts_per_token"])
    assert cfg.norm_topk_prob == TL_CASES[case].get("norm_topk_prob", False)
    model = HookedDecoder(cfg).eval()
    model.load_state_dict(part(out, "state."), strict=True)
    assert set(model.state_dict()) == {key for key in part(out, "state.") if key.rsplit(".", 1)[-1] not in TL_UNWRITTEN}
    assert_same_cache(model, tokens(), part(out, "cache."), out["logits"])


@needs_saelens
@pytest.mark.parametrize("case", ["mixtral-like", "renormalised-one-of-three"])
def test_tl_default_processing_gives_hooked_transformers_weights_and_activations(case, hooked_transformers):
    """ln2's w folds into the router and every expert's gate and up projections (an RMS model: nothing centred)."""
    assert_processed_as_hooked_transformer(TL_CASES[case], part(hooked_transformers, f"{case}/"), tokens(),
                                           own=dict(TL_DEFAULTS, center_writing_weights=False))


def test_layernorm_processing_keeps_the_log_probs():
    """A LayerNorm's b folds into a bias on the router and every expert (exact, unlike TL's, which drops it)."""
    torch.manual_seed(0)
    model = HookedDecoder(HookedTransformerConfig(**TL_CASES["layernorm-ungated-flag"])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.2 * torch.randn_like(p))
        before = model(tokens()).log_softmax(-1)
        after = process_weights(model, **TL_DEFAULTS)(tokens()).log_softmax(-1)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["olmoe", "qwen3_moe", "qwen2_moe", "flex_olmo"])
def test_the_other_families_hooks_match_the_bridge(kind, tmp_path):
    from test_family_defaults import GPT_FILES, QWEN_FILES, tokenized_checkpoint
    from test_transformer_lens import compare_with_transformer_lens

    olmo = kind in ("olmoe", "flex_olmo")
    directory = tokenized_checkpoint(kind, tmp_path / "checkpoint", GPT_FILES if olmo else QWEN_FILES)
    # (OLMoE's and FlexOlmo's q and k norms span every head: the bridge holds them flattened, as on OLMo 2)
    missing, theirs = compare_with_transformer_lens(directory, 10, seed=4, skip=("hook_expert_weights",),
                                                    flattened=("hook_q_normed", "hook_k_normed") if olmo else ())
    missing = {n for n in missing if ".experts." not in n and "shared_expert_gate" not in n}
    if kind == "flex_olmo":  # TL 4.3's FlexOlmo adapter hooks no routing
        assert missing == {f"blocks.{l}.mlp.hook_expert_{what}" for l in range(2) for what in ("weights", "indices")}
        return
    assert missing == set()
    assert "blocks.1.mlp.hook_expert_indices" in theirs
    if kind == "qwen2_moe":  # the shared expert's points, as the bridge names a gated MLP's
        assert {"blocks.1.mlp.shared_expert.hook_pre", "blocks.1.mlp.shared_expert.hook_post"} <= theirs


def test_the_shared_expert_by_hand(tmp_path):
    """Qwen2-MoE: the routed experts' sum plus sigmoid(shared_expert_gate x) times the shared gated MLP, from
    transformers' own modules."""
    hf = build("qwen2_moe", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens(101))
        for layer in range(2):
            theirs, x = hf.model.layers[layer].mlp, mlp_input(model, cache, layer)
            gate = torch.sigmoid(theirs.shared_expert_gate(x))
            torch.testing.assert_close(cache[f"blocks.{layer}.mlp.hook_shared_expert_gate"], gate, atol=1e-6, rtol=0)
            shared = theirs.shared_expert(x)
            routed = cache[f"blocks.{layer}.hook_mlp_out"].reshape(-1, 64) - gate * shared
            _, weights, chosen = theirs.gate(x)
            torch.testing.assert_close(routed, theirs.experts(x, chosen, weights), atol=1e-5, rtol=0)


def test_hooks_match_the_bridge(tmp_path):
    from test_family_defaults import LLAMA_FILES, tokenized_checkpoint
    from test_transformer_lens import compare_with_transformer_lens
    directory = tokenized_checkpoint("mixtral", tmp_path / "checkpoint", LLAMA_FILES)
    missing, theirs = compare_with_transformer_lens(directory, 10, seed=4, skip=("hook_expert_weights",))
    # the bridge hooks the routing (the chosen experts agree) but not inside each expert
    assert {n for n in missing if ".experts." not in n} == set() and "blocks.0.mlp.hook_expert_indices" in theirs
    # its hook_expert_weights is the weights the chosen experts are summed with, zeros elsewhere; TL 3.9's (and
    # probe's) the softmax over every expert before the choice
    cache, their_cache = caches_of_both(directory, tokens(HookedDecoder.from_pretrained(directory).cfg.d_vocab))
    for layer in range(2):
        probs, chosen = cache[f"blocks.{layer}.mlp.hook_expert_weights"], cache[f"blocks.{layer}.mlp.hook_expert_indices"]
        top = probs.gather(-1, chosen)
        used = torch.zeros_like(probs).scatter(-1, chosen, top / top.sum(-1, keepdim=True))
        torch.testing.assert_close(their_cache[f"blocks.{layer}.mlp.hook_expert_weights"], used, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["mixtral", "flex_olmo"])
def test_generation_through_a_kv_cache_is_transformers_greedy(kind, tmp_path):
    assert_generation_and_processing_match(build(kind, tmp_path), tmp_path, processing=False)  # RMS


def test_a_mixture_of_experts_has_no_one_mlp_matrix_per_layer(tmp_path):
    build("mixtral", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path)
    for name in ("W_in", "W_out", "W_gate", "b_in"):
        with pytest.raises(ValueError, match=f"model.{name}: .*mixtures of experts.*experts\\[e\\].W_in.weight"):
            getattr(model, name)
    with pytest.raises(ValueError, match="num_experts=4, experts_per_token=None.*needs both"):
        HookedTransformerConfig(**dict(SMALL, experts_per_token=None))
    with pytest.raises(ValueError, match="gated_mlp=True"):
        from probe import DecoderConfig

        DecoderConfig(n_layers=1, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, experts={"n": 2, "per_token": 1})
    with pytest.raises(ValueError, match="per_token=3.*more experts than there are"):
        DecoderConfig(n_layers=1, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, gated_mlp=True,
                      experts={"n": 2, "per_token": 3})


def test_a_qwen3_moe_file_without_sparse_layers_is_refused(tmp_path):
    """Dense layers among sparse ones load (test_variants.py's qwen3-moe-mlp-only-layers); a file whose every layer
    is dense names no experts anywhere."""
    from probe.config_file import CheckpointError

    build("qwen3_moe", tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "mlp_only_layers": [0, 1]}))
    with pytest.raises(CheckpointError, match=r"no layer's experts anywhere \(every layer dense"):
        HookedDecoder.from_pretrained(tmp_path)


def test_the_residual_decomposes_with_each_mixture_whole_and_neuron_analyses_say_why_not(tmp_path):
    from probe.analyses import memory_lookup

    build("mixtral", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    toks = tokens(101)
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
    stack, labels = cache.get_full_resid_decomposition(expand_neurons=False, return_labels=True)
    assert "1_mlp_out" in labels
    # the components add up to the residual the final norm reads
    torch.testing.assert_close(stack.sum(0), cache["blocks.1.hook_resid_post"], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="mixtures of experts .*expand_neurons=False"):
        cache.get_full_resid_decomposition(expand_neurons=True)
    with pytest.raises(ValueError, match="memory_lookup: this model's MLPs are mixtures of experts"):
        memory_lookup(model, toks[:1], k=3)


def test_the_report_runs_and_says_why_it_leaves_out_ffn_memories(tmp_path):
    from test_family_defaults import LLAMA_FILES, tokenized_checkpoint
    from probe.cli.cli import main

    directory = tokenized_checkpoint("mixtral", tmp_path / "checkpoint", LLAMA_FILES)
    assert main(["report", "--model", str(directory), "--prompt", "the cat sat on the mat", "--corrupted",
                 "the cat sat on the rug", "--out", str(tmp_path / "report"), "--quiet"]) in (0, None)
    page = (tmp_path / "report" / "report.html").read_text()
    assert "Not run: FFN memories read each layer&#x27;s one MLP, and this model&#x27;s MLPs are mixtures of experts" in page
    assert "Expert routing" in page and "Each token runs through 2 of each layer&#x27;s 4 experts" in page
    assert (tmp_path / "report" / "edges.csv").exists() and not (tmp_path / "report" / "memories.csv").exists()
    routing = pd.read_csv(tmp_path / "report" / "routing.csv")
    assert len(routing) == 2 * 2 * len(model_tokens(directory, "the cat sat on the mat"))  # layers x tokens x experts


def model_tokens(directory, text: str) -> list[int]:
    return HookedDecoder.from_pretrained(directory).to_tokens(text)[0].tolist()


def test_expert_routing_is_transformers_routers(tmp_path):
    """The router's softmax from transformers' own router logits, the chosen experts and their weights, each
    expert's share of the tokens counted by hand, and a figure with every layer."""
    from probe.analyses import expert_routing

    hf = build("olmoe", tmp_path, norm_topk_prob=True)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    toks = tokens(101)[:1]
    with torch.no_grad():
        router_logits = hf(toks, output_router_logits=True).router_logits  # per layer [pos experts]
    routing = expert_routing(model, toks)
    for layer, logits in enumerate(router_logits):
        probs = F.softmax(logits.float(), dim=-1)
        torch.testing.assert_close(routing.probs[layer], probs, atol=1e-6, rtol=0)
        top, chosen = probs.topk(3, dim=-1)
        assert torch.equal(routing.chosen[layer], chosen)
        torch.testing.assert_close(routing.weights[layer], top / top.sum(-1, keepdim=True), atol=1e-6, rtol=0)
        counts = torch.bincount(chosen.flatten(), minlength=6).float()
        torch.testing.assert_close(routing.usage[layer], counts / 11)
    frame = routing.to_frame()
    assert len(frame) == 2 * 11 * 3 and set(frame["rank"]) == {1, 2, 3}
    first = frame[(frame.layer == 1) & (frame.position == 4) & (frame["rank"] == 1)].iloc[0]
    assert first.expert == int(routing.chosen[1, 4, 0]) and first.prob == pytest.approx(float(routing.probs[1, 4].max()))
    fig = routing.figure()
    assert len([t for t in fig.data if t.type == "heatmap"]) == 2
    with pytest.raises(ValueError, match="not mixtures of experts"):
        expert_routing(HookedDecoder.from_pretrained(build_dense(tmp_path)), toks)


def build_dense(tmp_path):
    build("llama", tmp_path / "dense")
    return tmp_path / "dense"


def test_folding_the_norms_into_every_expert_and_the_shared_one_keeps_transformers_log_probs(tmp_path):
    hf = build("qwen2_moe", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path, fold_ln=True, center_writing_weights=False, center_unembed=True,
                                          fold_value_biases=True).eval()
    assert model.cfg.normalization_type == "RMSPre"
    toks = tokens(101)
    with torch.no_grad():
        torch.testing.assert_close(model(toks).log_softmax(-1), hf(toks).logits.log_softmax(-1), atol=1e-4, rtol=0)


def test_flex_olmo_renormalised_tied_case_saves_through_transformers(tmp_path):
    """FlexOlmo's second case (renormalised weights, biases, tied, one expert per token) saved as FlexOlmo and read
    back by transformers' own class (the default case's round trip is in test_variants.py)."""
    import json

    from test_variants import CASES

    kind, overrides = CASES["flex-olmo-renormalised-biases-tied"]
    hf = build(kind, tmp_path / "hf", **overrides)
    saved = HookedDecoder.from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "ours")
    config = json.loads((saved / "config.json").read_text())
    assert config["architectures"] == ["FlexOlmoForCausalLM"] and config["norm_topk_prob"] is True
    again = type(hf).from_pretrained(saved).eval()
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, atol=1e-5, rtol=0)
