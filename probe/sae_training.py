"""Training sparse autoencoders and transcoders on a model's activations: the loop.

`train_sae(model, corpus, cfg)` streams the model's activations (`probe.activation_store`) into
`train_on_store`, which steps a `TrainingSAE` (`probe.training_sae`: the architectures and every loss term)
with Adam, the schedules of `probe.training_config`, gradient clipping, and the dead-feature counters that
AuxK and resampling read; checkpoints every `checkpoint_every_tokens` (`probe.training_checkpoints`):
`train_sae(..., resume=checkpoint)` continues bit for bit. Under `torchrun` the processes share the work
(`probe.training_world`): each reads batch_tokens / N rows of every batch from its own shard of the
corpus and the gradients are averaged, so N processes take the steps one process would take.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Union

import torch
from torch import nn

from probe.activation_store import ActivationStore
from probe.model import HookedDecoder
from probe.sae import SAEConfig, SparseAutoencoder
from probe.shapes import hook_shapes
from probe.training_checkpoints import STATE_FILE, TRAINER_FILE, load_checkpoint, save_checkpoint, save_final
from probe.training_config import TRAIN_ARCHITECTURES, TrainArchitecture, TrainingConfig, coefficient_at, lr_factor
from probe.training_sae import JumpReLU, Step, TrainingSAE, rectangle, resample_dead
from probe.training_world import World, world as current_world

__all__ = ["TrainingConfig", "TrainingSAE", "TrainingResult", "train_sae", "train_on_store", "save_checkpoint",
           "load_checkpoint", "resample_dead", "lr_factor", "coefficient_at", "JumpReLU", "Step", "rectangle",
           "TRAIN_ARCHITECTURES", "TrainArchitecture", "STATE_FILE", "TRAINER_FILE", "World"]


@dataclass
class TrainingResult:
    sae: SparseAutoencoder
    steps: int
    tokens: int
    history: list[dict]  # per step: mse, l0, dead fraction, explained variance, lr


def train_sae(model: HookedDecoder, corpus: Iterable[str], cfg: TrainingConfig, *, out: Optional[Union[str, Path]] = None,
              resume: Optional[Union[str, Path]] = None, progress: bool = True, stop_after_steps: Optional[int] = None,
              overwrite: bool = False) -> TrainingResult:
    """Train a dictionary on `model`'s activations over `corpus` (a re-iterable of texts). `out`: where the
    final dictionary is written (SAELens's format), and its checkpoints under `out/checkpoints/<tokens>`.
    `resume`: a checkpoint directory to continue from, with the same cfg. `stop_after_steps`: stop early
    (as an interruption would), after saving a checkpoint, without writing the final dictionary."""
    names = [cfg.hook_name] + ([cfg.hook_name_out] if cfg.hook_name_out else [])
    d_in, d_out = (_width(model, name) for name in (names[0], names[-1]))
    place = current_world(model.device)
    store = ActivationStore(model, corpus, names, batch_tokens=_share(cfg, place), buffer_tokens=cfg.buffer_tokens,
                            context_size=cfg.context_size, batch_prompts=cfg.batch_prompts,
                            store_device=cfg.store_device, seed=cfg.seed, shard=(place.rank, place.size))
    return train_on_store(store, cfg, d_in, d_out, model_name=model.cfg.model_name, out=out, resume=resume,
                          progress=progress, stop_after_steps=stop_after_steps, overwrite=overwrite)


def train_on_store(store, cfg: TrainingConfig, d_in: int, d_out: int, *, model_name: Optional[str] = None,
                   out: Optional[Union[str, Path]] = None, resume: Optional[Union[str, Path]] = None,
                   progress: bool = True, stop_after_steps: Optional[int] = None, overwrite: bool = False) -> TrainingResult:
    """`train_sae` on any source of batches: `store` has next_batch() -> (x,) or (x, y) [batch_tokens width]
    (under torchrun, this process's batch_tokens / N rows), state_dict() / load_state_dict() of tensors (for
    checkpoints), and store_device."""
    from tqdm.auto import tqdm

    place = current_world(store.store_device)
    share = _share(cfg, place)

    out = None if out is None else Path(out).expanduser()
    if out is not None and (out / "cfg.json").exists() and not overwrite and resume is None:
        raise FileExistsError(f"{out} already holds a dictionary; choose a new directory, pass overwrite=True, or resume "
                              f"from one of its checkpoints")
    sae = TrainingSAE(cfg, d_in, d_out, torch.Generator().manual_seed(cfg.seed)).to(store.store_device)
    optimizer = torch.optim.Adam(sae.parameters(), lr=cfg.lr, betas=cfg.adam_betas)
    step, pending = 0, None
    if resume is not None:
        step = load_checkpoint(Path(resume), cfg, sae, optimizer, store, place)
    else:
        pending = store.next_batch()
        with torch.no_grad():  # b_dec starts at the mean of what it reconstructs: the first steps fit the rest
            sae.b_dec.copy_(place.reduce(pending[-1].mean(0), "sum") / place.size)
    sae_cfg = SAEConfig(d_in=d_in, d_sae=cfg.d_sae, hook_name=cfg.hook_name,
                        architecture="jumprelu" if cfg.architecture == "batchtopk" else cfg.architecture,
                        k=cfg.k if cfg.architecture == "topk" else None, apply_b_dec_to_input=cfg.hook_name_out is None,
                        model_name=model_name, hook_name_out=cfg.hook_name_out,
                        d_out=d_out if cfg.hook_name_out else None, skip=cfg.skip)
    every = None if cfg.checkpoint_every_tokens is None else cfg.checkpoint_every_tokens // cfg.batch_tokens
    history: list[dict] = []
    bar = tqdm(total=cfg.steps * cfg.batch_tokens, initial=step * cfg.batch_tokens, unit="tok", unit_scale=True,
               disable=not (progress and place.main), desc=f"training {cfg.architecture} on {cfg.hook_name}")
    try:
        while step < cfg.steps:
            batch = pending if pending is not None else store.next_batch()
            pending = None
            x, y = batch[0], batch[-1]
            if x.shape[0] != share:
                raise ValueError(f"the store served {x.shape[0]} rows and this process's share of batch_tokens="
                                 f"{cfg.batch_tokens} is {share} ({place.size} process(es))")
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr * lr_factor(cfg, step)
            if sae.threshold is not None:
                with torch.no_grad():
                    sae.threshold.clamp_(min=0.0)  # below zero the gate would pass negative pre-activations
            terms = sae.losses(x, y, coefficient_at(cfg, step))
            optimizer.zero_grad(set_to_none=True)
            terms["loss"].backward()
            place.mean_gradients(sae.parameters())
            if cfg.max_grad_norm:
                nn.utils.clip_grad_norm_(sae.parameters(), cfg.max_grad_norm)
            optimizer.step()
            fired, smallest = sae.step_statistics(terms["features"])
            sae.after_step(place.reduce(fired.to(torch.uint8), "max").bool(), place.reduce(smallest, "min"))
            step += 1
            if cfg.resample_every_steps and step % cfg.resample_every_steps == 0 and step < cfg.steps \
                    and bool(sae.dead_mask().any()):
                drawn = [store.next_batch() for _ in range(cfg.resample_batches)]
                xs, ys = (torch.cat([t for b in drawn for t in place.gather(b[i])]) for i in (0, -1))
                revived, _ = resample_dead(sae, optimizer, xs, ys, torch.Generator().manual_seed(cfg.seed * 1_000_003 + step))
                if place.main:
                    bar.write(f"step {step}: resampled {revived.numel()} dead features")
            with torch.no_grad():
                total = (y - y.mean(0)).pow(2).sum()
                row = {"step": step, "mse": float(terms["mse"]), "l0": float((terms["features"] > 0).sum(-1).float().mean()),
                       "dead": float(sae.dead_mask().float().mean()),
                       "explained_variance": float(1 - (terms["output"] - y).pow(2).sum() / total),
                       "lr": optimizer.param_groups[0]["lr"]}
            history.append(row)
            bar.update(cfg.batch_tokens)
            bar.set_postfix(mse=f"{row['mse']:.4g}", L0=f"{row['l0']:.1f}", dead=f"{row['dead']:.1%}",
                            ev=f"{row['explained_variance']:.3f}", refresh=False)
            stopping = stop_after_steps is not None and step >= stop_after_steps and step < cfg.steps
            if out is not None and ((every and step % every == 0 and step < cfg.steps) or stopping):
                path = save_checkpoint(out / "checkpoints" / str(step * cfg.batch_tokens), cfg, sae, sae_cfg, optimizer,
                                       store, step, place)
                if place.main:
                    bar.write(f"wrote checkpoint {path}")
            if stopping:
                return TrainingResult(sae.to_inference(sae_cfg), step, step * cfg.batch_tokens, history)
    finally:
        bar.close()
    result = sae.to_inference(sae_cfg)
    if out is not None and place.main:
        save_final(out, result, cfg, history, overwrite=overwrite or resume is not None)
    place.barrier()
    return TrainingResult(result, step, step * cfg.batch_tokens, history)


def _width(model: HookedDecoder, name: str) -> int:
    shape = hook_shapes(model.cfg, 1, 1).get(name)
    if shape is None:
        model.hook_point(name)  # an unknown name fails here, with the closest valid ones
        raise ValueError(f"the width of {name!r} is unknown to probe.shapes; train on a hook point with one vector per position")
    if len(shape) != 3:
        raise ValueError(f"{name!r} holds {list(shape[2:])} per position (per head?); train on one vector per position")
    return shape[-1]


def _share(cfg: TrainingConfig, place: World) -> int:
    """This process's rows of every batch."""
    if cfg.batch_tokens % place.size:
        raise ValueError(f"batch_tokens={cfg.batch_tokens} does not split evenly over {place.size} processes; choose a "
                         f"multiple of {place.size}")
    return cfg.batch_tokens // place.size
