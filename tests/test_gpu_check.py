"""scripts/gpu_check.sh, the GPU suite, checked on the CPU (GPU_CHECK_DEVICE=cpu): a GPU session has
minutes, so the script must not be debugged there."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def gpu_check(out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(out)], env={**os.environ, "GPU_CHECK_DEVICE": "cpu", **env},
                          capture_output=True, text=True, timeout=600)


def stages(out: Path) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in (out / "stages.txt").read_text().splitlines())


@pytest.mark.slow
def test_every_stage_runs_and_reports(tmp_path):
    out = tmp_path / "gpu"
    proc = gpu_check(out, TESTS_K="tiny", F32_WORKLOADS="forward", BF16_WORKLOADS="cache_all", MEDIUM_WORKLOADS="3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert stages(out) == dict.fromkeys(["tests", "float32", "bfloat16", "medium"], "finished")
    assert "4 passed" in (out / "tests.log").read_text()
    for directory, dtype, workload in [("float32", "float32", "forward"), ("bfloat16", "bfloat16", "cache_all"),
                                       ("medium-bfloat16", "bfloat16", "cache_resid")]:
        results = json.loads((out / directory / "bench.json").read_text())
        assert results["settings"]["dtype"] == dtype
        assert {row["workload"] for row in results["rows"]} == {workload}
        assert not results["failures"]


def test_refuses_a_directory_that_holds_results(tmp_path):
    (tmp_path / "stages.txt").write_text("earlier\n")
    proc = gpu_check(tmp_path)
    assert proc.returncode == 2
    assert "not empty" in proc.stderr
    assert (tmp_path / "stages.txt").read_text() == "earlier\n"


@pytest.mark.parametrize("env, message", [
    (dict(STAGES="tests float64"), "unknown stage 'float64'"),
    (dict(GPU_CHECK_DEVICE="tpu"), "GPU_CHECK_DEVICE=tpu"),
])
def test_bad_settings_are_refused_before_anything_runs(tmp_path, env, message):
    proc = gpu_check(tmp_path / "gpu", **env)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not (tmp_path / "gpu").exists()


def test_stages_past_the_time_budget_do_not_start_and_the_run_fails(tmp_path):
    proc = gpu_check(tmp_path / "gpu", TOTAL_S="0")
    assert proc.returncode == 1
    assert set(stages(tmp_path / "gpu").values()) == {"not started: under 30 s of TOTAL_S left"}
    assert not (tmp_path / "gpu" / "float32").exists()


def test_a_failing_stage_fails_the_run(tmp_path):
    # a test selection that matches nothing is pytest's exit 5: a failure, not a pass
    proc = gpu_check(tmp_path / "gpu", STAGES="tests", TESTS_K="no_such_test")
    assert proc.returncode == 1
    assert stages(tmp_path / "gpu") == {"tests": "failed (exit 5)"}
