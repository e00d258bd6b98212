"""Text generation with a key/value cache: the prompt in one pass, then one pass per new token.

`generate` takes probe's keywords and transformer-lens's (`do_sample`, `stop_at_eos`, `eos_token_id`,
`freq_penalty`, `use_past_kv_cache`, `prepend_bos`, `padding_side`, `return_type`, `verbose`) with TL's meaning,
with two deliberate differences, both to keep probe's callers' results: it is greedy unless asked to sample
(`do_sample=True` or a temperature above 0; TL samples by default), and it shows no progress bar unless
`verbose=True` (TL's default). Greedy continuations, EOS stopping and the returned text and tokens equal TL's
(tests/test_tl_tokens.py), and so do sampled ones under one `torch.manual_seed`, as both draw from the global
generator in the same order. Input embeddings [batch pos d_model] are a prompt too, as in TL; there TL 3.9's
key/value cache (its default) gives a model with learned positions the wrong positions for the new tokens (it offsets
the whole sequence's by the cache's length), and a shortformer model an error, so probe's continuation is TL's
without the cache, `use_past_kv_cache=False`, which equals TL's from the same prompt's ids
(tests/test_tl_config_fields.py). `generate_stream` (probe/generation_stream.py) is the streaming form of the same loop.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import TYPE_CHECKING, Iterable, Optional, Sequence, Union

import torch

from probe.hooks import ActivationCache, HookFn, NameFilter
from probe.inputs import mask_from_padding
from probe.kv_cache import KVCache
from probe.sampling import (Stopping, choose_tokens, completes_a_stop_string, effective_temperature,
                            penalise_repeats, stopping)
from probe.tl_surface import refuse_unsupported
from probe.tokenizer import check_padding_side
from probe.tokens import is_text

if TYPE_CHECKING:
    from probe.model import HookedDecoder, ModelInput

RETURN_TYPES = ("input", "str", "tokens", "embeds")

# transformer-lens generate keywords probe does not take, with what to do instead
UNSUPPORTED = {
    "pixel_values": "probe's models are text-only",
    "forced_bos_token_id": "probe's models are decoder-only",
}


@torch.no_grad()
def generate(model: "HookedDecoder", input: "ModelInput" = "", max_new_tokens: int = 10, **keywords):
    """Continue each prompt by up to `max_new_tokens` tokens.

    Choosing: greedy unless `do_sample=True` (then at `temperature`, 1.0 by default, as TL) or, with
    `do_sample` left None, a `temperature` above 0 (probe's switch) or `top_k` / `top_p` (which only sampling reads:
    at temperature 1.0 unless given, as TL samples them); `do_sample=False` is greedy whatever the
    temperature, and temperature 0 is greedy either way. Sampling draws from softmax(logits / temperature -
    freq_penalty x each token's count so far), restricted to the `top_k` most likely tokens and to the smallest
    set whose probability reaches `top_p`, with a generator seeded by `seed` (else torch's global one).

    Stopping: with `stop_at_eos` (None: when the model knows an EOS id), a sequence that emits `eos_token_id`
    (default the tokenizer's EOS; an id or a list) is padded with EOS from then on, and generation ends early
    once every sequence has, as in TL. `stop_at_eos=False` always makes `max_new_tokens` tokens.

    Prompts of different lengths are left-padded so they all end at the same position; positions count real
    tokens, so a padded prompt continues exactly as it would alone (text is always left-padded, whatever
    `padding_side` says, as in TL). Token ids padded by you need `attention_mask` (1 = real token), or a left
    padding side (`padding_side="left"`, else the tokenizer's `padding_side`) to read the padding off the pad
    token, as TL does.

    Input embeddings, a float [batch pos d_model] tensor (what `model.embed(tokens)` gives, positions not added:
    the model adds them, counting from 0), are a prompt too, as in TL: they enter at `hook_embed` (the prompt's
    placeholder ids, 0, are what `hook_tokens` sees), and `attention_mask` may mark left padding among them.
    `prepend_bos` does not apply to them, and `padding_side` and `freq_penalty`, which read token ids, are refused.

    Returns, with `return_type="input"`, what it was given: text for text (without special tokens, as TL
    decodes it), token ids [batch prompt+new] for ids, embeddings [batch prompt+new d_model] for embeddings (the
    new tokens' `model.embed`); "str", "tokens" or "embeds" asks for one. Text is TL's: a string for one sequence
    (a list of one prompt, or ids [1 pos], too), a list for several. From embeddings, "tokens" and "str" hold the
    new tokens only (the prompt has no ids), as in TL. Hooks in `fwd_hooks` fire on every pass (the prompt's,
    then each new token's). With `cache_names`, also returns one ActivationCache per pass. With `steering` (an object whose
    `applied(model)` is a context manager, e.g. analyses.steering's), the whole generation runs inside
    `with steering.applied(model):`. `use_past_kv_cache` is TL's name for `use_cache`.

    transformer-lens 4's keywords: `repetition_penalty` (transformers': each token already in the sequence has its
    logit divided by it where positive, multiplied where negative, before the temperature, greedy too; real tokens
    only, where TL also counts a batch's left padding); `output_logits=True` returns a `GenerateOutput` (`sequences`,
    and `logits`: one [batch vocab] per new token, as the model gave them); `return_cache=True` adds the cache of one
    pass over the output (`names_filter=`, `device=` as run_with_cache's; the prompt's padding stays masked);
    `return_input_tokens=True` adds the prompt's ids as fed (BOS and left padding included). Extras come after the
    output in the order per-pass caches, cache, input tokens. `stop_strings` (a string or a list) ends a sequence
    once a new token completes one in its text, as transformers' StopStringCriteria reads it (the occurrence ends
    inside that token, wherever it starts); it is then padded as at EOS (with the pad token if EOS does not stop).
    `stopping_criteria` (transformers' StoppingCriteria: one, a list, or a StoppingCriteriaList) ends a sequence when
    a criterion, called with every id so far and the step's logits, says so; it is padded in the same way.
    """
    return _finished(generation_states(model, input, max_new_tokens, **keywords))


@torch.no_grad()
def _finished(steps):
    """Run a generation to its end; its output."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def generation_states(
    model: "HookedDecoder",
    input: "ModelInput" = "",
    max_new_tokens: int = 10,
    *,
    temperature: Optional[float] = None,
    do_sample: Optional[bool] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    freq_penalty: float = 0.0,
    seed: Optional[int] = None,
    stop_at_eos: Optional[bool] = None,
    eos_token_id: Optional[Union[int, Sequence[int]]] = None,
    use_cache: Optional[bool] = None,
    use_past_kv_cache: Optional[bool] = None,
    prepend_bos: Optional[bool] = None,
    padding_side: Optional[str] = None,
    attention_mask: Optional[torch.Tensor] = None,
    return_type: str = "input",
    verbose: bool = False,
    fwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
    cache_names: Optional[NameFilter] = None,
    steering=None,
    repetition_penalty: float = 1.0,
    output_logits: bool = False,
    return_cache: bool = False,
    names_filter: Optional[NameFilter] = None,
    device=None,
    return_input_tokens: bool = False,
    stop_strings: Optional[Union[str, Sequence[str]]] = None,
    stopping_criteria=None,
    **unsupported,
):
    """generate's body, yielding (tokens, mask) for the prompt and after each new token; returns the output."""
    refuse_unsupported(unsupported, "HookedDecoder.generate", UNSUPPORTED)
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0 (1.0: none), got {repetition_penalty}")
    for name, value in (("names_filter", names_filter), ("device", device)):
        if value is not None and not return_cache:  # TL ignores them then; a silent no-op would hide a typo
            raise ValueError(f"generate: {name}= says what return_cache=True caches, and return_cache is off: pass "
                             f"return_cache=True (or cache_names= for one cache per pass), or leave {name} out")
    if model.cfg.bidirectional:
        raise ValueError("generate: this model's attention is bidirectional, so every position already sees the "
                         "tokens after it and none predicts a next token to continue with; run the model on whole "
                         "sequences instead")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if temperature is not None and temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if freq_penalty < 0:
        raise ValueError(f"freq_penalty must be >= 0, got {freq_penalty}")
    if return_type not in RETURN_TYPES:
        raise ValueError(f"return_type={return_type!r} is not one of {RETURN_TYPES}")
    if padding_side is not None:
        check_padding_side(padding_side)
    if steering is not None and not callable(getattr(steering, "applied", None)):
        raise TypeError(f"steering= takes an object with a method applied(model) returning a context manager "
                        f"(e.g. analyses.steering.steer(...)), got {type(steering).__name__}")
    if use_cache is not None and use_past_kv_cache is not None and use_cache != use_past_kv_cache:
        raise ValueError(f"use_cache={use_cache} and use_past_kv_cache={use_past_kv_cache} disagree; "
                         "they are one switch (use_past_kv_cache is transformer-lens's name)")
    use_cache = next((v for v in (use_cache, use_past_kv_cache) if v is not None), True)
    temperature = effective_temperature(do_sample, temperature, top_k is not None or top_p is not None)
    stops = stopping(model, stop_at_eos, eos_token_id, stop_strings, stopping_criteria)
    embeds = input_embeddings(model, input)
    if embeds is not None:
        for name, value, reads in (("padding_side", padding_side, "reads the padding off pad token ids"),
                                   ("freq_penalty", freq_penalty or None, "counts earlier token ids")):
            if value is not None:
                raise ValueError(f"generate: {name}={value!r} {reads}, and input embeddings have none: leave it out "
                                 "(mark padding with attention_mask= [batch pos], 1 = real)")
        # the prompt's ids are placeholders: its embeddings replace theirs at hook_embed, on each pass that reads it
        for name, value in (("return_cache", return_cache), ("return_input_tokens", return_input_tokens)):
            if value:
                raise ValueError(f"generate: {name}=True reads the prompt's token ids, and input embeddings have none")
        input = torch.zeros(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        fwd_hooks = [("hook_embed", _EmbeddingsAt(embeds, every_pass=not use_cache)), *fwd_hooks]

    step_logits: Optional[list[torch.Tensor]] = [] if output_logits else None
    with steering.applied(model) if steering is not None else nullcontext():
        tokens, mask, caches, prompt_length = yield from _token_steps(
            model, input, max_new_tokens, Choice(temperature, top_k, top_p, freq_penalty, repetition_penalty, seed),
            stops, use_cache, prepend_bos, padding_side, attention_mask, list(fwd_hooks), cache_names,
            verbose, embeds is not None, step_logits)
        if return_cache:  # TL 4's: one pass over the output (steered and hooked as generation was), padding masked
            with model.hooks(fwd_hooks):
                cache = model.run_with_cache(tokens, attention_mask=mask, names=names_filter, device=device)[1]
    if output_logits:  # transformers' output, as TL 4 returns it, whatever return_type says
        sequences = tokens if embeds is None else tokens[:, embeds.shape[1]:]
        output = GenerateOutput(sequences, tuple(step_logits))
    elif embeds is None:
        output = _output(model, input, tokens, mask, return_type)
    else:
        output = _output_from_embeddings(model, embeds, tokens[:, embeds.shape[1]:], return_type)
    extras = []
    if cache_names is not None:
        extras.append(caches)
    if return_cache:
        extras.append(cache)
    if return_input_tokens:
        extras.append(tokens[:, :prompt_length])  # as fed: BOS and left padding included
    return (output, *extras) if extras else output


@dataclasses.dataclass(frozen=True)
class Choice:
    """How each new token is chosen (see `generate`): greedy at temperature 0, else sampled."""

    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    freq_penalty: float
    repetition_penalty: float
    seed: Optional[int]


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """`generate(output_logits=True)`, as transformer-lens 4 returns it (transformers' GenerateDecoderOnlyOutput):
    `sequences` [batch prompt+new] token ids, and `logits`, one [batch vocab] per new token, as the model gave them
    (before any penalty or temperature). Read by attribute, key (`out["logits"]`) or position (`out[0]`)."""

    sequences: torch.Tensor
    logits: tuple[torch.Tensor, ...]

    def __getitem__(self, key):
        return (self.sequences, self.logits)[key] if isinstance(key, int) else getattr(self, key)


def input_embeddings(model, input) -> Optional[torch.Tensor]:
    """A float input as generate's prompt embeddings [batch pos d_model] on the model's device; None for text or ids."""
    if not (isinstance(input, torch.Tensor) and input.is_floating_point()):
        return None
    d_model = model.cfg.d_model
    if input.dim() != 3 or input.shape[-1] != d_model or input.shape[1] == 0:
        raise ValueError(f"generate takes input embeddings as a float [batch pos d_model] tensor with d_model={d_model} "
                         f"and at least one position, got shape {tuple(input.shape)}; token ids are an integer "
                         "[batch pos] tensor, and model.embed(tokens) gives embeddings of the right shape")
    return input.to(model.device)


class _EmbeddingsAt:
    """A hook on hook_embed: the prompt's embeddings [batch prompt d_model] in place of its placeholder ids' on each
    pass that reads the prompt: every pass without a key/value cache, the first only with one (the later passes
    read the new tokens alone, so they keep their own embeddings)."""

    def __init__(self, embeds: torch.Tensor, every_pass: bool):
        self.embeds, self.every_pass, self.done = embeds, every_pass, False

    def __call__(self, embed: torch.Tensor, hook) -> Optional[torch.Tensor]:
        if self.done:
            return None
        self.done = not self.every_pass
        return torch.cat([self.embeds.to(embed.dtype), embed[:, self.embeds.shape[1]:]], dim=1)


def _token_steps(model, input, max_new_tokens, choice: Choice, stops: Stopping, use_cache, prepend_bos,
                 padding_side, attention_mask, fwd_hooks, cache_names, verbose, from_embeddings, step_logits):
    """The loop, yielding (tokens [batch prompt+new], their mask) for the prompt and after each new token; returns
    them with the per-pass caches and the prompt's length. `step_logits` (a list, or None) collects each step's
    last-position logits."""
    # text is padded on the left: every prompt then ends at the last position, where generation continues
    # (transformer-lens forces the same whatever padding_side says)
    # token ids are read as the forward reads them (left padding off the pad id, when this call's or the
    # tokenizer's padding side is left); an explicit padding_side="right" also reads trailing pads, as TL's does,
    # and is refused below (generation continues from the last position); embeddings' placeholder ids are no tokens
    as_text = is_text(input)
    tokens, attention_mask = model.tokens_and_mask(
        input, attention_mask, padding_side="left" if as_text else padding_side, prepend_bos=prepend_bos,
        infer_padding=not from_embeddings)
    if attention_mask is None and padding_side == "right" and not as_text:
        tokenizer = _tokenizer_of(model, "padding_side= reads the padding off the pad token, which")
        attention_mask = mask_from_padding(tokens, tokenizer.pad_id, tokenizer.bos_id, "right", False)
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
    if choice.seed is not None:
        generator = torch.Generator(device=tokens.device).manual_seed(choice.seed)
    stop_ids = None if stops.ids is None else stops.ids.to(tokens.device)

    kv_cache = KVCache(model.cfg.n_layers) if use_cache else None
    caches: list[ActivationCache] = []
    scaling = model.cfg.rotary_scaling
    rope_switch = scaling.original_n_ctx if scaling is not None and scaling.kind == "longrope" else None

    def forward(step_tokens: torch.Tensor, step_mask: torch.Tensor) -> torch.Tensor:
        if cache_names is None:
            with model.hooks(fwd_hooks):
                return model(step_tokens, attention_mask=step_mask, kv_cache=kv_cache)
        logits, cache = model.run_with_cache(
            step_tokens, attention_mask=step_mask, kv_cache=kv_cache, names=cache_names, fwd_hooks=fwd_hooks
        )
        caches.append(cache)
        return logits

    steps = range(max_new_tokens)
    if verbose:
        from tqdm.auto import tqdm

        steps = tqdm(steps, total=max_new_tokens, desc="generate", unit="tok")
    finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    prompt_length = tokens.shape[1]
    yield tokens, mask
    logits = forward(tokens, mask) if max_new_tokens else None
    for step in steps:
        last = logits[:, -1]
        if step_logits is not None:
            step_logits.append(last)
        penalty = None
        if choice.freq_penalty and choice.temperature:  # greedy ignores the penalty, as in transformer-lens
            counts = torch.zeros(logits.shape[0], logits.shape[-1], device=tokens.device)
            penalty = choice.freq_penalty * counts.scatter_add_(1, tokens, mask.to(counts.dtype))  # real tokens only
        last = last.float()
        if choice.repetition_penalty != 1.0:
            last = penalise_repeats(last, tokens, mask, choice.repetition_penalty)
        next_token = choose_tokens(last, choice.temperature, choice.top_k, choice.top_p, generator, penalty)
        if stops.active:
            next_token[finished] = stops.fill
        if stop_ids is not None:
            finished |= torch.isin(next_token, stop_ids)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(next_token[:, None])], dim=1)
        if stops.strings:
            finished |= completes_a_stop_string(model.tokenizer, tokens, mask, stops.strings)
        if stops.criteria:
            finished |= stops.criteria_met(tokens, logits[:, -1])
        yield tokens, mask
        if step == max_new_tokens - 1 or (stops.active and bool(finished.all())):
            break
        # LongRoPE's cached keys turned the short way; once the sequence passes its threshold every key turns the
        # long way, so the cache restarts from the whole sequence there, as transformers' Phi-3 and PhiMoE generation
        restart = use_cache and tokens.shape[1] - 1 == rope_switch
        if restart:
            kv_cache = KVCache(model.cfg.n_layers)
        cached = use_cache and not restart
        logits = forward(next_token[:, None], torch.ones_like(next_token[:, None])) if cached else forward(tokens, mask)
    return tokens, mask, caches, prompt_length


def _output(model, input, tokens: torch.Tensor, mask: torch.Tensor, return_type: str):
    if return_type == "embeds":
        return model.embed(tokens)
    as_text = is_text(input)
    if return_type == "tokens" or (return_type == "input" and not as_text):
        return tokens
    # special tokens are dropped, as transformer-lens decodes: the BOS, and the EOS that ended a sequence
    tokenizer = _tokenizer_of(model, f"return_type={return_type!r} decodes text, which")
    texts = [tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=True) for row, m in zip(tokens, mask)]
    # transformer-lens's rule, whatever the input: one sequence is a string, several a list (a list of one prompt
    # gives a string too)
    return texts[0] if len(texts) == 1 else texts


def _output_from_embeddings(model, embeds: torch.Tensor, new_tokens: torch.Tensor, return_type: str):
    """What a prompt of embeddings gives: them and the new tokens' embeddings, or the new tokens alone (TL's)."""
    if return_type in ("input", "embeds"):
        return torch.cat([embeds, model.embed(new_tokens).to(embeds.dtype)], dim=1)
    if return_type == "tokens":
        return new_tokens
    tokenizer = _tokenizer_of(model, f"return_type={return_type!r} decodes text, which")
    texts = [tokenizer.decode(row.tolist(), skip_special_tokens=True) for row in new_tokens]
    return texts[0] if len(texts) == 1 else texts


def _tokenizer_of(model, what: str):
    if model.tokenizer is None:
        raise ValueError(f"{what} needs a tokenizer and this model has none: pass attention_mask= and "
                         "return_type='tokens', or load a directory with tokenizer.json")
    return model.tokenizer
