"""Text generation with a key/value cache: the prompt in one pass, then one pass per new token."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional, Union

import torch

from hooks import ActivationCache, HookFn, NameFilter
from probe.kv_cache import KVCache

if TYPE_CHECKING:
    from probe.model import HookedDecoder, ModelInput


@torch.no_grad()
def generate(
    model: "HookedDecoder",
    input: "ModelInput",
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seed: Optional[int] = None,
    use_cache: bool = True,
    attention_mask: Optional[torch.Tensor] = None,
    fwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
    cache_names: Optional[NameFilter] = None,
):
    """Continue each prompt by `max_new_tokens` tokens.

    Greedy at temperature 0; otherwise samples from softmax(logits / temperature), optionally
    restricted to the `top_k` most likely tokens and to the smallest set whose probability reaches
    `top_p`, with a seeded generator. Prompts of different lengths are left-padded so they all end
    at the same position; positions count real tokens, so a padded prompt continues exactly as it
    would alone.

    Returns what it was given: a string for a string, a list of strings for a list, token ids
    [batch prompt+new] for ids. Hooks in `fwd_hooks` fire on every pass (the prompt's, then each
    new token's). With `cache_names`, also returns one ActivationCache per pass.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    fwd_hooks = list(fwd_hooks)  # attached on every pass: a generator would be used up by the first
    as_text = isinstance(input, str) or (isinstance(input, (list, tuple)) and bool(input) and isinstance(input[0], str))
    # text is padded on the left: every prompt then ends at the last position, where generation continues
    tokens, attention_mask = model._tokens_and_mask(input, attention_mask, padding_side="left")
    if tokens.shape[1] + max_new_tokens > model.cfg.n_ctx:
        raise ValueError(
            f"the prompt has {tokens.shape[1]} tokens; {max_new_tokens} more would exceed n_ctx={model.cfg.n_ctx}"
        )
    mask = torch.ones_like(tokens) if attention_mask is None else attention_mask
    padded_last = (mask[:, -1] == 0).nonzero().flatten().tolist()
    if padded_last:
        # each prompt continues from the last position, so that position must be a real token
        raise ValueError(
            f"attention_mask marks the last position of prompt(s) {padded_last} as padding; generation continues "
            "from the last position, so pad on the left (model.to_tokens(..., padding_side='left'))"
        )
    generator = None
    if seed is not None:
        generator = torch.Generator(device=tokens.device).manual_seed(seed)

    kv_cache = KVCache(model.cfg.n_layers) if use_cache else None
    caches: list[ActivationCache] = []

    def forward(step_tokens: torch.Tensor, step_mask: torch.Tensor) -> torch.Tensor:
        if cache_names is None:
            with model.hooks(fwd_hooks):
                return model(step_tokens, attention_mask=step_mask, kv_cache=kv_cache)
        logits, cache = model.run_with_cache(
            step_tokens, attention_mask=step_mask, kv_cache=kv_cache, names=cache_names, fwd_hooks=fwd_hooks
        )
        caches.append(cache)
        return logits

    logits = forward(tokens, mask)
    for step in range(max_new_tokens):
        next_token = _choose(logits[:, -1].float(), temperature, top_k, top_p, generator)[:, None]
        tokens = torch.cat([tokens, next_token], dim=1)
        mask = torch.cat([mask, torch.ones_like(next_token)], dim=1)
        if step == max_new_tokens - 1:
            break
        logits = forward(next_token, torch.ones_like(next_token)) if use_cache else forward(tokens, mask)

    output: Union[str, list[str], torch.Tensor] = tokens
    if as_text:
        first = 0 if model.tokenizer.bos_id is None else 1  # to_tokens prepended BOS exactly when there is one
        texts = [model.tokenizer.decode(row[m.bool()].tolist()[first:]) for row, m in zip(tokens, mask)]
        output = texts[0] if isinstance(input, str) else texts
    return (output, caches) if cache_names is not None else output


def _choose(logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float], generator) -> torch.Tensor:
    """logits [batch vocab] -> token ids [batch]."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens before it already reach top_p; the most likely always stays
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
