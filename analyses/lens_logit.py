"""The logit lens (nostalgebraist 2020): every site's residual decoded through the model's own final norm and
unembedding (a tuned lens's translators first, given one), with the target token's rank and probability."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, Union

import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from probe.analyses.common import AnalysisInput, TableDisplay, check_id_tensor, is_int, model_mask, resolve_positions, token_decoder, token_id, tokens_and_mask, top_count
from probe.analyses.labels import CHAR_PX, figure_token, fitted, grid_layout, plain_length, titled
from probe.analyses.lens_sites import final_norm, has_final_scale, model_lens_sites, position_labels, site_label
from probe.analyses.tuned_lens import TunedLens
from probe import HookedDecoder

NormMode = Literal["recompute", "frozen"]
CELL_MIN_PX, CELL_MAX_PX = 34, 72  # a heatmap column per position: never narrower, at most this wide
TargetSpec = Union[None, int, str, torch.Tensor]
DEFAULT_K = 5  # top tokens per cell when k is not given (fewer when the output vocabulary is smaller)


# ---- the logit lens ---------------------------------------------------------------------------------
@dataclass
class LogitLensResult(TableDisplay):
    """What each site's residual decodes to. Dimensions: `batch layer pos vocab`, where `layer` indexes `sites`.

    `target_rank` counts the tokens the lens ranks above the target (0 when it is the top token); frames,
    hovers and figures show rank = target_rank + 1 (rank 1 = top). `kl` is KL(final || layer) in nats;
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
                "rank": torch.arange(1, k + 1).repeat(len(b)).numpy(),
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
            "target_rank": self.target_rank.cpu()[b, l, p].numpy() + 1,  # 1 = the lens's top token
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
        if color not in ("top_prob", "target_logprob"):
            raise ValueError(f"color={color!r} is not one of: top_prob, target_logprob")
        top = self.top_tokens[prompt, :, :n, 0].cpu()
        top_prob = self.top_probs[prompt, :, :n, 0].float().cpu()
        t_prob = self.target_prob[prompt, :, :n].float().cpu()
        t_rank = self.target_rank[prompt, :, :n].cpu() + 1
        kl = self.kl[prompt, :, :n].float().cpu()
        strings = [figure_token(s) for s in self.token_strings(top.flatten().tolist())]
        full = [strings[i * n:(i + 1) * n] for i in range(top.shape[0])]
        targets = [figure_token(s) for s in self.token_strings(self.target[prompt, :n].tolist())]
        x = self.position_labels[prompt][:n]
        hover = [[
            f"{self.labels[l]}, {x[p]}<br>top: {full[l][p]} ({top_prob[l, p]:.4f})"
            f"<br>target {targets[p]}: p={t_prob[l, p]:.4g}, rank {int(t_rank[l, p])}<br>KL(final||layer)={kl[l, p]:.4f}"
            for p in range(n)] for l in range(top.shape[0])]  # per-cell hover strings: formatting, not compute
        # each position gets a column at least CELL_MIN_PX wide, wider (to CELL_MAX_PX) for long tokens: a long
        # prompt makes the figure wider, not its cells narrower; cell text is cut to what fits, the hover has it all
        lengths = sorted(plain_length(t) for row in full for t in row)
        typical = lengths[int(0.9 * (len(lengths) - 1))]  # sized for most tokens: one long one is cut, not every column widened
        cell_w = min(max(CELL_MIN_PX, 10 + CHAR_PX * typical), CELL_MAX_PX)
        text = [[fitted(t, cell_w) for t in row] for row in full]
        if color == "top_prob":
            z, what, zmin, zmax = top_prob, "top-token probability", 0.0, 1.0
        else:
            z, what, zmin, zmax = t_prob.clamp_min(1e-12).log(), "target log-prob", None, 0.0
        fig = go.Figure(go.Heatmap(
            z=z.numpy(), x=x, y=self.labels, text=text, texttemplate="%{text}",
            hovertext=hover, hoverinfo="text", colorscale="Blues", zmin=zmin, zmax=zmax,
            colorbar=dict(title=dict(text=what.replace(" ", "<br>", 1)), len=1.0), textfont=dict(size=11),
        ))
        fig.update_xaxes(type="category")
        fig.update_yaxes(type="category")  # the first site (the embeddings) at the bottom, as in every layer heatmap
        return grid_layout(fig, f"{self.lens_name}: top token per layer and position (colour: {what})",
                           x_labels=x, y_labels=self.labels, cell_w=cell_w, cell_h=30,
                           x_title="position (input token)", y_title="layer")

    def _target_figure(self, prompt: int, position: int) -> go.Figure:
        pos = resolve_positions(self.mask[prompt:prompt + 1], position)[0]
        prob = self.target_prob[prompt, :, pos].float().cpu()
        rank = self.target_rank[prompt, :, pos].cpu() + 1  # rank 1 = the lens's top token (a log axis cannot show 0)
        target = figure_token(self.token_strings([int(self.target[prompt, pos])])[0])
        fig = make_subplots(rows=2, cols=1, shared_xaxes=True, subplot_titles=("probability", "rank (1 = top)"))
        hover = [f"{lab}: p={p:.6g}, rank {int(r)}" for lab, p, r in zip(self.labels, prob.tolist(), rank.tolist())]
        fig.add_trace(go.Scatter(x=self.labels, y=prob.numpy(), mode="lines+markers", name="probability",
                                 hovertext=hover, hoverinfo="text"), row=1, col=1)
        fig.add_trace(go.Scatter(x=self.labels, y=rank.numpy(), mode="lines+markers", name="rank",
                                 hovertext=hover, hoverinfo="text"), row=2, col=1)
        fig.update_yaxes(type="log", row=2, col=1)
        fig.update_layout(xaxis2_title="layer", showlegend=False, width=720, height=560)
        return titled(fig, f"{self.lens_name}: target {target} at {self.position_labels[prompt][pos]} across layers", 720)

    def _kl_figure(self) -> go.Figure:
        kl = self.mean_kl().float().cpu()
        fig = go.Figure(go.Scatter(x=self.labels, y=kl.numpy(), mode="lines+markers", name=self.lens_name,
                                   hovertext=[f"{l}: {v:.5f} nats" for l, v in zip(self.labels, kl.tolist())],
                                   hoverinfo="text"))
        fig.update_layout(xaxis_title="layer", yaxis_title="KL (nats)", width=720, height=440)
        return titled(fig, f"{self.lens_name}: mean KL(final || layer)", 720)


@torch.no_grad()
def logit_lens(
    model: HookedDecoder,
    input: AnalysisInput,
    target: TargetSpec = None,
    k: Optional[int] = None,
    *,
    include_mid: bool = False,
    norm: NormMode = "recompute",
    lens: Optional["TunedLens"] = None,
    attention_mask: Optional[torch.Tensor] = None,
) -> LogitLensResult:
    """Decode the residual stream after the embedding and after every block through the final norm and unembedding.

    `target`: None = the next input token at each position, and the model's own top prediction at
    each prompt's last position (which has no next token); on a bidirectional model, whose positions
    see the next token and predict no such thing, the model's own top prediction everywhere; a token
    id or single-token string = that token everywhere; a tensor [batch pos] or [pos] = per position.
    `k`: top tokens kept per cell; None = 5, or the whole output vocabulary when it is smaller (a classifier's
    two classes); an explicit k above d_vocab_out is refused.
    `include_mid`: also read after every attention sublayer (`hook_resid_mid`).
    `norm`: "recompute" applies ln_final to each layer's residual (the lens as published); "frozen"
    divides by the final layer's own scale from the forward pass (the linearisation attribution uses).
    `lens`: a TunedLens; each site's residual goes through its translator first.
    """
    if norm not in ("recompute", "frozen"):
        raise ValueError(f"norm={norm!r} is not one of: recompute, frozen")
    k = lens_top_k(model, k)
    tokens, mask = tokens_and_mask(model, input, attention_mask)
    sites = model_lens_sites(model, include_mid)
    if lens is not None:
        lens.check_compatible(model, sites)
    # Stop before the final norm: every site, the final one included, goes through ln_final and the
    # unembedding in one matmul straight into the [batch site pos vocab] result (no second copy of
    # the logits to concatenate, no separate final unembedding). The final row is the model's own
    # computation on the same residual, so it equals the forward's logits up to float rounding.
    final_resid, cache = model.run_with_cache(tokens, attention_mask=model_mask(mask), names=sites,
                                              stop_at_layer=model.cfg.n_layers)
    resid = torch.stack([cache[s] for s in sites], dim=1)  # [batch site pos d_model]
    del cache
    if lens is not None:
        resid[:, :-1] = lens(resid[:, :-1], sites[:-1])
    frozen = _final_scale(model, final_resid)[:, None] if norm == "frozen" and has_final_scale(model) else None
    logits = model.unembed(final_norm(model, resid, frozen))  # [batch site pos vocab]
    return _lens_result(model, tokens, mask, sites, logits, target, k, "tuned lens" if lens is not None else "logit lens")


def lens_top_k(model: HookedDecoder, k: Optional[int], what: str = "k") -> int:
    """The lens's top tokens per cell: `k`, or None for DEFAULT_K cut to the output vocabulary (`top_count`)."""
    return top_count(k, model.cfg.d_vocab_out, "d_vocab_out", DEFAULT_K, what)


def _final_scale(model: HookedDecoder, final_resid: torch.Tensor) -> torch.Tensor:
    """[batch pos 1]: the scale ln_final computes for the final residual (what `norm="frozen"` holds fixed)."""
    captured = {}

    def keep(scale: torch.Tensor, hook) -> None:
        captured["scale"] = scale

    with model.hooks([("ln_final.hook_scale", keep)]):
        model.ln_final(final_resid)
    return captured["scale"]


def _lens_result(model, tokens, mask, sites, logits, target, k, name) -> LogitLensResult:
    batch, n_sites, n_pos, n_vocab = logits.shape
    target_ids = _resolve_target(model, tokens, mask, target, logits[:, -1])
    # One site at a time, through one reused float32 buffer: each site's log-softmax is written into
    # it once (no float copy of bf16 logits first, no fresh vocabulary-sized allocation per site), read
    # by the gathers and the KL contraction, and last overwritten in place by the comparison of the
    # logits with the target's, whose sum is the rank. A float sum of 0/1 is exact below 2^24 and
    # several times faster than count_nonzero over a bool temporary, which was the lens's costliest pass.
    final = logits[:, -1].float().log_softmax(-1)
    p_final = final.exp()
    neg_entropy = torch.einsum("bpv,bpv->bp", p_final, final)
    device = logits.device
    top_logprobs = torch.empty(batch, n_sites, n_pos, k, dtype=torch.float32, device=device)
    top_tokens = torch.empty(batch, n_sites, n_pos, k, dtype=torch.long, device=device)
    target_logprob = torch.empty(batch, n_sites, n_pos, dtype=torch.float32, device=device)
    rank = torch.empty(batch, n_sites, n_pos, dtype=torch.long, device=device)
    kl = torch.empty(batch, n_sites, n_pos, dtype=torch.float32, device=device)
    buffer = torch.empty(batch, n_pos, n_vocab, dtype=torch.float32, device=device) if n_sites > 1 else None
    top_values = torch.empty(batch, n_pos, k, dtype=logits.dtype, device=device)  # the top logits, unused
    for site in range(n_sites):
        # the final site last: its log-probabilities are `final`, which the other sites' KL reads until then
        site_logits = logits[:, site]
        logprobs = final if site == n_sites - 1 else torch.log_softmax(site_logits, -1, dtype=torch.float32, out=buffer)
        # top-k and rank on the logits themselves: logit - logsumexp rounds logits a float32 step apart together
        torch.topk(site_logits, k, dim=-1, out=(top_values, top_tokens[:, site]))
        top_logprobs[:, site] = logprobs.gather(-1, top_tokens[:, site])
        target_logprob[:, site] = logprobs.gather(-1, target_ids[..., None])[..., 0]
        # KL(final || site) = sum p_f log p_f - sum p_f log p_site; the contraction makes no temporary
        kl[:, site] = neg_entropy - torch.einsum("bpv,bpv->bp", p_final, logprobs)
        rank[:, site] = _count_above(site_logits, site_logits.gather(-1, target_ids[..., None]), out=logprobs)
    kl.clamp_(min=0)
    kl[:, -1] = 0.0  # the final row against itself: exactly zero, not a rounding residue
    return LogitLensResult(
        tokens=tokens, mask=mask, sites=sites, logits=logits, top_tokens=top_tokens, top_probs=top_logprobs.exp(),
        target=target_ids, target_prob=target_logprob.exp(), target_rank=rank, kl=kl, lens_name=name,
        position_labels=position_labels(model, tokens), token_strings=token_decoder(model),
    )


def _count_above(logits: torch.Tensor, chosen: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """[...]: how many entries of `logits` [... vocab] exceed `chosen` [... 1]; overwrites `out` (float32, logits' shape)."""
    if logits.shape[-1] >= 2**24:  # a float count would round; never reached by a real vocabulary
        return torch.count_nonzero(logits > chosen, dim=-1)
    return torch.gt(logits, chosen, out=out).sum(-1)


def _resolve_target(model, tokens, mask, target: TargetSpec, final_logits) -> torch.Tensor:
    batch, n = tokens.shape
    if target is None and model.cfg.bidirectional:
        return final_logits.argmax(-1)
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
        if bool((t < 0).any() | (t >= model.cfg.d_vocab_out).any()):
            raise ValueError(f"target token ids must lie in [0, {model.cfg.d_vocab_out})")
        return t
    raise TypeError(f"target must be None, a token id, a string or a tensor of ids, got {type(target).__name__}")
