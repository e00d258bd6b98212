"""transformer-lens's token and generation surface on probe: each case is TL code, a function of `model` alone,
run on the bundled model and on TL's TransformerBridge over the same directory; the results must be equal.
The tokenizer's transformers-like surface is held to transformers' PreTrainedTokenizerFast on the same file.

TL's bridge generates wrongly with its KV cache on this checkpoint (its cached greedy continuation differs from
its own uncached one and from a hand-written argmax loop), so the generation cases pass use_past_kv_cache=False;
probe's cached generation is held to its uncached one in tests/test_generation.py and below."""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch

from probe import DEFAULT_MODEL, HookedDecoder
from tl_oracle import assert_same, bridge

PROMPTS = ["ROMEO. But soft, what light", "KING", "To be, or not to be: that is the question."]
LONG = "To be, or not to be, that is the question. " * 40  # > n_ctx = 256 tokens


@pytest.fixture(scope="module")
def probe_model():
    return HookedDecoder.from_pretrained(DEFAULT_MODEL).eval()


@pytest.fixture(scope="module")
def tl_model():
    return bridge(DEFAULT_MODEL)


_EOS = {}


def greedy_eos(model):
    """A token the greedy continuation of PROMPTS[0] emits at its 3rd step, so a case can stop there."""
    if id(model) not in _EOS:
        out = model.generate(PROMPTS[0], max_new_tokens=3, do_sample=False, verbose=False, use_past_kv_cache=False,
                             return_type="tokens")
        _EOS[id(model)] = int(out[0, -1])
    return _EOS[id(model)]


CASES = {
    # ---- to_tokens ----
    "to_tokens": lambda model: model.to_tokens(PROMPTS[0]),
    "to_tokens list pads right": lambda model: model.to_tokens(PROMPTS),
    "to_tokens padding_side left": lambda model: model.to_tokens(PROMPTS, padding_side="left"),
    "to_tokens prepend_bos=False": lambda model: model.to_tokens(PROMPTS, prepend_bos=False),
    "to_tokens truncates to n_ctx": lambda model: model.to_tokens([LONG, "KING"]),
    "to_tokens truncate=False": lambda model: model.to_tokens(LONG, truncate=False).shape,
    "to_tokens move_to_device=False": lambda model: model.to_tokens("KING", move_to_device=False).device.type,
    "to_tokens empty string": lambda model: model.to_tokens(""),
    # ---- to_str_tokens ----
    "to_str_tokens": lambda model: model.to_str_tokens(PROMPTS[0]),
    "to_str_tokens prepend_bos=False": lambda model: model.to_str_tokens(PROMPTS[2], prepend_bos=False),
    "to_str_tokens list": lambda model: model.to_str_tokens(PROMPTS),
    "to_str_tokens 1-D tensor": lambda model: model.to_str_tokens(model.to_tokens(PROMPTS[2])[0]),
    "to_str_tokens [1 pos] tensor": lambda model: model.to_str_tokens(model.to_tokens(PROMPTS[2])),
    "to_str_tokens 0-d tensor": lambda model: model.to_str_tokens(torch.tensor(590)),
    "to_str_tokens numpy": lambda model: model.to_str_tokens(model.to_tokens(PROMPTS[0]).cpu().numpy()),
    "to_str_tokens list of tensors": lambda model: model.to_str_tokens(list(model.to_tokens(PROMPTS))),
    "to_str_tokens whitespace": lambda model: model.to_str_tokens(" two  spaces\n\ttab", prepend_bos=False),
    # ---- to_string ----
    "to_string int": lambda model: model.to_string(590),
    "to_string list": lambda model: model.to_string([590, 45, 37]),
    "to_string 0-d tensor": lambda model: model.to_string(torch.tensor(590)),
    "to_string 1-D tensor": lambda model: model.to_string(model.to_tokens(PROMPTS[0])[0]),
    "to_string 2-D tensor": lambda model: model.to_string(model.to_tokens(PROMPTS)),
    "to_string round trip": lambda model: model.to_string(model.to_tokens(PROMPTS[2], prepend_bos=False)[0]),
    # ---- single tokens ----
    "to_single_token": lambda model: [model.to_single_token(s) for s in (" the", "\n", ",", " love")],
    "to_single_str_token": lambda model: [model.to_single_str_token(i) for i in (0, 199, 590)],
    "to_single_token round trip": lambda model: model.to_single_str_token(model.to_single_token(" love")),
    # ---- the tokenizer, through the model ----
    "tokenizer special ids": lambda model: [model.tokenizer.bos_token_id, model.tokenizer.eos_token_id,
                                            model.tokenizer.pad_token_id, model.tokenizer.padding_side],
    "tokenizer special tokens": lambda model: [model.tokenizer.bos_token, model.tokenizer.eos_token,
                                               model.tokenizer.pad_token],
    "tokenizer decode": lambda model: model.tokenizer.decode(model.to_tokens(PROMPTS[0])[0]),
    "tokenizer decode skip_special_tokens": lambda model: model.tokenizer.decode(
        model.to_tokens(PROMPTS[0])[0], skip_special_tokens=True),
    "tokenizer batch_decode": lambda model: model.tokenizer.batch_decode(model.to_tokens(PROMPTS)),
    "tokenizer len": lambda model: len(model.tokenizer),
    "tokenizer padding_side left": lambda model: _with_padding_side(model, "left", lambda: model.to_tokens(PROMPTS)),
    # ---- generate: greedy ----
    "generate greedy text": lambda model: model.generate(
        PROMPTS[0], max_new_tokens=8, do_sample=False, verbose=False, use_past_kv_cache=False),
    "generate greedy list": lambda model: model.generate(
        PROMPTS, max_new_tokens=8, do_sample=False, verbose=False, use_past_kv_cache=False),
    "generate greedy tokens in": lambda model: model.generate(
        model.to_tokens(PROMPTS[2]), max_new_tokens=8, do_sample=False, verbose=False, use_past_kv_cache=False),
    "generate return_type tokens": lambda model: model.generate(
        PROMPTS, max_new_tokens=8, do_sample=False, verbose=False, use_past_kv_cache=False, return_type="tokens"),
    "generate return_type str from tokens": lambda model: model.generate(
        model.to_tokens(PROMPTS[:2], padding_side="left"), max_new_tokens=6, do_sample=False, verbose=False,
        use_past_kv_cache=False, padding_side="left", return_type="str"),
    "generate prepend_bos=False": lambda model: model.generate(
        PROMPTS[1], max_new_tokens=8, do_sample=False, verbose=False, use_past_kv_cache=False, prepend_bos=False,
        return_type="tokens"),
    "generate left-padded ids with padding_side": lambda model: model.generate(
        model.to_tokens(PROMPTS, padding_side="left"), max_new_tokens=6, do_sample=False, verbose=False,
        use_past_kv_cache=False, padding_side="left"),
    # ---- generate: stopping ----
    "generate stop_at_eos pads with eos": lambda model: model.generate(
        PROMPTS, max_new_tokens=6, do_sample=False, verbose=False, use_past_kv_cache=False,
        eos_token_id=greedy_eos(model), return_type="tokens"),
    "generate stop_at_eos text": lambda model: model.generate(
        PROMPTS, max_new_tokens=6, do_sample=False, verbose=False, use_past_kv_cache=False,
        eos_token_id=greedy_eos(model)),
    "generate stops early when all finish": lambda model: model.generate(
        PROMPTS[0], max_new_tokens=8, do_sample=False, verbose=False, use_past_kv_cache=False,
        eos_token_id=greedy_eos(model), return_type="tokens").shape,
    "generate stop_at_eos=False": lambda model: model.generate(
        PROMPTS[0], max_new_tokens=8, do_sample=False, verbose=False, use_past_kv_cache=False,
        eos_token_id=greedy_eos(model), stop_at_eos=False, return_type="tokens"),
    "generate several stop ids": lambda model: model.generate(
        PROMPTS, max_new_tokens=5, do_sample=False, verbose=False, use_past_kv_cache=False,
        eos_token_id=[greedy_eos(model), 14], return_type="tokens"),
    # ---- generate: sampling under torch's global seed ----
    # do_sample=True spelt out: TL samples by default, probe is greedy by default (see probe/generation.py)
    "generate sampled": lambda model: _seeded(3, lambda: model.generate(
        PROMPTS, max_new_tokens=8, do_sample=True, verbose=False, use_past_kv_cache=False, return_type="tokens")),
    "generate sampled top_k temperature freq_penalty": lambda model: _seeded(4, lambda: model.generate(
        PROMPTS[0], max_new_tokens=8, do_sample=True, top_k=20, temperature=0.7, freq_penalty=1.0, verbose=False,
        use_past_kv_cache=False)),
    "generate sampled top_p": lambda model: _seeded(5, lambda: model.generate(
        PROMPTS[1], max_new_tokens=8, do_sample=True, top_p=0.9, verbose=False, use_past_kv_cache=False)),
    # TL code that names top_k or top_p alone samples (its do_sample=True default); probe samples them too
    "generate top_k alone samples": lambda model: _seeded(6, lambda: model.generate(
        PROMPTS[0], max_new_tokens=8, top_k=20, verbose=False, use_past_kv_cache=False)),
    "generate top_p alone samples": lambda model: _seeded(7, lambda: model.generate(
        PROMPTS[1], max_new_tokens=8, top_p=0.9, verbose=False, use_past_kv_cache=False)),
    "generate do_sample=True temperature 0 is greedy": lambda model: model.generate(
        PROMPTS[0], max_new_tokens=8, do_sample=True, temperature=0.0, verbose=False, use_past_kv_cache=False),
    # ---- transformer-lens 4's generate keywords ----
    "generate repetition_penalty greedy": lambda model: model.generate(  # (this prompt repeats itself without it)
        PROMPTS[2], max_new_tokens=10, do_sample=False, verbose=False, use_past_kv_cache=False, repetition_penalty=1.8,
        return_type="tokens"),
    "generate repetition_penalty sampled": lambda model: _seeded(8, lambda: model.generate(
        PROMPTS[1], max_new_tokens=8, do_sample=True, temperature=0.8, top_k=40, freq_penalty=0.5,
        repetition_penalty=1.3, verbose=False, use_past_kv_cache=False)),
    "generate return_input_tokens": lambda model: model.generate(
        PROMPTS[2], max_new_tokens=4, do_sample=False, verbose=False, use_past_kv_cache=False, return_input_tokens=True,
        return_type="tokens"),
    # stop strings, as transformers' StopStringCriteria reads them: one spanning tokens ("e world"), one ending inside
    # a token ("th" of " that"), one reaching back into the prompt ("question.\n"), rows that never stop
    "generate stop_strings": lambda model: model.generate(
        PROMPTS, max_new_tokens=12, do_sample=False, verbose=False, use_past_kv_cache=False,
        stop_strings=["e world", " th", "question.\n"], return_type="tokens"),
    "generate stop_strings text": lambda model: model.generate(
        PROMPTS[0], max_new_tokens=12, do_sample=False, verbose=False, use_past_kv_cache=False, stop_strings="I hav"),
    "generate stop_strings without eos": lambda model: model.generate(
        PROMPTS, max_new_tokens=10, do_sample=False, verbose=False, use_past_kv_cache=False, stop_strings="What",
        stop_at_eos=False, return_type="tokens"),
    # ---- TL's dataset helper given model.tokenizer (it calls tokenizer(texts, return_tensors="np", padding=True)) ----
    "tokenize_and_concatenate": lambda model: tokenized_dataset(model.tokenizer),
}


def tokenized_dataset(tokenizer):
    import datasets
    from transformer_lens.utilities import tokenize_and_concatenate

    texts = datasets.Dataset.from_dict({"text": [PROMPTS[0] * 9, PROMPTS[1] * 7, PROMPTS[2] * 20]})
    return tokenize_and_concatenate(texts, tokenizer, max_length=24, column_name="text", add_bos_token=True,
                                    num_proc=1)[:]["tokens"]

def _with_padding_side(model, side, fn):
    before = model.tokenizer.padding_side
    model.tokenizer.padding_side = side
    try:
        return fn()
    finally:
        model.tokenizer.padding_side = before


def _seeded(seed, fn):
    torch.manual_seed(seed)
    return fn()


@pytest.mark.parametrize("case", list(CASES))
def test_case_equals_transformer_lens(case, probe_model, tl_model):
    assert_same(CASES[case](probe_model), CASES[case](tl_model), atol=0, what=case)


def test_generate_returns_logits_and_a_cache_as_transformer_lens_4s(probe_model, tl_model):
    """`output_logits=True` (transformers' GenerateDecoderOnlyOutput, as TL 4 returns it) and `return_cache=True`
    (one pass over the output), against TL 4's bridge (without its key/value cache, which continues wrongly here)."""
    greedy = dict(max_new_tokens=6, do_sample=False, verbose=False, use_past_kv_cache=False)
    ours, theirs = (model.generate(PROMPTS[2], output_logits=True, repetition_penalty=1.4, **greedy)
                    for model in (probe_model, tl_model))
    assert torch.equal(ours.sequences, theirs.sequences) and torch.equal(ours["sequences"], ours[0])
    assert_same(list(ours.logits), list(theirs.logits), what="each step's logits")
    names = ["blocks.1.attn.hook_pattern", "blocks.2.hook_resid_post", "ln_final.hook_scale"]
    (our_out, our_cache, our_input), (their_out, their_cache, their_input) = (
        model.generate(PROMPTS[1], return_cache=True, names_filter=names, return_input_tokens=True, **greedy)
        for model in (probe_model, tl_model))
    assert our_out == their_out and torch.equal(our_input, their_input)
    assert_same({name: our_cache[name] for name in names}, {name: their_cache[name] for name in names}, what="cache")
    with pytest.raises(TypeError, match="yields its output only"):
        next(probe_model.generate_stream(PROMPTS[0], max_new_tokens=2, output_logits=True))


def test_the_repetition_penalty_is_transformer_lens_4s():
    """On logits of both signs, against the function TL 4's sampler applies (a batch without padding)."""
    from transformer_lens.utilities.logits_utils import _apply_repetition_penalty

    from probe.sampling import penalise_repeats

    generator = torch.Generator().manual_seed(0)
    logits, tokens = torch.randn(3, 50, generator=generator), torch.randint(0, 50, (3, 12), generator=generator)
    assert_same(penalise_repeats(logits, tokens, torch.ones_like(tokens), 1.7),
                _apply_repetition_penalty(logits, tokens, 1.7), atol=0, what="repetition penalty")


# ---- probe only: what TL does not have, or where probe deliberately differs ---------------------------------
def test_cached_generation_equals_uncached_and_greedy_is_the_default(probe_model):
    kw = dict(max_new_tokens=8, verbose=False)
    uncached = probe_model.generate(PROMPTS, do_sample=False, use_past_kv_cache=False, **kw)
    assert probe_model.generate(PROMPTS, do_sample=False, **kw) == uncached
    assert probe_model.generate(PROMPTS, **kw) == uncached  # probe's default: greedy (TL's: sampling)
    assert probe_model.generate(PROMPTS, do_sample=False, temperature=1.5, **kw) == uncached  # do_sample wins
    assert probe_model.generate(PROMPTS, do_sample=False, use_cache=False, **kw) == uncached


def test_sampling_is_seeded_and_top_k_1_is_greedy(probe_model):
    kw = dict(max_new_tokens=10, verbose=False, return_type="tokens")
    greedy = probe_model.generate(PROMPTS, do_sample=False, **kw)
    a = probe_model.generate(PROMPTS, do_sample=True, seed=7, **kw)
    b = probe_model.generate(PROMPTS, do_sample=True, seed=7, **kw)
    assert a.tolist() == b.tolist() and a.tolist() != greedy.tolist()
    assert _seeded(2, lambda: probe_model.generate(PROMPTS, do_sample=True, **kw)).tolist() == \
        _seeded(2, lambda: probe_model.generate(PROMPTS, do_sample=True, **kw)).tolist()
    assert probe_model.generate(PROMPTS, do_sample=True, top_k=1, seed=3, **kw).tolist() == greedy.tolist()
    assert probe_model.generate(PROMPTS, temperature=1.0, top_k=1, seed=3, **kw).tolist() == greedy.tolist()


def test_stop_at_eos_pads_each_finished_sequence(probe_model):
    eos = greedy_eos(probe_model)
    out = probe_model.generate(PROMPTS, max_new_tokens=8, do_sample=False, verbose=False, eos_token_id=eos,
                               return_type="tokens")
    n_prompt = probe_model.to_tokens(PROMPTS).shape[1]
    for row in out[:, n_prompt:].tolist():
        if eos in row:
            assert set(row[row.index(eos):]) == {eos}  # the stop token, then only padding with it
    # a tokenizer EOS that never comes: every sequence runs max_new_tokens
    assert probe_model.generate(PROMPTS[0], max_new_tokens=8, verbose=False, return_type="tokens").shape[1] == \
        probe_model.to_tokens(PROMPTS[0]).shape[1] + 8


def test_to_str_tokens_extensions(probe_model):
    """Beyond TL (which raises on these): a list of ints is one prompt's ids, [batch pos] ids give a list per row."""
    tokens = probe_model.to_tokens(PROMPTS)
    assert probe_model.to_str_tokens(tokens[0].tolist()) == probe_model.to_str_tokens(tokens[0])
    assert probe_model.to_str_tokens(tokens) == [probe_model.to_str_tokens(row) for row in tokens]
    assert probe_model.to_str_tokens(np.array([590, 45])) == ["RO", "M"]


def test_to_tokens_keeps_probe_keywords(probe_model):
    tokens, mask = probe_model.to_tokens(PROMPTS, padding_side="left", return_attention_mask=True)
    assert mask.shape == tokens.shape and bool((mask[:, -1] == 1).all()) and int(mask[1].sum()) < tokens.shape[1]


def test_steering_wraps_the_whole_generation(probe_model):
    events = []

    class Recorder:
        @contextmanager
        def applied(self, model):
            events.append("enter")
            try:
                yield model
            finally:
                events.append("exit")

    def note(x, hook):
        events.append("pass")

    probe_model.generate(PROMPTS[0], max_new_tokens=3, verbose=False, steering=Recorder(),
                         fwd_hooks=[("hook_embed", note)])
    assert events == ["enter", "pass", "pass", "pass", "exit"]
    events.clear()  # return_cache's pass over the output is steered and hooked too
    probe_model.generate(PROMPTS[0], max_new_tokens=2, verbose=False, steering=Recorder(),
                         fwd_hooks=[("hook_embed", note)], return_cache=True, names_filter="hook_embed")
    assert events == ["enter", "pass", "pass", "pass", "exit"]
    with pytest.raises(TypeError, match=r"applied\(model\)"):
        probe_model.generate(PROMPTS[0], max_new_tokens=2, steering=object())


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(repetition_penalty=0.0), ValueError, "repetition_penalty must be > 0"),
    (dict(names_filter="hook_embed"), ValueError, "return_cache=True"),
    (dict(stopping_criteria=[3]), TypeError, "stopping_criteria takes transformers. StoppingCriteria"),
    (dict(stop_strings=[""]), ValueError, "non-empty string"),
    (dict(not_a_keyword=1), TypeError, "not_a_keyword"),
    (dict(return_type="logits"), ValueError, "'input', 'str', 'tokens'"),
    (dict(freq_penalty=-1.0), ValueError, "freq_penalty"),
    (dict(use_cache=True, use_past_kv_cache=False), ValueError, "disagree"),
    (dict(eos_token_id=10**6), ValueError, "eos_token_id"),
    (dict(padding_side="middle"), ValueError, "padding_side"),
])
def test_generate_refuses_bad_keywords_naming_the_fix(probe_model, kwargs, error, match):
    with pytest.raises(error, match=match):
        probe_model.generate(PROMPTS[0], max_new_tokens=2, **kwargs)


def test_token_errors_name_the_fix(probe_model):
    with pytest.raises(ValueError, match="not one"):
        probe_model.to_single_token(" antidisestablishmentarianism")
    with pytest.raises(TypeError, match="integer token ids"):
        probe_model.to_string(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="token ids"):
        probe_model.to_string(object())
    with pytest.raises(ValueError, match=r"\[batch pos\]"):
        probe_model.to_string(torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        probe_model.to_single_str_token(10**6)
    with pytest.raises(ValueError, match="non-empty list of strings"):
        probe_model.to_tokens(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="padding_side"):
        probe_model.tokenizer.padding_side = "up"


# ---- the tokenizer against transformers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    special = "<|endoftext|>"  # add_bos_token=True: TL 3.9 reloads model.tokenizer so (get_tokenizer_with_bos)
    return PreTrainedTokenizerFast(tokenizer_file=f"{DEFAULT_MODEL}/tokenizer.json", bos_token=special,
                                   eos_token=special, pad_token=special, add_bos_token=True)


def numpy_out(arrays):
    """Arrays as (type, dtype, tensor) triples, so the comparison sees numpy's arrays stay numpy's."""
    if isinstance(arrays, dict) or hasattr(arrays, "keys"):
        return {key: numpy_out(arrays[key]) for key in arrays.keys()}
    if isinstance(arrays, list):
        return [numpy_out(a) for a in arrays]
    return [type(arrays).__name__, str(arrays.dtype), torch.as_tensor(arrays)]


TOKENIZER_CASES = {
    "call": lambda tok: dict(tok(PROMPTS[0])),
    "call list": lambda tok: dict(tok(PROMPTS)),
    "call padded tensors": lambda tok: dict(tok(PROMPTS, return_tensors="pt", padding=True)),
    "call left": lambda tok: dict(tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")),
    "call one pt": lambda tok: dict(tok(PROMPTS[2], return_tensors="pt")),
    "call truncation": lambda tok: dict(tok(PROMPTS, truncation=True, max_length=4)),
    "call max_length padding": lambda tok: dict(tok(PROMPTS[1], padding="max_length", max_length=6)),
    "call no special tokens": lambda tok: dict(tok(PROMPTS, add_special_tokens=False, padding=True)),
    "call attribute": lambda tok: tok(PROMPTS[0]).input_ids,
    "call special in text": lambda tok: tok("a<|endoftext|>b")["input_ids"],
    "encode": lambda tok: tok.encode(PROMPTS[2]),
    "encode tensors": lambda tok: numpy_out([tok.encode(PROMPTS[1], return_tensors="pt"),
                                             tok.encode(PROMPTS[1], return_tensors="np")]),
    "call numpy": lambda tok: numpy_out(tok(PROMPTS, return_tensors="np", padding=True)),  # tokenize_and_concatenate's
    "tokenize": lambda tok: tok.tokenize(PROMPTS[1]),
    "convert_tokens_to_string": lambda tok: tok.convert_tokens_to_string(tok.tokenize(PROMPTS[1])),
    "all_special_ids": lambda tok: tok.all_special_ids,
    "decode list": lambda tok: tok.decode([0, 590, 45, 37]),
    "decode tensor": lambda tok: tok.decode(torch.tensor([0, 590, 45, 37])),
    "decode 0-d": lambda tok: tok.decode(torch.tensor(590)),
    "decode int": lambda tok: tok.decode(590),
    "decode skip_special_tokens": lambda tok: tok.decode([0, 590, 0, 45], skip_special_tokens=True),
    "decode clean_up False": lambda tok: tok.decode(tok.encode("Hello , world ."), clean_up_tokenization_spaces=False),
    "batch_decode tensor": lambda tok: tok.batch_decode(torch.tensor([[0, 590], [45, 37]])),
    "batch_decode lists skip": lambda tok: tok.batch_decode([[0, 590], [45]], skip_special_tokens=True),
    "convert_ids_to_tokens": lambda tok: [tok.convert_ids_to_tokens(199), tok.convert_ids_to_tokens([0, 268, 590])],
    "convert_tokens_to_ids": lambda tok: [tok.convert_tokens_to_ids("Ġthe"), tok.convert_tokens_to_ids(["<|endoftext|>", "Ġthe"])],
    "unknown token": lambda tok: tok.convert_tokens_to_ids("not-a-token-at-all"),
    "specials": lambda tok: [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.bos_token, tok.eos_token,
                             tok.pad_token, tok.padding_side],
    "sizes": lambda tok: [len(tok), tok.vocab_size, len(tok.get_vocab())],
}


@pytest.mark.parametrize("case", list(TOKENIZER_CASES))
def test_tokenizer_equals_transformers(case, probe_model, hf_tokenizer):
    assert_same(TOKENIZER_CASES[case](probe_model.tokenizer), TOKENIZER_CASES[case](hf_tokenizer), atol=0, what=case)


def test_tokenizer_errors_name_the_fix(probe_model):
    tok = probe_model.tokenizer
    with pytest.raises(ValueError, match="padding=True"):
        tok(PROMPTS, return_tensors="pt")
    with pytest.raises(ValueError, match="batch_decode"):
        tok.decode(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="return_tensors"):
        tok(PROMPTS[0], return_tensors="tf")
    with pytest.raises(TypeError, match="string or a non-empty list"):
        tok(5)
    with pytest.raises(AttributeError, match="input_ids"):
        tok("x").token_type_ids


def test_generate_stream_yields_tl_4s_text_on_a_booted_model(probe_model):
    """TL 4's bridge streams text for a text prompt (`return_type="input"`, its default) and ids for ids; TL 3.9's
    HookedTransformer ids whatever (tests/test_kv_cache.py). Against the bridge, greedy, without its key/value cache."""
    from test_bridge_names import native_bridge

    ours, theirs = HookedDecoder.boot_transformers(DEFAULT_MODEL), native_bridge(DEFAULT_MODEL)
    kw = dict(max_new_tokens=11, max_tokens_per_yield=4, do_sample=False, verbose=False, use_past_kv_cache=False)
    for prompt, extra in ((PROMPTS[0], {}), (PROMPTS[:2], {}), (PROMPTS[2], {"return_type": "tokens"}),
                          (ours.to_tokens(PROMPTS[2]), {}), (ours.to_tokens(PROMPTS[1]), {"return_type": "str"})):
        got, want = (list(model.generate_stream(prompt, **kw, **extra)) for model in (ours, theirs))
        assert_same(got, want, atol=0, what=f"{prompt!r} {extra}")
    assert all(isinstance(chunk, torch.Tensor) for chunk in probe_model.generate_stream(PROMPTS[0], **kw))


def test_streamed_text_holds_back_a_character_split_across_chunks(probe_model):
    """Each chunk's text is what it adds to the whole stream's: a character whose bytes straddle two chunks comes
    whole, in the chunk that completes it. By hand: the text of all the ids, decoded at once."""
    from probe.generation_stream import text_deltas

    ids = probe_model.to_tokens("naïve café — 東京", prepend_bos=False)
    assert ids.shape[1] > len("naïve café — 東京") - 4  # byte-level pieces: some characters span several ids
    deltas = list(text_deltas(probe_model, (ids[:, i:i + 1] for i in range(ids.shape[1]))))
    assert "".join(deltas) == "naïve café — 東京" and not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas  # a chunk that ended inside a character added nothing yet


def test_stopping_criteria_stop_as_on_transformer_lens_4(probe_model, tl_model):
    """TL 4's `stopping_criteria=`: transformers' StoppingCriteria (one, a list, a StoppingCriteriaList), each called
    with every id so far and the step's logits; a sequence a criterion ends is padded from then on. Against the
    bridge, greedy, without its key/value cache."""
    from transformers import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

    greedy = dict(max_new_tokens=8, do_sample=False, verbose=False, use_past_kv_cache=False, return_type="tokens")
    free = probe_model.generate(PROMPTS[0], **greedy)
    stop_id = int(free[0, -5])  # a token the free run emits part-way

    class AtToken(StoppingCriteria):
        def __init__(self):
            self.scores = []

        def __call__(self, input_ids, scores, **kwargs):
            self.scores.append(scores.clone())
            return input_ids[:, -1] == stop_id

    for criteria in (lambda: AtToken(), lambda: [MaxLengthCriteria(max_length=free.shape[1] - 3)],
                     lambda: StoppingCriteriaList([AtToken(), MaxLengthCriteria(max_length=free.shape[1] - 1)])):
        runs = []
        for model in (probe_model, tl_model):
            given = criteria()
            out = model.generate(PROMPTS[0], stopping_criteria=given, **greedy)
            recorders = [c for c in (given if isinstance(given, list) else [given]) if isinstance(c, AtToken)]
            runs.append((out, [torch.stack(r.scores) for r in recorders]))
        (ours, our_scores), (theirs, their_scores) = runs
        assert torch.equal(ours, theirs) and ours.shape[1] < free.shape[1]
        assert_same(our_scores, their_scores, atol=1e-4, what="the scores each criterion saw")
    # a batch: the sequence the criterion ends is padded while the other goes on
    batch = [PROMPTS[0], PROMPTS[2]]
    ours, theirs = (model.generate(batch, stopping_criteria=[AtToken()], **greedy) for model in (probe_model, tl_model))
    assert torch.equal(ours, theirs)
    with pytest.raises(TypeError, match="stopping_criteria takes transformers' StoppingCriteria"):
        probe_model.generate(PROMPTS[0], stopping_criteria="eos", **greedy)
