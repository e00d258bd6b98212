"""probe prune: head importance (Michel et al. 2019), the pruning curve with baselines, and a pruned model.

examples:
  probe prune                                  # importance and curve on the bundled held-out text
  probe prune --text-file corpus.txt --step 0.1 --max-fraction 0.6
  probe prune --heads 1.3,2.0 --save runs/pruned-model
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


from probe.cli.common import (CommandError, Output, command, default_out, fraction, fraction_below_one, load_model, log,
                            parse_heads, positive_int)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text-file", default=None, help="UTF-8 text to estimate importance and evaluate on (default: the bundled held-out text)")
    parser.add_argument("--step", type=fraction, default=0.1, help="fraction of the remaining heads pruned per step")
    parser.add_argument("--max-fraction", type=fraction, default=1.0, help="stop after pruning this fraction of heads")
    parser.add_argument("--max-windows", type=positive_int, default=16, help="text windows used (more: slower, steadier)")
    parser.add_argument("--no-curve", action="store_true", help="importance only")
    parser.add_argument("--heads", default=None, help="with --save: remove these heads (LAYER.HEAD,..., numbered as in importance.csv) instead of the least important")
    parser.add_argument("--save", default=None, help="write a structurally pruned model (and its head_map.json) to this directory")
    parser.add_argument("--save-fraction", type=fraction_below_one, default=0.25, help="with --save and no --heads: prune this fraction of the heads, least important first")


def run(args: argparse.Namespace) -> int:
    from probe.analyses.pruning import (attach_head_map, head_importance, head_map_of, original_heads, prune_by_importance,
                                  prune_heads, save_pruned)

    out = Output(default_out(args, "prune"), args.force)
    model = load_model(args)
    attach_head_map(model, args.model)  # a model pruned by `probe prune --save`: its heads' original numbers
    data = None  # the bundled held-out text
    if args.text_file:
        data = Path(args.text_file)
        if not data.is_file():
            raise CommandError(f"--text-file {data} does not exist")
    if args.save and Path(args.save).exists():
        raise CommandError(f"--save {args.save} already exists; choose a new directory")
    if args.save:
        try:
            head_map_of(model)  # a pruned model needs its head map to be pruned again
        except ValueError as err:
            raise CommandError(f"--model {args.model} was structurally pruned, but has no head_map.json to say which "
                               f"original heads remain; prune the original model instead") from err
    heads = parse_heads(args.heads, model) if args.save and args.heads else None
    # the file is read a piece at a time; a bad byte or an empty file is a ValueError naming it
    importance = head_importance(model, data, max_windows=args.max_windows, progress=not args.quiet)
    out.write_csv("importance.csv", importance.to_frame())
    out.write_figure("importance.html", importance.figure())
    if not args.no_curve:
        curve = prune_by_importance(model, data, step=args.step, max_fraction=args.max_fraction,
                                    max_windows=args.max_windows, progress=not args.quiet)
        out.write_csv("pruning_curve.csv", curve.to_frame())
        out.write_figure("pruning_curve.html", curve.figure())
    if args.save:
        if heads is None:
            order = importance.order()  # the heads the model has, least important first
            heads = order[: int(round(args.save_fraction * len(order)))]
        pruned = prune_heads(model, original_heads(model, heads))  # importance.csv numbers the heads the model has
        save_pruned(pruned, args.save)
        log(args, f"pruned {len(heads)} heads; saved the model to {args.save} "
                  f"({pruned.ledger().total_params:,} parameters, was {model.ledger().total_params:,})")
    out.report(args)
    return 0


build_parser, main = command(__doc__, "probe prune", add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
