"""Edge attribution patching against transformers' own autograd, brute-force edge patching and node-level attribution.

The oracle for every edge is (writer's clean output - corrupted output) . d metric / d (reader's input), with the
writers' outputs read from transformers' modules and each reader's input gradient taken by transformers'
autograd: every head's q, k and v slice and every MLP and final norm is recomputed inside the forward from the
residual it reads plus a zero leaf of its own, so one backward gives each reader's gradient separately.
"""
from __future__ import annotations

import copy
import pickle
import sys

import pytest
import torch

from probe.analyses import attribution_patch, logit_diff_metric
from probe.analyses.common import token_strings
from probe.analyses.edge_attribution import edge_attribution
from probe import HookedDecoder
from probe.names import act_name
from probe.norm import LayerNorm, RMSNorm

from test_variants import build

ANSWERS, COUNTERFACTUALS = [5, 9], [7, 2]


def prompts(vocab: int, n_pos: int = 9, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, vocab, (2, n_pos), generator=gen)
    corrupted = clean.clone()
    corrupted[:, 2:5] = torch.randint(0, vocab, (2, 3), generator=gen)
    return clean, corrupted


SANDWICH = ("gemma2", "gemma3", "olmo2", "olmo3")  # the families whose sublayer writes are normalised before the residual
OLMO = ("olmo2", "olmo3")  # sandwich blocks without input norms


class HFEdges:
    """Writers' outputs and readers' input gradients of a transformers GPT-2, GPT-Neo, Llama, Gemma 2, Gemma 3, OLMo 2,
    GPT-NeoX, Bloom, Mixtral or GPT-OSS model."""

    def __init__(self, hf, kind: str):
        self.hf, self.kind = hf, kind
        cfg = hf.config
        if kind == "gpt2":
            self.layers, self.final = hf.transformer.h, hf.transformer.ln_f
            self.H = self.KV = cfg.n_head
            self.d = cfg.n_embd
        elif kind == "gptneo":
            self.layers, self.final = hf.transformer.h, hf.transformer.ln_f
            self.H = self.KV = cfg.num_heads
            self.d = cfg.hidden_size
        elif kind == "bloom":
            self.layers, self.final = hf.transformer.h, hf.transformer.ln_f
            self.H = self.KV = cfg.n_head
            self.d = cfg.hidden_size
        else:
            body = hf.gpt_neox if kind == "neox" else hf.model
            self.layers, self.final = body.layers, (body.final_layer_norm if kind == "neox" else body.norm)
            self.H, self.d = cfg.num_attention_heads, cfg.hidden_size
            self.KV = getattr(cfg, "num_key_value_heads", None) or self.H
        self.dh = getattr(cfg, "head_dim", None) or self.d // self.H

    def _parts(self, layer):
        """(attention norm, [(projection module, [(reader slot, column slice)])], out projection, mlp norm, mlp)."""
        H, KV, dh, d = self.H, self.KV, self.dh, self.d
        q_slots = list(range(H))
        k_slots, v_slots = [H + g for g in range(KV)], [H + KV + g for g in range(KV)]
        if self.kind == "gpt2":
            cols = [slice(h * dh, (h + 1) * dh) for h in range(H)]
            projections = [(layer.attn.c_attn, list(zip(q_slots, cols)) + list(zip(k_slots, [slice(d + c.start, d + c.stop) for c in cols]))
                            + list(zip(v_slots, [slice(2 * d + c.start, 2 * d + c.stop) for c in cols])))]
            return layer.ln_1, projections, layer.attn.c_proj, layer.ln_2, layer.mlp
        if self.kind == "gptneo":  # Llama's separate projections under GPT-2's names
            a = layer.attn.attention
            projections = [(a.q_proj, [(s, slice(h * dh, (h + 1) * dh)) for s, h in zip(q_slots, range(H))]),
                           (a.k_proj, [(s, slice(g * dh, (g + 1) * dh)) for s, g in zip(k_slots, range(KV))]),
                           (a.v_proj, [(s, slice(g * dh, (g + 1) * dh)) for s, g in zip(v_slots, range(KV))])]
            return layer.ln_1, projections, a.out_proj, layer.ln_2, layer.mlp
        if self.kind in ("llama", "gemma2", "gemma3", "olmo2", "olmo3", "mixtral", "gpt_oss", "apertus", "granite"):
            a = layer.self_attn
            projections = [(a.q_proj, [(s, slice(h * dh, (h + 1) * dh)) for s, h in zip(q_slots, range(H))]),
                           (a.k_proj, [(s, slice(g * dh, (g + 1) * dh)) for s, g in zip(k_slots, range(KV))]),
                           (a.v_proj, [(s, slice(g * dh, (g + 1) * dh)) for s, g in zip(v_slots, range(KV))])]
            # Gemma 2's sandwich: the MLP reads pre_feedforward_layernorm; post_attention_layernorm normalises the write
            if self.kind in OLMO:  # no input norms: the sublayers read the residual itself
                return None, projections, a.o_proj, None, layer.mlp
            if self.kind == "apertus":  # (Llama's norms under names of its own)
                return layer.attention_layernorm, projections, a.o_proj, layer.feedforward_layernorm, layer.mlp
            ln2 = layer.pre_feedforward_layernorm if self.kind in SANDWICH else layer.post_attention_layernorm
            return layer.input_layernorm, projections, a.o_proj, ln2, layer.mlp
        # GPT-NeoX and Bloom: the fused projection is [head, (q k v), d_head]
        a = layer.self_attention if self.kind == "bloom" else layer.attention
        slots = [(s, slice(h * 3 * dh + part * dh, h * 3 * dh + (part + 1) * dh))
                 for part, group in enumerate((q_slots, k_slots, v_slots)) for h, s in enumerate(group)]
        return layer.input_layernorm, [(a.query_key_value, slots)], a.dense, layer.post_attention_layernorm, layer.mlp

    def run(self, tokens, answers, counterfactuals, inputs_embeds=None):
        """(writers [batch pos writer d_model], reader gradients [batch pos reader d_model]) of one forward."""
        hf, handles, leaves, writes = self.hf, [], {}, {}
        busy = set()

        def own_leaf(key, x):
            # x plus a zero of its own: the value and the rest of the graph are unchanged, and the gradient at the
            # zero is the gradient through this one reader
            leaves[key] = torch.zeros_like(x, requires_grad=True)
            return x + leaves[key]

        def norm_output(key):
            def hook(mod, args, out):
                if mod in busy:
                    return None
                busy.add(mod)
                try:
                    return mod(own_leaf(key, args[0]))
                finally:
                    busy.discard(mod)
            return hook

        for l, layer in enumerate(self.layers):
            ln1, projections, out_proj, ln2, mlp = self._parts(layer)
            resid = {}
            # the residual the block reads, not the copies the recomputations below pass through ln1
            if ln1 is None:  # OLMo 2: attention reads it as it is, given by keyword
                ln1 = torch.nn.Identity()
                handles.append(layer.self_attn.register_forward_pre_hook(
                    lambda mod, args, kwargs, resid=resid: None if busy else resid.__setitem__("x", kwargs["hidden_states"]),
                    with_kwargs=True))
            else:
                handles.append(ln1.register_forward_pre_hook(
                    lambda mod, args, resid=resid: None if busy else resid.__setitem__("x", args[0])))

            def project(mod, args, out, l=l, slots=None, ln1=ln1, resid=resid):
                if mod in busy:  # the recomputation below calls the module again
                    return None
                busy.add(mod)
                try:
                    out, x = out.clone(), resid["x"]
                    for slot, cols in slots:
                        out[..., cols] = mod(ln1(own_leaf((l, slot), x)))[..., cols]
                    return out
                finally:
                    busy.discard(mod)

            for module, slots in projections:
                handles.append(module.register_forward_hook(lambda mod, a, o, f=project, s=slots: f(mod, a, o, slots=s)))
            handles.append(out_proj.register_forward_pre_hook(lambda mod, args, l=l: writes.__setitem__(("z", l), args[0])))
            if ln2 is None:  # the MLP reads the residual itself: its own leaf on that input
                handles.append(mlp.register_forward_pre_hook(lambda mod, args, l=l: (own_leaf((l, "mlp"), args[0]),)))
            else:
                handles.append(ln2.register_forward_hook(norm_output((l, "mlp"))))
            # an MLP's write is what reaches the residual: in a sandwich block, after its post-norm
            # (Bloom's MLP module returns the residual plus its write: the write is its output projection's)
            written = layer.post_feedforward_layernorm if self.kind in SANDWICH else \
                mlp.dense_4h_to_h if self.kind == "bloom" else mlp
            # (GPT-OSS's MLP returns its router's scores beside its write)
            handles.append(written.register_forward_hook(
                lambda mod, args, out, l=l: writes.__setitem__(("mlp", l), out[0] if isinstance(out, tuple) else out)))
            if self.kind in SANDWICH:  # the attention's whole write, before its post-norm: its scale is every head's
                handles.append(out_proj.register_forward_hook(lambda mod, args, out, l=l: writes.__setitem__(("attn", l), out)))
        handles.append(self.final.register_forward_hook(norm_output("logits")))
        try:
            if inputs_embeds is None:
                out = hf(tokens, output_hidden_states=True)
            else:
                out = hf(inputs_embeds=inputs_embeds, output_hidden_states=True)
            rows = torch.arange(tokens.shape[0])
            value = (out.logits[rows, -1, answers] - out.logits[rows, -1, counterfactuals]).sum()
            keys = list(leaves)
            grads = dict(zip(keys, torch.autograd.grad(value, [leaves[k] for k in keys])))
        finally:
            for h in handles:
                h.remove()
        parts = [out.hidden_states[0].detach()[:, :, None]]
        readers = []
        for l, layer in enumerate(self.layers):
            z = writes[("z", l)].detach().unflatten(-1, (self.H, self.dh))
            out_proj = self._parts(layer)[2]
            weight = out_proj.weight.unflatten(0, (self.H, self.dh)) if self.kind == "gpt2" else \
                out_proj.weight.T.unflatten(0, (self.H, self.dh))  # [head d_head d_model]
            heads = torch.einsum("bphd,hdm->bphm", z, weight.detach())
            if self.kind in SANDWICH:  # each head's share of the normalised write: (1 + w) / that run's RMS
                post = layer.post_attention_layernorm
                raw = writes[("attn", l)].detach().float()
                gain = post.weight.detach().float() + (0.0 if self.kind in OLMO else 1.0)  # Gemma stores w - 1
                eps = post.variance_epsilon if self.kind in OLMO else post.eps
                heads = heads * gain * torch.rsqrt(raw.pow(2).mean(-1) + eps)[:, :, None, None]
            scale = getattr(self.hf.config, "residual_multiplier", 1.0)  # Granite's, on each sublayer's write
            parts += [heads * scale, writes[("mlp", l)].detach()[:, :, None] * scale]
            readers += [grads[(l, s)] for s in range(self.H + 2 * self.KV)] + [grads[(l, "mlp")]]
        readers.append(grads["logits"])
        return torch.cat(parts, dim=2), torch.stack(readers, dim=2)


def oracle_scores(graph, delta, grads):
    """[batch edge]: delta . gradient summed over positions, for every edge of the graph."""
    full = torch.einsum("bpwd,bprd->bwr", delta, grads)
    return full[:, graph.edge_writer, graph.edge_reader]


FAMILIES = {"gpt2": None, "llama-gqa": ("llama", {}), "neox-parallel": ("neox", {}), "gemma2-sandwich": ("gemma2", {}),
            "gptneo-unscaled-local": ("gptneo", {}), "gemma3-qk-norms-local-base": ("gemma3", {}),
            "olmo2-write-norms": ("olmo2", {"num_key_value_heads": 2}), "olmo3-sliding-yarn": ("olmo3", {}),
            "bloom-alibi": ("bloom", {"initializer_range": 0.3}),  # sharp enough that q edges matter
            "mixtral-experts": ("mixtral", {}), "gpt-oss-sinks-experts": ("gpt_oss", {}),
            "apertus-xielu-qk-norms": ("apertus", {}), "granite-multipliers": ("granite", {"initializer_range": 0.3})}  # (sharp enough that q edges matter)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, tiny_dir, tiny_hf):
    if request.param == "gpt2":
        return "gpt2", tiny_hf, HookedDecoder.from_pretrained(tiny_dir).eval()
    kind, overrides = FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = build(kind, directory, **overrides)
    return kind, hf, HookedDecoder.from_pretrained(directory).eval()


def assert_scores_close(ours, expected):
    scale = float(expected.abs().max())
    assert scale > 0
    torch.testing.assert_close(ours, expected, atol=1e-4 * scale, rtol=0)


@pytest.mark.parametrize("method", ["eap", "clean-corrupted"])
def test_eap_matches_transformers_autograd_on_every_edge(family, method):
    kind, hf, model = family
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    ours = edge_attribution(model, clean, corrupted, metric, method=method)
    oracle = HFEdges(hf, kind)
    clean_writers, clean_grads = oracle.run(clean, ANSWERS, COUNTERFACTUALS)
    corr_writers, corr_grads = oracle.run(corrupted, ANSWERS, COUNTERFACTUALS)
    grads = corr_grads if method == "eap" else (corr_grads + clean_grads) / 2
    graph = ours.graph
    assert corr_grads.shape[2] == len(graph.readers) and corr_writers.shape[2] == len(graph.writers)
    expected = oracle_scores(graph, clean_writers - corr_writers, grads)
    assert_scores_close(ours.per_example, expected)
    # the oracle's edges into each kind of input are not all zero, so each kind was compared
    for kind_ in ("q", "k", "v", "mlp", "logits"):
        into = torch.tensor([graph.reader_kind[r] == kind_ for r in graph.edge_reader.tolist()])
        assert float(expected[:, into].abs().max()) > 1e-3 * float(expected.abs().max()), kind_


def large_model_path(monkeypatch) -> None:
    """What a large model on a CPU runs, forced on a tiny one: its layers one at a time, the clean prompts in a
    forward of their own."""
    monkeypatch.setattr(sys.modules["probe.analyses.edge_gradients"], "SMALL_FORWARD", 0)


def integrated_oracle(hf, kind, graph, clean, corrupted, steps: int) -> torch.Tensor:
    """[batch edge]: Δwriter . the reader gradients averaged over transformers runs from interpolated `inputs_embeds`
    (alpha = 0, 1/steps, ...: steps=1 is EAP's corrupted run)."""
    oracle = HFEdges(hf, kind)
    embed = hf.get_input_embeddings()
    with torch.no_grad():
        e_clean, e_corr = embed(clean), embed(corrupted)
    clean_writers, _ = oracle.run(clean, ANSWERS, COUNTERFACTUALS)
    corr_writers, _ = oracle.run(corrupted, ANSWERS, COUNTERFACTUALS)
    if kind == "bloom":
        # the path runs through the residual stream's input, after Bloom's embedding norm (EAP-IG's library moves
        # blocks.0.hook_resid_pre): interpolate normed embeddings, the norm an identity while they run
        norm = hf.transformer.word_embeddings_layernorm
        with torch.no_grad():
            e_clean, e_corr = norm(e_clean), norm(e_corr)
        hf.transformer.word_embeddings_layernorm = torch.nn.Identity()
    try:
        grads = sum(oracle.run(corrupted, ANSWERS, COUNTERFACTUALS, inputs_embeds=e_corr + k / steps * (e_clean - e_corr))[1]
                    for k in range(steps)) / steps
    finally:
        if kind == "bloom":
            hf.transformer.word_embeddings_layernorm = norm
    return oracle_scores(graph, clean_writers - corr_writers, grads)


def test_eap_ig_inputs_matches_transformers_integrated_gradients(family):
    kind, hf, model = family
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    ours = edge_attribution(model, clean, corrupted, metric, method="eap-ig-inputs", ig_steps=3)
    assert_scores_close(ours.per_example, integrated_oracle(hf, kind, ours.graph, clean, corrupted, steps=3))


@pytest.mark.parametrize("method", ["eap", "eap-ig-inputs"])
def test_the_large_model_path_matches_transformers_autograd(family, method, monkeypatch):
    """What a large model on a CPU runs (its layers' readers one layer at a time, the clean prompts in a forward of
    their own, the interpolation steps in several forwards) against the same oracle."""
    large_model_path(monkeypatch)
    kind, hf, model = family
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    steps = 3 if method == "eap-ig-inputs" else 1
    ours = edge_attribution(model, clean, corrupted, metric, method=method, ig_steps=steps, max_rows=2 * clean.shape[0],
                            positions=True)
    expected = integrated_oracle(hf, kind, ours.graph, clean, corrupted, steps)
    assert_scores_close(ours.per_example, expected)
    # each position's share, summed, is the edge's score
    assert_scores_close(ours.per_position.sum(1), expected)


def test_ig_with_one_step_is_eap(tiny_model):
    clean, corrupted = prompts(tiny_model.cfg.d_vocab)
    metric = logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)
    eap = edge_attribution(tiny_model, clean, corrupted, metric, method="eap")
    for method in ("eap-ig-inputs", "eap-ig-activations"):
        one = edge_attribution(tiny_model, clean, corrupted, metric, method=method, ig_steps=1)
        torch.testing.assert_close(one.scores, eap.scores, atol=0, rtol=0)
    # more steps move the activations variant away from EAP (it integrates along the path)
    many = edge_attribution(tiny_model, clean, corrupted, metric, method="eap-ig-activations", ig_steps=4)
    assert not torch.allclose(many.scores, eap.scores, atol=1e-7)


def brute_force_edge(model, graph, clean, corrupted, metric, writer, reader):
    """The metric's change (per prompt) with one edge patched, by plain hooks: the reader's input gets the
    writer's (clean - corrupted) output added, everything else runs as it runs."""
    _, clean_cache = model.run_with_cache(clean)
    base_logits, corr_cache = model.run_with_cache(corrupted)

    def output(cache):
        kind, layer, head = graph.writer_kind[writer], graph.writer_layer[writer], graph.writer_head[writer]
        if kind == "embed":
            return cache[act_name("resid_pre", 0)]
        if kind == "mlp":
            return cache[act_name("mlp_out", layer)]
        z = cache[act_name("z", layer)][:, :, head]
        return z @ model.blocks[layer].attn.W_O[head]

    delta = output(clean_cache) - output(corr_cache)
    kind, layer, head = graph.reader_kind[reader], graph.reader_layer[reader], graph.reader_head[reader]
    seen = {}
    hooks = [(act_name("resid_pre", l), lambda x, hook: seen.__setitem__(hook.name, x)) for l in range(model.cfg.n_layers)]
    if kind in ("q", "k", "v"):
        attn = model.blocks[layer].attn
        w = {"q": attn.W_Q, "k": attn.W_K, "v": attn.W_V}[kind][head]
        b = {"q": attn.b_Q, "k": attn.b_K, "v": attn.b_V}[kind]

        def swap(x, hook):
            x = x.clone()
            x[:, :, head] = model.blocks[layer].ln1(seen[act_name("resid_pre", layer)] + delta) @ w + (0 if b is None else b[head])
            return x
        hooks.append((act_name(kind, layer), swap))
    elif kind == "mlp":
        block = model.blocks[layer]
        read = act_name("resid_pre" if model.cfg.norm_placement.value == "parallel" else "resid_mid", layer)
        hooks.append((read, lambda x, hook: seen.__setitem__("mlp_in", x)))
        hooks.append((act_name("mlp_out", layer), lambda x, hook: block.mlp(block.ln2(seen["mlp_in"] + delta))))
    else:
        hooks.append((act_name("resid_post", model.cfg.n_layers - 1), lambda x, hook: x + delta))
    logits = model.run_with_hooks(corrupted, fwd_hooks=hooks)
    mask = torch.ones_like(corrupted, dtype=torch.bool)
    return metric(logits, corrupted, mask) - metric(base_logits, corrupted, mask)


@pytest.mark.parametrize("which", ["tiny", "neox"])
def test_exact_method_matches_brute_force_patching(which, tiny_model, tmp_path):
    if which == "neox":
        build("neox", tmp_path)
    model = tiny_model if which == "tiny" else HookedDecoder.from_pretrained(tmp_path).eval()
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    exact = edge_attribution(model, clean, corrupted, metric, method="exact")
    graph = exact.graph
    gen = torch.Generator().manual_seed(0)
    picks = torch.randperm(graph.n_edges, generator=gen)[:10].tolist()
    for kind in ("q", "k", "v", "mlp", "logits"):  # at least one edge into each kind of input
        picks.append(next(e for e in range(graph.n_edges) if graph.reader_kind[int(graph.edge_reader[e])] == kind
                          and graph.writer_kind[int(graph.edge_writer[e])] != "embed"))
    with torch.no_grad():
        for e in picks:
            expected = brute_force_edge(model, graph, clean, corrupted, metric, int(graph.edge_writer[e]), int(graph.edge_reader[e]))
            torch.testing.assert_close(exact.per_example[:, e], expected, atol=2e-6, rtol=1e-4)
    # and the linear estimate is close to it on this tiny random model (a first-order expansion, not exact)
    eap = edge_attribution(model, clean, corrupted, metric, method="eap")
    assert torch.corrcoef(torch.stack([eap.scores, exact.scores]))[0, 1] > 0.8


def test_edge_scores_summed_over_readers_are_node_attribution(tiny_model):
    clean, corrupted = prompts(tiny_model.cfg.d_vocab)
    metric = logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)
    scores = edge_attribution(tiny_model, clean, corrupted, metric)
    node = attribution_patch(tiny_model, clean, corrupted, metric, sites="heads")
    graph = scores.graph
    for site, estimate in zip(node.sites, node.patched.tolist()):
        writer = graph.writer_index((site.layer, site.head))
        edges = graph.edge_writer == writer
        # attribution_patch gives the batch-summed change on top of the corrupted metric; ours are batch means
        total = float(scores.scores[edges].sum())
        assert total == pytest.approx(estimate - node.corrupted, abs=1e-6)


def test_per_position_scores_add_up_and_frame(tiny_model):
    clean, corrupted = prompts(tiny_model.cfg.d_vocab)
    metric = logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)
    scores = edge_attribution(tiny_model, clean, corrupted, metric, positions=True)
    torch.testing.assert_close(scores.per_position.sum(1), scores.per_example, atol=1e-7, rtol=1e-5)
    frame = scores.to_frame()
    assert list(frame.columns[:3]) == ["source", "target", "input"]
    assert {"score", "ci_low", "ci_high", "p_value"} <= set(frame.columns) and len(frame) == scores.graph.n_edges
    by_position = scores.to_frame(positions=True)
    assert len(by_position) == scores.graph.n_edges * clean.shape[1]
    # the token column: the first corrupted prompt's tokens (decoded when first read), position by position
    assert list(by_position["token"][:clean.shape[1]]) == token_strings(tiny_model, corrupted[0].tolist())
    assert list(by_position["position"][:clean.shape[1]]) == list(range(clean.shape[1]))
    # a pickle (torch.save of the results) keeps the strings and the scores, not the tokenizer
    fresh = edge_attribution(tiny_model, clean, corrupted, metric, positions=True)
    copy_back = pickle.loads(pickle.dumps(fresh))
    assert copy_back.tokenizer is None and copy_back.position_strings == by_position["token"][:clean.shape[1]].tolist()
    torch.testing.assert_close(copy_back.scores, fresh.scores, rtol=0, atol=0)
    top = scores.top(5)
    assert list(top["rank"]) == [1, 2, 3, 4, 5] and top["score"].abs().is_monotonic_decreasing
    scores.figure()


def test_bad_inputs(tiny_model):
    clean, corrupted = prompts(tiny_model.cfg.d_vocab)
    metric = logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)
    with pytest.raises(ValueError, match="method='bogus' is not one of"):
        edge_attribution(tiny_model, clean, corrupted, metric, method="bogus")
    with pytest.raises(ValueError, match="ig_steps=0 must be a positive int"):
        edge_attribution(tiny_model, clean, corrupted, metric, method="eap-ig-inputs", ig_steps=0)
    with pytest.raises(ValueError, match="ig_steps=2.0 must be a positive int"):
        edge_attribution(tiny_model, clean, corrupted, metric, method="eap-ig-inputs", ig_steps=2.0)
    with pytest.raises(ValueError, match="same shape and padding"):
        edge_attribution(tiny_model, clean, corrupted[:, :-1], metric)
    with pytest.raises(ValueError, match="per-position scores come from"):
        edge_attribution(tiny_model, clean, corrupted, metric, method="exact", positions=True)


def test_numpy_and_tensor_integers_are_settings_like_ints(tiny_model):
    import numpy as np

    # a sweep's np.int64 steps and row caps were refused as "not a positive int"
    clean, corrupted = prompts(tiny_model.cfg.d_vocab)
    metric = logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)
    plain = edge_attribution(tiny_model, clean, corrupted, metric, method="eap-ig-inputs", ig_steps=2, max_rows=4)
    for steps, rows in ((np.int64(2), np.int32(4)), (torch.tensor(2), torch.tensor(4))):
        swept = edge_attribution(tiny_model, clean, corrupted, metric, method="eap-ig-inputs", ig_steps=steps,
                                 max_rows=rows)
        assert type(swept.ig_steps) is int and swept.ig_steps == 2
        assert torch.equal(swept.scores, plain.scores)


def test_a_model_mixing_norm_kinds_is_refused_by_name(tiny_model):
    # the pull-back through ln1 holds for one kind before every attention (OLMo 2's none, with RMSNorms elsewhere, is
    # one: tests above), and the centred deltas for LayerNorms everywhere
    mixed = copy.deepcopy(tiny_model)
    mixed.blocks[0].ln1 = RMSNorm(mixed.cfg.d_model, mixed.cfg.eps)
    clean, corrupted = prompts(mixed.cfg.d_vocab)
    metric = logit_diff_metric(mixed, ANSWERS, COUNTERFACTUALS)
    with pytest.raises(TypeError, match=r"one kind before every attention .*this model's norms are \['LayerNorm', 'RMSNorm'\]"):
        edge_attribution(mixed, clean, corrupted, metric)
    mixed.ln_final = RMSNorm(mixed.cfg.d_model, mixed.cfg.eps)
    for block in mixed.blocks:
        block.ln1 = LayerNorm(mixed.cfg.d_model, mixed.cfg.eps)
    with pytest.raises(TypeError, match=r"and LayerNorms everywhere when it is LayerNorm"):
        edge_attribution(mixed, clean, corrupted, metric)


def test_a_metric_declaring_its_reads_scores_like_the_full_logits_path(tiny_model, method="eap-ig-activations"):
    """logit_diff_metric declares what it reads (analyses.metric_reads), so its gradient runs from the final residual at
    the read position and columns only; the same function without the declaration goes through the full logits."""
    clean, corrupted = prompts(tiny_model.cfg.d_vocab)
    declared = logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)
    assert getattr(declared, "reads", None) is not None

    def generic(logits, tokens, mask):  # the same arithmetic, no declaration
        return declared(logits, tokens, mask)

    fast = edge_attribution(tiny_model, clean, corrupted, declared, method=method, ig_steps=3)
    full = edge_attribution(tiny_model, clean, corrupted, generic, method=method, ig_steps=3)
    scale = float(full.scores.abs().max())
    torch.testing.assert_close(fast.per_example, full.per_example, atol=1e-5 * scale, rtol=0)
    assert fast.clean == pytest.approx(full.clean, abs=1e-5) and fast.corrupted == pytest.approx(full.corrupted, abs=1e-5)


@pytest.mark.parametrize("method", ["eap", "eap-ig-inputs"])
def test_left_padding_changes_no_score(tiny_model, method, monkeypatch):
    """A left-padded prompt scores every edge as it does alone and unpadded (padded positions carry nothing), on
    both the small-model path and the large-model one."""
    clean, corrupted = prompts(tiny_model.cfg.d_vocab, n_pos=9)
    metric = logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)
    mask = torch.ones_like(clean, dtype=torch.bool)
    mask[0, :3] = False  # the first prompt is its last six tokens, left-padded with three
    for small in (True, False):
        if not small:
            large_model_path(monkeypatch)
        padded = edge_attribution(tiny_model, clean, corrupted, metric, method=method, ig_steps=3, attention_mask=mask)
        alone = edge_attribution(tiny_model, clean[:1, 3:], corrupted[:1, 3:],
                                 logit_diff_metric(tiny_model, ANSWERS[:1], COUNTERFACTUALS[:1]), method=method, ig_steps=3)
        assert_scores_close(padded.per_example[0], alone.per_example[0])


@pytest.mark.parametrize("method", ["eap-ig-activations", "clean-corrupted"])
def test_the_two_paths_agree_on_the_other_methods(family, method, monkeypatch):
    """The methods the oracle does not cover score alike on the small-model path (one stacked forward, every
    layer at once) and the large-model one (one layer at a time, separate and split forwards)."""
    kind, hf, model = family
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    small = edge_attribution(model, clean, corrupted, metric, method=method, ig_steps=3, positions=True)
    large_model_path(monkeypatch)
    large = edge_attribution(model, clean, corrupted, metric, method=method, ig_steps=3, positions=True,
                             max_rows=2 * clean.shape[0])
    assert_scores_close(large.per_example, small.per_example)
    assert_scores_close(large.per_position.flatten(1), small.per_position.flatten(1))


def test_scratch_buffers_left_holding_nan_change_no_score(family):
    """The contraction's buffers outlive a call (analyses.scratch) and hold what the last call left there: filled
    with NaN after a call on longer prompts, they still give the oracle's scores (nothing is read before it is
    written), for EAP and EAP-IG alike."""
    from probe.analyses import scratch

    kind, hf, model = family
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    edge_attribution(model, *prompts(model.cfg.d_vocab, n_pos=13), metric, method="eap-ig-inputs", ig_steps=3,
                     positions=True)
    for method, steps in (("eap", 1), ("eap-ig-inputs", 3)):
        assert scratch.held()
        for buffer in scratch.held():
            buffer.fill_(float("nan"))
        ours = edge_attribution(model, clean, corrupted, metric, method=method, ig_steps=steps)
        assert_scores_close(ours.per_example, integrated_oracle(hf, kind, ours.graph, clean, corrupted, steps))


def test_threads_scoring_at_once_get_the_scores_each_gets_alone(tiny_model):
    """Calls from several threads at once (each with its own scratch buffers and scoped hooks) score as each does
    alone; with buffers shared between threads, a run of this test saw one thread's scores off by ~100."""
    import threading

    metric = logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)
    inputs = [prompts(tiny_model.cfg.d_vocab, n_pos=8 + 3 * i, seed=i) for i in range(4)]
    alone = [edge_attribution(tiny_model, *pair, metric, method="eap-ig-inputs", ig_steps=3).per_example
             for pair in inputs]
    got, errors = {}, []

    def work(i):
        try:
            for _ in range(8):
                scores = edge_attribution(tiny_model, *inputs[i], metric, method="eap-ig-inputs", ig_steps=3).per_example
                got.setdefault(i, []).append(scores)
        except Exception as err:  # surfaced below: an exception in a thread does not fail the test by itself
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for i, runs in got.items():
        assert len(runs) == 8
        for scores in runs:  # (not bit for bit: a matmul may split its work differently while threads compete)
            torch.testing.assert_close(scores, alone[i], atol=1e-6 * float(alone[i].abs().max()), rtol=0)
