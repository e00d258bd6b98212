"""The migration guide's example runs as written (its comments state shapes, checked here too)."""
from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "from_transformer_lens.md"


def test_the_transformer_lens_guide_example_runs_and_its_shapes_hold():
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) == 1
    scope: dict = {}
    exec(compile(blocks[0], str(GUIDE), "exec"), scope)
    model, cache, tokens = scope["model"], scope["cache"], scope["tokens"]
    grad = cache["blocks.2.hook_resid_pre_grad"]
    assert grad.shape == (1, tokens.shape[1], model.cfg.d_model) and bool(grad.abs().sum() > 0)
    assert model.W_Q.shape == (model.cfg.n_layers, model.cfg.n_heads, model.cfg.d_model, model.cfg.d_head)
    assert not scope["processed"].cfg.tied_embeddings and model.cfg.tied_embeddings
