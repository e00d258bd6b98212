"""transformer-lens code that tests what it was given against HookedTransformerConfig, written once: the oracle
(tests/saelens_oracle.py `config_class`, transformer-lens 3.9's classes) and tests/test_tl_config_fields.py (probe's)
each run `config_class_idioms` on a model built from the same config."""
from __future__ import annotations


def graph_source(given, model_class, config_class) -> str:
    """EAP-IG's Graph.from_model dispatch: a model, a config, or a dict of the sizes it needs."""
    if isinstance(given, model_class):
        return "model"
    if isinstance(given, config_class):
        return "config"
    return "dict" if isinstance(given, dict) else "refused"


def config_class_idioms(model, model_class, config_class) -> dict:
    cfg = model.cfg
    sizes = {"n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "d_model": cfg.d_model}
    rebuilt = config_class.from_dict(cfg.to_dict())
    return {
        "is_config": [isinstance(cfg, config_class), isinstance(model, config_class), isinstance(sizes, config_class),
                      issubclass(type(cfg), config_class)],
        "graph_sources": [graph_source(given, model_class, config_class) for given in (model, cfg, sizes, 3)],
        "from_dict": [isinstance(rebuilt, config_class), rebuilt.n_layers, rebuilt.d_head, rebuilt.d_vocab],
        "unwrap": [config_class.unwrap(cfg) is cfg, isinstance(config_class.unwrap(cfg.to_dict()), config_class)],
        "layer_norm_activation": [cfg.is_layer_norm_activation(), config_class(
            n_layers=1, d_model=8, d_head=4, n_ctx=4, d_vocab=10, act_fn="solu_ln").is_layer_norm_activation()],
        "seeded": seeded(cfg),
    }


def seeded(cfg) -> list:
    import random

    import numpy
    import torch

    cfg.set_seed_everywhere(3)
    return [torch.rand(2).tolist(), random.random(), float(numpy.random.rand())]
