"""Training sparse autoencoders and transcoders on a model's activations, SAELens's recipes written out.

Each step reads a batch from an `ActivationStore` (x; for a transcoder also y, the activation to predict,
else y = x) and minimises, as SAELens 6 does,

    mse = sum_d (y_hat - y)^2, mean over the batch
    standard:  + c * sum_f f_f ||W_dec[f]||, mean over the batch          (L1 with SAELens's decoder-norm scaling)
    topk:      + aux * min(n_dead / k_aux, 1) * sum_d (e_hat - e)^2, mean  (AuxK: e = y - y_hat detached,
               e_hat the k_aux = d_in // 2 most active dead features decoded without b_dec)
    batchtopk: the same, with the k * batch largest activations of the whole batch kept
    jumprelu:  + c * sum_f step(pre_f - threshold_f), mean over the batch  (L0; straight-through gradient)

TopK and BatchTopK train with SAELens's `rescale_acts_by_decoder_norm`: pre-activations times ||W_dec[f]||,
decoding by activations over ||W_dec[f]||, so the choice of the top k does not depend on how long a decoder
row happens to be; the norms are folded into W_enc, b_enc and W_dec when saved. A BatchTopK dictionary is
saved as JumpReLU (SAELens's choice): one threshold for every feature, the running mean of the smallest
activation a batch kept. JumpReLU's gradient reaches the threshold through a rectangle kernel of width
`jumprelu_bandwidth`: d step(pre - t)/dt = -rect((pre - t) / bw) / bw, and d jumprelu/dt = -t/bw rect(...).

A feature is dead once it has not fired for `dead_feature_window` steps; AuxK reads that mask. The
learning rate warms up linearly over `lr_warm_up_steps`, decays linearly to zero over the last
`lr_decay_steps`; the L1/L0 coefficient warms up linearly over `coefficient_warm_up_steps`. Checkpoints
(every `checkpoint_every_tokens`) hold the inference dictionary in SAELens's format plus
`trainer_state.safetensors` and `trainer.json` (parameters, Adam's moments, the store's buffer and position,
the dead-feature counters): `train_sae(..., resume=checkpoint)` continues bit for bit.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal, Optional, Union

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from probe.activation_store import ActivationStore
from probe.io import atomic_directory, atomic_file
from probe.shapes import hook_shapes
from probe.model import HookedDecoder
from probe.sae import SAEConfig, SparseAutoencoder

TrainArchitecture = Literal["standard", "topk", "batchtopk", "jumprelu"]
TRAIN_ARCHITECTURES = ("standard", "topk", "batchtopk", "jumprelu")
STATE_FILE, TRAINER_FILE = "trainer_state.safetensors", "trainer.json"


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    hook_name: str  # what it reads, e.g. "blocks.1.hook_resid_post"; a transcoder: "blocks.1.ln2.hook_normalized"
    d_sae: int
    training_tokens: int
    architecture: TrainArchitecture = "topk"
    k: Optional[int] = None  # topk: features on per token; batchtopk: on average
    hook_name_out: Optional[str] = None  # a transcoder: what it predicts, e.g. "blocks.1.hook_mlp_out"
    skip: bool = False  # a skip-transcoder
    l1_coefficient: float = 1.0  # standard
    l0_coefficient: float = 1.0  # jumprelu
    coefficient_warm_up_steps: int = 0
    aux_coefficient: float = 1.0  # AuxK, topk and batchtopk (SAELens's aux_loss_coefficient)
    jumprelu_bandwidth: float = 0.05
    jumprelu_init_threshold: float = 0.01
    topk_threshold_lr: float = 0.01  # batchtopk: the threshold's moving-average rate
    decoder_init_norm: float = 0.1  # decoder rows start at this norm; W_enc starts as W_dec^T
    dead_feature_window: int = 1000  # steps without firing that make a feature dead
    lr: float = 3e-4
    adam_betas: tuple[float, float] = (0.9, 0.999)
    lr_warm_up_steps: int = 0
    lr_decay_steps: int = 0
    max_grad_norm: float = 1.0
    batch_tokens: int = 4096
    buffer_tokens: int = 65536
    context_size: Optional[int] = None  # tokens per window (default: the model's n_ctx)
    batch_prompts: int = 16  # windows per forward of the model
    store_device: Optional[str] = None  # where the buffer lives (default: the model's device)
    checkpoint_every_tokens: Optional[int] = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in TRAIN_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not trainable; choose one of {', '.join(TRAIN_ARCHITECTURES)}")
        topk = self.architecture in ("topk", "batchtopk")
        if topk and not (isinstance(self.k, int) and 0 < self.k <= self.d_sae):
            raise ValueError(f"architecture={self.architecture!r} needs k, an int in [1, d_sae={self.d_sae}], got {self.k!r}")
        if not topk and self.k is not None:
            raise ValueError(f"k={self.k!r} applies only to topk and batchtopk; {self.architecture} sets sparsity by its coefficient")
        for name in ("d_sae", "training_tokens", "batch_tokens", "dead_feature_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.training_tokens < self.batch_tokens:
            raise ValueError(f"training_tokens={self.training_tokens} is less than one batch of {self.batch_tokens}")
        if self.skip and self.hook_name_out is None:
            raise ValueError("skip=True makes a skip-transcoder: give hook_name_out, the activation it predicts")
        if self.checkpoint_every_tokens is not None and self.checkpoint_every_tokens < self.batch_tokens:
            raise ValueError(f"checkpoint_every_tokens={self.checkpoint_every_tokens} is less than one batch of {self.batch_tokens}")
        if not self.lr > 0 or self.lr_warm_up_steps + self.lr_decay_steps > self.steps:
            raise ValueError(f"lr={self.lr} must be > 0 and lr_warm_up_steps + lr_decay_steps ({self.lr_warm_up_steps} + "
                             f"{self.lr_decay_steps}) at most the {self.steps} steps")

    @property
    def steps(self) -> int:
        return self.training_tokens // self.batch_tokens

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class TrainingSAE(nn.Module):
    """The parameters in training form and the loss of one batch (see the module docstring)."""

    def __init__(self, cfg: TrainingConfig, d_in: int, d_out: int, generator: torch.Generator):
        super().__init__()
        self.cfg = cfg
        W_dec = torch.empty(cfg.d_sae, d_out)
        bound = math.sqrt(6 / d_out)  # kaiming-uniform, as SAELens, before the rows are set to decoder_init_norm
        W_dec.uniform_(-bound, bound, generator=generator)
        W_dec *= cfg.decoder_init_norm / W_dec.norm(dim=1, keepdim=True)
        self.W_dec = nn.Parameter(W_dec)
        # a transcoder's input and output widths may differ; its encoder starts random at the same scale
        W_enc = W_dec.T.contiguous() if d_in == d_out else \
            torch.empty(d_in, cfg.d_sae).uniform_(-bound, bound, generator=generator) * cfg.decoder_init_norm
        self.W_enc = nn.Parameter(W_enc)
        self.b_enc = nn.Parameter(torch.zeros(cfg.d_sae))
        self.b_dec = nn.Parameter(torch.zeros(d_out))
        self.threshold = nn.Parameter(torch.full((cfg.d_sae,), cfg.jumprelu_init_threshold)) \
            if cfg.architecture == "jumprelu" else None
        self.W_skip = nn.Parameter(torch.zeros(d_out, d_in)) if cfg.skip else None
        self.register_buffer("topk_threshold", torch.zeros((), dtype=torch.float64))  # batchtopk
        self.register_buffer("steps_since_fired", torch.zeros(cfg.d_sae, dtype=torch.long))

    @property
    def transcoder(self) -> bool:
        return self.cfg.hook_name_out is not None

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, pre-activations) [batch d_sae]; a topk pre-activation is already times ||W_dec[f]||."""
        features, pre, _ = self._encode(x)
        return features, pre

    def _encode(self, x: torch.Tensor):
        """(features, pre, (indices, values) of a topk's active features or None)."""
        arch = self.cfg.architecture
        pre = (x if self.transcoder else x - self.b_dec) @ self.W_enc + self.b_enc
        if arch in ("topk", "batchtopk"):
            pre = pre * self.W_dec.norm(dim=1)
        if arch == "topk":
            top = pre.topk(self.cfg.k, dim=-1, sorted=False)
            values = top.values.relu()
            return torch.zeros_like(pre).scatter(-1, top.indices, values), pre, (top.indices, values)
        if arch == "batchtopk":
            acts = pre.relu().flatten()
            top = acts.topk(self.cfg.k * pre.shape[0], sorted=False)
            return torch.zeros_like(acts).scatter(-1, top.indices, top.values).view_as(pre), pre, None
        if arch == "jumprelu":
            return JumpReLU.apply(pre, self.threshold, self.cfg.jumprelu_bandwidth), pre, None
        return pre.relu(), pre, None

    def decode(self, features: torch.Tensor, bias: bool = True) -> torch.Tensor:
        if self.cfg.architecture in ("topk", "batchtopk"):
            features = features / self.W_dec.norm(dim=1)
        return features @ self.W_dec + (self.b_dec if bias else 0)

    def decode_sparse(self, indices: torch.Tensor, values: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """decode() of features nonzero only at `indices` [batch k]: k rows of W_dec per token instead of all
        d_sae (the same sum; on the CPU the dense decoder was most of a TopK step)."""
        # embedding, not W_dec[indices]: indexing's backward accumulates repeated rows in a thread-dependent
        # order on the CPU, and a resumed run would then differ from an uninterrupted one in the last bits
        rows = torch.nn.functional.embedding(indices, self.W_dec)  # [batch k d_out]
        scaled = values / rows.norm(dim=-1)
        return torch.einsum("bk,bkd->bd", scaled, rows) + (self.b_dec if bias else 0)

    def losses(self, x: torch.Tensor, y: torch.Tensor, coefficient: float) -> dict[str, torch.Tensor]:
        """Every loss term of one batch (x read, y predicted), "loss" their sum, and the features and output."""
        features, pre, top = self._encode(x)
        decoded = self.decode(features) if top is None else self.decode_sparse(*top)
        y_hat = decoded + (0 if self.W_skip is None else x @ self.W_skip.T)
        out = {"mse": (y_hat - y).pow(2).sum(-1).mean(), "features": features, "output": y_hat}
        arch = self.cfg.architecture
        if arch == "standard":
            out["l1"] = coefficient * (features * self.W_dec.norm(dim=1)).sum(-1).mean()
        elif arch == "jumprelu":
            out["l0"] = coefficient * Step.apply(pre, self.threshold, self.cfg.jumprelu_bandwidth).sum(-1).mean()
        else:
            out["auxk"] = self.auxk_loss(y - y_hat.detach(), pre)
        out["loss"] = sum(v for name, v in out.items() if name not in ("features", "output"))
        return out

    def auxk_loss(self, residual: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        dead = self.dead_mask()
        n_dead = int(dead.sum())
        if n_dead == 0:
            return pre.new_zeros(())
        k_aux = self.W_enc.shape[0] // 2  # d_in // 2: Gao et al. appendix B.1, as SAELens (sae_in.shape[-1])
        scale = min(n_dead / k_aux, 1.0)
        top = torch.where(dead, pre, -torch.inf).topk(min(k_aux, n_dead), dim=-1, sorted=False)
        decoded = self.decode_sparse(top.indices, top.values, bias=False)
        return self.cfg.aux_coefficient * scale * (decoded - residual).pow(2).sum(-1).mean()

    def dead_mask(self) -> torch.Tensor:
        return self.steps_since_fired > self.cfg.dead_feature_window

    @torch.no_grad()
    def after_step(self, features: torch.Tensor) -> None:
        """Book-keeping after a forward: which features fired, the batchtopk threshold."""
        fired = (features > 0).any(0)
        self.steps_since_fired += 1
        self.steps_since_fired[fired] = 0
        if self.cfg.architecture == "batchtopk":
            positive = features[features > 0]
            if positive.numel():
                lr = self.cfg.topk_threshold_lr
                self.topk_threshold.copy_((1 - lr) * self.topk_threshold + lr * positive.min().double())

    @torch.no_grad()
    def to_inference(self, sae_cfg: SAEConfig) -> SparseAutoencoder:
        """The dictionary in inference form: decoder norms folded in, BatchTopK as JumpReLU."""
        W_enc, b_enc, W_dec = self.W_enc.clone(), self.b_enc.clone(), self.W_dec.clone()
        if self.cfg.architecture in ("topk", "batchtopk"):
            norm = W_dec.norm(dim=1)
            W_enc, b_enc, W_dec = W_enc * norm, b_enc * norm, W_dec / norm[:, None]
        sae = SparseAutoencoder(sae_cfg)
        state = {"W_enc": W_enc, "b_enc": b_enc, "W_dec": W_dec, "b_dec": self.b_dec}
        if self.cfg.architecture == "jumprelu":
            state["threshold"] = self.threshold.clamp(min=0)
        if self.cfg.architecture == "batchtopk":
            state["threshold"] = torch.full_like(b_enc, float(self.topk_threshold))
        if self.W_skip is not None:
            state["W_skip"] = self.W_skip
        sae.load_state_dict({name: t.detach().float() for name, t in state.items()})
        return sae


def rectangle(x: torch.Tensor) -> torch.Tensor:
    return ((x > -0.5) & (x < 0.5)).to(x)


class Step(torch.autograd.Function):
    """step(pre - threshold): the threshold's gradient through the rectangle kernel, none to pre (DeepMind's)."""

    @staticmethod
    def forward(ctx, pre: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return (pre > threshold).to(pre)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pre, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        return None, (-(1.0 / bw) * rectangle((pre - threshold) / bw) * grad).sum(0), None


class JumpReLU(torch.autograd.Function):
    """pre * step(pre - threshold): the exact gradient to pre, the kernel's to the threshold."""

    @staticmethod
    def forward(ctx, pre: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return pre * (pre > threshold)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pre, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        to_threshold = (-(threshold / bw) * rectangle((pre - threshold) / bw) * grad).sum(0)
        return (pre > threshold) * grad, to_threshold, None


def lr_factor(cfg: TrainingConfig, step: int) -> float:
    warm = min(1.0, (step + 1) / cfg.lr_warm_up_steps) if cfg.lr_warm_up_steps else 1.0
    left = cfg.steps - step
    decay = min(1.0, left / cfg.lr_decay_steps) if cfg.lr_decay_steps else 1.0
    return warm * decay


def coefficient_at(cfg: TrainingConfig, step: int) -> float:
    value = cfg.l1_coefficient if cfg.architecture == "standard" else cfg.l0_coefficient
    return value * min(1.0, (step + 1) / cfg.coefficient_warm_up_steps) if cfg.coefficient_warm_up_steps else value


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
    store = ActivationStore(model, corpus, names, batch_tokens=cfg.batch_tokens, buffer_tokens=cfg.buffer_tokens,
                            context_size=cfg.context_size, batch_prompts=cfg.batch_prompts,
                            store_device=cfg.store_device, seed=cfg.seed)
    return train_on_store(store, cfg, d_in, d_out, model_name=model.cfg.model_name, out=out, resume=resume,
                          progress=progress, stop_after_steps=stop_after_steps, overwrite=overwrite)


def train_on_store(store, cfg: TrainingConfig, d_in: int, d_out: int, *, model_name: Optional[str] = None,
                   out: Optional[Union[str, Path]] = None, resume: Optional[Union[str, Path]] = None,
                   progress: bool = True, stop_after_steps: Optional[int] = None, overwrite: bool = False) -> TrainingResult:
    """`train_sae` on any source of batches: `store` has next_batch() -> (x,) or (x, y) [batch_tokens width],
    state_dict() / load_state_dict() of tensors (for checkpoints), and store_device."""
    from tqdm.auto import tqdm

    out = None if out is None else Path(out).expanduser()
    if out is not None and (out / "cfg.json").exists() and not overwrite and resume is None:
        raise FileExistsError(f"{out} already holds a dictionary; choose a new directory, pass overwrite=True, or resume "
                              f"from one of its checkpoints")
    sae = TrainingSAE(cfg, d_in, d_out, torch.Generator().manual_seed(cfg.seed)).to(store.store_device)
    optimizer = torch.optim.Adam(sae.parameters(), lr=cfg.lr, betas=cfg.adam_betas)
    step, pending = 0, None
    if resume is not None:
        step = _load_checkpoint(Path(resume), cfg, sae, optimizer, store)
    else:
        pending = store.next_batch()
        with torch.no_grad():  # b_dec starts at the mean of what it reconstructs: the first steps fit the rest
            sae.b_dec.copy_(pending[-1].mean(0))
    sae_cfg = SAEConfig(d_in=d_in, d_sae=cfg.d_sae, hook_name=cfg.hook_name,
                        architecture="jumprelu" if cfg.architecture == "batchtopk" else cfg.architecture,
                        k=cfg.k if cfg.architecture == "topk" else None, apply_b_dec_to_input=cfg.hook_name_out is None,
                        model_name=model_name, hook_name_out=cfg.hook_name_out,
                        d_out=d_out if cfg.hook_name_out else None, skip=cfg.skip)
    every = None if cfg.checkpoint_every_tokens is None else cfg.checkpoint_every_tokens // cfg.batch_tokens
    history: list[dict] = []
    bar = tqdm(total=cfg.steps * cfg.batch_tokens, initial=step * cfg.batch_tokens, unit="tok", unit_scale=True,
               disable=not progress, desc=f"training {cfg.architecture} on {cfg.hook_name}")
    try:
        while step < cfg.steps:
            batch = pending if pending is not None else store.next_batch()
            pending = None
            x, y = batch[0], batch[-1]
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr * lr_factor(cfg, step)
            if sae.threshold is not None:
                with torch.no_grad():
                    sae.threshold.clamp_(min=0.0)  # below zero the gate would pass negative pre-activations
            terms = sae.losses(x, y, coefficient_at(cfg, step))
            optimizer.zero_grad(set_to_none=True)
            terms["loss"].backward()
            if cfg.max_grad_norm:
                nn.utils.clip_grad_norm_(sae.parameters(), cfg.max_grad_norm)
            optimizer.step()
            sae.after_step(terms["features"])
            step += 1
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
                                       store, step)
                bar.write(f"wrote checkpoint {path}")
            if stopping:
                return TrainingResult(sae.to_inference(sae_cfg), step, step * cfg.batch_tokens, history)
    finally:
        bar.close()
    result = sae.to_inference(sae_cfg)
    if out is not None:
        _save_final(out, result, cfg, history, overwrite=overwrite or resume is not None)
    return TrainingResult(result, step, step * cfg.batch_tokens, history)


def _save_final(out: Path, sae: SparseAutoencoder, cfg: TrainingConfig, history: list[dict], overwrite: bool) -> None:
    """The dictionary's files in `out` (beside its checkpoints/), each written whole; cfg.json last, so a
    directory that has one has the weights it describes."""
    staged = out / f".final-{cfg.seed}"
    sae.save_pretrained(staged, overwrite=True)
    try:
        for name in ("sae_weights.safetensors", "cfg.json"):
            if (out / name).exists() and not overwrite:
                raise FileExistsError(f"{out / name} exists; pass overwrite=True to replace it")
            (staged / name).replace(out / name)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    with atomic_file(out / "training.json", overwrite=True) as tmp:
        tmp.write_text(json.dumps({"config": cfg.to_json(), "last_step": history[-1:]}, indent=2) + "\n")


def _width(model: HookedDecoder, name: str) -> int:
    shape = hook_shapes(model.cfg, 1, 1).get(name)
    if shape is None:
        model.hook_point(name)  # an unknown name fails here, with the closest valid ones
        raise ValueError(f"the width of {name!r} is unknown to probe.shapes; train on a hook point with one vector per position")
    if len(shape) != 3:
        raise ValueError(f"{name!r} holds {list(shape[2:])} per position (per head?); train on one vector per position")
    return shape[-1]


def save_checkpoint(path: Path, cfg: TrainingConfig, sae: TrainingSAE, sae_cfg: SAEConfig, optimizer: torch.optim.Adam,
                    store: ActivationStore, step: int) -> Path:
    """A resumable checkpoint: the inference dictionary plus the trainer's whole state; whole or not at all."""
    state = {f"param.{n}": p.detach().cpu().contiguous() for n, p in sae.named_parameters()}
    state.update({f"buffer.{n}": b.cpu().contiguous() for n, b in sae.named_buffers()})
    names = {id(p): n for n, p in sae.named_parameters()}
    for param, moments in optimizer.state.items():
        for key, value in moments.items():
            state[f"adam.{names[id(param)]}.{key}"] = torch.as_tensor(value).cpu().contiguous()
    state.update({f"store.{k}": v for k, v in store.state_dict().items()})
    with atomic_directory(path, overwrite=True) as tmp:
        sae.to_inference(sae_cfg).save_pretrained(tmp / "sae")
        for name in ("cfg.json", "sae_weights.safetensors"):
            (tmp / "sae" / name).replace(tmp / name)
        (tmp / "sae").rmdir()
        save_file(state, str(tmp / STATE_FILE))
        (tmp / TRAINER_FILE).write_text(json.dumps({"step": step, "tokens": step * cfg.batch_tokens,
                                                    "config": cfg.to_json()}, indent=2) + "\n")
    return path


def _load_checkpoint(path: Path, cfg: TrainingConfig, sae: TrainingSAE, optimizer: torch.optim.Adam,
                     store: ActivationStore) -> int:
    for name in (STATE_FILE, TRAINER_FILE):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name} is missing: resume from a directory under <out>/checkpoints/")
    meta = json.loads((path / TRAINER_FILE).read_text())
    saved = meta["config"]
    if saved != json.loads(json.dumps(cfg.to_json())):
        changed = sorted(k for k in saved if saved[k] != json.loads(json.dumps(cfg.to_json())).get(k))
        raise ValueError(f"{path} was written with other settings ({', '.join(changed)}); resume with the same ones")
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
    store.load_state_dict({k.removeprefix("store."): v for k, v in state.items() if k.startswith("store.")})
    return int(meta["step"])
