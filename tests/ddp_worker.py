"""Run under `torchrun --nproc-per-node N` by tests/test_sae_training.py, never collected: every process
trains the same dictionaries on its share of each batch, interrupted after a few steps and resumed from
the checkpoint rank 0 wrote, and rank 0 writes the final dictionaries under OUT/<name>/. The test trains
the same configs in one process reading whole batches (the oracle) and compares the weights.

    torchrun --standalone --nproc-per-node 2 tests/ddp_worker.py OUT
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from probe.sae_training import TrainingConfig, train_on_store

D, STOP = 16, 3
CONFIGS = {  # topk: AuxK reads the dead mask, which every process must agree on (dead_feature_window=2)
    "topk": dict(architecture="topk", k=1, dead_feature_window=2, lr=1e-2),
    # standard: resampling draws batches from every process and resamples the same rows everywhere
    "standard": dict(architecture="standard", l1_coefficient=100.0, dead_feature_window=1, resample_every_steps=6,
                     resample_batches=2, lr=1e-1),
}


def config(name: str) -> TrainingConfig:
    return TrainingConfig(hook_name="blocks.0.hook_resid_post", d_sae=32, training_tokens=64 * 8, batch_tokens=64,
                          lr_decay_steps=3, seed=3, checkpoint_every_tokens=64 * 5, **CONFIGS[name])


class SplitStore:
    """Batch t (of the whole run) is 64 rows drawn from a generator seeded by t: sparse non-negative
    combinations of fixed directions; process r of n serves rows [r * 64/n, (r + 1) * 64/n)."""

    def __init__(self, batch_tokens: int, rank: int = 0, size: int = 1):
        self.batch_tokens, self.rank, self.size, self.t = batch_tokens, rank, size, 0
        self.directions = torch.randn(24, D, generator=torch.Generator().manual_seed(0))
        self.store_device = torch.device("cpu")

    def next_batch(self):
        gen = torch.Generator().manual_seed(1000 + self.t)
        self.t += 1
        on = torch.rand(self.batch_tokens, 24, generator=gen) < 0.15
        x = (on * torch.rand(self.batch_tokens, 24, generator=gen)) @ self.directions
        share = self.batch_tokens // self.size
        return (x[self.rank * share:(self.rank + 1) * share],)

    def state_dict(self):
        return {"t": torch.tensor([self.t])}

    def load_state_dict(self, state):
        self.t = int(state["t"][0])


def main(out: Path) -> None:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for name in CONFIGS:
        cfg = config(name)
        run = out / name
        train_on_store(SplitStore(cfg.batch_tokens, rank, size), cfg, D, D, out=run, progress=False, stop_after_steps=STOP)
        train_on_store(SplitStore(cfg.batch_tokens, rank, size), cfg, D, D, out=run, progress=False,
                       resume=run / "checkpoints" / str(STOP * cfg.batch_tokens))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
