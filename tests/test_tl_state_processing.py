"""transformer-lens's state-dict processing methods (probe/tl_state_processing.py), against HookedTransformer
(transformer-lens 3.9) running the same calls (tests/state_processing_idioms.py) on the same state dict."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from probe import HookedDecoder, HookedTransformer, HookedTransformerConfig
from state_processing_idioms import STEPS, state_processing_idioms
from test_sae_training import needs_saelens, oracle
from test_tl_state_dict import TOY_CONFIGS, built_by_hooked_transformer

# ARENA's July 2023 problem (palindromes), smaller: attention only, two output classes; every step applies
ARENA_LIKE = dict(n_layers=2, n_ctx=12, d_model=28, d_head=14, n_heads=2, d_mlp=None, attn_only=True, act_fn="relu",
                  d_vocab=33, d_vocab_out=2, normalization_type="LN", seed=42)
# ARENA's November 2023 problem (cumulative sums), smaller: no norms, so centring writers and readers changes the model
ARENA_NO_NORMS = dict(n_layers=1, n_ctx=10, d_model=24, d_head=12, n_heads=1, d_mlp=8, act_fn="relu", d_vocab=11,
                      d_vocab_out=3, normalization_type=None, seed=42)
CASES = {
    "arena-attn-only": (ARENA_LIKE, STEPS, {}),
    "arena-no-norms": (ARENA_NO_NORMS, STEPS[:4], {}),
    "ln-mlp": (TOY_CONFIGS["ln-defaults"], STEPS, {}),
    "lnpre": (TOY_CONFIGS["lnpre-othello-like"], STEPS[:4], {}),  # nothing to fold: the readers are centred
    # an RMSNorm folds without bias or centring (what TL's process_weights passes)
    "rms-gqa": (TOY_CONFIGS["rms-rotary-gqa-gated"], STEPS[:4], dict(fold_biases=False, center_weights=False)),
}


def products(out: dict, prefix: str) -> dict:
    """Each head's W_Q W_K^T and W_V W_O: what a refactoring keeps (its singular directions' signs are the SVD's)."""
    layers = {key.split(".")[2] for key in out if key.startswith(f"{prefix}.blocks.")}
    return {f"{layer}.{name}": torch.einsum("hmd,hnd->hmn" if name == "QK" else "hmd,hdn->hmn",
                                            out[f"{prefix}.blocks.{layer}.attn.{a}"], out[f"{prefix}.blocks.{layer}.attn.{b}"])
            for layer in layers for name, a, b in (("QK", "W_Q", "W_K"), ("OV", "W_V", "W_O"))}


@needs_saelens
@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_steps_give_hooked_transformers_dicts(case, tmp_path):
    settings, steps, fold = CASES[case]
    tokens = torch.randint(0, settings["d_vocab"], (3, settings["n_ctx"]), generator=torch.Generator().manual_seed(4))
    state = built_by_hooked_transformer(settings, tokens, tmp_path)  # trained-looking weights, TL's layout
    # as an older transformer-lens saved it (ARENA's checkpoints): the whole causal mask, which passes through
    state.update({key: torch.ones(settings["n_ctx"], settings["n_ctx"], dtype=torch.bool).tril()
                  for key in state if key.endswith(".attn.mask")})
    save_file(state, str(tmp_path / "state.safetensors"))
    oracle("state_steps", json.dumps(settings), tmp_path / "state.safetensors", tmp_path / "tokens.safetensors",
           tmp_path / "theirs.safetensors", json.dumps(steps), json.dumps(fold))
    theirs = load_file(str(tmp_path / "theirs.safetensors"))
    model = HookedTransformer(HookedTransformerConfig(**settings)).eval()  # fresh, as ARENA's cell builds it
    built = {key: t.clone() for key, t in state.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = state_processing_idioms(model, state, tokens, steps, fold)
    # a step that changes what the model computes says so, as it does it
    changes = {str(w.message).split(":")[0] for w in caught if "changes what this model computes" in str(w.message)}
    assert changes == ({"center_writing_weights", "fold_layer_norm"} if case == "arena-no-norms" else
                       {"center_writing_weights"} if case == "rms-gqa" else set())
    assert set(ours) == set(theirs)  # the same keys after every step: a folded norm's weights stay, as the identity
    assert all(torch.all(t == (1.0 if key.endswith(".w") else 0.0)) for key, t in ours.items()
               if key.startswith("fold_layer_norm.") and ".ln" in key)
    refactored = {key for key in ours if key.startswith("refactor_factored_attn_matrices.")
                  and key.rsplit(".", 1)[-1] in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K")}
    for key in sorted(set(ours) - refactored):
        scale = max(theirs[key].double().abs().max().item() if theirs[key].numel() else 0.0, 1e-3)  # (bool buffers)
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-5 * scale, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    if refactored:
        for key, product in products(ours, "refactor_factored_attn_matrices").items():
            expected = products(theirs, "refactor_factored_attn_matrices")[key]
            torch.testing.assert_close(product, expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5, msg=key)
    # (input.KEY above: each step leaves its input as it was, but center_writing_weights, which writes into it too)
    if "center_writing_weights" in steps:
        assert not torch.equal(ours["input.embed.W_E"], built["embed.W_E"])
    assert torch.equal(ours["input.unembed.W_U"], built["unembed.W_U"])


def test_folding_refuses_a_folded_dict_and_the_wrong_norm_keywords():
    model = HookedDecoder(HookedTransformerConfig(**TOY_CONFIGS["ln-defaults"]))
    # a dict whose norms an older transformer-lens folded away (it deleted their weights) has nothing to fold
    folded = {key: t for key, t in model.state_dict().items() if ".ln" not in f".{key}"}
    with pytest.raises(KeyError, match=r"blocks\.0\.ln1\.w.*folded already"):
        model.fold_layer_norm(folded)
    with pytest.raises(ValueError, match="fold_biases=True, center_weights=True"):
        model.fold_layer_norm(model.state_dict(), fold_biases=False, center_weights=False)
    with pytest.raises(KeyError, match="blocks.0.attn.W_X"):
        model.center_unembed({**model.state_dict(), "blocks.0.attn.W_X": torch.zeros(1)})
    rms = HookedDecoder(HookedTransformerConfig(**TOY_CONFIGS["rms-rotary-gqa-gated"]))
    with pytest.raises(ValueError, match="fold_biases=False, center_weights=False"):
        rms.fold_layer_norm(rms.state_dict())
    with pytest.raises(ValueError, match="center_unembed shifts"):  # a logit soft cap: refused, as in processing
        HookedDecoder(HookedTransformerConfig(**TOY_CONFIGS["local-windows-softcaps"])).center_unembed({})
