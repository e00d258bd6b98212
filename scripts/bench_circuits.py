"""Benchmark workloads 13 and 14: edge attribution (EAP, EAP-IG) over every edge and one circuit's
faithfulness, at GPT-2-small shape and on the small model."""
from __future__ import annotations

from probe.cli.bench_harness import PROBE, Case, Context, all_of, at_most, no_grad, workload


def circuit_cases(ctx: Context) -> list[Case]:
    from probe.analyses import edge_attribution, faithfulness, logit_diff_metric
    from probe.analyses.faithfulness import CircuitRunner

    probe = ctx.probe_model()
    clean, corrupted = ctx.tokens(seed=0), ctx.tokens(seed=1)
    metric = logit_diff_metric(probe, 0, 1)
    circuit = edge_attribution(probe, clean, corrupted, metric).circuit(n_edges=50)
    # one circuit's faithfulness is one patched forward given the clean and corrupted runs, prepared once (as a
    # faithfulness curve prepares them once for all its circuits); the whole call, preparation included, is shown too
    runner = no_grad(lambda: CircuitRunner.prepare(probe, clean, corrupted, metric))()
    return [
        Case("probe forward", PROBE, no_grad(lambda: probe(clean))),
        Case("probe EAP, every edge", PROBE, lambda: edge_attribution(probe, clean, corrupted, metric),
             note="clean and corrupted forwards, one backward"),
        Case("probe EAP-IG inputs, 5 steps", PROBE,
             lambda: edge_attribution(probe, clean, corrupted, metric, method="eap-ig-inputs", ig_steps=5)),
        Case("probe faithfulness, one circuit", PROBE, no_grad(lambda: runner.faithfulness(circuit)),
             note=f"{circuit.n_edges} edges kept, every other edge patched to its corrupted value; the clean and "
                  "corrupted runs prepared once (CircuitRunner.prepare), as a faithfulness curve reuses them; the sparse "
                  "engine computes only the nodes the circuit touches"),
        Case("probe faithfulness() call, preparation included", PROBE,
             no_grad(lambda: faithfulness(probe, circuit, clean, corrupted, metric)),
             note="two forwards to prepare + the patched one; no goal"),
    ]


CIRCUIT_GOALS = all_of(at_most("probe EAP, every edge", "probe forward", 3.5),
                         at_most("probe EAP-IG inputs, 5 steps", "probe forward", 7.5),
                         at_most("probe faithfulness, one circuit", "probe forward", 1.5))


@workload("circuits", 13, "Edge attribution (EAP, EAP-IG) over every edge, and one circuit's faithfulness",
          "EAP <= 3.5x one forward; EAP-IG with 5 steps <= 7.5x; faithfulness <= 1.5x", floor="probe forward",
          check=CIRCUIT_GOALS)
def circuits(ctx: Context) -> list[Case]:
    return circuit_cases(ctx)


@workload("circuits_small", 14, "The same on the small model", "as workload 13", floor="probe forward",
          check=CIRCUIT_GOALS, model="small", shape="small")
def circuits_small(ctx: Context) -> list[Case]:
    return circuit_cases(ctx)


