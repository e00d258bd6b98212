import pytest

from probe import Activation, DecoderConfig

BASE = dict(n_layers=2, d_model=64, n_heads=4, d_vocab=100, n_ctx=32)


def test_derived_sizes():
    cfg = DecoderConfig(**BASE)
    assert (cfg.d_head, cfg.d_mlp, cfg.activation) == (16, 256, Activation.GELU_TANH)


def test_frozen():
    cfg = DecoderConfig(**BASE)
    with pytest.raises(Exception):
        cfg.n_layers = 3  # type: ignore[misc]


def test_indivisible_heads_named():
    with pytest.raises(ValueError, match=r"d_model=64 .*n_heads=5"):
        DecoderConfig(**{**BASE, "n_heads": 5})


@pytest.mark.parametrize("field,value", [("n_layers", 0), ("d_model", -8), ("d_vocab", 1.5), ("n_ctx", True), ("d_mlp", 0)])
def test_bad_sizes_named(field, value):
    with pytest.raises(ValueError, match=field):
        DecoderConfig(**{**BASE, field: value})


def test_activation_from_string_and_bad_activation():
    assert DecoderConfig(**BASE, activation="relu").activation is Activation.RELU
    with pytest.raises(ValueError, match="gelu_new"):
        DecoderConfig(**BASE, activation="swish")


def test_dict_round_trip_and_unknown_fields():
    cfg = DecoderConfig(**BASE, activation=Activation.GELU, eps=1e-6)
    assert DecoderConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="n_layer"):
        DecoderConfig.from_dict({**BASE, "n_layer": 3})


@pytest.mark.parametrize("fields, match", [
    (dict(sliding_window=4, sliding_layers=(True,)), "sliding_layers=.* must give each of the n_layers=2"),
    (dict(sliding_window=4, sliding_layers=(1, 0)), "True \\(windowed\\) or False"),
    (dict(sliding_layers=(True, False)), "with sliding_window set"),
    (dict(attn_softcap=0.0), "attn_softcap must be a positive number"),
    (dict(logit_softcap=-30.0), "logit_softcap must be a positive number"),
    (dict(attn_scale_dim=True), "attn_scale_dim must be a positive number"),
    (dict(positions="rotary", rotary_scaling={"kind": "dynamic", "factor": 2.0}), "kind='dynamic' is not supported"),
    (dict(positions="rotary", rotary_scaling={"kind": "longrope", "factor": 2.0, "original_n_ctx": 4}),
     "longrope rotary scaling needs short_factor and long_factor"),
    (dict(positions="rotary", d_head=4, rotary_scaling={"kind": "longrope", "factor": 2.0, "original_n_ctx": 4,
                                                       "short_factor": [1.0], "long_factor": [2.0]}),
     "need rotary_dim // 2 = 2 entries, got 1"),
    (dict(positions="rotary", rotary_scaling={"kind": "yarn", "factor": 2.0, "original_n_ctx": 4,
                                              "short_factor": [1.0]}), "longrope's; yarn rotary scaling takes none"),
    (dict(positions="rotary", rotary_scaling={"kind": "yarn", "factor": 2.0}), "yarn rotary scaling needs original_n_ctx"),
    (dict(positions="rotary", rotary_scaling={"kind": "linear", "factor": 0}), "factor must be a positive number"),
    (dict(positions="rotary", rotary_scaling={"kind": "llama3", "factor": 8.0, "original_n_ctx": 16,
                                              "low_freq_factor": 4.0, "high_freq_factor": 1.0}), "low_freq_factor < high"),
    (dict(positions="rotary", rotary_scaling="llama3"), "rotary_scaling must be a RotaryScaling"),
])
def test_the_newer_fields_are_validated(fields, match):
    with pytest.raises(ValueError, match=match):
        DecoderConfig(n_layers=2, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, **fields)


def test_every_config_choice_is_exported_from_probe():
    """Each frozen choice a DecoderConfig field takes (StateSpace, OutputGate, Rwkv, ...) is importable from probe, as the
    README's config table names them."""
    import dataclasses
    import typing

    import probe

    hints = typing.get_type_hints(DecoderConfig)
    choices = {arg for field in dataclasses.fields(DecoderConfig)
               for arg in typing.get_args(hints[field.name]) or (hints[field.name],) if dataclasses.is_dataclass(arg)}
    assert len(choices) >= 16
    assert sorted(c.__name__ for c in choices if getattr(probe, c.__name__, None) is not c
                  or c.__name__ not in probe.__all__) == []
