"""probe lens: the logit lens (and a tuned lens) on a prompt: what each layer's residual stream predicts.

examples:
  probe lens --prompt "ROMEO. But soft, what light through yonder window"
  probe lens --prompt "ROMEO. But soft, what light through yonder window" --target " light" --mid --tuned --out runs/lens
"""
from __future__ import annotations

import argparse
import sys


from probe.cli.common import CommandError, Output, check_prompt, command, default_out, load_model, token_id


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the prompt")
    parser.add_argument("--target", default=None, help="token to follow across layers (text of one token, or an id); default: the model's prediction")
    parser.add_argument("--k", type=int, default=None,
                        help="top tokens per cell (default: 5, or the model's whole output vocabulary when it is smaller)")
    parser.add_argument("--mid", action="store_true", help="also decode after every attention sublayer (hook_resid_mid)")
    parser.add_argument("--frozen-scale", action="store_true", help="use the final norm's actual scale instead of recomputing it per layer")
    parser.add_argument("--tuned", action="store_true", help="also train a tuned lens on the held-out text and compare (about a minute)")
    parser.add_argument("--tuned-steps", type=int, default=150, help="with --tuned: training steps")
    parser.add_argument("--tuned-tokens", type=int, default=16384, help="with --tuned: held-out tokens to train on (and half as many to compare on)")


def run(args: argparse.Namespace) -> int:
    from probe.analyses import compare_lenses, logit_lens, train_tuned_lens
    from probe.analyses.lens import lens_top_k, require_resid_mid

    for flag, value, least in (("--tuned-steps", args.tuned_steps, 1), ("--tuned-tokens", args.tuned_tokens, 4)):
        if value < least:  # the comparison reads half the tokens, and a lens needs two
            raise CommandError(f"{flag} {value} must be at least {least}")
    out = Output(default_out(args, "lens"), args.force)
    model = load_model(args)
    check_prompt(model, args.prompt)
    if args.mid:
        require_resid_mid(model, f"--mid with --model {args.model}", "drop --mid")
    k = lens_top_k(model, args.k, "--k")  # before any forward: a --k above the vocabulary is refused now
    target = None if args.target is None else token_id(model, args.target, "--target")
    norm = "frozen" if args.frozen_scale else "recompute"
    result = logit_lens(model, args.prompt, target=target, k=k, include_mid=args.mid, norm=norm)
    out.write_csv("logit_lens.csv", result.to_frame())
    out.write_csv("logit_lens_topk.csv", result.to_frame(top_k=True))
    out.write_figure("logit_lens.html", result.figure())
    out.write_figure("logit_lens_target.html", result.figure(kind="target"))
    if args.tuned:
        lens = train_tuned_lens(model, include_mid=args.mid, seed=args.seed, steps=args.tuned_steps,
                                max_tokens=args.tuned_tokens, progress=not args.quiet)
        tuned = logit_lens(model, args.prompt, target=target, k=k, include_mid=args.mid, lens=lens)
        out.write_csv("tuned_lens.csv", tuned.to_frame())
        out.write_figure("tuned_lens.html", tuned.figure())
        comparison = compare_lenses(model, lens, max_tokens=args.tuned_tokens // 2, progress=not args.quiet)
        out.write_csv("lens_comparison.csv", comparison.to_frame())
        out.write_figure("lens_comparison.html", comparison.figure())
    print(result.to_frame().query("position == position.max()").to_string(index=False))
    out.report(args)
    return 0


build_parser, main = command(__doc__, "probe lens", add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
