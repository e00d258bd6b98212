"""Evaluating the bundled model (importable): held-out loss against n-gram baselines, in-context
learning on repeated random tokens, induction and previous-token head scores, and a greedy sample."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from probe import HookedDecoder
from probe.cli.tiny_corpus import random_tokens

GREEDY_PROMPT = "KING.\nWhat news, my lord?\n\n"


def windows(ids: torch.Tensor, n_ctx: int, bos: int) -> torch.Tensor:
    """Non-overlapping [n n_ctx] windows of BOS + n_ctx-1 tokens covering `ids` (a ragged tail is dropped)."""
    step = n_ctx - 1
    n = len(ids) // step
    body = ids[: n * step].view(n, step)
    return torch.cat([torch.full((n, 1), bos, dtype=torch.long), body], dim=1)


@torch.no_grad()
def model_loss(model: HookedDecoder, rows: torch.Tensor, batch: int = 32) -> float:
    """Mean next-token loss (nats) over every position after BOS of every row."""
    total, count = 0.0, 0
    for i in range(0, len(rows), batch):
        x = rows[i: i + batch].to(model.device)
        logits = model(x)[:, :-1].float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total, count = total + float(loss), count + x[:, 1:].numel()
    return total / count


def ngram_baselines(train_ids: torch.Tensor, rows: torch.Tensor, vocab: int,
                    ks: tuple[float, ...] = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)) -> dict:
    """Unigram (add-1) and add-k bigram losses on the same targets `model_loss` scores.

    Both are fit on `train_ids`. The bigram's previous token for a row's first target is BOS, exactly
    the context the model has. The bigram's k is the best of `ks` *on the evaluation rows themselves*,
    which flatters the baseline: the model is compared with the best bigram there is.
    """
    prev, nxt = rows[:, :-1].reshape(-1), rows[:, 1:].reshape(-1)
    uni = torch.bincount(train_ids, minlength=vocab).double()
    uni_logp = torch.log((uni + 1) / (uni.sum() + vocab))
    unigram = float(-uni_logp[nxt].mean())
    pairs = torch.bincount(train_ids[:-1] * vocab + train_ids[1:], minlength=vocab * vocab).double().view(vocab, vocab)
    row_tot = pairs.sum(1)
    best = None
    for k in ks:
        logp = torch.log((pairs[prev, nxt] + k) / (row_tot[prev] + k * vocab))
        loss = float(-logp.mean())
        if best is None or loss < best[0]:
            best = (loss, k)
    return {"unigram_loss": unigram, "bigram_loss": best[0], "bigram_k": best[1]}


def repeated_random_tokens(vocab: int, bos: int, n_seqs: int = 32, length: int = 50, seed: int = 0) -> torch.Tensor:
    """[n_seqs 1+2*length]: BOS, then `length` uniformly random non-special tokens, then the same again."""
    body = random_tokens((n_seqs, length), vocab, bos, torch.Generator().manual_seed(seed))
    return torch.cat([torch.full((n_seqs, 1), bos, dtype=torch.long), body, body], dim=1)


def repeated_losses(logits: torch.Tensor, seqs: torch.Tensor, length: int) -> tuple[float, float]:
    """(first-copy loss, second-copy loss) from the logits of `seqs`: mean loss on tokens 2..length
    of each copy (each copy's first token is unpredictable in both copies, so it is left out of both)."""
    losses = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), seqs[:, 1:].to(logits.device), reduction="none")
    # losses[:, p-1] is the loss for the token at position p; copy 1 = positions 1..L, copy 2 = L+1..2L
    first = losses[:, 1:length].mean()
    second = losses[:, length + 1: 2 * length].mean()
    return float(first), float(second)


@torch.no_grad()
def logits_and_patterns(model: HookedDecoder, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, [layer batch head query key] attention patterns) from one forward with probe's cache."""
    logits, cache = model.run_with_cache(tokens.to(model.device), names=lambda n: n.endswith("attn.hook_pattern"))
    patterns = torch.stack([cache[f"blocks.{l}.attn.hook_pattern"].float().cpu() for l in range(model.cfg.n_layers)])
    return logits, patterns


def induction_scores(patterns: torch.Tensor, length: int) -> torch.Tensor:
    """[layer head]: mean attention from each second-copy token to the token after its first occurrence.

    With BOS at 0, copy 1 at 1..L and copy 2 at L+1..2L, the query at q attends to q-L+1.
    """
    q = torch.arange(length + 1, 2 * length + 1)
    return patterns[:, :, :, q, q - length + 1].mean(dim=(1, 3))


def previous_token_scores(patterns: torch.Tensor) -> torch.Tensor:
    """[layer head]: mean attention from every query position >= 1 to the position right before it."""
    q = torch.arange(1, patterns.shape[-1])
    return patterns[:, :, :, q, q - 1].mean(dim=(1, 3))


@torch.no_grad()
def induction_probe(model: HookedDecoder, seqs: torch.Tensor, length: int) -> dict:
    """A quick look during training: the best induction and previous-token scores and the in-context
    losses, all on `seqs` (repeated random tokens)."""
    model.eval()
    logits, patterns = logits_and_patterns(model, seqs)
    first, second = repeated_losses(logits, seqs, length)
    return {"induction": round(float(induction_scores(patterns, length).max()), 4),
            "prev_token": round(float(previous_token_scores(patterns).max()), 4),
            "icl_first": round(first, 3), "icl_second": round(second, 3)}


@torch.no_grad()
def greedy_sample(model: HookedDecoder, prompt: str, new_tokens: int = 120) -> str:
    tokens = model.to_tokens(prompt)
    for _ in range(new_tokens):
        logits = model(tokens[:, -model.cfg.n_ctx:])
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return model.tokenizer.decode(tokens[0, 1:].tolist())


def evaluate(model: HookedDecoder, train_ids: torch.Tensor, val_ids: torch.Tensor, heldout_text: Optional[str] = None,
             icl_length: int = 50, max_val_rows: Optional[int] = None) -> dict:
    model.eval()
    cfg, bos = model.cfg, model.tokenizer.bos_id
    rows = windows(val_ids, cfg.n_ctx, bos)
    if max_val_rows:
        rows = rows[:max_val_rows]
    metrics = {"val_loss": model_loss(model, rows), "val_tokens_scored": int(rows[:, 1:].numel())}
    metrics.update(ngram_baselines(train_ids, rows, cfg.d_vocab))
    seqs = repeated_random_tokens(cfg.d_vocab, bos, length=icl_length)
    logits, patterns = logits_and_patterns(model, seqs)
    first, second = repeated_losses(logits, seqs, icl_length)
    metrics.update({"icl_first_copy_loss": first, "icl_second_copy_loss": second, "icl_length": icl_length})
    ind = induction_scores(patterns, icl_length)
    layer, head = divmod(int(ind.argmax()), cfg.n_heads)
    metrics.update({"best_induction_head": f"{layer}.{head}", "best_induction_score": float(ind.max()),
                    "induction_scores": [[round(float(s), 4) for s in r] for r in ind]})
    prev = previous_token_scores(logits_and_patterns(model, rows[:16])[1])
    layer, head = divmod(int(prev.argmax()), cfg.n_heads)
    metrics.update({"best_prev_token_head": f"{layer}.{head}", "best_prev_token_score": float(prev.max()),
                    "prev_token_scores": [[round(float(s), 4) for s in r] for r in prev]})
    metrics["greedy_prompt"] = GREEDY_PROMPT
    metrics["greedy_sample"] = greedy_sample(model, GREEDY_PROMPT)
    return metrics

