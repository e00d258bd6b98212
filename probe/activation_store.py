"""A shuffled stream of a model's activations at one or more hook points, for training dictionaries.

The corpus's documents are tokenised into one stream, each document preceded by the tokenizer's BOS
(GPT-2's `<|endoftext|>`, the document separator), and cut into windows of `context_size` tokens that
each begin with BOS, as the bundled model was trained (`scripts/train_tiny.py`); a window cut where a document
begins starts with that document's BOS, never with two. Windows run through the
model `batch_prompts` at a time, the forward stopping after the block of the last hook point read
(`model(tokens, stop_at_layer=...)`), and every position's activation enters a buffer of `buffer_tokens`
rows. The buffer is shuffled, its first half served in batches of `batch_tokens`, the served half refilled
with new activations and the whole shuffled again (SAELens's mixing buffer): consecutive batches mix
activations from many windows, so a batch is not one document's few hundred correlated positions.

The stream is a pure function of the corpus, the model and `seed`: `state_dict()` (tensors only: the
buffer, the shuffle generator, how many windows were read) and `load_state_dict` continue it exactly,
which is what makes a resumed training run bit-identical to an uninterrupted one. The corpus is read
again from its start when it runs out (a new epoch), so it must be re-iterable: a list, or an object
whose `__iter__` starts over.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Optional, Sequence, Union

import torch

from probe.hooks import HookPoint
from probe.model import HookedDecoder

# How windows are cut, saved with the state: 2 = a window cut where a document begins keeps that document's BOS
# alone. States without it (rule 1, BOS BOS there) would resume onto other windows than the run they continue.
WINDOW_RULE = 2


class ActivationStore:
    def __init__(
        self,
        model: HookedDecoder,
        corpus: Iterable[str],
        hook_names: Union[str, Sequence[str]],
        *,
        batch_tokens: int = 4096,
        buffer_tokens: int = 65536,
        context_size: Optional[int] = None,
        batch_prompts: int = 16,
        store_device: Optional[Union[str, torch.device]] = None,
        seed: int = 0,
        shard: tuple[int, int] = (0, 1),
    ):
        """`hook_names`: one name (an SAE) or several read together (a transcoder's input and output); each
        batch is a tuple of [batch_tokens width] float32 tensors, one per name, rows aligned.
        `store_device`: where the buffer lives (default: the model's device; "cpu" keeps a large buffer off
        the accelerator). `shard`: (r, n), read only every n-th window, from the r-th: the disjoint share of
        process r of n under torchrun."""
        self.model = model
        self.hook_names = [hook_names] if isinstance(hook_names, str) else list(hook_names)
        if not self.hook_names:
            raise ValueError("hook_names is empty: name the hook point(s) to read, e.g. 'blocks.1.hook_resid_post'")
        tokenizer = model.tokenizer
        if tokenizer is None:
            raise ValueError("the activation store tokenises a corpus, and this model has no tokenizer")
        if tokenizer.bos_id is None:
            raise ValueError("the activation store starts every window with the tokenizer's BOS, and this tokenizer has none")
        self.context_size = model.cfg.n_ctx if context_size is None else context_size
        for name, value in (("batch_tokens", batch_tokens), ("buffer_tokens", buffer_tokens),
                            ("batch_prompts", batch_prompts), ("context_size", self.context_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not 2 <= self.context_size <= model.cfg.n_ctx:
            raise ValueError(f"context_size={self.context_size} must be in [2, n_ctx={model.cfg.n_ctx}]")
        if buffer_tokens < 2 * batch_tokens:
            raise ValueError(f"buffer_tokens={buffer_tokens} must hold at least two batches of batch_tokens={batch_tokens}: "
                             "half the buffer is served between refills")
        if isinstance(corpus, Iterator):
            raise TypeError("the corpus is an iterator, which can be read once; pass a list of texts, or an object whose "
                            "__iter__ starts over, so the store can read it again (epochs, resuming)")
        rank, size = shard
        if not (isinstance(size, int) and size >= 1 and isinstance(rank, int) and 0 <= rank < size):
            raise ValueError(f"shard={shard!r} must be (rank, processes) with 0 <= rank < processes")
        self.shard = (rank, size)
        self.corpus, self.batch_tokens, self.batch_prompts = corpus, batch_tokens, batch_prompts
        # whole batches only: the served half is a whole number of them
        self.half = (buffer_tokens // 2 // batch_tokens) * batch_tokens
        self.store_device = torch.device(store_device) if store_device is not None else model.device
        self.points = [model.hook_point(name) for name in self.hook_names]  # unknown names fail here, named
        self.stop_at_layer = _stop_at_layer(model, self.points)
        self.generator = torch.Generator().manual_seed(seed)
        self.windows_read = 0  # how far into the (cycled) window stream: what a resumed store skips
        self.served = 0  # rows served from the current buffer's first half
        self.epochs = 0
        self.buffer: Optional[list[torch.Tensor]] = None
        self._windows: Optional[Iterator[list[int]]] = None

    # ---- the stream --------------------------------------------------------------------------------
    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """The next batch: one [batch_tokens width] float32 tensor per hook name, on the store's device."""
        if self.buffer is None:
            self.buffer = self._activations(2 * self.half)
            self._shuffle()
        elif self.served == self.half:
            fresh = self._activations(self.half)
            # new tensors, not writes into the old buffer: batches already served are views of it
            self.buffer = [torch.cat([new, kept[self.half:]]) for kept, new in zip(self.buffer, fresh)]
            self._shuffle()
            self.served = 0
        rows = slice(self.served, self.served + self.batch_tokens)
        self.served += self.batch_tokens
        return tuple(b[rows] for b in self.buffer)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        while True:
            yield self.next_batch()

    def _shuffle(self) -> None:
        order = torch.randperm(self.buffer[0].shape[0], generator=self.generator).to(self.store_device)
        self.buffer = [b[order] for b in self.buffer]

    @torch.no_grad()
    def _activations(self, n_rows: int) -> list[torch.Tensor]:
        """[n_rows width] per hook name: every position of whole windows, the last window's tail dropped."""
        parts: list[list[torch.Tensor]] = [[] for _ in self.hook_names]
        have = 0
        while have < n_rows:
            tokens = torch.tensor([self._next_window() for _ in range(self.batch_prompts)], device=self.model.device)
            seen: dict[int, torch.Tensor] = {}

            def keep(index: int):
                def fn(activation: torch.Tensor, hook: HookPoint) -> None:
                    seen[index] = activation.detach()
                return fn

            hooks = [(name, keep(i)) for i, name in enumerate(self.hook_names)]
            self.model.run_with_hooks(tokens, fwd_hooks=hooks, stop_at_layer=self.stop_at_layer)
            for i, part in enumerate(parts):
                part.append(seen[i].flatten(0, 1).flatten(1).to(self.store_device, torch.float32))
            have += tokens.numel()
        return [torch.cat(part)[:n_rows] for part in parts]

    def _next_window(self) -> list[int]:
        if self._windows is None:
            self._windows = self._window_stream()
        self.windows_read += 1
        return next(self._windows)

    def _window_stream(self) -> Iterator[list[int]]:
        """Windows of context_size tokens, each BOS + the next context_size - 1 tokens of the corpus stream (or, where
        a document begins, its own BOS + context_size - 1 tokens), cycling over the corpus (each pass an epoch); of
        a shard (r, n), windows r, r + n, r + 2n, ..."""
        tokenizer = self.model.tokenizer
        bos, body = tokenizer.bos_id, self.context_size - 1
        rank, size = self.shard
        yielded = cut = 0  # windows this shard yielded; windows cut from the stream, every shard's
        while True:
            pending: list[int] = []
            documents = 0
            for i, text in enumerate(self.corpus):
                if not isinstance(text, str) or not text:
                    raise ValueError(f"corpus document {i} is {type(text).__name__} {str(text)[:40]!r}; documents must be "
                                     "non-empty strings")
                documents += 1
                pending += [bos] + tokenizer.encode(text, add_special_tokens=False)
                # a window cut where a document begins starts with that document's own BOS, not BOS BOS (rare in
                # a model's training, and a second attention-sink row in the dictionary's data); SAELens does the same
                while pending and len(pending) >= (take := body + (pending[0] == bos)):
                    if cut % size == rank:
                        yield pending[:take] if take > body else [bos] + pending[:body]
                        yielded += 1
                    pending = pending[take:]
                    cut += 1
            if documents == 0:
                raise ValueError("the corpus has no documents")
            if yielded == 0:
                raise ValueError(f"the corpus is shorter than one window of {self.context_size} tokens"
                                 + (f" per process ({size} processes)" if size > 1 else ""))
            self.epochs += 1

    # ---- resuming ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only (for safetensors): the buffer, the shuffle generator's state, the position."""
        state = {"generator": self.generator.get_state(),
                 "position": torch.tensor([self.windows_read, self.served, self.epochs], dtype=torch.long),
                 "window_rule": torch.tensor([WINDOW_RULE], dtype=torch.long)}
        if self.buffer is not None:
            state.update({f"buffer.{i}": b.cpu().contiguous() for i, b in enumerate(self.buffer)})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Continue where the store that wrote `state` was, on the same corpus and model."""
        rule = int(state["window_rule"][0]) if "window_rule" in state else 1
        if rule != WINDOW_RULE:
            # refused rather than resumed: the windows read from here on would not be the ones the saved run read,
            # and the buffer and position would describe another stream
            raise ValueError(f"this activation store state cuts windows by rule {rule} and this probe by rule "
                             f"{WINDOW_RULE} (a window cut where a document begins now keeps that document's BOS alone, "
                             "not BOS BOS): resuming would not continue the same stream. Start the run afresh, or "
                             "resume it with the probe version that wrote it")
        self.generator.set_state(state["generator"])
        windows_read, self.served, epochs = (int(v) for v in state["position"])
        self.buffer = [state[f"buffer.{i}"].to(self.store_device) for i in range(len(self.hook_names))] \
            if "buffer.0" in state else None
        self._windows, self.windows_read, self.epochs = self._window_stream(), 0, 0
        for _ in range(windows_read):  # tokenising again is cheap; the model is not run for them
            self._next_window()
        self.epochs = epochs


def _stop_at_layer(model: HookedDecoder, points: list) -> Optional[int]:
    """The first block the forward can skip: one past the last block holding a point; None (run everything)
    when a point lies past the blocks (ln_final), 0 when all are embeddings."""
    last = 0
    for point in points:
        layer = next((i for i, block in enumerate(model.blocks) if any(point is m for m in block.modules())), None)
        if layer is not None:
            last = max(last, layer + 1)
        elif not any(point is getattr(model, name, None) for name in ("hook_embed", "hook_pos_embed")):
            return None
    return last
