"""The `probe` command: one subcommand per workflow; each is also `python scripts/<name>.py`."""
from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

COMMANDS = {
    "report": "the main job: every analysis on one prompt, in one self-contained HTML report",
    "cache": "save chosen activations for a prompt to safetensors",
    "lens": "logit lens (and tuned lens) for a prompt",
    "contributions": "residual decomposition and direct logit attribution",
    "attention": "attention-pattern plots and head-detector scores",
    "ablate": "ablate heads; --sweep for every head's effect",
    "patch": "activation patching between a clean and a corrupted prompt",
    "prune": "head importance, pruning curve, structurally pruned model",
    "memories": "FFN key-value memories: value tokens, lookup, corpus triggers",
    "anatomy": "structure, parameter ledger, shapes through one block",
    "tokens": "how prompts tokenise: each position's id and string, whitespace shown",
    "sae": "sparse autoencoder features of a prompt: top features, their tokens, loss recovered; sae dashboard, sae train",
    "train_sae": "train a sparse autoencoder or transcoder on a corpus (SAELens format)",
    "steer": "contrastive steering vector: generations with and without it, coefficient sweep",
    "circuit": "edge attribution (EAP, EAP-IG), a circuit, its faithfulness curve and its graph",
    "graph": "attribution graph from transcoders: features, errors and embeddings driving the logits, interactive page",
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"probe {version('probe')}")
        except PackageNotFoundError:  # a checkout that was never installed
            print("probe (not installed: run pip install -e . in the checkout)")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, COMMANDS))
        lines = [f"  {name:<{width}}  {help}" for name, help in COMMANDS.items()]
        print("usage: probe <command> [options]   (probe <command> --help for each; probe --version)\n\ncommands:\n"
              + "\n".join(lines))
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"error: unknown command {command!r}{hint} (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    module = importlib.import_module(f"probe.cli.{command}")
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
