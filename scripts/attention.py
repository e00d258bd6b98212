"""probe attention: attention-pattern plots for a prompt, and head-detector scores.

attention_view.html is interactive: pick a layer and a head, hover a token to see where it attends
(or what attends to it).

examples:
  probe attention --prompt "ROMEO. But soft, what light"
  probe attention --prompt "ROMEO. But soft, what light" --layer 1 --head 3 --detectors induction previous_token
"""
from __future__ import annotations

import argparse
import sys


from probe.cli.common import CommandError, Output, check_prompt, command, default_out, load_model, positive_int

KINDS = ("previous_token", "first_token", "duplicate_token", "induction")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the prompt")
    parser.add_argument("--layer", type=int, default=None, help="plot this layer's heads (with --head: one head)")
    parser.add_argument("--head", type=int, default=None, help="plot one head (needs --layer)")
    parser.add_argument("--detectors", nargs="*", default=list(KINDS), choices=KINDS, help="head detectors to score")
    parser.add_argument("--samples", type=positive_int, default=32, help="random sequences per detector")


def run(args: argparse.Namespace) -> int:
    from probe.analyses import AttentionView, attention_patterns, composition_scores, copying_scores, head_scores
    from probe.analyses.circuits import processed_for_circuits
    from probe.analyses.labels import head_label

    out = Output(default_out(args, "attention"), args.force)
    model = load_model(args)
    check_prompt(model, args.prompt)
    if args.head is not None and args.layer is None:
        raise CommandError("--head needs --layer")
    if args.layer is not None and not 0 <= args.layer < model.cfg.n_layers:
        raise CommandError(f"--layer {args.layer} is outside [0, {model.cfg.n_layers})")
    if args.head is not None and not 0 <= args.head < model.cfg.layer_heads(args.layer):
        raise CommandError(f"--head {args.head} is outside [0, {model.cfg.layer_heads(args.layer)}) in layer {args.layer}")
    patterns = attention_patterns(model, args.prompt)
    out.write_csv("patterns.csv", patterns.to_frame())
    # hover a token to see where it attends; pick the layer and head (no plotly, no network)
    out.write_text("attention_view.html", AttentionView.from_patterns(patterns).to_html(full_html=True))
    out.write_figure("patterns_overview.html", patterns.figure())
    if args.layer is not None:
        name = f"pattern_L{args.layer}" + ("" if args.head is None else f"H{args.head}")
        out.write_figure(f"{name}.html", patterns.figure(layer=args.layer, head=args.head))
    for kind in args.detectors:
        scores = head_scores(model, kind, n_samples=args.samples, seed=args.seed)
        out.write_csv(f"scores_{kind}.csv", scores.to_frame())
        out.write_figure(f"scores_{kind}.html", scores.figure())
        top = scores.top(3)
        print(f"{kind}: " + ", ".join(f"{r.label} {r.score:.2f}" for r in top.itertuples()))
    processed = processed_for_circuits(model)  # one processed copy for both scores, not one each
    copying = copying_scores(processed, process=False)
    out.write_csv("copying_scores.csv", copying.to_frame())
    out.write_figure("copying_scores.html", copying.figure())
    top = copying.to_frame().nlargest(3, "copying_score")
    print("OV copying: " + ", ".join(f"{head_label(r.layer, r.head)} {r.copying_score:.2f}" for r in top.itertuples()))
    if model.cfg.n_layers > 1:
        composition = composition_scores(processed, process=False)
        frame = composition.to_frame()
        out.write_csv("composition.csv", frame)
        for kind in "qkv":
            out.write_figure(f"composition_{kind}.html", composition.figure(kind))
        strongest = frame.nlargest(3, "k")
        print("K-composition: " + ", ".join(f"{head_label(r.layer, r.head)} -> {head_label(r.later_layer, r.later_head)} {r.k:.2f}"
                                            for r in strongest.itertuples()))
    out.report(args)
    return 0


build_parser, main = command(__doc__, "probe attention", add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
