"""The processes a dictionary trains on: one, or several under `torchrun` (data parallel).

Under `torchrun --nproc-per-node N` (WORLD_SIZE, RANK and the rendezvous in the environment) the first
call of `world()` joins the process group: gloo on the CPU, nccl on CUDA. Every process holds the same
dictionary (the same seed makes the same initialisation), reads its own share of the batch from a disjoint
shard of the corpus, and averages its gradient with the others' before clipping and Adam's step, so every
process takes the same step: that of one process reading the whole batch, up to float rounding. Only
rank 0 writes files.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    device: Optional[torch.device] = None  # where a collective's tensors must be (nccl: the GPU)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def _to(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.device is None else tensor.to(self.device)

    def mean_gradients(self, parameters) -> None:
        """Every gradient replaced by its mean over the processes, in one all-reduce."""
        if self.size == 1:
            return
        grads = [p.grad for p in parameters if p.grad is not None]
        flat = self._to(torch.cat([g.flatten() for g in grads]))
        dist.all_reduce(flat)
        flat /= self.size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """The tensor reduced over the processes ("sum", "max", "min"), on its own device."""
        if self.size == 1:
            return tensor
        moved = self._to(tensor.clone())
        dist.all_reduce(moved, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return moved.to(tensor.device)

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every process's tensor (the same shape on each), in rank order, on the tensor's device."""
        if self.size == 1:
            return [tensor]
        moved = self._to(tensor.contiguous())
        parts = [torch.empty_like(moved) for _ in range(self.size)]
        dist.all_gather(parts, moved)
        return [p.to(tensor.device) for p in parts]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def world(device: torch.device) -> World:
    """This process's place: one process alone, or a rank of the group torchrun started (joined on first call)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_available() or (size == 1 and not dist.is_initialized()):
        return World()
    if not dist.is_initialized():
        if device.type == "cuda":  # one GPU per process: scripts/train_sae.py puts rank r on cuda:LOCAL_RANK
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    backend = dist.get_backend()
    return World(dist.get_rank(), dist.get_world_size(), torch.device("cuda", torch.cuda.current_device())
                 if backend == "nccl" else None)
