"""probe memories: FFN key-value memories (Geva et al.): value tokens, a prompt's lookup, corpus triggers.

examples:
  probe memories --prompt "ROMEO. But soft, what light"           # lookup at the last position + value tokens
  probe memories --corpus plays/ --layers 2 3 --k 25               # top trigger examples, card report
"""
from __future__ import annotations

import argparse
import sys


from probe.cli.common import (CommandError, Output, check_corpus_arg, check_prompt, checked, command, default_out,
                            load_model, write_triggers)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", default=None, help="look up the memories that fire on this prompt")
    parser.add_argument("--position", type=int, default=-1, help="position for the lookup (default: the last)")
    parser.add_argument("--corpus", default=None, help="text file or folder to scan for trigger examples (default with --triggers: the bundled held-out text)")
    parser.add_argument("--triggers", action="store_true", help="scan the corpus for each neuron's top trigger examples")
    parser.add_argument("--layers", type=int, nargs="*", default=None, help="layers (default: all)")
    parser.add_argument("--neurons", type=int, nargs="+", default=None,
                        help="neurons (of every chosen layer) to report value tokens and triggers for (default: the lookup's top ones; all for triggers)")
    parser.add_argument("--k", type=int, default=10, help="memories per layer / trigger examples per neuron")
    parser.add_argument("--max-cards", type=int, default=500, help="neurons shown in memory_cards.html (one card each)")


def run(args: argparse.Namespace) -> int:
    from probe.analyses import agreement, memory_lookup, memory_report, top_triggers, value_tokens
    from probe.analyses.memory_units import neuron_tensor

    if args.prompt is None and not args.triggers and args.corpus is None:
        raise CommandError("give --prompt TEXT for a lookup and/or --triggers [--corpus PATH] for a corpus scan")
    out = Output(default_out(args, "memories"), args.force)
    model = load_model(args)
    layers = args.layers if args.layers is not None else list(range(model.cfg.n_layers))
    for layer in layers:
        if not 0 <= layer < model.cfg.n_layers:
            raise CommandError(f"--layers: {layer} is outside [0, {model.cfg.n_layers})")
    if args.neurons is not None:
        checked("--neurons", neuron_tensor, model, args.neurons)
    if args.max_cards < 1:
        raise CommandError(f"--max-cards {args.max_cards}: give at least 1")
    if args.triggers or args.corpus is not None:
        check_corpus_arg(args.corpus)  # before the lookup writes its files
    if args.prompt is not None:
        check_prompt(model, args.prompt)
        lookup = memory_lookup(model, args.prompt, position=args.position, layer=layers, k=args.k)
        out.write_csv("lookup.csv", lookup.to_frame())
        out.write_figure("lookup.html", lookup.figure())
        for layer in layers:
            neurons = args.neurons if args.neurons is not None else lookup.neurons[lookup.layers.index(layer)].tolist()
            out.write_csv(f"value_tokens_L{layer}.csv", value_tokens(model, layer, neurons, k=10).to_frame())
        print(lookup.to_frame().head(2 * args.k).to_string(index=False))
    if args.triggers or args.corpus is not None:
        triggers = top_triggers(model, args.corpus, layers=layers, neurons=args.neurons, k=args.k, progress=not args.quiet)
        if write_triggers(out, args, model, triggers) is None:
            return 130
        stats = agreement(model, triggers)
        out.write_csv("agreement.csv", stats.to_frame())
        out.write_figure("agreement.html", stats.figure())
        out.write_text("memory_cards.html", memory_report(model, triggers, max_cards=args.max_cards,
                                                          show_more="raise --max-cards or pick them with --neurons"))
    out.report(args)
    return 0


build_parser, main = command(__doc__, "probe memories", add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
