"""probe contributions: the residual stream as a sum of components, and direct logit attribution.

examples:
  probe contributions --prompt "ROMEO. But soft, what light" --answer " through" --counterfactual " in"
  probe contributions --prompt "ROMEO. But soft, what light" --answer 318 --position -1 --out runs/dla
"""
from __future__ import annotations

import argparse
import sys


from probe.cli.common import Output, check_position, check_prompt, check_contrast, command, default_out, load_model, token_id


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the prompt")
    parser.add_argument("--answer", default=None, help="the token whose logit to attribute (one token's text, or an id); default: the model's prediction")
    parser.add_argument("--counterfactual", default=None, help="attribute logit(answer) - logit(counterfactual) instead")
    parser.add_argument("--position", type=int, default=-1, help="position to attribute (default: the last)")


def run(args: argparse.Namespace) -> int:
    import torch

    from probe.analyses import direct_logit_attribution, residual_decomposition

    out = Output(default_out(args, "contributions"), args.force)
    model = load_model(args)
    check_prompt(model, args.prompt)
    check_position(model, args.prompt, args.position)
    if args.answer is None:
        with torch.no_grad():
            answer = int(model(args.prompt)[0, args.position].argmax())
    else:
        answer = token_id(model, args.answer, "--answer")
    counterfactual = None if args.counterfactual is None else token_id(model, args.counterfactual, "--counterfactual")
    check_contrast(model, answer, counterfactual)
    dla = direct_logit_attribution(model, args.prompt, answer, counterfactual, position=args.position)
    decomposition = residual_decomposition(model, args.prompt)
    out.write_csv("attribution.csv", dla.to_frame())
    out.write_figure("attribution_bar.html", dla.figure("bar"))
    out.write_figure("attribution_heads.html", dla.figure("heads"))
    out.write_figure("attribution_accumulated.html", dla.figure("accumulated"))
    out.write_csv("decomposition.csv", decomposition.to_frame())
    out.write_figure("decomposition.html", decomposition.figure(position=args.position))
    print(dla.to_frame().sort_values("contribution", key=abs, ascending=False).head(15).to_string(index=False))
    out.report(args)
    return 0


build_parser, main = command(__doc__, "probe contributions", add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
