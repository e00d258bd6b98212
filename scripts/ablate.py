"""probe ablate: ablate heads and show the effect on the next-token distribution and the loss.

examples:
  probe ablate --prompt "ROMEO. But soft, what light" --heads L1H3,L2H0
  probe ablate --prompt "ROMEO. But soft, what light" --heads L1H3 --method mean --reference-file more_prompts.txt
  probe ablate --prompt "ROMEO. But soft, what light" --sweep
"""
from __future__ import annotations

import argparse
import sys


from probe.cli.common import CommandError, Output, check_prompt, command, default_out, load_model, parse_heads, read_prompts_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the prompt")
    parser.add_argument("--heads", default=None, help="heads to ablate together, e.g. L1H3,L2H0 (1.3,2.0 also reads)")
    parser.add_argument("--method", default="zero", choices=["zero", "mean", "resample"], help="what replaces the head's output")
    parser.add_argument("--reference-file", default=None,
                        help="prompts (one per line, each at least as long as --prompt) to take the mean or the samples from; "
                             "needed by --method mean and resample")
    parser.add_argument("--sweep", action="store_true", help="the effect of ablating every head alone")
    parser.add_argument("--top", type=int, default=10, help="tokens to show")


def run(args: argparse.Namespace) -> int:
    import pandas as pd
    import torch

    from probe.analyses import ablate_heads, head_ablation_effects
    from probe.analyses.ablation import loss_metric

    if args.heads is None and not args.sweep:
        raise CommandError("give --heads L1H3,... and/or --sweep")
    if args.method != "zero" and args.reference_file is None:  # one prompt has no mean, and nothing to resample from
        raise CommandError(f"--method {args.method} needs --reference-file FILE: prompts, one per line, to take the "
                           f"{'mean' if args.method == 'mean' else 'samples'} from")
    out = Output(default_out(args, "ablate"), args.force)
    model = load_model(args)
    check_prompt(model, args.prompt)
    if not 1 <= args.top <= model.cfg.d_vocab_out:
        raise CommandError(f"--top {args.top} is outside [1, {model.cfg.d_vocab_out}] (the output vocabulary's size)")
    heads = None if args.heads is None else parse_heads(args.heads, model)  # checked before any forward pass
    reference = None if args.reference_file is None else read_prompts_file(args.reference_file, "--reference-file")
    tokens, mask = model.to_tokens(args.prompt, return_attention_mask=True)
    if heads is not None:
        with torch.no_grad():
            clean = model(tokens)
        ablated = ablate_heads(model, tokens, heads, method=args.method, reference=reference, seed=args.seed)
        p_clean, p_ablated = clean[0, -1].float().softmax(-1), ablated[0, -1].float().softmax(-1)
        top = torch.cat([p_clean.topk(args.top).indices, p_ablated.topk(args.top).indices]).unique()
        table = pd.DataFrame({
            "token": model.tokenizer.token_strings(top.tolist()), "token_id": top.tolist(),
            "p_clean": p_clean[top].tolist(), "p_ablated": p_ablated[top].tolist(),
        }).assign(change=lambda f: f.p_ablated - f.p_clean).sort_values("p_clean", ascending=False)
        loss = pd.DataFrame({"run": ["clean", "ablated"],
                             "loss": [float(loss_metric(clean, tokens, mask)[0]), float(loss_metric(ablated, tokens, mask)[0])]})
        out.write_csv("next_token.csv", table)
        out.write_csv("loss.csv", loss)
        print(table.head(args.top).to_string(index=False))
        print(loss.to_string(index=False))
    if args.sweep:
        effects = head_ablation_effects(model, tokens, method=args.method, reference=reference, seed=args.seed)
        out.write_csv("sweep.csv", effects.to_frame())
        out.write_figure("sweep.html", effects.figure())
        top = effects.to_frame().nlargest(5, "effect")
        print("largest loss increases: " + ", ".join(f"{r.label} {r.effect:+.3f}" for r in top.itertuples()))
    out.report(args)
    return 0


build_parser, main = command(__doc__, "probe ablate", add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
