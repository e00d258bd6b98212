"""A dictionary in training form (`TrainingSAE`) and every term of its loss, SAELens 6's recipes written out.

Each step reads a batch (x; for a transcoder also y, the activation to predict, else y = x) and minimises

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

A feature is dead once it has not fired for `dead_feature_window` steps. TopK and BatchTopK revive dead
features through AuxK; the standard SAE by resampling (`resample_dead`, Anthropic's "Towards
Monosemanticity" recipe, every `resample_every_steps`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from probe.sae import SAEConfig, SparseAutoencoder
from probe.training_config import TrainingConfig


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
        arch = self.cfg.architecture
        x_in = x if self.transcoder else x - self.b_dec
        if arch in ("topk", "batchtopk"):  # (x_in @ W_enc + b_enc) * norm, the norm folded into the weights:
            norm = self.W_dec.norm(dim=1)  # [d_in d_sae] multiplies instead of [batch d_sae] ones, both ways
            pre = torch.addmm(self.b_enc * norm, x_in, self.W_enc * norm)
        else:
            pre = torch.addmm(self.b_enc, x_in, self.W_enc)
        if arch == "topk":
            top = pre.topk(self.cfg.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu()), pre
        if arch == "batchtopk":
            acts = pre.relu().flatten()
            top = acts.topk(self.cfg.k * pre.shape[0], sorted=False)
            return torch.zeros_like(acts).scatter(-1, top.indices, top.values).view_as(pre), pre
        if arch == "jumprelu":
            return JumpReLU.apply(pre, self.threshold, self.cfg.jumprelu_bandwidth), pre
        return pre.relu(), pre

    def decode(self, features: torch.Tensor, bias: bool = True) -> torch.Tensor:
        # dense, as SAELens: on the CPU, gathering k decoder rows per token (and their gradient) measured no
        # faster than the [batch d_sae] @ [d_sae d_out] product (scripts/bench_sae.py)
        W_dec = self.W_dec
        if self.cfg.architecture in ("topk", "batchtopk"):  # (features / norm) @ W_dec, the norm folded into W_dec
            W_dec = W_dec / W_dec.norm(dim=1, keepdim=True)
        return torch.addmm(self.b_dec, features, W_dec) if bias else features @ W_dec

    def losses(self, x: torch.Tensor, y: torch.Tensor, coefficient: float) -> dict[str, torch.Tensor]:
        """Every loss term of one batch (x read, y predicted), "loss" their sum, and the features and output."""
        features, pre = self.encode(x)
        y_hat = self.decode(features) + (0 if self.W_skip is None else x @ self.W_skip.T)
        out = {"mse": (y_hat - y).pow(2).sum(-1).mean(), "features": features, "output": y_hat}
        arch = self.cfg.architecture
        if arch == "standard":
            out["l1"] = coefficient * (features @ self.W_dec.norm(dim=1)).mean()
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
        decoded = self.decode(torch.zeros_like(pre).scatter(-1, top.indices, top.values), bias=False)
        return self.cfg.aux_coefficient * scale * (decoded - residual).pow(2).sum(-1).mean()

    def dead_mask(self) -> torch.Tensor:
        return self.steps_since_fired > self.cfg.dead_feature_window

    @torch.no_grad()
    def step_statistics(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a batch's features tell the book-keeping: which fired [d_sae], the smallest positive activation
        (inf if none); under torchrun each is reduced over the processes (any, min) before `after_step`."""
        positive = features[features > 0] if self.cfg.architecture == "batchtopk" else features.new_zeros(0)
        smallest = positive.min().double() if positive.numel() else torch.tensor(math.inf, dtype=torch.float64)
        return (features > 0).any(0), smallest.to(features.device)

    @torch.no_grad()
    def after_step(self, fired: torch.Tensor, smallest: torch.Tensor) -> None:
        """Book-keeping after a step: the dead-feature counters, the batchtopk threshold."""
        self.steps_since_fired += 1
        self.steps_since_fired[fired] = 0
        if self.cfg.architecture == "batchtopk" and bool(torch.isfinite(smallest)):
            lr = self.cfg.topk_threshold_lr
            self.topk_threshold.copy_((1 - lr) * self.topk_threshold + lr * smallest)

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


RESAMPLE_ENCODER_SCALE = 0.2  # Anthropic: a resampled encoder row at 0.2 x the alive rows' mean norm


@torch.no_grad()
def resample_dead(sae: TrainingSAE, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Anthropic's resampling ("Towards Monosemanticity", 2023): every dead feature f draws one of the rows s
    of (x, y) with probability proportional to the square of its loss, loss_s = ||y_hat_s - y_s||^2, then

        W_dec[f] = d_s / ||d_s||,  d_s = y_s - b_dec                  (what the feature must add to the bias)
        W_enc[:, f] = e_s / ||e_s|| * 0.2 * mean of ||W_enc[:, g]|| over the alive features g
                                                                      (e_s = x_s - b_dec, what the encoder reads;
        b_enc[f] = 0                                                   a transcoder's encoder reads x_s)

    and Adam's moments of those entries are reset to zero, as is the feature's dead-feature counter.
    Returns (the resampled features, the row each drew)."""
    dead = sae.dead_mask().nonzero().flatten()
    if dead.numel() == 0:
        return dead, dead
    y_hat = sae.losses(x, y, 0.0)["output"]
    weight = (y_hat - y).pow(2).sum(-1).double().pow(2)
    if not float(weight.sum()) > 0:  # every row reconstructed exactly: no row is worse than another
        weight = torch.ones_like(weight)
    rows = torch.multinomial(weight.cpu(), dead.numel(), replacement=True, generator=generator).to(x.device)
    enc_in = x[rows] if sae.transcoder else x[rows] - sae.b_dec
    dec_dir = y[rows] - sae.b_dec
    alive = ~sae.dead_mask()
    norms = sae.W_enc.norm(dim=0)
    scale = RESAMPLE_ENCODER_SCALE * float(norms[alive].mean() if alive.any() else norms.mean())
    sae.W_dec[dead] = (dec_dir / dec_dir.norm(dim=1, keepdim=True).clamp(min=1e-12)).to(sae.W_dec.dtype)
    sae.W_enc[:, dead] = (enc_in / enc_in.norm(dim=1, keepdim=True).clamp(min=1e-12) * scale).T.to(sae.W_enc.dtype)
    sae.b_enc[dead] = 0.0
    for param, index in ((sae.W_dec, (dead,)), (sae.W_enc, (slice(None), dead)), (sae.b_enc, (dead,))):
        for key in ("exp_avg", "exp_avg_sq"):
            if key in optimizer.state.get(param, {}):
                optimizer.state[param][key][index] = 0.0
    sae.steps_since_fired[dead] = 0
    return dead, rows
