"""Apertus (probe/checkpoint_apertus.py: q/k norms, an ungated MLP whose xIELU learns two scalars per layer) and Arcee
(Llama with an ungated relu^2 MLP).

The oracles: transformers (test_variants.py compares logits and every residual on two cases of each and saves
through it; here greedy generation, TL-default processing, a file without xIELU's buffers), HookedTransformer 3.9
(toys with act_fn "xielu" / "relu2", hook by hook, and its own Apertus converter on a transformers checkpoint), and
TL 4's bridge over the same checkpoints."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from probe import DecoderConfig, Experts, HookedDecoder, HookedTransformerConfig
from probe.tl_state_dict import TL_BUFFERS
from probe.config_choices import Activation
from probe.config_file import CheckpointError
from family_checks import assert_generation_and_processing_match, cache_of_everything
from oracle_process import oracle
from test_sae_training import needs_saelens
from test_variants import build
from tl_cases import TL_DEFAULTS, assert_processed_as_hooked_transformer, assert_same_cache, hooked_transformer_outputs, part

UNGATED = dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, normalization_type="RMS",
               positional_embedding_type="rotary", rotary_dim=8, n_key_value_heads=2, gated_mlp=False)
TL_CASES = {
    "apertus": dict(UNGATED, act_fn="xielu", use_qk_norm=True, original_architecture="ApertusForCausalLM"),
    "arcee": dict(UNGATED, act_fn="relu2", original_architecture="ArceeForCausalLM"),
    "xielu-gated": dict(UNGATED, act_fn="xielu", gated_mlp=True),  # TL builds it: act_fn(gate) * up
}
# the normed q and k: TL 4's points, which TL 3.9 lacks; the per-head norms' points, which TL 3.9 flattens to
# [batch*pos*head ...] (docs/from_transformer_lens.md)
TL4_ONLY = dict(probe_only=("attn.hook_q_normed", "attn.hook_k_normed"),
                flattened=tuple(f"{w}_norm.hook_{p}" for w in "qk" for p in ("scale", "normalized")))


def tokens(vocab: int = 50, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(seed))


# ---- transformers -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["apertus", "arcee"])
def test_generation_and_processing_are_transformers(kind, tmp_path):
    hf = build(kind, tmp_path)
    assert_generation_and_processing_match(hf, tmp_path)


def test_a_file_without_xielus_buffers_is_refused_by_name(tmp_path):
    """transformers saves beta and eps beside alpha_p and alpha_n, and reads garbage where a file lacks them (its
    missing buffers are left uninitialised); probe names the missing tensor."""
    build("apertus", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert {k for k in state if k.endswith(("act_fn.beta", "act_fn.eps"))}  # what transformers' save holds
    save_file({k: v for k, v in state.items() if not k.endswith("layers.1.mlp.act_fn.eps")},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing the tensor 'layers.1.mlp.act_fn.eps'"):
        HookedDecoder.from_pretrained(tmp_path)


def test_xielus_parameters_are_the_models_own(tmp_path):
    """The learned scalars are parameters (the ledger counts them, optimisers see them) and the hook shapes are a
    plain MLP's; the activation itself is transformers' XIELUActivation, value for value, on both sides of 0."""
    from transformers.activations import XIELUActivation

    build("apertus", tmp_path)
    model, _, cache, shapes = cache_of_everything(tmp_path)
    assert all(tuple(t.shape) == shapes[name] for name, t in cache.items()) and "blocks.1.mlp.hook_post" in cache
    act = model.blocks[0].mlp.act_fn
    assert {n for n, _ in model.named_parameters() if ".act_fn." in n} == {
        f"blocks.{l}.mlp.act_fn.{p}" for l in range(2) for p in ("alpha_p", "alpha_n")}
    assert model.ledger().total_params == sum(p.numel() for p in model.parameters())
    theirs = XIELUActivation(dtype=torch.float32)
    with torch.no_grad():
        for name in ("alpha_p", "alpha_n"):
            getattr(theirs, name).copy_(getattr(act, name).reshape(1))
        theirs.beta.copy_(act.beta), theirs.eps.copy_(act.eps)
        x = torch.linspace(-6, 6, 101)
        torch.testing.assert_close(act(x), theirs(x), atol=1e-6, rtol=0)


def test_what_only_apertus_holds_is_refused_elsewhere(tmp_path):
    small = dict(n_layers=1, d_model=16, n_heads=2, d_vocab=20, n_ctx=8, norm="rms", positions="rotary")
    with pytest.raises(ValueError, match="activation='xielu' learns parameters per MLP.*experts"):
        DecoderConfig(**small, activation=Activation.XIELU, gated_mlp=True, experts=Experts(n=2, per_token=1))
    gated = HookedDecoder(DecoderConfig(**small, activation=Activation.XIELU, gated_mlp=True))
    with pytest.raises(ValueError, match="no Hugging Face checkpoint format holds.*apertus.*gated_mlp=True"):
        gated.save_pretrained(tmp_path / "gated")
    assert not (tmp_path / "gated").exists()


# ---- transformer-lens -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hooked_transformers(tmp_path_factory) -> dict:
    return hooked_transformer_outputs(tmp_path_factory.mktemp("tl_apertus"), TL_CASES, tokens(),
                                      processed=("apertus",))[0]


@needs_saelens
@pytest.mark.parametrize("case", sorted(TL_CASES))
def test_every_hook_agrees_with_hooked_transformer(case, hooked_transformers):
    out = part(hooked_transformers, f"{case}/")
    model = HookedDecoder(HookedTransformerConfig(**TL_CASES[case])).eval()
    model.load_state_dict(part(out, "state."), strict=True)
    if TL_CASES[case]["act_fn"] == "xielu":  # (moved off TL's initial values by the oracle, as every parameter)
        assert model.blocks[1].mlp.act_fn.alpha_p.item() == part(out, "state.")["blocks.1.mlp.act_fn.alpha_p"].item()
    assert_same_cache(model, tokens(), part(out, "cache."), out["logits"], **TL4_ONLY)


@needs_saelens
def test_tl_default_processing_gives_hooked_transformers_weights(hooked_transformers):
    assert_processed_as_hooked_transformer(TL_CASES["apertus"], part(hooked_transformers, "apertus/"), tokens(),
                                           own=dict(TL_DEFAULTS, center_writing_weights=False), **TL4_ONLY)


@needs_saelens
def test_hooked_transformers_own_converter_reads_what_probe_reads(tmp_path):
    """TL 3.9's convert_apertus_weights on a transformers checkpoint gives probe's exported state dict, and TL's
    forward on probe's export gives transformers' logits. (TL's converter leaves eps at its own default, so the
    checkpoint keeps transformers' default eps here.)"""
    hf = build("apertus", tmp_path / "built")
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.act_fn.eps.fill_(-1e-6)
    hf.save_pretrained(tmp_path / "checkpoint")
    c = hf.config
    rope = c.rope_parameters
    settings = dict(n_layers=c.num_hidden_layers, d_model=c.hidden_size, d_head=c.hidden_size // c.num_attention_heads,
                    n_heads=c.num_attention_heads, n_key_value_heads=c.num_key_value_heads, d_mlp=c.intermediate_size,
                    n_ctx=c.max_position_embeddings, eps=c.rms_norm_eps, d_vocab=c.vocab_size, act_fn="xielu",
                    normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=c.hidden_size // c.num_attention_heads,
                    rotary_base=rope["rope_theta"], gated_mlp=False, final_rms=True, use_qk_norm=True,
                    use_NTK_by_parts_rope=True, NTK_original_ctx_len=rope["original_max_position_embeddings"],
                    NTK_by_parts_low_freq_factor=rope["low_freq_factor"],
                    NTK_by_parts_high_freq_factor=rope["high_freq_factor"], NTK_by_parts_factor=rope["factor"],
                    original_architecture="ApertusForCausalLM")
    model = HookedDecoder.from_pretrained(tmp_path / "checkpoint").eval()
    exported = model.state_dict()
    save_file(exported, str(tmp_path / "state.safetensors"))
    toks = tokens(101)
    save_file({"tokens": toks}, str(tmp_path / "tokens.safetensors"))
    report = json.loads(oracle("tl_state_dict", "apertus", tmp_path / "checkpoint", json.dumps(settings),
                               tmp_path / "state.safetensors", tmp_path / "tokens.safetensors", tmp_path / "out.safetensors"))
    out = load_file(str(tmp_path / "out.safetensors"))
    theirs = {key.removeprefix("tl."): t for key, t in out.items() if key.startswith("tl.")}
    assert {k for k in theirs if "act_fn" in k} == {f"blocks.{l}.mlp.act_fn.{p}" for l in range(2)
                                                     for p in ("alpha_p", "alpha_n", "beta")}
    for key, value in theirs.items():  # (TL's converter keeps transformers' [1] for the alphas; its model holds [])
        torch.testing.assert_close(exported[key], value.reshape(exported[key].shape), atol=1e-6, rtol=0, msg=key)
    with torch.no_grad():
        expected = hf(toks).logits
    torch.testing.assert_close(out["tl_logits"], expected, atol=1e-4, rtol=1e-4)  # the oracle's own check
    assert report["unexpected"] == [] and all(key.rsplit(".", 1)[-1] in TL_BUFFERS for key in report["missing"])
    torch.testing.assert_close(out["logits"], expected, atol=1e-4, rtol=1e-4)
    assert {k: list(v.shape) for k, v in exported.items() if "act_fn" in k} == \
        {k: v for k, v in report["shapes"].items() if "act_fn" in k}


@pytest.mark.parametrize("kind", ["apertus", "arcee"])
def test_hooks_match_the_bridge(kind, tmp_path):
    from test_family_defaults import tokenized_checkpoint
    from test_transformer_lens import compare_with_transformer_lens

    directory = tokenized_checkpoint(kind, tmp_path / "checkpoint")
    missing, theirs = compare_with_transformer_lens(directory, 10, seed=4)
    assert {"blocks.1.mlp.hook_pre", "blocks.1.mlp.hook_post", "blocks.1.attn.hook_pattern"} <= theirs
    assert not {n for n in missing if n.startswith("blocks.1.mlp.")}, missing
