"""Resumable checkpoints of a training run, and the final dictionary's files.

A checkpoint directory (`OUT/checkpoints/<tokens>/`) holds the inference dictionary in SAELens's format
(cfg.json, sae_weights.safetensors) plus `trainer_state.safetensors` (parameters, Adam's moments, the
dead-feature counters, the activation store's buffer, generator and position) and `trainer.json` (the
step, the config, how many processes). Under torchrun every process's store differs, so each one's state
is kept, under `store.rank<r>.`; the dictionary and Adam are the same on every process and kept once.
Written whole or not at all, by rank 0; safetensors and JSON only, no pickle.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from probe.io import atomic_directory, atomic_file
from probe.sae import SAEConfig, SparseAutoencoder
from probe.training_config import TrainingConfig
from probe.training_sae import TrainingSAE
from probe.training_world import World

STATE_FILE, TRAINER_FILE = "trainer_state.safetensors", "trainer.json"


def save_checkpoint(path: Path, cfg: TrainingConfig, sae: TrainingSAE, sae_cfg: SAEConfig, optimizer: torch.optim.Adam,
                    store, step: int, world: World = World()) -> Path:
    """A resumable checkpoint: the inference dictionary plus the trainer's whole state; whole or not at all.
    Under torchrun every process calls it (each contributes its store's state); rank 0 writes."""
    store_state = store.state_dict()
    if world.size == 1:
        state = {f"store.{k}": v for k, v in store_state.items()}
    else:  # the same keys and shapes on every process: they step together
        state = {f"store.rank{r}.{k}": part.cpu() for k, v in sorted(store_state.items())
                 for r, part in enumerate(world.gather(v))}
    if world.main:
        state.update({f"param.{n}": p.detach().cpu().contiguous() for n, p in sae.named_parameters()})
        state.update({f"buffer.{n}": b.cpu().contiguous() for n, b in sae.named_buffers()})
        names = {id(p): n for n, p in sae.named_parameters()}
        for param, moments in optimizer.state.items():
            for key, value in moments.items():
                state[f"adam.{names[id(param)]}.{key}"] = torch.as_tensor(value).cpu().contiguous()
        with atomic_directory(path, overwrite=True) as tmp:
            sae.to_inference(sae_cfg).save_pretrained(tmp / "sae")
            for name in ("cfg.json", "sae_weights.safetensors"):
                (tmp / "sae" / name).replace(tmp / name)
            (tmp / "sae").rmdir()
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / STATE_FILE))
            (tmp / TRAINER_FILE).write_text(json.dumps({"step": step, "tokens": step * cfg.batch_tokens,
                                                        "processes": world.size, "config": cfg.to_json()}, indent=2) + "\n")
    world.barrier()  # nobody reads on (or resumes) before the checkpoint is whole
    return path


def load_checkpoint(path: Path, cfg: TrainingConfig, sae: TrainingSAE, optimizer: torch.optim.Adam, store,
                    world: World = World()) -> int:
    """Restore `sae`, `optimizer` and `store` from `path`; returns the step it was written at."""
    for name in (STATE_FILE, TRAINER_FILE):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name} is missing: resume from a directory under <out>/checkpoints/")
    meta = json.loads((path / TRAINER_FILE).read_text())
    saved, now = meta["config"], json.loads(json.dumps(cfg.to_json()))
    if saved != now:
        changed = sorted(k for k in saved if saved[k] != now.get(k))
        raise ValueError(f"{path} was written with other settings ({', '.join(changed)}); resume with the same ones")
    if meta.get("processes", 1) != world.size:
        raise ValueError(f"{path} was written by {meta.get('processes', 1)} process(es) and this run has {world.size}: "
                         "resume with the same torchrun --nproc-per-node (each process continues its own shard)")
    state = load_file(str(path / STATE_FILE))
    with torch.no_grad():
        for n, p in sae.named_parameters():
            p.copy_(state[f"param.{n}"])
        for n, b in sae.named_buffers():
            b.copy_(state[f"buffer.{n}"])
    for n, p in sae.named_parameters():
        moments = {key.rsplit(".", 1)[1]: value for key, value in state.items() if key.startswith(f"adam.{n}.")}
        if moments:
            optimizer.state[p] = {k: v.to(p.device) if k != "step" else v for k, v in moments.items()}
    prefix = "store." if world.size == 1 else f"store.rank{world.rank}."
    store.load_state_dict({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})
    return int(meta["step"])


def save_final(out: Path, sae: SparseAutoencoder, cfg: TrainingConfig, history: list[dict], overwrite: bool) -> None:
    """The dictionary's files in `out` (beside its checkpoints/), each written whole; cfg.json last, so a
    directory that has one has the weights it describes."""
    staged = out / f".final-{cfg.seed}"
    sae.save_pretrained(staged, overwrite=True)
    try:
        names = ("sae_weights.safetensors", "cfg.json")
        for name in names:
            if (out / name).exists() and not overwrite:
                raise FileExistsError(f"{out / name} exists; pass overwrite=True to replace it")
        (out / "cfg.json").unlink(missing_ok=True)  # an old cfg.json must never stand beside the new weights
        for name in names:
            (staged / name).replace(out / name)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    with atomic_file(out / "training.json", overwrite=True) as tmp:
        tmp.write_text(json.dumps({"config": cfg.to_json(), "last_step": history[-1:]}, indent=2) + "\n")
