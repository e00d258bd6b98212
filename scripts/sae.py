"""probe sae: a sparse autoencoder's (or transcoder's) features on a prompt, the tokens they write, the loss it
recovers, and (--triggers) the corpus contexts where they fire hardest.

examples:
  probe sae --sae bundled --prompt "ROMEO. But soft, what light"                # top features at the last token
  probe sae --sae bundled --prompt "ROMEO. But soft, what light" --position 3 --features 17 601      # these features' tokens
  probe sae --sae bundled --prompt "ROMEO. But soft, what light" --triggers --corpus plays/          # their top contexts in a corpus

--sae is a directory in SAELens's format (cfg.json and sae_weights.safetensors), for the --model given, or a
dictionary shipped for the bundled model (bundled = resid-post-1; transcoder-0 ... transcoder-3). A transcoder's
features are read at its input point and its decoder rows judged where it writes (hook_name_out).

subcommands (each has its own --help):
  probe sae dashboard --sae DIR [--features 0,5,17 | --top N] [--corpus FILE] [--tokens N] --out DIR
                                   one HTML page of feature dashboards, and CSV files
  probe sae train --hook ... --d-sae ... --tokens ... --out DIR
                                   train a dictionary: the same command and flags as probe train_sae
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


from probe.cli.common import (CommandError, Output, check_corpus_arg, check_position, check_prompt, checked, command,
                            default_out, load_model, load_sae, write_triggers)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sae", required=True, help="SAE directory (SAELens format: cfg.json, sae_weights.safetensors), or `bundled` for the residual SAE shipped for the bundled model")
    parser.add_argument("--prompt", required=True, help="the prompt to read the features of")
    parser.add_argument("--k", type=int, default=10, help="top features per position, tokens per feature, and (--triggers) contexts per feature")
    parser.add_argument("--position", type=int, default=-1, help="position whose top features are printed (default: the last)")
    parser.add_argument("--features", type=int, nargs="+", default=None,
                        help="features whose tokens (and triggers) to report (default: the top k at --position)")
    parser.add_argument("--triggers", action="store_true",
                        help="scan a corpus for the features' top --k activating contexts (triggers.csv, one figure per feature)")
    parser.add_argument("--corpus", default=None,
                        help="text file or folder to scan with --triggers (default: the bundled held-out text; implies --triggers)")
    parser.add_argument("--batch-size", type=int, default=8, help="--triggers: windows per forward (lower it for a wide SAE)")
    parser.add_argument("--window", type=int, default=None, help="--triggers: tokens per window (default: the model's n_ctx)")


def run(args: argparse.Namespace) -> int:
    from probe.analyses import feature_logits, sae_features, sae_loss_recovered
    from probe.analyses.features import feature_ids

    out = Output(default_out(args, "sae"), args.force)
    model = load_model(args)
    sae = load_sae(model, args.sae)
    limit = min(sae.cfg.d_sae, model.cfg.d_vocab_out)  # --k counts features per position and output tokens per feature
    if not 0 < args.k <= limit:
        raise CommandError(f"--k {args.k} must be in [1, {limit}] (d_sae={sae.cfg.d_sae}, d_vocab_out={model.cfg.d_vocab_out})")
    if args.features is not None:
        checked("--features", feature_ids, sae, args.features)
    scan = args.triggers or args.corpus is not None  # as in probe memories, naming a corpus asks for the scan
    if scan:
        _check_scan(args, model)
    check_prompt(model, args.prompt)
    check_position(model, args.prompt, args.position)

    try:
        found = sae_features(model, sae, args.prompt, k=args.k)
    except ValueError as err:  # the prompt and flags are checked: what is left is an SAE that does not fit the model
        raise CommandError(f"--sae {args.sae}: {err}") from err
    position = args.position % found.tokens.shape[1]
    top = [f for f in found.top_ids[0, position].tolist() if f >= 0]
    top_tokens = feature_logits(model, sae, top, k=args.k) if top else None
    logits = top_tokens if args.features is None else feature_logits(model, sae, args.features, k=args.k)
    loss = sae_loss_recovered(model, sae, args.prompt)

    out.write_csv("features.csv", found.to_frame())
    out.write_figure("features.html", found.figure())
    if logits is not None:
        out.write_csv("feature_logits.csv", logits.to_frame())
        out.write_figure("feature_logits.html", logits.figure())
    out.write_csv("loss.csv", loss.to_frame())
    scanned = args.features if args.features is not None else top
    triggers, frame = _triggers(args, out, model, sae, scanned) if scan and scanned else (None, None)
    if triggers is not None and frame is None:  # interrupted
        return 130
    out.report(args)

    token = found.token_strings[0][position]
    where = f"transcoder at {sae.cfg.hook_name} -> {sae.cfg.hook_name_out}" if sae.cfg.is_transcoder else \
        f"SAE at {sae.cfg.hook_name}"
    print(f"{where} (d_sae={sae.cfg.d_sae}), position {position} {token!r}: "
          f"L0 {int(found.l0[0, position])}, reconstruction error {float(found.fvu[0, position]):.4g} (fvu)")
    if not top:
        print("no feature is active at this position" + ("" if logits is not None else
              "; feature_logits.csv not written: name features with --features"))
    for rank, feature in enumerate(top):
        promoted = " ".join(repr(s) for s in top_tokens.token_strings[rank][:5])
        print(f"  #{rank + 1:<3} F{feature:<7} {float(found.top_activations[0, position, rank]):9.4f}   promotes {promoted}")
    print(f"loss: clean {float(loss.clean[0]):.4f}, SAE spliced in {float(loss.spliced[0]):.4f}, zero-ablated "
          f"{float(loss.zero_ablated[0]):.4f}; loss recovered {float(loss.recovered[0]):.4f}")
    if scan and not scanned:
        print("triggers not scanned: no feature is active at this position; name features with --features")
    if triggers is not None:
        print(f"top triggers over {triggers.n_tokens} corpus tokens (triggers.csv):")
        # every feature has a value at every scanned token, so each one's first slot is filled
        best = frame.sort_values("rank").groupby("feature").first()  # each feature's rank 1
        for feature in scanned:
            row = best.loc[feature]
            print(f"  F{feature:<7} {row.activation:9.4f}   {row.prefix[-60:]!r} -> next {row.next_token!r}")
    return 0


def _check_scan(args: argparse.Namespace, model) -> None:
    """The scan's settings, and the corpus's first piece, before any work: an empty file or a folder without
    .txt files is named now, not after the other outputs were written."""
    if args.batch_size < 1:
        raise CommandError(f"--batch-size {args.batch_size} must be at least 1")
    if args.window is not None and not 2 <= args.window <= model.cfg.n_ctx:
        raise CommandError(f"--window {args.window} must be in [2, n_ctx={model.cfg.n_ctx}]")
    check_corpus_arg(args.corpus)


def _triggers(args: argparse.Namespace, out: Output, model, sae, features: list[int]):
    """Scan the corpus for `features`' top --k triggers and write them; an interrupted scan (Ctrl-C)
    writes what it folded as triggers.partial.csv, under a name that says so, and says how to finish."""
    from plotly.subplots import make_subplots

    from probe.analyses import top_triggers

    triggers = top_triggers(model, args.corpus, neurons=features, k=args.k, progress=not args.quiet, sae=sae,
                            batch_size=args.batch_size, window=args.window)
    frame = write_triggers(out, args, model, triggers)
    if frame is None:
        return triggers, None
    # one page with a panel per feature: plotly.js is inlined once, not once per feature (~5 MB each)
    panels = [triggers.figure(model, triggers.layers[0], feature) for feature in features]
    page = make_subplots(rows=len(panels), cols=1, subplot_titles=[p.layout.title.text for p in panels],
                         vertical_spacing=min(0.3 / len(panels), 0.08))
    for row, panel in enumerate(panels, start=1):
        for trace in panel.data:
            page.add_trace(trace, row=row, col=1)
    page.update_layout(height=260 * len(panels), showlegend=False, title=f"Top triggers of {len(panels)} features")
    out.write_figure("triggers.html", page)
    return triggers, frame


build_parser, _main = command(__doc__, "probe sae", add_arguments, run)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`probe sae ...` as ever, or `probe sae dashboard ...` / `probe sae train ...` (see the docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["dashboard"]:
        from probe.cli import sae_dashboard

        return sae_dashboard.main(argv[1:])
    if argv[:1] == ["train"]:
        from probe.cli import train_sae

        doc = train_sae.__doc__.replace("probe train_sae", "probe sae train")
        return command(doc, "probe sae train", train_sae.add_arguments, train_sae.run)[1](argv[1:])
    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
