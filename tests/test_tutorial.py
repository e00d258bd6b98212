"""docs/tutorial.ipynb runs from top to bottom (nbclient, a fresh kernel), and what it prints is true."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "docs" / "tutorial.ipynb"


def _text(cell) -> str:
    """What a code cell printed (its stream outputs)."""
    return "".join(out.get("text", "") for out in cell.get("outputs", []) if out.get("output_type") == "stream")


@pytest.mark.slow
def test_the_tutorial_runs_and_prints_what_transformers_computes():
    nbformat = pytest.importorskip("nbformat", reason="the tutorial test needs nbformat (pip install -e '.[test]')")
    nbclient = pytest.importorskip("nbclient", reason="the tutorial test needs nbclient (pip install -e '.[test]')")
    pytest.importorskip("ipykernel", reason="the tutorial test needs ipykernel (pip install -e '.[test]')")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # a cell that raises fails here, naming the cell
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not any(out.get("output_type") == "error" for out in cell.outputs) for cell in code)

    # the next token the notebook prints is the argmax of transformers' own forward on the bundled checkpoint
    from transformers import GPT2LMHeadModel

    from probe import DEFAULT_MODEL, HookedDecoder

    printed = next(_text(cell) for cell in code if "next token:" in _text(cell))
    shown = re.search(r"next token: '(.*)'", printed).group(1)
    tokenizer = HookedDecoder.from_pretrained(DEFAULT_MODEL).tokenizer
    ids = torch.tensor([tokenizer.encode("ROMEO. But soft, what light through yonder window", add_special_tokens=False)])
    ids = torch.cat([torch.tensor([[tokenizer.bos_id]]), ids], dim=1)
    with torch.no_grad():
        logits = GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL).eval()(ids).logits
    assert shown == tokenizer.token_strings([int(logits[0, -1].argmax())])[0].encode("unicode_escape").decode()

    # the attention view and the tables display as HTML, the lens figure as plotly
    shown = [out for cell in code for out in cell.outputs if out.get("output_type") in ("execute_result", "display_data")]
    kinds = [set(out.get("data", {})) for out in shown]
    assert any("text/html" in k and "application/vnd.plotly.v1+json" not in k for k in kinds)
    assert any("application/vnd.plotly.v1+json" in k for k in kinds)
    html = [out["data"]["text/html"] for out in shown if "probe-attn" in out.get("data", {}).get("text/html", "")]
    assert len(html) == 1 and "pa-data" in html[0]
