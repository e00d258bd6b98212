"""transformer-lens's `generate_stream`: the generation loop of probe/generation.py, yielding its output as it goes,
as TL 3.9's HookedTransformer yields it (token ids) or as TL 4's bridge does (text for a text prompt)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from probe.generation import generation_states, input_embeddings

if TYPE_CHECKING:
    from probe.model import HookedDecoder, ModelInput


def generate_stream(model: "HookedDecoder", input: "ModelInput" = "", max_new_tokens: int = 10,
                    max_tokens_per_yield: int = 25, return_type: Optional[str] = None, **keywords):
    """transformer-lens's `generate_stream`: `generate`, yielding as it goes, in chunks of `max_tokens_per_yield` new
    tokens (the first chunk holds the prompt's ids and the first new tokens, as TL counts it), the last chunk what is
    left when generation ends. The keywords are `generate`'s (greedy unless asked to sample, as there); text and ids
    are prompts, embeddings are not (TL's takes neither).

    What it yields: token ids [batch n], as TL 3.9's HookedTransformer yields whatever `return_type` says; on a
    model booted as TL 4's bridge (`boot_transformers`), or given `return_type="str"` / `"input"`, TL 4's choice:
    `"input"` (its default) yields text for a text prompt and ids for ids, and text is what each chunk adds to the
    stream's text (special tokens left out, a character split across chunks held back until it is whole), one string
    for one sequence and a list for several."""
    if not (isinstance(max_tokens_per_yield, int) and max_tokens_per_yield > 0):
        raise ValueError(f"max_tokens_per_yield must be a positive int, got {max_tokens_per_yield!r}")
    if input_embeddings(model, input) is not None:
        raise ValueError("generate_stream takes text or token ids, as transformer-lens's; use generate() for embeddings")
    if return_type is None:
        return_type = "input" if model.bridge_names else "tokens"
    if return_type not in ("input", "str", "tokens"):
        raise ValueError(f"generate_stream(return_type={return_type!r}): it yields 'tokens', 'str', or 'input' (text "
                         f"for a text prompt, ids for ids)")
    for name in ("output_logits", "return_cache", "names_filter", "device", "return_input_tokens", "cache_names"):
        if name in keywords:  # what generate returns beside its output: a stream has nothing to return it with
            raise TypeError(f"generate_stream does not take {name}= (it yields its output only); use generate()")
    chunks = token_chunks(model, input, max_new_tokens, max_tokens_per_yield, **keywords)
    if return_type == "str" or (return_type == "input" and isinstance(input, (str, list))):
        chunks = text_deltas(model, chunks)
    yield from chunks


def token_chunks(model, input, max_new_tokens: int, max_tokens_per_yield: int, **keywords):
    """The ids [batch n] in the chunks transformer-lens yields them: every `max_tokens_per_yield` new tokens."""
    sent, prompt_length, tokens = 0, None, None
    for tokens, _ in generation_states(model, input, max_new_tokens, return_type="tokens", **keywords):
        if prompt_length is None:
            prompt_length = tokens.shape[1]  # the first state is the prompt's
        elif tokens.shape[1] - sent >= max_tokens_per_yield:  # the first chunk counts the prompt's ids too, as TL's
            yield tokens[:, sent:]
            sent = tokens.shape[1]
    if tokens is not None and tokens.shape[1] > max(sent, prompt_length):
        yield tokens[:, sent:]


def text_deltas(model, chunks):
    """The text each chunk of ids adds to its sequence's text: the whole stream decoded each time (a multi-byte
    character can straddle two chunks, and decoding a chunk alone would garble it), a trailing incomplete character
    held back until the ids that finish it arrive, and whatever is still held when the stream ends yielded last."""
    history, emitted = None, None

    def added(final: bool):
        texts = [model.tokenizer.decode(row, skip_special_tokens=True) for row in history]
        texts = texts if final else [text.rstrip("\ufffd") for text in texts]
        new = [text[done:] for text, done in zip(texts, emitted)]
        emitted[:] = [len(text) for text in texts]
        return new[0] if len(new) == 1 else new

    for chunk in chunks:
        history = chunk if history is None else torch.cat([history, chunk], dim=-1)
        emitted = emitted or [0] * chunk.shape[0]
        yield added(final=False)
    if history is not None:
        rest = added(final=True)
        if any(rest if isinstance(rest, list) else [rest]):
            yield rest
