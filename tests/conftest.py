"""Shared fixtures: random-weight GPT-2 checkpoints built with `transformers`, saved to temp dirs.

Nothing here touches the network or ../shared: the tokenizer is a small byte-level BPE trained on
a few sentences below, and the weights are `transformers`' own random initialisation.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from probe import HookedDecoder

TOKENIZER_TEXT = [
    "When in the course of human events it becomes necessary for one people to dissolve the bands.",
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    "<script>alert('x')</script> & other <b>markup</b> should stay text.",
    "Numbers 0123456789 and punctuation !?.,;:'\"()[]{} appear too.",
]


def train_tokenizer(vocab_size: int = 320) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_TEXT * 20, trainer)
    return tok


def build_hf_checkpoint(directory: Path, seed: int = 0, with_tokenizer: bool = True, **config) -> Path:
    """A random-weight transformers GPT2LMHeadModel saved to `directory`; returns the directory."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = train_tokenizer()
    eot = tok.token_to_id("<|endoftext|>")
    config.setdefault("vocab_size", tok.get_vocab_size())
    torch.manual_seed(seed)
    hf_config = GPT2Config(bos_token_id=eot, eos_token_id=eot, **config)
    model = GPT2LMHeadModel(hf_config)
    _perturb_norms(model, seed)
    model.save_pretrained(directory)
    if with_tokenizer:
        tok.save(str(directory / "tokenizer.json"))
    return directory


def _perturb_norms(model, seed: int) -> None:
    """transformers initialises LayerNorms to (1, 0) and biases to 0; random values make the tests see them."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "ln" in name and name.endswith("weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))


TINY = dict(n_layer=2, n_embd=64, n_head=4, n_positions=48)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return build_hf_checkpoint(tmp_path_factory.mktemp("tiny-gpt2"), **TINY)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir) -> HookedDecoder:
    return HookedDecoder.from_pretrained(tiny_dir).eval()


@pytest.fixture
def no_bos_model(tiny_model) -> HookedDecoder:
    """The tiny model (same weights) with a tokenizer that has no BOS, as GPT-1's vocabulary has none."""
    import copy

    from probe.tokenizer import Tokenizer as ProbeTokenizer

    model = copy.copy(tiny_model)  # shares the modules; only the tokenizer attribute differs
    model.tokenizer = ProbeTokenizer(tiny_model.tokenizer.backend, bos_token=None)
    return model


@pytest.fixture(scope="session")
def tiny_hf(tiny_dir):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(tiny_dir, attn_implementation="eager").eval()


@pytest.fixture
def tokens(tiny_model) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, tiny_model.cfg.d_vocab, (3, 17), generator=gen)


@pytest.fixture(scope="session")
def bundled_model() -> HookedDecoder:
    """The small trained model shipped in the package (probe.DEFAULT_MODEL)."""
    from probe import DEFAULT_MODEL

    return HookedDecoder.from_pretrained(DEFAULT_MODEL).eval()


@pytest.fixture
def device_under_test() -> torch.device:
    """The device a GPU test compares with the CPU: $PROBE_TEST_DEVICE, else CUDA when present; the test is skipped
    with neither (PROBE_TEST_DEVICE=cpu runs it on the CPU against itself, which checks the test)."""
    device = os.environ.get("PROBE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
    if device is None:
        pytest.skip("needs a GPU (or PROBE_TEST_DEVICE=cpu to check this test on the CPU)")
    return torch.device(device)
