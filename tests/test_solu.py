"""SoLU MLPs (probe/mlp.py: SoLU, NormedMLP), as transformer-lens's `act_fn="solu"` and `"solu_ln"` build them:
x * softmax(x) over d_mlp, and with "solu_ln" a LayerNorm over d_mlp (mlp.ln) between the activation and W_out;
and Neel Nanda's solu-* toy models loaded by name (probe/checkpoint_tl.py).

The oracle is HookedTransformer itself (transformer-lens 3, in the SAELens virtualenv): tests/saelens_oracle.py's
`tl_cache` command builds one from the config with random weights and returns every cached activation, before and
after TL's default processing; its `neel` command runs TL's own from_pretrained(name) on a locally served checkpoint."""
from __future__ import annotations

import json

import pytest
import torch

from probe import Activation, DecoderConfig, HookedDecoder, HookedTransformerConfig, process_weights
from probe.checkpoint_tl import TLFormatError
from probe.loading import SHORT_NAMES
from probe.mlp import NormedMLP
from probe.names import act_name
from probe.shapes import hook_shapes
from probe.tl_state_dict import TL_BUFFERS, TL_UNWRITTEN
from test_checkpoint_tl import assert_state_and_logits_are_tls, checkpoint_dir, loaded_by_both
from test_sae_training import needs_saelens, oracle
from tl_cases import TL_DEFAULTS, assert_processed_as_hooked_transformer, assert_same_cache, hooked_transformer_outputs, part
from toy_helpers import randomised

SMALL = dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, d_mlp=48)
CASES = {
    "solu-ln": dict(SMALL, act_fn="solu_ln"),  # Neel Nanda's solu-* models: LayerNorm everywhere
    "solu": dict(SMALL, act_fn="solu"),  # no norm after the activation: hook_post = SoLU(hook_pre)
    "solu-ln-no-norms": dict(SMALL, act_fn="solu_ln", normalization_type=None),  # mlp.ln without weights (TL's LNPre)
    "solu-ln-lnpre": dict(SMALL, act_fn="solu_ln", normalization_type="LNPre"),
}


def tokens(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, SMALL["d_vocab"], (2, 9), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def hooked_transformers(tmp_path_factory) -> tuple[dict, dict]:
    """HookedTransformer's outputs for every case with random weights (one oracle process, whose start costs more
    than a case), "solu-ln" processed with TL's defaults too: (outputs under "CASE/", {case: n_params})."""
    return hooked_transformer_outputs(tmp_path_factory.mktemp("tl_caches"), CASES, tokens(), processed=("solu-ln",))


# ---- the model, hook by hook, against HookedTransformer ----------------------------------------------------------
@needs_saelens
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_hook_agrees_with_hooked_transformer(case, hooked_transformers):
    settings, toks = CASES[case], tokens()
    out, printed = part(hooked_transformers[0], f"{case}/"), {"n_params": hooked_transformers[1][case]}
    model = HookedDecoder(HookedTransformerConfig(**settings)).eval()
    model.load_state_dict(part(out, "state."), strict=True)
    normed = settings["act_fn"] == "solu_ln"
    assert isinstance(model.blocks[0].mlp, NormedMLP) == normed
    theirs = part(out, "cache.")
    if normed:
        assert {"blocks.1.mlp.hook_mid", "blocks.1.mlp.ln.hook_scale", "blocks.1.mlp.ln.hook_normalized"} <= set(theirs)
    assert_same_cache(model, toks, theirs, out["logits"])
    assert model.cfg.n_params == printed["n_params"]  # TL's count: weights of attention and MLPs, no norms or biases
    # mlp.ln.w / .b exactly where TL has them (and none in an LNPre one)
    assert set(model.state_dict()) == {key for key in part(out, "state.") if key.rsplit(".", 1)[-1] not in TL_UNWRITTEN}
    shapes = hook_shapes(model.cfg, *toks.shape)
    assert all(shapes[name] == tuple(t.shape) for name, t in theirs.items())


@needs_saelens
def test_tl_default_processing_gives_hooked_transformers_weights_and_activations(hooked_transformers):
    """load_and_process_state_dict with TL's defaults: mlp.ln's w and b fold into W_out and b_out, W_out is centred
    over d_mlp (what the LayerNorm's mean-zero output never reads) and then over d_model, mlp.ln keeps no weights."""
    out = part(hooked_transformers[0], "solu-ln/")
    assert_processed_as_hooked_transformer(CASES["solu-ln"], out, tokens())
    model = HookedDecoder(HookedTransformerConfig(**CASES["solu-ln"])).eval()
    model.load_and_process_state_dict(part(out, "state."), **TL_DEFAULTS)
    assert not any(".mlp.ln." in key for key in model.state_dict())


# ---- the model by hand ------------------------------------------------------------------------------------
def test_the_mlp_computes_solu_then_its_layernorm_then_w_out():
    model = randomised(HookedDecoder(HookedTransformerConfig(**CASES["solu-ln"])), seed=3)
    mlp, toks = model.blocks[1].mlp, tokens()
    with torch.no_grad():
        _, cache = model.run_with_cache(toks)
    pre, mid, post = (cache[act_name(kind, 1)] for kind in ("pre", "mid", "post"))
    x = cache["blocks.1.ln2.hook_normalized"] * model.blocks[1].ln2.w + model.blocks[1].ln2.b
    torch.testing.assert_close(pre, x @ mlp.W_in + mlp.b_in, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mid, pre * torch.softmax(pre, dim=-1), atol=1e-6, rtol=1e-5)
    centred = mid - mid.mean(-1, keepdim=True)
    scale = (centred.pow(2).mean(-1, keepdim=True) + model.cfg.eps).sqrt()
    torch.testing.assert_close(cache[act_name("scale", 1, "mlp.ln")], scale, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(post, centred / scale * mlp.ln.w + mlp.ln.b, atol=1e-5, rtol=1e-5)
    # W_out reads hook_post: each neuron's write is still its activation times its row (neuron results add up)
    torch.testing.assert_close(cache[act_name("mlp_out", 1)], post @ mlp.W_out + mlp.b_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.get_neuron_results(1).sum(-2) + mlp.b_out, cache[act_name("mlp_out", 1)],
                               atol=1e-5, rtol=1e-5)


def test_processing_keeps_log_probs_and_drops_the_mlp_norms_weights():
    model = randomised(HookedDecoder(HookedTransformerConfig(**CASES["solu-ln"])), seed=4)
    processed = process_weights(model)
    toks = tokens()
    with torch.no_grad():
        torch.testing.assert_close(processed(toks).log_softmax(-1), model(toks).log_softmax(-1), atol=1e-4, rtol=1e-4)
    assert not processed.cfg.mlp_norm_learned and model.cfg.mlp_norm_learned
    assert "mlp.ln.w" not in dict(processed.blocks[0].named_parameters(prefix="")) and \
        torch.equal(processed.blocks[0].mlp.ln.w, torch.ones(SMALL["d_mlp"]))
    row = processed.blocks[0].mlp.W_out  # [d_mlp d_model]: centred over the neurons (fold) and over d_model (writers)
    torch.testing.assert_close(row.mean(0), torch.zeros(SMALL["d_model"]), atol=1e-6, rtol=0)
    torch.testing.assert_close(row.mean(1), torch.zeros(SMALL["d_mlp"]), atol=1e-6, rtol=0)


def test_a_plain_solu_model_processes_too():
    """TL's fold_ln stops on a plain "solu" model (it looks for an mlp.ln it does not have); probe folds the rest."""
    model = randomised(HookedDecoder(HookedTransformerConfig(**CASES["solu"])), seed=5)
    processed, toks = process_weights(model), tokens()
    with torch.no_grad():
        torch.testing.assert_close(processed(toks).log_softmax(-1), model(toks).log_softmax(-1), atol=1e-4, rtol=1e-4)
    assert not processed.cfg.norm_weights and not hasattr(processed.blocks[0].mlp, "ln")


def test_config_names_ledger_and_refusals():
    cfg = HookedTransformerConfig(**CASES["solu-ln"])
    assert cfg.activation is Activation.SOLU_LN and cfg.act_fn == "solu_ln" and cfg.activation.normed
    assert HookedTransformerConfig(**CASES["solu"]).activation is Activation.SOLU and not Activation.SOLU.normed
    assert DecoderConfig.from_dict(cfg.to_dict()) == cfg
    model = HookedDecoder(cfg)
    book = model.ledger().to_frame()
    assert model.ledger().total_params == sum(p.numel() for p in model.parameters())
    assert set(book[book.component == "mlp.ln"].params) == {2 * SMALL["d_mlp"]}
    assert "mlp.ln" not in set(process_weights(model).ledger().to_frame().component)  # folded: nothing learned
    assert act_name("mid", 0) == "blocks.0.mlp.hook_mid" and act_name("mlp_mid", 1) == "blocks.1.mlp.hook_mid"
    assert act_name("normalized", 0, "mlp.ln") == "blocks.0.mlp.ln.hook_normalized"
    with pytest.raises(ValueError, match="no Hugging Face checkpoint format holds a SoLU MLP.*safetensors"):
        model.save_pretrained("never-written")
    with pytest.raises(ValueError, match="activation='solu_ln'.*gated MLP.*gated_mlp=False"):
        DecoderConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=4, activation="solu_ln", gated_mlp=True)
    with pytest.raises(ValueError, match="activation='softmax' is not supported.*'solu', 'solu_ln'"):
        DecoderConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=4, activation="softmax")


# ---- Neel Nanda's solu-* checkpoints by name ----------------------------------------------------------------
def old_format(state: dict, n_layers: int) -> dict:
    """A TL state dict as the older SoLU runs (`solu-*-pile`) stored theirs: the inverse of TL's
    convert_neel_solu_old_weights (norms named `norm`, W_pos and, up to 6 layers, every W_ transposed)."""
    out = {}
    for key, t in state.items():
        if key.rsplit(".", 1)[-1] in TL_BUFFERS:
            continue
        if n_layers <= 6 and "W_" in key and "W_pos" not in key:
            t = t.transpose(-2, -1)
        if key == "pos_embed.W_pos" and n_layers <= 8:
            t = t.T
        key = "norm." + key[len("ln_final."):] if key.startswith("ln_final.") else key.replace(".ln", ".norm")
        out[key] = t.contiguous()
    return out


NEEL = dict(d_model=32, n_layers=2, d_mlp=128, d_head=8, n_heads=4, n_ctx=16, d_vocab=50, act_fn="solu_ln",
            attn_only=False, normalization="LN")


@needs_saelens
@pytest.mark.parametrize("name", ["solu-2l", "solu-1l-pile"])
def test_a_solu_model_loads_by_name_as_transformer_lens_loads_it(name, tmp_path, monkeypatch):
    config = dict(NEEL, n_layers=1) if name == "solu-1l-pile" else NEEL
    directory = checkpoint_dir(tmp_path, config)
    if name.endswith("-pile"):  # the older runs' layout, written here (the oracle writes TL's own otherwise)
        fresh = randomised(HookedDecoder(HookedTransformerConfig(**{k: v for k, v in config.items()
                                                                    if k != "normalization"})), seed=9)
        torch.save(old_format(fresh.state_dict(), config["n_layers"]), directory / "model_final.pth")
    toks = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(1))
    model, resolved, out, asked = loaded_by_both(name, directory, TL_DEFAULTS, toks, tmp_path, monkeypatch)
    assert asked and {repo for repo, _ in asked} == {SHORT_NAMES[name]}
    assert resolved["act_fn"] == "solu_ln" and model.cfg.activation is Activation.SOLU_LN
    for key, value in resolved.items():
        assert getattr(model.cfg, key) == (pytest.approx(value) if isinstance(value, float) else value), key
    assert_state_and_logits_are_tls(model, out, toks)


def test_an_older_solu_run_in_a_directory_says_so_in_its_config(tmp_path):
    """A local directory has no hub name to tell an older run by: its config's "architecture" does, as in TL."""
    config = dict(NEEL, n_layers=1, d_mlp=48)
    settings = {k: v for k, v in config.items() if k != "normalization"}
    fresh = randomised(HookedDecoder(HookedTransformerConfig(**settings)), seed=5)
    directory = checkpoint_dir(tmp_path, dict(config, architecture="neel-solu-old"))
    torch.save(old_format(fresh.state_dict(), 1), directory / "model_final.pth")
    loaded = HookedDecoder.from_pretrained(directory)
    assert loaded.cfg.original_architecture == "neel-solu-old"
    toks = tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(toks), fresh(toks), atol=1e-5, rtol=1e-5)
    (directory / "config.json").write_text(json.dumps(config))  # without it, the old layout's shapes are refused
    with pytest.raises(TLFormatError, match="(?s)size mismatch.*older SoLU runs.*\"architecture\": \"neel-solu-old\""):
        HookedDecoder.from_pretrained(directory)


def test_short_names_cover_transformer_lens_solu_models():
    for n, width in ((1, 512), (6, 768), (12, 1536)):
        for alias in ("", "-new", "-c4-code"):
            assert SHORT_NAMES[f"solu-{n}l{alias}"] == f"NeelNanda/SoLU_{n}L{width}W_C4_Code"
    assert SHORT_NAMES["solu-4l-wiki"] == "NeelNanda/SoLU_4L512W_Wiki_Finetune"
    assert SHORT_NAMES["solu-8l-pile"] == SHORT_NAMES["solu-8l-old"] == "NeelNanda/SoLU_8L_v21_old"
