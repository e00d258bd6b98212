"""probe graph: the attribution graph of a prompt (Ameisen et al. 2025): the transcoder features, error nodes and
embeddings that drive the top logits, with every direct effect between them, pruned to the influential part.

writes: graph.html (the interactive page: layers x positions; hover a node for its edges, click a feature for its
details), nodes.csv and edges.csv (the pruned graph), and with --dashboards a dashboard page per layer
(dashboard-L<layer>.html, the graph's features on the bundled held-out text) that the page links to

examples:
  probe graph --prompt "Enter Mercutio and Benvolio. Then enter Mercutio and"
  probe graph --prompt "Good night, good night" --logits " night" --max-features 256 --node-threshold 0.6

--transcoders is `bundled` (the transcoders shipped for the bundled model) or comma-separated transcoder
directories in SAELens's format, one per layer (--transcoders tc-0,tc-1,tc-2,tc-3); a layer without one keeps
its MLP whole, as an error node. The page opens with a node selected from its address: graph.html#node=L0.F616@5.
"""
from __future__ import annotations

import argparse
import sys


from probe.cli.common import CommandError, Output, check_prompt, command, default_out, load_model, log, positive_int, token_id


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 1]")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the prompt (a BOS is prepended when the tokenizer has one)")
    parser.add_argument("--transcoders", default="bundled", help="bundled, or comma-separated transcoder directories")
    parser.add_argument("--logits", nargs="+", default=None,
                        help="the logits to explain, as one-token strings or ids (default: the most probable, up to 10, "
                             "until they hold 95%% of the probability)")
    parser.add_argument("--max-features", type=positive_int, default=1024,
                        help="feature nodes visited, most influential first (all active ones if fewer)")
    parser.add_argument("--node-threshold", type=fraction, default=0.8, help="share of node influence pruning keeps")
    parser.add_argument("--edge-threshold", type=fraction, default=0.98, help="share of edge score pruning keeps")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="targets per backward pass")
    parser.add_argument("--dashboards", action="store_true",
                        help="also write a dashboard page per layer for the graph's features, linked from graph.html")


def run(args: argparse.Namespace) -> int:
    from probe.analyses.attribution_graph import attribution_graph
    from probe.analyses.replacement_model import BUNDLED, load_transcoders

    out = Output(default_out(args, "graph"), args.force)
    model = load_model(args)
    check_prompt(model, args.prompt)
    spec = BUNDLED if args.transcoders == BUNDLED else [p for p in args.transcoders.split(",") if p]
    try:
        transcoders = load_transcoders(model, spec)
    except (OSError, ValueError) as err:
        raise CommandError(f"--transcoders {args.transcoders}: {err}") from err
    targets = "top" if args.logits is None else [token_id(model, t, "--logits") for t in args.logits]
    log(args, f"attributing with {len(transcoders)} transcoders, up to {args.max_features} features")
    try:
        graph = attribution_graph(model, transcoders, args.prompt, max_feature_nodes=args.max_features,
                                  logit_targets=targets, batch_size=args.batch_size, progress=not args.quiet)
    except ValueError as err:
        raise CommandError(str(err)) from err
    pruned = graph.prune(args.node_threshold, args.edge_threshold)
    links = write_dashboards(out, args, model, transcoders, pruned) if args.dashboards else None
    out.write_csv("nodes.csv", pruned.to_frame("nodes"))
    out.write_csv("edges.csv", pruned.to_frame("edges"))
    out.write_text("graph.html", pruned.page(title=f"attribution graph: {args.prompt}", feature_links=links))
    print(f"{graph}\npruned: {pruned} (kept {pruned.shares[0]:.1%} of node influence, {pruned.shares[1]:.1%} of "
          f"edge score)")
    nodes = pruned.to_frame("nodes")
    top = nodes[nodes.kind.isin(["feature", "error"])].sort_values("influence", ascending=False).head(10)
    print(top[["node", "kind", "activation", "influence"]].to_string(index=False))
    out.report(args)
    return 0


def write_dashboards(out: Output, args, model, transcoders, graph) -> dict:
    """dashboard-L<layer>.html for the features of each layer in the graph; {(layer, feature): link}."""
    from probe.analyses.sae_dashboard import feature_dashboard

    links = {}
    for layer, sae in transcoders.items():
        features = sorted({int(f) for l, f, k in zip(graph.layer, graph.feature, graph.kind) if int(l) == layer and int(k) == 0})
        if not features:
            continue
        log(args, f"dashboards of {len(features)} features of layer {layer}")
        dashboard = feature_dashboard(model, sae, None, features, max_tokens=1 << 14, progress=not args.quiet)
        name = f"dashboard-L{layer}.html"
        out.write_text(name, dashboard.to_html())
        links.update({(layer, f): f"{name}#F{f}" for f in features})
    return links


build_parser, main = command(__doc__, "probe graph", add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
