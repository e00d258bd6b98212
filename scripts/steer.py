"""probe steer: build a contrastive steering vector, generate with and without it, and sweep its coefficient.

examples:
  probe steer --positive romeo.txt --negative juliet.txt --layer 2 --coefficient 4 --prompt "ROMEO. But soft" --out runs/steer
  probe steer --vector runs/steer/vector.safetensors --coefficient 2 --prompt "ROMEO. But soft" --prompt "JULIET. O" --target " Romeo"
  probe steer --positive romeo.txt --negative juliet.txt --layer 1 --prompt "JULIET. I" --target " love" --coefficients 0 1 2 4 8

--positive and --negative hold one prompt per line, paired line by line; the vector is the mean over pairs of the
activation difference at --site of block --layer. The sweep shows a metric beside the next-token loss on held-out
text for each coefficient: with --target, the log-probability of those tokens after each --prompt; otherwise the
log-likelihood of the --positive lines minus that of the --negative lines.
"""
from __future__ import annotations

import argparse
import html
import math
import sys
from pathlib import Path


from probe.cli.common import (CommandError, Output, check_prompt, checked, command, default_out, load_model,
                            log, model_label, read_prompts_file)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--positive", default=None, help="file of prompts to steer towards, one per line")
    parser.add_argument("--negative", default=None, help="file of prompts to steer away from, one per line, paired with --positive")
    parser.add_argument("--vector", default=None, help="a saved vector (NAME.safetensors beside NAME.json) instead of --positive/--negative")
    parser.add_argument("--layer", type=int, default=None, help="block whose --site the vector is read from and added to")
    # None, not the defaults themselves: with --vector, a --site or --position the user gave is refused, not ignored
    parser.add_argument("--site", default=None, choices=["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"],
                        help="where in the block (default resid_pre)")
    parser.add_argument("--position", default=None, choices=["last", "mean"],
                        help="read each contrastive prompt's activation at its last token or averaged over its tokens "
                             "(default last)")
    parser.add_argument("--coefficient", type=float, default=4.0, help="multiple of the vector added while generating")
    parser.add_argument("--positions", default="all", choices=["all", "prompt", "generated"], help="which positions to steer")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt to continue (repeat for several)")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sampled, seeded by --seed")
    parser.add_argument("--samples", type=int, default=1, help="continuations per prompt (with --temperature > 0)")
    parser.add_argument("--coefficients", type=float, nargs="+", default=None,
                        help="coefficients to sweep (default: 0 and +-1/4, 1/2, 1, 2 times --coefficient)")
    parser.add_argument("--target", nargs="+", default=None, help="sweep metric: log p of these tokens (ids or one-token strings) after each --prompt")
    parser.add_argument("--heldout", default=None, help="text file for the sweep's fluency loss (default: the bundled held-out text)")
    parser.add_argument("--heldout-windows", type=int, default=8, help="windows of n_ctx tokens of --heldout to score")


def _vector(args, model):
    from probe.analyses import SteeringVector, steering_vector

    if args.vector is not None:
        if args.positive or args.negative or args.layer is not None:
            raise CommandError("--vector replaces --positive, --negative and --layer; give either the vector or those")
        for flag, value in (("--site", args.site), ("--position", args.position)):
            if value is not None:  # the saved vector has its own; silently steering elsewhere would mislead
                raise CommandError(f"{flag} {value}: --vector brings its own site and position (in its .json); "
                                   f"drop {flag}, or build a new vector with --positive, --negative and --layer")
        try:
            return SteeringVector.load(args.vector, model), None, None
        except (OSError, ValueError) as err:
            raise CommandError(f"--vector {args.vector}: {err}") from err
    if args.positive is None or args.negative is None or args.layer is None:
        raise CommandError("give --positive FILE, --negative FILE and --layer N (or --vector FILE)")
    positive, negative = read_prompts_file(args.positive, "--positive"), read_prompts_file(args.negative, "--negative")
    if len(positive) != len(negative):
        raise CommandError(f"--positive has {len(positive)} lines but --negative has {len(negative)}; the lines are paired, "
                           "so give as many of each (trim the longer file)")
    for flag, lines in (("--positive", positive), ("--negative", negative)):
        for line in lines:
            checked(flag, check_prompt_fits, model, line)
    vector = checked("--layer", lambda: steering_vector(model, positive, negative, args.layer, args.position or "last",
                                                         args.site or "resid_pre", model_name=model_label(args)))
    return vector, positive, negative


def check_prompt_fits(model, prompt: str) -> None:
    n = model.to_tokens(prompt).shape[1]
    if n > model.cfg.n_ctx:
        raise ValueError(f"a line is {n} tokens, longer than the model's context ({model.cfg.n_ctx}): {prompt[:40]!r}...")


def shown(text: str) -> str:
    """Text safe and visible in HTML: escaped, control characters but newlines and tabs written as \\xNN."""
    return html.escape("".join(c if c.isprintable() or c in "\n\t" else f"\\x{ord(c):02x}" for c in text), quote=True)


def _generate(model, steering, prompt: str, args) -> list[str]:
    """The continuations (new text only) of `prompt`, steered inside `steering.applied` when given."""
    from contextlib import nullcontext

    tokens = model.to_tokens(prompt).repeat(args.samples, 1)
    with steering.applied(model) if steering is not None else nullcontext():
        out = model.generate(tokens, args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    return [model.tokenizer.decode(row[tokens.shape[1]:].tolist()) for row in out]


def generations_page(frame, title: str, setup: str) -> str:
    # one column per run, in the order run (unsteered first): not per coefficient, which both runs share at
    # --coefficient 0; prompts are distinct (run refuses repeats), so each (prompt, sample) has one text per run
    runs = list(dict.fromkeys(frame.run))
    rows = []
    for (prompt, sample), group in frame.groupby(["prompt", "sample"], sort=False):
        texts = dict(zip(group.run, group.completion))
        cells = "".join(f"<td><pre><span class='prompt'>{shown(prompt)}</span><b>{shown(texts[run])}</b></pre></td>"
                        for run in runs)
        rows.append(f"<tr><td>{sample}</td>{cells}</tr>")
    heads = "".join(f"<th>{shown(label)}</th>" for label in runs)
    style = ("body{font-family:sans-serif;max-width:1000px;margin:2em auto}table{border-collapse:collapse;width:100%;table-layout:fixed}th:first-child{width:4em}"
             "td,th{border:1px solid #ccc;padding:4px;vertical-align:top;text-align:left}"
             "pre{white-space:pre-wrap;margin:0}.prompt{color:#888}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{shown(title)}</title><style>{style}</style></head>"
            f"<body><h1>{shown(title)}</h1><p>{shown(setup)}</p><table><tr><th>sample</th>{heads}</tr>{''.join(rows)}"
            "</table></body></html>")


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from probe.analyses import steer, steering_sweep, target_logprob_metric

    if args.max_new_tokens < 1 or args.samples < 1 or args.heldout_windows < 1:
        raise CommandError("--max-new-tokens, --samples and --heldout-windows must each be at least 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):  # else generate's error, after all the work
        raise CommandError(f"--temperature {args.temperature:g} must be a finite number >= 0 (0: greedy)")
    if args.samples > 1 and args.temperature == 0:
        raise CommandError("--samples above 1 needs --temperature above 0: greedy continuations would all be the same")
    if args.coefficients is not None and not all(math.isfinite(c) for c in args.coefficients):
        raise CommandError(f"--coefficients {' '.join(f'{c:g}' for c in args.coefficients)}: give finite numbers")
    repeated = next((p for i, p in enumerate(args.prompt) if p in args.prompt[:i]), None)
    if repeated is not None:  # its rows would merge with the first one's in generations.html
        raise CommandError(f"--prompt {repeated!r} is given twice; give each prompt once (--samples N with "
                           "--temperature above 0 gives several continuations of one prompt)")
    if args.heldout is not None and not Path(args.heldout).is_file():
        what = "is not a file" if Path(args.heldout).exists() else "does not exist"
        raise CommandError(f"--heldout {args.heldout} {what}")
    out = Output(default_out(args, "steer"), args.force)
    model = load_model(args)
    for prompt in args.prompt:
        check_prompt(model, prompt)
        if model.to_tokens(prompt).shape[1] + args.max_new_tokens > model.cfg.n_ctx:
            raise CommandError(f"--max-new-tokens {args.max_new_tokens} after a {model.to_tokens(prompt).shape[1]}-token "
                               f"prompt exceeds the model's context ({model.cfg.n_ctx})")
    metric = None if args.target is None else checked("--target", target_logprob_metric, model,
                                                      [int(t) if t.isascii() and t.isdigit() else t for t in args.target])
    vector, positive, negative = _vector(args, model)
    if metric is None and positive is None:
        raise CommandError("with --vector, give --target TOKEN... for the sweep (there are no --positive lines to score)")
    steering = checked("--coefficient", lambda: steer(model, vector, args.coefficient, positions=args.positions))

    out.written.extend(vector.save(out.path("vector.safetensors"), overwrite=True))
    if vector.differences is not None:
        out.write_csv("vector_pairs.csv", vector.to_frame())
    rows = []
    for prompt in args.prompt:
        for coefficient, s in ((0.0, None), (args.coefficient, steering)):
            for sample, text in enumerate(_generate(model, s, prompt, args)):
                rows.append({"prompt": prompt, "sample": sample, "coefficient": coefficient,
                             "run": "unsteered" if s is None else f"steered x{coefficient:g}", "completion": text})
    generations = pd.DataFrame(rows)
    out.write_csv("generations.csv", generations)
    setup = (f"{model_label(args)}; vector at L{vector.layer} {vector.site} (norm {vector.norm:.3f}); "
             f"coefficient {args.coefficient:g} at {args.positions} positions; temperature {args.temperature:g}")
    out.write_text("generations.html", generations_page(generations, "Generations with and without steering", setup))

    c = args.coefficient or 1.0
    coefficients = args.coefficients or [k * c for k in (-2, -1, -0.5, -0.25, 0, 0.25, 0.5, 1, 2)]
    heldout = None if args.heldout is None else Path(args.heldout)
    if metric is not None:
        sweep = steering_sweep(model, vector, args.prompt, coefficients, metric, heldout=heldout,
                               heldout_windows=args.heldout_windows, progress=not args.quiet)
    else:
        sweep = steering_sweep(model, vector, positive, coefficients, versus=negative, heldout=heldout,
                               heldout_windows=args.heldout_windows, progress=not args.quiet)
    out.write_csv("sweep.csv", sweep.to_frame())
    out.write_figure("sweep.html", sweep.figure())
    out.report(args)

    for prompt in args.prompt:
        for run_name, group in generations[generations.prompt == prompt].groupby("run", sort=False):
            print(f"{run_name}: {prompt!r} -> {group.completion.iloc[0]!r}")
    limits = sweep.fluency_limits()
    log(args, f"held-out loss {sweep.baseline_loss:.3f} unsteered; climbs 0.1 nats above it at coefficient "
              f"{limits['positive']} (positive side) and {limits['negative']} (negative side)")
    return 0


build_parser, main = command(__doc__, "probe steer", add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
