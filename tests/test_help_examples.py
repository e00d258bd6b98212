"""Every example command line in every `probe <command> --help` runs, on the bundled model.

The examples are read from the help text itself (the lines of its `examples:` block that start with
`probe `, backslash continuations joined, `# comments` dropped), so an example edited into a
command's docstring is tested too. They run in a scratch directory holding the stand-in files the
examples name (a user's own prompts and corpora: prompts.txt, plays/, ...), in order, so that an
example may read what an earlier one of the same command wrote. Each gets `--out` in the scratch
directory when it names none, and the per-command size flags below (tiny sizes: the same code
paths in a fraction of the time); what each example claims about the bundled model (its prompts
tokenise to equal lengths, its answers are one token, its layers and heads exist) is what runs.
"""
from __future__ import annotations

import shlex

import pytest

from probe.cli import cli

# appended after the example's own flags (argparse keeps the last value): fewer steps, samples, windows
TINY_SIZES = {
    "report": ["--skip", "memories", "importance"],
    "lens": ["--tuned-steps", "2", "--tuned-tokens", "256"],
    "attention": ["--samples", "2"],
    "prune": ["--max-windows", "1", "--step", "0.5", "--max-fraction", "0.5"],
    "steer": ["--heldout-windows", "1", "--max-new-tokens", "3"],
    "circuit": ["--ig-steps", "2", "--random", "1"],
    "train_sae": ["--tokens", "4k", "--batch-tokens", "512", "--buffer-tokens", "2k"],
    "graph": ["--max-features", "32"],
}


def help_text(command: str) -> str:
    """What `probe <command> --help` prints."""
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.suppress(SystemExit):
        cli.main([command, "--help"])
    return printed.getvalue()


def examples(text: str) -> list[list[str]]:
    """The example command lines of a help text, each as argv after `probe`."""
    lines, block, found = [], None, False
    for raw in text.splitlines():
        if raw.strip() == "examples:":
            found = True
            continue
        if not found:
            continue
        if not raw.strip():
            if block is None:
                break  # the examples block ends at its first blank line
            continue
        stripped = raw.strip()
        if block is not None:  # a continuation of the line before
            block += " " + stripped
        elif stripped.startswith("probe "):
            block = stripped
        else:
            break
        if block.endswith("\\"):
            block = block[:-1]
            continue
        lines.append(shlex.split(block, comments=True)[1:])
        block = None
    return lines


def test_examples_are_read_from_the_help_text():
    text = "usage: ...\n\nexamples:\n  probe x --a 1   # a comment\n  probe x --b \"two words\" \\\n      --c 3\n\nmore text\n"
    assert examples(text) == [["x", "--a", "1"], ["x", "--b", "two words", "--c", "3"]]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A working directory with the files the examples name: stand-ins for a user's own."""
    from probe import HELDOUT_TEXT

    root = tmp_path_factory.mktemp("examples")
    lines = [line for line in HELDOUT_TEXT.read_text(encoding="utf-8").splitlines() if len(line.split()) >= 8]
    (root / "prompts.txt").write_text("\n".join(lines[:4]) + "\n", encoding="utf-8")
    (root / "more_prompts.txt").write_text("\n".join(lines[4:12]) + "\n", encoding="utf-8")
    (root / "corpus.txt").write_text("\n".join(lines[:60]) + "\n", encoding="utf-8")
    (root / "plays").mkdir()
    for i in range(2):
        (root / "plays" / f"act{i}.txt").write_text("\n".join(lines[30 * i:30 * i + 30]) + "\n", encoding="utf-8")
    romeo = ["ROMEO. I love thee, my sweet Juliet", "ROMEO. O Juliet, thou art my sun", "ROMEO. Good night, Juliet"]
    juliet = [line.replace("Juliet", "Romeo").replace("ROMEO", "JULIET") for line in romeo]
    (root / "romeo.txt").write_text("\n".join(romeo) + "\n", encoding="utf-8")
    (root / "juliet.txt").write_text("\n".join(juliet) + "\n", encoding="utf-8")
    return root


CASES = [(command, i, argv) for command in cli.COMMANDS for i, argv in enumerate(examples(help_text(command)))]


def test_every_command_has_examples_that_name_it():
    for command in cli.COMMANDS:
        found = examples(help_text(command))
        assert found, f"probe {command} --help shows no example command line"
        assert all(argv[0] == command for argv in found), (command, found)


# every example runs in every suite: with the tiny sizes below, all of them take about 25 s on two cores (the
# training and scanning commands' 13 about 10 s of it)
@pytest.mark.slow
@pytest.mark.parametrize("command, index, argv", CASES, ids=[f"{c}-{i}" for c, i, _ in CASES])
def test_help_example_runs(command, index, argv, scratch, monkeypatch, capsys):
    run_example(command, index, argv, scratch, monkeypatch, capsys)


def run_example(command, index, argv, scratch, monkeypatch, capsys):
    monkeypatch.chdir(scratch)
    argv = list(argv)
    if "--out" not in argv and "--show" not in argv:
        argv += ["--out", str(scratch / "out" / f"{command}-{index}")]
    code = cli.main(argv + TINY_SIZES.get(command, []) + ["--quiet"])
    err = capsys.readouterr().err
    assert code == 0, f"probe {shlex.join(argv)} failed: {err}"


@pytest.mark.parametrize("command, index, argv", CASES, ids=[f"{c}-{i}" for c, i, _ in CASES])
def test_help_example_parses(command, index, argv, monkeypatch, capsys):
    """What the suite can afford for every example: its command line parses, flag by flag, with the command's
    own parser (a renamed or mistyped flag, a value of the wrong type or range, fails here); running them all is
    `test_help_example_runs` above."""
    import sys

    parsed = []

    def parse_only(run, parser, argv):
        parsed.append(parser.parse_args(argv))
        return 0

    for name, module in list(sys.modules.items()):
        if (name == "probe.cli" or name.startswith("probe.cli.")) and hasattr(module, "run_command"):
            monkeypatch.setattr(module, "run_command", parse_only)
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:  # argparse's usage error
        pytest.fail(f"probe {shlex.join(argv)} does not parse: {capsys.readouterr().err.strip()} (exit {exit_.code})")
    assert code == 0 and len(parsed) == 1, f"probe {shlex.join(argv)}: {capsys.readouterr().err}"
