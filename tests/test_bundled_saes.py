"""The dictionaries shipped for the bundled model (probe/data/saes, docs/sae_training.md), each against the issue's
bars on the bundled held-out text (plays the model and the dictionaries never trained on)."""
from __future__ import annotations

import pytest

from probe.analyses import sae_eval
from probe import HELDOUT_TEXT, SparseAutoencoder
from probe.sae import BUNDLED_SAES


def test_the_bundled_residual_sae_meets_its_bars(bundled_model):
    sae = SparseAutoencoder.from_pretrained(BUNDLED_SAES / "resid-post-1")
    got = sae_eval(bundled_model, sae, HELDOUT_TEXT, max_tokens=8192)
    assert got.l0 == 32  # TopK: exactly k everywhere
    assert got.explained_variance >= 0.8 and got.ce_loss_recovered >= 0.9 and got.dead_fraction < 0.05, got.to_dict()


@pytest.mark.parametrize("layer", range(4))
def test_each_bundled_transcoder_explains_its_mlp_output(bundled_model, layer):
    sae = SparseAutoencoder.from_pretrained(BUNDLED_SAES / f"transcoder-{layer}")
    assert (sae.cfg.hook_name, sae.cfg.hook_name_out) == (f"blocks.{layer}.ln2.hook_normalized", f"blocks.{layer}.hook_mlp_out")
    got = sae_eval(bundled_model, sae, HELDOUT_TEXT, max_tokens=4096)
    assert got.explained_variance >= 0.7, got.to_dict()
    assert got.ce_loss_recovered > 0.8, got.to_dict()
