"""Benchmark workload 16: training a sparse autoencoder, probe's loop against SAELens's own trainer (issue 19),
on the same activations with the same architecture, width, batch and optimiser, on the same machine.

The activations are the small model's residual stream after block 1 on random tokens, computed once and
saved as safetensors; both trainers cycle through them in the same order. SAELens 6 cannot live in
probe's environment (it needs transformer-lens < 4), so its trainer runs in its own virtualenv
(scripts/saelens_oracle.sh) as a subprocess, `scripts/saelens_train_steps.py`, which runs
`SAETrainer.fit()` one step per request. probe's `train_on_store` runs in a thread of this process, fed
the same way. One timed call is one step of each library's own loop, from handing it a batch until it asks
for the next: start-up (building the dictionary, importing SAELens) is outside every call. The steps run
on, one after the other, through warm-up and the timed runs; the memory column of the SAELens rows is
this process's, not SAELens's.
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from functools import partial
from pathlib import Path

from probe.cli.bench_harness import PROBE, REPO, Case, Context, SkipWorkload, all_of, at_most, workload

SAELENS = "sae_lens"
SAELENS_PYTHON = Path(os.environ.get("PROBE_SAELENS_VENV", "/tmp/saelens-venv")) / "bin" / "python"
HOOK = "blocks.1.hook_resid_post"
ARCHS = ("topk", "standard")
K, L1, LR, EXPANSION = 32, 5.0, 3e-4, 16


def _activations(ctx: Context, model, rows: int):
    """[rows d_model]: the residual stream after block 1 on random tokens."""
    import torch

    seq = min(model.cfg.n_ctx, 256)
    parts = []
    with torch.no_grad():
        for seed in range(-(-rows // (8 * seq))):
            _, cache = model.run_with_cache(ctx.tokens(seed=seed, batch=8, seq=seq), names=HOOK)
            parts.append(cache[HOOK].flatten(0, 1).float().cpu())
    return torch.cat(parts)[:rows].contiguous()


class Stepper:
    """probe's training loop in a thread, one step per call: the store it reads hands over a batch when
    `step()` asks and reports back when the loop asks for the next one."""

    def __init__(self, x, cfg):
        import torch

        from probe.sae_training import train_on_store

        self.x, self.batch, self.start = x, cfg.batch_tokens, 0
        self.store_device = torch.device("cpu")
        self.go, self.asked = queue.Queue(), queue.Queue()
        self.error = None

        def loop():
            try:
                train_on_store(self, cfg, x.shape[1], x.shape[1], progress=False)
            except BaseException as err:  # surfaces in step()
                self.error = err
                self.asked.put(None)

        threading.Thread(target=loop, daemon=True).start()
        self.asked.get()  # the loop asked for its first batch: start-up is done

    def next_batch(self):
        self.asked.put(None)  # start-up, or the step before, is done
        self.go.get()
        if self.start + self.batch > self.x.shape[0]:
            self.start = 0
        rows = self.x[self.start:self.start + self.batch]
        self.start += self.batch
        return (rows,)

    def step(self) -> None:
        self.go.put(None)
        self.asked.get()
        if self.error is not None:
            raise self.error

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class SAELensStepper:
    """scripts/saelens_train_steps.py in SAELens's virtualenv (one process for every dictionary), one step per call."""

    def __init__(self, settings: dict, inputs: Path):
        driver = REPO / "scripts" / "saelens_train_steps.py"
        self.process = subprocess.Popen([str(SAELENS_PYTHON), str(driver), json.dumps(settings), str(inputs)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                        env={**os.environ, "TQDM_DISABLE": "1"})  # fit()'s progress bar
        atexit.register(self.process.kill)
        self._expect("ready")

    def _expect(self, word: str) -> None:
        line = self.process.stdout.readline().strip()
        if line != word:
            raise RuntimeError(f"SAELens's trainer said {line!r} (exit code {self.process.poll()}), not {word!r}")

    def step(self, name: str) -> None:
        self.process.stdin.write(f"step {name}\n")
        self.process.stdin.flush()
        self._expect("done")


@workload("sae_training", 16, "Training an SAE: one step of probe's loop vs SAELens's trainer (same activations)",
          "tokens/s >= 1.0x SAELens's (time per step <= 1.0x), TopK and standard", floor="SAELens topk step",
          check=all_of(*(at_most(f"probe {a} step", f"SAELens {a} step", 1.0) for a in ARCHS)), model="small",
          shape="small")
def sae_training(ctx: Context) -> list[Case]:
    import torch
    from safetensors.torch import save_file

    from probe.sae_training import TrainingConfig

    if ctx.device != "cpu":
        raise SkipWorkload(f"the SAELens trainer runs on the CPU here; --device {ctx.device} is not compared")
    if not SAELENS_PYTHON.exists():
        raise SkipWorkload(f"no SAELens virtualenv at {SAELENS_PYTHON.parent.parent}: create it with "
                           "`bash scripts/saelens_oracle.sh` (or set PROBE_SAELENS_VENV)")
    model = ctx.probe_model()
    d_in = model.cfg.d_model
    batch = 4096 if d_in >= 128 else 256  # SAELens's default batch; --quick's tiny model: a small one
    x = _activations(ctx, model, 4 * batch)
    del model
    d_sae = EXPANSION * d_in
    folder = tempfile.mkdtemp(prefix="bench-sae-")
    atexit.register(shutil.rmtree, folder, True)
    inputs = Path(folder) / "x.safetensors"
    save_file({"x": x}, str(inputs))
    extra = {"topk": dict(k=K), "standard": dict(l1_coefficient=L1)}
    theirs = SAELensStepper(dict(saes={a: dict(d_sae=d_sae, **extra[a]) for a in ARCHS}, batch=batch, lr=LR,
                                 threads=torch.get_num_threads()), inputs)
    cases = []
    for arch in ARCHS:
        cfg = TrainingConfig(hook_name=HOOK, d_sae=d_sae, architecture=arch, training_tokens=batch * 10**9,
                             batch_tokens=batch, lr=LR, **extra[arch])
        ours = Stepper(x, cfg)
        note = f"d_in {d_in}, d_sae {d_sae}, batch {batch} tokens, " + ", ".join(f"{k} {v}" for k, v in extra[arch].items())
        cases += [Case(f"SAELens {arch} step", SAELENS, partial(theirs.step, arch),
                       note=note + "; SAETrainer.fit in SAELens's venv (memory: not this process's)"),
                  Case(f"probe {arch} step", PROBE, ours.step, ratio_to=f"SAELens {arch} step", note=note)]
    return cases
