"""Each family's text defaults as transformer-lens sets them (probe/checkpoints.py `Family.prepends_bos`,
probe/tokenizer.py's padding token): BOS first by default except for GPT-NeoX/Pythia, Qwen and Phi, trained without one,
and padding with the tokenizer's pad token, else EOS. The oracle: transformer-lens 4's bridge over the same
checkpoint directory (TL 3.9's from_pretrained makes the same choices: tests/test_tokenizer_surface.py)."""
from __future__ import annotations

import pytest
import torch

from probe import HookedDecoder
from probe.tokenizer import Tokenizer
from test_tokenizer_surface import tokenizer_dir
from test_variants import build
from tl_oracle import assert_same, booted

TEXT, TEXTS = "the cat sat on the mat", ["Hello world", "the cat sat on the mat, the cat", " Paris"]
LLAMA_FILES = (["<s>", "</s>"], {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}, True)
GPT_FILES = (["<|endoftext|>"], {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
                                 "eos_token": "<|endoftext|>"}, False)
QWEN_FILES = (["<|endoftext|>"], {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
                                  "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, False)
# OPT's tokenizer puts its BOS, </s>, before text itself and pads with <pad>
OPT_FILES = (["<pad>", "</s>"], {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "</s>", "eos_token": "</s>",
                                 "pad_token": "<pad>"}, True)
# Bloom's tokenizer adds nothing before text, pads with <pad>
BLOOM_FILES = (["<unk>", "<s>", "</s>", "<pad>"], {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                                                   "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}, False)
FAMILIES = {"llama": LLAMA_FILES, "bloom": BLOOM_FILES, "mistral": LLAMA_FILES, "gemma": LLAMA_FILES, "neox": GPT_FILES, "gptneo": GPT_FILES,
            "opt": OPT_FILES, "phi": GPT_FILES, "phi3": LLAMA_FILES, "gemma3": LLAMA_FILES,
            "olmo": GPT_FILES, "gptj": GPT_FILES, "olmo2": GPT_FILES, "olmo_hybrid": GPT_FILES,
            "qwen2": QWEN_FILES, "qwen3": QWEN_FILES, "mixtral": LLAMA_FILES, "olmoe": GPT_FILES, "qwen3_moe": QWEN_FILES, "gpt_oss": GPT_FILES,
            "apertus": LLAMA_FILES, "arcee": LLAMA_FILES, "granite": LLAMA_FILES, "cohere": LLAMA_FILES,
            "cohere2": LLAMA_FILES, "granitemoe": LLAMA_FILES, "xglm": OPT_FILES,
            "exaone": LLAMA_FILES, "qwen3_5": QWEN_FILES, "starcoder2": GPT_FILES, "nemotron": LLAMA_FILES,
            "seed_oss": LLAMA_FILES, "glm": LLAMA_FILES, "glm4": LLAMA_FILES,
            "ernie4_5": LLAMA_FILES, "flex_olmo": GPT_FILES,
            "exaone4": LLAMA_FILES, "hunyuan": LLAMA_FILES, "jais2": LLAMA_FILES, "deepseek_v2": LLAMA_FILES,
            "deepseek_v3": LLAMA_FILES, "glm4_moe_lite": LLAMA_FILES, "youtu": LLAMA_FILES, "glm_moe_dsa": LLAMA_FILES,
            "granitemoehybrid": LLAMA_FILES, "bamba": LLAMA_FILES, "falcon_h1": LLAMA_FILES, "mamba2": LLAMA_FILES, "mamba": LLAMA_FILES,
            "falcon_mamba": LLAMA_FILES, "rwkv": LLAMA_FILES, "glm4_moe": LLAMA_FILES, "jamba": LLAMA_FILES,
            "minimax_m2": LLAMA_FILES, "ernie4_5_moe": LLAMA_FILES,
            "lfm2": LLAMA_FILES, "lfm2_moe": LLAMA_FILES, "recurrent_gemma": LLAMA_FILES, "nemotron_h": LLAMA_FILES, "zamba2": LLAMA_FILES, "gemma4": LLAMA_FILES, "afmoe": LLAMA_FILES, "laguna": LLAMA_FILES, "phimoe": LLAMA_FILES, "jetmoe": LLAMA_FILES, "llama4": LLAMA_FILES, "nanochat": LLAMA_FILES, "bitnet": LLAMA_FILES,
            "modernbert_decoder": LLAMA_FILES,
            "llama-pad": (["<s>", "</s>", "<pad>"], {**LLAMA_FILES[1], "pad_token": "<pad>"}, True)}


def tokenized_checkpoint(kind: str, directory, files=LLAMA_FILES, **overrides):
    """A random `kind` checkpoint in `directory` with a tokenizer of these files (TL 4's bridge loads one for some
    families), its vocabulary the tokenizer's."""
    directory = tokenizer_dir(directory, *files)
    build(kind, directory, vocab_size=len(Tokenizer.from_directory(directory)), **overrides)
    return directory


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_text_defaults_are_transformer_lens_per_family(family, tmp_path):
    directory = tokenized_checkpoint(family.removesuffix("-pad"), tmp_path / family, FAMILIES[family])
    ours, theirs = HookedDecoder.from_pretrained(directory).eval(), booted(directory, no_processing=True)
    assert ours.cfg.default_prepend_bos == theirs.cfg.default_prepend_bos == (family not in ("neox", "qwen2", "qwen3", "phi", "bloom", "qwen3_moe",
                                                                                                 "granite", "granitemoe", "qwen3_5",
                                                                                                 "starcoder2", "seed_oss", "glm", "glm4", "glm4_moe", "ernie4_5",
                                                                                                 "exaone4", "glm4_moe_lite", "glm_moe_dsa", "minimax_m2", "ernie4_5_moe",
                                                                                                 "granitemoehybrid", "phimoe", "recurrent_gemma"))
    assert ours.tokenizer.pad_token_id == theirs.tokenizer.pad_token_id
    assert_same(ours.to_tokens(TEXTS), theirs.to_tokens(TEXTS), what=f"{family}: to_tokens")
    assert ours.to_str_tokens(TEXT) == theirs.to_str_tokens(TEXT)
    with torch.no_grad():
        assert_same(ours(TEXT), theirs(TEXT), what=f"{family}: logits of text")
        # right-padded text: the pad targets are scored, so the pad id shows in the loss
        assert_same(ours(TEXTS, return_type="loss"), theirs(TEXTS, return_type="loss"), what=f"{family}: loss")
    last = int(theirs.to_tokens(TEXT)[0, -1])
    assert ours.get_token_position(last, TEXT) == theirs.get_token_position(last, TEXT)
