"""Benchmark workload 17: loading a sharded checkpoint, and what loading holds in host memory beyond the model.

The checkpoint is the run's own (random GPT-2 of --shape) saved again in shards of about a tenth of it. Three
memory baselines are measured beside the loads: reading the largest shard whole, and allocating the model's own
bytes. The goal (issue 21): what probe's loading holds beyond the model it returns is at most 1.2x the largest
shard (a tensor at a time is read, converted and put in place; nothing is held twice)."""
from __future__ import annotations

import atexit
import math
import shutil
import tempfile
from pathlib import Path

from probe.cli.bench_harness import HF, PROBE, Case, Context, workload

MODEL_BYTES, SHARD, PROBE_LOAD = "model's own bytes, allocated", "largest shard, read whole", "probe from_pretrained, sharded"


def _transient_check(rows: dict[str, dict]) -> list[dict]:
    peak = {label: rows.get(label, {}).get("peak_extra_bytes") for label in (MODEL_BYTES, SHARD, PROBE_LOAD)}
    ratio = None
    if None not in peak.values() and peak[SHARD]:
        ratio = max(0, peak[PROBE_LOAD] - peak[MODEL_BYTES]) / peak[SHARD]
    return [dict(measure=f"memory: ({PROBE_LOAD} - {MODEL_BYTES}) / {SHARD}", ratio=ratio, limit=1.2,
                 met=None if ratio is None else ratio <= 1.2,
                 detail=", ".join(f"{k} {'n/a' if v is None else f'{v / 2**20:.0f} MiB'}" for k, v in peak.items()))]


@workload("load_sharded", 17, "Loading a sharded checkpoint: time, and host memory held beyond the model",
          "probe's peak above its model <= 1.2x the largest shard", floor="transformers from_pretrained, sharded",
          check=_transient_check)
def load_sharded(ctx: Context) -> list[Case]:
    import torch
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(ctx.path)
    n_params = sum(p.numel() for p in hf.parameters())
    n_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    sharded = Path(tempfile.mkdtemp(prefix="probe-bench-shards-"))
    atexit.register(shutil.rmtree, sharded, True)  # the workload runs in a process of its own
    hf.save_pretrained(sharded, max_shard_size=max(1, math.ceil(n_bytes / 10)))
    del hf
    shards = sorted(sharded.glob("model-*.safetensors")) or [sharded / "model.safetensors"]
    largest = max(shards, key=lambda p: p.stat().st_size)
    sharded_ctx = Context(path=sharded, batch=ctx.batch, seq=ctx.seq, dtype=ctx.dtype, device=ctx.device)
    return [
        Case("transformers from_pretrained, sharded", HF, sharded_ctx.hf_model,
             note=f"{len(shards)} shards, the largest {largest.stat().st_size / 2**20:.0f} MiB"),
        Case(PROBE_LOAD, PROBE, sharded_ctx.probe_model),
        Case(SHARD, PROBE, lambda: {k: v.clone() for k, v in load_file(str(largest)).items()}, timed=False,
             note="memory baseline: the largest shard's tensors in memory (load_file maps the file; clone reads it)"),
        Case(MODEL_BYTES, PROBE, lambda: torch.ones(n_params, dtype=ctx.torch_dtype), timed=False,
             note=f"memory baseline: what the loaded model itself occupies ({ctx.dtype})"),
    ]
