"""probe.act_name: short kinds to hook names, the names the model really has and transformer-lens spells."""
from __future__ import annotations

import pytest

from probe import act_name

BLOCK_KINDS = ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "q", "k", "v", "attn_scores", "pattern",
               "attn", "z", "result", "pre", "mlp_pre", "post", "mlp_post"]


def test_every_kind_names_a_hook_point_of_the_model(tiny_model):
    names = set(tiny_model.hook_names)
    for layer in range(tiny_model.cfg.n_layers):
        for kind in BLOCK_KINDS:
            assert act_name(kind, layer) in names, kind
        for norm in ("ln1", "ln2"):
            assert act_name("scale", layer, norm) in names and act_name("normalized", layer, norm) in names
    assert {act_name("embed"), act_name("pos_embed"), act_name("scale"), act_name("normalized")} <= names


def test_rotary_and_gated_kinds_exist_where_the_model_has_them(tmp_path):
    from probe import HookedDecoder
    from test_variants import build

    build("llama", tmp_path)
    names = set(HookedDecoder.from_pretrained(tmp_path).hook_names)
    assert {act_name("rot_q", 1), act_name("rot_k", 1), act_name("pre_linear", 1)} <= names


def test_names_agree_with_transformer_lens():
    utilities = pytest.importorskip("transformer_lens.utilities")
    for kind in BLOCK_KINDS + ["rot_q", "rot_k", "pre_linear"]:
        assert act_name(kind, 3) == utilities.get_act_name(kind, 3), kind
    assert act_name("scale", 3, "ln1") == utilities.get_act_name("scale", 3, "ln1")
    assert act_name("normalized", 2, "ln2") == utilities.get_act_name("normalized", 2, "ln2")
    assert act_name("scale") == utilities.get_act_name("scale")


@pytest.mark.parametrize("args, message", [
    (("resid_pre",), "give its layer"),
    (("embed", 2), "not inside a block"),
    (("scale", 2), "norm='ln1' or 'ln2'"),
    (("pattern", 1, "ln1"), "only applies to"),
    (("resid_prev", 1), "unknown activation kind 'resid_prev'"),
    (("z", -1), "non-negative int"),
    (("z", True), "non-negative int"),
])
def test_mistakes_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        act_name(*args)


def test_transformer_lens_aliases_and_integer_like_layers():
    import numpy as np
    import torch

    utilities = pytest.importorskip("transformer_lens.utilities")
    for kind in ("attn_logits", "query", "key", "value"):
        assert act_name(kind, 2) == utilities.get_act_name(kind, 2), kind
    # a layer from argmax: numpy or 0-d tensor, named as the int it stands for
    assert act_name("z", np.int64(3)) == act_name("z", torch.tensor(3)) == "blocks.3.attn.hook_z"
    for bad in (1.0, torch.tensor(1.5), torch.tensor([1, 2])):
        with pytest.raises(ValueError, match="non-negative int"):
            act_name("z", bad)


def test_the_names_of_newer_hook_points_exist_where_the_model_has_them():
    """act_name builds names; the models with sandwich blocks and per-head q/k norms have exactly these points."""
    from probe import DecoderConfig, HookedDecoder

    sandwich = HookedDecoder(DecoderConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=11, n_ctx=8, norm="rms",
                                           norm_placement="sandwich", positions="rotary", qk_norm=True))
    for name in (act_name("scale", 0, "ln1_post"), act_name("normalized", 0, "ln2_post"), act_name("q_normed", 0),
                 act_name("k_normed", 0)):
        assert name in sandwich.hook_names, name
    plain = HookedDecoder(DecoderConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=11, n_ctx=8))
    assert act_name("q_normed", 0) not in plain.hook_names and act_name("scale", 0, "ln1_post") not in plain.hook_names
