"""Rows of the bad-input matrix (docs/robustness.md) that cut across the analyses and the command."""
from __future__ import annotations

import pytest
import torch

from analyses import Site, ablate_heads, direct_logit_attribution, patch, logit_diff_metric
from scripts import cli


@pytest.mark.parametrize("heads", [[(0, 99)], [(-20, 0)], [(99, 0)]])
def test_ablating_a_head_that_does_not_exist(tiny_model, tokens, heads):
    with pytest.raises(ValueError, match="layer|head"):
        ablate_heads(tiny_model, tokens, heads)
    torch.testing.assert_close(tiny_model(tokens), tiny_model(tokens))  # still usable
    assert not any(tiny_model.hook_point(n).active for n in tiny_model.hook_names)


def test_patching_a_site_that_does_not_exist(tiny_model, tokens):
    metric = logit_diff_metric(tiny_model, 1, 2)
    clean, corrupted = tokens[:1], tokens[1:2]
    with pytest.raises(ValueError, match="head=99"):
        patch(tiny_model, clean, corrupted, metric, sites=[Site("z", 0, head=99)])
    with pytest.raises(ValueError, match="layer=-20"):
        patch(tiny_model, clean, corrupted, metric, sites=[Site("resid_pre", -20)])


def test_an_answer_outside_the_vocabulary(tiny_model, tokens):
    with pytest.raises(ValueError, match="10000"):
        direct_logit_attribution(tiny_model, tokens, answer=10_000)


@pytest.mark.parametrize("args,message", [
    (["ablate", "--heads", "0.99"], "head 99 is outside"),
    (["ablate", "--heads", "-20.0"], "layer -20 is outside"),
    (["ablate", "--heads", "zero"], "LAYER.HEAD"),
    (["contributions", "--answer", "100000"], "not a token id"),
])
def test_command_line_bad_heads_and_answers(tiny_dir, tmp_path, capsys, args, message):
    code = cli.main([args[0], "--model", str(tiny_dir), "--prompt", "To be, or not", "--out", str(tmp_path / "o"), *args[1:]])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
