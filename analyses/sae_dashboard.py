"""Feature dashboards: for each chosen feature of an SAE or transcoder, what it reads, where it fires, what it writes.

`feature_dashboard(model, sae, corpus, features=[0, 5, 17])` (or `top=20`: the 20 features active on the most
tokens) gathers, per feature:

- from one streaming pass over the corpus (`analyses.feature_scan`): its top-k contexts with the activation at
  every token, its density and a histogram of its activations;
- the output view, `feature_logits`: the tokens its decoder row promotes and suppresses where it is written (a
  transcoder's rows at hook_name_out, the MLP's output);
- the input view, `feature_inputs`: the tokens whose embeddings excite and inhibit it most along the direct path
  (a transcoder's encoder reading the MLP's input), where the dictionary reads the residual stream or a norm.

`FeatureDashboard.to_html()` is one self-contained page (no network: inline CSS, SVG histograms, a few lines of
vanilla JS for the search box) with a feature index; `frames()` gives the same numbers as tidy DataFrames (the
CSV files of `probe sae dashboard`), `figure()` the features' densities against their largest activations.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch

from probe.analyses.corpus import Corpus
from probe.analyses.feature_scan import FeatureScan, feature_scan
from probe.analyses.features import (
    TOP_K, FeatureInputs, FeatureLogits, check_sae, feature_ids, feature_inputs, feature_logits, output_hook,
)
from probe import HookedDecoder, SparseAutoencoder
from probe.analyses.common import TableDisplay, top_count

DEFAULT_TOP = 20


@dataclass
class FeatureDashboard(TableDisplay):
    """What a dashboard shows, feature by feature in `scan.features`' order."""

    scan: FeatureScan
    logits: Optional[FeatureLogits]  # None where the written point is not a residual-stream write
    inputs: Optional[FeatureInputs]  # None where the dictionary does not read the residual stream (or a norm of it)
    title: str  # what the page is about: the dictionary, its hook points and shape
    corpus: str  # what was scanned, as given
    notes: list[str]  # why a view is missing, and other caveats shown on the page

    @property
    def features(self) -> torch.Tensor:
        return self.scan.features

    @property
    def is_transcoder(self) -> bool:
        return self.scan.hook_name_out is not None

    def to_frame(self) -> pd.DataFrame:
        """One row per feature: its density numbers, and its top promoted and exciting tokens (raw strings)."""
        frame = self.scan.densities_frame()
        for name, view in (("promotes", self.logits), ("excited_by", self.inputs)):
            if view is not None:
                frame[name] = [" ".join(repr(s) for s in view.token_strings[i][:view.k]) for i in range(len(frame))]
        return frame

    def frames(self) -> dict[str, pd.DataFrame]:
        """The dashboard's CSV files by name: contexts (one row per context token), densities, histograms, and
        logits / inputs where those views exist."""
        frames = {"contexts": self.scan.contexts_frame(), "densities": self.to_frame(),
                  "histograms": self.scan.histogram_frame()}
        if self.logits is not None:
            frames["logits"] = self.logits.to_frame()
        if self.inputs is not None:
            frames["inputs"] = self.inputs.to_frame()
        return frames

    def figure(self) -> go.Figure:
        return self.scan.figure()

    def to_html(self) -> str:
        from probe.analyses.sae_dashboard_html import render_dashboard  # the page's markup lives beside this module

        return render_dashboard(self)


def describe(sae: SparseAutoencoder) -> str:
    """A one-line name for the dictionary: kind, architecture, hook points and width."""
    cfg = sae.cfg
    kind = ("skip-transcoder" if cfg.skip else "transcoder") if cfg.is_transcoder else "SAE"
    shape = f"{cfg.architecture}{f' k={cfg.k}' if cfg.k else ''}, d_sae {cfg.d_sae}"
    where = f"{cfg.hook_name} -> {cfg.hook_name_out}" if cfg.is_transcoder else cfg.hook_name
    return f"{kind} {where} ({shape})"


def top_features(scan: FeatureScan, n: int) -> list[int]:
    """The n features active on the most tokens (ties: lower id first), never-active ones left out."""
    order = sorted(range(len(scan.features)), key=lambda i: (-int(scan.active[i]), int(scan.features[i])))
    return [int(scan.features[i]) for i in order if int(scan.active[i]) > 0][:n]


@torch.no_grad()
def feature_dashboard(
    model: HookedDecoder,
    sae: SparseAutoencoder,
    corpus: Corpus = None,
    features: Optional[Sequence[int]] = None,
    *,
    top: Optional[int] = None,
    k: int = 10,
    n_tokens: Optional[int] = None,
    max_tokens: int = 1 << 17,
    window: Optional[int] = None,
    batch_size: int = 8,
    progress: bool = True,
) -> FeatureDashboard:
    """The dashboard of `features` (ids), or of the `top` features active on the most tokens (default
    DEFAULT_TOP, or d_sae if fewer, when neither is given; that scans every feature). `k` contexts per feature,
    `n_tokens` tokens per view (default 10, or d_vocab_out if fewer); the corpus (None = the bundled held-out text)
    is read up to `max_tokens` tokens."""
    check_sae(model, sae)
    if features is not None and top is not None:
        raise ValueError("give features (ids) or top (how many of the most active), not both")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 < top <= sae.cfg.d_sae):
        raise ValueError(f"top={top!r} must be an integer in [1, d_sae={sae.cfg.d_sae}]")
    n_tokens = top_count(n_tokens, model.cfg.d_vocab_out, "d_vocab_out", TOP_K, "n_tokens")
    chosen = None if features is None else feature_ids(sae, features).tolist()
    scan = feature_scan(model, sae, corpus, chosen, k=k, max_tokens=max_tokens, window=window,
                        batch_size=batch_size, progress=progress)
    notes = []
    if chosen is None:
        wanted = top or min(DEFAULT_TOP, sae.cfg.d_sae)  # a toy SAE may have fewer features than the default
        chosen = top_features(scan, wanted)
        if not chosen:
            raise ValueError(f"no feature of the SAE is active on the {scan.n_tokens} tokens scanned: scan more tokens "
                             "or another corpus, or name features")
        scan = scan.select(chosen)
        if len(chosen) < wanted:
            notes.append(f"only {len(chosen)} features are active on the {scan.n_tokens} tokens scanned")
    dead = [f for f, a in zip(chosen, scan.active.tolist()) if a == 0]
    if dead:
        notes.append(f"never active on the {scan.n_tokens} tokens scanned: " + ", ".join(f"F{f}" for f in dead))
    views = {}
    for name, view, point in (("logits", feature_logits, output_hook(sae)), ("inputs", feature_inputs, sae.cfg.hook_name)):
        try:
            views[name] = view(model, sae, chosen, k=n_tokens)
        except ValueError as err:  # the only error left once the ids and k are checked: a point it cannot read
            views[name] = None
            what = "logit effects (output view)" if name == "logits" else "input view"
            notes.append(f"no {what} for {point}: {err}")
    return FeatureDashboard(scan=scan, logits=views["logits"], inputs=views["inputs"], title=describe(sae),
                            corpus=_corpus_label(corpus), notes=notes)


def _corpus_label(corpus: Corpus) -> str:
    if corpus is None:
        return "the bundled held-out text"
    if isinstance(corpus, (str, os.PathLike)):
        return str(corpus)
    return f"documents given as a {type(corpus).__name__}"
