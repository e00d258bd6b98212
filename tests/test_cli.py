"""The `probe` command: outputs written safely, errors as one line with a non-zero exit."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from scripts import cli


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cache_writes_activations_that_match_the_model(tiny_dir, tiny_model, tmp_path, capsys):
    out = tmp_path / "cache"
    code, _, err = run_cli(capsys, "cache", "--model", str(tiny_dir), "--prompt", "To be, or not",
                           "--names", "blocks.*.hook_resid_post", "--names", "hook_embed", "--out", str(out))
    assert code == 0, err
    saved = load_file(str(out / "activations.safetensors"))
    assert set(saved) == {"blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "hook_embed", "attention_mask"}
    _, cache = tiny_model.run_with_cache("To be, or not", names=["blocks.1.hook_resid_post"])
    torch.testing.assert_close(saved["blocks.1.hook_resid_post"], cache["blocks.1.hook_resid_post"])
    index = json.loads((out / "index.json").read_text())
    assert {row["name"] for row in index} == set(saved)
    assert f"wrote {out / 'activations.safetensors'}" in err

    code, shown, _ = run_cli(capsys, "cache", "--show", str(out / "activations.safetensors"))
    assert code == 0 and "blocks.1.hook_resid_post" in shown and "4 tensors" in shown


def test_cache_refuses_a_non_empty_output_directory(tiny_dir, tmp_path, capsys):
    out = tmp_path / "results"
    out.mkdir()
    (out / "activations.safetensors").write_text("my earlier results")
    code, _, err = run_cli(capsys, "cache", "--model", str(tiny_dir), "--prompt", "hi", "--out", str(out))
    assert code == 2 and "not empty" in err and "--force" in err
    assert (out / "activations.safetensors").read_text() == "my earlier results"
    code, _, err = run_cli(capsys, "cache", "--model", str(tiny_dir), "--prompt", "hi", "--out", str(out), "--force")
    assert code == 0, err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--names", "blocks.*.hook_resid_psot"], "matches no hook point"),
        (["--model", "/no/such/dir"], "cannot load --model"),
        (["--prompt", "word " * 100], "n_ctx=48"),
        (["--device", "cuda:7"], "CUDA is not available"),
    ],
)
def test_cache_errors_are_one_line(tiny_dir, tmp_path, capsys, args, message):
    base = ["cache", "--model", str(tiny_dir), "--prompt", "hello", "--out", str(tmp_path / "o")]
    code, _, err = run_cli(capsys, *base, *args)
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "o" / "activations.safetensors").exists()


def test_output_that_is_a_file_or_unwritable(tiny_dir, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, _, err = run_cli(capsys, "cache", "--model", str(tiny_dir), "--prompt", "hi", "--out", str(afile))
    assert code == 2 and "is a file" in err
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, _, err = run_cli(capsys, "cache", "--model", str(tiny_dir), "--prompt", "hi", "--out", str(locked / "sub"))
        import os

        if os.geteuid() != 0:  # root writes anywhere; the check is still exercised for other users
            assert code == 2 and "cannot be written" in err
    finally:
        locked.chmod(0o700)


def test_prompts_file_errors(tiny_dir, tmp_path, capsys):
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    code, _, err = run_cli(capsys, "cache", "--model", str(tiny_dir), "--prompts-file", str(binary), "--out", str(tmp_path / "o"))
    assert code == 2 and "not UTF-8" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    code, _, err = run_cli(capsys, "cache", "--model", str(tiny_dir), "--prompts-file", str(empty), "--out", str(tmp_path / "o"))
    assert code == 2 and "no prompts" in err


def test_anatomy_ledger_matches_the_model(tiny_dir, tiny_model, tmp_path, capsys):
    import pandas as pd

    code, printed, err = run_cli(capsys, "anatomy", "--model", str(tiny_dir), "--out", str(tmp_path / "a"))
    assert code == 0, err
    ledger = pd.read_csv(tmp_path / "a" / "ledger.csv")
    assert ledger["params"].sum() == sum(p.numel() for p in tiny_model.parameters())
    assert "blocks.0.attn.hook_pattern" in printed
    assert "blocks.0.attn.hook_pattern" in (tmp_path / "a" / "anatomy.html").read_text()


def test_unknown_command_and_help(capsys):
    code, _, err = run_cli(capsys, "cahce")
    assert code == 2 and "did you mean 'cache'" in err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["cache", "--help"])
    assert exit_info.value.code == 0 and "example" in capsys.readouterr().out


def test_script_runs_standalone(tiny_dir, tmp_path):
    result = subprocess.run([sys.executable, "scripts/anatomy.py", "--model", str(tiny_dir), "--out", str(tmp_path / "s"), "--quiet"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "s" / "ledger.csv").is_file() and result.stderr == ""


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_has_help_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "example" in out and "--model" in out and "--out" in out


def test_report_on_a_checkpoint_writes_every_section_and_true_numbers(tiny_dir, tiny_model, tmp_path, capsys, monkeypatch):
    import pandas as pd

    heldout = tmp_path / "heldout.txt"
    heldout.write_text("To be, or not to be, that is the question. " * 40)
    monkeypatch.setattr("probe.HELDOUT_TEXT", heldout)
    monkeypatch.setattr("probe.bundled.HELDOUT_TEXT", heldout)
    import analyses.pruning

    monkeypatch.setattr(analyses.pruning, "HELDOUT_TEXT", heldout, raising=False)
    prompt = "To be, or not to be <script>x</script>"
    corrupted = "To be, or not to be <script>y</script>"
    out = tmp_path / "report"
    code, _, err = run_cli(capsys, "report", "--model", str(tiny_dir), "--prompt", prompt, "--corrupted", corrupted, "--out", str(out))
    assert code == 0, err
    page = (out / "report.html").read_text()
    for anchor in ("model", "prompt", "lens", "attribution", "attention", "detectors", "ablation", "patching", "memories", "importance"):
        assert f'id="{anchor}"' in page, anchor
    assert "<script>x</script>" not in page and "&lt;script&gt;x&lt;/script&gt;" in page
    with torch.no_grad():
        probs = tiny_model(prompt)[0, -1].softmax(-1)
    prediction = pd.read_csv(out / "prediction.csv")
    assert prediction["id"][0] == int(probs.argmax())
    assert abs(prediction["probability"][0] - float(probs.max())) < 1e-5


def test_memories_with_a_missing_corpus(tiny_dir, tmp_path, capsys):
    code, _, err = run_cli(capsys, "memories", "--model", str(tiny_dir), "--corpus", str(tmp_path / "nope"), "--out", str(tmp_path / "m"))
    assert code == 2 and "does not exist" in err


def test_bad_flag_is_a_usage_error(tiny_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["lens", "--model", str(tiny_dir), "--prompt", "x", "--no-such-flag"])
    assert exit_info.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
