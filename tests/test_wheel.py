"""The distribution (issue 23): a wheel built from the source puts one top-level name in site-packages,
`probe`, with the repository's hooks/, analyses/ and scripts/ inside it as probe.hooks, probe.analyses and
probe.cli; installed on its own, the short names do not import and the `probe` command points inside."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ("probe", "hooks", "analyses", "scripts", "pyproject.toml", "README.md")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the source, so the checkout gets no build/ folder."""
    tree, out = tmp_path_factory.mktemp("tree"), tmp_path_factory.mktemp("wheel")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCE:
        source = ROOT / name
        (shutil.copytree(source, tree / name, ignore=ignore) if source.is_dir() else shutil.copy(source, tree / name))
    # without build isolation: offline, with the setuptools the test extra installs (pyproject.toml)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "--no-build-isolation",
                            "-w", str(out), "-q"], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (found,) = out.glob("probe-*.whl")
    return found


def test_the_wheel_has_one_top_level_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"probe"}, top
    for module in ("probe/hooks/hook_point.py", "probe/analyses/__init__.py", "probe/cli/cli.py",
                   "probe/data/tiny-shakespeare/config.json"):
        assert module in names, module
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "probe = probe.cli.cli:main" in entry_points


def test_installed_alone_only_the_probe_names_import(wheel, tmp_path):
    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q",
                                "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-2000:]
    code = ("import importlib.util, probe.hooks, probe.analyses, probe.cli.cli\n"
            "from pathlib import Path\n"
            f"site = Path({str(target)!r})\n"
            "for module in (probe.hooks, probe.analyses, probe.cli.cli):\n"
            "    assert site in Path(module.__file__).parents, module.__file__\n"
            "for short in ('hooks', 'analyses', 'scripts'):\n"
            "    spec = importlib.util.find_spec(short)\n"
            "    assert spec is None or site not in Path(spec.origin or '').parents, (short, spec)\n"
            "from probe.analyses import logit_lens\n"
            "from probe.hooks import HookPoint\n"
            "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(target)}
    ran = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stderr[-2000:]
