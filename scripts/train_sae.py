"""probe train_sae: train a sparse autoencoder (or a transcoder) on a model's activations over a corpus,
and save it in SAELens's format (cfg.json, sae_weights.safetensors) for `probe sae --sae DIR`.

examples:
  probe train_sae --hook blocks.1.hook_resid_post --arch topk --k 32 --d-sae 768 --tokens 2M --corpus plays/ --out sae
  probe train_sae --hook blocks.0.ln2.hook_normalized --hook-out blocks.0.hook_mlp_out --arch topk --k 32 \\
      --d-sae 768 --tokens 1M --corpus plays/ --out transcoder-0          # an MLP transcoder (--skip: skip-transcoder)
  probe train_sae --hook blocks.1.hook_resid_post --k 32 --d-sae 768 --tokens 2M --checkpoint-every 500k --out run

After an interruption, the same command with --resume run/checkpoints/<tokens> (the newest checkpoint there)
continues bit for bit.

The corpus is a text file or a folder of .txt files (default: the bundled held-out text), read again
from its start when --tokens asks for more than it holds. Data parallel, `torchrun --nproc-per-node N -m
scripts.cli train_sae ...`: every process reads its own shard of the corpus and --batch-tokens / N rows of
each batch (gloo on the CPU; nccl with --device cuda, process r on cuda:LOCAL_RANK), the gradients are
averaged, and rank 0 writes the checkpoints and the dictionary; resume with the same N. See
docs/sae_training.md for the recipe of the dictionaries shipped with probe.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


from probe.cli.common import CommandError, check_corpus_arg, command, load_model, log

SUFFIXES = {"k": 10**3, "K": 10**3, "m": 10**6, "M": 10**6, "g": 10**9, "G": 10**9}


def token_count(text: str) -> int:
    """'20M' -> 20_000_000, '500k' -> 500_000, '4096' -> 4096."""
    number, scale = (text[:-1], SUFFIXES[text[-1]]) if text and text[-1] in SUFFIXES else (text, 1)
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count; write e.g. 4096, 500k or 20M") from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive whole number of tokens")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hook", required=True, help="the hook point it reads, e.g. blocks.1.hook_resid_post")
    parser.add_argument("--hook-out", default=None,
                        help="train a transcoder predicting this hook point, e.g. blocks.1.hook_mlp_out (read --hook "
                             "blocks.1.ln2.hook_normalized)")
    parser.add_argument("--skip", action="store_true", help="with --hook-out: a skip-transcoder (adds a linear path)")
    parser.add_argument("--arch", default="topk", choices=["standard", "topk", "batchtopk", "jumprelu"],
                        help="standard (L1), topk, batchtopk (saved as JumpReLU), jumprelu (L0)")
    parser.add_argument("--k", type=int, default=None, help="topk/batchtopk: active features per token")
    parser.add_argument("--d-sae", type=int, required=True, help="number of features")
    parser.add_argument("--tokens", type=token_count, required=True, help="training tokens, e.g. 2M")
    parser.add_argument("--corpus", default=None, help="text file or folder of .txt files (default: the bundled held-out text)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--lr-warm-up-steps", type=int, default=0)
    parser.add_argument("--lr-decay-steps", type=int, default=0, help="linear decay to 0 over the last N steps")
    parser.add_argument("--l1", type=float, default=1.0, help="standard: L1 coefficient")
    parser.add_argument("--l0", type=float, default=1.0, help="jumprelu: L0 coefficient")
    parser.add_argument("--coefficient-warm-up-steps", type=int, default=0)
    parser.add_argument("--aux", type=float, default=1.0, help="topk/batchtopk: AuxK coefficient")
    parser.add_argument("--dead-window", type=int, default=1000, help="steps without firing that make a feature dead")
    parser.add_argument("--resample-every", type=int, default=None,
                        help="standard: resample dead features every N steps (Anthropic's recipe)")
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--buffer-tokens", type=token_count, default=65536)
    parser.add_argument("--context-size", type=int, default=None, help="tokens per window (default: the model's n_ctx)")
    parser.add_argument("--store-device", default=None, help="where the activation buffer lives (e.g. cpu; default: --device)")
    parser.add_argument("--checkpoint-every", type=token_count, default=None, help="write a resumable checkpoint every N tokens")
    parser.add_argument("--resume", default=None, help="a checkpoint directory (OUT/checkpoints/TOKENS) to continue from")


class Corpus:
    """The corpus argument as a re-iterable of document texts (the trainer reads it again each epoch)."""

    def __init__(self, corpus):
        self.corpus = corpus

    def __iter__(self):
        from probe.analyses import iter_documents

        return (text for _, text in iter_documents(self.corpus))


def run(args: argparse.Namespace) -> int:
    from probe.sae_training import TrainingConfig, train_sae

    if args.out is None:
        raise CommandError("--out is required: the directory the dictionary (and its checkpoints) are written to")
    if args.skip and args.hook_out is None:
        raise CommandError("--skip makes a skip-transcoder: give --hook-out too")
    check_corpus_arg(args.corpus)
    try:
        cfg = TrainingConfig(hook_name=args.hook, hook_name_out=args.hook_out, skip=args.skip, architecture=args.arch,
                             k=args.k, d_sae=args.d_sae, training_tokens=args.tokens, lr=args.lr,
                             lr_warm_up_steps=args.lr_warm_up_steps, lr_decay_steps=args.lr_decay_steps,
                             l1_coefficient=args.l1, l0_coefficient=args.l0,
                             coefficient_warm_up_steps=args.coefficient_warm_up_steps, aux_coefficient=args.aux,
                             dead_feature_window=args.dead_window, resample_every_steps=args.resample_every,
                             batch_tokens=args.batch_tokens,
                             buffer_tokens=args.buffer_tokens, context_size=args.context_size,
                             store_device=args.store_device, checkpoint_every_tokens=args.checkpoint_every, seed=args.seed)
    except ValueError as err:
        raise CommandError(str(err)) from err
    if os.environ.get("LOCAL_RANK") is not None and args.device in ("cuda", "auto") and _cuda():
        args.device = f"cuda:{os.environ['LOCAL_RANK']}"  # torchrun: one GPU per process
    model = load_model(args)
    out = Path(args.out)
    if (out / "cfg.json").exists() and not args.force and args.resume is None:
        raise CommandError(f"--out {out} already holds a dictionary; choose another directory, pass --force, or --resume")
    start = time.perf_counter()
    result = train_sae(model, Corpus(args.corpus), cfg, out=out, resume=args.resume, progress=not args.quiet,
                       overwrite=args.force)
    seconds = time.perf_counter() - start
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # rank 0 wrote the files and reports them
    last = result.history[-1] if result.history else {}
    log(args, f"wrote {out} ({out / 'cfg.json'}, {out / 'sae_weights.safetensors'}, {out / 'training.json'})")
    print(f"trained {cfg.architecture} d_sae={cfg.d_sae} on {cfg.hook_name}"
          + (f" -> {cfg.hook_name_out}" if cfg.hook_name_out else "")
          + f": {result.tokens} tokens in {seconds:.0f} s; last batch: mse {last.get('mse', float('nan')):.4g}, "
            f"L0 {last.get('l0', float('nan')):.1f}, dead {last.get('dead', float('nan')):.1%}, "
            f"explained variance {last.get('explained_variance', float('nan')):.3f}")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


build_parser, main = command(__doc__, "probe train_sae", add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
