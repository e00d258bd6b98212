"""GPT-OSS (probe/checkpoint_gpt_oss.py): attention sinks, experts chosen by logit with a clamped SwiGLU, MXFP4 files.

The oracles: transformers (its own dequantisation of an MXFP4 file; its router and experts' arithmetic; greedy
generation), HookedTransformer 3.9 (toys with use_attention_sinks and its GptOssMoE, hook by hook), TL 4's bridge over
the same checkpoint. test_variants.py compares logits and every residual with transformers' on two GPT-OSS cases and
saves through it; test_tl_state_dict.py runs TL 3.9's own GPT-OSS converter."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from probe import HookedDecoder, HookedTransformerConfig
from probe.checkpoint_gpt_oss import dequantize_mxfp4
from probe.processing import process_weights
from probe.tl_state_dict import TL_UNWRITTEN
from family_checks import assert_generation_and_processing_match
from test_sae_training import needs_saelens
from test_variants import build
from tl_cases import TL_DEFAULTS, assert_processed_as_hooked_transformer, assert_same_cache, hooked_transformer_outputs, part

DENSE = dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="silu", normalization_type="RMS",
             positional_embedding_type="rotary", rotary_dim=8, gated_mlp=True, n_key_value_heads=2)
GPT_OSS = dict(DENSE, num_experts=4, experts_per_token=2, original_architecture="GptOssForCausalLM")
TL_CASES = {
    "sinks-dense": dict(DENSE, use_attention_sinks=True, gated_mlp=False, act_fn="gelu"),
    "gpt-oss-sinks-window": dict(GPT_OSS, use_attention_sinks=True, use_local_attn=True, window_size=4,
                                 attn_types=["local", "global"]),
    "gpt-oss-experts-no-sinks": GPT_OSS,  # processed: ln2's w folds into the biased router and experts
}


def tokens(vocab: int = 50, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(seed))


# ---- transformers -------------------------------------------------------------------------------------------
def mxfp4_checkpoint(source, directory, seed: int = 0) -> None:
    """`source`'s checkpoint with its experts' two weights replaced by random MXFP4 blocks and scales under the
    released files' names, and the quantization_config they carry."""
    state = load_file(str(source / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    for name in [k for k in state if k.endswith(("gate_up_proj", "down_proj"))]:
        n, d_in, d_out = state.pop(name).shape
        state[f"{name}_blocks"] = torch.randint(0, 256, (n, d_out, d_in // 32, 16), generator=gen, dtype=torch.uint8)
        state[f"{name}_scales"] = torch.randint(118, 128, (n, d_out, d_in // 32), generator=gen, dtype=torch.uint8)
    directory.mkdir()
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))


def test_mxfp4_experts_dequantise_as_transformers_does(tmp_path):
    from transformers import AutoModelForCausalLM, Mxfp4Config
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 5, 4), generator=gen, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [expert in out]
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2), theirs)

    build("gpt_oss", tmp_path / "plain")
    mxfp4_checkpoint(tmp_path / "plain", tmp_path / "mxfp4")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "mxfp4", quantization_config=Mxfp4Config(dequantize=True),
                                              dtype=torch.float32, attn_implementation="eager").eval()
    model = HookedDecoder.from_pretrained(tmp_path / "mxfp4").eval()
    assert torch.equal(model.blocks[1].mlp.experts[2].W_in.weight, hf.model.layers[1].mlp.experts.gate_up_proj[2, :, 1::2].T)
    toks = tokens(101)
    with torch.no_grad():
        torch.testing.assert_close(model(toks), hf(toks).logits, atol=1e-4, rtol=0)
    # saved dequantised, which transformers reads as a plain checkpoint
    saved = model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(toks).logits, hf(toks).logits, atol=1e-4, rtol=0)


def test_mxfp4_files_with_the_wrong_packing_are_refused(tmp_path):
    build("gpt_oss", tmp_path / "plain")
    mxfp4_checkpoint(tmp_path / "plain", tmp_path / "mxfp4")
    state = load_file(str(tmp_path / "mxfp4" / "model.safetensors"))
    state["model.layers.0.mlp.experts.down_proj_scales"] = state["model.layers.0.mlp.experts.down_proj_scales"].float()
    save_file(state, str(tmp_path / "mxfp4" / "model.safetensors"))
    with pytest.raises(Exception, match=r"down_proj_scales.*float32.*quantisation implies uint8"):
        HookedDecoder.from_pretrained(tmp_path / "mxfp4")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="quant_method='bitsandbytes' is not supported for GPT-OSS"):
        HookedDecoder.from_pretrained(tmp_path / "plain")


def test_routing_sinks_and_experts_by_hand(tmp_path):
    """From transformers' own modules: the router's top logits and their softmax (hook_expert_weights holds them at
    the chosen experts, 0 elsewhere), each expert's rows through its clamped GLU, and the pattern with each head's
    sink's share left out (rows summing to less than 1)."""
    hf = build("gpt_oss", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    toks = tokens(101)
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
        expected = hf(toks, output_attentions=True)
        for layer in range(3):
            theirs = hf.model.layers[layer].mlp
            x = model.blocks[layer].ln2(cache[f"blocks.{layer}.hook_resid_mid"]).reshape(-1, 64)
            _, scores, chosen = theirs.router(x)
            assert torch.equal(cache[f"blocks.{layer}.mlp.hook_expert_indices"], chosen)
            weights = cache[f"blocks.{layer}.mlp.hook_expert_weights"]
            torch.testing.assert_close(weights.gather(1, chosen), scores, atol=1e-6, rtol=0)
            assert (weights > 0).sum(1).eq(2).all()
            for e in range(4):
                rows = torch.cat([(chosen[:, k] == e).nonzero()[:, 0] for k in range(2)])
                gate_up = x[rows] @ theirs.experts.gate_up_proj[e] + theirs.experts.gate_up_proj_bias[e]
                gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
                torch.testing.assert_close(cache[f"blocks.{layer}.mlp.experts.{e}.hook_gate"], gate, atol=1e-5, rtol=0)
                torch.testing.assert_close(cache[f"blocks.{layer}.mlp.experts.{e}.hook_pre"], up, atol=1e-5, rtol=0)
                torch.testing.assert_close(cache[f"blocks.{layer}.mlp.experts.{e}.hook_post"],
                                           theirs.experts._apply_gate(gate_up), atol=1e-5, rtol=0)
            torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_pattern"], expected.attentions[layer], atol=1e-5,
                                       rtol=0)
    clamped = max(float(cache[f"blocks.{l}.mlp.experts.{e}.hook_gate"].amax(dim=None, keepdim=False))
                  for l in range(3) for e in range(4) if cache[f"blocks.{l}.mlp.experts.{e}.hook_gate"].numel())
    assert clamped > model.cfg.experts.clamped_glu.limit  # the clamp bites in these tests
    rows = cache["blocks.0.attn.hook_pattern"].sum(-1)
    assert (rows < 0.99).all() and (rows > 0).all()


def test_generation_through_a_kv_cache_is_transformers_greedy(tmp_path):
    """Past the window (6) on the windowed layers, with each head's sink."""
    hf = build("gpt_oss", tmp_path)
    assert_generation_and_processing_match(hf, tmp_path, processing=False)
    # TL's default processing (fold_value_biases skipped: inexact beside a sink) keeps transformers' log-probs
    with pytest.warns(UserWarning, match="skipping fold_value_biases=True.*attention sinks"):
        processed = HookedDecoder.from_pretrained(tmp_path, **TL_DEFAULTS).eval()
    toks = tokens(101)
    with torch.no_grad():
        torch.testing.assert_close(processed(toks).log_softmax(-1), hf(toks).logits.log_softmax(-1), atol=1e-4, rtol=0)


def test_value_biases_do_not_fold_beside_a_sink(tmp_path):
    build("gpt_oss", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="fold_value_biases.*attention sink.*pass fold_value_biases=False"):
        process_weights(model, fold_ln=True, center_writing_weights=False, center_unembed=True, fold_value_biases=True)
    # what it would change: a head's value bias reaches z times its row's weight, less than 1
    biased = process_weights(model, fold_ln=False, center_writing_weights=False, center_unembed=False,
                             fold_value_biases=False)
    assert biased.blocks[0].attn.b_V.abs().sum() > 0


# ---- transformer-lens -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hooked_transformers(tmp_path_factory) -> dict:
    return hooked_transformer_outputs(tmp_path_factory.mktemp("tl_gpt_oss"), TL_CASES, tokens(),
                                      processed=("gpt-oss-experts-no-sinks",))[0]


@needs_saelens
@pytest.mark.parametrize("case", sorted(TL_CASES))
def test_every_hook_agrees_with_hooked_transformer(case, hooked_transformers):
    out = part(hooked_transformers, f"{case}/")
    cfg = HookedTransformerConfig(**TL_CASES[case])
    assert cfg.use_attention_sinks == TL_CASES[case].get("use_attention_sinks", False)
    model = HookedDecoder(cfg).eval()
    model.load_state_dict(part(out, "state."), strict=True)
    assert set(model.state_dict()) == {key for key in part(out, "state.") if key.rsplit(".", 1)[-1] not in TL_UNWRITTEN}
    assert_same_cache(model, tokens(), part(out, "cache."), out["logits"])


@needs_saelens
def test_tl_default_processing_gives_hooked_transformers_weights(hooked_transformers):
    case = "gpt-oss-experts-no-sinks"
    assert_processed_as_hooked_transformer(TL_CASES[case], part(hooked_transformers, f"{case}/"), tokens(),
                                           own=dict(TL_DEFAULTS, center_writing_weights=False))


def test_hooks_match_the_bridge(tmp_path):
    from test_family_defaults import GPT_FILES, tokenized_checkpoint
    from test_transformer_lens import compare_with_transformer_lens

    directory = tokenized_checkpoint("gpt_oss", tmp_path / "checkpoint", GPT_FILES)
    missing, theirs = compare_with_transformer_lens(directory, 10, seed=4, skip=("hook_expert_weights",))
    assert {n for n in missing if ".experts." not in n} == set()


# ---- analyses and the report ----------------------------------------------------------------------------------
def test_expert_routing_holds_the_chosen_experts_softmax(tmp_path):
    """GPT-OSS's routing: each token's chosen experts and their weights are transformers' router's top logits and
    the softmax over them; `probs` holds those weights, 0 for the experts not chosen (its hook's content)."""
    from probe.analyses import expert_routing

    hf = build("gpt_oss", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    toks = tokens(101)[:1]
    routing = expert_routing(model, toks)
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
        for layer in range(3):
            x = model.blocks[layer].ln2(cache[f"blocks.{layer}.hook_resid_mid"]).reshape(-1, 64)
            _, scores, chosen = hf.model.layers[layer].mlp.router(x)
            assert torch.equal(routing.chosen[layer], chosen)
            torch.testing.assert_close(routing.weights[layer], scores, atol=1e-6, rtol=0)
            assert torch.equal(routing.probs[layer] > 0, torch.zeros(11, 4, dtype=torch.bool).scatter(1, chosen, True))


def test_the_report_runs_on_gpt_oss(tmp_path):
    """Routing, and the circuit section on the hooked engine (the sparse one refuses attention sinks)."""
    from test_family_defaults import GPT_FILES, tokenized_checkpoint
    from probe.cli.cli import main

    directory = tokenized_checkpoint("gpt_oss", tmp_path / "checkpoint", GPT_FILES)
    assert main(["report", "--model", str(directory), "--prompt", "the cat sat on the mat", "--corrupted",
                 "the cat sat on the rug", "--out", str(tmp_path / "report"), "--quiet"]) in (0, None)
    page = (tmp_path / "report" / "report.html").read_text()
    assert "Expert routing" in page and "Each token runs through 2 of each layer&#x27;s 4 experts" in page
    assert (tmp_path / "report" / "edges.csv").exists() and (tmp_path / "report" / "routing.csv").exists()


@needs_saelens
def test_transformer_lens_gpt_oss_demo_runs_unchanged(tmp_path):
    """TL 3.9's GPT_OSS_Demo way (tests/gpt_oss_idioms.py): HookedTransformer(cfg, transformers_tokenizer,
    move_to_device=False), filled by partial load_state_dict calls from an MXFP4 file, then its routing table, logit
    lens, pattern and residual patching: TL's values."""
    from probe import HookedTransformer
    from test_family_defaults import GPT_FILES, tokenized_checkpoint
    from gpt_oss_idioms import gpt_oss_demo
    from test_sae_training import oracle

    plain = tokenized_checkpoint("gpt_oss", tmp_path / "plain", GPT_FILES, hidden_size=64, head_dim=16,
                                 num_attention_heads=8, num_hidden_layers=2)
    mxfp4_checkpoint(plain, tmp_path / "mxfp4")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "mxfp4" / name).write_bytes((plain / name).read_bytes())
    oracle("gpt_oss_demo", tmp_path / "mxfp4", tmp_path / "tl.safetensors")
    theirs = load_file(str(tmp_path / "tl.safetensors"))
    ours = gpt_oss_demo(HookedTransformer, HookedTransformerConfig, str(tmp_path / "mxfp4"))
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, atol=1e-4, rtol=1e-4, msg=key)
