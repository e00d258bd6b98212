"""Qwen3.5 (probe/checkpoint_qwen35.py, probe/linear_attention.py): Gated DeltaNet layers in three of four blocks,
gated attention in the fourth, zero-centred norms; the multimodal files' language model.

The oracles: transformers (test_variants.py compares logits and every residual on two cases and saves through it;
here greedy generation through the state cache, TL-default processing, padding, the DeltaNet's and the gate's
values read off transformers' own modules, and the multimodal class) and TL 4's bridge over the same checkpoint,
hook by hook (its GatedDeltaNetBridge names every intermediate of the linear layers)."""
from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch

from probe import DecoderConfig, HookedDecoder, LinearAttention
from family_checks import (assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_left_padded_generation_matches, assert_on_the_device_as_transformers,
                           cache_of_everything, caches_in_compatibility_mode, seen_in_forward)
from test_transformer_lens import compare_with_transformer_lens
from test_variants import build, perturbed

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_generation_and_processing_are_transformers(kind, tmp_path):
    hf = build(kind, tmp_path)
    with pytest.warns(UserWarning, match="center_writing_weights"):  # RMSNorm: nothing to centre, as in TL
        assert_generation_and_processing_match(hf, tmp_path)


def test_a_cached_prefix_then_its_continuation_is_one_forward(tmp_path):
    """The state cache carries each linear layer's convolution window and state: a prompt, then two more tokens, then
    one, give the logits of the whole sequence in one pass; a frozen cache reads the prefix without keeping more."""
    build("qwen3_5", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, prefix = assert_cached_parts_are_one_forward(model, TOKENS)
    assert cache.length == 13 and cache.layers[0].k is None and cache.layers[3].k.shape[1] == 13
    assert prefix.length == 10 and prefix.layers[0].seen == 10


def test_left_padding_writes_nothing_into_the_state(tmp_path):
    """A left-padded prompt's logits are those of the prompt alone in transformers: its padding's inputs are zeroed
    before the projections (as transformers does), so the convolution and the state never see them."""
    hf = build("qwen3_5", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    short = TOKENS[1, 4:]
    ids = torch.stack([TOKENS[0], torch.cat([torch.zeros(4, dtype=torch.long), short])])
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        logits = model(ids, attention_mask=mask)
        torch.testing.assert_close(logits[1, 4:], hf(short[None]).logits[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(logits[0], hf(TOKENS[:1]).logits[0], atol=1e-4, rtol=0)


def test_the_deltanet_and_the_gate_hold_transformers_values(tmp_path):
    """Read off transformers' own modules in its forward: each linear layer's output is hook_attn_out and its gated
    norm's output hook_z; the attention layer's o_proj reads hook_z (z times sigmoid(gate)), and its q_proj's gate
    rows give hook_q_gate."""
    hf = build("qwen3_5", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    layers = hf.model.layers
    seen = seen_in_forward(hf, TOKENS, {"linear": layers[0].linear_attn, "norm": layers[0].linear_attn.norm,
                                        "o": layers[3].self_attn.o_proj, "q": layers[3].self_attn.q_proj})
    seen = {"out0": seen["linear"][1], "norm0": seen["norm"][1], "o3": seen["o"][0][0], "q3": seen["q"][1]}
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS)
    torch.testing.assert_close(cache["blocks.0.hook_attn_out"], seen["out0"], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["blocks.0.linear_attn.hook_z"].flatten(0, 2), seen["norm0"], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["blocks.3.attn.hook_z"].flatten(-2), seen["o3"], atol=1e-5, rtol=0)
    gate = seen["q3"].unflatten(-1, (4, 2, 16))[..., 1, :]  # each head's query rows, then its gate's
    torch.testing.assert_close(cache["blocks.3.attn.hook_q_gate"], gate, atol=1e-5, rtol=0)
    # per-head writes add up to the attention layer's output (the gate is per head, before W_O)
    model.set_use_attn_result(True)
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS)
    torch.testing.assert_close(cache["blocks.3.attn.hook_result"].sum(-2), cache["blocks.3.hook_attn_out"], atol=1e-5,
                               rtol=0)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_every_shared_hook_matches_the_bridge(kind, tmp_path):
    """TL 4's bridge hook by hook: every DeltaNet intermediate (pre- and post-convolution q, k, v, beta and its
    logit, the log decay, the recurrence's output, the gate's input) and every attention point. The bridge's
    attn.hook_q is q_proj's whole output, query and gate rows together ([batch pos 2*head d_head]); probe's is the
    query alone and the gate is hook_q_gate, which the bridge gives flattened."""
    build(kind, tmp_path)
    missing, theirs = compare_with_transformer_lens(tmp_path, 12, seed=4, skip=("attn.hook_q", "hook_expert_weights"),
                                                    flattened=("hook_q_gate",))
    missing = {n for n in missing if ".experts." not in n and "shared_expert_gate" not in n}  # (see test_moe.py)
    assert {"blocks.0.linear_attn.hook_log_decay", "blocks.0.linear_attn.hook_v_pre_conv",
            "blocks.3.attn.hook_q_gate"} <= theirs
    # the linear layers' write into the residual (the bridge's linear_attn.hook_out, an alias here) and their value
    # heads' normed, gated output, which the bridge does not hook
    assert missing == {f"blocks.{l}.{name}" for l in range(3) for name in ("hook_attn_out", "linear_attn.hook_z")}


def test_bridge_names_reach_the_deltanet(tmp_path):
    build("qwen3_5", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS, names=["blocks.1.linear_attn.hook_out", "blocks.1.linear_attn.hook_in",
                                                       "blocks.1.linear_attn.hook_ssm_decay"])
        _, classic = model.run_with_cache(TOKENS, names=["blocks.1.hook_attn_out", "blocks.1.ln1.hook_out",
                                                         "blocks.1.linear_attn.hook_log_decay"])
    assert torch.equal(cache["blocks.1.linear_attn.hook_out"], classic["blocks.1.hook_attn_out"])
    assert torch.equal(cache["blocks.1.linear_attn.hook_in"], classic["blocks.1.ln1.hook_out"])
    assert torch.equal(cache["blocks.1.linear_attn.hook_ssm_decay"], classic["blocks.1.linear_attn.hook_log_decay"])
    with pytest.raises(Exception, match="does not keep the state"):
        model.run_with_cache(TOKENS, names=["blocks.1.linear_attn.hook_ssm_state"])


def test_an_edit_at_a_deltanet_point_reaches_the_output(tmp_path):
    """Zeroing one value head's beta (its writes) leaves that head's state empty: its recurrence output is zero at
    every position, and the other heads' are as before."""
    build("qwen3_5", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()

    def no_writes(beta, hook):
        beta[..., 1] = 0
        return beta

    with torch.no_grad():
        _, clean = model.run_with_cache(TOKENS, names=["blocks.0.linear_attn.hook_recurrence_out"])
        with model.hooks(fwd_hooks=[("blocks.0.linear_attn.hook_beta", no_writes)]):
            _, edited = model.run_with_cache(TOKENS, names=["blocks.0.linear_attn.hook_recurrence_out"])
    out, before = edited["blocks.0.linear_attn.hook_recurrence_out"], clean["blocks.0.linear_attn.hook_recurrence_out"]
    assert out[..., 1, :].abs().max() == 0 and before[..., 1, :].abs().max() > 0
    torch.testing.assert_close(out[..., [0, 2, 3], :], before[..., [0, 2, 3], :])


@pytest.mark.parametrize("moe", [False, True])
def test_the_multimodal_files_language_model(moe, tmp_path):
    """A Qwen3_5(Moe)ForConditionalGeneration directory (how the models are released): the language model's logits
    are transformers' on text, the vision tower is never read, and it saves as the text-only format."""
    import transformers as tf

    text = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=12, max_position_embeddings=40)
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2)
    config, whole, text_only = ((tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration, tf.Qwen3_5MoeForCausalLM)
                                if moe else (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration, tf.Qwen3_5ForCausalLM))
    torch.manual_seed(0)
    hf = perturbed(whole(config(text_config=text, vision_config=vision)))
    hf.save_pretrained(tmp_path / "mm")
    model = HookedDecoder.from_pretrained(tmp_path / "mm").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(input_ids=TOKENS).logits, atol=1e-4, rtol=0)
        again = text_only.from_pretrained(model.save_pretrained(tmp_path / "text")).eval()
        torch.testing.assert_close(again(TOKENS).logits, hf(input_ids=TOKENS).logits, atol=1e-4, rtol=0)
    assert model.cfg.original_architecture == whole.__name__


def test_head_analyses_say_the_linear_layers_have_no_heads(tmp_path):
    build("qwen3_5", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    _, cache = model.run_with_cache(TOKENS)
    with pytest.raises(ValueError, match="layer 0 is a linear-attention layer"):
        cache.stack_head_results()
    with pytest.raises(ValueError, match="linear-attention layers have no attention heads"):
        model.W_Q
    with pytest.raises(AttributeError, match="linear-attention .* no attn"):
        model.blocks[0].attn
    # what needs no heads works: the residual decomposes by layer, the attention layer's heads stack
    torch.testing.assert_close(cache.decompose_resid().sum(0), cache["ln_final.hook_in"] if "ln_final.hook_in" in cache
                               else cache["blocks.3.hook_resid_post"], atol=1e-5, rtol=0)
    assert model.blocks[3].attn.W_Q.shape == (4, 64, 16)


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="multiple of key_heads"):
        LinearAttention(layers=(True,), key_heads=2, value_heads=3, d_key_head=4, d_value_head=4)
    with pytest.raises(ValueError, match="at least one True"):
        LinearAttention(layers=(False, False), key_heads=1, value_heads=1, d_key_head=4, d_value_head=4)
    linear = dict(layers=(True, False), key_heads=1, value_heads=2, d_key_head=4, d_value_head=4)
    base = dict(n_layers=2, d_model=16, n_heads=2, d_vocab=11, n_ctx=8)
    with pytest.raises(ValueError, match="give each of the n_layers=3"):
        DecoderConfig(**{**base, "n_layers": 3}, linear_attention=linear)
    with pytest.raises(ValueError, match="causal pre-norm"):
        DecoderConfig(**base, linear_attention=linear, norm_placement="parallel")
    cfg = DecoderConfig(**base, linear_attention=linear, positions="rotary", norm="rms")
    assert cfg.layer_is_linear(0) and not cfg.layer_is_linear(1)
    assert DecoderConfig.from_dict(cfg.to_dict()) == cfg  # a config file round trip keeps the layers
    model = HookedDecoder(cfg)
    with pytest.raises(ValueError, match="qwen3_5_text checkpoint cannot hold this model"):
        model.save_pretrained("/nonexistent/never-written")
    assert dataclasses.replace(cfg, linear_attention=None).linear_attention is None


def test_analyses_of_heads_refuse_and_analyses_of_layers_run(tmp_path):
    """Analyses of every layer's heads say the linear layers have none (circuit discovery makes each one a mixer
    node: tests/test_circuit_mixers.py); patching the residual works, and patching
    the residual entering block 0 at one position is (there being no position embedding) swapping that token."""
    from probe import analyses

    build("qwen3_5", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    clean, corrupted = TOKENS[:1, :8], TOKENS[1:, :8]
    metric = analyses.logit_diff_metric(model, 5, 7)
    for run in (lambda: analyses.head_scores(model, "previous_token"),
                lambda: analyses.patch(model, clean, corrupted, metric, sites="heads")):
        with pytest.raises(ValueError, match=r"layers \[0, 1, 2\] of this hybrid model are linear-attention"):
            run()
    result = analyses.patch(model, clean, corrupted, metric, sites="resid_pre")
    swapped = corrupted.clone()
    swapped[0, 3] = clean[0, 3]
    with torch.no_grad():
        expected = metric(model(swapped), swapped, torch.ones_like(swapped)).mean()
    at = next(i for i, site in enumerate(result.sites) if site.layer == 0 and site.pos == 3)
    assert result.patched[at].item() == pytest.approx(expected.item(), abs=1e-5)


def test_a_save_keeps_the_layer_pattern_and_the_rotary_fraction(tmp_path):
    """The second case's two full layers, whole-head rotary and tied unembedding, saved and read back by
    transformers' Qwen3_5ForCausalLM."""
    from test_variants import CASES

    import transformers as tf

    hf = build("qwen3_5", tmp_path / "hf", **CASES["qwen3-5-two-full-layers-tied"][1])
    model = HookedDecoder.from_pretrained(tmp_path / "hf")
    again = tf.Qwen3_5ForCausalLM.from_pretrained(model.save_pretrained(tmp_path / "ours")).eval()
    assert again.config.layer_types == hf.config.layer_types and again.config.tie_word_embeddings
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, hf(TOKENS).logits, atol=1e-5, rtol=0)


def test_experts_stored_fused_load_as_stored_one_by_one(tmp_path):
    """A file whose experts are fused per layer (`experts.gate_up_proj` [expert 2*d_mlp d_model], gates first, and
    `experts.down_proj`), as transformers holds them in memory, gives the logits of transformers' own per-expert save."""
    from safetensors.torch import load_file, save_file

    hf = build("qwen3_5_moe", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    for l in range(4):
        t = f"model.layers.{l}.mlp.experts"
        gates, ups, downs = ([state.pop(f"{t}.{e}.{p}_proj.weight") for e in range(4)] for p in ("gate", "up", "down"))
        state[f"{t}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups)])
        state[f"{t}.down_proj"] = torch.stack(downs)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(TOKENS).logits, atol=1e-4, rtol=0)


def test_qwen3_next_fused_projections_are_transformers_grouping(tmp_path):
    """Qwen3-Next's in_proj_qkvz groups each key head's q, k, then its value heads' v and z: the q/k/v probe reads
    (hook_q_pre_conv, hook_v_pre_conv) and z (hook_gate_input) are transformers' own fix_query_key_value_ordering's."""
    hf = build("qwen3_next", tmp_path, linear_num_value_heads=6)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    mixer = hf.model.layers[0].linear_attn
    names = ["hook_q_pre_conv", "hook_k_pre_conv", "hook_v_pre_conv", "hook_gate_input", "hook_beta_logit"]
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS, names=[f"blocks.0.linear_attn.{n}" for n in names] + ["blocks.0.ln1.hook_out"])
        x = cache["blocks.0.ln1.hook_out"]  # what the mixer reads
        q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(x), mixer.in_proj_ba(x))
    for name, theirs in zip(names, (q, k, v, z, b)):
        torch.testing.assert_close(cache[f"blocks.0.linear_attn.{name}"], theirs, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("n", [1, 7, 64, 150])
def test_the_chunked_recurrence_is_transformers_stepwise_one(n):
    """gated_delta_rule (by chunks of 64, with a state carried in) against transformers' own one-position-at-a-time
    torch_recurrent_gated_delta_rule, and probe's stepwise definition, on lengths inside, at and across chunks."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    from probe.linear_attention import gated_delta_rule, gated_delta_rule_stepwise, l2_normed

    gen = torch.Generator().manual_seed(n)
    q, k = (l2_normed(torch.randn(2, n, 4, 8, generator=gen)) for _ in range(2))
    v = torch.randn(2, n, 4, 12, generator=gen)
    beta, log_decay = torch.rand(2, n, 4, generator=gen), -2 * torch.rand(2, n, 4, generator=gen)
    state = torch.randn(2, 4, 8, 12, generator=gen)
    out, last = gated_delta_rule(q, k, v, beta, log_decay, state)
    theirs, their_last = torch_recurrent_gated_delta_rule(q, k, v, g=log_decay, beta=beta, initial_state=state,
                                                          output_final_state=True)
    torch.testing.assert_close(out, theirs, atol=1e-5, rtol=0)
    torch.testing.assert_close(last, their_last, atol=1e-5, rtol=0)
    steps, step_last = gated_delta_rule_stepwise(q, k, v, beta, log_decay, state)
    torch.testing.assert_close(out, steps, atol=1e-5, rtol=0)
    torch.testing.assert_close(last, step_last, atol=1e-5, rtol=0)


def test_a_prompt_longer_than_a_chunk_is_transformers(tmp_path):
    hf = build("qwen3_5", tmp_path, max_position_embeddings=200)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (1, 150), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_residual_decomposition_and_dla_add_up_on_a_hybrid(kind, tmp_path):
    """A linear-attention layer's write is one component (`L{l} linear_attn`), an attention layer's are its heads:
    they add up to transformers' final residual stream, and their direct logit attributions to transformers' logit
    difference; the attention layer's heads add up to its write."""
    from probe import analyses

    hf = build(kind, tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    decomposition = analyses.residual_decomposition(model, TOKENS)
    with torch.no_grad():
        out = hf(TOKENS, output_hidden_states=True)
        _, cache = model.run_with_cache(TOKENS)
    torch.testing.assert_close(decomposition.total(), cache["blocks.3.hook_resid_post"], atol=1e-4, rtol=0)
    names = decomposition.index.names
    assert names[:3] == ["embed", "L0 linear_attn", "L0 mlp"] and "L3H3" in names and "L2 linear_attn" in names
    heads = [i for i, name in enumerate(names) if name.startswith("L3H")]
    torch.testing.assert_close(decomposition.components[:, :, heads].sum(2), cache["blocks.3.hook_attn_out"],
                               atol=1e-5, rtol=0)
    for name, point in (("L1 linear_attn", "blocks.1.hook_attn_out"), ("L1 mlp", "blocks.1.hook_mlp_out")):
        torch.testing.assert_close(decomposition.components[:, :, names.index(name)], cache[point], atol=1e-6, rtol=0)
    # the residual after each sublayer, a linear layer's included: embed, L0 attn (its resid_mid), L0, L1 attn, ...
    steps = decomposition.accumulated(include_mid=True)
    for layer in range(4):
        torch.testing.assert_close(steps[:, 1 + 2 * layer], cache[f"blocks.{layer}.hook_resid_mid"], atol=1e-5, rtol=0)
        torch.testing.assert_close(steps[:, 2 + 2 * layer], cache[f"blocks.{layer}.hook_resid_post"], atol=1e-5, rtol=0)
    result = analyses.direct_logit_attribution(model, TOKENS, 5, 9)
    expected = out.logits[:, -1, 5] - out.logits[:, -1, 9]
    torch.testing.assert_close(result.total, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(result.actual, expected, atol=1e-4, rtol=0)
    frame = result.to_frame()
    assert set(frame.component) >= {"L0 linear_attn", "L3H0"}
    result.figure()  # the head table holds the attention layer's heads only


def test_the_report_runs_and_says_why_it_leaves_out_the_head_sections(tmp_path):
    """`probe report` on a hybrid: the sections by layer run (residual patching in place of head patching), the
    attention patterns are its attention layer's, and each analysis of every layer's heads says why it is not run
    instead of failing the report."""
    from test_family_defaults import QWEN_FILES, tokenized_checkpoint
    from probe.cli.cli import main

    directory = tokenized_checkpoint("qwen3_5", tmp_path / "checkpoint", QWEN_FILES)
    assert main(["report", "--model", str(directory), "--prompt", "the cat sat on the mat", "--corrupted",
                 "the cat sat on the rug", "--out", str(tmp_path / "report"), "--quiet"]) in (0, None)
    page = (tmp_path / "report" / "report.html").read_text()
    for what in ("each head detector", "head ablation", "head importance"):
        assert (f"Not run: {what} reads every layer&#x27;s attention heads, and layers [0, 1, 2] of this hybrid model "
                "are linear-attention layers") in page
    assert (tmp_path / "report" / "edges.csv").exists()  # (the circuit: each linear layer a mixer node)
    patched = pd.read_csv(tmp_path / "report" / "patching.csv")
    assert set(patched["act"]) == {"resid_pre"} and len(patched) == 4 * len(patched["pos"].unique())
    attribution = pd.read_csv(tmp_path / "report" / "attribution.csv")
    assert {"L0 linear_attn", "L3H0"} <= set(attribution["component"])
    assert set(pd.read_csv(tmp_path / "report" / "patterns.csv")["layer"]) == {3}


def test_compatibility_mode_processes_as_the_bridge_does(tmp_path):
    """`boot_transformers` then `enable_compatibility_mode()`: the bridge's processing, which leaves a hybrid's norms
    unfolded (its Qwen3.5 adapter declares fold_ln unsupported) and centres the unembedding, gives the bridge's
    logits and activations; probe says which step it skips, as the bridge warns."""
    build("qwen3_5", tmp_path)
    model, ours, cache, theirs, their_cache = caches_in_compatibility_mode(tmp_path, TOKENS)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for name in ("blocks.0.ln1.hook_out", "blocks.0.linear_attn.hook_q", "blocks.0.linear_attn.hook_recurrence_out",
                 "blocks.3.attn.hook_z", "blocks.3.hook_resid_post", "ln_final.hook_out"):
        torch.testing.assert_close(cache[name], their_cache[name], atol=1e-4, rtol=0, msg=name)
    assert model.cfg.normalization_type == "RMS"  # unfolded, as the bridge's
    assert model.unembed.W_U.mean(-1).abs().max() < 1e-6  # centred, as the bridge's


def test_left_padded_batched_generation_is_transformers(tmp_path):
    """Two prompts, one left-padded, generated together through the state cache: each continuation is transformers'
    (given the same mask), and the padded one is its prompt's alone."""
    hf = build("qwen3_5", tmp_path)
    assert_left_padded_generation_matches(hf, tmp_path)


def test_bfloat16_rounds_no_worse_than_transformers(tmp_path):
    """In bfloat16 (the recurrence and the gated norm in float32 inside, as transformers runs them), probe's logits
    are as near the float32 model's as transformers' own bfloat16 model's are, over a prompt longer than a chunk."""
    import transformers as tf

    hf = build("qwen3_5", tmp_path, max_position_embeddings=200)
    tokens = torch.randint(0, 101, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exact = hf(tokens).logits
        theirs = tf.Qwen3_5ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()(tokens).logits.float()
        ours = HookedDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()(tokens).float()
    assert (ours - exact).abs().max() <= 2 * (theirs - exact).abs().max()


def test_the_hybrid_on_the_device_is_transformers_there(tmp_path, device_under_test):
    """On the GPU (the GPU list): a Qwen3.5 prompt longer than a chunk, and its greedy continuation through the state
    cache, against transformers' model on the same device (its chunked torch recurrence)."""
    hf = build("qwen3_5", tmp_path, max_position_embeddings=200)
    assert_on_the_device_as_transformers(hf, tmp_path, device_under_test, 150)


def test_attention_patterns_of_a_hybrid_are_its_attention_layers(tmp_path):
    """By default the patterns of the layers that attend (transformers' own attention weights there); a linear layer
    asked for by name is refused, naming the attention layers."""
    from probe import analyses

    hf = build("qwen3_5", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    patterns = analyses.attention_patterns(model, TOKENS[0])
    assert patterns.layers == [3]
    with torch.no_grad():
        weights = hf(TOKENS[:1], output_attentions=True).attentions  # (one per attention layer: layer 3's)
    assert len(weights) == 1
    torch.testing.assert_close(patterns.pattern[0], weights[0][0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"layers \[1\] are linear-attention layers, .* attention layers are \[3\]"):
        analyses.attention_patterns(model, TOKENS[0], layers=[1, 3])


def test_hook_shapes_predicts_every_points_shape_gated_heads_included(tmp_path):
    build("qwen3_5", tmp_path)
    _, _, cache, predicted = cache_of_everything(tmp_path)
    assert {name: tuple(value.shape) for name, value in cache.items()} == {name: predicted.get(name) for name in cache}
    assert {"blocks.3.attn.hook_q_gate", "blocks.0.linear_attn.hook_beta"} <= set(cache)
