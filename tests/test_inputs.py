"""Tokenisation, padding, devices and dtypes, and the errors bad input gets."""
from __future__ import annotations

import pytest
import torch

from probe import HookedDecoder


def test_tokenizer_round_trip(tiny_model):
    text = "To be, or not to be: <script>alert(1)</script>"
    tokens = tiny_model.to_tokens(text)
    assert tokens.shape[0] == 1 and tokens[0, 0].item() == tiny_model.tokenizer.bos_id
    assert tiny_model.to_string(tokens[0, 1:]) == text
    str_tokens = tiny_model.to_str_tokens(text)
    assert len(str_tokens) == tokens.shape[1] and "".join(str_tokens[1:]) == text
    assert tiny_model.to_tokens(text, prepend_bos=False).shape[1] == tokens.shape[1] - 1


def test_single_token_strings_and_the_error_for_several(tiny_model):
    backend = tiny_model.tokenizer.backend  # the oracle: the tokenizer library itself
    one = next(s for s in (" the", " to", "e", "a") if len(backend.encode(s).ids) == 1)
    assert tiny_model.to_single_token(one) == backend.encode(one).ids[0]
    with pytest.raises(ValueError, match=r"is \d+ tokens .*not one"):
        tiny_model.to_single_token(" antidisestablishmentarianism")
    with pytest.raises(ValueError, match="is 0 tokens"):
        tiny_model.to_single_token("")


def test_padded_batch_gives_each_prompt_its_own_activations(tiny_model):
    prompts = ["The quick brown fox", "To be, or not to be, that is the question: whether", "Numbers"]
    with torch.no_grad():
        batched, cache = tiny_model.run_with_cache(prompts)
        _, mask = tiny_model.to_tokens(prompts, return_attention_mask=True)
        for i, prompt in enumerate(prompts):
            alone, alone_cache = tiny_model.run_with_cache(prompt)
            n = int(mask[i].sum())
            assert alone.shape[1] == n
            torch.testing.assert_close(batched[i, :n], alone[0], atol=1e-5, rtol=0)
            for name in ("blocks.1.hook_resid_post", "blocks.0.attn.hook_pattern"):
                got = cache[name][i]
                got = got[:n] if "resid" in name else got[:, :n, :n]
                torch.testing.assert_close(got, alone_cache[name][0], atol=1e-5, rtol=0)


def test_left_padding_with_attention_mask(tiny_model):
    prompt = tiny_model.to_tokens("The quick brown fox jumps")
    n, pad = prompt.shape[1], 4
    padded = torch.cat([torch.full((1, pad), tiny_model.tokenizer.pad_id), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, pad), torch.ones(1, n)], dim=1).long()
    with torch.no_grad():
        alone = tiny_model(prompt)
        left = tiny_model(padded, attention_mask=mask)
        _, cache = tiny_model.run_with_cache(padded, attention_mask=mask, names=lambda n: n.endswith("hook_pattern"))
    assert torch.isfinite(left).all()
    torch.testing.assert_close(left[:, pad:], alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["blocks.1.attn.hook_pattern"][0, :, pad:, :pad], torch.zeros(4, n, pad))


def test_one_dimensional_tokens_get_a_batch_dim(tiny_model, tokens):
    with torch.no_grad():
        torch.testing.assert_close(tiny_model(tokens[0]), tiny_model(tokens[:1]))


@pytest.mark.parametrize(
    "bad,error,match",
    [
        (torch.zeros(1, 5), TypeError, "integer"),
        (torch.zeros(1, 5, dtype=torch.bool), TypeError, "integer"),
        (torch.zeros(1, 2, 3, dtype=torch.long), ValueError, r"\[batch pos\]"),
        (torch.zeros(1, 0, dtype=torch.long), ValueError, "empty"),
        (torch.tensor([[1, -1]]), ValueError, "-1 is outside the vocabulary"),
        (torch.tensor([[1, 10_000]]), ValueError, "10000 is outside the vocabulary"),
        (torch.zeros(1, 49, dtype=torch.long), ValueError, "n_ctx=48"),
        (3.5, TypeError, "token ids"),
    ],
)
def test_bad_token_input(tiny_model, bad, error, match):
    with pytest.raises(error, match=match):
        tiny_model(bad)


def test_empty_prompts(tiny_model):
    assert tiny_model.to_tokens("").tolist() == [[tiny_model.tokenizer.bos_id]]  # BOS alone is a valid prompt
    assert tiny_model.to_tokens("", prepend_bos=False).shape == (1, 0)  # TL's empty row (tests/test_tokenizer_surface.py)
    with pytest.raises(ValueError, match="empty input"):
        tiny_model("", prepend_bos=False)
    with pytest.raises(ValueError, match="non-empty list"):
        tiny_model.to_tokens([])
    for run in (tiny_model, tiny_model.run_with_cache, lambda x: tiny_model.generate(x, max_new_tokens=1)):
        with pytest.raises(ValueError, match="empty list"):
            run([])


def test_mask_shape_mismatch(tiny_model, tokens):
    with pytest.raises(ValueError, match="attention_mask has shape"):
        tiny_model(tokens, attention_mask=torch.ones(1, 3))


def test_model_without_tokenizer_says_what_is_missing(tiny_model):
    bare = HookedDecoder(tiny_model.cfg)
    with pytest.raises(ValueError, match="tokenizer.json"):
        bare("hello")


def test_dtype_and_to(tiny_dir, tokens):
    model = HookedDecoder.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, dtype=torch.float32)
        reference = HookedDecoder.from_pretrained(tiny_dir)(tokens)
    assert logits.dtype == torch.bfloat16 and cache["blocks.0.hook_resid_pre"].dtype == torch.float32
    assert (logits.float() - reference).abs().max() < 0.1  # bf16 is close, not exact
    model = model.to(torch.float64)
    assert model(tokens).dtype == torch.float64
    assert model.unembed.weight is model.embed.W_E  # tying survives .to()


def test_hook_returning_wrong_dtype_names_the_point(tiny_model, tokens):
    with pytest.raises(ValueError, match="blocks.0.hook_resid_pre.*float64"):
        tiny_model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, h: x.double())])
