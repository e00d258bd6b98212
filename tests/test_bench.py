"""scripts/bench.py: the workloads, the measurements and the files it writes (no timing assertions:
these machines are shared and noisy, so only what does not depend on speed is checked)."""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"



def _load_script():
    spec = importlib.util.spec_from_file_location("bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _surface(script) -> SimpleNamespace:
    """The benchmark's public names: the runner's and those of the modules it is built from."""
    from probe.cli import bench_forward, bench_harness, bench_measure, bench_results

    modules = (bench_harness, bench_measure, bench_results, bench_forward, script)
    return SimpleNamespace(**{name: value for module in modules for name, value in vars(module).items()
                              if not name.startswith("_")})


BENCH = _surface(_load_script())  # the modules import only the standard library at module level


@pytest.fixture(scope="module")
def bench():
    return BENCH


@pytest.fixture
def one_thread():
    """Tiny shapes on a loaded 2-core machine: a second intra-op thread only waits for a core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("key", sorted(BENCH.WORKLOADS))
def test_every_workload_measures_its_cases_and_its_goal(bench, tiny_dir, one_thread, key, monkeypatch):
    """Each registered workload builds, runs once, and its floor, ratio targets and goal checks all
    name cases it really has (a renamed case would otherwise silently drop its ratio or verdict)."""
    monkeypatch.setenv("PROBE_BENCH_EAGER_ONLY", "1")  # workload 23's cases without minutes of torch.compile
    ctx = bench.Context(path=tiny_dir, batch=2, seq=8, dtype="float32", device="cpu")
    spec = bench.WORKLOADS[key]
    try:
        cases = spec.build(ctx)
    except bench.SkipWorkload as skip:  # e.g. the SAELens venv was not built: the workload says why, as in a run
        pytest.skip(f"workload {key} skips here: {skip}")
    rows = bench.measure(cases, "cpu", repeats=1, min_run_s=0.0, log=lambda msg: None)
    labels = [row["case"] for row in rows]
    assert len(set(labels)) == len(labels)
    assert spec.floor in labels
    bench.ratios(rows, spec.floor)
    for row in rows:
        assert row["ratio_to"] in labels, row["case"]
        assert (row["median_s"] is None) == (row["ratio"] is None), row["case"]
    floor = next(row for row in rows if row["case"] == spec.floor)
    assert floor["ratio"] == 1.0
    verdicts = spec.check({row["case"]: row for row in rows})
    assert verdicts and all(v["ratio"] is not None and v["met"] in (True, False) for v in verdicts)


def test_cache_bytes_match_a_count_from_the_shapes(bench, tiny_model, tokens):
    """The cache's memory, counted by hand from the config: each layer's activations, with the
    residual leaving block l and entering block l + 1 held once (it is the same tensor)."""
    cfg = tiny_model.cfg
    b, p = tokens.shape
    d, h, m, n = cfg.d_model, cfg.n_heads, cfg.d_mlp, cfg.n_layers
    per_layer = (
        5 * b * p * d  # resid_pre, attn_out, resid_mid, mlp_out, resid_post
        + 2 * (b * p + b * p * d)  # ln1 and ln2: scale, normalized
        + 4 * b * p * d  # q, k, v, z
        + 2 * b * h * p * p  # attn_scores, pattern
        + 2 * b * p * m  # mlp pre, post
    )
    # hook_embed, hook_pos_embed; ln_final scale, normalized; unembed.hook_in (the final norm's output); the logits
    # (unembed.hook_out) are the returned tensor itself, which costs the cache nothing
    outside = 2 * b * p * d + b * p + b * p * d + b * p * d
    elements = n * per_layer + outside - (n - 1) * b * p * d
    with torch.no_grad():
        held, entries = bench.cache_stats(tiny_model.run_with_cache(tokens))
    assert entries == n * 17 + 6
    assert held == 4 * elements


def test_unique_storage_bytes_counts_views_once(bench):
    a = torch.zeros(10)
    b = torch.zeros(3, dtype=torch.float64)
    assert bench.unique_storage_bytes([a, a[:5], a.view(2, 5), b, b.detach()]) == 10 * 4 + 3 * 8


def test_peak_extra_bytes_sees_an_allocation(bench):
    size = 64 * 2**20
    peak, out = bench.peak_extra_bytes(lambda: torch.ones(size // 4), "cpu")
    assert out.numel() * 4 == size
    assert size <= peak < size + 16 * 2**20


def test_ratios_divide_by_the_named_case(bench):
    rows = [
        dict(case="floor", median_s=2.0, ratio_to=None),
        dict(case="ours", median_s=3.0, ratio_to=None),
        dict(case="ours, cached", median_s=4.5, ratio_to="ours"),
        dict(case="baseline", median_s=None, ratio_to=None),
    ]
    bench.ratios(rows, "floor")
    assert [row["ratio"] for row in rows] == [1.0, 1.5, 1.5, None]
    assert [row["ratio_to"] for row in rows] == ["floor", "floor", "ours", "floor"]


def test_results_are_never_overwritten_silently(bench, tmp_path):
    target = tmp_path / "bench.json"
    target.write_text("earlier results")
    with pytest.raises(FileExistsError, match="--overwrite"):
        bench.check_out_dir(tmp_path, overwrite=False)
    with pytest.raises(FileExistsError):
        bench.write_atomic(target, "new", overwrite=False)
    assert target.read_text() == "earlier results"
    bench.write_atomic(target, "new", overwrite=True)
    assert target.read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["bench.json"]  # no temporary file left behind


def test_unknown_workload_is_named(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", str(tmp_path), "--workloads", "forwrad"])
    assert "unknown workload 'forwrad'" in capsys.readouterr().err


# One workload of each family module, each in its own process as a run does them (every workload is built and
# measured in-process by test_every_workload_measures_its_cases_and_its_goal; a process each costs ~8 s of imports)
QUICK_RUN = ("forward", "ablation", "generation", "tl_surface", "circuits_small", "load_sharded")


@pytest.mark.slow
def test_quick_run_writes_every_workload_it_is_given(bench, tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--workloads", ",".join(QUICK_RUN)],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]

    results = json.loads((out / "bench.json").read_text())
    assert results["skipped"] == []
    assert [row["workload"] for row in results["rows"]] == sorted(
        (row["workload"] for row in results["rows"]), key=QUICK_RUN.index)  # in the order asked
    assert {row["workload"] for row in results["rows"]} == set(QUICK_RUN)
    assert {goal["workload"] for goal in results["goals"]} == set(QUICK_RUN)
    assert results["failures"] == []
    assert {"torch", "transformers", "transformer-lens"} <= set(results["versions"])
    assert results["settings"]["dtype"] == "float32" and results["settings"]["batch"] == 2
    with open(out / "bench.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == bench.CSV_COLUMNS
        csv_rows = list(reader)
    assert [(r["workload"], r["case"]) for r in csv_rows] == [(r["workload"], r["case"]) for r in results["rows"]]
    assert "| goal |" in (out / "bench.md").read_text()

    before = (out / "bench.json").read_text()
    again = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "--overwrite" in again.stderr
    assert (out / "bench.json").read_text() == before


def test_cache_memory_goal_is_on_the_bytes_each_cache_holds(bench):
    """The verdict divides the bytes held by the caches; the peak rise above each library's own
    forward is only reported beside it (it depends on what the allocator reuses)."""
    mib = 2**20
    rows = {
        "probe forward": dict(peak_extra_bytes=100 * mib), "probe run_with_cache": dict(peak_extra_bytes=900 * mib, cache_bytes=300),
        "transformer-lens forward": dict(peak_extra_bytes=200 * mib),
        "transformer-lens run_with_cache": dict(peak_extra_bytes=1000 * mib, cache_bytes=800),
    }
    [verdict] = bench.extra_memory_check(rows)
    assert verdict["ratio"] == 300 / 800 and verdict["met"] is True
    assert "peak rise above the forward 800.0 MiB vs 800.0 MiB" in verdict["detail"]
    rows["probe run_with_cache"]["cache_bytes"] = 500
    rows["probe run_with_cache, bfloat16 storage"] = dict(peak_extra_bytes=400, cache_bytes=250)
    assert [(v["ratio"], v["met"]) for v in bench.extra_memory_check(rows)] == [(500 / 800, False), (250 / 800, True)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_script_refuses_cleanly_without_a_gpu_or_with_a_used_directory(tmp_path):
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
    fresh = tmp_path / "fresh"
    proc = subprocess.run(["bash", str(script), str(fresh)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr and not fresh.exists()
    used = tmp_path / "used"
    used.mkdir()
    (used / "bench.md").write_text("earlier results\n")
    proc = subprocess.run(["bash", str(script), str(used)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not empty" in proc.stderr
    assert (used / "bench.md").read_text() == "earlier results\n"


def test_cache_bytes_leave_out_the_logits_the_call_returns_anyway(bench):
    """A cache that also holds the returned logits (transformer-lens caches `hook_unembed`) costs no
    memory for them beyond the forward's own output: only the other storages are the cache's."""
    logits, other = torch.zeros(2, 3, 5), torch.zeros(7)
    cache = {"unembed.hook_out": logits, "hook_unembed": logits[:], "a": other, "b": other[:3]}
    assert bench.cache_stats((logits, cache)) == (7 * 4, 4)


def test_an_interrupted_runs_partial_results_are_not_overwritten(bench, tmp_path):
    (tmp_path / bench.PARTIAL_FILE).write_text("results of an interrupted run")
    with pytest.raises(FileExistsError, match="interrupted run.*--overwrite"):
        bench.check_out_dir(tmp_path, overwrite=False)
    bench.check_out_dir(tmp_path, overwrite=True)


def test_load_leaves_transformer_lens_out_where_it_cannot_be_imported(bench, tiny_dir, tmp_path, monkeypatch):
    """Its loader would return None at once and be timed as a 0 ms load; the other workloads find out
    at build time, so must this one."""
    monkeypatch.setitem(sys.modules, "transformer_lens", None)
    monkeypatch.setitem(sys.modules, "transformer_lens.model_bridge", None)
    result_file = tmp_path / "load.json"
    args = bench.parse_args(["--workload", "load", "--result-file", str(result_file), "--checkpoint", str(tiny_dir),
                             "--batch", "1", "--seq", "4", "--repeats", "1", "--min-run-time", "0", "--threads", "1"])
    before = torch.get_num_threads()
    try:
        bench.run_workload(args)
    finally:
        torch.set_num_threads(before)
    result = json.loads(result_file.read_text())
    assert "transformer-lens unavailable" in result["peer_missing"]
    assert {row["library"] for row in result["rows"]} == {bench.PROBE, bench.HF}


def test_trigger_scan_floor_keeps_only_the_last_positions(bench, tiny_dir, one_thread):
    """The plain forward it is compared with returns each window's last-position logits; views of them
    would keep every batch's full logits alive (peak memory growing with the corpus)."""
    ctx = bench.Context(path=tiny_dir, batch=2, seq=8, dtype="float32", device="cpu")
    floor = next(case for case in bench.WORKLOADS["trigger_scan"].build(ctx) if case.label == bench.WORKLOADS["trigger_scan"].floor)
    out = floor.run()
    vocab = ctx.vocab
    assert bench.unique_storage_bytes(out) == sum(row.shape[0] for row in out) * vocab * 4


def test_a_run_writes_its_files_and_removes_its_partial_file(bench, tmp_path):
    """The run's own partial file, written after each workload, must not count as earlier results."""
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--workloads", "load", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == sorted(bench.RESULT_FILES)
    assert {row["workload"] for row in json.loads((out / "bench.json").read_text())["rows"]} == {"load"}
