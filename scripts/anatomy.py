"""probe anatomy: the model's structure, its parameter ledger, and the shapes through one block.

examples:
  probe anatomy
  probe anatomy --n-ctx 128 --out runs/anatomy          # FLOPs and KV-cache sizes at 128 tokens
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from probe.cli.common import CommandError, HelpFormatter, Output, add_common_arguments, default_out, load_model, run_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="probe anatomy", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--n-ctx", type=int, default=None, help="context length for FLOPs and KV-cache sizes (default: the model's)")
    add_common_arguments(parser)
    return parser


def anatomy_tables(model, n_ctx: Optional[int]):
    import pandas as pd

    from probe.shapes import hook_shapes

    book = model.ledger(n_ctx=n_ctx, dtype=model.embed.W_E.dtype)
    shapes = hook_shapes(model.cfg, batch=1, pos=book.n_ctx)
    block0 = [{"hook": n, "shape": "x".join(map(str, s))} for n, s in shapes.items() if not n.startswith("blocks.") or n.startswith("blocks.0.")]
    config = pd.DataFrame({"field": list(model.cfg.to_dict()), "value": [str(v) for v in model.cfg.to_dict().values()]})
    return config, book.to_frame(), book.summary(), pd.DataFrame(block0)


def run(args: argparse.Namespace) -> int:
    if args.n_ctx is not None and args.n_ctx < 1:  # the ledger would read 0 as "the model's" and count negative FLOPs
        raise CommandError(f"--n-ctx {args.n_ctx} must be a positive number of tokens")
    out = Output(default_out(args, "anatomy"), args.force)
    model = load_model(args)
    config, ledger, summary, shapes = anatomy_tables(model, args.n_ctx)
    print(config.to_string(index=False))
    print()
    print(summary.to_string(index=False))
    print()
    print(shapes.to_string(index=False))
    out.write_csv("config.csv", config)
    out.write_csv("ledger.csv", ledger)
    out.write_csv("summary.csv", summary)
    out.write_csv("shapes.csv", shapes)
    tables = "".join(f"<h2>{title}</h2>" + frame.to_html(index=False, escape=True, border=0)
                     for title, frame in (("Parameters, FLOPs, KV cache", summary), ("Config", config),
                                          ("Ledger", ledger), ("Hook shapes through block 0", shapes)))
    out.write_text("anatomy.html", "<!DOCTYPE html><html><head><meta charset='utf-8'><title>anatomy</title>"
                   "<style>body{font-family:system-ui,sans-serif;margin:2em}td,th{border:1px solid #ddd;padding:2px 6px}"
                   "table{border-collapse:collapse}</style></head><body>" + tables + "</body></html>")
    out.report(args)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_command(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
