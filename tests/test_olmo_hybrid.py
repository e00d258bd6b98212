"""OLMo-Hybrid (probe/checkpoint_olmo_hybrid.py; its DeltaNet is probe/linear_attention.py's with beta_scale and
norm_eps): OLMo 3's post-norm attention among pre-norm Gated DeltaNet layers.

The oracles: transformers (test_variants.py compares logits and every residual on three cases; here saving, greedy
generation through the state cache, TL-default processing, padding, values read off transformers' own DeltaNet
modules, the file's split convolution) and TL 4's bridge over the same checkpoint, hook by hook and in
compatibility mode; the ledger against transformers' parameter count."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from probe import HookedDecoder, LinearAttention
from probe.ledger import ledger
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, assert_on_the_device_as_transformers,
                           cache_of_everything, caches_in_compatibility_mode, report_page, seen_in_forward)
from test_family_defaults import GPT_FILES, tokenized_checkpoint
from test_transformer_lens import compare_with_transformer_lens
from test_variants import CASES, build

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))
OLMO_HYBRID_CASES = sorted(c for c in CASES if c.startswith("olmo-hybrid"))


@pytest.mark.parametrize("case", OLMO_HYBRID_CASES)
def test_saving_keeps_every_setting_and_the_ledger_counts_transformers_parameters(case, tmp_path):
    """Each case saved by probe and read back by transformers gives the original's logits (the layer pattern, rope or
    NoPE, beta's range, the convolution's split and widths as the case sets them), probe reads its own file back to
    the same config, and the ledger counts transformers' parameters."""
    from safetensors.torch import load_file

    kind, overrides = CASES[case]
    hf = build(kind, tmp_path / "src", **overrides)
    model = HookedDecoder.from_pretrained(tmp_path / "src")
    out = model.save_pretrained(tmp_path / "saved")
    again = type(hf).from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, hf(TOKENS).logits, atol=1e-5, rtol=0)
    assert HookedDecoder.from_pretrained(out).cfg == model.cfg
    # the tensors are transformers' own save's, name for name (its norm names, its convolution in three chunks)
    theirs, ours = load_file(tmp_path / "src" / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(ours) == set(theirs) - ({"lm_head.weight"} if hf.config.tie_word_embeddings else set())
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert ledger(model.cfg).total_params == sum(p.numel() for p in hf.parameters())


def test_the_config_is_transformers_reading():
    """NoPE where rope_theta is null, beta doubled by default, the gated norm's eps fixed, transformers' layer pattern
    and widths where the file leaves them out; what transformers cannot run is refused by name."""
    import transformers as tf

    from probe.checkpoint_olmo_hybrid import olmo_hybrid_config
    from probe.config_file import CheckpointError

    hf = dict(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, intermediate_size=96, vocab_size=101,
              rope_parameters={"rope_type": "default", "rope_theta": None})
    cfg = olmo_hybrid_config(hf)
    linear = cfg.linear_attention
    assert linear.layers == (True, True, True, False, True, True)
    assert (linear.key_heads, linear.d_key_head, linear.d_value_head) == (4, 12, 24)
    assert linear.beta_scale == 2.0 and linear.norm_eps == 1e-5 and cfg.eps == 1e-6
    assert cfg.rotary_layers == (False,) * 6 and cfg.n_ctx == 65536
    assert type(cfg).from_dict(cfg.to_dict()) == cfg  # a config file keeps beta's range and the norm's eps
    for n in (3, 5, 6):  # transformers' default pattern: every fourth layer attention, else the last
        expected = tf.OlmoHybridConfig(**{**hf, "num_hidden_layers": n}).layer_types
        assert olmo_hybrid_config({**hf, "num_hidden_layers": n}).linear_attention.layers == tuple(
            t == "linear_attention" for t in expected)
    rotary = olmo_hybrid_config({**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
                                 "linear_allow_neg_eigval": False})
    assert rotary.rotary_layers is None and rotary.rotary_base == 500.0 and rotary.linear_attention.beta_scale == 1.0
    with pytest.raises(CheckpointError, match="shares no key head"):
        olmo_hybrid_config({**hf, "linear_num_value_heads": 8})
    with pytest.raises(CheckpointError, match="DeltaNet convolution's activation"):
        olmo_hybrid_config({**hf, "hidden_act": "gelu"})
    with pytest.raises(CheckpointError, match="one of linear_attention, full_attention"):
        olmo_hybrid_config({**hf, "layer_types": ["linear_attention"] * 5 + ["sliding_attention"]})
    with pytest.raises(ValueError, match="beta_scale must be a positive number"):
        LinearAttention(layers=(True,), key_heads=1, value_heads=1, d_key_head=4, d_value_head=4, beta_scale=0)
    with pytest.raises(ValueError, match="norm_eps must be a small positive float"):
        LinearAttention(layers=(True,), key_heads=1, value_heads=1, d_key_head=4, d_value_head=4, norm_eps=2.0)


def test_a_model_the_format_cannot_hold_is_refused_by_name(tmp_path):
    build("olmo_hybrid", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path)
    linear = dataclasses.replace(model.cfg.linear_attention, norm_eps=None)
    with pytest.raises(ValueError, match="gated norm eps of 1e-05"):
        HookedDecoder(dataclasses.replace(model.cfg, linear_attention=linear)).save_pretrained(tmp_path / "never")
    mixed = dataclasses.replace(model.cfg, rotary_layers=(False, False, False, True),
                                linear_attention=dataclasses.replace(model.cfg.linear_attention,
                                                                     layers=(True, False, True, False)))
    with pytest.raises(ValueError, match="rotates every attention layer or none"):
        HookedDecoder(mixed).save_pretrained(tmp_path / "never")


def test_the_deltanet_holds_transformers_values(tmp_path):
    """Read off transformers' own modules in its forward: each linear layer's write is hook_attn_out, its gated norm's
    output hook_z, b_proj's output hook_beta_logit and beta (twice its sigmoid) hook_beta, g_proj's output
    hook_gate_input, and the attention layer's o_proj reads hook_z; the norms around each block are the file's."""
    hf = build("olmo_hybrid", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    mixer, attention = hf.model.layers[1].linear_attn, hf.model.layers[3]
    seen = seen_in_forward(hf, TOKENS, {"linear": mixer, "norm": mixer.o_norm, "b": mixer.b_proj, "g": mixer.g_proj,
                                        "o": attention.self_attn.o_proj, "post": attention.post_attention_layernorm})
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS)
    close = lambda a, b: torch.testing.assert_close(a, b, atol=1e-5, rtol=0)  # noqa: E731
    close(cache["blocks.1.hook_attn_out"], seen["linear"][1])
    close(cache["blocks.1.linear_attn.hook_z"].flatten(0, 2), seen["norm"][1])
    close(cache["blocks.1.linear_attn.hook_beta_logit"], seen["b"][1])
    close(cache["blocks.1.linear_attn.hook_beta"], 2 * seen["b"][1].sigmoid())
    assert cache["blocks.1.linear_attn.hook_beta"].max() > 1  # beta past 1: the state's transition may flip sign
    close(cache["blocks.1.linear_attn.hook_gate_input"].flatten(-2), seen["g"][1])
    close(cache["blocks.3.attn.hook_z"].flatten(-2), seen["o"][0][0])
    close(cache["blocks.3.hook_attn_out"], seen["post"][1])  # the attention layer's write is normed after attention
    assert "blocks.3.attn.hook_rot_q" not in cache  # NoPE


def test_the_deltanet_is_transformers_module_whole_and_through_its_cache(tmp_path):
    """probe's mixer against transformers' OlmoHybridGatedDeltaNet with the same weights: a whole sequence, then a
    prefix and single tokens through each one's cache (transformers' one-token path is its recurrent kernel and
    causal_conv1d_update)."""
    from transformers.cache_utils import DynamicCache

    from probe.kv_cache import KVCache

    hf = build("olmo_hybrid", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    theirs, ours = hf.model.layers[0].linear_attn, model.blocks[0].linear_attn
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
        cache, past = DynamicCache(config=hf.config), KVCache.init_cache(model.cfg, batch_size=2).layers[0]
        for start, end in ((0, 5), (5, 6), (6, 7), (7, 9)):
            torch.testing.assert_close(ours(x[:, start:end], past=past), theirs(x[:, start:end], cache=cache),
                                       atol=1e-5, rtol=0)
    assert past.seen == 9


def test_a_file_with_the_convolution_whole_and_the_norms_by_their_module_names_loads_the_same(tmp_path):
    """transformers' in-memory names (conv1d whole, input_layernorm, post_attention_layernorm) as a file: the same
    model as the save format's q/k/v_conv1d and attention/feedforward_layer_norm."""
    from safetensors.torch import save_file

    hf = build("olmo_hybrid", tmp_path / "src")
    (tmp_path / "memory").mkdir()
    hf.config.save_pretrained(tmp_path / "memory")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "memory" / "model.safetensors",
              metadata={"format": "pt"})
    stored, memory = (HookedDecoder.from_pretrained(tmp_path / d).eval() for d in ("src", "memory"))
    with torch.no_grad():
        torch.testing.assert_close(memory(TOKENS), stored(TOKENS), atol=0, rtol=0)
        torch.testing.assert_close(memory(TOKENS), hf(TOKENS).logits, atol=1e-4, rtol=0)


def test_a_prompt_longer_than_a_chunk_is_transformers_in_float32_and_bfloat16(tmp_path):
    """Over 150 positions (three chunks of the recurrence, beta up to 2): transformers' logits in float32; in bfloat16
    probe's are as near the float32 model's as transformers' own bfloat16 model's are."""
    import transformers as tf

    hf = build("olmo_hybrid", tmp_path, max_position_embeddings=200)
    tokens = torch.randint(0, 101, (2, 150), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        exact = hf(tokens).logits
        torch.testing.assert_close(HookedDecoder.from_pretrained(tmp_path).eval()(tokens), exact, atol=1e-4, rtol=0)
        theirs = tf.OlmoHybridForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()(tokens).logits.float()
        ours = HookedDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()(tokens).float()
    assert (ours - exact).abs().max() <= 2 * (theirs - exact).abs().max()


def test_hook_shapes_predict_both_kinds_of_block(tmp_path):
    """Every point's shape as hook_shapes predicts it: the linear layers' pre-norm points (ln1, ln2, the DeltaNet's)
    and the attention layer's sandwich ones (ln1_post, ln2_post, q/k norms over every head)."""
    build("olmo_hybrid", tmp_path)
    _, _, cache, predicted = cache_of_everything(tmp_path)
    assert {name: tuple(value.shape) for name, value in cache.items()} == {name: predicted[name] for name in cache}
    assert {"blocks.0.ln2.hook_scale", "blocks.0.linear_attn.hook_beta", "blocks.3.ln1_post.hook_scale"} <= set(cache)
    assert "blocks.0.ln1_post.hook_scale" not in cache and "blocks.3.linear_attn.hook_beta" not in cache


def test_generation_and_processing_are_transformers(tmp_path):
    hf = build("olmo_hybrid", tmp_path)
    with pytest.warns(UserWarning, match="center_writing_weights"):  # RMSNorm: nothing to centre, as in TL
        assert_generation_and_processing_match(hf, tmp_path)


def test_a_cached_prefix_then_its_continuation_is_one_forward(tmp_path):
    build("olmo_hybrid", tmp_path, **CASES["olmo-hybrid-rope-attention-first-no-neg-eigval"][1])
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, prefix = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.layers[1].k is None and cache.layers[0].k.shape[1] == 13 and prefix.layers[1].seen == 10


def test_left_padding_writes_nothing_into_the_state(tmp_path):
    """A left-padded prompt's logits are those of the prompt alone in transformers, and a batch generated together
    is transformers' continuation."""
    hf = build("olmo_hybrid", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    short = TOKENS[1, 4:]
    ids = torch.stack([TOKENS[0], torch.cat([torch.zeros(4, dtype=torch.long), short])])
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask)[1, 4:], hf(short[None]).logits[0], atol=1e-4, rtol=0)
    assert_left_padded_generation_matches(hf, tmp_path)


@pytest.mark.parametrize("case", ["olmo-hybrid-nope-three-deltanet-one-attention",
                                  "olmo-hybrid-rope-attention-first-no-neg-eigval"])
def test_every_shared_hook_matches_the_bridge(case, tmp_path):
    """TL 4's bridge hook by hook. Its OLMo-Hybrid adapter delegates the DeltaNet whole (linear_attn.hook_in /
    hook_out: probe's ln1 output and hook_attn_out there), so probe's DeltaNet intermediates have no bridge name;
    on the attention layers the bridge renames post_attention_layernorm ln1_post, as probe's sandwich block has it.
    The adapter keeps transformers' own attention (maintain_native_attention), whose hook_attn_scores then holds
    the softmaxed weights: compared with probe's hook_pattern, which the bridge's hook_pattern also is."""
    directory = tokenized_checkpoint("olmo_hybrid", tmp_path / "hf", GPT_FILES, **CASES[case][1])  # (the bridge loads one)
    missing, theirs = compare_with_transformer_lens(directory, 12, seed=4, skip=("attn.hook_attn_scores",))
    attention = [l for l, t in enumerate(HookedDecoder.from_pretrained(directory).cfg.linear_attention.layers) if not t]
    assert {f"blocks.{attention[0]}.ln1_post.hook_out", f"blocks.{attention[0]}.attn.hook_z"} <= theirs
    deltanet = ("q_pre_conv", "k_pre_conv", "v_pre_conv", "q", "k", "v", "beta_logit", "beta", "log_decay",
                "recurrence_out", "gate_input", "z")
    linear = [l for l in range(4) if l not in attention]
    # (the bridge holds the q/k norms' outputs flattened over heads, under q_norm.hook_out: see bridge_names)
    assert missing == ({f"blocks.{l}.linear_attn.hook_{p}" for l in linear for p in deltanet}
                       | {f"blocks.{l}.attn.hook_{p}_normed" for l in attention for p in "qk"}
                       # (its native attention rotates inside: no rotated q or k to hook)
                       | {f"blocks.{l}.attn.hook_rot_{p}" for l in attention for p in "qk" if "rope" in case})


def test_compatibility_mode_processes_as_the_bridge_does(tmp_path):
    directory = tokenized_checkpoint("olmo_hybrid", tmp_path / "hf", GPT_FILES)
    model, ours, cache, theirs, their_cache = caches_in_compatibility_mode(directory, TOKENS)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for name in ("blocks.0.ln1.hook_out", "blocks.0.linear_attn.hook_out", "blocks.3.attn.hook_z",
                 "blocks.3.ln1_post.hook_out", "blocks.3.hook_resid_post", "ln_final.hook_out"):
        torch.testing.assert_close(cache[name], their_cache[name], atol=1e-4, rtol=0, msg=name)
    assert model.cfg.normalization_type == "RMS"


def test_analyses_of_heads_refuse_by_name_and_analyses_of_layers_run(tmp_path):
    from probe import analyses

    build("olmo_hybrid", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    clean, corrupted = TOKENS[:1, :8], TOKENS[1:, :8]
    metric = analyses.logit_diff_metric(model, 5, 7)
    for run in (lambda: analyses.head_scores(model, "previous_token"),
                lambda: analyses.patch(model, clean, corrupted, metric, sites="heads")):
        with pytest.raises(ValueError, match=r"layers \[0, 1, 2\] of this hybrid model are linear-attention"):
            run()
    with pytest.raises(ValueError, match=r"recurrent layers \[0, 1, 2\] sit among sandwich blocks"):
        analyses.circuit_graph(model)  # (mixer nodes are built for pre-norm blocks)
    result = analyses.patch(model, clean, corrupted, metric, sites="resid_pre")
    assert len(result.sites) == 4 * 8
    with pytest.raises(AttributeError, match="linear-attention .* no attn"):
        model.blocks[0].attn
    patterns = analyses.attention_patterns(model, TOKENS[0])
    assert patterns.layers == [3]


def test_decompositions_add_up_across_both_kinds_of_block(tmp_path):
    """The residual stream splits into the linear layers' whole writes and the attention layer's heads (through its
    write norm, ln1_post, at this forward's scale): the parts add up to the final residual, their direct logit
    attributions to transformers' logit difference; each layer's memories (pre-norm in a linear layer, through
    ln2_post in the attention layer) add up to its MLP's write."""
    from probe import analyses
    from probe.analyses.vocab_projection import value_directions

    hf = build("olmo_hybrid", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    decomposition = analyses.residual_decomposition(model, TOKENS)
    with torch.no_grad():
        out = hf(TOKENS, output_hidden_states=True)
        _, cache = model.run_with_cache(TOKENS)
    torch.testing.assert_close(decomposition.total(), cache["blocks.3.hook_resid_post"], atol=1e-5, rtol=0)
    names = decomposition.index.names
    assert names[:3] == ["embed", "L0 linear_attn", "L0 mlp"] and names[-5:] == ["L3H0", "L3H1", "L3H2", "L3H3", "L3 mlp"]
    heads = [names.index(f"L3H{h}") for h in range(4)]
    torch.testing.assert_close(decomposition.components[:, :, heads].sum(2), cache["blocks.3.hook_attn_out"], atol=1e-5,
                               rtol=0)
    result = analyses.direct_logit_attribution(model, TOKENS, 5, 9)
    torch.testing.assert_close(result.total, out.logits[:, -1, 5] - out.logits[:, -1, 9], atol=1e-4, rtol=0)
    lookup = analyses.memory_lookup(model, TOKENS[0], position=5, layer=[1, 3], k=96)
    everyone = torch.arange(96)
    for i, layer in enumerate((1, 3)):
        values = value_directions(model, layer, everyone, through_final_norm=False)
        unscaled = lookup.value_norms[i, 0] / values[0].norm()  # 1 / the write norm's scale (1 without one)
        torch.testing.assert_close(lookup.coefficients[i] @ values * unscaled, cache[f"blocks.{layer}.hook_mlp_out"][0, 5],
                                   atol=1e-5, rtol=0)


def test_the_report_runs_and_says_why_it_leaves_out_the_head_sections(tmp_path):
    directory = tokenized_checkpoint("olmo_hybrid", tmp_path / "checkpoint", GPT_FILES)
    page = report_page(directory, tmp_path / "report")
    assert "layers [0, 1, 2] of this hybrid model are linear-attention layers" in page


def test_the_hybrid_on_the_device_is_transformers_there(tmp_path, device_under_test):
    """On the GPU: a prompt longer than a chunk, and its greedy continuation through the state cache, against
    transformers' model on the same device."""
    hf = build("olmo_hybrid", tmp_path, max_position_embeddings=200)
    assert_on_the_device_as_transformers(hf, tmp_path, device_under_test, 150)
