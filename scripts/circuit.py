"""probe circuit: score every edge of the model's graph, extract a circuit, measure its faithfulness, draw it.

The metric is logit(answer) - logit(counterfactual) at the last position. Edge scores estimate how much
each edge alone restores the clean prompt's behaviour in the corrupted one (EAP or EAP-IG); the circuit is
the best --edges edges, pruned; its faithfulness is the share of the logit difference it keeps with every
other edge patched to its corrupted value, over a range of circuit sizes and against random circuits.

writes: edges.csv, edges.html (the top edges), circuit.csv, circuit.html (the drawing),
faithfulness.csv, faithfulness.html (the curve)

Edges are ranked by |score| unless --signed ranks them by the score itself, those estimated to restore the
clean behaviour first (a negative edge enters only after every positive one): with eap-ig-activations scores the signed circuits
keep more of the logit difference at the same size (docs/circuits.md).

examples:
  probe circuit --clean "Romeo, Romeo, Romeo," --corrupted "Juliet, Juliet, Juliet," --answer " Romeo" --counterfactual " Juliet"
  probe circuit --clean "Romeo, Romeo, Romeo," --corrupted "Juliet, Juliet, Juliet," --answer " Romeo" --counterfactual " Juliet" --method eap-ig-inputs --ig-steps 5 --edges 50
  probe circuit --clean "Romeo, Romeo, Romeo," --corrupted "Juliet, Juliet, Juliet," --answer " Romeo" --counterfactual " Juliet" --method eap-ig-activations --signed --edges 40
"""
from __future__ import annotations

import argparse
import sys


from probe.cli.common import CommandError, Output, check_contrast, check_prompt, command, default_out, load_model, log, positive_int, token_id

METHODS = ["eap", "eap-ig-inputs", "eap-ig-activations", "clean-corrupted", "exact"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clean", required=True, help="the clean prompt")
    parser.add_argument("--corrupted", required=True, help="the corrupted prompt (same number of tokens)")
    parser.add_argument("--answer", required=True, help="the token the clean prompt should predict")
    parser.add_argument("--counterfactual", required=True, help="the token the corrupted prompt should predict")
    parser.add_argument("--method", default="eap-ig-inputs", choices=METHODS, help="how edges are scored (default: eap-ig-inputs)")
    parser.add_argument("--ig-steps", type=positive_int, default=5, help="integration steps of the eap-ig methods")
    parser.add_argument("--edges", type=positive_int, default=50, help="edges in the circuit before pruning")
    parser.add_argument("--greedy", action="store_true", help="grow the circuit from the logits instead of taking the top edges")
    parser.add_argument("--signed", action="store_true",
                        help="rank edges by their score, highest first, instead of by |score| (the circuit and the curve)")
    parser.add_argument("--ablation", default="patch", choices=["patch", "mean", "zero"],
                        help="what an edge outside the circuit carries (mean needs several prompts, so not here)")
    parser.add_argument("--random", type=int, default=3, help="random circuits per size on the faithfulness curve")


def run(args: argparse.Namespace) -> int:
    from probe.analyses import circuit_graph, edge_attribution, faithfulness, faithfulness_curve, logit_diff_metric

    if args.ablation == "mean":
        raise CommandError("--ablation mean averages over several corrupted prompts and this command takes one; use patch or zero")
    if args.random < 0:
        raise CommandError(f"--random {args.random} must be 0 or more")
    for flag in ("--clean", "--corrupted"):  # (every command's text arguments are checked for UTF-8 in scripts/common)
        if getattr(args, flag[2:]) == "":  # two empty prompts would be scored as one prompt
            raise CommandError(f"{flag} is empty; give the prompt's text")
    out = Output(default_out(args, "circuit"), args.force)
    model = load_model(args)
    try:
        graph = circuit_graph(model)
    except ValueError as err:
        raise CommandError(f"--model {args.model}: {err}") from err
    for prompt in (args.clean, args.corrupted):
        check_prompt(model, prompt)
    n_clean, n_corrupted = model.to_tokens(args.clean).shape[1], model.to_tokens(args.corrupted).shape[1]
    if n_clean != n_corrupted:
        raise CommandError(f"--clean is {n_clean} tokens but --corrupted is {n_corrupted}; edges are patched position by "
                           "position, so they need equal lengths")
    answer, counterfactual = token_id(model, args.answer, "--answer"), token_id(model, args.counterfactual, "--counterfactual")
    check_contrast(model, answer, counterfactual)
    metric = logit_diff_metric(model, answer, counterfactual)
    log(args, f"{graph}; scoring them with {args.method}")
    scores = edge_attribution(model, args.clean, args.corrupted, metric, method=args.method, ig_steps=args.ig_steps)
    if abs(scores.clean - scores.corrupted) <= 1e-6 * max(abs(scores.clean), abs(scores.corrupted), 1e-30):
        raise CommandError(f"the logit difference is {scores.clean:.6g} on both prompts, so there is nothing for a circuit to "
                           "recover; choose prompts (or tokens) that tell them apart")
    out.write_csv("edges.csv", scores.to_frame())
    out.write_figure("edges.html", scores.figure())
    circuit = scores.circuit(n_edges=min(args.edges, graph.n_edges), method="greedy" if args.greedy else "topn",
                             absolute=not args.signed)
    if circuit.n_edges == 0:  # faithfulness 0 and an empty drawing would otherwise be all the run says
        log(args, f"note: the circuit has no edges: pruning dropped all {circuit.requested} chosen, none of which joins "
                  "the embedding to the logits through the others; pass a larger --edges")
    out.write_csv("circuit.csv", circuit.to_frame())
    out.write_figure("circuit.html", circuit.figure())
    kept = faithfulness(model, circuit, args.clean, args.corrupted, metric, ablation=args.ablation)
    curve = faithfulness_curve(model, scores, args.clean, args.corrupted, metric, ablation=args.ablation,
                               method="greedy" if args.greedy else "topn", n_random=args.random, seed=args.seed,
                               absolute=not args.signed)
    out.write_csv("faithfulness.csv", curve.to_frame())
    out.write_figure("faithfulness.html", curve.figure())
    print(scores.top(10)[["rank", "source", "target", "input", "score"]].to_string(index=False))
    print(f"{circuit}: faithfulness {kept.value:.3f} (logit difference {kept.circuit:.4f}; clean {kept.clean:.4f}, "
          f"ablated {kept.ablated:.4f})")
    out.report(args)
    return 0


build_parser, main = command(__doc__, "probe circuit", add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
