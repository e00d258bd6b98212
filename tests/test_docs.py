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


ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def test_every_python_block_of_the_docs_parses_and_imports_only_what_probe_has():
    """What the suite can afford for every snippet (many name a user's own prompts, files or a hub model): it is
    valid Python, and every name it imports from probe exists, so a renamed function cannot leave a stale snippet."""
    import ast
    import importlib

    checked = 0
    for path in DOCUMENTS:
        for i, block in enumerate(python_blocks(path)):
            tree = ast.parse(block, filename=f"{path.name} block {i}")
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "probe":
                    module = importlib.import_module(node.module)
                    for alias in node.names:
                        assert hasattr(module, alias.name), f"{path.name} block {i}: {node.module} has no {alias.name}"
                        checked += 1
    assert checked > 50  # the blocks were found and read


def test_the_readme_quickstart_and_gradient_blocks_run_as_written():
    """The README's first two blocks need nothing but the bundled model; run in order, as a reader would."""
    import torch

    blocks = python_blocks(ROOT / "README.md")
    scope: dict = {}
    for block in blocks[:2]:
        exec(compile(block, "README.md", "exec"), scope)
    model, cache = scope["model"], scope["cache"]
    n_pos = scope["logits"].shape[1]
    assert cache["blocks.1.attn.hook_pattern"].shape == (1, model.cfg.n_heads, n_pos, n_pos)
    assert cache["blocks.2.hook_resid_pre_grad"].shape == (1, n_pos, model.cfg.d_model)
    assert not torch.equal(scope["ablated"], scope["logits"])  # zeroing a head changed the output
