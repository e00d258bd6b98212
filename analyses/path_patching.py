"""Path patching (Wang et al. 2022, the IOI circuit): the senders' clean outputs reach the receivers alone.

In the corrupted run, each receiver (a head's q, k or v input, a mixer's or an MLP's input, the logits) reads its
corrupted input plus (clean - corrupted) of every sender that writes before it, and nothing else that
changed: every other path from the senders is frozen at its corrupted value, and the receiver's norm
reads with the corrupted run's scale. Everything downstream of the receivers then runs as usual, so
the receivers' new outputs reach the logits through the rest of the model. That is the two-pass
recipe (freeze all but the senders and record the receivers' inputs; rerun with those patched in)
done in one forward of rebuilt reader inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import pandas as pd
import plotly.graph_objects as go
import torch

from probe.analyses.ablation import Metric, metric_name
from probe.analyses.architecture import refuse_next_token_metric
from probe.analyses.circuit_graph import CircuitGraph, circuit_graph, with_grouped_key_values
from probe.analyses.common import AnalysisInput, TableDisplay, evaluate_metric, is_int, model_mask
from probe.analyses.edge_attribution import paired_tokens
from probe.analyses.edge_patching import EdgeInputs, copies_per_forward, graph_hook_names, run_edges, stage_residuals, writer_outputs
from probe.analyses.paired_stats import bootstrap_ci, sign_flip_p
from probe import HookedDecoder
from probe.names import act_name

NodeNames = Union[str, tuple, Sequence[Union[str, tuple]]]


@dataclass
class PathPatching(TableDisplay):
    """`patched` [sender_set batch]: the metric with each set of senders patched into the receivers; `clean` and
    `corrupted` [batch] the unpatched runs. `recovered` is (patched - corrupted) / (clean - corrupted) of batch means."""

    senders: list[list[str]]
    receivers: list[str]
    patched: torch.Tensor
    clean: torch.Tensor
    corrupted: torch.Tensor
    metric_name: str
    graph: CircuitGraph = field(repr=False)

    @property
    def recovered(self) -> torch.Tensor:
        """[sender_set]."""
        gap = self.clean.mean() - self.corrupted.mean()
        return (self.patched.mean(1) - self.corrupted.mean()) / gap

    def to_frame(self) -> pd.DataFrame:
        """One row per sender set: the metric, the share recovered, and with several prompts a 95% bootstrap interval
        of the metric's change and a sign-flip p-value."""
        change = self.patched - self.corrupted[None]  # [set batch]
        frame = pd.DataFrame({
            "senders": [", ".join(s) for s in self.senders], "receivers": ", ".join(self.receivers),
            "metric": self.patched.mean(1).numpy(), "change": change.mean(1).numpy(), "recovered": self.recovered.numpy(),
        })
        if change.shape[1] > 1:
            low, high = bootstrap_ci(change.T)
            frame["change_ci_low"], frame["change_ci_high"] = low.numpy(), high.numpy()
            frame["p_value"] = sign_flip_p(change.T).numpy()
        frame["clean"], frame["corrupted"] = float(self.clean.mean()), float(self.corrupted.mean())
        return frame

    def figure(self) -> go.Figure:
        """A layer x head heatmap of the share recovered when every sender set is one head; bars otherwise."""
        frame = self.to_frame()
        receivers = ", ".join(self.receivers)
        title = f"Path patching into {receivers}<br><sup>share of the {self.metric_name} recovered: 0 corrupted, 1 clean</sup>"
        single = [s[0] for s in self.senders if len(s) == 1]
        g = self.graph
        if len(single) == len(self.senders) and all(g.writer_kind[g.writer_index(s)] == "head" for s in single) and len(single) > 1:
            grid = torch.full((g.n_layers, max(g.heads)), float("nan"))
            for name, value in zip(single, self.recovered.tolist()):
                i = g.writer_index(name)
                grid[g.writer_layer[i], g.writer_head[i]] = value
            bound = max(1.0, float(grid.nan_to_num().abs().max()))
            fig = go.Figure(go.Heatmap(z=grid.numpy(), x=[f"H{h}" for h in range(grid.shape[1])], y=[f"L{l}" for l in range(g.n_layers)],
                                       colorscale="RdBu", zmid=0, zmin=-bound, zmax=bound, colorbar=dict(title="recovered"),
                                       hovertemplate="%{y}%{x} → " + receivers + "<br>recovered %{z:.4f}<extra></extra>"))
            fig.update_layout(title=title, xaxis_title="sender head", yaxis_title="sender layer", yaxis_autorange="reversed",
                              width=max(520, 160 + 50 * grid.shape[1]), height=240 + 40 * g.n_layers)
            return fig
        error = None
        if "change_ci_low" in frame:
            gap = float(self.clean.mean() - self.corrupted.mean())
            error = dict(type="data", symmetric=False, array=((frame["change_ci_high"] - frame["change"]) / gap).abs().to_numpy(),
                         arrayminus=((frame["change"] - frame["change_ci_low"]) / gap).abs().to_numpy())
        fig = go.Figure(go.Bar(x=frame["senders"], y=frame["recovered"], error_y=error,
                               hovertemplate="%{x} → " + receivers + "<br>recovered %{y:.4f}<extra></extra>"))
        fig.update_layout(title=title, xaxis_title="senders", yaxis_title="recovered", xaxis_type="category")
        return fig


def _names(value: NodeNames) -> list:
    # only a pair of ints is one node, (layer, head); a tuple of names is several, as a list of them is
    if isinstance(value, str) or (isinstance(value, tuple) and len(value) == 2 and all(is_int(v) for v in value)):
        return [value]
    items = list(value)
    if not items:
        raise ValueError("an empty list of nodes: name at least one (e.g. 'L0H1', 'L2H0<k', 'logits')")
    return items


@with_grouped_key_values
def path_patch(model: HookedDecoder, clean: AnalysisInput, corrupted: AnalysisInput, metric: Metric,
               senders: Union[NodeNames, Sequence[NodeNames]], receivers: NodeNames, *, sweep: bool = False,
               attention_mask: Optional[torch.Tensor] = None, max_rows: Optional[int] = None) -> PathPatching:
    """Patch the path from `senders` (writers: 'L0H1', 'embed', 'L1 mlp', a recurrent layer's 'L1 mixer', (0, 1),
    ...) to `receivers` (readers: 'L2H0<k', 'L2H0' for all three of its inputs, 'L1 mlp', 'L3 mixer', 'logits').

    `sweep=True`: `senders` is a list of sender sets (a name each, or a list of names), each patched on its own, in
    batched forwards; `senders="heads"` with sweep=True is every head that writes before a receiver, alone (a layer x
    head figure)."""
    graph = circuit_graph(model)
    refuse_next_token_metric(model, metric, "path_patch")
    readers = sorted({i for name in _names(receivers) for i in graph.reader_indices(name)})
    valid = graph.valid
    if isinstance(senders, str) and senders == "heads":
        if not sweep:
            raise ValueError("senders='heads' means every head patched on its own: pass sweep=True (or name the heads)")
        # every head with a path to the receivers: the later ones have none, and stay blank in the figure
        sets = [[w] for w, kind in enumerate(graph.writer_kind) if kind == "head" and bool(valid[w, readers].any())]
        if not sets:
            raise ValueError(f"no head writes before any of the receivers {[graph.readers[r] for r in readers]}: "
                             "receive at a later layer's input, an MLP or the logits")
    elif sweep:
        sets = [[graph.writer_index(n) for n in _names(s)] for s in _names(senders)]
    else:
        sets = [[graph.writer_index(n) for n in _names(senders)]]
    for members in sets:
        if not bool(valid[members][:, readers].any()):
            raise ValueError(f"none of the senders {[graph.writers[w] for w in members]} writes before any of the receivers "
                             f"{[graph.readers[r] for r in readers]}: a receiver must read a later residual than a sender")
    clean_tokens, tokens, mask = paired_tokens(model, clean, corrupted, attention_mask)
    names = graph_hook_names(graph)
    norms = _receiver_norms(model, graph, readers)
    with torch.no_grad():
        logits, clean_cache = model.run_with_cache(clean_tokens, attention_mask=model_mask(mask), names=names)
        clean_values = evaluate_metric(metric, logits, clean_tokens, mask)
        logits, cache = model.run_with_cache(tokens, attention_mask=model_mask(mask), names=sorted(set(names + norms)))
        corrupted_values = evaluate_metric(metric, logits, tokens, mask)
        del logits
        corr_out = writer_outputs(model, graph, cache)
        base, clean_out = stage_residuals(graph, cache), writer_outputs(model, graph, clean_cache)
        carry = valid.float().to(tokens.device)
        carry[:, readers] = 0.0  # a receiver hears the senders alone
        frozen_readers = torch.zeros(len(graph.readers), dtype=torch.bool)
        frozen_readers[readers] = True
        batch, n_pos = tokens.shape
        copies = copies_per_forward(model, batch, n_pos, max_rows)
        patched = torch.empty(len(sets), batch)
        for first in range(0, len(sets), copies):
            chunk = sets[first:first + copies]
            patch = torch.zeros(len(chunk), *valid.shape, device=tokens.device)
            for c, members in enumerate(chunk):
                for w in members:
                    patch[c, w, readers] = valid[w, readers].float().to(tokens.device)
            spec = EdgeInputs(base=base, ref=corr_out, carry=carry[None].expand(len(chunk), -1, -1), source=clean_out,
                              patch=patch, frozen={n: cache[n] for n in norms}, frozen_readers=frozen_readers)
            logits = run_edges(model, graph, tokens, model_mask(mask), spec)
            values = evaluate_metric(metric, logits, tokens.repeat(len(chunk), 1), mask.repeat(len(chunk), 1))
            patched[first:first + len(chunk)] = values.view(len(chunk), batch).cpu()
    return PathPatching(senders=[[graph.writers[w] for w in s] for s in sets], receivers=[graph.readers[r] for r in readers],
                        patched=patched, clean=clean_values.cpu(), corrupted=corrupted_values.cpu(),
                        metric_name=metric_name(metric), graph=graph)


def _receiver_norms(model: HookedDecoder, graph: CircuitGraph, readers: list[int]) -> list[str]:
    """The norm scales the receivers read with, to freeze at the corrupted run's."""
    names = set()
    for r in readers:
        kind, layer = graph.reader_kind[r], graph.reader_layer[r]
        if kind == "logits":
            if "ln_final.hook_scale" in model.hook_names:
                names.add("ln_final.hook_scale")
        else:
            names.add(act_name("scale", layer, "ln2" if kind == "mlp" else "ln1"))
    return sorted(names)
