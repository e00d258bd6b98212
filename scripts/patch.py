"""probe patch: activation patching from a clean prompt into a corrupted one (exact and attribution).

The metric is logit(answer) - logit(counterfactual) at the last position, normalised so that 0 is
the corrupted run and 1 the clean run.

The two prompts must tokenise to the same number of tokens, and --answer and --counterfactual must be
one token each: `probe tokens --prompt TEXT` shows how a text tokenises.

examples:
  probe patch --clean "Romeo, Romeo, Romeo," --corrupted "Juliet, Juliet, Juliet," --answer " Romeo" --counterfactual " Juliet"
  probe patch --clean "Romeo, Romeo, Romeo," --corrupted "Juliet, Juliet, Juliet," --answer " Romeo" --counterfactual " Juliet" --sweep resid_pre
"""
from __future__ import annotations

import argparse
import sys


from probe.cli.common import CommandError, Output, check_prompt, command, default_out, load_model, token_id


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clean", required=True, help="the clean prompt")
    parser.add_argument("--corrupted", required=True, help="the corrupted prompt (same number of tokens)")
    parser.add_argument("--answer", required=True, help="the token the clean prompt should predict")
    parser.add_argument("--counterfactual", required=True, help="the token the corrupted prompt should predict")
    parser.add_argument("--sweep", default="heads", choices=["heads", "resid_pre", "attn_out", "mlp_out"], help="which sites to patch")
    parser.add_argument("--no-attribution", action="store_true", help="skip the attribution-patching comparison")


def check_pair(model, clean: str, corrupted: str) -> None:
    """Patching pairs position i of one run with position i of the other: the prompts' lengths must agree."""
    from probe.cli.tokens import describe

    n_clean, n_corrupted = model.to_tokens(clean).shape[1], model.to_tokens(corrupted).shape[1]
    if n_clean != n_corrupted:
        raise CommandError(f"--clean and --corrupted must tokenise to the same number of tokens, for patching pairs "
                           f"their positions one to one: --clean is {describe(model, clean)}; --corrupted is "
                           f"{describe(model, corrupted)}. Swap words that tokenise alike (probe tokens --prompt TEXT "
                           f"shows how a text tokenises)")


def one_token(model, value: str, flag: str) -> int:
    """An --answer given as text must be one token: say how it tokenises and what to give instead."""
    from probe.cli.tokens import describe

    if model.tokenizer is not None and not (value.isascii() and value.lstrip("-").isdigit()):
        ids = model.tokenizer.encode(value, add_special_tokens=False)
        if len(ids) != 1:
            raise CommandError(f"{flag} {value!r} is {describe(model, value, bos=False)}; the metric compares two "
                               f"single tokens: give one token (mind the leading space; probe tokens --prompt TEXT "
                               f"--no-bos shows how a text tokenises), its first token, or a token id")
    return token_id(model, value, flag)


def run(args: argparse.Namespace) -> int:
    from probe.analyses import compare_patching, logit_diff_metric, patch

    out = Output(default_out(args, "patch"), args.force)
    model = load_model(args)
    for prompt in (args.clean, args.corrupted):
        check_prompt(model, prompt)
    check_pair(model, args.clean, args.corrupted)
    answer, counterfactual = (one_token(model, value, flag) for value, flag in
                              ((args.answer, "--answer"), (args.counterfactual, "--counterfactual")))
    metric = logit_diff_metric(model, answer, counterfactual)
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
