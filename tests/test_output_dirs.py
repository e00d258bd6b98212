"""A command's output directory (scripts/output.py): one run at a time, published whole, no stale files left
silently beside new ones, one plotly.js per directory, an index of the pages; flags checked before any write."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from probe.cli import cli
from probe.cli.output import LOCK, MANIFEST, PLOTLY_FILE, STAGING

ROOT = Path(__file__).resolve().parent.parent


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def visible(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def cache(tiny_dir, out, *extra):
    return ["cache", "--model", tiny_dir, "--prompt", "To be", "--names", "hook_embed", "--out", out, *extra]


def hold_lock(directory: Path) -> subprocess.Popen:
    """Another process that opens an output directory as a run does and keeps it (it waits on stdin)."""
    code = ("import sys; from pathlib import Path; from probe.cli.output import Output; "
            f"o = Output(Path({str(directory)!r}), force=True); o.write_text('half.csv', 'x'); "
            "print('held', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held", child.stderr.read()
    return child


def test_a_second_run_on_a_directory_in_use_is_refused_and_a_killed_runs_lock_is_explained(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    child = hold_lock(out)
    try:
        code, _, err = run_cli(capsys, *cache(tiny_dir, out, "--force"))
        assert code == 2 and f"--out {out} is in use by another probe run (pid {child.pid}" in err, err
        assert visible(out) == []  # the refused run wrote nothing; the holder's file is still private to it
    finally:
        child.kill()  # SIGKILL: no clean-up runs, the lock record and the staging folder stay behind
        child.wait()
    assert LOCK in hidden(out) and any(n.startswith(STAGING) for n in hidden(out))
    code, _, err = run_cli(capsys, *cache(tiny_dir, out))  # not --force: the leftovers are not results
    assert code == 0, err
    assert f"(pid {child.pid}, started" in err and "was killed before it finished" in err
    assert visible(out) == ["activations.safetensors", "index.csv", "index.json"]
    assert hidden(out) == [MANIFEST]  # no lock, no staging folder, no .part left


def test_a_failing_force_run_leaves_the_directory_as_it_was(tiny_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert run_cli(capsys, *cache(tiny_dir, out))[0] == 0
    before = {name: (out / name).read_bytes() for name in visible(out)}
    from probe.cli.output import Output

    real = Output.write_csv

    def fail_on_the_index(self, name, frame):
        if name == "index.csv":
            raise OSError(28, "No space left on device")
        return real(self, name, frame)

    monkeypatch.setattr(Output, "write_csv", fail_on_the_index)
    code, _, err = run_cli(capsys, "cache", "--model", tiny_dir, "--prompt", "something else entirely", "--names",
                           "blocks.0.hook_resid_post", "--out", out, "--force")
    assert code == 2 and "No space left on device" in err
    assert "none of the files above was kept" in err
    assert {name: (out / name).read_bytes() for name in visible(out)} == before  # not half old, half new
    assert hidden(out) == [MANIFEST]


def test_an_interrupted_run_publishes_nothing_and_removes_its_temporary_files(tiny_dir, tmp_path, capsys, monkeypatch):
    from probe.cli.output import Output

    def sigterm(self, name, frame):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Output, "write_csv", sigterm)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, *cache(tiny_dir, out))
    assert code == 143 and "terminated" in err
    assert not out.exists()  # it made the directory, wrote nothing that stays: gone again


def test_force_removes_an_earlier_runs_files_and_names_the_ones_it_keeps(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_cli(capsys, *cache(tiny_dir, out))[0] == 0
    (out / "my_notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, "anatomy", "--model", tiny_dir, "--out", out, "--force")
    assert code == 0, err
    for stale in ("activations.safetensors", "index.csv", "index.json"):
        assert not (out / stale).exists() and f"removed {out / stale}: an earlier run wrote it" in err
    assert (out / "my_notes.txt").read_text() == "mine"
    assert "kept 1 file(s)" in err and "my_notes.txt" in err
    assert set(json.loads((out / MANIFEST).read_text())["written"]) == set(visible(out)) - {"my_notes.txt"}


def test_figures_share_one_plotly_and_an_index_links_every_page(tiny_dir, tmp_path, capsys):
    out = tmp_path / "lens"
    code, _, err = run_cli(capsys, "lens", "--model", tiny_dir, "--prompt", "To be, or not", "--out", out)
    assert code == 0, err
    pages = [n for n in visible(out) if n.endswith(".html") and n != "index.html"]
    assert len(pages) >= 2 and (out / PLOTLY_FILE).stat().st_size > 1_000_000
    for page in pages:
        text = (out / page).read_text()
        assert f'src="{PLOTLY_FILE}"' in text and len(text) < 500_000  # a reference, not a 4.8 MB copy
    index = (out / "index.html").read_text()
    assert all(f'href="{page}"' in index for page in pages)


def test_plotly_inline_and_cdn_pages(tmp_path, monkeypatch):
    import plotly.graph_objects as go

    from probe.cli.output import SETTINGS, Output

    figure = go.Figure(go.Bar(x=["a", "b"], y=[1, 2]))
    for mode, check in (("inline", lambda text: len(text) > 1_000_000 and "src=\"plotly.min.js\"" not in text),
                        ("cdn", lambda text: "cdn.plot.ly" in text and len(text) < 100_000)):
        monkeypatch.setattr(SETTINGS, "plotly", mode)
        out = Output(tmp_path / mode, force=False)
        out.write_figure("a.html", figure)
        out.report()
        assert visible(tmp_path / mode) == ["a.html"] and check((tmp_path / mode / "a.html").read_text()), mode


def test_quiet_still_says_where_the_results_are(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, *cache(tiny_dir, out, "--quiet"))
    assert code == 0 and f"results in {out}" in err and "wrote" not in err


def test_report_without_out_gets_a_fresh_directory_each_run(tmp_path, monkeypatch):
    from probe.cli.common import default_out

    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(out=None)
    made = [default_out(args, "report") for _ in range(3)]  # in the same second
    assert len(set(made)) == 3 and all(p.is_dir() and p.parent == Path("probe-out") for p in made)
    assert all(p.name.startswith("report-") for p in made)
    assert default_out(args, "cache") == Path("probe-out/cache")


@pytest.mark.parametrize("argv,flag", [
    (["attention", "--prompt", "hi", "--samples", "0"], "--samples"),
    (["prune", "--step", "0"], "--step"),
    (["prune", "--save-fraction", "2"], "--save-fraction"),
    (["prune", "--save-fraction", "1"], "--save-fraction"),
    (["prune", "--max-fraction", "-0.5"], "--max-fraction"),
    (["prune", "--max-windows", "0"], "--max-windows"),
    (["cache", "--prompt", "hi", "--plotly", "embedded"], "--plotly"),
])
def test_bad_flag_values_are_usage_errors_before_anything_is_written(tmp_path, capsys, argv, flag):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        cli.main([*argv, "--out", str(out)])
    assert exited.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_the_index_page_and_a_page_sharing_plotly_render_in_chromium(tmp_path):
    import plotly.graph_objects as go

    from probe.cli.output import Output

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed")
    out = Output(tmp_path / "pages", force=False)
    for name in ("one.html", "two.html"):
        out.write_figure(name, go.Figure(go.Heatmap(z=[[1, 2], [3, 4]]), layout=dict(title=name)))
    out.report()
    for page in ("index.html", "one.html"):
        shot = tmp_path / f"{page}.png"
        subprocess.run([chromium, "--headless", "--no-sandbox", f"--screenshot={shot}", "--window-size=1000,700",
                        (tmp_path / "pages" / page).as_uri()], capture_output=True, timeout=120)
        assert shot.is_file() and shot.stat().st_size > 5_000  # something drawn (a blank page is ~3 kB)


def test_a_leftover_part_file_is_named_and_removed_with_force(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    part = out / ".activations.safetensors.k2j4.part"  # what a killed atomic write leaves; `ls` does not show it
    part.write_bytes(b"\0" * 1000)
    code, _, err = run_cli(capsys, *cache(tiny_dir, out))
    assert code == 2 and "not empty (it holds only .activations.safetensors.k2j4.part" in err and "--force removes it" in err
    code, _, err = run_cli(capsys, *cache(tiny_dir, out, "--force"))
    assert code == 0 and f"removed {part}: a temporary file an interrupted run left" in err
    assert hidden(out) == [MANIFEST]
