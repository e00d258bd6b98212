"""Logit lens (nostalgebraist 2020) and tuned lens (Belrose et al. 2023): decode the residual stream early.

A *site* is a hook name where the residual stream is read: `blocks.0.hook_resid_pre` (the
embeddings), optionally `blocks.{l}.hook_resid_mid` (after block l's attention), and
`blocks.{l}.hook_resid_post` (after block l). Every lens maps a site's residual to logits through
the model's own final norm and unembedding; the last site's row is the model's output.

The parts live in modules of their own: sites and the final norm (`analyses.lens_sites`), the logit lens
(`analyses.lens_logit`), the tuned lens (`analyses.tuned_lens`) and its training
(`analyses.tuned_lens_training`); this module gathers their public names and compares the two lenses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pandas as pd
import plotly.graph_objects as go
import torch

from probe.analyses.labels import count, titled
from probe.analyses.lens_logit import (
    CELL_MAX_PX, CELL_MIN_PX, DEFAULT_K, LogitLensResult, NormMode, TargetSpec, lens_top_k, logit_lens,
)
from probe.analyses.lens_sites import (
    final_norm, has_final_scale, has_resid_mid, lens_sites, model_lens_sites, position_labels, require_resid_mid, site_label,
)
from probe.analyses.tuned_lens import FORMAT_VERSION, LENS_CONFIG, LENS_WEIGHTS, TunedLens, TunedLensConfig
from probe.analyses.tuned_lens_training import collect_residuals, heldout_split, lens_kl, progress_bar, train_tuned_lens
from probe import HookedDecoder
from probe.analyses.common import TableDisplay

__all__ = ["CELL_MAX_PX", "CELL_MIN_PX", "DEFAULT_K", "FORMAT_VERSION", "LENS_CONFIG", "LENS_WEIGHTS", "LensComparison",
           "LogitLensResult", "NormMode", "TargetSpec", "TunedLens", "TunedLensConfig", "compare_lenses", "final_norm",
           "has_final_scale", "has_resid_mid", "heldout_split", "lens_sites", "lens_top_k", "logit_lens", "model_lens_sites",
           "position_labels", "require_resid_mid", "site_label", "train_tuned_lens"]


# ---- logit lens vs tuned lens -----------------------------------------------------------------------
@dataclass
class LensComparison(TableDisplay):
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
        fig.update_layout(xaxis_title="layer", yaxis_title="KL (nats)", width=720, height=440)
        return titled(fig, f"Mean KL(final || lens) per layer, {count(self.tokens, 'held-out token')}", 720)


@torch.no_grad()
def compare_lenses(
    model: HookedDecoder, lens: TunedLens, text: Optional[str] = None, *, max_tokens: int = 8192, n_ctx: Optional[int] = None,
    progress: bool = False,
) -> LensComparison:
    """Mean KL(final || lens) per site for the logit lens and `lens`, on `text` (default: the
    evaluation part of the bundled held-out text, which the default training never saw).
    `progress` shows progress bars (stderr)."""
    text = heldout_split()[1] if text is None else text
    sites = lens_sites(model.cfg.n_layers, include_mid=any("resid_mid" in s for s in lens.sites))
    lens.check_compatible(model, sites)
    resid = collect_residuals(model, text, sites, max_tokens, n_ctx, desc="lens comparison: residuals" if progress else None)
    chunk = max(1, 2**26 // (len(sites) * model.cfg.d_vocab))  # bounds the [token layer vocab] log-probs in memory
    parts = resid.split(chunk)
    logit_kl = torch.cat([lens_kl(model, part, None, sites) for part in
                          progress_bar(parts, "lens comparison: logit lens KL" if progress else None, unit="chunk")]).mean(0)
    tuned_kl = torch.cat([lens_kl(model, part, lens, sites) for part in
                          progress_bar(parts, "lens comparison: tuned lens KL" if progress else None, unit="chunk")]).mean(0)
    return LensComparison(sites=sites, logit_kl=logit_kl, tuned_kl=tuned_kl, tokens=int(resid.shape[0]))
