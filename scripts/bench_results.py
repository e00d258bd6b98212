"""The benchmark's results: ratios to each workload's floor, the machine and library versions, and the
markdown table, CSV and JSON files (written atomically, never over earlier results unless asked)."""
from __future__ import annotations

import csv
import importlib.metadata
import io
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from probe.cli.bench_harness import REPO, mib

RESULT_FILES = ("bench.json", "bench.csv", "bench.md")
PARTIAL_FILE = "bench.partial.json"  # the workloads finished so far, while a run is in progress
CSV_COLUMNS = (
    "number", "workload", "case", "library", "median_s", "min_s", "runs", "calls_per_run", "ratio",
    "ratio_to", "peak_extra_bytes", "cache_bytes", "cache_entries", "model", "batch", "seq", "dtype", "device", "note",
)



def ratios(rows: list[dict], floor: str) -> None:
    """Fill each row's `ratio`: its median time over its `ratio_to` case's (the workload's floor by default)."""
    by_label = {row["case"]: row for row in rows}
    for row in rows:
        row["ratio_to"] = row.get("ratio_to") or floor
        base = by_label.get(row["ratio_to"], {}).get("median_s")
        row["ratio"] = row["median_s"] / base if row["median_s"] is not None and base else None


def machine_info(device: str, threads: int = 0) -> dict:
    import torch

    info = {
        "platform": platform.platform(), "python": platform.python_version(), "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(), "torch_threads": threads or torch.get_num_threads(),
        "load_average_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    info["first_touch_ms_per_gib"] = _first_touch_ms_per_gib()
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


def _first_touch_ms_per_gib() -> dict:
    """What fresh memory costs here: filling newly mapped pages vs filling the same pages again.
    On some virtual machines the first touch is ten times dearer, which every allocation-heavy case pays."""
    import torch

    x = torch.empty(64 * 2**20 // 4)
    start = time.perf_counter()
    x.fill_(1.0)
    first = time.perf_counter() - start
    start = time.perf_counter()
    x.fill_(2.0)
    again = time.perf_counter() - start
    return {"first_touch": round(first * 16e3, 1), "already_mapped": round(again * 16e3, 1)}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def library_versions() -> dict:
    versions = {}
    for name in ("probe", "torch", "transformers", "transformer-lens", "numpy", "einops", "safetensors"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            versions["probe_commit"] = commit.stdout.strip() + ("+uncommitted changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return versions



def _seconds(s: Optional[float]) -> str:
    if s is None:
        return "(memory only)"
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def markdown(results: dict) -> str:
    settings, machine, versions = results["settings"], results["machine"], results["versions"]
    lines = [
        f"`{results['command']}`, {results['started_utc']} to {results['finished_utc']}",
        "",
        f"Machine: {machine.get('gpu') or machine['cpu']}, {machine['logical_cpus']} logical CPUs, "
        f"{machine['torch_threads']} torch threads, {machine.get('memory_gib', '?')} GiB; load average "
        f"{_load(machine['load_average_start'])} at the start, {_load(machine.get('load_average_end'))} at the end. "
        f"Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v) + ".",
        "",
        f"Model: {settings['model_desc']}; small model: {settings['small_model_desc'] or 'not used'}; {settings['dtype']} "
        f"on {settings['device']}; median of {settings['repeats']} timed runs after a warm-up"
        + (f". Note: {results['note']}" if results["note"] else "."),
        "",
        "| # | workload | case | batch x seq | median time | ratio | ratio to | peak extra memory | cache held |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        cache = "" if row["cache_bytes"] is None else f"{mib(row['cache_bytes'])} ({row['cache_entries']} entries)"
        lines.append(
            f"| {row['number']} | {row['workload']} | {row['case']} | {row['batch']} x {row['seq']} | "
            f"{_seconds(row['median_s'])} | {ratio} | {row['ratio_to']} | {mib(row['peak_extra_bytes'])} | {cache} |"
        )
    lines += ["", "| # | goal | measured | limit | met |", "|---|---|---|---|---|"]
    for goal in results["goals"]:
        measured = "n/a" if goal["ratio"] is None else f"{goal['ratio']:.2f}x"
        met = {True: "yes", False: "**no**", None: "n/a"}[goal["met"]]
        detail = f" ({goal['detail']})" if goal.get("detail") else ""
        lines.append(f"| {goal['number']} | {goal['measure']}{detail} | {measured} | {goal['limit']:.3g}x | {met} |")
    for skipped in results["skipped"]:
        lines.append(f"\nworkload {skipped['workload']} skipped: {skipped['reason']}")
    for failure in results["failures"]:
        lines.append(f"\nworkload {failure['workload']} FAILED: {failure['error'].strip().splitlines()[-1] if failure['error'].strip() else ''}")
    return "\n".join(lines) + "\n"


def _load(average) -> str:
    return "?" if not average else "/".join(f"{x:.1f}" for x in average)


def to_csv(results: dict) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for row in results["rows"]:
        writer.writerow(row)
    return buffer.getvalue()


def write_atomic(path: Path, text: str, overwrite: bool) -> None:
    """Write to a temporary sibling, then move it into place; without `overwrite` an existing file
    is never replaced (a hard link fails if the name exists, so even a race cannot clobber one)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        from probe.io import umask  # not at import time: this module imports only the standard library

        os.chmod(tmp, 0o666 & ~umask())  # mkstemp's files are private; results are ordinary files
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
            os.unlink(tmp)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def check_out_dir(out: Path, overwrite: bool, partial: bool = True) -> None:
    """Refuse (unless `overwrite`) a directory holding results; `partial=False` once this run's own
    partial file is there."""
    existing = [name for name in RESULT_FILES if (out / name).exists()]
    if partial and (out / PARTIAL_FILE).exists():  # a new run would replace it with its own first workload
        existing.append(f"{PARTIAL_FILE} (the workloads an interrupted run finished)")
    if existing and not overwrite:
        raise FileExistsError(
            f"{out} already holds {', '.join(existing)}; choose another --out directory or pass --overwrite"
        )


