"""Token ids given without an attention mask are read as transformer-lens 3 reads them (probe/inputs.py's
`padding_of`): left padding is masked off the pad id when this call's `padding_side`, else the tokenizer's, is
left; right padding is attended, as TL attends it. Also forward's return_type="both" (TL's `Output`) and
generate(return_type="str")'s str-or-list rule.

The oracles: transformer-lens 3.9's HookedTransformer on the same weights (tests/saelens_oracle.py's `padding`
command, run in the SAELens virtualenv), and each prompt run alone."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from probe import DEFAULT_MODEL, HookedDecoder
from probe.kv_cache import KVCache
from oracle_process import SAELENS_PYTHON, oracle

needs_saelens = pytest.mark.skipif(not SAELENS_PYTHON.exists(), reason=f"no SAELens virtualenv at {SAELENS_PYTHON.parent.parent}: "
                                   "create it with `bash scripts/saelens_oracle.sh` (or set PROBE_SAELENS_VENV)")
# the longest prompt second, so row 1 of a right-padded batch has no padding
PROMPTS = ["KING.", "ROMEO. But soft, what light through yonder window breaks?", "JULIET. O Romeo"]
LAST = "blocks.3.hook_resid_post"


@pytest.fixture(scope="module")
def model():
    return HookedDecoder.from_pretrained(DEFAULT_MODEL).eval()


@pytest.fixture
def left(model):
    """The tokenizer's padding side set to left for one test, as refusal-direction code sets it."""
    model.tokenizer.padding_side = "left"
    yield model
    model.tokenizer.padding_side = "right"


def record(model, out, case, tokens, **keywords):
    """What the oracle records of one case (tests/saelens_oracle.py's padding), on probe."""
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=LAST, **keywords)
        out[f"{case}/logits"] = model(tokens, **keywords)
        out[f"{case}/resid"] = cache[LAST][:, -1]
        out[f"{case}/loss"] = model(tokens, return_type="loss", **keywords).reshape(1)
        halved = [("blocks.0.hook_attn_out", lambda x, hook: x * 0.5)]
        out[f"{case}/hooked"] = model.run_with_hooks(tokens, fwd_hooks=halved, **keywords)[:, -1]
    assert torch.equal(logits, out[f"{case}/logits"])


@needs_saelens
def test_padded_ids_without_a_mask_give_transformer_lens_numbers(model, tmp_path):
    data = {"left": model.to_tokens(PROMPTS, padding_side="left"),
            "left_nobos": model.to_tokens(PROMPTS, padding_side="left", prepend_bos=False),
            "right": model.to_tokens(PROMPTS, padding_side="right")}
    pad = model.tokenizer.pad_id
    assert pad == model.tokenizer.bos_id == 0  # the bundled tokenizer's BOS is its pad: TL's BOS-unmasking case
    data["left_pad1"] = torch.where(data["left"] == pad, 1, data["left"])
    data["left_pad1"][:, -1] = data["left"][:, -1]
    data["left_pad1"][torch.arange(3), (data["left"] == pad).sum(-1) - 1] = 0  # each row's BOS stays 0, after pads of 1
    save_file({k: v.contiguous() for k, v in data.items()}, str(tmp_path / "tokens.safetensors"))
    printed = json.loads(oracle("padding", DEFAULT_MODEL, tmp_path / "tokens.safetensors", tmp_path / "tl.safetensors"))
    theirs = load_file(str(tmp_path / "tl.safetensors"))

    ours = {}
    model.tokenizer.padding_side = "left"
    try:
        record(model, ours, "attribute", data["left"])
        record(model, ours, "right_kw_over_left_tokenizer", data["right"], padding_side="right")
        model.tokenizer.padding_side = "right"
        record(model, ours, "kw", data["left"], padding_side="left")
        record(model, ours, "kw_no_bos", data["left_nobos"], padding_side="left", prepend_bos=False)
        record(model, ours, "kw_bos_not_prepended", data["left"], padding_side="left", prepend_bos=False)
        record(model, ours, "right", data["right"])
        model.set_tokenizer(model.tokenizer, default_padding_side="left")
        record(model, ours, "set_tokenizer", data["left"])
        model.tokenizer.pad_id = 1
        record(model, ours, "pad_not_bos", data["left_pad1"])
        both = model(data["left"], return_type="both")
    finally:
        model.tokenizer.padding_side, model.tokenizer.pad_id = "right", pad
    assert set(ours) == set(theirs)
    tokens_of = {"attribute": "left", "right_kw_over_left_tokenizer": "right", "kw": "left", "kw_no_bos": "left_nobos",
                 "kw_bos_not_prepended": "left", "right": "right", "set_tokenizer": "left", "pad_not_bos": "left_pad1"}
    for key, expected in theirs.items():
        case, what = key.split("/")
        got = ours[key]
        if what == "logits":  # a padded query's row is meaningless (TL's attends to nothing, probe's to itself)
            tokens = data[tokens_of[case]]
            padding = 1 if case == "pad_not_bos" else pad
            real = (tokens != padding).cumsum(-1) > 0 if case not in ("right", "right_kw_over_left_tokenizer") else \
                torch.ones_like(tokens, dtype=torch.bool)
            got, expected = got[real], expected[real]
        scale = expected.abs().max().clamp(min=1)
        assert (got - expected).abs().max() <= 1e-4 * scale, key
    # the cases differ from each other, so the comparison tells left padding read from ignored
    assert not torch.allclose(ours["kw/resid"], ours["right/resid"][[0, 1, 2]], atol=1e-3)
    assert (ours["kw/resid"] - ours["kw_bos_not_prepended/resid"]).abs().max() > 1e-3

    assert (type(both).__name__, list(both._fields)) == (printed["both_type"], printed["both_fields"])
    model.tokenizer.padding_side = "right"
    for name, prompt in (("one_row", data["right"][1:]), ("two_rows", data["left"]), ("one_text", ["KING"])):
        assert model.generate(prompt, max_new_tokens=3, do_sample=False, return_type="str") == printed["generate"][name]


def test_a_left_padded_batch_of_ids_equals_each_prompt_alone(model, left):
    tokens = model.to_tokens(PROMPTS)  # left-padded: the tokenizer's side
    assert (tokens[:, 0] == model.tokenizer.pad_id).sum() == 3  # two rows padded, and every row's BOS is the pad id
    logits, cache = model.run_with_cache(tokens, names_filter=LAST)
    for i, prompt in enumerate(PROMPTS):
        alone_logits, alone_cache = model.run_with_cache(prompt, names_filter=LAST)
        torch.testing.assert_close(logits[i, -1], alone_logits[0, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cache[LAST][i, -1], alone_cache[LAST][0, -1], atol=1e-4, rtol=1e-4)
    # the padding read off the ids is the mask to_tokens built
    _, mask = model.to_tokens(PROMPTS, return_attention_mask=True)
    torch.testing.assert_close(model(tokens, attention_mask=mask), logits)
    torch.testing.assert_close(model(tokens, return_type="loss"), model(tokens, attention_mask=mask, return_type="loss"))


def test_the_padding_side_per_call_and_at_load(model):
    tokens = model.to_tokens(PROMPTS, padding_side="left")
    _, mask = model.to_tokens(PROMPTS, padding_side="left", return_attention_mask=True)
    masked = model(tokens, attention_mask=mask)
    torch.testing.assert_close(model(tokens, padding_side="left"), masked)
    hooked = model.run_with_hooks(tokens, padding_side="left", fwd_hooks=[("hook_embed", lambda x, hook: x)])
    torch.testing.assert_close(hooked, masked)
    # the tokenizer's right side, the default, reads nothing: the pads are tokens, as in transformer-lens
    assert (model(tokens) - masked)[:, -1].abs().max() > 1e-3
    loaded = HookedDecoder.from_pretrained(DEFAULT_MODEL, default_padding_side="left").eval()
    torch.testing.assert_close(loaded(tokens), masked)
    _, cache = loaded.run_with_cache(tokens, names_filter=LAST)
    torch.testing.assert_close(cache[LAST], model.run_with_cache(tokens, attention_mask=mask, names_filter=LAST)[1][LAST])
    # and this call's right side overrides the tokenizer's left
    torch.testing.assert_close(loaded(tokens, padding_side="right"), model(tokens))


def test_right_padded_ids_are_attended_as_transformer_lens_attends_them(model, left):
    tokens = model.to_tokens(PROMPTS, padding_side="right")
    unmasked = model(tokens, attention_mask=torch.ones_like(tokens))
    torch.testing.assert_close(model(tokens, padding_side="right"), unmasked)
    for i, prompt in enumerate(PROMPTS):  # the real tokens never see the pads after them
        n = model.to_tokens(prompt).shape[1]
        torch.testing.assert_close(unmasked[i, :n], model(prompt)[0], atol=1e-4, rtol=1e-4)


def test_a_kv_cache_continuation_reads_a_pad_id_as_a_token(model, left):
    tokens = model.to_tokens(PROMPTS)
    _, mask = model.to_tokens(PROMPTS, return_attention_mask=True)
    pad = torch.full((3, 1), model.tokenizer.pad_id)  # EOS, here the pad id too, generated as the next token
    cache = KVCache(model.cfg.n_layers)
    model(tokens, kv_cache=cache)
    step = model(pad, kv_cache=cache)
    whole = model(torch.cat([tokens, pad], 1), attention_mask=torch.cat([mask, torch.ones_like(pad)], 1))
    torch.testing.assert_close(step[:, -1], whole[:, -1], atol=1e-4, rtol=1e-4)


def test_left_padding_without_a_tokenizer_asks_for_a_mask(model):
    bare = HookedDecoder(model.cfg)
    tokens = torch.tensor([[0, 0, 5, 6]])
    with pytest.raises(ValueError, match="needs a tokenizer.*attention_mask="):
        bare(tokens, padding_side="left")
    bare(tokens, padding_side="right")  # nothing to read, as transformer-lens without a tokenizer
    with pytest.raises(ValueError, match="padding_side must be 'right' or 'left'"):
        model(tokens, padding_side="middle")


def test_generate_reads_the_tokenizers_left_padding_of_ids(model, left):
    tokens = model.to_tokens(PROMPTS)
    _, mask = model.to_tokens(PROMPTS, return_attention_mask=True)
    out = model.generate(tokens, max_new_tokens=4, return_type="tokens")
    assert torch.equal(out, model.generate(tokens, max_new_tokens=4, attention_mask=mask, return_type="tokens"))
    for i, prompt in enumerate(PROMPTS):
        assert model.generate(prompt, max_new_tokens=4) == model.generate([PROMPTS[i]], max_new_tokens=4)


def test_return_type_both_is_transformer_lens_output(model):
    out = model(PROMPTS[1], return_type="both")
    logits, loss = out
    assert type(out).__name__ == "Output" and out._fields == ("logits", "loss")
    assert out.logits is logits and out.loss is loss
    torch.testing.assert_close(out.logits, model(PROMPTS[1]))
    torch.testing.assert_close(out.loss, model(PROMPTS[1], return_type="loss"))


def test_generate_str_is_a_string_for_one_sequence_and_a_list_for_several(model):
    one = model.to_tokens(PROMPTS[1])
    assert isinstance(model.generate(one, max_new_tokens=2, return_type="str"), str)
    assert isinstance(model.generate(one[0], max_new_tokens=2, return_type="str"), str)
    assert isinstance(model.generate([PROMPTS[0]], max_new_tokens=2), str)
    texts = model.generate(model.to_tokens(PROMPTS[:2], padding_side="left"), max_new_tokens=2, return_type="str",
                           padding_side="left")
    assert isinstance(texts, list) and len(texts) == 2
    assert texts[1] == model.generate(one, max_new_tokens=2, return_type="str")
