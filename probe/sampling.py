"""Choosing each generated token and when a sequence stops, as transformer-lens's generate does: greedy or sampled
at a temperature, with its frequency and repetition penalties, top-k and top-p, and its EOS rules."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


def effective_temperature(do_sample: Optional[bool], temperature: Optional[float],
                           sampling_only: bool = False) -> float:
    """0.0 for greedy, else the sampling temperature (see `generate`). `sampling_only`: a keyword that means
    nothing to greedy decoding was given (top_k, top_p), which asks to sample as TL's default does."""
    if do_sample is None:
        if sampling_only and temperature is None:
            return 1.0
        return temperature or 0.0
    if not do_sample:
        return 0.0
    return 1.0 if temperature is None else temperature


@dataclasses.dataclass(frozen=True)
class Stopping:
    """When a sequence ends: at one of `ids` (None: none), once its text completes one of `strings`, or once one of
    `criteria` (transformers' StoppingCriteria, or any callable of (input_ids, scores)) says so; a finished sequence
    is padded with `fill` until every sequence has finished."""

    ids: Optional[torch.Tensor]
    fill: int
    strings: tuple[str, ...] = ()
    criteria: tuple = ()

    @property
    def active(self) -> bool:
        return self.ids is not None or bool(self.strings) or bool(self.criteria)

    def criteria_met(self, tokens: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """[batch] bool: the sequences one of `criteria` ends, each called as transformers' StoppingCriteria are
        (every id so far, the new one included; this step's logits [batch vocab])."""
        met = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        for criterion in self.criteria:
            said = torch.as_tensor(criterion(tokens, scores), device=tokens.device).bool()
            if said.shape not in ((), met.shape):
                raise ValueError(f"a stopping criterion returned shape {tuple(said.shape)}; it must return a bool "
                                 f"per sequence, shape {tuple(met.shape)} (or one bool for all)")
            met |= said
        return met


def stopping(model, stop_at_eos: Optional[bool], eos_token_id, stop_strings, stopping_criteria=None) -> Stopping:
    """generate's stopping rules: EOS ids (see stop_ids_and_fill) and transformer-lens 4's `stop_strings` and
    `stopping_criteria` (one criterion, a list of them, or transformers' StoppingCriteriaList)."""
    ids, fill = stop_ids_and_fill(model, stop_at_eos, eos_token_id)
    criteria = () if stopping_criteria is None else \
        tuple(stopping_criteria) if isinstance(stopping_criteria, (list, tuple)) else (stopping_criteria,)
    if not all(callable(criterion) for criterion in criteria):
        raise TypeError("stopping_criteria takes transformers' StoppingCriteria (or callables of (input_ids, scores) "
                        "returning a bool per sequence), one, a list of them or a StoppingCriteriaList")
    strings = ()
    if stop_strings is not None:
        strings = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings)
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"stop_strings takes a non-empty string or a list of them, got {stop_strings!r}")
        if model.tokenizer is None:
            raise ValueError("stop_strings needs a tokenizer to read the text generated, and this model has none; "
                             "stop at token ids with eos_token_id= instead")
    if (strings or criteria) and ids is None and model.tokenizer is not None:
        fill = model.tokenizer.pad_id  # without EOS stopping, finished sequences get the pad token, as in TL 4
    return Stopping(ids, fill, strings, criteria)


def completes_a_stop_string(tokenizer, tokens: torch.Tensor, mask: torch.Tensor, strings: tuple[str, ...]) -> torch.Tensor:
    """[batch] bool: whether each sequence's last token completes one of `strings` in its text, as transformers'
    StopStringCriteria (which transformer-lens 4 applies) reads it: an occurrence that ends inside the last token,
    wherever it starts (in the prompt too) and whatever the token holds after it."""
    hits = []
    for row, real in zip(tokens.tolist(), mask.bool().tolist()):
        ids = [token for token, keep in zip(row, real) if keep]
        text, before = tokenizer.decode(ids), tokenizer.decode(ids[:-1])
        # the last occurrence ends past the text before the last token
        hits.append(any((at := text.rfind(s)) >= 0 and at + len(s) > len(before) for s in strings))
    return torch.tensor(hits, dtype=torch.bool, device=tokens.device)


def stop_ids_and_fill(model, stop_at_eos: Optional[bool], eos_token_id) -> tuple[Optional[torch.Tensor], int]:
    """The ids that end a sequence (None: never stop) and the id a finished sequence is padded with."""
    if stop_at_eos is False:
        return None, 0
    tokenizer_eos = None if model.tokenizer is None else model.tokenizer.eos_token_id
    if eos_token_id is None:
        eos_token_id = tokenizer_eos
    if eos_token_id is None:
        if stop_at_eos:
            raise ValueError("stop_at_eos=True needs an EOS id and this model's tokenizer has none: pass "
                             "eos_token_id= (an id or a list of ids), or stop_at_eos=False")
        return None, 0  # stop_at_eos=None: nothing to stop at, so run max_new_tokens as probe always has
    ids = [eos_token_id] if isinstance(eos_token_id, int) else [int(i) for i in eos_token_id]
    if not ids or not all(0 <= i < model.cfg.d_vocab for i in ids):
        raise ValueError(f"eos_token_id={eos_token_id!r}: give token ids in [0, {model.cfg.d_vocab})")
    # TL pads with the tokenizer's EOS when given several stop ids, with the one id otherwise
    fill = ids[0] if len(ids) == 1 or tokenizer_eos is None else tokenizer_eos
    return torch.tensor(ids, dtype=torch.long), fill


def choose_tokens(logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float], generator,
            penalty: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits [batch vocab] -> token ids [batch]."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if penalty is not None:
        logits = logits - penalty
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


def penalise_repeats(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' (and transformer-lens 4's) repetition penalty on logits [batch vocab]: the logit of every token
    already in the sequence (its real tokens, `mask` [batch pos] = 1) divided by `penalty` where positive, multiplied
    by it where negative; before the temperature, and for greedy decoding too."""
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, tokens, mask.bool())
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
