"""Circuits on hybrid and recurrent models (each recurrent layer one mixer node) and on gated attention (the gate
reads each head's queries' input), against transformers' own autograd and brute-force patching.

The oracle recomputes each reader inside transformers' forward from the residual it reads plus a zero leaf of its
own (as tests/test_edge_attribution.py does for attention models): a mixer's input is ln1's input, recomputed through
ln1 for the mixer alone; a gated head's q reader is its q and gate columns of q_proj together.
"""
from __future__ import annotations

import pytest
import torch

from probe import HookedDecoder
from probe.analyses import circuit_graph, faithfulness, logit_diff_metric, path_patch
from probe.analyses.edge_attribution import edge_attribution
from probe.analyses.faithfulness import CircuitRunner

from test_edge_attribution import ANSWERS, COUNTERFACTUALS, assert_scores_close, oracle_scores, prompts
from test_variants import build


class HybridEdges:
    """Writers' outputs and readers' input gradients of a transformers Qwen3.5 (Gated DeltaNet layers and gated
    attention), Mamba-2 (mixers alone, no MLPs) or LFM2 (short convolutions and attention) model."""

    def __init__(self, hf, kind: str):
        self.hf, self.kind, cfg = hf, kind, hf.config
        body = hf.backbone if kind == "mamba2" else hf.model
        self.layers = body.layers
        self.final = {"mamba2": "norm_f", "lfm2": "embedding_norm"}.get(kind, "norm")
        self.final = getattr(body, self.final)
        types = getattr(cfg, "layer_types", None) or ["mixer"] * cfg.num_hidden_layers
        self.mixer = [t != "full_attention" for t in types] if kind != "mamba2" else [True] * cfg.num_hidden_layers
        self.H = getattr(cfg, "num_attention_heads", 0)
        self.KV = getattr(cfg, "num_key_value_heads", None) or self.H
        self.dh = getattr(cfg, "head_dim", None) or (cfg.hidden_size // self.H if self.H else 0)

    def _parts(self, layer, mixer: bool):
        """(ln1, mixer or attention module, ln2, mlp)."""
        if self.kind == "mamba2":
            return layer.norm, layer.mixer, None, None
        if self.kind == "lfm2":
            return layer.operator_norm, layer.conv if mixer else layer.self_attn, layer.ffn_norm, layer.feed_forward
        return layer.input_layernorm, layer.linear_attn if mixer else layer.self_attn, layer.post_attention_layernorm, layer.mlp

    def _projections(self, attn):
        """[(module, [(reader slot, columns)])]: a gated head's q reader takes its q and gate columns (Qwen3.5 puts
        each head's gate beside its query in q_proj)."""
        H, KV, dh = self.H, self.KV, self.dh
        q_width = 2 * dh if self.kind == "qwen3_5" else dh
        return [(attn.q_proj, [(h, slice(h * q_width, (h + 1) * q_width)) for h in range(H)]),
                (attn.k_proj, [(H + g, slice(g * dh, (g + 1) * dh)) for g in range(KV)]),
                (attn.v_proj, [(H + KV + g, slice(g * dh, (g + 1) * dh)) for g in range(KV)])]

    def run(self, tokens):
        """(writers [batch pos writer d_model], reader gradients [batch pos reader d_model]) of one forward."""
        handles, leaves, writes, busy = [], {}, {}, set()

        def own_leaf(key, x):
            leaves[key] = torch.zeros_like(x, requires_grad=True)
            return x + leaves[key]

        def recomputed(key):  # a module's output recomputed from its input plus the reader's own leaf
            def hook(mod, args, out):
                if mod in busy:
                    return None
                busy.add(mod)
                try:
                    return mod(own_leaf(key, args[0]))
                finally:
                    busy.discard(mod)
            return hook

        def kept(key):
            return lambda mod, args, out: writes.__setitem__(key, out[0] if isinstance(out, tuple) else out)

        for l, layer in enumerate(self.layers):
            ln1, mixer, ln2, mlp = self._parts(layer, self.mixer[l])
            if self.mixer[l]:
                handles += [ln1.register_forward_hook(recomputed((l, "mixer"))),
                            mixer.register_forward_hook(kept(("mixer", l)))]
            else:
                resid = {}
                handles.append(ln1.register_forward_pre_hook(
                    lambda mod, args, resid=resid: None if busy else resid.__setitem__("x", args[0])))

                def project(mod, args, out, l=l, slots=None, ln1=ln1, resid=resid):
                    if mod in busy:
                        return None
                    busy.add(mod)
                    try:
                        out = out.clone()
                        for slot, cols in slots:
                            out[..., cols] = mod(ln1(own_leaf((l, slot), resid["x"])))[..., cols]
                        return out
                    finally:
                        busy.discard(mod)

                for module, slots in self._projections(mixer):
                    handles.append(module.register_forward_hook(lambda mod, a, o, s=slots: project(mod, a, o, slots=s)))
                out_proj = mixer.o_proj if self.kind == "qwen3_5" else mixer.out_proj
                handles.append(out_proj.register_forward_pre_hook(lambda mod, args, l=l: writes.__setitem__(("z", l), args[0])))
            if mlp is not None:
                handles += [ln2.register_forward_hook(recomputed((l, "mlp"))), mlp.register_forward_hook(kept(("mlp", l)))]
        handles.append(self.final.register_forward_hook(recomputed("logits")))
        try:
            out = self.hf(tokens, output_hidden_states=True)
            rows = torch.arange(tokens.shape[0])
            value = (out.logits[rows, -1, ANSWERS] - out.logits[rows, -1, COUNTERFACTUALS]).sum()
            keys = list(leaves)
            grads = dict(zip(keys, torch.autograd.grad(value, [leaves[k] for k in keys])))
        finally:
            for h in handles:
                h.remove()
        parts, readers = [out.hidden_states[0].detach()[:, :, None]], []
        for l, layer in enumerate(self.layers):
            if self.mixer[l]:
                parts.append(writes[("mixer", l)].detach()[:, :, None])
                readers.append(grads[(l, "mixer")])
            else:
                attn = self._parts(layer, False)[1]
                out_proj = attn.o_proj if self.kind == "qwen3_5" else attn.out_proj
                z = writes[("z", l)].detach().unflatten(-1, (self.H, self.dh))
                w_o = out_proj.weight.detach().T.unflatten(0, (self.H, self.dh))
                parts.append(torch.einsum("bphd,hdm->bphm", z, w_o))
                readers += [grads[(l, s)] for s in range(self.H + 2 * self.KV)]
            if self.kind != "mamba2":
                parts.append(writes[("mlp", l)].detach()[:, :, None])
                readers.append(grads[(l, "mlp")])
        readers.append(grads["logits"])
        return torch.cat(parts, dim=2), torch.stack(readers, dim=2)


# a sharper initialisation, so that the gates' logits leave sigmoid's flat middle and every kind of edge counts
FAMILIES = {"qwen3_5-deltanet-gated-attention": ("qwen3_5", {"initializer_range": 0.2}),
            "mamba2-mixers-only": ("mamba2", {}),
            "lfm2-conv-attention": ("lfm2", {"initializer_range": 0.2})}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    kind, overrides = FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = build(kind, directory, **overrides).eval()
    return kind, hf, HookedDecoder.from_pretrained(directory).eval()


def test_mixer_nodes_and_names(family):
    kind, _, model = family
    graph = circuit_graph(model)
    mixers = [l for l in range(model.cfg.n_layers) if model.cfg.layer_is_linear(l)]
    assert [graph.writers[graph.mixer_writer(l)] for l in mixers] == [f"L{l} mixer" for l in mixers]
    assert [graph.readers[graph.mixer_reader(l)] for l in mixers] == [f"L{l} mixer" for l in mixers]
    assert all(graph.heads[l] == 0 for l in mixers)
    assert graph.writer_index("mixer0") == graph.writer_index("L0 mixer") == graph.mixer_writer(0)
    # a mixer feeds everything after it: its own layer's MLP and every later reader
    first = graph.mixer_writer(0)
    assert graph.valid[first].sum() == sum(graph.reader_stage > 1)
    assert not bool(graph.valid[first, graph.mixer_reader(0)])


@pytest.mark.parametrize("method", ["eap", "clean-corrupted"])
def test_eap_matches_transformers_autograd_on_every_edge(family, method):
    kind, hf, model = family
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    ours = edge_attribution(model, clean, corrupted, metric, method=method)
    oracle = HybridEdges(hf, kind)
    clean_writers, clean_grads = oracle.run(clean)
    corr_writers, corr_grads = oracle.run(corrupted)
    grads = corr_grads if method == "eap" else (corr_grads + clean_grads) / 2
    graph = ours.graph
    assert corr_grads.shape[2] == len(graph.readers) and corr_writers.shape[2] == len(graph.writers)
    expected = oracle_scores(graph, clean_writers - corr_writers, grads)
    assert_scores_close(ours.per_example, expected)
    kinds = {"mixer", "logits"} | ({"q", "k", "v", "mlp"} if kind != "mamba2" else set())
    for kind_ in kinds:  # each kind of input was compared
        into = torch.tensor([graph.reader_kind[r] == kind_ for r in graph.edge_reader.tolist()])
        assert float(expected[:, into].abs().max()) > 1e-3 * float(expected.abs().max()), kind_


def test_the_large_model_path_matches_too(family, monkeypatch):
    """The layers' readers one layer at a time (a large model on a CPU), per-position scores adding up."""
    import sys

    monkeypatch.setattr(sys.modules["probe.analyses.edge_gradients"], "SMALL_FORWARD", 0)
    kind, hf, model = family
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    ours = edge_attribution(model, clean, corrupted, metric, method="eap", positions=True)
    oracle = HybridEdges(hf, kind)
    clean_writers, _ = oracle.run(clean)
    corr_writers, corr_grads = oracle.run(corrupted)
    expected = oracle_scores(ours.graph, clean_writers - corr_writers, corr_grads)
    assert_scores_close(ours.per_example, expected)
    assert_scores_close(ours.per_position.sum(1), expected)


def brute_force(model, graph, clean, corrupted, metric, kept: torch.Tensor) -> torch.Tensor:
    """[batch] the metric with only the `kept` [writer reader] edges carrying the clean run's outputs (the rest the
    corrupted run's), built by plain hooks layer by layer: each reader's input is the corrupted residual it reads plus
    (clean - corrupted) of its kept writers, where a writer's "clean" output is what it outputs in this very run."""
    _, corr_cache = model.run_with_cache(corrupted)
    _, clean_cache = model.run_with_cache(clean)
    outputs = {}  # writer -> its output in this run

    def corr_output(w):
        kind, layer = graph.writer_kind[w], graph.writer_layer[w]
        if kind == "embed":
            return corr_cache["blocks.0.hook_resid_pre"]
        if kind == "head":
            return corr_cache[f"blocks.{layer}.attn.hook_result"][:, :, graph.writer_head[w]]
        return corr_cache[f"blocks.{layer}.hook_{'attn' if kind == 'mixer' else 'mlp'}_out"]

    def reader_input(r, residual):
        return residual + sum((outputs[w] - corr_output(w) for w in kept[:, r].nonzero()[:, 0].tolist()),
                              torch.zeros_like(residual))

    outputs[0] = clean_cache["blocks.0.hook_resid_pre"]
    hooks = []
    for l in range(graph.n_layers):
        pre = corr_cache[f"blocks.{l}.hook_resid_pre"]
        if graph.is_mixer(l):
            hooks.append((f"blocks.{l}.ln1.hook_in", lambda a, hook, l=l, pre=pre: reader_input(graph.mixer_reader(l), pre)))
            hooks.append((f"blocks.{l}.hook_attn_out", lambda a, hook, l=l: outputs.__setitem__(graph.mixer_writer(l), a)))
        else:
            raise NotImplementedError("brute_force builds mixer layers only")
        if graph.mlps:
            mid = corr_cache[f"blocks.{l}.hook_resid_mid"]
            hooks.append((f"blocks.{l}.hook_mlp_in", lambda a, hook, l=l, mid=mid: reader_input(graph.mlp_reader(l), mid)))
            hooks.append((f"blocks.{l}.hook_mlp_out", lambda a, hook, l=l: outputs.__setitem__(graph.mlp_writer(l), a)))
    last = corr_cache[f"blocks.{graph.n_layers - 1}.hook_resid_post"]
    hooks.append((f"blocks.{graph.n_layers - 1}.hook_resid_post",
                  lambda a, hook: reader_input(len(graph.readers) - 1, last)))
    with torch.no_grad():
        logits = model.run_with_hooks(corrupted, fwd_hooks=hooks)
    return metric(logits, corrupted, torch.ones_like(corrupted, dtype=torch.bool))


def test_faithfulness_of_a_mixers_only_circuit_is_brute_force_patching(tmp_path):
    """Mamba-2 (every layer a mixer): faithfulness's patched forward against hooks built by hand, for random
    circuits; the full circuit is the clean run and the empty one the corrupted run."""
    build("mamba2", tmp_path, initializer_range=0.2)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    graph = circuit_graph(model)
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    runner = CircuitRunner.prepare(model, clean, corrupted, metric)
    gen = torch.Generator().manual_seed(0)
    masks = torch.rand(4, graph.n_edges, generator=gen) < 0.5
    masks = torch.cat([masks, torch.ones(1, graph.n_edges, dtype=torch.bool), torch.zeros(1, graph.n_edges, dtype=torch.bool)])
    got = runner.evaluate(masks)
    for mask, values in zip(masks, got):
        kept = torch.zeros_like(graph.valid)
        kept[graph.edge_writer[mask], graph.edge_reader[mask]] = True
        expected = brute_force(model, graph, clean, corrupted, metric, kept)
        torch.testing.assert_close(values, expected.float(), atol=1e-4, rtol=0)
    torch.testing.assert_close(got[-2], runner.clean_values.cpu(), atol=1e-4, rtol=0)
    torch.testing.assert_close(got[-1], runner.corrupted_values.cpu(), atol=1e-4, rtol=0)
    assert len({tuple(v.tolist()) for v in got}) == len(got)  # the circuits differ, and so do their metrics


def test_the_full_circuit_is_faithful_and_the_empty_one_not(family, ablation="patch"):
    kind, _, model = family
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    scores = edge_attribution(model, clean, corrupted, metric)
    graph = scores.graph
    full = faithfulness(model, scores.circuit(n_edges=graph.n_edges), clean, corrupted, metric, ablation=ablation)
    empty = faithfulness(model, scores.circuit(threshold=float("inf")), clean, corrupted, metric, ablation=ablation)
    assert full.value == pytest.approx(1.0, abs=1e-3)  # (zero ablation: norms of near-zero residuals round)
    assert empty.value == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("family", ["qwen3_5-deltanet-gated-attention"], indirect=True)
@pytest.mark.parametrize("ablation", ["mean", "zero"])
def test_mean_and_zero_ablations_too(family, ablation):
    """(The references these ablate to are computed alike on every family: one hybrid suffices.)"""
    test_the_full_circuit_is_faithful_and_the_empty_one_not(family, ablation)


def test_path_patching_a_mixer_into_the_logits(family):
    """The mixer's clean output reaching the logits alone is, for the last layer, a direct path: the corrupted run
    with that writer's (clean - corrupted) added to the final residual, under the frozen final-norm scale."""
    kind, _, model = family
    graph = circuit_graph(model)
    last = max(l for l in range(model.cfg.n_layers) if graph.is_mixer(l))
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    got = path_patch(model, clean, corrupted, metric, senders=[f"L{last} mixer"], receivers=["logits"])
    _, clean_cache = model.run_with_cache(clean)
    _, corr_cache = model.run_with_cache(corrupted)
    name = f"blocks.{last}.hook_attn_out"
    final = corr_cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"] + clean_cache[name] - corr_cache[name]
    scale = corr_cache["ln_final.hook_scale"]
    with model.hooks([("ln_final.hook_scale", lambda a, hook: scale)]):
        logits = model.unembed(model.ln_final(final))
    expected = metric(logits, corrupted, torch.ones_like(corrupted, dtype=torch.bool))
    torch.testing.assert_close(got.patched[0], expected.float(), atol=1e-4, rtol=0)


def test_refusals_name_what_is_not_built(tmp_path):
    build("nemotron_h", tmp_path / "nemotron")
    with pytest.raises(ValueError, match="one sublayer each"):
        circuit_graph(HookedDecoder.from_pretrained(tmp_path / "nemotron"))
    build("olmo_hybrid", tmp_path / "olmo")
    with pytest.raises(ValueError, match="sandwich attention"):
        circuit_graph(HookedDecoder.from_pretrained(tmp_path / "olmo"))


def test_path_patching_a_mixer_into_a_later_mixer(family):
    """Wang et al.'s path patching between two recurrent layers: the corrupted run, with the later mixer's input
    alone given the earlier mixer's (clean - corrupted) output and read with the corrupted run's ln1 scale, by hand;
    everything after it runs as usual."""
    kind, _, model = family
    graph = circuit_graph(model)
    first, second = [l for l in range(model.cfg.n_layers) if graph.is_mixer(l)][:2]
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    got = path_patch(model, clean, corrupted, metric, senders=[f"L{first} mixer"], receivers=[f"L{second} mixer"])
    _, clean_cache = model.run_with_cache(clean)
    _, corr_cache = model.run_with_cache(corrupted)
    sent = clean_cache[f"blocks.{first}.hook_attn_out"] - corr_cache[f"blocks.{first}.hook_attn_out"]
    received = corr_cache[f"blocks.{second}.hook_resid_pre"] + sent
    scale = corr_cache[f"blocks.{second}.ln1.hook_scale"]
    with torch.no_grad():
        logits = model.run_with_hooks(corrupted, fwd_hooks=[(f"blocks.{second}.ln1.hook_in", lambda a, hook: received),
                                                            (f"blocks.{second}.ln1.hook_scale", lambda a, hook: scale)])
    expected = metric(logits, corrupted, torch.ones_like(corrupted, dtype=torch.bool))
    torch.testing.assert_close(got.patched[0], expected.float(), atol=1e-4, rtol=0)
    assert float((got.patched[0] - got.corrupted).abs().max()) > 1e-3  # the path carries something


@pytest.mark.parametrize("kind", ["rwkv", "recurrent_gemma", "jamba"])
def test_the_other_recurrent_families_circuits_are_exact_at_the_ends(kind, tmp_path):
    """RWKV (time mix a mixer node, channel mix an MLP node), RecurrentGemma's RG-LRU layers and Jamba's Mamba layers:
    the full circuit is the clean run and the empty one the corrupted run."""
    build(kind, tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    graph = circuit_graph(model)
    assert any(graph.mixers)
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    runner = CircuitRunner.prepare(model, clean, corrupted, metric)
    ends = torch.stack([torch.ones(graph.n_edges, dtype=torch.bool), torch.zeros(graph.n_edges, dtype=torch.bool)])
    got = runner.evaluate(ends)
    torch.testing.assert_close(got, torch.stack([runner.clean_values, runner.corrupted_values]).cpu(), atol=1e-4, rtol=0)
    assert float((runner.clean_values - runner.corrupted_values).abs().max()) > 1e-3
