"""The sparse circuit forward (analyses.circuit_forward) against the hooked patched forward (analyses.edge_patching),
which the faithfulness tests in test_circuit.py hold to plain runs built by hand: the same circuit metrics for random
circuits of many sizes, under every ablation, on GPT-2, Llama with grouped-query attention, GPT-NeoX (parallel
blocks, partial rotary), Mistral (a sliding window shorter than the prompts) and Qwen3 (q/k norms), with padding."""
from __future__ import annotations

import pytest
import torch

from probe import HookedDecoder
from probe.analyses import logit_diff_metric
from probe.analyses.circuit import Circuit
from probe.analyses.circuit_graph import circuit_graph
from probe.analyses.faithfulness import CircuitRunner, faithfulness

from test_variants import build

FAMILIES = ("gpt2", "llama", "neox", "mistral", "qwen3")


def sharpened(model: HookedDecoder) -> HookedDecoder:
    """Queries and keys scaled up: random-init attention is nearly uniform, so a rebuilt query or key would barely
    move anything and both engines could agree while ignoring it."""
    with torch.no_grad():
        for block in model.blocks:
            q_and_k = block.attn.qkv_sizes[0] + block.attn.qkv_sizes[1]
            block.attn.qkv.weight[:q_and_k] *= 15.0
    return model


# every ablation on the three main families; the sliding window (Mistral) and q/k norms (Qwen3) under patch
CASES = [(family, ablation) for family in FAMILIES[:3] for ablation in ("patch", "mean", "zero")] + \
    [(family, "patch") for family in FAMILIES[3:]]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory, tiny_dir):
    """family -> its sharpened model, built on first use and shared by the module's tests."""
    built = {}

    def get(family: str) -> HookedDecoder:
        if family not in built:
            directory = tiny_dir
            if family != "gpt2":
                directory = tmp_path_factory.mktemp(family)
                build(family, directory)
            built[family] = sharpened(HookedDecoder.from_pretrained(directory).eval())
        return built[family]

    return get


def paired(vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, vocab, (3, 12), generator=gen)
    corrupted = clean.clone()
    corrupted[:, 1:-1] = torch.randint(0, vocab, (3, 10), generator=gen)
    mask = torch.ones_like(clean)
    mask[0, :3] = 0  # one prompt left-padded: positions and the allowed keys follow the mask
    return clean, corrupted, mask


def random_circuits(n_edges: int, sizes, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros(len(sizes), n_edges, dtype=torch.bool)
    for i, size in enumerate(sizes):
        out[i, torch.randperm(n_edges, generator=gen)[:size]] = True
    return out


@pytest.mark.parametrize("family, ablation", CASES)
def test_sparse_forward_matches_the_hooked_forward(family_models, family, ablation):
    model = family_models(family)
    clean, corrupted, mask = paired(model.cfg.d_vocab)
    metric = logit_diff_metric(model, [5, 9, 3], [7, 2, 1])
    sparse = CircuitRunner.prepare(model, clean, corrupted, metric, ablation, attention_mask=mask, engine="sparse")
    hooked = CircuitRunner.prepare(model, clean, corrupted, metric, ablation, attention_mask=mask, engine="hooked")
    assert sparse.run is not None and hooked.run is None
    n = sparse.graph.n_edges
    circuits = random_circuits(n, [0, 1, 10, n // 3, n - 5, n])
    got, expected = sparse.evaluate(circuits), hooked.evaluate(circuits)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert float((expected - expected[0]).abs().max()) > 0.01  # the circuits do differ from the ablated run
    if ablation == "patch":  # one circuit at a time (no copies stacked) gives the same values
        torch.testing.assert_close(sparse.evaluate(circuits[3:4])[0], expected[3], atol=1e-5, rtol=0)


# a shared norm scale per layer; ALiBi's biased scores; q/k norms after rotary
@pytest.mark.parametrize("family", ["gemma2", "bloom", "hunyuan"])
def test_sparse_engine_refuses_sandwich_blocks_and_alibi_and_auto_falls_back(family, tmp_path):
    build(family, tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    clean, corrupted, mask = paired(model.cfg.d_vocab)
    metric = logit_diff_metric(model, [5, 9, 3], [7, 2, 1])
    with pytest.raises(ValueError, match="engine='sparse' does not run sandwich blocks .*, nor ALiBi's"):
        CircuitRunner.prepare(model, clean, corrupted, metric, engine="sparse")
    with pytest.raises(ValueError, match="engine='fast' is not one of"):
        CircuitRunner.prepare(model, clean, corrupted, metric, engine="fast")
    assert CircuitRunner.prepare(model, clean, corrupted, metric).run is None  # auto: the hooked forward


def test_a_metric_without_declared_reads_gets_the_full_logits(tiny_model):
    """A user's metric (no `reads`): evaluated on the full logits of the sparse forward; the same as the hooked
    engine's and, for the full graph, the clean run's."""
    model = tiny_model
    clean, corrupted, mask = paired(model.cfg.d_vocab)

    def mean_logit(logits, tokens, attention_mask):  # reads every position
        return (logits[..., 3] * attention_mask).sum(-1) / attention_mask.sum(-1)

    graph = circuit_graph(model)
    circuit = Circuit(graph=graph, edges=torch.randperm(graph.n_edges, generator=torch.Generator().manual_seed(0))[:30])
    full = Circuit(graph=graph, edges=torch.arange(graph.n_edges))
    a = faithfulness(model, circuit, clean, corrupted, mean_logit, attention_mask=mask, engine="sparse")
    b = faithfulness(model, circuit, clean, corrupted, mean_logit, attention_mask=mask, engine="hooked")
    torch.testing.assert_close(a.circuit_values, b.circuit_values, atol=1e-5, rtol=0)
    kept = faithfulness(model, full, clean, corrupted, mean_logit, attention_mask=mask, engine="sparse")
    with torch.no_grad():
        torch.testing.assert_close(kept.circuit_values, mean_logit(model(clean, attention_mask=mask), clean, mask),
                                   atol=2e-5, rtol=0)


def test_sparse_engine_runs_bfloat16_models(tiny_dir):
    """A bfloat16 model under the default (sparse) engine: the full graph is the model's own clean forward and the
    empty graph its corrupted forward, to bfloat16 rounding, for a metric that declares its reads and one that does
    not. The last tokens differ (3 clean, 4 corrupted), so the two runs are far apart next to that rounding."""
    model = HookedDecoder.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    clean, corrupted, mask = paired(model.cfg.d_vocab)
    clean[:, -1], corrupted[:, -1] = 3, 4
    graph = circuit_graph(model)
    full = Circuit(graph=graph, edges=torch.arange(graph.n_edges))
    empty = Circuit(graph=graph, edges=torch.zeros(0, dtype=torch.long))

    def last_logit(logits, tokens, attention_mask):  # no declared reads: the full logits
        return logits[:, -1, 3].float() - logits[:, -1, 4].float()

    for metric in (logit_diff_metric(model, [3, 3, 3], [4, 4, 4]), last_logit):
        runner = CircuitRunner.prepare(model, clean, corrupted, metric, attention_mask=mask)
        assert runner.run is not None  # the sparse engine
        with torch.no_grad():
            expected_clean = metric(model(clean, attention_mask=mask), clean, mask.bool()).float()
            expected_corrupted = metric(model(corrupted, attention_mask=mask), corrupted, mask.bool()).float()
        assert float((expected_clean - expected_corrupted).abs().min()) > 0.2
        got = runner.evaluate(torch.stack([full.edge_mask(), empty.edge_mask()]))
        torch.testing.assert_close(got[0], expected_clean, atol=1e-2, rtol=0)
        torch.testing.assert_close(got[1], expected_corrupted, atol=1e-2, rtol=0)


def test_evaluate_refuses_masks_that_are_not_circuit_by_edge_bool(tiny_model):
    """`evaluate` takes [circuit edge] bool: one circuit's [edge] mask, a wrong edge count or float weights (which the
    hooked engine would read as fractional edges and the sparse one as whole ones) are refused, naming the fix."""
    clean, corrupted, mask = paired(tiny_model.cfg.d_vocab)
    metric = logit_diff_metric(tiny_model, [5, 9, 3], [7, 2, 1])
    n = circuit_graph(tiny_model).n_edges
    for engine in ("sparse", "hooked"):
        runner = CircuitRunner.prepare(tiny_model, clean, corrupted, metric, attention_mask=mask, engine=engine)
        with pytest.raises(ValueError, match=r"\[circuit edge\].*edge_mask\(\)\[None\]"):
            runner.evaluate(torch.ones(n, dtype=torch.bool))
        with pytest.raises(ValueError, match=f"{n} edges"):
            runner.evaluate(torch.ones(1, n - 1, dtype=torch.bool))
        with pytest.raises(TypeError, match="bool"):
            runner.evaluate(torch.full((1, n), 0.5))


def test_hunyuan_circuits_run_on_the_hooked_forward_and_match_it(tmp_path):
    """HunYuan normalises q and k after rotary, which the sparse engine does not compute: `auto` takes the hooked
    forward, and a random circuit's metric is the hooked engine's own (and the full and empty circuits the clean and
    corrupted runs')."""
    build("hunyuan", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    clean, corrupted, mask = paired(model.cfg.d_vocab)
    metric = logit_diff_metric(model, [5, 9, 3], [7, 2, 1])
    auto = CircuitRunner.prepare(model, clean, corrupted, metric, attention_mask=mask)
    hooked = CircuitRunner.prepare(model, clean, corrupted, metric, attention_mask=mask, engine="hooked")
    assert auto.run is None
    n = auto.graph.n_edges
    circuits = torch.rand(3, n, generator=torch.Generator().manual_seed(0)) < 0.3
    circuits[1], circuits[2] = True, False
    got = auto.evaluate(circuits)
    torch.testing.assert_close(got, hooked.evaluate(circuits), atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], auto.clean_values, atol=1e-4, rtol=0)
    torch.testing.assert_close(got[2], auto.corrupted_values, atol=1e-4, rtol=0)


def test_a_gated_attention_model_runs_circuits_on_the_hooked_forward(tmp_path):
    """Each head's z gated by sigmoid(x W_gate) (Qwen3.5's attention, here without linear layers) is not computed by
    the sparse engine: `auto` takes the hooked forward, whose full and empty circuits are the clean and corrupted
    runs."""
    from probe import DecoderConfig

    torch.manual_seed(0)
    model = HookedDecoder(DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, positions="rotary",
                                        norm="rms", attn_output_gate=True)).eval()
    clean, corrupted, mask = paired(50)
    metric = logit_diff_metric(model, [5, 9, 3], [7, 2, 1])
    runner = CircuitRunner.prepare(model, clean, corrupted, metric, attention_mask=mask)
    assert runner.run is None
    with pytest.raises(ValueError, match="engine='sparse' does not run"):
        CircuitRunner.prepare(model, clean, corrupted, metric, engine="sparse")
    full_and_empty = torch.stack([torch.ones(runner.graph.n_edges, dtype=torch.bool),
                                  torch.zeros(runner.graph.n_edges, dtype=torch.bool)])
    got = runner.evaluate(full_and_empty)
    torch.testing.assert_close(got, torch.stack([runner.clean_values, runner.corrupted_values]), atol=1e-4, rtol=0)
