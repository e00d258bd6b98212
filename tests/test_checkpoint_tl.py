"""probe/checkpoint_tl.py: checkpoints in transformer-lens's own format (Neel Nanda's toy models: `gelu-2l`,
`attn-only-2l`, ...), loaded by name as TL loads them.

The oracle is transformer-lens 3's own `from_pretrained(name)` (tests/saelens_oracle.py's `neel` command), its hub
reads served from the same local directory: the config it resolves, its processed state dict and its logits."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from probe import DEFAULT_MODEL, HookedDecoder
from probe.checkpoint_tl import TLFormatError
from probe.loading import SHORT_NAMES
from probe.tl_state_dict import TL_BUFFERS, TL_UNWRITTEN
from test_sae_training import needs_saelens, oracle

NO_PROCESSING = dict(fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False)
# TL's from_pretrained processes by default; probe's only when asked, so both are asked explicitly
TL_DEFAULTS = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)
CASES = {  # Neel Nanda's config.json keys, at a small size
    "gelu-2l": dict(d_model=64, n_layers=2, d_mlp=256, d_head=16, n_heads=4, n_ctx=32, d_vocab=100, act_fn="gelu",
                    attn_only=False, normalization="LN", shortformer_pos=False),
    "attn-only-2l": dict(d_model=64, n_layers=2, d_mlp=256, d_head=16, n_heads=4, n_ctx=32, d_vocab=100,
                         act_fn="solu_ln", attn_only=True, normalization="LN", shortformer_pos=True),
    # the same names with learned positions added to the residual, so TL's processing folds the norms: an attention-only
    # model's config still names "solu_ln", which has no MLP norm to fold
    "attn-only-1l": dict(d_model=64, n_layers=1, d_mlp=256, d_head=16, n_heads=4, n_ctx=32, d_vocab=100,
                         act_fn="solu_ln", attn_only=True, normalization="LN", shortformer_pos=False),
    # Redwood's two-layer attention-only model, in the same format (ArthurConmy/redwood_attn_2l): ACDC's induction task
    "redwood_attn_2l": dict(d_model=64, n_layers=2, d_mlp=256, d_head=8, n_heads=8, n_ctx=32, d_vocab=100, act_fn="gelu",
                            attn_only=True, normalization="LN", shortformer_pos=True),
}
# asked for TL's default processing, TL's from_pretrained folds and centres nothing in a shortformer model (it folds
# only the value biases), so the attention-only model's weights are the file's but for b_O
LOADINGS = [("gelu-2l", TL_DEFAULTS), ("attn-only-2l", TL_DEFAULTS), ("attn-only-2l", NO_PROCESSING),
            ("attn-only-1l", TL_DEFAULTS),
            ("redwood_attn_2l", dict(fold_ln=False, center_writing_weights=False, center_unembed=False))]  # ACDC's


def checkpoint_dir(tmp_path: Path, config: dict) -> Path:
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def loaded_by_both(name: str, directory, processing: dict, tokens: torch.Tensor, tmp_path, monkeypatch,
                   model_class: type = HookedDecoder):
    """(probe's `model_class.from_pretrained(name, **processing)`, TL's resolved config values, TL's outputs, the hub
    reads probe asked for as (repo, patterns)): both libraries' hub reads served from `directory`; TL's through the
    oracle's `neel` command, run on `tokens`."""
    import huggingface_hub

    save_file({"tokens": tokens}, str(tmp_path / "tokens.safetensors"))
    resolved = json.loads(oracle("neel", name, directory, tmp_path / "tokens.safetensors", tmp_path / "out.safetensors",
                                 json.dumps(processing)).splitlines()[-1])
    out = load_file(str(tmp_path / "out.safetensors"))
    asked = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, local_files_only=False, **_):
        asked.append((repo_id, tuple(allow_patterns or ())))
        return str(directory)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    generator = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the default steps a model cannot take, skipped as TL skips them
        model = model_class.from_pretrained(name, **processing).eval()
    # a notebook's random tokens after the loading line are TL's only if loading draws what TL's draws (nothing)
    assert (not torch.equal(torch.get_rng_state(), generator)) == bool(out.pop("generator_moved"))
    return model, resolved, out, asked


def assert_state_and_logits_are_tls(model: HookedDecoder, out: dict, tokens: torch.Tensor) -> None:
    """The model's state dict is TL's loaded one (`out`'s state.KEY, less TL's buffers) and so are its logits."""
    theirs = {key.removeprefix("state."): t for key, t in out.items()
              if key.startswith("state.") and key.rsplit(".", 1)[-1] not in TL_UNWRITTEN}
    ours = model.state_dict()
    assert set(ours) == set(theirs)
    for key in (key for key in ours if key.rsplit(".", 1)[-1] not in TL_BUFFERS):  # TL fills its mask as it runs
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=1e-5, msg=key)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), out["logits"], atol=1e-4, rtol=1e-4)


@needs_saelens
@pytest.mark.parametrize("name, processing", LOADINGS, ids=[f"{name}-{bool(steps['fold_ln'])}" for name, steps in LOADINGS])
def test_a_toy_model_loads_by_name_as_transformer_lens_loads_it(name, processing, tmp_path, monkeypatch):
    config = CASES[name]
    directory = checkpoint_dir(tmp_path, config)
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    model, resolved, out, asked = loaded_by_both(name, directory, processing, tokens, tmp_path, monkeypatch)
    assert asked and all(repo == SHORT_NAMES[name] and "*final.pth" in patterns for repo, patterns in asked)
    for key, value in resolved.items():
        if key != "act_fn" or not config["attn_only"]:  # no MLP: TL keeps the file's act_fn, which nothing uses
            assert getattr(model.cfg, key) == (pytest.approx(value) if isinstance(value, float) else value), key
    assert_state_and_logits_are_tls(model, out, tokens)

def test_a_tl_format_directory_reads_only_tensors_and_says_what_is_wrong(tmp_path):
    config = dict(CASES["gelu-2l"], n_layers=1)
    directory = checkpoint_dir(tmp_path, config)
    with pytest.raises(TLFormatError, match=r"one \*final\.pth state dict; found no file"):
        HookedDecoder.from_pretrained(directory)

    class Payload:  # a pickled object: torch.load(weights_only=True) must refuse it, running nothing
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"embed.W_E": Payload()}, directory / "model_final.pth")
    with pytest.raises(TLFormatError, match="model_final.pth: not a state dict of tensors.*weights_only"):
        HookedDecoder.from_pretrained(directory)
    torch.save({"embed.W_E": torch.zeros(100, 64)}, directory / "run_final.pth")
    with pytest.raises(TLFormatError, match=r"found 2 files \(model_final\.pth, run_final\.pth\)"):
        HookedDecoder.from_pretrained(directory)
    (directory / "run_final.pth").unlink()
    (directory / "model_final.pth").unlink()
    (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "d_vocab"}))
    with pytest.raises(TLFormatError, match=r"config.json: a transformer-lens config needs \['d_vocab'\]"):
        HookedDecoder.from_pretrained(directory)
    (directory / "config.json").write_text(json.dumps(dict(config, act_fn="tanh")))  # one probe does not build
    torch.save({}, directory / "model_final.pth")
    with pytest.raises(TLFormatError, match="act_fn='tanh'"):
        HookedDecoder.from_pretrained(directory)


def test_the_tokenizer_is_the_directorys_or_the_one_its_config_names(tmp_path):
    from probe import HookedTransformerConfig

    config = dict(CASES["gelu-2l"], n_layers=1, d_vocab=4096)
    directory = checkpoint_dir(tmp_path, config)
    weights = HookedDecoder(HookedTransformerConfig(**{k: v for k, v in config.items() if k not in
                                                      ("normalization", "shortformer_pos")})).state_dict()
    torch.save(weights, directory / "model_final.pth")
    assert HookedDecoder.from_pretrained(directory).tokenizer is None
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    shutil.copy(Path(DEFAULT_MODEL) / "tokenizer.json", tokenizer_dir / "tokenizer.json")
    (directory / "config.json").write_text(json.dumps(dict(config, tokenizer_name=str(tokenizer_dir))))
    named = HookedDecoder.from_pretrained(directory)
    reference = HookedDecoder.from_pretrained(DEFAULT_MODEL)
    assert named.to_tokens("ROMEO. But soft").tolist() == reference.to_tokens("ROMEO. But soft").tolist()
    with torch.no_grad():
        loaded = {k: v for k, v in named.state_dict().items()}
    assert all(torch.equal(loaded[k], weights[k]) for k in weights if k in loaded)
