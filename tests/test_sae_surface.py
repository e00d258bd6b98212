"""SAELens 6's SAE surface on probe.SparseAutoencoder (probe/sae.py, probe/sae_config.py): loading with SAELens's
keywords, the config and metadata fields SAELens code and SAELens's own tools read, a hook_z SAE's per-head `decode`,
`save_model`, the error `fold_W_dec_norm` raises on TopK. The oracle: SAELens itself (tests/saelens_oracle.py
`sae_surface` writes the SAE directories with SAELens and runs tests/sae_surface_idioms.py with SAELens's class)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from probe import SparseAutoencoder
from sae_surface_idioms import sae_surface_idioms
from test_sae_training import needs_saelens, oracle

Z = torch.randn(2, 5, 4, 8, generator=torch.Generator().manual_seed(1))  # [batch pos head d_head]


@needs_saelens
def test_saelens_sae_surface_agrees_with_saelens(tmp_path):
    save_file({"z": Z}, str(tmp_path / "in.safetensors"))
    (tmp_path / "work").mkdir()
    printed = oracle("sae_surface", tmp_path / "work", tmp_path / "in.safetensors", tmp_path / "theirs.safetensors")
    their_values, theirs = json.loads(printed.splitlines()[-1]), load_file(str(tmp_path / "theirs.safetensors"))
    directories = {"z": tmp_path / "work" / "z", "topk": tmp_path / "work" / "topk"}
    tensors, values = sae_surface_idioms(SparseAutoencoder, directories, Z, tmp_path / "ours")
    assert json.loads(json.dumps(values)) == their_values
    assert sorted(tensors) == sorted(theirs)
    for name, expected in theirs.items():
        assert tensors[name].shape == expected.shape, name
        torch.testing.assert_close(tensors[name], expected, atol=1e-5, rtol=1e-5, msg=name)
    assert tensors["recons"].shape == Z.shape and float(tensors["features"].gt(0).float().mean()) > 0.1


def test_saelens_loading_keywords_refuse_what_probe_cannot_read(tmp_path):
    from probe.sae import SAEConfig

    directory = SparseAutoencoder(SAEConfig(d_in=4, d_sae=8, hook_name="blocks.0.hook_resid_pre")).save_pretrained(tmp_path / "s")
    with pytest.raises(ValueError, match="dtype='float33' names no torch dtype"):
        SparseAutoencoder.load_from_disk(directory, dtype="float33")
    with pytest.raises(TypeError, match="converter= is SAELens's hook"):
        SparseAutoencoder.load_from_disk(directory, converter=object())
    with pytest.raises(FileExistsError, match="already exists"):  # save_model never overwrites a directory
        SparseAutoencoder.load_from_disk(directory).save_model(directory)
    with pytest.raises(ValueError, match="only for SAEs on attention's hook_z|hook_z reshaping is for SAEs"):
        SparseAutoencoder.load_from_disk(directory).turn_on_forward_pass_hook_z_reshaping()


@needs_saelens
def test_saelens_activation_store_and_evals_read_probes_sae_as_saelenss(tmp_path):
    """SAELens's ActivationsStore.from_sae and run_evals read an SAE's metadata (prepend_bos, context_size, hook_name):
    given probe's SparseAutoencoder they do what they do given SAELens's SAE loaded from the same file."""
    from probe import DEFAULT_MODEL, HookedDecoder
    from probe.sae import SAEConfig

    d_model = HookedDecoder.from_pretrained(DEFAULT_MODEL).cfg.d_model
    cfg = SAEConfig(d_in=d_model, d_sae=4 * d_model, hook_name="blocks.1.hook_resid_post", model_name="tiny-shakespeare",
                    file_metadata=(("prepend_bos", True), ("context_size", 16), ("hook_layer", 1)))
    sae = SparseAutoencoder(cfg)
    with torch.no_grad():
        for param in sae.parameters():
            param.copy_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(3)))
    sae.save_pretrained(tmp_path / "sae")
    printed = oracle("saelens_tools", DEFAULT_MODEL, tmp_path / "sae", tmp_path / "out.safetensors")
    runs, activations = json.loads(printed.splitlines()[-1]), load_file(str(tmp_path / "out.safetensors"))
    assert runs["SparseAutoencoder"]["tokens"] == runs["SAE"]["tokens"]
    torch.testing.assert_close(activations["SparseAutoencoder/activations"], activations["SAE/activations"])
    ours, theirs = runs["SparseAutoencoder"]["metrics"], runs["SAE"]["metrics"]
    assert sorted(ours) == sorted(theirs) and len(theirs) > 5
    for name, value in theirs.items():
        assert ours[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
