"""Attribution graphs against an oracle written here: GPT-2 computed from the transformers checkpoint's own weights
(float64), linearised by hand (patterns and norm scales frozen at the clean run's values, each MLP's output
replaced by the sum of its nodes' writes, each write scaled by a multiplier m = 1), so that an edge s -> t is
d t / d m_s by autograd, and a target's bias terms are its value with every m = 0."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from probe.analyses.attribution_graph import EMBEDDING, ERROR, FEATURE, LOGIT, attribution_graph
from probe.analyses.graph_interventions import FeatureEdit, intervene
from probe.analyses.graph_pruning import influence, prune, row_normalised
from probe.analyses.replacement_model import load_transcoders, replacement_logits
from probe import SAEConfig, SparseAutoencoder

D_SAE, K, N_POS = 32, 4, 6
TOL = 1e-6  # the model is float64 but probe's LayerNorm computes in float32 (as the fused kernel does)


def random_transcoders(model, seed=0):
    out = []
    gen = torch.Generator().manual_seed(seed)
    d = model.cfg.d_model
    for layer in range(model.cfg.n_layers):
        sae = SparseAutoencoder(SAEConfig(d_in=d, d_sae=D_SAE, hook_name=f"blocks.{layer}.ln2.hook_normalized",
                                          architecture="topk", k=K, apply_b_dec_to_input=False,
                                          hook_name_out=f"blocks.{layer}.hook_mlp_out", d_out=d))
        with torch.no_grad():
            for name, param in sae.named_parameters():
                param.copy_({"W_enc": 0.3, "b_enc": 0.1, "W_dec": 0.2, "b_dec": 0.05}[name]
                            * torch.randn(param.shape, generator=gen))
        out.append(sae.double())
    return out


@pytest.fixture(scope="module")
def model64(tiny_model):
    return copy.deepcopy(tiny_model).double()


@pytest.fixture(scope="module")
def weights(tiny_hf):
    return {name: p.detach().double() for name, p in tiny_hf.state_dict().items()}


@pytest.fixture(scope="module")
def setup(model64):
    tokens = torch.randint(1, model64.cfg.d_vocab, (N_POS,), generator=torch.Generator().manual_seed(3))
    tokens[0] = model64.tokenizer.bos_id
    return model64, random_transcoders(model64), tokens


@pytest.fixture(scope="module")
def full_graph(setup):
    model, saes, tokens = setup
    return attribution_graph(model, saes, tokens, logit_targets="top", batch_size=32)


def gelu_new(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def norm(x, w, b, scale=None):
    centred = x - x.mean(-1, keepdim=True)
    scale = (centred.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() if scale is None else scale
    return centred / scale, centred / scale * w + b, scale


def gpt2(sd, tokens, n_head, *, frozen=None, mlp=None, embed=None, attn_frozen=None):
    """The forward of the checkpoint `sd`; `frozen` (from a clean run's record) fixes patterns and scales,
    `attn_frozen` only the patterns; `mlp(layer, normalized, real_out)` replaces an MLP's output, `embed` the input."""
    n = len(tokens)
    x = sd["transformer.wte.weight"][tokens] + sd["transformer.wpe.weight"][:n] if embed is None else embed
    rec = {"embed": x, "normalized": [], "mlp_out": [], "scale": {}, "pattern": {}}
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    layers = sorted({int(k.split(".")[2]) for k in sd if k.startswith("transformer.h.")})
    for L in layers:
        p = f"transformer.h.{L}."
        pin = frozen or {}
        _, h, rec["scale"][f"ln1.{L}"] = norm(x, sd[p + "ln_1.weight"], sd[p + "ln_1.bias"], pin.get("scale", {}).get(f"ln1.{L}"))
        q, k, v = (h @ sd[p + "attn.c_attn.weight"] + sd[p + "attn.c_attn.bias"]).split(x.shape[-1], dim=-1)
        q, k, v = (t.view(n, n_head, -1).transpose(0, 1) for t in (q, k, v))
        if frozen is not None or attn_frozen is not None:
            pattern = (frozen or attn_frozen)["pattern"][L]
        else:
            scores = (q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])).masked_fill(~causal, float("-inf"))
            pattern = scores.softmax(-1)
        rec["pattern"][L] = pattern
        z = (pattern @ v).transpose(0, 1).reshape(n, -1)
        x = x + z @ sd[p + "attn.c_proj.weight"] + sd[p + "attn.c_proj.bias"]
        normalized, h2, rec["scale"][f"ln2.{L}"] = norm(x, sd[p + "ln_2.weight"], sd[p + "ln_2.bias"],
                                                        pin.get("scale", {}).get(f"ln2.{L}"))
        real = gelu_new(h2 @ sd[p + "mlp.c_fc.weight"] + sd[p + "mlp.c_fc.bias"]) @ sd[p + "mlp.c_proj.weight"] \
            + sd[p + "mlp.c_proj.bias"]
        out = real if mlp is None else mlp(L, normalized, real)
        rec["normalized"].append(normalized)
        rec["mlp_out"].append(out)
        x = x + out
    _, final, rec["scale"]["ln_f"] = norm(x, sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"],
                                          (frozen or {}).get("scale", {}).get("ln_f"))
    rec["final"] = final
    rec["logits"] = final @ sd["transformer.wte.weight"].T
    return rec


def topk_features(sae, x):
    pre = x @ sae.W_enc.detach() + sae.b_enc.detach()
    top = pre.topk(sae.cfg.k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, top.indices, top.values.clamp(min=0))


class Oracle:
    """The linearised replacement model by hand: multipliers on every node's write, targets as functions of them."""

    def __init__(self, sd, saes, tokens, n_head):
        self.sd, self.saes, self.tokens, self.n_head = sd, saes, tokens, n_head
        self.clean = gpt2(sd, tokens, n_head)
        self.acts = [topk_features(sae, self.clean["normalized"][L]) for L, sae in enumerate(saes)]
        self.errors = [self.clean["mlp_out"][L] - self.acts[L] @ sae.W_dec.detach() - sae.b_dec.detach()
                       for L, sae in enumerate(saes)]

    def run(self, m_feat, m_err, m_emb):
        """m_feat [layer pos d_sae], m_err [layer pos], m_emb [pos]: each node's write times its multiplier."""
        def mlp(L, normalized, real):
            sae = self.saes[L]
            return (m_feat[L] * self.acts[L]) @ sae.W_dec.detach() + sae.b_dec.detach() + m_err[L][:, None] * self.errors[L]

        return gpt2(self.sd, self.tokens, self.n_head, frozen=self.clean, mlp=mlp, embed=m_emb[:, None] * self.clean["embed"])

    def multipliers(self, value):
        n_layers, n = len(self.saes), len(self.tokens)
        return (torch.full((n_layers, n, D_SAE), value, dtype=torch.float64, requires_grad=True),
                torch.full((n_layers, n), value, dtype=torch.float64, requires_grad=True),
                torch.full((n,), value, dtype=torch.float64, requires_grad=True))

    def target(self, rec, kind, layer, pos, index):
        if kind == FEATURE:
            sae = self.saes[layer]
            return rec["normalized"][layer][pos] @ sae.W_enc.detach()[:, index] + sae.b_enc.detach()[index]
        W_U = self.sd["transformer.wte.weight"].T
        return rec["final"][-1] @ (W_U[:, index] - W_U.mean(dim=1))


def test_replacement_reproduces_the_logits_of_the_bundled_model(bundled_model):
    """The shipped transcoders with their error terms: the model's own logits (1e-4), though each explains only
    ~80% of its MLP's variance (so without the error terms they would not)."""
    tokens = bundled_model.to_tokens("ROMEO. Good night, good night. JULIET. Good night")[0]
    transcoders = load_transcoders(bundled_model, "bundled")
    with torch.no_grad():
        expected = bundled_model(tokens[None])[0]
    assert (replacement_logits(bundled_model, transcoders, tokens) - expected).abs().max() < 1e-4
    # and the linearised run reads the same demeaned logits from its frozen final norm
    graph = attribution_graph(bundled_model, transcoders, tokens, max_feature_nodes=0)
    logits = graph.kind == LOGIT
    demeaned = expected[-1] - expected[-1].mean()
    assert torch.allclose(graph.value[logits], demeaned[graph.token[logits]], atol=1e-4)
    assert torch.equal(graph.token[logits], expected[-1].topk(int(logits.sum())).indices)


def test_every_edge_is_the_derivative_times_the_activation(setup, weights, full_graph):
    model, saes, tokens = setup
    graph = full_graph
    oracle = Oracle(weights, saes, tokens, model.cfg.n_heads)
    # the oracle's active features are the graph's feature nodes, in its (layer, pos, feature) order
    active = torch.stack(oracle.acts).nonzero()  # [feature 3]: (layer, pos, feature), in that order
    features = graph.kind == FEATURE
    nodes = torch.stack([graph.layer[features], graph.pos[features], graph.feature[features]], 1)
    assert torch.equal(nodes, active)
    acts = torch.stack(oracle.acts)
    assert torch.allclose(graph.activation[features].double(), acts[tuple(active.T)], atol=TOL)

    m = oracle.multipliers(1.0)
    rec = oracle.run(*m)
    zero = oracle.run(*oracle.multipliers(0.0))
    assert torch.allclose(rec["logits"], oracle.clean["logits"], atol=TOL)  # the oracle's replacement is exact
    targets = (features | (graph.kind == LOGIT)).nonzero()[:, 0].tolist()
    for t in targets:
        kind, layer, pos = int(graph.kind[t]), int(graph.layer[t]), int(graph.pos[t])
        index = int(graph.feature[t]) if kind == FEATURE else int(graph.token[t])
        value = oracle.target(rec, kind, layer, pos, index)
        d_feat, d_err, d_emb = torch.autograd.grad(value, m, retain_graph=True, allow_unused=True)
        d_feat = torch.zeros_like(m[0]) if d_feat is None else d_feat
        d_err = torch.zeros_like(m[1]) if d_err is None else d_err
        d_emb = torch.zeros_like(m[2]) if d_emb is None else d_emb
        expected = torch.cat([d_feat[tuple(active.T)], d_err.flatten(), d_emb]).double()
        row = graph.adjacency[t, :len(expected)].double()
        assert torch.allclose(row, expected, atol=TOL), (t, (row - expected).abs().max())
        assert not graph.adjacency[t, len(expected):].any()  # nothing reads a logit
        # completeness: the incoming edges and the bias terms (everything but the nodes) make up the value
        bias = oracle.target(zero, kind, layer, pos, index)
        assert abs(float(graph.value[t]) - float(value.detach())) < TOL
        assert abs(float(graph.bias[t]) - float(bias.detach())) < TOL
        assert abs(float(row.sum()) + float(bias.detach()) - float(value.detach())) < TOL
    assert not graph.adjacency[(graph.kind == ERROR) | (graph.kind == EMBEDDING)].any()
    assert not graph.unvisited.any()


def test_without_a_head_the_edges_keep_the_paths_that_avoid_it(setup, weights):
    model, saes, tokens = setup
    graph = attribution_graph(model, saes, tokens, max_feature_nodes=0, without_heads=["L1H2", (0, 1)])
    assert_logit_rows_without(graph, weights, setup, [(1, 2), (0, 1)])
    with pytest.raises(ValueError, match="not a head"):
        attribution_graph(model, saes, tokens, max_feature_nodes=0, without_heads=["L5H0"])


def test_a_capped_graph_visits_the_most_influential_features_and_keeps_completeness(setup, full_graph):
    model, saes, tokens = setup
    full = full_graph
    capped = attribution_graph(model, saes, tokens, max_feature_nodes=12, batch_size=4, update_interval=1)
    assert int((capped.kind == FEATURE).sum()) == 12
    targets = (capped.kind == FEATURE) | (capped.kind == LOGIT)
    # the edges from features it never visited are counted apart, so completeness still holds
    total = capped.adjacency.sum(1) + capped.unvisited + capped.bias
    assert torch.allclose(total[targets], capped.value[targets], atol=TOL)
    assert capped.unvisited[capped.kind == LOGIT].abs().sum() > 0
    # the logit rows are the full graph's, restricted to the columns kept
    keys = lambda g: list(zip(*(t.tolist() for t in (g.kind, g.layer, g.pos, g.feature, g.token))))  # noqa: E731
    index = {key: i for i, key in enumerate(keys(full))}
    kept = torch.tensor([index[key] for key in keys(capped)])
    logit_rows = (capped.kind == LOGIT).nonzero()[:, 0]
    assert torch.allclose(capped.adjacency[logit_rows][:, :-len(logit_rows)],
                          full.adjacency[kept[logit_rows]][:, kept[:-len(logit_rows)]])
    # the first features visited are the ones the logits' own rows point to most, by normalised direct effect
    weights = capped.logit_weights.double()
    direct = weights @ row_normalised(full.adjacency[full.kind == LOGIT].double())
    best = int(direct[:int((full.kind == FEATURE).sum())].argmax())
    assert keys(full)[best] in set(keys(capped))


def test_influence_and_pruning_keep_the_stated_share():
    gen = torch.Generator().manual_seed(0)
    n = 14  # nodes 0..9 prunable (features), 10..11 embeddings, 12..13 logits; edges only from higher index to lower
    adjacency = torch.randn(n, n, generator=gen, dtype=torch.float64).tril(-1).flip(0).flip(1)
    adjacency[10:12] = 0  # embeddings read nothing
    adjacency[:, 12:] = 0  # nothing reads a logit
    adjacency[12:, :] = torch.randn(2, n, generator=gen, dtype=torch.float64)
    adjacency[12:, 12:] = 0
    weights = torch.zeros(n, dtype=torch.float64)
    weights[12:] = torch.tensor([0.7, 0.3], dtype=torch.float64)
    B = row_normalised(adjacency)
    assert torch.allclose(B[B.sum(1) > 0].sum(1), torch.ones(int((B.sum(1) > 0).sum()), dtype=torch.float64))
    expected = weights @ (torch.linalg.inv(torch.eye(n, dtype=torch.float64) - B) - torch.eye(n, dtype=torch.float64))
    assert torch.allclose(influence(B, weights), expected)
    prunable = torch.zeros(n, dtype=torch.bool)
    prunable[:10] = True
    for threshold in (0.5, 0.8, 0.95):
        result = prune(adjacency, weights, prunable, prunable, node_threshold=threshold, edge_threshold=1.0)
        kept = result.node_mask[:10]
        share = float(expected[:10][kept].sum() / expected[:10].sum())
        assert share >= threshold and abs(share - result.node_share) < 1e-12
        # and it is the smallest such set: without its least influential node it falls short
        assert float(expected[:10][kept].sum() - expected[:10][kept].min()) / float(expected[:10].sum()) < threshold
        assert result.node_mask[10:].all()
    result = prune(adjacency, weights, prunable, prunable, node_threshold=1.0, edge_threshold=0.9)
    scores = B * (expected + weights)[:, None]  # every node kept by the node step: the whole graph's edge scores
    ordered = scores.flatten().sort(descending=True).values
    n_top = int((ordered.cumsum(0) < 0.9 * ordered.sum()).sum()) + 1  # the fewest edges holding 90%
    top = scores >= ordered[n_top - 1]
    # the edges kept are those, less any left dangling: a feature without outgoing or incoming edges goes
    assert not (result.edge_mask & ~top).any()
    dropped = top & ~result.edge_mask
    assert dropped.any() and (~result.node_mask[dropped.nonzero()]).any(dim=1).all()
    assert (result.edge_mask[:, ~result.node_mask] == 0).all()
    # the shares are those of what is left: here under the 90% the edge step kept (reported before the stranded went)
    assert abs(result.edge_share - float(scores[result.edge_mask].sum() / scores.sum())) < 1e-12
    assert result.edge_share < 0.9 <= float(scores[top].sum() / scores.sum())
    assert abs(result.node_share - float(expected[:10][result.node_mask[:10]].sum() / expected[:10].sum())) < 1e-12


def test_a_pruned_graph_keeps_its_shares(setup, full_graph):
    model, saes, tokens = setup
    graph = full_graph
    pruned = graph.prune(node_threshold=0.8, edge_threshold=0.98)
    # the influence share by hand: the kept features' and errors' influence on the unpruned graph over all of theirs
    full = influence(row_normalised(graph.adjacency.double()), graph.logit_weight_vector().double())
    prunable = (graph.kind == FEATURE) | (graph.kind == ERROR)
    kept = (pruned.kind == FEATURE) | (pruned.kind == ERROR)
    assert abs(pruned.shares[0] - float(pruned.influence[kept].double().sum() / full[prunable].sum())) < 1e-5
    assert 0.5 < pruned.shares[0] <= 1.0 and 0.5 < pruned.shares[1] <= 1.0
    assert pruned.n_nodes < graph.n_nodes
    assert int((pruned.kind == EMBEDDING).sum()) == len(tokens) and int((pruned.kind == LOGIT).sum()) == int(
        (graph.kind == LOGIT).sum())
    edges = pruned.to_frame("edges")
    assert set(edges.source) | set(edges.target) <= set(pruned.labels())
    assert len(edges) == int((pruned.adjacency != 0).sum())
    figure = pruned.figure()  # already pruned: drawn as it is, every node a marker
    assert sum(len(trace.x) for trace in figure.data if trace.mode == "markers") == pruned.n_nodes


@pytest.mark.parametrize("freeze_attention", [True, False])
def test_intervention_matches_a_hand_computation(setup, weights, freeze_attention):
    model, saes, tokens = setup
    oracle = Oracle(weights, saes, tokens, model.cfg.n_heads)
    pos = 2
    feature = int(oracle.acts[0][pos].argmax())
    old = oracle.acts[0][pos, feature]
    edit = FeatureEdit(layer=0, pos=pos, feature=feature, scale=3.0)
    delta = (3.0 - 1.0) * old * saes[0].W_dec.detach()[feature]

    def mlp(L, normalized, real):
        return real + (delta * (torch.arange(len(tokens)) == pos)[:, None] if L == 0 else 0)

    expected = gpt2(weights, tokens, model.cfg.n_heads, mlp=mlp,
                    attn_frozen=oracle.clean if freeze_attention else None)["logits"]
    result = intervene(model, saes, tokens, [edit], freeze_attention=freeze_attention)
    assert torch.allclose(result.clean, oracle.clean["logits"], atol=TOL)
    assert torch.allclose(result.edited, expected, atol=TOL)
    assert result.change[pos:].abs().max() > 1e-3 and result.change[:pos].abs().max() < TOL
    set_to = intervene(model, saes, tokens, [FeatureEdit(0, pos, feature, value=float(3.0 * old))],
                       freeze_attention=freeze_attention)
    assert torch.allclose(set_to.edited, expected, atol=TOL)


def test_bad_inputs_say_what_to_do(setup):
    model, saes, tokens = setup
    with pytest.raises(ValueError, match="not a transcoder"):
        attribution_graph(model, [SparseAutoencoder(SAEConfig(d_in=64, d_sae=8, hook_name="blocks.0.hook_resid_pre"))],
                          tokens)
    with pytest.raises(ValueError, match="two transcoders"):
        attribution_graph(model, [saes[0], saes[0]], tokens)
    with pytest.raises(ValueError, match="is 2 tokens|one token"):
        attribution_graph(model, saes, tokens, logit_targets=["the cat sat"])
    with pytest.raises(ValueError, match="d_model"):
        load_transcoders(model, "bundled")
    # a mapping's keys are the layers meant: a transcoder under another layer's key was used at its own layer
    with pytest.raises(ValueError, match="given for layer 1 writes blocks.0.hook_mlp_out"):
        load_transcoders(model, {1: saes[0], 0: saes[1]})
    assert {layer: sae.cfg.hook_name_out for layer, sae in load_transcoders(model, {1: saes[1], 0: saes[0]}).items()} \
        == {0: "blocks.0.hook_mlp_out", 1: "blocks.1.hook_mlp_out"}
    with pytest.raises(ValueError, match="exactly one"):
        FeatureEdit(0, 1, 2)
    with pytest.raises(ValueError, match="outside"):
        intervene(model, saes, tokens, [FeatureEdit(0, 99, 2, value=1.0)])


def test_probe_graph_writes_the_page_and_tables_with_tokens_escaped(tiny_dir, tmp_path, capsys):
    import pandas as pd

    from probe.cli import cli

    from probe import HookedDecoder

    tiny = HookedDecoder.from_pretrained(tiny_dir)
    dirs = []
    for layer, sae in enumerate(random_transcoders(tiny)):
        dirs.append(str(sae.float().save_pretrained(tmp_path / f"tc-{layer}")))
    prompt = "<script>alert('x')</script> & the dog"
    out = tmp_path / "graph"
    code = cli.main(["graph", "--model", str(tiny_dir), "--prompt", prompt, "--transcoders", ",".join(dirs),
                     "--out", str(out), "--quiet"])
    assert code == 0, capsys.readouterr().err
    page = (out / "graph.html").read_text()
    assert "<script>alert" not in page and "&lt;script&gt;alert" in page  # the title; the data is \u003c-escaped
    nodes, edges = pd.read_csv(out / "nodes.csv"), pd.read_csv(out / "edges.csv")
    graph = attribution_graph(tiny, [SparseAutoencoder.from_pretrained(d) for d in dirs], prompt,
                              max_feature_nodes=1024).prune()
    assert list(nodes.node) == graph.labels() and len(edges) == int((graph.adjacency != 0).sum())
    assert code == 0 and cli.main(["graph", "--model", str(tiny_dir), "--prompt", "x", "--transcoders", "bundled",
                                   "--out", str(tmp_path / "bad"), "--quiet"]) == 2
    assert "d_model" in capsys.readouterr().err


def post_norm_copy(model):
    """The same weights in post-norm blocks (GPT-1's layout): h = ln1(x + attn(x)); y = ln2(h + mlp(h))."""
    import dataclasses

    from probe import HookedDecoder, NormPlacement

    post = HookedDecoder(dataclasses.replace(model.cfg, norm_placement=NormPlacement.POST), model.tokenizer)
    post.load_state_dict(model.state_dict())
    return post.eval()


def test_a_post_norm_models_ln2_comes_after_its_mlp_so_a_transcoder_may_not_read_it(tiny_model):
    post = post_norm_copy(tiny_model)
    tokens = post.to_tokens("the dog sleeps")
    # by hand: ln2 of a post-norm block normalises resid_mid + mlp_out, so it moves when the MLP's output does
    names = ["blocks.0.ln2.hook_normalized", "blocks.0.hook_mlp_in"]
    with torch.no_grad():
        _, clean = post.run_with_cache(tokens, names=names)
        with post.hooks([("blocks.0.hook_mlp_out", lambda a, hook: torch.zeros_like(a))]):
            _, ablated = post.run_with_cache(tokens, names=names)
    assert (clean[names[0]] - ablated[names[0]]).abs().max() > 1e-3  # after the MLP
    assert torch.equal(clean[names[1]], ablated[names[1]])  # what the MLP reads: before it
    saes = random_transcoders(post)
    # a transcoder reading its own MLP's output made a cycle (the graph failed as "the adjacency has a cycle")
    with pytest.raises(ValueError, match="after"):
        load_transcoders(post, [saes[0].float()])
    import dataclasses

    for sae in saes:  # the MLP's own input is fine
        sae.cfg = dataclasses.replace(sae.cfg, hook_name=sae.cfg.hook_name.replace("ln2.hook_normalized", "hook_mlp_in"))
    assert sorted(load_transcoders(post, [s.float() for s in saes])) == [0, 1]


@pytest.mark.parametrize("head", ["L1H2", "1.2", (1, 2)])
def test_one_head_without_a_list_is_that_head(setup, weights, head):
    model, saes, tokens = setup
    # "L1H2" was read as the heads "L", "1", "H", "2" and refused ("'L' is not a head"); (1, 2) raised a TypeError
    graph = attribution_graph(model, saes, tokens, max_feature_nodes=0, without_heads=head)
    assert_logit_rows_without(graph, weights, setup, [(1, 2)], values=True)


def assert_logit_rows_without(graph, weights, setup, heads, values=False):
    """Each logit's edges from the errors and embeddings (and its value) equal the hand-written oracle's with those
    heads' frozen patterns zeroed."""
    model, saes, tokens = setup
    oracle = Oracle(weights, saes, tokens, model.cfg.n_heads)
    for layer, head in heads:
        oracle.clean["pattern"][layer] = oracle.clean["pattern"][layer].clone()
        oracle.clean["pattern"][layer][head] = 0.0
    m = oracle.multipliers(1.0)
    rec = oracle.run(*m)
    for t in (graph.kind == LOGIT).nonzero()[:, 0].tolist():
        value = oracle.target(rec, LOGIT, 2, len(tokens) - 1, int(graph.token[t]))
        _, d_err, d_emb = torch.autograd.grad(value, m, retain_graph=True)
        expected = torch.cat([d_err.flatten(), d_emb])
        assert torch.allclose(graph.adjacency[t, :len(expected)].double(), expected, atol=TOL)
        if values:
            assert abs(float(graph.value[t]) - float(value.detach())) < TOL


def test_a_title_naming_the_data_placeholder_is_shown_as_written(full_graph):
    """The page's title and data are filled in one pass: a title holding "__DATA__" stays text, and the page's
    data is there once, where the template has it."""
    import html
    import json
    import re

    title = "runs <__DATA__> & __TITLE__"
    page = full_graph.prune().page(title=title)
    assert page.count('id="graph-data"') == 1
    assert f"<title>{html.escape(title)}</title>" in page and f"<h1>{html.escape(title)}</h1>" in page
    data = re.search(r'<script type="application/json" id="graph-data">(.*?)</script>', page, re.S).group(1)
    assert len(json.loads(data)["nodes"]) == full_graph.prune().n_nodes
