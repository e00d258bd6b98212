"""Activation patching: how much of a metric one clean activation restores in a corrupted run.

Exact patching reruns the corrupted prompt once per site with that site's activation taken from
the clean run; attribution patching estimates all of them from one corrupted forward and one
backward, as (clean - corrupted) . d metric / d activation. Metrics follow analyses.ablation:
`metric(logits, tokens, attention_mask) -> [batch]`.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Literal, Optional, Sequence, Union

import pandas as pd
import plotly.graph_objects as go
import torch

from probe.analyses.ablation import Metric, metric_name, rows_per_forward, tokens_and_mask
from probe.analyses.architecture import refuse_next_token_metric, require_attention_heads, require_mlps
from probe.analyses.attention import CELL_PX, MAX_LABELLED_TOKENS
from probe.analyses.common import AnalysisInput, TableDisplay, is_int, model_mask, token_labels, token_strings
from probe.analyses.labels import LAYER_AXIS, grid_layout, head_grid, head_label, position_labels, titled
from probe.analyses.metric_reads import evaluate_output, metric_stop
from probe import HookedDecoder
from probe.names import act_name

Activation = Literal["z", "resid_pre", "attn_out", "mlp_out"]
# z: [batch pos head d_head]; the others: [batch pos d_model]
ACTIVATIONS = ("z", "resid_pre", "attn_out", "mlp_out")
SWEEPS = ("heads", "resid_pre", "attn_out", "mlp_out")


@dataclass(frozen=True)
class Site:
    """One activation to patch: a head's output (`z` with `head`), or a residual-stream-sized
    activation; `pos` limits it to one position (None: every position)."""

    act: Activation
    layer: int
    head: Optional[int] = None
    pos: Optional[int] = None

    @property
    def hook_name(self) -> str:
        return act_name(self.act, self.layer)

    @property
    def label(self) -> str:
        """`z L1H2 pos 3`, `mlp_out L1`: heads in the one notation (analyses.labels)."""
        where = f"L{self.layer}" if self.head is None else head_label(self.layer, self.head)
        pos = "" if self.pos is None else f" pos {self.pos}"
        return f"{self.act} {where}{pos}"

    def check(self, model: HookedDecoder, n_pos: int) -> None:
        cfg = model.cfg
        if self.act == "mlp_out":
            require_mlps(model, f"patching site {self!r}", "no mlp_out to patch",
                         "patch 'attn_out' (a block's whole write), 'resid_pre' or 'heads' instead")
        problems = []
        if self.act not in ACTIVATIONS:
            problems.append(f"act={self.act!r} is not one of {', '.join(ACTIVATIONS)}")
        if not (is_int(self.layer) and 0 <= self.layer < cfg.n_layers):
            problems.append(f"layer={self.layer!r} is outside [0, {cfg.n_layers})")
        heads = cfg.layer_heads(self.layer) if not problems else cfg.n_heads
        if self.head is not None and (self.act != "z" or not (is_int(self.head) and 0 <= self.head < heads)):
            problems.append(f"head={self.head!r} needs act='z' and a head in [0, {heads})")
        if self.pos is not None and not (is_int(self.pos) and 0 <= self.pos < n_pos):
            problems.append(f"pos={self.pos!r} is outside the prompt's [0, {n_pos})")
        if problems:
            raise ValueError(f"bad patching site {self!r}: " + "; ".join(problems))


def sweep_sites(model: HookedDecoder, sweep: str, n_pos: int) -> list[Site]:
    """The sites of a standard sweep: every head ('heads'), or every layer x position."""
    layers = range(model.cfg.n_layers)
    if sweep == "mlp_out":
        require_mlps(model, "sites='mlp_out'", "no mlp_out to patch",
                     "sweep 'attn_out' (a block's whole write), 'resid_pre' or 'heads' instead")
    if sweep == "heads":
        require_attention_heads(model, "sites='heads'")
        return [Site("z", l, head=h) for l in layers for h in range(model.cfg.layer_heads(l))]
    if sweep in ACTIVATIONS and sweep != "z":
        return [Site(sweep, l, pos=p) for l in layers for p in range(n_pos)]
    raise ValueError(f"sites={sweep!r} is not a sweep; choose one of {', '.join(SWEEPS)}, or give a list of Site")


@dataclass
class PatchingResult(TableDisplay):
    """patched: [site] the metric (batch mean) with that site patched, or its linear estimate
    (method 'attribution'); clean/corrupted: the metric on the unpatched runs."""

    sites: list[Site]
    patched: torch.Tensor
    clean: float
    corrupted: float
    method: str
    metric_name: str
    labels: list[str]  # escaped token labels of the first corrupted prompt
    clean_labels: list[str]
    sweep: Optional[str] = None
    strings: Optional[list[str]] = None  # the first corrupted prompt's token strings, raw (for frames, not HTML); patch sets it

    @property
    def recovered(self) -> torch.Tensor:
        """[site]: 0 = the corrupted run's metric, 1 = the clean run's."""
        return (self.patched - self.corrupted) / (self.clean - self.corrupted)

    def to_frame(self) -> pd.DataFrame:
        pos = [s.pos for s in self.sites]
        return pd.DataFrame({
            "act": [s.act for s in self.sites],
            "layer": [s.layer for s in self.sites],
            "head": pd.array([s.head for s in self.sites], dtype="Int64"),
            "pos": pd.array(pos, dtype="Int64"),
            "label": [s.label for s in self.sites],
            "token": [None if p is None else self.strings[p] for p in pos],
            "metric": self.patched.numpy(),
            "recovered": self.recovered.numpy(),
            "method": self.method,
        })

    def figure(self) -> go.Figure:
        """A layer x head or layer x position heatmap for sweeps; a bar per site otherwise."""
        recovered = self.recovered
        what = "attribution patching (linear estimate)" if self.method == "attribution" else "activation patching"
        title = f"{what}<br><sup>share of the {self.metric_name} recovered: 0 corrupted, 1 clean</sup>"
        if self.sweep is None:
            fig = go.Figure(go.Bar(x=[s.label for s in self.sites], y=recovered.numpy(),
                                   hovertemplate="%{x}<br>recovered %{y:.4f}<extra></extra>"))
            fig.update_layout(yaxis_title="recovered (0 corrupted, 1 clean)", width=max(640, 160 + 28 * len(self.sites)), height=480)
            return titled(fig, title, max(640, 160 + 28 * len(self.sites)))
        n_layer = max(s.layer for s in self.sites) + 1
        column = [s.head if self.sweep == "heads" else s.pos for s in self.sites]
        # filled by coordinates, NaN where a pruned layer has fewer heads
        grid = torch.full((n_layer, max(column) + 1), float("nan"))
        grid[[s.layer for s in self.sites], column] = recovered
        bound = max(1.0, float(grid.nan_to_num().abs().max()))
        colors = dict(colorscale="RdBu", zmid=0, zmin=-bound, zmax=bound)
        if self.sweep == "heads":
            return head_grid(grid, title, "recovered", **colors)
        x = self.labels[:grid.shape[1]]
        labelled = len(x) <= MAX_LABELLED_TOKENS
        fig = go.Figure(go.Heatmap(
            z=grid.numpy(), x=x, y=list(range(n_layer)), customdata=[self.clean_labels[:len(x)]] * n_layer,
            colorbar=dict(title="recovered"), **colors,
            hovertemplate="layer %{y}<br>corrupted %{x}<br>clean %{customdata}<br>recovered %{z:.4f}<extra></extra>",
        ))
        # a column per position at least CELL_PX wide: a long prompt widens the figure, which scrolls sideways
        grid_layout(fig, title, x_labels=x if labelled else ["x"], y_labels=[str(l) for l in range(n_layer)],
                    cell_w=max(CELL_PX, 18), cell_h=40, x_title=f"position (token of the corrupted prompt; {self.sweep} patched)",
                    y_title="layer", min_width=520)
        fig.update_xaxes(showticklabels=labelled, type="category")
        fig.update_yaxes(dtick=1, **LAYER_AXIS)
        return fig


def compare_patching(exact: PatchingResult, estimate: PatchingResult) -> go.Figure:
    """Scatter of attribution-patching estimates against exact patching, one point per site."""
    if exact.sites != estimate.sites:
        raise ValueError("the two results patch different sites; run both with the same `sites`")
    x, y = exact.recovered.numpy(), estimate.recovered.numpy()
    lo, hi = float(min(x.min(), y.min(), 0)), float(max(x.max(), y.max(), 1))
    fig = go.Figure([
        go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", line=dict(dash="dash", color="grey"), name="estimate = exact",
                   hoverinfo="skip"),
        go.Scatter(x=x, y=y, mode="markers", name="site", text=[s.label for s in exact.sites],
                   hovertemplate="%{text}<br>exact %{x:.4f}<br>attribution %{y:.4f}<extra></extra>"),
    ])
    fig.update_layout(title=f"Attribution patching against exact patching<br><sup>share of the {exact.metric_name} "
                            "recovered, one point per site</sup>",
                      xaxis_title="exact patching", yaxis_title="attribution estimate", width=680, height=560)
    return fig


def _site_masks(sites: Sequence[Site], n_pos: int, n_head: int, device) -> torch.Tensor:
    """[site pos head] for z sites, [site pos] otherwise: which elements each site patches."""
    pos = torch.tensor([-1 if s.pos is None else s.pos for s in sites], device=device)
    pos_mask = (pos[:, None] == -1) | (pos[:, None] == torch.arange(n_pos, device=device))
    if sites[0].act != "z":
        return pos_mask
    head = torch.tensor([-1 if s.head is None else s.head for s in sites], device=device)
    head_mask = (head[:, None] == -1) | (head[:, None] == torch.arange(n_head, device=device))
    return pos_mask[:, :, None] & head_mask[:, None, :]


def _broadcast(mask: torch.Tensor) -> torch.Tensor:
    """A site mask shaped to index [site batch pos (head) d]."""
    return mask[:, None, ..., None]


def patch(
    model: HookedDecoder,
    clean: AnalysisInput,
    corrupted: AnalysisInput,
    metric: Metric,
    sites: Union[str, Site, Sequence[Site]] = "heads",
    method: Literal["exact", "attribution"] = "exact",
    max_rows: Optional[int] = None,
    *,
    attention_mask: Optional[torch.Tensor] = None,
) -> PatchingResult:
    """Patch each site from the clean run into the corrupted run and measure the metric.

    sites: 'heads' (every head's hook_z), 'resid_pre' / 'attn_out' / 'mlp_out' (every layer x
    position; an attention-only model has no 'mlp_out'), a Site or a list of Site. method 'exact'
    reruns the model per site (batched: sites of one layer share a forward, restarting there from
    the cached corrupted residual); 'attribution'
    estimates every site from one forward and one backward. `attention_mask` [batch pos] marks the
    real tokens of padded token ids, the same for both (text is padded and masked for you).
    """
    refuse_next_token_metric(model, metric, "patch")
    clean_tokens, clean_mask = tokens_and_mask(model, clean, attention_mask)
    tokens, mask = tokens_and_mask(model, corrupted, attention_mask)
    if clean_tokens.shape != tokens.shape or not torch.equal(clean_mask, mask):
        raise ValueError(
            f"clean {tuple(clean_tokens.shape)} and corrupted {tuple(tokens.shape)} prompts must have the same "
            "shape and padding: patching swaps activations position by position"
        )
    n = tokens.shape[1]
    if isinstance(sites, Site):  # one site on its own: patch it as a list of one
        sites = [sites]
    sweep = sites if isinstance(sites, str) else None
    sites = sweep_sites(model, sites, n) if isinstance(sites, str) else list(sites)
    if not sites:
        raise ValueError("no sites to patch")
    if not all(isinstance(site, Site) for site in sites):
        raise TypeError("sites must be a sweep name or a list of Site, e.g. [Site('z', 1, head=2), Site('resid_pre', 0, pos=3)]")
    for site in sites:
        site.check(model, n)
    if method not in ("exact", "attribution"):
        raise ValueError(f"method={method!r}; choose 'exact' or 'attribution'")

    hook_names = sorted({s.hook_name for s in sites})
    with torch.no_grad():
        clean_out, clean_cache = model.run_with_cache(clean_tokens, attention_mask=model_mask(mask), names=hook_names,
                                                      stop_at_layer=metric_stop(model, metric))
        clean_value = float(evaluate_output(model, metric, clean_out, clean_tokens, mask).mean())
    del clean_out
    if method == "exact":
        corrupted_value, patched = _exact(model, tokens, mask, metric, sites, clean_cache, max_rows)
    else:
        corrupted_value, patched = _attribution(model, tokens, mask, metric, sites, clean_cache)
    # relative to the metric's own size: a metric of 1e-6 that moves by 3% is real, one of 5 that moves by 1e-7 is noise
    if abs(clean_value - corrupted_value) <= 1e-6 * max(abs(clean_value), abs(corrupted_value)):
        raise ValueError(
            f"the metric is {clean_value:.6g} on both the clean and the corrupted prompts, so there is nothing to "
            "recover; choose prompts (or a metric) that tell them apart"
        )
    strings = token_strings(model, tokens[0].tolist())
    return PatchingResult(
        sites=sites, patched=patched, clean=clean_value, corrupted=corrupted_value, method=method,
        metric_name=metric_name(metric),
        labels=position_labels(strings), clean_labels=token_labels(model, clean_tokens[0]), sweep=sweep, strings=strings,
    )


def attribution_patch(model: HookedDecoder, clean: AnalysisInput, corrupted: AnalysisInput, metric: Metric,
                      sites: Union[str, Site, Sequence[Site]] = "heads", *,
                      attention_mask: Optional[torch.Tensor] = None) -> PatchingResult:
    """Attribution patching: `patch(..., method='attribution')`."""
    return patch(model, clean, corrupted, metric, sites, method="attribution", attention_mask=attention_mask)


def _groups(sites: Sequence[Site]):
    """(indices, layer, act) runs of sites that can share a forward."""
    order = sorted(range(len(sites)), key=lambda i: (sites[i].layer, sites[i].act))
    for (layer, act), members in groupby(order, key=lambda i: (sites[i].layer, sites[i].act)):
        yield list(members), layer, act


@torch.no_grad()
def _exact(model, tokens, mask, metric, sites, clean_cache, max_rows):
    batch, n = tokens.shape
    # each run restarts from a cached residual: its sites' layer's, or an earlier one whose keys it reuses (Gemma 4)
    layers = sorted({model.cfg.resume_layer(s.layer) for s in sites} - {0})
    stop = metric_stop(model, metric)  # a metric reading a few logits runs to the final residual only
    out, cache = model.run_with_cache(tokens, attention_mask=model_mask(mask),
                                      names=[act_name("resid_pre", l) for l in layers], stop_at_layer=stop)
    corrupted_value = float(evaluate_output(model, metric, out, tokens, mask).mean())
    del out
    copies = max(1, rows_per_forward(model, n, max_rows) // batch)
    patched = torch.empty(len(sites))
    for members, layer, act in _groups(sites):
        resume = model.cfg.resume_layer(layer)
        start = tokens if resume == 0 else cache[act_name("resid_pre", resume)]
        clean_act = clean_cache[act_name(act, layer)]
        for first in range(0, len(members), copies):
            chunk = members[first: first + copies]
            k = len(chunk)
            where = _broadcast(_site_masks([sites[i] for i in chunk], n, model.cfg.layer_heads(layer), tokens.device))

            def swap(activation, hook, where=where, k=k, clean_act=clean_act):
                stacked = activation.view(k, batch, *activation.shape[1:])
                return torch.where(where, clean_act[None].to(activation.dtype), stacked).flatten(0, 1)

            stacked_mask = mask.repeat(k, 1)
            out = model.run_with_hooks(
                start.repeat(k, *([1] * (start.dim() - 1))), attention_mask=model_mask(stacked_mask),
                start_at_layer=None if resume == 0 else resume, stop_at_layer=stop, tokens=tokens.repeat(k, 1),
                fwd_hooks=[(act_name(act, layer), swap)],
            )
            values = evaluate_output(model, metric, out, tokens.repeat(k, 1), stacked_mask).view(k, batch).mean(dim=1)
            patched[chunk] = values.cpu()
    return corrupted_value, patched


def _attribution(model, tokens, mask, metric, sites, clean_cache):
    names = sorted({s.hook_name for s in sites})
    acts: dict[str, torch.Tensor] = {}

    def keep(activation, hook):
        if not activation.requires_grad:  # frozen weights: make the activation a leaf we can differentiate to
            activation = activation.detach().requires_grad_(True)
        acts[hook.name] = activation
        return activation

    # one forward with a graph and one backward to the activations only (no parameter gradients); a metric
    # reading a few logits is computed from the final residual, so neither pass touches [batch pos vocab]
    with torch.enable_grad():
        out = model.run_with_hooks(tokens, attention_mask=model_mask(mask), fwd_hooks=[(names, keep)],
                                   stop_at_layer=metric_stop(model, metric))
        value = evaluate_output(model, metric, out, tokens, mask).mean()
        grads = dict(zip(names, torch.autograd.grad(value, [acts[name] for name in names])))
    corrupted_value = float(value.detach())
    estimate = torch.empty(len(sites))
    for members, layer, act in _groups(sites):
        name = act_name(act, layer)
        # d metric ~ sum over the patched elements of (clean - corrupted) * gradient, summed over the batch
        contribution = ((clean_cache[name] - acts[name].detach()) * grads[name]).sum(dim=(0, -1))  # [pos (head)]
        masks = _site_masks([sites[i] for i in members], tokens.shape[1], model.cfg.layer_heads(layer), tokens.device)
        delta = (masks.to(contribution.dtype) * contribution).flatten(1).sum(dim=1)
        estimate[members] = (corrupted_value + delta.float()).cpu()
    return corrupted_value, estimate
