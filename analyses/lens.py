"""Logit lens (nostalgebraist 2020) and tuned lens (Belrose et al. 2023): decode the residual stream early.

A *site* is a hook name where the residual stream is read: `blocks.0.hook_resid_pre` (the
embeddings), optionally `blocks.{l}.hook_resid_mid` (after block l's attention), and
`blocks.{l}.hook_resid_post` (after block l). Every lens maps a site's residual to logits through
the model's own final norm and unembedding; the last site's row is the model's output.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional, Sequence, Union

import pandas as pd
import plotly.graph_objects as go
import torch
from einops import einsum, rearrange
from plotly.subplots import make_subplots
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from analyses.common import model_mask as _forward_mask, tokens_and_mask
from analyses.common import AnalysisInput, check_id_tensor, escape_token, is_int, token_decoder, token_id, token_labels
from analyses.common import resolve_positions as _resolve_positions
from probe.io import atomic_directory
from probe import HELDOUT_TEXT, HookedDecoder, NormPlacement
from probe.names import act_name

NormMode = Literal["recompute", "frozen"]
TargetSpec = Union[None, int, str, torch.Tensor]


# ---- sites and inputs -------------------------------------------------------------------------------
def lens_sites(n_layers: int, include_mid: bool = False) -> list[str]:
    """The residual-stream hook names a lens reads, shallow to deep; the last is the final residual."""
    sites = ["blocks.0.hook_resid_pre"]
    for layer in range(n_layers):
        if include_mid:
            sites.append(act_name("resid_mid", layer))
        sites.append(act_name("resid_post", layer))
    return sites


def has_resid_mid(model: HookedDecoder) -> bool:
    """Whether blocks have a residual between attention and MLP (parallel blocks have none)."""
    return model.cfg.norm_placement is not NormPlacement.PARALLEL


def model_lens_sites(model: HookedDecoder, include_mid: bool = False) -> list[str]:
    """`lens_sites` for this model; include_mid needs a residual between the sublayers, which parallel blocks lack."""
    if include_mid and not has_resid_mid(model):
        raise ValueError("include_mid reads the residual between each block's attention and MLP (hook_resid_mid); "
                         f"this model's blocks are {model.cfg.norm_placement.value} (attention and MLP both read "
                         "hook_resid_pre), so there is none: leave include_mid=False")
    return lens_sites(model.cfg.n_layers, include_mid)


def site_label(site: str) -> str:
    """A short readable name: `embed`, `L3 attn` (after block 3's attention), `L3` (after block 3)."""
    if site == "blocks.0.hook_resid_pre":
        return "embed"
    layer, kind = site.split(".")[1], site.rsplit(".", 1)[1]
    return f"L{layer} attn" if kind == "hook_resid_mid" else f"L{layer}"




def position_labels(model: HookedDecoder, tokens: torch.Tensor) -> list[list[str]]:
    """Per prompt, one escaped label per position, suffixed with the position so equal tokens stay apart."""
    return [token_labels(model, row) for row in tokens]


def has_final_scale(model: HookedDecoder) -> bool:
    """False for a model without a final norm (its ln_final is the identity, so nothing to freeze)."""
    return "ln_final.hook_scale" in model.hook_names


def _final_norm(model: HookedDecoder, resid: torch.Tensor, frozen_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The model's own final norm on residuals [... d_model]; `frozen_scale` (broadcastable to [... 1])
    replaces the scale it would compute, which makes the norm an affine map of `resid`."""
    if frozen_scale is None or not has_final_scale(model):
        return model.ln_final(resid)

    def freeze(scale: torch.Tensor, hook) -> torch.Tensor:
        return frozen_scale.to(scale.dtype).expand_as(scale)

    # through the module and its hook rather than re-deriving the formula, so any norm exposing hook_scale works
    with model.hooks([("ln_final.hook_scale", freeze)]):
        return model.ln_final(resid)


# ---- the logit lens ---------------------------------------------------------------------------------
@dataclass
class LogitLensResult:
    """What each site's residual decodes to. Dimensions: `batch layer pos vocab`, where `layer` indexes `sites`.

    `target_rank` is 0 when the target is the lens's top token. `kl` is KL(final || layer) in nats;
    the last row is 0. Padded positions (mask False) hold meaningless values and are left out of frames.
    """

    tokens: torch.Tensor  # [batch pos]
    mask: torch.Tensor  # [batch pos] bool, True = real token
    sites: list[str]
    logits: torch.Tensor  # [batch layer pos vocab]; logits[:, -1] is the model's output
    top_tokens: torch.Tensor  # [batch layer pos k]
    top_probs: torch.Tensor  # [batch layer pos k]
    target: torch.Tensor  # [batch pos]
    target_prob: torch.Tensor  # [batch layer pos]
    target_rank: torch.Tensor  # [batch layer pos]
    kl: torch.Tensor  # [batch layer pos]
    lens_name: str
    position_labels: list[list[str]]  # per prompt, escaped, position-suffixed (for plotly axes)
    token_strings: Callable[[list[int]], list[str]] = field(repr=False)

    @property
    def labels(self) -> list[str]:
        return [site_label(s) for s in self.sites]

    def mean_kl(self) -> torch.Tensor:
        """[layer]: KL(final || layer) averaged over every real position of every prompt."""
        weights = self.mask.to(self.kl.dtype)[:, None, :]
        return (self.kl * weights).sum(dim=(0, 2)) / weights.sum(dim=(0, 2))

    def to_frame(self, top_k: bool = False) -> pd.DataFrame:
        """One row per (prompt, layer, position); with top_k=True one row per (prompt, layer, position, rank)."""
        batch, n_layers, n_pos, k = self.top_tokens.shape
        idx = torch.cartesian_prod(torch.arange(batch), torch.arange(n_layers), torch.arange(n_pos))
        b, l, p = idx.unbind(-1)
        real = self.mask.cpu()[b, p]
        b, l, p = b[real], l[real], p[real]
        base = {
            "prompt": b.numpy(), "layer": l.numpy(),
            "site": [self.sites[i] for i in l.tolist()], "label": [site_label(self.sites[i]) for i in l.tolist()],
            "position": p.numpy(),
            "token": self.token_strings(self.tokens.cpu()[b, p].tolist()),
        }
        if top_k:
            reps = {key: [v for v in vals for _ in range(k)] for key, vals in base.items()}
            tokens = self.top_tokens.cpu()[b, l, p]  # [row k]
            reps.update({
                "rank": torch.arange(k).repeat(len(b)).numpy(),
                "top_token_id": tokens.flatten().numpy(),
                "top_token": self.token_strings(tokens.flatten().tolist()),
                "probability": self.top_probs.float().cpu()[b, l, p].flatten().numpy(),
            })
            return pd.DataFrame(reps)
        target = self.target.cpu()[b, p]
        base.update({
            "top_token_id": self.top_tokens.cpu()[b, l, p, 0].numpy(),
            "top_token": self.token_strings(self.top_tokens.cpu()[b, l, p, 0].tolist()),
            "top_prob": self.top_probs.float().cpu()[b, l, p, 0].numpy(),
            "target_id": target.numpy(),
            "target": self.token_strings(target.tolist()),
            "target_prob": self.target_prob.float().cpu()[b, l, p].numpy(),
            "target_rank": self.target_rank.cpu()[b, l, p].numpy(),
            "kl": self.kl.float().cpu()[b, l, p].numpy(),
            "lens": self.lens_name,
        })
        return pd.DataFrame(base)

    def figure(
        self,
        kind: Literal["heatmap", "target", "kl"] = "heatmap",
        prompt: int = 0,
        color: Literal["top_prob", "target_logprob"] = "top_prob",
        position: int = -1,
    ) -> go.Figure:
        """`heatmap`: layers x positions, each cell the lens's top token, coloured by its probability
        (or the target's log-prob); `target`: the target's probability and rank across layers at one
        position; `kl`: mean KL(final || layer) per layer."""
        if not 0 <= prompt < self.tokens.shape[0]:
            raise ValueError(f"prompt={prompt} is outside the batch of {self.tokens.shape[0]}")
        if kind == "heatmap":
            return self._heatmap(prompt, color)
        if kind == "target":
            return self._target_figure(prompt, position)
        if kind == "kl":
            return self._kl_figure()
        raise ValueError(f"kind={kind!r} is not one of: heatmap, target, kl")

    def _real_positions(self, prompt: int) -> int:
        return int(self.mask[prompt].sum())

    def _heatmap(self, prompt: int, color: str) -> go.Figure:
        n = self._real_positions(prompt)  # right padding: real tokens come first
        if not bool(self.mask[prompt, :n].all()):
            raise ValueError("the heatmap needs right-padded prompts (real tokens first); pass them one at a time")
        top = self.top_tokens[prompt, :, :n, 0].cpu()
        top_prob = self.top_probs[prompt, :, :n, 0].float().cpu()
        t_prob = self.target_prob[prompt, :, :n].float().cpu()
        t_rank = self.target_rank[prompt, :, :n].cpu()
        kl = self.kl[prompt, :, :n].float().cpu()
        strings = [escape_token(s) for s in self.token_strings(top.flatten().tolist())]
        text = [strings[i * n:(i + 1) * n] for i in range(top.shape[0])]
        targets = [escape_token(s) for s in self.token_strings(self.target[prompt, :n].tolist())]
        hover = [[
            f"{self.labels[l]}, {self.position_labels[prompt][p]}<br>top: {text[l][p]} ({top_prob[l, p]:.4f})"
            f"<br>target {targets[p]}: p={t_prob[l, p]:.4g}, rank {int(t_rank[l, p])}<br>KL(final||layer)={kl[l, p]:.4f}"
            for p in range(n)] for l in range(top.shape[0])]  # per-cell hover strings: formatting, not compute
        if color == "top_prob":
            z, title, zmin, zmax = top_prob, "top-token probability", 0.0, 1.0
        elif color == "target_logprob":
            z, title, zmin, zmax = t_prob.clamp_min(1e-12).log(), "target log-prob", None, 0.0
        else:
            raise ValueError(f"color={color!r} is not one of: top_prob, target_logprob")
        fig = go.Figure(go.Heatmap(
            z=z.numpy(), x=self.position_labels[prompt][:n], y=self.labels, text=text, texttemplate="%{text}",
            hovertext=hover, hoverinfo="text", colorscale="Blues", zmin=zmin, zmax=zmax, colorbar=dict(title=title),
            textfont=dict(size=11),
        ))
        fig.update_layout(
            title=f"{self.lens_name}: top token per layer and position (colour: {title})",
            xaxis_title="position (input token)", yaxis_title="layer", xaxis_type="category", yaxis_type="category",
        )
        return fig

    def _target_figure(self, prompt: int, position: int) -> go.Figure:
        pos = _resolve_positions(self.mask[prompt:prompt + 1], position)[0]
        prob = self.target_prob[prompt, :, pos].float().cpu()
        rank = self.target_rank[prompt, :, pos].cpu()
        target = escape_token(self.token_strings([int(self.target[prompt, pos])])[0])
        # ranks start at 1 here (target_rank counts the tokens above, from 0): a log axis cannot show 0
        fig = make_subplots(rows=2, cols=1, shared_xaxes=True, subplot_titles=("probability", "rank (1 = top)"))
        hover = [f"{lab}: p={p:.6g}, rank {int(r) + 1}" for lab, p, r in zip(self.labels, prob.tolist(), rank.tolist())]
        fig.add_trace(go.Scatter(x=self.labels, y=prob.numpy(), mode="lines+markers", name="probability",
                                 hovertext=hover, hoverinfo="text"), row=1, col=1)
        fig.add_trace(go.Scatter(x=self.labels, y=(rank + 1).numpy(), mode="lines+markers", name="rank",
                                 hovertext=hover, hoverinfo="text"), row=2, col=1)
        fig.update_yaxes(type="log", row=2, col=1)
        fig.update_layout(title=f"{self.lens_name}: target {target} at {self.position_labels[prompt][pos]} across layers",
                          xaxis2_title="layer", showlegend=False)
        return fig

    def _kl_figure(self) -> go.Figure:
        kl = self.mean_kl().float().cpu()
        fig = go.Figure(go.Scatter(x=self.labels, y=kl.numpy(), mode="lines+markers", name=self.lens_name,
                                   hovertext=[f"{l}: {v:.5f} nats" for l, v in zip(self.labels, kl.tolist())],
                                   hoverinfo="text"))
        fig.update_layout(title=f"{self.lens_name}: mean KL(final || layer)", xaxis_title="layer", yaxis_title="KL (nats)")
        return fig


@torch.no_grad()
def logit_lens(
    model: HookedDecoder,
    input: AnalysisInput,
    target: TargetSpec = None,
    k: int = 5,
    *,
    include_mid: bool = False,
    norm: NormMode = "recompute",
    lens: Optional["TunedLens"] = None,
    attention_mask: Optional[torch.Tensor] = None,
) -> LogitLensResult:
    """Decode the residual stream after the embedding and after every block through the final norm and unembedding.

    `target`: None = the next input token at each position, and the model's own top prediction at
    each prompt's last position (which has no next token); a token id or single-token string = that
    token everywhere; a tensor [batch pos] or [pos] = per position.
    `include_mid`: also read after every attention sublayer (`hook_resid_mid`).
    `norm`: "recompute" applies ln_final to each layer's residual (the lens as published); "frozen"
    divides by the final layer's own scale from the forward pass (the linearisation attribution uses).
    `lens`: a TunedLens; each site's residual goes through its translator first.
    """
    if norm not in ("recompute", "frozen"):
        raise ValueError(f"norm={norm!r} is not one of: recompute, frozen")
    if not (isinstance(k, int) and 1 <= k <= model.cfg.d_vocab):
        raise ValueError(f"k={k!r} must be an int in [1, d_vocab={model.cfg.d_vocab}]")
    tokens, mask = tokens_and_mask(model, input, attention_mask)
    sites = model_lens_sites(model, include_mid)
    if lens is not None:
        lens.check_compatible(model, sites)
    # Stop before the final norm: every site, the final one included, goes through ln_final and the
    # unembedding in one matmul straight into the [batch site pos vocab] result (no second copy of
    # the logits to concatenate, no separate final unembedding). The final row is the model's own
    # computation on the same residual, so it equals the forward's logits up to float rounding.
    final_resid, cache = model.run_with_cache(tokens, attention_mask=_forward_mask(mask), names=sites,
                                              stop_at_layer=model.cfg.n_layers)
    resid = torch.stack([cache[s] for s in sites], dim=1)  # [batch site pos d_model]
    del cache
    if lens is not None:
        resid[:, :-1] = lens(resid[:, :-1], sites[:-1])
    frozen = _final_scale(model, final_resid)[:, None] if norm == "frozen" and has_final_scale(model) else None
    logits = model.unembed(_final_norm(model, resid, frozen))  # [batch site pos vocab]
    return _lens_result(model, tokens, mask, sites, logits, target, k, "tuned lens" if lens is not None else "logit lens")


def _final_scale(model: HookedDecoder, final_resid: torch.Tensor) -> torch.Tensor:
    """[batch pos 1]: the scale ln_final computes for the final residual (what `norm="frozen"` holds fixed)."""
    captured = {}

    def keep(scale: torch.Tensor, hook) -> None:
        captured["scale"] = scale

    with model.hooks([("ln_final.hook_scale", keep)]):
        model.ln_final(final_resid)
    return captured["scale"]


def _lens_result(model, tokens, mask, sites, logits, target, k, name) -> LogitLensResult:
    batch, n_sites, n_pos, _ = logits.shape
    target_ids = _resolve_target(model, tokens, mask, target, logits[:, -1])
    # One site at a time: the log-softmax of one [batch pos vocab] slice is the only vocabulary-sized
    # temporary, instead of a second tensor as large as all the logits.
    final = logits[:, -1].float().log_softmax(-1)
    p_final = final.exp()
    neg_entropy = torch.einsum("bpv,bpv->bp", p_final, final)
    device = logits.device
    top_logprobs = torch.empty(batch, n_sites, n_pos, k, dtype=torch.float32, device=device)
    top_tokens = torch.empty(batch, n_sites, n_pos, k, dtype=torch.long, device=device)
    target_logprob = torch.empty(batch, n_sites, n_pos, dtype=torch.float32, device=device)
    rank = torch.empty(batch, n_sites, n_pos, dtype=torch.long, device=device)
    kl = torch.empty(batch, n_sites, n_pos, dtype=torch.float32, device=device)
    for site in range(n_sites):
        logprobs = final if site == n_sites - 1 else logits[:, site].float().log_softmax(-1)
        torch.topk(logprobs, k, dim=-1, out=(top_logprobs[:, site], top_tokens[:, site]))
        chosen = logprobs.gather(-1, target_ids[..., None])  # [batch pos 1]
        target_logprob[:, site] = chosen[..., 0]
        rank[:, site] = torch.count_nonzero(logprobs > chosen, dim=-1)
        # KL(final || site) = sum p_f log p_f - sum p_f log p_site; the contraction makes no temporary
        kl[:, site] = neg_entropy - torch.einsum("bpv,bpv->bp", p_final, logprobs)
    kl.clamp_(min=0)
    kl[:, -1] = 0.0  # the final row against itself: exactly zero, not a rounding residue
    return LogitLensResult(
        tokens=tokens, mask=mask, sites=sites, logits=logits, top_tokens=top_tokens, top_probs=top_logprobs.exp(),
        target=target_ids, target_prob=target_logprob.exp(), target_rank=rank, kl=kl, lens_name=name,
        position_labels=position_labels(model, tokens), token_strings=token_decoder(model),
    )


def _resolve_target(model, tokens, mask, target: TargetSpec, final_logits) -> torch.Tensor:
    batch, n = tokens.shape
    if target is None:
        nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
        is_last = mask & ~torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)
        return torch.where(is_last, final_logits.argmax(-1), nxt)
    if isinstance(target, str) or (is_int(target) and not isinstance(target, torch.Tensor)):
        return torch.full_like(tokens, token_id(model, target, "target"))
    if isinstance(target, torch.Tensor):
        t = check_id_tensor(target, "target").to(tokens.device)
        t = t.expand(batch, n) if t.dim() == 1 and t.shape[0] == n else t
        if t.shape != tokens.shape:
            raise ValueError(f"a target tensor must have shape [batch pos] {tuple(tokens.shape)} or [pos], got {tuple(target.shape)}")
        if bool((t < 0).any() | (t >= model.cfg.d_vocab).any()):
            raise ValueError(f"target token ids must lie in [0, {model.cfg.d_vocab})")
        return t
    raise TypeError(f"target must be None, a token id, a string or a tensor of ids, got {type(target).__name__}")


# ---- the tuned lens ---------------------------------------------------------------------------------
LENS_CONFIG = "config.json"
LENS_WEIGHTS = "translators.safetensors"
FORMAT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class TunedLensConfig:
    d_model: int
    n_layers: int
    sites: tuple[str, ...]  # one translator per site; the final residual never gets one
    model_signature: tuple[float, ...]  # cheap fingerprint of the model trained on, see _signature
    training: dict = field(default_factory=dict)  # how it was trained: text, steps, seed, final KL, ...

    def to_json(self) -> str:
        values = dataclasses.asdict(self)
        values["sites"], values["model_signature"] = list(self.sites), list(self.model_signature)
        return json.dumps({"format_version": FORMAT_VERSION, **values}, indent=2) + "\n"


def _signature(model: HookedDecoder) -> tuple[float, ...]:
    """A few weight statistics: tells a lens trained on another checkpoint apart, survives dtype changes."""
    with torch.no_grad():
        tensors = [model.embed.W_E[:8]] + list(model.blocks[-1].parameters()) + list(model.ln_final.parameters())
        return tuple(round(float(t.double().norm()), 6) for t in tensors)


class TunedLens(nn.Module):
    """One affine translator per site, `h + h A + b`, A and b zero at initialisation (the logit lens).

    Works on tensors: `lens(resid, sites)` translates residuals [batch layer pos d_model] read at `sites`.
    """

    def __init__(self, config: TunedLensConfig):
        super().__init__()
        self.config = config
        n = len(config.sites)
        self.A = nn.Parameter(torch.zeros(n, config.d_model, config.d_model))  # [layer d_model d_model]
        self.b = nn.Parameter(torch.zeros(n, config.d_model))  # [layer d_model]

    @classmethod
    def for_model(cls, model: HookedDecoder, include_mid: bool = False, training: Optional[dict] = None) -> "TunedLens":
        sites = tuple(model_lens_sites(model, include_mid)[:-1])
        cfg = TunedLensConfig(d_model=model.cfg.d_model, n_layers=model.cfg.n_layers, sites=sites,
                              model_signature=_signature(model), training=dict(training or {}))
        return cls(cfg).to(model.device)

    @property
    def sites(self) -> tuple[str, ...]:
        return self.config.sites

    def forward(self, resid: torch.Tensor, sites: Sequence[str]) -> torch.Tensor:
        index = [self._index(s) for s in sites]
        # a lens loaded on the CPU reads a model's residuals wherever they are
        A, b = self.A[index].to(resid.device, resid.dtype), self.b[index].to(resid.device, resid.dtype)
        return resid + einsum(resid, A, "batch layer pos d_model, layer d_model d_out -> batch layer pos d_out") + b[:, None]

    def _index(self, site: str) -> int:
        try:
            return self.config.sites.index(site)
        except ValueError:
            hint = " (train it with include_mid=True to read hook_resid_mid)" if "resid_mid" in site else ""
            raise ValueError(f"this tuned lens has no translator for {site}{hint}; it has: {', '.join(self.sites)}") from None

    def check_compatible(self, model: HookedDecoder, sites: Sequence[str] = ()) -> None:
        cfg = self.config
        if (cfg.d_model, cfg.n_layers) != (model.cfg.d_model, model.cfg.n_layers):
            raise ValueError(
                f"this tuned lens was trained for d_model={cfg.d_model}, n_layers={cfg.n_layers}; the model has "
                f"d_model={model.cfg.d_model}, n_layers={model.cfg.n_layers}"
            )
        ours, theirs = torch.tensor(cfg.model_signature), torch.tensor(_signature(model))
        if not torch.allclose(ours, theirs, rtol=1e-2, atol=1e-3):
            raise ValueError("this tuned lens was trained on a different checkpoint (its weight fingerprint differs); "
                             "train one for this model with train_tuned_lens")
        for site in sites[:-1]:
            self._index(site)

    # ---- saving and loading: safetensors + JSON, never pickle ----
    def save(self, directory: Union[str, Path], overwrite: bool = False) -> Path:
        """Write `config.json` and `translators.safetensors` into a new directory (e.g. next to the model's).

        Written to a temporary sibling and renamed into place; an existing path is replaced only with overwrite=True.
        """
        with atomic_directory(directory, overwrite=overwrite) as tmp:
            (tmp / LENS_CONFIG).write_text(self.config.to_json())
            tensors = {"A": self.A.detach().float().cpu().contiguous(), "b": self.b.detach().float().cpu().contiguous()}
            save_file(tensors, str(tmp / LENS_WEIGHTS), metadata={"format": "pt"})
        return Path(directory).expanduser()

    @classmethod
    def load(cls, directory: Union[str, Path], model: Optional[HookedDecoder] = None) -> "TunedLens":
        """Read a lens written by `save`; with `model`, check it was trained on that model and move it there."""
        directory = Path(directory).expanduser()
        config_path, weights_path = directory / LENS_CONFIG, directory / LENS_WEIGHTS
        for path in (config_path, weights_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: a tuned-lens directory holds {LENS_CONFIG} and {LENS_WEIGHTS}")
        try:
            values = json.loads(config_path.read_text())
            version = values.pop("format_version", None)
            if version != FORMAT_VERSION:
                raise ValueError(f"format_version {version!r}, expected {FORMAT_VERSION}")
            config = TunedLensConfig(**{**values, "sites": tuple(values["sites"]),
                                        "model_signature": tuple(values["model_signature"])})
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError, ValueError) as err:
            raise ValueError(f"{config_path} is not a tuned-lens config: {err}") from err
        try:
            tensors = load_file(str(weights_path))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"could not read {weights_path}: {err}") from err
        lens = cls(config)
        shapes = {"A": tuple(lens.A.shape), "b": tuple(lens.b.shape)}
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if got != shapes:
            raise ValueError(f"{weights_path} holds tensors {got}; its config implies {shapes}")
        with torch.no_grad():
            lens.A.copy_(tensors["A"])
            lens.b.copy_(tensors["b"])
        if model is not None:
            lens.check_compatible(model)
            lens = lens.to(model.device)
        return lens


def heldout_split(fraction: float = 0.8) -> tuple[str, str]:
    """The bundled held-out text cut at a line break: (training part, evaluation part)."""
    if not HELDOUT_TEXT.is_file():
        raise FileNotFoundError(f"{HELDOUT_TEXT} is missing; pass your own text")
    text = HELDOUT_TEXT.read_text(encoding="utf-8")
    cut = text.rfind("\n", 0, int(len(text) * fraction))
    cut = int(len(text) * fraction) if cut <= 0 else cut
    return text[:cut], text[cut:]


def _windows(model: HookedDecoder, text: str, max_tokens: int, n_ctx: Optional[int]) -> list[torch.Tensor]:
    """Batches of BOS + (n-1) tokens covering the text's first max_tokens tokens: full windows, then the tail."""
    if model.tokenizer is None:
        raise ValueError("training or comparing lenses on text needs a model with a tokenizer")
    if n_ctx is not None and not (isinstance(n_ctx, int) and n_ctx >= 2):
        raise ValueError(f"n_ctx={n_ctx!r}: a window holds BOS plus at least one token, so give an int >= 2 (or None "
                         f"for the model's n_ctx={model.cfg.n_ctx})")
    ids = torch.tensor(model.tokenizer.encode(text)[:max_tokens], dtype=torch.long)
    if len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} tokens; the lens needs at least 2")
    n = min(n_ctx or model.cfg.n_ctx, model.cfg.n_ctx)
    bos = model.tokenizer.bos_id
    step = n if bos is None else n - 1  # without a BOS (GPT-1's vocabulary has none) a window is text alone
    full = len(ids) // step
    batches = [ids[: full * step].view(full, step)] if full else []
    tail = ids[full * step:]
    if len(tail):
        batches.append(tail[None])
    if bos is not None:
        batches = [torch.cat([torch.full((len(rows), 1), bos), rows], dim=1) for rows in batches]
    return [b.to(model.device) for b in batches]


@torch.no_grad()
def _collect_residuals(model: HookedDecoder, text: str, sites: list[str], max_tokens: int, n_ctx: Optional[int],
                       batch_size: int = 8) -> torch.Tensor:
    """[token layer d_model] residuals at `sites` for every text token (not the BOS, whose residual is fixed)."""
    out = []
    first = 0 if model.tokenizer.bos_id is None else 1
    for rows in _windows(model, text, max_tokens, n_ctx):
        for chunk in rows.split(batch_size):
            _, cache = model.run_with_cache(chunk, names=sites)
            stacked = torch.stack([cache[s][:, first:] for s in sites], dim=2)  # [batch pos layer d_model]
            out.append(rearrange(stacked, "batch pos layer d_model -> (batch pos) layer d_model").float())
    return torch.cat(out)


def _lens_kl(model: HookedDecoder, resid: torch.Tensor, lens: Optional[TunedLens], sites: Sequence[str]) -> torch.Tensor:
    """[token layer]: KL(final || lens at each site) for residuals [token layer d_model] whose last layer is the final one."""
    early = resid[:, :-1, None]  # the lens takes [batch layer pos d_model]: tokens as the batch, one position each
    if lens is not None:
        early = lens(early, sites[:-1])
    resid = torch.cat([early[:, :, 0], resid[:, -1:]], dim=1)
    # detached, float copies of the model's weights: only the lens learns, and the model's .grad stays untouched
    normed = _call_detached(model.ln_final, resid)
    logprobs = _call_detached(model.unembed, normed).log_softmax(-1)  # [token layer vocab]
    final = logprobs[:, -1:]
    return (final.exp() * (final - logprobs)).sum(-1)


def _call_detached(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    params = {name: p.detach().float() for name, p in module.named_parameters()}
    return torch.func.functional_call(module, params, (x,))


def train_tuned_lens(
    model: HookedDecoder,
    text: Optional[str] = None,
    *,
    include_mid: bool = False,
    steps: int = 150,
    batch_tokens: int = 256,
    lr: float = 2e-3,
    weight_decay: float = 1e-3,
    seed: int = 0,
    max_tokens: int = 16384,
    n_ctx: Optional[int] = None,
    progress: Optional[Callable[[int, float], None]] = None,
) -> TunedLens:
    """Fit one affine translator per site by minimising the mean KL(final || lens) over the text's tokens.

    `text` defaults to the training part of the bundled held-out text (`heldout_split()[0]`); the
    model is run once with no gradient and only the translators are optimised (Adam), on random
    batches of `batch_tokens` tokens drawn with `seed`. The model is not modified.
    """
    for name, value in (("steps", steps), ("batch_tokens", batch_tokens)):
        if not (isinstance(value, int) and value >= 1):  # 0 would leave the lens untrained and its KL NaN
            raise ValueError(f"{name}={value!r} must be a positive int")
    if text is None:
        text, source = heldout_split()[0], "probe.HELDOUT_TEXT (training part, heldout_split()[0])"
    else:
        source = "user text"
    sites = model_lens_sites(model, include_mid)
    resid = _collect_residuals(model, text, sites, max_tokens, n_ctx)
    lens = TunedLens.for_model(model, include_mid)
    lens.float()
    gen = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.Adam(lens.parameters(), lr=lr, weight_decay=weight_decay)
    loss = torch.tensor(float("nan"))
    with torch.enable_grad():
        for step in range(steps):
            index = torch.randint(0, resid.shape[0], (min(batch_tokens, resid.shape[0]),), generator=gen)
            loss = _lens_kl(model, resid[index.to(resid.device)], lens, sites)[:, :-1].mean()
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            if progress is not None:
                progress(step, loss.item())
    lens.config = dataclasses.replace(lens.config, training=dict(text=source, tokens=int(resid.shape[0]), steps=steps, batch_tokens=batch_tokens,
                                     lr=lr, weight_decay=weight_decay, seed=seed, final_train_kl=round(float(loss.detach()), 6)))
    lens.requires_grad_(False)
    return lens


# ---- logit lens vs tuned lens -----------------------------------------------------------------------
@dataclass
class LensComparison:
    sites: list[str]
    logit_kl: torch.Tensor  # [layer] mean KL(final || logit lens), nats
    tuned_kl: torch.Tensor  # [layer] mean KL(final || tuned lens), nats
    tokens: int  # how many tokens were averaged over

    def to_frame(self) -> pd.DataFrame:
        n = len(self.sites)
        return pd.DataFrame({
            "layer": list(range(n)) * 2, "site": self.sites * 2, "label": [site_label(s) for s in self.sites] * 2,
            "lens": ["logit lens"] * n + ["tuned lens"] * n,
            "mean_kl": torch.cat([self.logit_kl, self.tuned_kl]).cpu().numpy(),
        })

    def figure(self) -> go.Figure:
        labels = [site_label(s) for s in self.sites]
        fig = go.Figure()
        for name, kl in (("logit lens", self.logit_kl), ("tuned lens", self.tuned_kl)):
            fig.add_trace(go.Scatter(x=labels, y=kl.cpu().numpy(), mode="lines+markers", name=name,
                                     hovertext=[f"{name}, {l}: {v:.5f} nats" for l, v in zip(labels, kl.tolist())],
                                     hoverinfo="text"))
        fig.update_layout(title=f"Mean KL(final || lens) per layer, {self.tokens} held-out tokens",
                          xaxis_title="layer", yaxis_title="KL (nats)")
        return fig


@torch.no_grad()
def compare_lenses(
    model: HookedDecoder, lens: TunedLens, text: Optional[str] = None, *, max_tokens: int = 8192, n_ctx: Optional[int] = None
) -> LensComparison:
    """Mean KL(final || lens) per site for the logit lens and `lens`, on `text` (default: the
    evaluation part of the bundled held-out text, which the default training never saw)."""
    text = heldout_split()[1] if text is None else text
    sites = lens_sites(model.cfg.n_layers, include_mid=any("resid_mid" in s for s in lens.sites))
    lens.check_compatible(model, sites)
    resid = _collect_residuals(model, text, sites, max_tokens, n_ctx)
    chunk = max(1, 2**26 // (len(sites) * model.cfg.d_vocab))  # bounds the [token layer vocab] log-probs in memory
    logit_kl = torch.cat([_lens_kl(model, part, None, sites) for part in resid.split(chunk)]).mean(0)
    tuned_kl = torch.cat([_lens_kl(model, part, lens, sites) for part in resid.split(chunk)]).mean(0)
    return LensComparison(sites=sites, logit_kl=logit_kl, tuned_kl=tuned_kl, tokens=int(resid.shape[0]))
