"""The graph, circuits (extraction, pruning) and faithfulness, against runs patched by hand with plain hooks."""
from __future__ import annotations

import pytest
import torch

from probe.analyses import logit_diff_metric
from probe.analyses.circuit import Circuit, prune
from probe.analyses.circuit_forward import sparse_supported
from probe.analyses.circuit_graph import circuit_graph
from probe.analyses.edge_attribution import edge_attribution
from probe.analyses.faithfulness import CircuitRunner, faithfulness, faithfulness_curve
from probe import HookedDecoder
from probe.names import act_name

from test_variants import build

ANSWERS, COUNTERFACTUALS = [5, 9], [7, 2]


@pytest.fixture(scope="module")
def sharp_model(tiny_model):
    """The tiny model with its queries and keys scaled up: random-init attention is nearly uniform, so a changed
    query or key would barely move anything and a test of q/k paths could pass with both sides ignoring them."""
    import copy

    model = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for block in model.blocks:
            q_and_k = block.attn.qkv_sizes[0] + block.attn.qkv_sizes[1]
            block.attn.qkv.weight[:q_and_k] *= 15.0
    return model


def prompts(vocab: int, n_pos: int = 9, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, vocab, (2, n_pos), generator=gen)
    corrupted = clean.clone()
    corrupted[:, 1:-1] = torch.randint(0, vocab, (2, n_pos - 2), generator=gen)
    return clean, corrupted


def test_graph_of_gpt2_counts_names_and_edges(tiny_model):
    graph = circuit_graph(tiny_model)
    L, H = 2, 4
    assert graph.writers[:6] == ["embed", "L0H0", "L0H1", "L0H2", "L0H3", "L0 mlp"] and len(graph.writers) == 1 + L * (H + 1)
    assert graph.readers[:5] == ["L0H0<q", "L0H1<q", "L0H2<q", "L0H3<q", "L0H0<k"] and graph.readers[-1] == "logits"
    # by hand: layer l's attention inputs read embed + (H + 1) l writers, its MLP those and the layer's H heads
    by_hand = sum(3 * H * (1 + (H + 1) * l) + (1 + (H + 1) * l + H) for l in range(L)) + 1 + L * (H + 1)
    assert graph.n_edges == by_hand
    assert "L0H1 -> L0 mlp" in graph.edge_names() and "L1H0 -> L1H1<q" not in graph.edge_names()
    assert graph.writer_index("a1.2") == graph.writer_index("1.2") == graph.writer_index((1, 2)) == graph.writers.index("L1H2")
    assert graph.writer_index("m0") == graph.writers.index("L0 mlp") and graph.writer_index("input") == 0
    assert graph.reader_indices("a1.2<k") == [graph.readers.index("L1H2<k")]
    assert [graph.readers[i] for i in graph.reader_indices("L1H2")] == ["L1H2<q", "L1H2<k", "L1H2<v"]
    with pytest.raises(ValueError, match="'L7H0' is not a writer"):
        graph.writer_index("L7H0")
    with pytest.raises(ValueError, match="not a reader"):
        graph.reader_indices("L0H9<q")
    assert "110 edges" in str(graph)
    # by hand: before layer l's attention, embed and l layers' H heads and MLP; before its MLP, also its H heads
    assert graph.writers_before[0] == 0 and graph.writers_before[2 * L + 2] == len(graph.writers)
    for l in range(L):
        assert graph.writers_before[2 * l + 1] == 1 + (H + 1) * l and graph.writers_before[2 * l + 2] == 1 + (H + 1) * l + H


def test_graph_of_grouped_query_and_parallel_models(tmp_path):
    build("llama", tmp_path / "llama")
    graph = circuit_graph(HookedDecoder.from_pretrained(tmp_path / "llama"))
    assert graph.grouped and "L0KV1<k" in graph.readers and "L0H1<k" not in graph.readers
    kv = graph.readers.index("L0KV1<v")
    assert [graph.nodes[n] for n in graph.reader_nodes[kv].nonzero()[:, 0].tolist()] == ["L0H4", "L0H5", "L0H6", "L0H7"]
    assert [graph.readers[i] for i in graph.reader_indices("L1H5")] == ["L1H5<q", "L1KV1<k", "L1KV1<v"]
    build("neox", tmp_path / "neox")
    graph = circuit_graph(HookedDecoder.from_pretrained(tmp_path / "neox"))
    assert graph.parallel and "L0H1 -> L0 mlp" not in graph.edge_names() and "L0H1 -> L1 mlp" in graph.edge_names()


def test_post_norm_models_are_refused(tmp_path):
    build("gpt1", tmp_path)
    with pytest.raises(ValueError, match="post-norm blocks"):
        circuit_graph(HookedDecoder.from_pretrained(tmp_path))


FAMILIES = {"gpt2": None, "llama-gqa": "llama", "neox-parallel": "neox", "gemma2-sandwich": "gemma2",
            "olmo2-write-norms": "olmo2", "bloom-alibi": "bloom", "mixtral-experts": "mixtral",
            "gpt-oss-sinks-experts": "gpt_oss"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_full_circuit_is_clean_and_empty_circuit_is_corrupted(family, tiny_model, tmp_path):
    if FAMILIES[family] is None:
        model = tiny_model
    else:
        build(FAMILIES[family], tmp_path)
        model = HookedDecoder.from_pretrained(tmp_path).eval()
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    graph = circuit_graph(model)
    with torch.no_grad():
        mask = torch.ones_like(clean, dtype=torch.bool)
        clean_values, corrupted_values = metric(model(clean), clean, mask), metric(model(corrupted), corrupted, mask)
    full = Circuit(graph=graph, edges=torch.arange(graph.n_edges))
    empty = Circuit(graph=graph, edges=torch.zeros(0, dtype=torch.long))
    # sandwich blocks, ALiBi, attention sinks: hooked
    engines = ("sparse", "hooked") if sparse_supported(graph) else ("hooked",)
    assert sparse_supported(graph) == (family not in ("gemma2-sandwich", "olmo2-write-norms", "bloom-alibi",
                                                      "gpt-oss-sinks-experts"))
    for engine in engines:
        runners = {ablation: CircuitRunner.prepare(model, clean, corrupted, metric, ablation, engine=engine)
                   for ablation in ("patch", "mean", "zero")}
        for runner in runners.values():
            kept = runner.faithfulness(full)
            torch.testing.assert_close(kept.circuit_values, clean_values, atol=2e-5, rtol=0)
            assert kept.value == pytest.approx(1.0, abs=1e-3)
        none = runners["patch"].faithfulness(empty)
        torch.testing.assert_close(none.circuit_values, corrupted_values, atol=2e-5, rtol=0)
        assert none.value == pytest.approx(0.0, abs=1e-3)
        torch.testing.assert_close(none.ablated_values, corrupted_values)


@pytest.mark.parametrize("engine", ["sparse", "hooked"])
def test_a_two_step_path_matches_a_run_built_by_hand(sharp_model, engine):
    """embed -> L0H1<v, L0H1 -> L1H2<k, L1H2 -> logits: each head's output in the circuit run is what it outputs
    when only its kept input changes, and only the kept edge carries it on."""
    model = sharp_model
    clean, corrupted = prompts(model.cfg.d_vocab)
    metric = logit_diff_metric(model, ANSWERS, COUNTERFACTUALS)
    names = lambda n: True  # noqa: E731  (hook_result is opt-in: name it)
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean, names=names)
        _, corr = model.run_with_cache(corrupted, names=names)
        seen = {}

        def keep(x, hook):
            seen[hook.name] = x

        def clean_v(x, hook):
            x = x.clone()
            x[:, :, 1] = clean_cache[act_name("v", 0)][:, :, 1]
            return x

        model.run_with_hooks(corrupted, fwd_hooks=[(act_name("v", 0), clean_v), (act_name("result", 0), keep)])
        head_1 = seen[act_name("result", 0)][:, :, 1]
        block = model.blocks[1]

        def new_k(x, hook):
            x = x.clone()
            resid = corr[act_name("resid_pre", 1)] + head_1 - corr[act_name("result", 0)][:, :, 1]
            x[:, :, 2] = block.ln1(resid) @ block.attn.W_K[2] + block.attn.b_K[2]
            return x

        model.run_with_hooks(corrupted, fwd_hooks=[(act_name("k", 1), new_k), (act_name("result", 1), keep)])
        head_2 = seen[act_name("result", 1)][:, :, 2]
        final = corr[act_name("resid_post", 1)] + head_2 - corr[act_name("result", 1)][:, :, 2]
        expected = metric(model.unembed(model.ln_final(final)), corrupted, torch.ones_like(corrupted, dtype=torch.bool))
    graph = circuit_graph(model)
    circuit = Circuit.from_edges(graph, [("embed", "L0H1<v"), ("L0H1", "L1H2<k"), ("L1H2", "logits")])
    result = faithfulness(model, circuit, clean, corrupted, metric, engine=engine)
    torch.testing.assert_close(result.circuit_values, expected, atol=1e-6, rtol=1e-5)
    assert result.circuit_values.sub(result.ablated_values).abs().max() > 1e-5  # the path does carry something (float noise here is ~1e-7)


def test_pruning_drops_what_cannot_matter(tiny_model):
    graph = circuit_graph(tiny_model)
    circuit = Circuit.from_edges(graph, [("embed", "L0H1<v"), ("L0H1", "logits"),  # a path
                                         ("L0H2", "L1H0<q"),  # its writer is never reached from the embedding
                                         ("embed", "L1H3<k")],  # its reader's head reaches nothing
                                 prune_edges=True)
    assert circuit.edge_names() == ["embed -> L0H1<v", "L0H1 -> logits"]
    assert circuit.nodes == ["embed", "L0H1", "logits"] and circuit.requested == 4
    everything = prune(graph, torch.ones(graph.n_edges, dtype=torch.bool))
    assert bool(everything.all())
    with pytest.raises(ValueError, match="is not an edge"):
        Circuit.from_edges(graph, [("L1H0", "L0H1<q")])


def test_circuits_from_scores_and_the_curve(tiny_model):
    clean, corrupted = prompts(tiny_model.cfg.d_vocab)
    metric = logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)
    scores = edge_attribution(tiny_model, clean, corrupted, metric)
    graph = scores.graph
    top = scores.circuit(n_edges=12)
    assert top.requested == 12 and top.n_edges <= 12
    best = set(scores.top(12)["source"] + " -> " + scores.top(12)["target"])
    assert set(top.edge_names()) <= best
    greedy = scores.circuit(n_edges=12, method="greedy")
    # grown from the logits, every edge reaches them; those whose writer the embedding does not reach are pruned
    assert greedy.requested == 12 and 0 < greedy.n_edges <= 12
    assert torch.equal(prune(graph, greedy.edge_mask()), greedy.edge_mask())
    assert scores.circuit(threshold=float(scores.scores.abs().max()) + 1).n_edges == 0
    with pytest.raises(ValueError, match="exactly one of n_edges"):
        scores.circuit()
    curve = faithfulness_curve(tiny_model, scores, clean, corrupted, metric, sizes=[0, 5, graph.n_edges], n_random=2)
    frame = curve.to_frame()
    assert list(frame["circuit"]) == ["topn", "random", "random"] * 3
    best_rows = frame[frame["circuit"] == "topn"]
    assert best_rows["faithfulness"].iloc[0] == pytest.approx(0.0, abs=1e-3)
    assert best_rows["faithfulness"].iloc[-1] == pytest.approx(1.0, abs=1e-3)
    curve.figure()
    result = faithfulness(tiny_model, top, clean, corrupted, metric)
    rows = result.to_frame()
    assert list(rows["prompt"]) == ["0", "1", "mean"] and rows["faithfulness"].iloc[-1] == pytest.approx(result.value)


def test_faithfulness_refuses_bad_input(tiny_model, tmp_path):
    clean, corrupted = prompts(tiny_model.cfg.d_vocab)
    metric = logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)
    graph = circuit_graph(tiny_model)
    circuit = Circuit(graph=graph, edges=torch.arange(3))
    with pytest.raises(ValueError, match="ablation='median' is not one of"):
        faithfulness(tiny_model, circuit, clean, corrupted, metric, ablation="median")
    with pytest.raises(TypeError, match="must be a Circuit"):
        faithfulness(tiny_model, ["L0H1"], clean, corrupted, metric)
    with pytest.raises(ValueError, match="needs more than one"):
        faithfulness(tiny_model, circuit, clean[:1], corrupted[:1], logit_diff_metric(tiny_model, 5, 7), ablation="mean")


def test_probe_circuit_writes_its_files_and_escapes_tokens(tiny_dir, tmp_path, capsys):
    from probe.cli import cli

    out = tmp_path / "circuit"
    argv = ["circuit", "--model", str(tiny_dir), "--clean", "<script>the dog & the", "--corrupted", "<script>the the & the",
            "--answer", " dog", "--counterfactual", " the", "--method", "eap", "--edges", "10", "--random", "1",
            "--out", str(out)]
    code = cli.main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for name in ("edges.csv", "edges.html", "circuit.csv", "circuit.html", "faithfulness.csv", "faithfulness.html"):
        assert (out / name).is_file() and f"wrote {out / name}" in captured.err
    page = (out / "circuit.html").read_text()
    assert "<script>the" not in page and "&lt;script&gt;the" in page.replace("\\u0026", "&").replace("\\u003c", "<")
    assert "faithfulness" in captured.out
    code = cli.main(argv[:4] + ["<script>the dog dog & the"] + argv[5:] + ["--force"])
    assert code == 2 and "need equal lengths" in capsys.readouterr().err


def test_circuit_figure_draws_every_edge_kind(tiny_model):
    graph = circuit_graph(tiny_model)
    circuit = Circuit.from_edges(graph, [("embed", "L0H1<q"), ("embed", "L0H1<k"), ("embed", "L0H1<v"), ("L0H1", "L0 mlp"),
                                         ("L0 mlp", "logits"), ("L0H1", "logits")])
    circuit.scores = torch.tensor([0.5, -0.2, 0.1, 0.3, 1.0, -0.7])
    fig = circuit.figure()
    names = {trace.name for trace in fig.data if trace.name}
    assert {"into a query (enters left)", "into a key (centre)", "into a value (right)", "into an MLP", "into the logits"} == names
    hover = [t for t in fig.data if t.hovertext is not None and t.mode == "markers"][0].hovertext
    assert len(hover) == 6 and "L0H1 → L0 mlp<br>score +0.3" in hover


def test_scores_and_circuits_are_the_same_on_the_gpu(tiny_model, device_under_test):
    import copy

    gpu = copy.deepcopy(tiny_model).to(device_under_test)
    clean, corrupted = prompts(tiny_model.cfg.d_vocab)
    on = dict(clean=clean.to(device_under_test), corrupted=corrupted.to(device_under_test))
    for method in ("eap", "eap-ig-inputs"):
        cpu_scores = edge_attribution(tiny_model, clean, corrupted, logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS), method=method)
        gpu_scores = edge_attribution(gpu, on["clean"], on["corrupted"], logit_diff_metric(gpu, ANSWERS, COUNTERFACTUALS),
                                      method=method)
        scale = float(cpu_scores.scores.abs().max())
        torch.testing.assert_close(gpu_scores.scores, cpu_scores.scores, atol=1e-4 * scale, rtol=0)
        assert cpu_scores.circuit(n_edges=20).edge_names() == gpu_scores.circuit(n_edges=20).edge_names()
    circuit = cpu_scores.circuit(n_edges=20)
    on_gpu = Circuit(graph=circuit_graph(gpu), edges=circuit.edges)
    a = faithfulness(tiny_model, circuit, clean, corrupted, logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS))
    b = faithfulness(gpu, on_gpu, on["clean"], on["corrupted"], logit_diff_metric(gpu, ANSWERS, COUNTERFACTUALS))
    assert b.value == pytest.approx(a.value, abs=1e-4)


def test_bundled_model_induction_circuit(bundled_model):
    """Repeated random tokens against a copy whose first half is other random tokens: the 46 best edges by signed
    EAP-IG-activations score (41 after pruning, 4.4% of 927) hold the previous-token head (L0H1), the induction head
    (L2H0) and the K-composition edge between them, and keep most of the logit difference (measured 0.73, 95%
    interval 0.46-0.90 over these 8 prompts; docs/circuits.md)."""
    model = bundled_model
    gen = torch.Generator().manual_seed(0)
    first, other = torch.randint(100, 4000, (8, 20), generator=gen), torch.randint(100, 4000, (8, 20), generator=gen)
    bos = torch.full((8, 1), model.tokenizer.bos_id)
    clean, corrupted = torch.cat([bos, first, first[:, :12]], 1), torch.cat([bos, other, first[:, :12]], 1)
    metric = logit_diff_metric(model, first[:, 12].tolist(), [4050] * 8)  # the next token against one in neither prompt
    scores = edge_attribution(model, clean, corrupted, metric, method="eap-ig-activations")
    circuit = scores.circuit(n_edges=46, absolute=False)
    assert circuit.n_edges <= 0.05 * scores.graph.n_edges
    assert {"L0H1", "L2H0"} <= set(circuit.nodes) and circuit.contains("L0H1", "L2H0<k")
    kept = faithfulness(model, circuit, clean, corrupted, metric)
    assert kept.value > 0.6 and kept.interval()[0] > 0.4 and kept.p_value() < 0.02


def test_probe_circuit_signed_selects_the_highest_scores(tiny_dir, tmp_path, capsys):
    """--signed: the circuit is the --edges edges of edges.csv with the highest scores (sorted here by hand), pruned,
    which here differ from the edges with the largest |score| (the default)."""
    import pandas as pd

    from probe.cli import cli

    graph = circuit_graph(HookedDecoder.from_pretrained(tiny_dir))
    out = tmp_path / "signed"
    argv = ["circuit", "--model", str(tiny_dir), "--clean", "the dog and the cat", "--corrupted", "the the and the cat",
            "--answer", " dog", "--counterfactual", " the", "--method", "eap", "--edges", "15", "--random", "0",
            "--signed", "--out", str(out)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    edges, circuit = pd.read_csv(out / "edges.csv"), pd.read_csv(out / "circuit.csv")
    top = edges.loc[edges["score"].sort_values(ascending=False, kind="stable").index[:15]]
    expected = Circuit.from_edges(graph, list(zip(top["source"], top["target"])), prune_edges=True)
    assert set(zip(circuit["source"], circuit["target"])) == {tuple(e.split(" -> ")) for e in expected.edge_names()}
    assert len(circuit) > 0 and (circuit["score"] >= top["score"].min()).all()
    by_size = edges.loc[edges["score"].abs().sort_values(ascending=False, kind="stable").index[:15]]
    assert set(zip(top["source"], top["target"])) != set(zip(by_size["source"], by_size["target"]))  # negative edges


CIRCUIT_ARGS = ["--clean", "the dog and the", "--corrupted", "the the and the", "--answer", " dog", "--counterfactual", " the",
                "--method", "eap", "--random", "0"]


@pytest.mark.parametrize("flag, value, said", [
    ("--clean", "the dog \udcff and", "--clean is not UTF-8"),  # how Python hands over a command line's byte 0xFF
    ("--answer", "\udcff", "--answer is not UTF-8"),
    ("--clean", "", "--clean is empty"),
])
def test_probe_circuit_refuses_non_utf8_and_empty_text(tiny_dir, tmp_path, capsys, flag, value, said):
    from probe.cli import cli

    argv = ["circuit", "--model", str(tiny_dir), *CIRCUIT_ARGS, "--out", str(tmp_path / "out")]
    argv[argv.index(flag) + 1] = value
    if flag == "--clean" and value == "":
        argv[argv.index("--corrupted") + 1] = ""  # equal lengths: the empty prompt itself must be what is named
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and not (tmp_path / "out").exists()
    if "UTF-8" in said:
        assert "0xFF" in err  # the offending byte, as the shell passed it


def test_circuit_accepts_numpy_and_tensor_integers_and_refuses_bad_thresholds(tiny_model):
    import numpy as np

    clean, corrupted = prompts(tiny_model.cfg.d_vocab)
    scores = edge_attribution(tiny_model, clean, corrupted, logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS))
    plain = scores.circuit(n_edges=12)
    for n in (np.int64(12), torch.tensor(12)):  # e.g. a size read back from faithfulness.csv
        assert scores.circuit(n_edges=n).edge_names() == plain.edge_names() and scores.circuit(n_edges=n).requested == 12
    for bad in (float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="threshold"):
            scores.circuit(threshold=bad)


def test_circuit_figure_title_wraps_a_long_prompt_and_counts_nodes_as_the_circuit(tiny_model):
    """plotly never wraps a title: a long corrupted prompt ran off the figure's right edge. The title's lines must
    each fit the figure's width, and together hold every shown token of the prompt, escaped for plotly."""
    import html

    from probe.analyses.circuit_figure import MAX_TITLE_TOKENS
    from probe.analyses.labels import TITLE_CHAR_PX, shown_token

    graph = circuit_graph(tiny_model)
    tokens = [f"<tok{i}&>" for i in range(MAX_TITLE_TOKENS)]
    circuit = Circuit.from_edges(graph, [("embed", "L0H1<v"), ("L0H1", "logits")])
    circuit.labels = tokens
    fig = circuit.figure()
    title = fig.layout.title.text
    lines = title.split("<br>")
    assert len(lines) > 2  # 40 tokens of 9 characters do not fit one line of a 720 px figure
    for line in lines:
        small = line.startswith("<sup>")
        plain = html.unescape(line.removeprefix("<sup>").removesuffix("</sup>"))
        assert "<" not in line.removeprefix("<sup>").removesuffix("</sup>")  # escaped: no raw markup
        assert len(plain) * TITLE_CHAR_PX * (0.7 if small else 1.0) <= fig.layout.width
    joined = "".join(html.unescape(l.removeprefix("<sup>").removesuffix("</sup>")) for l in lines)
    assert "".join(shown_token(t) for t in tokens) in joined.replace(" ", "")
    assert fig.layout.margin.t >= 30 + 24 * len(lines)  # room above the plot for every line
    # an empty circuit has no nodes (circuit.nodes), and the drawing says so rather than "1 nodes"
    empty = Circuit(graph=graph, edges=torch.zeros(0, dtype=torch.long), requested=3)
    assert empty.nodes == [] and "0 edges" in empty.figure().layout.title.text
    assert "1 nodes" not in empty.figure().layout.title.text and "0 nodes" in empty.figure().layout.title.text


def test_probe_circuit_says_when_pruning_leaves_no_edges(tiny_dir, tmp_path, capsys):
    """--edges 1 here picks L0H2 -> logits, whose writer the embedding does not reach: pruned, an empty circuit.
    The run must say so and how to get a circuit, not only report faithfulness 0."""
    import pandas as pd

    from probe.cli import cli

    out = tmp_path / "one"
    assert cli.main(["circuit", "--model", str(tiny_dir), *CIRCUIT_ARGS, "--edges", "1", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    edges = pd.read_csv(out / "edges.csv")
    best = edges.loc[edges["score"].abs().idxmax()]
    assert best["source"] != "embed" and best["target"] == "logits"  # by hand: this edge cannot survive pruning
    assert len(pd.read_csv(out / "circuit.csv")) == 0
    assert "no edges" in err and "--edges" in err


def test_circuit_edges_and_curve_sizes_are_checked_not_wrapped_or_truncated(tiny_model):
    """An edge index of -1 would silently be the graph's last edge, and a size of 2.5 two edges."""
    graph = circuit_graph(tiny_model)
    with pytest.raises(ValueError, match="indices from -1"):
        Circuit(graph=graph, edges=torch.tensor([0, -1]))
    with pytest.raises(ValueError, match=f"edges are 0 to {graph.n_edges - 1}"):
        Circuit(graph=graph, edges=torch.tensor([graph.n_edges]))
    with pytest.raises(TypeError, match="1-D integer tensor"):
        Circuit(graph=graph, edges=torch.tensor([0.0, 1.0]))
    assert Circuit(graph=graph, edges=torch.tensor([], dtype=torch.long)).n_edges == 0
    clean, corrupted = prompts(tiny_model.cfg.d_vocab)
    metric = logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)
    scores = edge_attribution(tiny_model, clean, corrupted, metric)
    with pytest.raises(TypeError, match="a size in sizes=2.5"):
        faithfulness_curve(tiny_model, scores, clean, corrupted, metric, sizes=[2, 2.5])
    with pytest.raises(ValueError, match="n_random=True"):
        faithfulness_curve(tiny_model, scores, clean, corrupted, metric, sizes=[2], n_random=True)
