"""Circuits on the toy architectures transformer-lens builds: attention-only models (ARENA 1.2's induction model,
Neel Nanda's attn-only-Nl), shortformer positions, models without norms (ARENA's grokking model) and SoLU MLPs, against
HookedTransformer itself: every edge's EAP, EAP-IG and exact score, path patches and circuits' metrics computed by
hand with its hook points (tests/circuits_by_hand.py, run by tests/saelens_oracle.py's `circuits` command)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from circuits_by_hand import names
from probe import HookedDecoder, HookedTransformerConfig
from probe.analyses import circuit_graph, edge_attribution, faithfulness, logit_diff_metric, path_patch
from probe.analyses.circuit import Circuit
from test_sae_training import needs_saelens, oracle

SMALL = dict(d_model=32, d_head=8, n_heads=4, n_layers=2, n_ctx=16, d_vocab=40, seed=398)
CASES = {
    # ARENA 1.2's induction model at a small size
    "arena-attn-only-shortformer": dict(SMALL, attn_only=True, positional_embedding_type="shortformer", normalization_type=None),
    "attn-only-shortformer-ln": dict(SMALL, attn_only=True, positional_embedding_type="shortformer"),  # attn-only-2l
    "attn-only-standard-ln": dict(SMALL, attn_only=True),
    "mlp-no-norm": dict(SMALL, d_mlp=64, act_fn="relu", normalization_type=None),  # ARENA's grokking model's kind
    "mlp-shortformer-rms": dict(SMALL, d_mlp=64, act_fn="gelu", positional_embedding_type="shortformer",
                                normalization_type="RMS"),
    "solu-ln": dict(SMALL, d_mlp=64, act_fn="solu_ln"),  # Neel Nanda's solu-Nl: the MLP's own LayerNorm inside it
}
ANSWERS, WRONGS = [5, 9], [7, 2]
PATHS = [("L0H1", ["L1H0<k"]), ("L0H2", ["L1H3<q", "L1H3<k", "L1H3<v"]), ("embed", ["logits"]), ("L0H0", ["logits"]),
         ("embed", ["L1H2<q", "L0H1<v"])]
MLP_PATHS = [("L0 mlp", ["L1H2<v"]), ("L0H1", ["L0 mlp"]), ("L1 mlp", ["logits"])]


def prompts(vocab: int):
    gen = torch.Generator().manual_seed(3)
    clean = torch.randint(0, vocab, (2, 9), generator=gen)
    corrupted = clean.clone()
    corrupted[:, 2:5] = torch.randint(0, vocab, (2, 3), generator=gen)
    return clean, corrupted


def random_circuits(settings: dict) -> list[list[tuple[str, str]]]:
    """Edge lists: the whole graph, none, and random subsets of 5, 20 and 50 edges."""
    graph = circuit_graph(HookedDecoder(HookedTransformerConfig(**settings)))
    edges = list(zip(graph.to_frame()["source"], graph.to_frame()["target"]))
    gen = torch.Generator().manual_seed(8)
    picks = [torch.randperm(len(edges), generator=gen)[:n].tolist() for n in (5, 20, 50)]
    return [edges, []] + [[edges[i] for i in sorted(p)] for p in picks]


def spec_of(settings: dict) -> dict:
    return {"answers": ANSWERS, "wrongs": WRONGS, "paths": PATHS + (MLP_PATHS if "d_mlp" in settings else []),
            "circuits": random_circuits(settings)}


@pytest.fixture(scope="module")
def by_hand(tmp_path_factory) -> dict:
    """Every case's oracle results, from one oracle process (its start costs more than a case)."""
    tmp = tmp_path_factory.mktemp("circuits_by_hand")
    inputs = {}
    for name, settings in CASES.items():
        inputs[f"{name}/clean"], inputs[f"{name}/corrupted"] = prompts(settings["d_vocab"])
    save_file(inputs, str(tmp / "inputs.safetensors"))
    cases = {name: {"config": settings, "spec": spec_of(settings)} for name, settings in CASES.items()}
    oracle("circuits", json.dumps(cases), tmp / "inputs.safetensors", tmp / "out.safetensors")
    return load_file(str(tmp / "out.safetensors"))


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, by_hand):
    """(settings, probe's model with HookedTransformer's weights, the oracle's results, the spec, clean, corrupted)."""
    settings, prefix = CASES[request.param], f"{request.param}/"
    out = {key.removeprefix(prefix): t for key, t in by_hand.items() if key.startswith(prefix)}
    model = HookedDecoder(HookedTransformerConfig(**settings)).eval()
    model.load_state_dict({k.removeprefix("state."): v for k, v in out.items() if k.startswith("state.")}, strict=True)
    clean, corrupted = prompts(settings["d_vocab"])
    return settings, model, out, spec_of(settings), clean, corrupted


def at_edges(graph, full: torch.Tensor) -> torch.Tensor:
    """[batch edge] of a [batch writer reader] matrix in the graph's order."""
    return full[:, graph.edge_writer, graph.edge_reader]


def assert_close_scaled(ours, expected):
    scale = float(expected.abs().max())
    assert scale > 1e-3
    torch.testing.assert_close(ours.float(), expected.float(), atol=1e-4 * scale, rtol=0)


@needs_saelens
def test_the_graph_is_hooked_transformers_nodes(case):
    settings, model, *_ = case
    graph = circuit_graph(model)
    writers, readers = names(model.cfg)
    assert (graph.writers, graph.readers) == (writers, readers)
    assert graph.mlps == ("d_mlp" in settings)
    assert not any(kind == "mlp" for kind in graph.writer_kind + graph.reader_kind) or graph.mlps


@needs_saelens
@pytest.mark.parametrize("method, key, steps", [("eap", "eap", 1), ("clean-corrupted", "clean_corrupted", 1),
                                                ("eap-ig-inputs", "eap_ig_inputs", 3), ("exact", "exact", 1)])
def test_edge_scores_match_hooked_transformer_by_hand(case, method, key, steps):
    """Every edge's score (into q, k, v, MLP inputs and the logits) against HookedTransformer's hook-point gradients
    (EAP, EAP-IG on the inputs) or its patched forwards (exact), per prompt."""
    settings, model, out, spec, clean, corrupted = case
    metric = logit_diff_metric(model, ANSWERS, WRONGS)
    ours = edge_attribution(model, clean, corrupted, metric, method=method, ig_steps=steps)
    expected = at_edges(ours.graph, out[key])
    assert_close_scaled(ours.per_example, expected)
    kinds = torch.tensor([ours.graph.reader_kind[r] == "k" for r in ours.graph.edge_reader.tolist()])
    assert float(expected[:, kinds].abs().max()) > 1e-3 * float(expected.abs().max())  # keys were compared too


@needs_saelens
def test_the_large_model_path_matches_too(case, monkeypatch):
    """One layer at a time and the clean prompts in their own forward, as a large model on a CPU runs."""
    import sys

    monkeypatch.setattr(sys.modules["probe.analyses.edge_gradients"], "SMALL_FORWARD", 0)
    settings, model, out, spec, clean, corrupted = case
    metric = logit_diff_metric(model, ANSWERS, WRONGS)
    ours = edge_attribution(model, clean, corrupted, metric, method="eap-ig-inputs", ig_steps=3, positions=True,
                            max_rows=2 * clean.shape[0])
    assert_close_scaled(ours.per_example, at_edges(ours.graph, out["eap_ig_inputs"]))
    assert_close_scaled(ours.per_position.sum(1), at_edges(ours.graph, out["eap_ig_inputs"]))


@needs_saelens
def test_path_patches_match_hooked_transformer_by_hand(case):
    settings, model, out, spec, clean, corrupted = case
    metric = logit_diff_metric(model, ANSWERS, WRONGS)
    for i, (sender, receivers) in enumerate(spec["paths"]):
        ours = path_patch(model, clean, corrupted, metric, senders=sender, receivers=receivers)
        torch.testing.assert_close(ours.patched[0], out[f"path.{i}"], atol=1e-4, rtol=1e-4, msg=f"{sender} -> {receivers}")


@needs_saelens
@pytest.mark.parametrize("engine", ["sparse", "hooked"])
def test_circuits_match_hooked_transformer_by_hand(case, engine):
    """The metric of circuits (all edges, none, random subsets) with every other edge patched to its corrupted value,
    both engines; the whole graph's faithfulness is 1 and the empty one's 0."""
    settings, model, out, spec, clean, corrupted = case
    metric = logit_diff_metric(model, ANSWERS, WRONGS)
    graph = circuit_graph(model)
    for i, edges in enumerate(spec["circuits"]):
        result = faithfulness(model, Circuit.from_edges(graph, [tuple(e) for e in edges]), clean, corrupted, metric,
                              engine=engine)
        torch.testing.assert_close(result.circuit_values.float(), out[f"circuit.{i}"], atol=1e-4, rtol=1e-4, msg=str(i))
        if i < 2:
            assert abs(result.value - (1.0 - i)) < 1e-5


@needs_saelens
def test_the_figure_has_no_mlp_rows_without_mlps(case):
    settings, model, out, spec, clean, corrupted = case
    scores = edge_attribution(model, clean, corrupted, logit_diff_metric(model, ANSWERS, WRONGS))
    figure = scores.circuit(n_edges=10).figure()
    labels = list(figure.layout.yaxis.ticktext)
    mlp_rows = [f"L{l} mlp" for l in range(model.cfg.n_layers)]
    assert ("d_mlp" in settings) == all(row in labels for row in mlp_rows)
    assert labels[0] == "embed" and labels[-1] == "logits" and "L1 attn" in labels


def train_induction_model() -> HookedDecoder:
    """ARENA 1.2's kind of model (attention-only, shortformer positions, no norms) at a small size, trained on random
    tokens with a copy of a random span of random length at a random offset, so only induction predicts the copy
    (a fixed offset would be learnt by position alone). Its loss falls past the induction bump in ~300 steps."""
    vocab, length = 40, 20
    model = HookedDecoder(HookedTransformerConfig(
        d_model=64, d_head=16, n_heads=4, n_layers=2, n_ctx=length, d_vocab=vocab, attn_only=True,
        positional_embedding_type="shortformer", normalization_type=None, seed=2))
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(400):
        tokens = torch.randint(1, vocab, (64, length), generator=gen)
        tokens[:, 0] = 0
        copied = torch.zeros(64, length - 1, dtype=torch.bool)
        for row in range(64):
            span = int(torch.randint(3, 10, (1,), generator=gen))
            start = int(torch.randint(1, length - 2 * span + 1, (1,), generator=gen))
            tokens[row, start + span:start + 2 * span] = tokens[row, start:start + span]
            copied[row, start + span:start + 2 * span - 1] = True  # the copy's tokens after its first
        logits = model(tokens)[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[copied], tokens[:, 1:][copied])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return model.eval()


@pytest.mark.slow
def test_the_induction_circuit_of_an_attention_only_shortformer_model():
    """Repeated random tokens against a copy whose first half is other random tokens, the answer the next repeated
    token against one in neither prompt (as the bundled model's test in test_circuit.py): the previous-token head
    and the induction heads, found by their attention patterns, are joined in the circuit by K-composition edges
    (measured: the 12 edges hold L0H3 -> L1H{0,2}<k), and a circuit of 24 of the 81 edges keeps most of the logit
    difference (measured 0.77, 95% interval 0.68-0.91). Seed 2 under TL's own initial draw, which HookedDecoder
    follows for a HookedTransformerConfig (seed 1 trains a weaker previous-token head in 400 steps)."""
    model = train_induction_model()
    vocab, half = model.cfg.d_vocab, 8
    gen = torch.Generator().manual_seed(5)
    first = torch.randint(1, vocab - 1, (16, half), generator=gen)
    other = torch.randint(1, vocab - 1, (16, half), generator=gen)
    bos = torch.zeros(16, 1, dtype=torch.long)
    clean, corrupted = torch.cat([bos, first, first[:, :-1]], 1), torch.cat([bos, other, first[:, :-1]], 1)
    with torch.no_grad():
        _, cache = model.run_with_cache(clean)
    # a query's previous token, and the token after its earlier occurrence (the second half's queries)
    previous = cache["blocks.0.attn.hook_pattern"].diagonal(offset=-1, dim1=-2, dim2=-1).mean((0, -1))
    induction = cache["blocks.1.attn.hook_pattern"].diagonal(offset=-(half - 1), dim1=-2, dim2=-1)[..., 1:].mean((0, -1))
    prev_head = int(previous.argmax())
    assert float(previous.max()) > 0.6 and float(induction.max()) > 0.5
    inductive = [h for h in range(4) if float(induction[h]) > 0.5]

    metric = logit_diff_metric(model, first[:, -1].tolist(), [vocab - 1] * 16)
    scores = edge_attribution(model, clean, corrupted, metric, method="eap-ig-activations")
    small = scores.circuit(n_edges=12, absolute=False)
    assert f"L0H{prev_head}" in small.nodes
    assert any(small.contains(f"L0H{prev_head}", f"L1H{h}<k") for h in inductive)
    kept = faithfulness(model, scores.circuit(n_edges=24, absolute=False), clean, corrupted, metric)
    assert kept.value > 0.6 and kept.interval()[0] > 0.45 and kept.p_value() < 0.02


def test_a_tokenizerless_models_prompt_in_the_title_keeps_its_ids_apart():
    model = HookedDecoder(HookedTransformerConfig(**CASES["arena-attn-only-shortformer"]))
    clean, corrupted = prompts(model.cfg.d_vocab)
    scores = edge_attribution(model, clean, corrupted, logit_diff_metric(model, ANSWERS, WRONGS))
    title = scores.circuit(n_edges=10).figure().layout.title.text
    assert " ".join(str(t) for t in corrupted[0].tolist()) in title


def test_probe_circuit_runs_on_a_transformer_lens_attention_only_checkpoint(tmp_path, capsys):
    """`probe circuit --model DIR` on a checkpoint in transformer-lens's own format (a TL config.json naming a local
    tokenizer, a *final.pth state dict), as Neel Nanda's attn-only-Nl are stored: the edge CSV is the graph's 81
    edges with no MLP inputs, scored as edge_attribution scores them in-process."""
    import pandas as pd

    import probe
    from probe.cli import cli

    settings = dict(d_model=32, d_head=8, n_heads=4, n_layers=2, n_ctx=32, d_vocab=4096, attn_only=True,
                    positional_embedding_type="shortformer", normalization_type=None, act_fn="relu",
                    tokenizer_name=str(probe.DEFAULT_MODEL), model_name="toy-attn-only-2l", seed=3)
    directory = tmp_path / "toy"
    directory.mkdir()
    model = HookedDecoder(HookedTransformerConfig(**settings))
    torch.save(model.state_dict(), directory / "model_final.pth")
    (directory / "config.json").write_text(json.dumps(dict(settings, d_mlp=None)))
    clean, corrupted = "the dog and the cat", "the the and the cat"
    argv = ["circuit", "--model", str(directory), "--clean", clean, "--corrupted", corrupted, "--answer", " dog",
            "--counterfactual", " the", "--method", "eap", "--edges", "10", "--random", "0", "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 0, capsys.readouterr().err
    edges = pd.read_csv(tmp_path / "out" / "edges.csv")
    assert len(edges) == 81 and set(edges["input"]) == {"q", "k", "v", "logits"}
    loaded = HookedDecoder.from_pretrained(directory).eval()
    answer, wrong = loaded.to_single_token(" dog"), loaded.to_single_token(" the")
    ours = edge_attribution(loaded, clean, corrupted, logit_diff_metric(loaded, [answer], [wrong]))
    expected = ours.to_frame().set_index(["source", "target"])["score"]
    got = edges.set_index(["source", "target"])["score"]
    torch.testing.assert_close(torch.tensor(got.loc[expected.index].values).float(), torch.tensor(expected.values).float(),
                               atol=1e-6, rtol=1e-5)
    assert (tmp_path / "out" / "circuit.html").exists()
