"""LFM2 and LFM2-MoE (probe/short_conv.py, probe/checkpoint_lfm2.py). The logits and every residual of each case are
compared with transformers in test_variants.py (CASES) with saving; here: the mixer against transformers' own
Lfm2ShortConv module (whole, and one token at a time through its cache), weights strong enough that the convolution
shows, the config fields transformers reads, generation through the carried window, padding, TL 4's bridge hook by
hook and by its names, compatibility mode, the report, the ledger, the routing's renormalising eps against
transformers' block, and the analyses that run or refuse by name."""
from __future__ import annotations

import json

import pytest
import torch

from probe import DecoderConfig, Experts, HookedDecoder, ShortConv
from probe.kv_cache import KVCache
from family_checks import (assert_saved_files_read_back, assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, assert_on_the_device_as_transformers,
                           cache_of_everything, left_padded_logits, report_page, seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import CASES, build

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))


def strengthened(hf, directory):
    """The convolution layers' projections scaled up, so B * x, the filter and the C gate shape the write (random
    small weights leave it near nothing beside the MLPs); saved to `directory`."""
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer, "conv"):
                layer.conv.in_proj.weight.mul_(8)
                layer.conv.conv.weight.mul_(4)
    hf.save_pretrained(directory)
    return hf


@pytest.mark.parametrize("case", sorted(c for c in CASES if c.startswith("lfm2")))
def test_saving_keeps_every_setting(case, tmp_path):
    """Each test_variants case saved by probe and read back by transformers (the kernel, biases, width, routing as
    the case sets them) gives the original's logits, and probe reads its own file back to the same config."""
    assert_saved_files_read_back(*CASES[case], tmp_path, TOKENS)


def test_the_mixer_is_transformers_module_whole_and_one_token_at_a_time(tmp_path):
    """probe's mixer against transformers' Lfm2ShortConv with the same weights: a whole sequence, then a prefix and
    single tokens through each one's cache (transformers' one-token path is its causal_conv1d_update); the carried
    window is the last kernel - 1 of transformers' conv state."""
    from transformers.cache_utils import DynamicCache

    hf = strengthened(build("lfm2", tmp_path / "src", conv_bias=True, conv_L_cache=4), tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    theirs, ours = hf.model.layers[0].conv, model.blocks[0].conv
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
        cache, past = DynamicCache(config=hf.config), KVCache(3, batch_size=2).layers[0]
        for start, end in ((0, 5), (5, 6), (6, 7), (7, 9)):
            torch.testing.assert_close(ours(x[:, start:end], past=past), theirs(x[:, start:end], cache=cache),
                                       atol=1e-5, rtol=0)
    assert past.seen == 9 and past.conv_window.shape == (2, 3, 64)
    torch.testing.assert_close(past.conv_window, cache.get_conv_state(0)[..., -3:].mT, atol=1e-6, rtol=0)


def test_a_strong_convolution_is_transformers_point_by_point(tmp_path):
    """With strong weights: logits and residuals, and each of probe's mixer points against what transformers' modules
    see (in_proj's output, the convolution's input and output, out_proj's input)."""
    hf = strengthened(build("lfm2", tmp_path / "src", conv_bias=True), tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (2, 30), generator=torch.Generator().manual_seed(1))
    conv = hf.model.layers[2].conv
    seen = seen_in_forward(hf, tokens, {"in_proj": conv.in_proj, "out_proj": conv.out_proj})
    with torch.no_grad():
        expected = hf(tokens, output_hidden_states=True)
        logits, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(logits, expected.logits, atol=1e-4, rtol=0)
    for layer in range(3):
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_resid_pre"], expected.hidden_states[layer], atol=1e-4,
                                   rtol=0)
    m = "blocks.2.conv"
    torch.testing.assert_close(cache[f"{m}.hook_in_proj"], seen["in_proj"][1], atol=1e-5, rtol=0)
    B, C, x = seen["in_proj"][1].chunk(3, dim=-1)  # transformers' order
    for name, value in (("B", B), ("C", C), ("x", x), ("conv_in", B * x)):
        torch.testing.assert_close(cache[f"{m}.hook_{name}"], value, atol=1e-5, rtol=0)
    by_conv = conv.conv(cache[f"{m}.hook_conv_in"].mT)[..., :30].mT  # transformers' module, its own padding trimmed
    torch.testing.assert_close(cache[f"{m}.hook_conv_out"], by_conv, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache[f"{m}.hook_gated"], seen["out_proj"][0][0], atol=1e-5, rtol=0)
    # the filter reads earlier positions: a real share of the output is not the current position's own
    own = conv.conv.weight[:, 0, -1] * cache[f"{m}.hook_conv_in"] + conv.conv.bias
    assert (cache[f"{m}.hook_conv_out"] - own).abs().mean() > 0.3 * own.abs().mean()


@pytest.mark.parametrize("kind", ["lfm2", "lfm2_moe"])
def test_generation_processing_and_cached_parts_are_transformers(kind, tmp_path):
    hf = build(kind, tmp_path, conv_bias=True)
    assert_generation_and_processing_match(hf, tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, _ = assert_cached_parts_are_one_forward(model, torch.randint(0, 101, (2, 16),
                                                                        generator=torch.Generator().manual_seed(6)))
    assert cache.layers[0].conv_window.shape == (2, 2, 64) and cache.layers[1].k.shape[1] == 16


def test_a_one_position_filter_carries_nothing_and_still_generates(tmp_path):
    hf = build("lfm2", tmp_path, conv_L_cache=1)
    assert_generation_and_processing_match(hf, tmp_path, processing=False)


def test_left_padding_reaches_neither_the_window_nor_the_output(tmp_path):
    """With biases, a zeroed padded input still writes the biases' product into the window, as transformers does:
    probe matches transformers on a left-padded batch, in one pass and through generation."""
    hf = strengthened(build("lfm2", tmp_path / "src", conv_bias=True), tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    padded, _, theirs = left_padded_logits(model, hf)
    torch.testing.assert_close(padded[:, 4:], theirs[:, 4:], atol=1e-4, rtol=0)
    assert_left_padded_generation_matches(build("lfm2", tmp_path / "gen", conv_bias=True), tmp_path / "gen")


@pytest.mark.parametrize("kind", ["lfm2", "lfm2_moe"])
def test_every_shared_hook_and_bridge_name_matches_the_bridge(kind, tmp_path):
    """TL 4's bridge (its Lfm2ShortConvBridge under `conv`) hook by hook, and its names for the mixer's points; the
    per-head q/k norm points it holds as [batch head pos ...] are probe's transposed. Its convolution's own points
    do not fire (transformers reads the convolution's weight): probe's names for them say where to look."""
    from transformer_lens.model_bridge import TransformerBridge

    from probe.hooks import UnknownNameError

    directory = tokenized_checkpoint(kind, tmp_path / kind)
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(directory).eval()
    tokens = TOKENS % model.cfg.d_vocab
    names = [f"blocks.0.conv.{n}" for n in ("hook_in", "in.hook_in", "in.hook_out", "out.hook_in", "out.hook_out",
                                            "hook_out")] + ["blocks.0.hook_in", "blocks.2.hook_out"]
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, ours = model.run_with_cache(tokens)
        _, named = model.run_with_cache(tokens, names=names)
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    compared = set()
    # (the bridge's hook_expert_weights are the chosen experts' final weights, zeros elsewhere; probe's the sigmoid
    # scores of every expert, as transformer-lens 3.9's: compared below)
    for name in (n for n in ours if n in theirs and not n.endswith("hook_expert_weights")):
        a, b = ours[name], theirs[name]
        if "_norm.hook_" in name or name.endswith("_normed"):  # (the bridge's [batch head pos ...])
            b = b.transpose(1, 2)
        if name.endswith("hook_attn_scores"):
            visible = torch.ones(13, 13, dtype=torch.bool).tril()
            a, b = a[..., visible], b[..., visible]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
        compared.add(name)
    assert {"blocks.0.conv.hook_in_proj", "blocks.0.conv.hook_gated", "blocks.1.attn.hook_pattern",
            "blocks.1.attn.q_norm.hook_normalized", "blocks.2.hook_resid_post"} <= compared
    for name in names:
        torch.testing.assert_close(named[name], theirs[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    for layer in filter(model.cfg.layer_sparse, range(3)):
        mlp = f"blocks.{layer}.mlp"
        scores, chosen = ours[f"{mlp}.hook_expert_weights"], ours[f"{mlp}.hook_expert_indices"]
        top = scores.gather(-1, chosen)
        used = torch.zeros_like(scores).scatter(-1, chosen, top / (top.sum(-1, keepdim=True) + 1e-6))
        torch.testing.assert_close(theirs[f"{mlp}.hook_expert_weights"], used, atol=1e-6, rtol=0)
    assert not any(n.startswith("blocks.0.conv.conv.") for n in theirs)
    for name in ("conv.conv.hook_in", "conv.conv.hook_out", "conv.hook_conv"):
        with pytest.raises(UnknownNameError, match="hook_conv_out"):
            model.hook_point(f"blocks.0.{name}")


def test_compatibility_mode_folds_as_the_bridge_and_the_report_runs(tmp_path):
    """The bridge's LFM2 adapter folds every norm in compatibility mode (the convolution's in_proj takes ln1's
    weight): probe skips only the centring its RMS norms do not allow, and gives the bridge's activations; `probe
    report` runs and says why its head sections are not run."""
    from transformer_lens.model_bridge import TransformerBridge

    directory = tokenized_checkpoint("lfm2", tmp_path / "lfm2")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(directory)
    with pytest.warns(UserWarning, match="skipping center_writing_weights"):
        model.enable_compatibility_mode()
    bridge.enable_compatibility_mode()
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        ours, our_cache = model.run_with_cache(tokens)
        theirs, their_cache = bridge.run_with_cache(tokens)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for name in ("blocks.0.ln1.hook_out", "blocks.0.conv.hook_in_proj", "blocks.1.attn.hook_pattern",
                 "blocks.2.hook_resid_post", "ln_final.hook_out"):
        torch.testing.assert_close(our_cache[name], their_cache[name], atol=1e-4, rtol=0, msg=name)
    page = report_page(directory, tmp_path / "out")
    assert ("Not run: head ablation reads every layer&#x27;s attention heads, and layers [0, 2] of this hybrid model "
            "are short-convolution (LFM2) layers") in page
    assert (tmp_path / "out" / "patching.csv").exists()


@pytest.mark.parametrize("kind, overrides", [("lfm2", {}), ("lfm2", {"conv_bias": True, "tie_word_embeddings": False}),
                                             ("lfm2_moe", {}), ("lfm2_moe", {"num_dense_layers": 0})])
def test_the_ledger_counts_what_transformers_holds(kind, overrides, tmp_path):
    hf = build(kind, tmp_path, **overrides)
    model = HookedDecoder.from_pretrained(tmp_path)
    book = model.ledger()
    assert book.total_params == sum(p.numel() for p in model.parameters()) == hf.num_parameters()
    assert book.kv_bytes_per_token == 2 * 2 * 16 * 4  # the one attention layer's keys and values


def _with_config(directory, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("built, changes", [
    # older files: the attention layers by index (the others convolutions), the MLP's width and the tying under their
    # first names (block_ff_dim 100: int(1.3 * int(2/3 of it)) = 85, rounded up to 96, the file's width)
    ({"layer_types": ["full_attention", "conv", "full_attention"]}, {"layer_types": None, "full_attn_idxs": [0, 2]}),
    ({"tie_word_embeddings": False}, {"intermediate_size": None, "block_ff_dim": 100, "tie_word_embeddings": None,
                                      "tie_embedding": False}),
])
def test_config_fields_are_read_as_transformers_reads_them(built, changes, tmp_path):
    import transformers as tf

    build("lfm2", tmp_path, **built)
    _with_config(tmp_path, **changes)
    hf = tf.Lfm2ForCausalLM.from_pretrained(tmp_path).eval()
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    assert model.cfg.short_conv.layers == tuple(kind == "conv" for kind in hf.config.layer_types)
    assert model.cfg.d_mlp == hf.model.layers[0].feed_forward.w1.out_features == 96
    assert model.cfg.tied_embeddings == hf.config.tie_word_embeddings == ("tie_embedding" not in changes)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(TOKENS).logits, atol=1e-4, rtol=0)


def test_lfm2_moe_renormalises_with_transformers_eps_where_the_scores_are_tiny():
    """LFM2-MoE divides the chosen weights by their sum plus 1e-6: where every score is tiny (logits far below 0) the
    weights fall well short of 1, as transformers' own sparse block computes them."""
    import transformers as tf
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeSparseMoeBlock

    from probe.checkpoint_lfm2 import lfm2_moe_config
    from probe.moe import MoEMLP

    config = tf.Lfm2MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                              num_hidden_layers=1, num_dense_layers=0, layer_types=["full_attention"],
                              num_attention_heads=2, num_key_value_heads=2)
    theirs = Lfm2MoeSparseMoeBlock(config).eval()
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        theirs.gate.weight.copy_(torch.randn(4, 16, generator=g) * 0.1)
        theirs.gate.weight[:, 0] = -1.0  # the first input dimension pushes every logit down
        theirs.experts.gate_up_proj.copy_(torch.randn(4, 16, 16, generator=g))
        theirs.experts.down_proj.copy_(torch.randn(4, 16, 8, generator=g))
        theirs.expert_bias.copy_(torch.randn(4, generator=g))
    cfg = lfm2_moe_config(config.to_dict())
    ours = MoEMLP(cfg).eval()
    with torch.no_grad():
        ours.W_gate.weight.copy_(theirs.gate.weight)
        ours.e_score_correction_bias.copy_(theirs.expert_bias)
        for e, expert in enumerate(ours.experts):
            expert.W_gate.weight.copy_(theirs.experts.gate_up_proj[e, :8])
            expert.W_in.weight.copy_(theirs.experts.gate_up_proj[e, 8:])
            expert.W_out.weight.copy_(theirs.experts.down_proj[e])
    x = torch.randn(2, 5, 16, generator=g)
    x[1, :, 0] = 30.0  # the second sequence's logits near -30: scores near 1e-13, their sum far below the eps
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-4)
    assert cfg.experts.renormalize_eps == 1e-6


def test_analyses_of_heads_refuse_and_analyses_of_layers_run(tmp_path):
    """Head analyses name the short-convolution layers; residual decomposition treats each one's write as one
    component, and direct logit attribution adds up to transformers' logit difference."""
    import probe.analyses as A

    hf = build("lfm2", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with pytest.raises(ValueError, match=r"layers \[0, 2\] of this hybrid model are short-convolution \(LFM2\) layers"):
        A.head_scores(model, "induction", n_samples=4)
    with pytest.raises(AttributeError, match="short-convolution \\(LFM2\\) layer: it has no attention heads"):
        model.blocks[0].attn
    with pytest.raises(ValueError, match=r"short-convolution \(LFM2\) layers have no attention heads.*\(\[1\]\)"):
        model.W_Q
    dla = A.direct_logit_attribution(model, TOKENS, torch.tensor([5, 5]), torch.tensor([9, 9]))
    with torch.no_grad():
        logits = hf(TOKENS).logits[:, -1]
    torch.testing.assert_close(dla.total, logits[:, 5] - logits[:, 9], atol=1e-4, rtol=0)
    assert {"L0 conv", "L1H0", "L2 conv"} <= set(dla.to_frame()["component"])


def test_hook_shapes_predict_the_mixers_points(tmp_path):
    build("lfm2", tmp_path)
    _, _, cache, predicted = cache_of_everything(tmp_path)
    assert {name: tuple(value.shape) for name, value in cache.items()} == {name: predicted[name] for name in cache}
    assert "blocks.2.conv.hook_conv_out" in cache


def test_config_errors_name_the_fix():
    base = dict(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, positions="rotary", norm="rms",
                gated_mlp=True)
    spec = dict(layers=(True, False), conv_kernel=3)
    assert DecoderConfig(**base, short_conv=spec).short_conv == ShortConv(**spec)
    for bad, match in ((dict(spec, layers=(False, False)), "at least one True"), (dict(spec, conv_kernel=0),
                                                                                  "conv_kernel"),
                       (dict(spec, bias=1), "bias must be a bool"), (dict(spec, layers=(True, False, True)),
                                                                    "gives 3 layers")):
        with pytest.raises(ValueError, match=match):
            DecoderConfig(**base, short_conv=bad)
    with pytest.raises(ValueError, match="settings differ: norm_placement"):
        DecoderConfig(**base, short_conv=spec, norm_placement="parallel")
    with pytest.raises(ValueError, match="renormalize_eps=0"):
        DecoderConfig(**base, experts=dict(n=4, per_token=2, renormalize=True, renormalize_eps=0))


@pytest.mark.parametrize("kind", ["lfm2", "lfm2_moe"])
def test_the_hybrid_on_the_device_is_transformers_there(kind, tmp_path, device_under_test):
    """On the GPU (the GPU list): a prompt's logits and its greedy continuation through the carried window, against
    transformers' model on the same device."""
    hf = build(kind, tmp_path, conv_bias=True)
    assert_on_the_device_as_transformers(hf, tmp_path, device_under_test, 40)


@pytest.mark.parametrize("kind", ["lfm2", "lfm2_moe"])
def test_left_out_keys_read_as_transformers_defaults(kind, tmp_path):
    """A config.json without the convolution's, the MLP width rule's and the routing's keys reads as transformers'
    config class fills them in (the oracle: AutoConfig on the same file, and the MLP transformers builds from it)."""
    import transformers as tf

    from probe.loading import config_from_hf

    build(kind, tmp_path, conv_bias=True, conv_L_cache=4)
    left_out = ("conv_bias", "conv_L_cache", "block_multiple_of", "block_ffn_dim_multiplier", "block_auto_adjust_ff_dim",
                "num_experts_per_tok", "use_expert_bias", "routed_scaling_factor",
                "norm_topk_prob", "num_dense_layers")
    _with_config(tmp_path, **dict.fromkeys(left_out))
    theirs = tf.AutoConfig.from_pretrained(tmp_path)
    ours = config_from_hf(json.loads((tmp_path / "config.json").read_text()), tmp_path)
    assert (ours.short_conv.conv_kernel, ours.short_conv.bias) == (theirs.conv_L_cache, theirs.conv_bias)
    if kind == "lfm2":
        from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP
        assert ours.d_mlp == Lfm2MLP(theirs).w1.out_features
        return
    experts = ours.experts
    assert (experts.per_token, experts.selection_bias, experts.scaling, experts.renormalize) == (
        theirs.num_experts_per_tok, theirs.use_expert_bias, theirs.routed_scaling_factor, theirs.norm_topk_prob)
    assert [ours.layer_sparse(l) for l in range(3)] == [l >= theirs.num_dense_layers for l in range(3)]


def test_what_the_formats_cannot_hold_is_refused_by_name():
    import dataclasses

    from probe.checkpoint_lfm2 import lfm2_config_to_hf, lfm2_moe_config_to_hf

    base = DecoderConfig(n_layers=3, d_model=32, n_heads=4, n_kv_heads=2, d_vocab=50, n_ctx=16, positions="rotary",
                         norm="rms", gated_mlp=True, activation="silu", qk_norm=True, qkv_bias=False, out_bias=False,
                         mlp_bias=False, short_conv=dict(layers=(True, False, True)))
    assert lfm2_config_to_hf(base, None)["layer_types"] == ["conv", "full_attention", "conv"]
    experts = dict(n=4, per_token=2, scoring="sigmoid", selection_bias=True, renormalize=True, renormalize_eps=1e-6,
                   width=16)
    for cfg, writer, match in (
            (dataclasses.replace(base, d_head=16), lfm2_config_to_hf, "heads split d_model"),
            (dataclasses.replace(base, qk_norm=False), lfm2_config_to_hf, "qk_norm=False"),
            (dataclasses.replace(base, experts=Experts(**experts, layers=(False, True, True))), lfm2_config_to_hf,
             "lfm2_moe's format holds them"),
            (dataclasses.replace(base, experts=Experts(**experts, layers=(True, False, True))), lfm2_moe_config_to_hf,
             r"first layers \(num_dense_layers\).*\[0, 2\]"),
            (dataclasses.replace(base, experts=Experts(**{**experts, "renormalize_eps": 1e-20},
                                                       layers=(False, True, True))), lfm2_moe_config_to_hf,
             "renormalize_eps=1e-20"),
            (base, lfm2_moe_config_to_hf, "holds a mixture of experts")):
        with pytest.raises(ValueError, match=match):
            writer(cfg, None)
