"""Attribution graphs (Ameisen et al. 2025; circuit-tracer): every direct effect between the active transcoder
features, error nodes, embeddings and chosen logits of one prompt, in the linearised replacement model of
analyses/replacement_model.py.

An edge s -> t is the derivative of t's pre-activation with respect to s's activation, times that activation:
what s's write adds to t along the linear paths (attention through its frozen pattern, norms through their
frozen scales, never through another node). So each target's incoming edges, plus its bias terms (what the
biases, b_dec, b_enc and the frozen norms' offsets add), sum to its value exactly (completeness). Rows are
read off one backward pass per target, many targets per pass (`batch_size` copies of the prompt); the logits
first, then the features in order of their influence on the logits as known so far (recomputed every
`update_interval` batches), up to `max_feature_nodes` of them.

Node order in every tensor: features (sorted by layer, position, feature), error nodes (layer by layer, each
position), embedding nodes (each position), logits (most probable first). `adjacency[target, source]`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence, Union

import pandas as pd
import torch
from tqdm.auto import tqdm

from probe.analyses.architecture import refuse_prediction_head
from probe.analyses.common import AnalysisInput, TableDisplay, as_tokens, is_int, token_decoder
from probe.analyses.labels import head_label, parse_head
from probe.analyses.graph_pruning import EDGE_THRESHOLD, NODE_THRESHOLD, influence, prune, row_normalised
from probe.analyses.replacement_model import (TranscoderSpec, demeaned_unembedding, linearised_run, load_transcoders,
                                        promoted_tokens, replacement_state)
from probe import HookedDecoder

KINDS = ("feature", "error", "embedding", "logit")
FEATURE, ERROR, EMBEDDING, LOGIT = range(4)
MAX_LOGITS, LOGIT_PROBABILITY = 10, 0.95  # circuit-tracer's defaults for logit_targets="top"


@dataclass
class AttributionGraph(TableDisplay):
    """See the module docstring for the node order. Per node [node]: `kind` (an index into KINDS), `layer`
    (-1 for embeddings, n_layers for logits), `pos`, `feature` (-1 unless a feature), `token` (the prompt's token
    at an embedding, the logit's token), `activation` (a feature's; an error's or embedding's vector norm; a logit's
    demeaned value), `value` and `bias` (a target's value and bias terms, 0 for errors and embeddings),
    `unvisited` (what features left out by max_feature_nodes add to a target), `influence` (on the logits)."""

    tokens: torch.Tensor  # [pos]
    token_strings: list[str]
    kind: torch.Tensor
    layer: torch.Tensor
    pos: torch.Tensor
    feature: torch.Tensor
    token: torch.Tensor
    activation: torch.Tensor
    value: torch.Tensor
    bias: torch.Tensor
    unvisited: torch.Tensor
    adjacency: torch.Tensor  # [target source]
    logit_probabilities: torch.Tensor  # [logit]
    logit_weights: torch.Tensor  # [logit]: what influence starts from (probabilities, or equal for chosen tokens)
    influence: torch.Tensor = field(default=None)
    n_layers: int = 0
    n_active: int = 0  # active features on the prompt, visited or not
    node_strings: list[str] = field(default_factory=list, repr=False)  # the logit's or embedding's token, raw
    promoted: dict = field(default_factory=dict, repr=False)  # feature node index -> [(token string, logit)]
    thresholds: Optional[tuple[float, float]] = None  # (node, edge) once pruned
    shares: Optional[tuple[float, float]] = None  # the influence and edge-score shares pruning kept

    def __post_init__(self):
        if self.influence is None:
            self.influence = influence(row_normalised(self.adjacency.float()), self.logit_weight_vector().float())

    @property
    def n_nodes(self) -> int:
        return len(self.kind)

    def logit_weight_vector(self) -> torch.Tensor:
        weights = torch.zeros(self.n_nodes, dtype=self.adjacency.dtype)
        weights[self.kind == LOGIT] = self.logit_weights.to(weights.dtype)
        return weights

    def labels(self) -> list[str]:
        """Each node's name: `L1.F123@5` (feature 123 of layer 1's transcoder, position 5), `L1.err@5`, `emb@5`,
        `logit " the"` (the token in quotes, so its whitespace shows)."""
        out = []
        for i in range(self.n_nodes):
            kind, layer, pos = int(self.kind[i]), int(self.layer[i]), int(self.pos[i])
            out.append(f"L{layer}.F{int(self.feature[i])}@{pos}" if kind == FEATURE else f"L{layer}.err@{pos}"
                       if kind == ERROR else f"emb@{pos}" if kind == EMBEDDING else f"logit {self.node_strings[i]!r}")
        return out

    def to_frame(self, what: str = "nodes") -> pd.DataFrame:
        """`what="nodes"`: one row per node; `"edges"`: one row per nonzero edge (source, target, weight)."""
        labels = self.labels()
        if what == "nodes":
            return pd.DataFrame(dict(
                node=labels, kind=[KINDS[k] for k in self.kind.tolist()], layer=self.layer.tolist(),
                pos=self.pos.tolist(), feature=self.feature.tolist(), token=self.node_strings,
                activation=self.activation.tolist(), influence=self.influence.tolist(), value=self.value.tolist(),
                bias=self.bias.tolist(), unvisited=self.unvisited.tolist()))
        if what == "edges":
            target, source = self.adjacency.nonzero(as_tuple=True)
            weight = self.adjacency[target, source]
            order = weight.abs().argsort(descending=True)
            target, source, weight = target[order], source[order], weight[order]
            return pd.DataFrame(dict(source=[labels[s] for s in source.tolist()], target=[labels[t] for t in target.tolist()],
                                     weight=weight.tolist(), source_index=source.tolist(), target_index=target.tolist()))
        raise ValueError(f"to_frame(what={what!r}): choose 'nodes' or 'edges'")

    def prune(self, node_threshold: float = NODE_THRESHOLD, edge_threshold: float = EDGE_THRESHOLD) -> "AttributionGraph":
        """The graph restricted to the nodes and edges pruning keeps (see analyses.graph_pruning); influences stay
        those of the unpruned graph, and `shares` says how much influence and edge score was kept."""
        result = prune(self.adjacency, self.logit_weight_vector(), (self.kind == FEATURE) | (self.kind == ERROR),
                       self.kind == FEATURE, node_threshold, edge_threshold)
        keep = result.node_mask.nonzero()[:, 0]
        adjacency = (self.adjacency * result.edge_mask)[keep][:, keep]
        index = {int(old): new for new, old in enumerate(keep.tolist())}
        picked = {name: getattr(self, name)[keep] for name in ("kind", "layer", "pos", "feature", "token", "activation",
                                                               "value", "bias", "unvisited")}
        return replace(self, **picked, adjacency=adjacency, influence=result.influence[keep].float(),
                       node_strings=[self.node_strings[i] for i in keep.tolist()],
                       promoted={index[i]: v for i, v in self.promoted.items() if i in index},
                       thresholds=(node_threshold, edge_threshold), shares=(result.node_share, result.edge_share))

    def figure(self, prune: bool = True):
        """A plotly drawing on the layers x positions grid (pruned with the default thresholds first, unless
        already pruned or `prune=False`); see analyses.graph_figure."""
        from probe.analyses.graph_figure import graph_figure

        return graph_figure(self.prune() if prune and self.thresholds is None else self)

    def page(self, title: Optional[str] = None, feature_links: Optional[dict] = None) -> str:
        """The interactive page, one self-contained HTML file; see analyses.graph_figure.graph_page."""
        from probe.analyses.graph_figure import graph_page

        return graph_page(self if self.thresholds is not None else self.prune(), title=title, feature_links=feature_links)

    def __repr__(self) -> str:
        counts = ", ".join(f"{int((self.kind == k).sum())} {name}s" for k, name in enumerate(KINDS))
        pruned = f", pruned at {self.thresholds}" if self.thresholds else ""
        return f"AttributionGraph({counts}; {self.n_active} features active{pruned})"


def logit_targets_of(model: HookedDecoder, logits: torch.Tensor, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [n], weights [n]) from `targets`: "top" (the most probable tokens until their probability reaches
    0.95, at most 10, weighted by probability: circuit-tracer's rule), or token ids or one-token strings
    (weighted equally: each is one the caller asked about)."""
    probs = logits.float().softmax(-1)
    if isinstance(targets, str) and targets == "top":
        top = probs.topk(min(MAX_LOGITS, len(probs)))
        n = int((top.values.cumsum(0) < LOGIT_PROBABILITY).sum()) + 1
        return top.indices[:n], top.values[:n]
    items = [targets] if isinstance(targets, str) or is_int(targets) else list(targets)
    if not items:
        raise ValueError("logit_targets is empty: give 'top', token ids or one-token strings")
    ids = []
    for item in items:
        if is_int(item):
            if not 0 <= int(item) < model.cfg.d_vocab_out:
                raise ValueError(f"logit target {int(item)} is outside the vocabulary [0, {model.cfg.d_vocab_out})")
            ids.append(int(item))
        elif isinstance(item, str):
            if model.tokenizer is None:
                raise ValueError(f"logit target {item!r} is text but the model has no tokenizer: give token ids")
            encoded = model.tokenizer.encode(item, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(f"logit target {item!r} is {len(encoded)} tokens; give one token (mind the leading space) "
                                 "or its id")
            ids.append(encoded[0])
        else:
            raise TypeError(f"logit target {item!r} must be a token id or a one-token string (or pass 'top')")
    if len(set(ids)) != len(ids):
        raise ValueError(f"logit_targets names a token twice: {ids}")
    ids = torch.tensor(ids, device=logits.device)
    return ids, torch.full((len(ids),), 1.0 / len(ids))


def attribution_graph(model: HookedDecoder, transcoders: TranscoderSpec, prompt: AnalysisInput, *,
                      max_feature_nodes: Optional[int] = 1024, logit_targets: Union[str, Sequence] = "top",
                      batch_size: int = 64, update_interval: int = 4, without_heads: Sequence = (),
                      progress: bool = False) -> AttributionGraph:
    """The attribution graph of one prompt (text, which gets a BOS, or token ids [pos]); see the module docstring.
    `transcoders`: "bundled" or see analyses.replacement_model.load_transcoders. `max_feature_nodes`: how many
    features get a row, most influential first (None: every active one; the bundled model has k=32 per layer and
    position, 8,192 on 64 tokens). `without_heads` (`"L2H0"`, `"2.0"` or
    (2, 0)): those heads' frozen patterns set to zero, so every edge keeps only the paths that avoid them (a path
    crosses a layer's heads once, so the full graph's edge minus this one is what runs through them); values and
    biases are then the modified model's, and completeness holds in it."""
    refuse_prediction_head(model, "attribution_graph (its logit nodes are W_U directions of the final norm's output)")
    tokens = as_tokens(model, prompt)
    if tokens.shape[0] != 1:
        raise ValueError(f"an attribution graph is of one prompt; got a batch of {tokens.shape[0]}")
    if not (is_int(batch_size) and batch_size > 0) or not (is_int(update_interval) and update_interval > 0):
        raise ValueError(f"batch_size={batch_size!r} and update_interval={update_interval!r} must be positive ints")
    if max_feature_nodes is not None and not (is_int(max_feature_nodes) and max_feature_nodes >= 0):
        raise ValueError(f"max_feature_nodes={max_feature_nodes!r} must be an int >= 0, or None for every active feature")
    tokens = tokens[0]
    transcoders = load_transcoders(model, transcoders)
    state = replacement_state(model, transcoders, tokens)
    for layer, head in _heads(model, without_heads):
        name = f"blocks.{layer}.attn.hook_pattern"
        state.frozen[name] = state.frozen[name].clone()
        state.frozen[name][:, head] = 0.0
    n_layers, n_pos, dtype = model.cfg.n_layers, state.n_pos, state.mlp_out.dtype
    logit_ids, logit_weights = logit_targets_of(model, state.logits[-1], logit_targets)
    probabilities = state.logits[-1].float().softmax(-1)[logit_ids]

    # the active features, sorted by (layer, pos, feature): the source columns, and the rows' targets. The run and
    # its readouts live on the model's device; the rows, targets and values are gathered on the CPU
    device = state.tokens.device
    empty = torch.zeros(0, dtype=torch.long, device=device)
    found = [(layer, *acts.nonzero(as_tuple=True)) for layer, acts in state.features.items()]
    f_layer = torch.cat([empty] + [torch.full_like(p, layer) for layer, p, _ in found])
    f_pos = torch.cat([empty] + [p for _, p, _ in found])
    f_id = torch.cat([empty] + [f for _, _, f in found])
    f_act = torch.cat([torch.zeros(0, dtype=dtype, device=device)] + [state.features[layer][p, f] for layer, p, f in found])
    n_active = len(f_id)
    n_sources = n_active + n_layers * n_pos + n_pos
    n_visit = n_active if max_feature_nodes is None else min(max_feature_nodes, n_active)

    unembed, unembed_bias = demeaned_unembedding(model, logit_ids)
    enc = torch.cat([torch.zeros(0, model.cfg.d_model, dtype=dtype, device=device)]
                    + [transcoders[layer].W_enc.detach()[:, f].T for layer, _, f in found])
    enc_bias = torch.cat([torch.zeros(0, dtype=dtype, device=device)]
                         + [transcoders[layer].b_enc.detach()[f] for layer, _, f in found])

    def spec(targets: torch.Tensor):
        """(layer, pos, direction, bias) of targets: feature indices, or n_active + j for logit j."""
        targets = targets.to(device)
        logit = targets >= n_active
        j, i = (targets - n_active).clamp(min=0), targets.clamp(max=max(n_active - 1, 0))
        layer = torch.where(logit, n_layers, f_layer[i] if n_active else n_layers)
        pos = torch.where(logit, n_pos - 1, f_pos[i] if n_active else n_pos - 1)
        direction = torch.where(logit[:, None], unembed[j], enc[i] if n_active else unembed[j])
        bias = torch.where(logit, unembed_bias[j], enc_bias[i] if n_active else unembed_bias[j])
        return layer, pos, direction.detach(), bias.detach()

    def readout(run, targets: torch.Tensor) -> torch.Tensor:
        """[n]: each target's value in the run, target b read from copy b."""
        layer, pos, direction, bias = spec(targets)
        values = torch.zeros(len(targets), dtype=dtype, device=device)
        total = 0
        for read in layer.unique().tolist():
            rows = (layer == read).nonzero()[:, 0]
            x = run.final if read == n_layers else run.inputs[read]
            v = (x[rows, pos[rows]] * direction[rows]).sum(-1) + bias[rows]
            values = values.index_put((rows,), v.detach())
            total = total + v.sum()
        return values, total

    w_dec = {layer: sae.W_dec.detach() for layer, sae in transcoders.items()}

    def rows_of(run, grads: Sequence[Optional[torch.Tensor]], n: int) -> torch.Tensor:
        """[n source]: each target's edges from every source, from the gradients at the sources' leaves."""
        grads = [torch.zeros_like(source[:n]) if g is None else g[:n] for g, source in zip(grads, run.sources)]
        out = torch.zeros(n, n_sources, dtype=dtype, device=device)
        for layer in range(n_layers):
            g = grads[1 + layer]  # [n pos d_model]
            cols = (f_layer == layer).nonzero()[:, 0]
            if len(cols):
                projected = g @ w_dec[layer].T  # [n pos d_sae]: the gradient along every decoder row
                out[:, cols] = projected[:, f_pos[cols], f_id[cols]] * f_act[cols]
            start = n_active + layer * n_pos
            out[:, start:start + n_pos] = (g * state.errors[layer]).sum(-1)
        out[:, n_active + n_layers * n_pos:] = (grads[0] * state.embeddings).sum(-1)
        return out

    n_logits = len(logit_ids)
    run = linearised_run(model, transcoders, state, batch=min(batch_size, max(n_visit, n_logits, 1)))
    rows = torch.zeros(n_logits + n_visit, n_sources, dtype=dtype)
    row_target = torch.zeros(n_logits + n_visit, dtype=torch.long)  # feature index, or n_active + logit index
    values = torch.zeros(n_logits + n_visit, dtype=dtype)
    filled = 0
    bar = tqdm(total=n_logits + n_visit, desc="attribution rows", disable=not progress)

    def compute(run, targets: torch.Tensor) -> None:
        nonlocal filled
        for chunk in targets.split(run.embed.shape[0]):
            chunk_values, total = readout(run, chunk)
            grads = torch.autograd.grad(total, run.sources, retain_graph=True, allow_unused=True)
            rows[filled:filled + len(chunk)] = rows_of(run, grads, len(chunk))
            row_target[filled:filled + len(chunk)] = chunk
            values[filled:filled + len(chunk)] = chunk_values
            filled += len(chunk)
            bar.update(len(chunk))

    compute(run, n_active + torch.arange(n_logits))
    visited = torch.zeros(n_active, dtype=torch.bool)
    while int(visited.sum()) < n_visit:
        if n_visit == n_active:
            pending = torch.arange(n_active)
        else:  # influence from the rows so far: a feature not yet visited passes none on
            ranking = _partial_influence(rows[:filled], row_target[:filled], n_active, logit_weights.cpu().to(dtype))
            order = ranking.argsort(descending=True)
            pending = order[~visited[order]][:min(update_interval * run.embed.shape[0], n_visit - int(visited.sum()))]
        compute(run, pending)
        visited[pending] = True
    bar.close()
    del run  # and with it the forward's graph

    # biases: each target's value with every source set to zero, in one more pass
    zero = linearised_run(model, transcoders, state, batch=1, zero_sources=True)
    with torch.no_grad():
        layer, pos, direction, bias_terms = spec(row_target)
        biases = torch.stack([(zero.final[0, p] if l == n_layers else zero.inputs[l][0, p]) @ d + b
                              for l, p, d, b in zip(layer.tolist(), pos.tolist(), direction, bias_terms)]) \
            if len(row_target) else torch.zeros(0, dtype=dtype)
        biases = biases.cpu()
    del zero
    f_layer, f_pos, f_id, f_act = f_layer.cpu(), f_pos.cpu(), f_id.cpu(), f_act.detach().cpu()  # for the nodes below

    selected = visited.nonzero()[:, 0]  # sorted: features stay in (layer, pos, feature) order
    columns = torch.cat([selected, torch.arange(n_active, n_sources)])
    unselected = torch.ones(n_sources, dtype=torch.bool)
    unselected[columns] = False
    by_target = {int(t): r for r, t in enumerate(row_target.tolist())}
    feature_rows = torch.tensor([by_target[int(i)] for i in selected], dtype=torch.long)
    logit_rows = torch.tensor([by_target[n_active + j] for j in range(n_logits)], dtype=torch.long)
    n_sel, n_src = len(selected), len(columns)
    n_nodes = n_src + n_logits
    adjacency = torch.zeros(n_nodes, n_nodes, dtype=dtype)
    target_rows = torch.cat([feature_rows, logit_rows])
    target_nodes = torch.cat([torch.arange(n_sel), n_src + torch.arange(n_logits)])
    adjacency[target_nodes[:, None], torch.arange(n_src)[None, :]] = rows[target_rows][:, columns]

    def per_node(target_values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(n_nodes, dtype=dtype)
        out[target_nodes] = target_values
        return out

    kind = torch.cat([torch.full((n_sel,), FEATURE), torch.full((n_layers * n_pos,), ERROR),
                      torch.full((n_pos,), EMBEDDING), torch.full((n_logits,), LOGIT)])
    grid_layer = torch.arange(n_layers).repeat_interleave(n_pos)
    grid_pos = torch.arange(n_pos).repeat(n_layers)
    cpu_tokens = tokens.cpu()
    decode = token_decoder(model)
    logit_cpu = logit_ids.cpu()
    strings = decode(cpu_tokens.tolist())
    logit_strings = decode(logit_cpu.tolist())
    promoted_ids, promoted_logits = promoted_tokens(model, torch.stack(
        [w_dec[int(f_layer[i])][f_id[i]] for i in selected]) if n_sel else state.embeddings[:0])
    promoted = {i: list(zip(decode(promoted_ids[i].tolist()), promoted_logits[i].tolist())) for i in range(n_sel)}
    graph = AttributionGraph(
        tokens=cpu_tokens, token_strings=strings, kind=kind,
        layer=torch.cat([f_layer[selected], grid_layer, torch.full((n_pos,), -1), torch.full((n_logits,), n_layers)]),
        pos=torch.cat([f_pos[selected], grid_pos, torch.arange(n_pos), torch.full((n_logits,), n_pos - 1)]),
        feature=torch.cat([f_id[selected], torch.full((n_layers * n_pos + n_pos + n_logits,), -1)]),
        token=torch.cat([torch.full((n_sel + n_layers * n_pos,), -1), cpu_tokens, logit_cpu]),
        activation=torch.cat([f_act[selected], state.errors.norm(dim=-1).flatten().cpu(),
                              state.embeddings.norm(dim=-1).cpu(), values[logit_rows]]),
        value=per_node(values[target_rows]), bias=per_node(biases[target_rows]),
        unvisited=per_node(rows[target_rows][:, unselected].sum(-1)),
        adjacency=adjacency.cpu(), logit_probabilities=probabilities.cpu(), logit_weights=logit_weights.cpu().float(),
        n_layers=n_layers, n_active=n_active,
        node_strings=[""] * (n_sel + n_layers * n_pos) + strings + logit_strings, promoted=promoted)
    return graph


def _partial_influence(rows: torch.Tensor, row_target: torch.Tensor, n_active: int, logit_weights: torch.Tensor):
    """[feature]: each active feature's influence on the logits through the rows computed so far (a feature's row
    passes its influence on to its sources; features without one yet pass none)."""
    normalised = row_normalised(rows)  # [row source]
    is_logit = row_target >= n_active
    start = torch.where(is_logit, logit_weights[(row_target - n_active).clamp(min=0)], 0.0)
    feature_of_row = row_target.clamp(max=max(n_active - 1, 0))
    total = torch.zeros(n_active, dtype=rows.dtype)
    reach = start
    for _ in range(len(rows) + 1):
        passed = reach @ normalised  # [source]
        if not bool(passed.any()):
            break
        total += passed[:n_active]
        reach = torch.where(is_logit, 0.0, passed[feature_of_row])
    return total


def _heads(model: HookedDecoder, heads: Sequence) -> list[tuple[int, int]]:
    # one head on its own ("L2H0", or (2, 0)) is that head, not a sequence of its characters or numbers
    if isinstance(heads, str) or (len(heads) == 2 and all(is_int(x) for x in heads)):
        heads = [heads]
    out = []
    for item in heads:
        layer, head = parse_head(item) if isinstance(item, str) else (int(item[0]), int(item[1]))
        if not (0 <= layer < model.cfg.n_layers and 0 <= head < model.cfg.layer_heads(layer)):
            raise ValueError(f"without_heads: {head_label(layer, head)} is not a head of this model "
                             f"({model.cfg.n_layers} layers of {model.cfg.n_heads} heads)")
        out.append((layer, head))
    return out
