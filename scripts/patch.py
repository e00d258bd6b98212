"""probe patch: activation patching from a clean prompt into a corrupted one (exact and attribution).

The metric is logit(answer) - logit(counterfactual) at the last position, normalised so that 0 is
the corrupted run and 1 the clean run.

examples:
  probe patch --clean "ROMEO. Good night, good night" --corrupted "JULIET. Good night, good night" --answer " ROMEO" --counterfactual " JULIET"
  probe patch --clean ... --corrupted ... --answer ... --counterfactual ... --sweep resid_pre
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python scripts/patch.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.common import CommandError, Output, check_prompt, command, default_out, load_model, token_id  # noqa: E402


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clean", required=True, help="the clean prompt")
    parser.add_argument("--corrupted", required=True, help="the corrupted prompt (same number of tokens)")
    parser.add_argument("--answer", required=True, help="the token the clean prompt should predict")
    parser.add_argument("--counterfactual", required=True, help="the token the corrupted prompt should predict")
    parser.add_argument("--sweep", default="heads", choices=["heads", "resid_pre", "attn_out", "mlp_out"], help="which sites to patch")
    parser.add_argument("--no-attribution", action="store_true", help="skip the attribution-patching comparison")


def run(args: argparse.Namespace) -> int:
    from analyses import compare_patching, logit_diff_metric, patch

    out = Output(default_out(args, "patch"), args.force)
    model = load_model(args)
    for prompt in (args.clean, args.corrupted):
        check_prompt(model, prompt)
    n_clean, n_corrupted = model.to_tokens(args.clean).shape[1], model.to_tokens(args.corrupted).shape[1]
    if n_clean != n_corrupted:
        raise CommandError(f"--clean is {n_clean} tokens but --corrupted is {n_corrupted}; patching needs equal lengths")
    metric = logit_diff_metric(model, token_id(model, args.answer, "--answer"), token_id(model, args.counterfactual, "--counterfactual"))
    exact = patch(model, args.clean, args.corrupted, metric, sites=args.sweep)
    out.write_csv("patching.csv", exact.to_frame())
    out.write_figure("patching.html", exact.figure())
    if not args.no_attribution:
        estimate = patch(model, args.clean, args.corrupted, metric, sites=args.sweep, method="attribution")
        out.write_csv("attribution_patching.csv", estimate.to_frame())
        out.write_figure("patching_vs_attribution.html", compare_patching(exact, estimate))
    print(exact.to_frame().sort_values("recovered", ascending=False).head(10).to_string(index=False))
    out.report(args)
    return 0


build_parser, main = command(__doc__, "probe patch", add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
