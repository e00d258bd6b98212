"""probe sae dashboard: a page per dictionary showing, for each chosen feature, its top-activating corpus
contexts (the activation shaded on every token), its density and activation histogram, the tokens its
decoder row promotes and suppresses, and (reading the residual stream or a norm of it: a transcoder's
MLP input) the tokens whose embeddings excite and inhibit it.

examples:
  probe sae dashboard --sae bundled --top 8 --tokens 16k                       # the 8 features active most often
  probe sae dashboard --sae transcoder-1 --features 0,5,17 --tokens 16k --k 5  # an MLP transcoder's features

Writes dashboard.html (one self-contained page: a feature index, a search box, no network needed) and
contexts.csv (one row per context token), densities.csv, histograms.csv, logits.csv and inputs.csv.
--sae is a directory in SAELens's format, or a dictionary shipped for the bundled model (`bundled` is the
residual SAE resid-post-1; transcoder-0 ... transcoder-3 the MLP transcoders). --corpus defaults to the
bundled held-out text (plays neither the bundled model nor its dictionaries were trained on).
"""
from __future__ import annotations

import argparse
import sys


from probe.cli.common import (CommandError, Output, check_corpus_arg, checked, command, default_out,
                            load_model, load_sae)
from probe.cli.train_sae import token_count

DEFAULT_TOKENS = 1 << 17


def feature_list(text: str) -> list[int]:
    """'0,5,17' -> [0, 5, 17]."""
    items = [item.strip() for item in text.split(",")]
    if not all(item.isascii() and item.isdigit() for item in items):
        raise argparse.ArgumentTypeError(f"{text!r}: write feature ids comma-separated, e.g. 0,5,17")
    return [int(item) for item in items]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sae", required=True,
                        help="SAE or transcoder directory (SAELens format), or a shipped one: bundled, transcoder-0 ...")
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--features", type=feature_list, default=None, help="feature ids, comma-separated, e.g. 0,5,17")
    chosen.add_argument("--top", type=int, default=None,
                        help="the N features active on the most corpus tokens (default when --features is not given: "
                             "20, or d_sae if fewer)")
    parser.add_argument("--corpus", default=None, help="text file or folder of .txt files (default: the bundled held-out text)")
    parser.add_argument("--tokens", type=token_count, default=DEFAULT_TOKENS, help="corpus tokens to scan, e.g. 50k")
    parser.add_argument("--k", type=int, default=10, help="top contexts per feature, and tokens per logit / input list")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward")
    parser.add_argument("--window", type=int, default=None, help="tokens per window (default: the model's n_ctx)")


def run(args: argparse.Namespace) -> int:
    from probe.analyses.features import feature_ids
    from probe.analyses.sae_dashboard import feature_dashboard

    model = load_model(args)
    sae = load_sae(model, args.sae)
    if args.features is not None:
        checked("--features", feature_ids, sae, args.features)
    if args.top is not None and not 0 < args.top <= sae.cfg.d_sae:
        raise CommandError(f"--top {args.top} must be in [1, d_sae={sae.cfg.d_sae}]")
    if not 0 < args.k <= model.cfg.d_vocab_out:  # tokens each feature promotes: the output vocabulary's
        raise CommandError(f"--k {args.k} must be in [1, d_vocab_out={model.cfg.d_vocab_out}]")
    if args.batch_size < 1:
        raise CommandError(f"--batch-size {args.batch_size} must be at least 1")
    low = 1 + (model.tokenizer is not None and model.tokenizer.bos_id is not None)
    if args.window is not None and not low <= args.window <= model.cfg.n_ctx:
        raise CommandError(f"--window {args.window} must be in [{low}, n_ctx={model.cfg.n_ctx}]")
    check_corpus_arg(args.corpus)
    out = Output(default_out(args, "sae-dashboard"), args.force)  # after the checks: a refusal leaves no folder

    dashboard = feature_dashboard(model, sae, args.corpus, args.features,
                                  top=args.top,  # None: the library's default, cut to d_sae
                                  k=args.k, n_tokens=args.k, max_tokens=args.tokens, window=args.window,
                                  batch_size=args.batch_size, progress=not args.quiet)
    for name, frame in dashboard.frames().items():
        out.write_csv(f"{name}.csv", frame)
    page = out.write_text("dashboard.html", dashboard.to_html())
    out.report(args)

    scan = dashboard.scan
    print(f"{dashboard.title}: {len(scan.features)} features over {scan.n_tokens} tokens")
    for i, feature in enumerate(scan.features.tolist()):
        promoted = "" if dashboard.logits is None else \
            "   promotes " + " ".join(repr(s) for s in dashboard.logits.token_strings[i][:4])
        print(f"  F{feature:<7} density {float(scan.density[i]):8.3%}   largest {float(scan.max_activation[i]):9.4f}{promoted}")
    for note in dashboard.notes:
        print(f"note: {note}")
    print(f"open {page}")
    return 0


build_parser, main = command(__doc__, "probe sae dashboard", add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
