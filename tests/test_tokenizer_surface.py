"""`model.tokenizer` as TL 3.9's HookedTransformer has it: BOS added by `encode` and `tokenizer(...)` exactly where TL's
tokenizer (reloaded with add_bos_token=True) adds it, per tokenizer family, against HookedTransformer itself; and the
transformers surface TL scripts use (`pad_token = eos_token`, `pad`, data collators, `save_pretrained`,
`apply_chat_template`, `name_or_path`, `model_max_length`) against transformers' tokenizer built from the same files.
Probe's own callers (to_tokens, to_single_token) keep one BOS."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import processors

from conftest import train_tokenizer
from probe import HookedDecoder, HookedTransformerConfig
from probe.tokenizer import Tokenizer
from saelens_oracle import tokenizer_idioms
from test_sae_training import needs_saelens, oracle

TEXTS = ["Hello world", " Paris", "the cat sat on the mat, the cat"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tokenizer_dir(directory: Path, specials: list[str], config: dict, bos_and_eos_processor: bool = False) -> Path:
    """A small trained byte-level BPE saved as a transformers checkpoint's tokenizer files would be."""
    directory.mkdir()
    tok = train_tokenizer()
    tok.add_special_tokens([s for s in specials if tok.token_to_id(s) is None])
    if bos_and_eos_processor:  # a Llama tokenizer.json's post-processor, with an EOS after, as some ship it
        bos, eos = specials[:2]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}", special_tokens=[(bos, tok.token_to_id(bos)), (eos, tok.token_to_id(eos))])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


# name: (specials, tokenizer_config.json, Llama-style post-processor, architecture, padded idioms)
FAMILIES = {
    "gpt2": (["<|endoftext|>"], {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024}, False,
             "GPT2LMHeadModel", True),
    "neox": (["<|endoftext|>"], {"tokenizer_class": "GPTNeoXTokenizer", "bos_token": "<|endoftext|>",
                                 "eos_token": "<|endoftext|>"}, False, "GPTNeoXForCausalLM", False),
    "qwen": (["<|endoftext|>", "<|im_end|>"], {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None,
              "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, False, "Qwen2ForCausalLM", True),
    # as transformers 5 saves Qwen's files: the null "bos_token" dropped
    "qwen-saved": (["<|endoftext|>", "<|im_end|>"], {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>",
                   "pad_token": "<|endoftext|>"}, False, "Qwen2ForCausalLM", True),
    "llama": (["<s>", "</s>"], {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"},
              True, "LlamaForCausalLM", True),
    "llama-pad": (["<s>", "</s>", "<pad>"], {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                                            "eos_token": "</s>", "pad_token": "<pad>"}, True, "LlamaForCausalLM", True),
}


@needs_saelens
def test_bos_and_token_methods_as_tl_per_family(tmp_path):
    """TL 3.9 (HookedTransformer(cfg, tokenizer=AutoTokenizer(dir))) and probe (the same config, tokenizer_name=dir)
    give the same encode / call / decode / to_tokens results, padded ones too: both pad with the tokenizer's pad
    token, else EOS (a Llama tokenizer with `</s>`)."""
    cases, ours = {}, {}
    for name, (specials, config, processor, architecture, padded) in FAMILIES.items():
        directory = tokenizer_dir(tmp_path / name, specials, config, processor)
        d_vocab = len(Tokenizer.from_directory(directory))
        cases[name] = {"dir": str(directory), "architecture": architecture, "d_vocab": d_vocab, "padded": padded}
        cfg = HookedTransformerConfig(n_layers=1, d_model=8, n_ctx=64, d_head=4, n_heads=2, d_vocab=d_vocab,
                                      act_fn="relu", attn_only=True, original_architecture=architecture,
                                      tokenizer_name=str(directory))
        ours[name] = tokenizer_idioms(HookedDecoder(cfg), padded)
    theirs = json.loads(oracle("tl_tokenizer", json.dumps(cases)))
    for name in FAMILIES:
        for key in theirs[name]:
            assert ours[name][key] == theirs[name][key], f"{name} {key}: {ours[name][key]!r} != TL's {theirs[name][key]!r}"
    assert theirs["gpt2"]["encode"][1][0] == theirs["gpt2"]["bos_token_id"]  # the case the audit found
    assert theirs["qwen"]["encode_empty"] == []


@pytest.fixture
def gpt2_dir(tmp_path) -> Path:
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024, "chat_template": CHATML}
    return tokenizer_dir(tmp_path / "gpt2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], config)


def both(directory: Path):
    """probe's tokenizer and transformers' as TL 3.9 holds it (add_bos_token=True), from the same files."""
    from transformers import AutoTokenizer

    return Tokenizer.from_directory(directory), AutoTokenizer.from_pretrained(str(directory), add_bos_token=True)


def test_pad_token_assignment_and_names(gpt2_dir):
    ours, theirs = both(gpt2_dir)
    for tok in (ours, theirs):
        tok.padding_side = "left"
        tok.pad_token = "<|im_end|>"
    assert ours.pad_token_id == theirs.pad_token_id
    assert ours(TEXTS, padding=True, return_tensors="pt").input_ids.tolist() == \
        theirs(TEXTS, padding=True, return_tensors="pt").input_ids.tolist()
    for tok in (ours, theirs):
        tok.pad_token_id = tok.eos_token_id
    assert (ours.pad_token, ours.pad_token_id) == (theirs.pad_token, theirs.pad_token_id)
    assert ours.name_or_path == theirs.name_or_path == str(gpt2_dir)
    assert ours.model_max_length == theirs.model_max_length == 1024
    assert Tokenizer.from_directory(tokenizer_dir(gpt2_dir.parent / "bare", ["<|endoftext|>"], {})).model_max_length \
        == both(gpt2_dir.parent / "bare")[1].model_max_length
    with pytest.raises(ValueError, match="pad_token"):
        ours.pad_token = "<not a token>"
    batch = ours(TEXTS[0], return_tensors="pt").to("cpu")
    assert batch.input_ids.tolist() == theirs(TEXTS[0], return_tensors="pt").to("cpu").input_ids.tolist()


def test_encode_with_and_without_special_tokens(gpt2_dir):
    ours, theirs = both(gpt2_dir)
    for text in TEXTS + ["", "a<|endoftext|>b"]:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    ours.add_bos_token = theirs.add_bos_token = False  # transformers' setter rebuilds its post-processor
    assert ours.encode(TEXTS[0]) == theirs.encode(TEXTS[0])


def test_pad_and_data_collator(gpt2_dir):
    from transformers import DataCollatorForLanguageModeling

    ours, theirs = both(gpt2_dir)
    for tok in (ours, theirs):
        tok.pad_token = tok.eos_token
    examples = lambda tok: [{"input_ids": tok(t)["input_ids"]} for t in TEXTS]
    for options in ({}, {"pad_to_multiple_of": 8}):
        a = DataCollatorForLanguageModeling(ours, mlm=False, **options)(examples(ours))
        b = DataCollatorForLanguageModeling(theirs, mlm=False, **options)(examples(theirs))
        assert sorted(a) == sorted(b)
        for key in b:
            assert torch.equal(a[key], b[key]), key
    for kwargs in ({"padding_side": "left"}, {"return_tensors": "pt", "padding": "max_length", "max_length": 40},
                   {"return_attention_mask": False}):
        a, b = ours.pad(examples(ours), **kwargs), theirs.pad(examples(theirs), **kwargs)
        assert sorted(a) == sorted(b)
        for key in b:
            assert torch.as_tensor(a[key]).tolist() == torch.as_tensor(b[key]).tolist(), (kwargs, key)


def test_save_pretrained_round_trips_through_transformers(gpt2_dir, tmp_path):
    from transformers import AutoTokenizer

    ours, theirs = both(gpt2_dir)
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    for directory in (tmp_path / "ours", tmp_path / "theirs"):
        reloaded, probe_reloaded = AutoTokenizer.from_pretrained(str(directory)), Tokenizer.from_directory(directory)
        for text in TEXTS:
            assert reloaded.encode(text) == probe_reloaded.encode(text) == theirs.encode(text), directory.name
            assert probe_reloaded.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert reloaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
            probe_reloaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_apply_chat_template(gpt2_dir):
    ours, theirs = both(gpt2_dir)
    chat = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the cat"}]
    batch = [chat, chat[:1]]
    for kwargs in ({"tokenize": False}, {"tokenize": False, "add_generation_prompt": True},
                   {"tokenize": False, "continue_final_message": True}, {}, {"return_dict": False},
                   {"add_generation_prompt": True, "return_tensors": "pt"}):
        for conversation in (chat, batch) if "return_tensors" not in kwargs else (chat,):  # a batch needs padding
            a, b = ours.apply_chat_template(conversation, **kwargs), theirs.apply_chat_template(conversation, **kwargs)
            if isinstance(b, str) or (isinstance(b, list) and isinstance(b[0], str)):
                assert a == b, kwargs
            else:
                a, b = (dict(x) if hasattr(x, "keys") else {"ids": x} for x in (a, b))
                assert {k: torch.as_tensor(v).tolist() if isinstance(v, torch.Tensor) else v for k, v in a.items()} == \
                    {k: torch.as_tensor(v).tolist() if isinstance(v, torch.Tensor) else v for k, v in b.items()}, kwargs
    padded = dict(padding=True, return_tensors="pt")
    theirs.pad_token = theirs.eos_token  # as TL 3.9 sets it
    assert ours.apply_chat_template(batch, **padded).input_ids.tolist() == \
        theirs.apply_chat_template(batch, **padded).input_ids.tolist()
    assert ours.apply_chat_template(chat, chat_template="{{ messages[0]['content'] }}", tokenize=False) == "hello world"
    bare = Tokenizer.from_directory(tokenizer_dir(gpt2_dir.parent / "plain", ["<|endoftext|>"], {}))
    with pytest.raises(ValueError, match="chat_template="):
        bare.apply_chat_template(chat)
    with pytest.raises(TypeError, match="AutoTokenizer"):
        ours.apply_chat_template(chat, tools=[{"name": "f"}])


def test_probe_callers_keep_one_bos(gpt2_dir):
    """to_tokens and to_single_token add BOS themselves, so the tokenizer's own BOS must not double it."""
    cfg = HookedTransformerConfig(n_layers=1, d_model=8, n_ctx=64, d_head=4, n_heads=2, act_fn="relu",
                                  d_vocab=len(Tokenizer.from_directory(gpt2_dir)), tokenizer_name=str(gpt2_dir))
    model = HookedDecoder(cfg)
    tok = model.tokenizer
    assert model.to_tokens(" Paris")[0].tolist() == tok.encode(" Paris")
    assert model.to_tokens(" Paris", prepend_bos=False)[0].tolist() == tok.encode(" Paris", add_special_tokens=False)
    assert model.to_single_token(" the") == tok.encode(" the", add_special_tokens=False)[0]
