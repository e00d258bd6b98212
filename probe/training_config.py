"""How a dictionary is trained (`TrainingConfig`) and the schedules it implies: the learning rate's linear
warm-up and decay, the L1/L0 coefficient's warm-up. The loop that uses them is `probe.sae_training`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

TrainArchitecture = Literal["standard", "topk", "batchtopk", "jumprelu"]
TRAIN_ARCHITECTURES = ("standard", "topk", "batchtopk", "jumprelu")


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    hook_name: str  # what it reads, e.g. "blocks.1.hook_resid_post"; a transcoder: "blocks.1.ln2.hook_normalized"
    d_sae: int
    training_tokens: int  # in all, over every process of a torchrun
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
    resample_every_steps: Optional[int] = None  # standard: resample dead features every N steps (probe.training_sae)
    resample_batches: int = 4  # batches whose reconstruction losses choose the resampled directions
    lr: float = 3e-4
    adam_betas: tuple[float, float] = (0.9, 0.999)
    lr_warm_up_steps: int = 0
    lr_decay_steps: int = 0
    max_grad_norm: float = 1.0
    batch_tokens: int = 4096  # per step, in all: under torchrun each of N processes reads batch_tokens / N
    buffer_tokens: int = 65536  # per process
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
        for names, least, what in ((("d_sae", "training_tokens", "batch_tokens", "dead_feature_window", "resample_batches"),
                                    1, "a positive int"),
                                   (("lr_warm_up_steps", "lr_decay_steps", "coefficient_warm_up_steps"), 0, "an int >= 0 (0: none)")):
            for name in names:
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < least:
                    raise ValueError(f"{name} must be {what}, got {value!r}")
        # a negative coefficient rewards density; a negative max_grad_norm flips every gradient in clip_grad_norm_
        for name in ("l1_coefficient", "l0_coefficient", "aux_coefficient", "max_grad_norm"):
            value = getattr(self, name)
            if not (value is None and name == "max_grad_norm") and not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}" + (" (0: no clipping)" if name == "max_grad_norm" else ""))
        for name in ("jumprelu_bandwidth", "decoder_init_norm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 < self.topk_threshold_lr <= 1:
            raise ValueError(f"topk_threshold_lr must be in (0, 1] (the moving average's rate), got {self.topk_threshold_lr!r}")
        if self.resample_every_steps is not None:
            if self.architecture != "standard":
                raise ValueError(f"resample_every_steps applies to the standard (L1) architecture; {self.architecture} "
                                 "revives dead features otherwise (topk, batchtopk: AuxK)")
            if not isinstance(self.resample_every_steps, int) or self.resample_every_steps < 1:
                raise ValueError(f"resample_every_steps must be a positive int or None, got {self.resample_every_steps!r}")
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


def lr_factor(cfg: TrainingConfig, step: int) -> float:
    warm = min(1.0, (step + 1) / cfg.lr_warm_up_steps) if cfg.lr_warm_up_steps else 1.0
    left = cfg.steps - step
    decay = min(1.0, left / cfg.lr_decay_steps) if cfg.lr_decay_steps else 1.0
    return warm * decay


def coefficient_at(cfg: TrainingConfig, step: int) -> float:
    """SAELens's `CoefficientScheduler`: from 0 at step 0, linearly to the full value at coefficient_warm_up_steps."""
    value = cfg.l1_coefficient if cfg.architecture == "standard" else cfg.l0_coefficient
    return value * min(1.0, step / cfg.coefficient_warm_up_steps) if cfg.coefficient_warm_up_steps else value
