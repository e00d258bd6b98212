#!/usr/bin/env python
"""Benchmark probe against plain `transformers` (the speed floor) and transformer-lens (issue 10).

    python scripts/bench.py --out runs/bench                    # GPT-2-small shape, float32, CPU, batch 4 x 128
    python scripts/bench.py --quick --out /tmp/bench-ci          # tiny shapes, 1 repeat: only checks it runs
    python scripts/bench.py --device cuda --dtype bfloat16 --batch 16 --seq 1024 --out runs/bench-gpu

Every workload runs in a fresh process of this same script (`--workload NAME`), so one workload's
allocations never inflate another's peak memory. Inside that process each case (one way of doing
the work) is warmed up once, then timed round-robin with the other cases, so a slow spell of a
shared machine hits every case alike; the median is reported. Peak memory is measured afterwards,
one extra call per case, from a clean baseline: on CPU the rise of the process's peak resident set
(VmHWM, reset through /proc/self/clear_refs) above its resident set just before the call, on CUDA
`max_memory_allocated` above `memory_allocated`.

Weights are random (a `transformers` GPT2LMHeadModel saved to a temporary directory) and inputs
are random token ids: no network, no tokenizer. The small-model workloads (4, 5, 7, 8) use the bundled
model (`probe.DEFAULT_MODEL`) when it exists, else a random GPT-2 of its shape; the logit lens (6)
runs one sequence (batch 1), since it holds [layer pos vocab] logits.

Adding a workload: write `def my_workload(ctx: Context) -> list[Case]` in a workload-family module
(`scripts/bench_*.py`), register it with `@workload(...)` from scripts/bench_harness.py, and list the
module in WORKLOAD_MODULES below; the runner, table and files pick it up.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence


from probe.cli.bench_harness import (
    DTYPES, LAUNCH_SHAPE, SHAPES, SMALL_FALLBACK, TL, WORKLOADS, Context, SkipWorkload, Workload)
from probe.cli.bench_measure import measure
from probe.cli.bench_results import (
    PARTIAL_FILE, RESULT_FILES, check_out_dir, library_versions, machine_info, markdown, ratios, to_csv, write_atomic)

# The workload families; each registers its workloads with @workload on import.
WORKLOAD_MODULES = (
    "probe.cli.bench_forward",
    "probe.cli.bench_analyses",
    "probe.cli.bench_generation",
    "probe.cli.bench_tl",
    "probe.cli.bench_circuits",
    "probe.cli.bench_graph",
    "probe.cli.bench_sae",
    "probe.cli.bench_loading",
)
for _module in WORKLOAD_MODULES:
    importlib.import_module(_module)


def run_workload(args: argparse.Namespace) -> None:
    """The child process: one workload, rows written as JSON to --result-file."""
    import torch

    spec = WORKLOADS[args.workload]
    ctx = Context(path=Path(args.checkpoint), batch=args.batch, seq=args.seq, dtype=args.dtype, device=args.device)
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"[{spec.key}] building cases")
    try:
        cases = spec.build(ctx)
    except SkipWorkload as skip:
        result = dict(rows=[], skipped=str(skip))
    else:
        if ctx.peer_missing:
            cases = [case for case in cases if case.library != TL]
            log(f"[{spec.key}] {ctx.peer_missing}: its cases are left out")
        result = dict(rows=measure(cases, args.device, args.repeats, args.min_run_time, log=log), skipped=None,
                      peer_missing=ctx.peer_missing)
    write_atomic(Path(args.result_file), json.dumps(result, indent=1), overwrite=True)


# ---- the parent: checkpoints, one process per workload, tables and files -------------------------
def build_checkpoint(directory: Path, seed: int = 0, **config) -> Path:
    """A random-weight transformers GPT-2 saved to `directory` (no tokenizer: the benchmark feeds ids)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    special = config["vocab_size"] - 1
    model = GPT2LMHeadModel(GPT2Config(bos_token_id=special, eos_token_id=special, **config))
    model.save_pretrained(directory)
    return directory


def small_model_path(tmp: Path, quick: bool) -> tuple[Path, str]:
    from probe import DEFAULT_MODEL

    bundled = Path(DEFAULT_MODEL)
    if (bundled / "config.json").is_file() and (bundled / "model.safetensors").is_file():
        return bundled, f"bundled model ({bundled.name})"
    shape = SHAPES["tiny"] if quick else SMALL_FALLBACK
    path = build_checkpoint(tmp / "small", seed=1, **shape)
    return path, f"random GPT-2 {shape['n_layer']} layers, d_model {shape['n_embd']} (the bundled model was not found)"



def _workload_shape(spec: Workload, args: argparse.Namespace, path: Path) -> tuple[int, int]:
    """(batch, seq) a workload runs at; seq is clipped to its model's context."""
    batch, seq = {"main": (args.batch, args.seq), "small": (args.small_batch, args.small_seq), "single": (1, args.seq),
                  "launch": LAUNCH_SHAPE}[spec.shape]
    return batch, min(seq, json.loads((path / "config.json").read_text())["n_positions"])


def run_all(args: argparse.Namespace, argv: Sequence[str]) -> dict:
    keys = args.workloads
    results = {
        "command": "python scripts/bench.py " + " ".join(argv),
        "started_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(args.device, args.threads), "versions": library_versions(),
        "settings": dict(shape=args.shape, model=SHAPES[args.shape], batch=args.batch, seq=args.seq,
                         small_batch=args.small_batch, small_seq=args.small_seq, dtype=args.dtype,
                         device=args.device, repeats=args.repeats, min_run_time_s=args.min_run_time, quick=args.quick,
                         threads=args.threads or None),
        "note": args.note, "rows": [], "goals": [], "skipped": [], "failures": [],
    }
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory(prefix="probe-bench-") as tmp_name:
        tmp = Path(tmp_name)
        if args.checkpoint:
            checkpoint, model_desc = Path(args.checkpoint), f"checkpoint {args.checkpoint}"
        else:
            print(f"building a random GPT-2 ({args.shape} shape) in {tmp}", file=sys.stderr)
            checkpoint = build_checkpoint(tmp / "main", **SHAPES[args.shape])
            model_desc = f"random GPT-2 {args.shape} shape"
        small = small_desc = None
        if any(WORKLOADS[k].model == "small" for k in keys):
            small, small_desc = small_model_path(tmp, args.quick)
        results["settings"].update(model_desc=model_desc, small_model_desc=small_desc)
        for key in keys:
            spec = WORKLOADS[key]
            path, desc = (small, small_desc) if spec.model == "small" else (checkpoint, model_desc)
            batch, seq = _workload_shape(spec, args, path)
            result_file = tmp / f"{key}.json"
            command = [
                sys.executable, str(Path(__file__).resolve()), "--workload", key, "--result-file", str(result_file),
                "--checkpoint", str(path), "--batch", str(batch), "--seq", str(seq), "--dtype", args.dtype,
                "--device", args.device, "--repeats", str(args.repeats), "--min-run-time", str(args.min_run_time),
                "--threads", str(args.threads),
            ]
            print(f"workload {spec.number} ({key}) ...", file=sys.stderr, flush=True)
            start = time.perf_counter()
            try:
                proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.workload_timeout)
                error = None if proc.returncode == 0 else proc.stderr[-4000:]
            except subprocess.TimeoutExpired:
                proc, error = None, f"timed out after {args.workload_timeout} s"
            if args.verbose and proc is not None:
                sys.stderr.write(proc.stderr)
            print(f"  ... {time.perf_counter() - start:.0f} s" + (" FAILED" if error else ""), file=sys.stderr, flush=True)
            if error:
                results["failures"].append(dict(workload=key, error=error))
                continue
            result = json.loads(result_file.read_text())
            if result["skipped"]:
                results["skipped"].append(dict(workload=key, reason=result["skipped"]))
                continue
            if result.get("peer_missing"):
                results["skipped"].append(dict(workload=key, reason=result["peer_missing"] + ": its cases are left out"))
            rows = result["rows"]
            ratios(rows, spec.floor)
            for row in rows:
                row.update(number=spec.number, workload=key, dtype=args.dtype, device=args.device, model=desc,
                           batch=batch, seq=seq)
            results["rows"] += rows
            if spec.check:
                by_label = {row["case"]: row for row in rows}
                for verdict in spec.check(by_label):
                    results["goals"].append(dict(number=spec.number, workload=key, goal=spec.goal, **verdict))
            # what is done so far survives an interrupted run, under a name that says it is partial
            write_atomic(args.out / PARTIAL_FILE, json.dumps(results, indent=1), overwrite=True)
    results["machine"]["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    results["finished_utc"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return results


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="directory for bench.json, bench.csv and bench.md")
    parser.add_argument("--overwrite", action="store_true", help="replace result files already in --out")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 1 repeat: checks that every workload runs (CI)")
    parser.add_argument("--workloads", default="all", help=f"comma-separated names or numbers, or 'all': {', '.join(WORKLOADS)}")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="model shape (default small; tiny with --quick)")
    parser.add_argument("--checkpoint", help="benchmark this GPT-2 checkpoint directory instead of a random one")
    parser.add_argument("--batch", type=int, default=None, help="default 4 (2 with --quick)")
    parser.add_argument("--seq", type=int, default=None, help="default 128 (16 with --quick)")
    parser.add_argument("--small-batch", type=int, default=1)
    parser.add_argument("--small-seq", type=int, default=32)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per case (default 5; 1 with --quick)")
    parser.add_argument("--min-run-time", type=float, default=None,
                        help="seconds one timed run should last; short calls are looped (default 0.2; 0 with --quick)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads in each workload process (default: torch's choice; 1 with --quick)")
    parser.add_argument("--workload-timeout", type=float, default=1800, help="seconds before a workload process is killed")
    parser.add_argument("--note", default="", help="free text saved with the results (e.g. what else loaded the machine)")
    parser.add_argument("--verbose", action="store_true", help="show each workload process's log")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)  # internal: the child process
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    defaults = dict(shape="tiny", batch=2, seq=16, repeats=1, min_run_time=0.0, threads=1) if args.quick else \
        dict(shape="small", batch=4, seq=128, repeats=5, min_run_time=0.2, threads=0)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.workload:
        return args
    if args.out is None:
        parser.error("--out DIRECTORY is required (where bench.json, bench.csv and bench.md go)")
    for name in ("batch", "seq", "small_batch", "small_seq", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    n_ctx = SHAPES[args.shape]["n_positions"]
    if args.seq > n_ctx and not args.checkpoint:
        parser.error(f"--seq {args.seq} exceeds the {args.shape} shape's context of {n_ctx} positions")
    args.workloads = _select_workloads(parser, args.workloads)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--device {args.device}: this torch build sees no CUDA device; use --device cpu")
    return args


def _select_workloads(parser: argparse.ArgumentParser, spec: str) -> list[str]:
    if spec == "all":
        return sorted(WORKLOADS, key=lambda key: WORKLOADS[key].number)
    by_number = {str(w.number): key for key, w in WORKLOADS.items()}
    keys = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        key = by_number.get(item, item)
        if key not in WORKLOADS:
            parser.error(f"unknown workload {item!r}; choose from {', '.join(f'{w.number}={k}' for k, w in WORKLOADS.items())}")
        keys.append(key)
    return keys


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.workload:
        run_workload(args)
        return 0
    try:
        check_out_dir(args.out, args.overwrite)  # before minutes of work, not after
    except FileExistsError as err:
        print(f"bench.py: error: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_all(args, argv)
    table = markdown(results)
    print(table)
    try:
        check_out_dir(args.out, args.overwrite, partial=False)  # something may have written there meanwhile
    except FileExistsError as err:
        write_atomic(args.out / PARTIAL_FILE, json.dumps(results, indent=1), overwrite=True)
        print(f"bench.py: error: {err}; this run's results are in {args.out / PARTIAL_FILE}", file=sys.stderr)
        return 2
    for name, text in (("bench.json", json.dumps(results, indent=1)), ("bench.csv", to_csv(results)), ("bench.md", table)):
        write_atomic(args.out / name, text, overwrite=args.overwrite)
    (args.out / PARTIAL_FILE).unlink(missing_ok=True)
    print(f"wrote {', '.join(str(args.out / n) for n in RESULT_FILES)}", file=sys.stderr)
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
