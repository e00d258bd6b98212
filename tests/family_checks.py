"""Checks every newly supported checkpoint family gets against transformers' own model of the same directory:
greedy generation through probe's KV cache, transformer-lens's default weight processing (same log-probs), and a
cache of everything against the hook shapes predicted from the config."""
from __future__ import annotations

import torch

from probe import HookedDecoder
from probe.shapes import hook_shapes

TL_PROCESSING = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)


def assert_generation_and_processing_match(hf, directory, vocab: int = 101, pad_token_id: int = 0,
                                           processing: bool = True, **generate) -> None:
    """probe's greedy continuation of two prompts is transformers' token for token, and (with `processing`) the
    processed model's log-probs are transformers'."""
    model = HookedDecoder.from_pretrained(directory).eval()
    prompt = torch.randint(4, vocab, (2, 6), generator=torch.Generator().manual_seed(1))
    # probe's model has no tokenizer here, so no end token to stop at: transformers is told of none either, or a
    # random model that happens to choose its config's eos id would stop there and not in probe
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=pad_token_id, **generate)
        assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False, verbose=False, **generate), expected)
        if processing:
            processed = HookedDecoder.from_pretrained(directory, **TL_PROCESSING).eval()
            torch.testing.assert_close(processed(prompt).log_softmax(-1), hf(prompt).logits.log_softmax(-1), atol=1e-4,
                                       rtol=0)


def cache_of_everything(directory, vocab: int = 101) -> tuple[HookedDecoder, torch.Tensor, dict, dict]:
    """(the model, its tokens, a cache of every point, the shapes hook_shapes predicts for them)."""
    model = HookedDecoder.from_pretrained(directory).eval()
    toks = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, cache = model.run_with_cache(toks, names=lambda n: True)
    return model, toks, cache, hook_shapes(model.cfg, *toks.shape)


def caches_of_both(directory, tokens: torch.Tensor) -> tuple[dict, dict]:
    """(probe's cache of everything, TL 4's bridge's) on the same checkpoint directory and tokens, where their layouts
    differ and a test compares the two by a rule of its own."""
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.from_pretrained(directory).eval()
    with torch.no_grad():
        return model.run_with_cache(tokens)[1], bridge.run_with_cache(tokens)[1]


def seen_in_forward(hf, tokens: torch.Tensor, modules: dict) -> dict:
    """{name: (its inputs, its output)} of each of transformers' `modules` in `hf`'s forward on `tokens`: what a test
    reads off transformers' own modules to compare with probe's hook points."""
    seen = {}
    handles = [module.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, (i, o)))
               for name, module in modules.items()]
    try:
        with torch.no_grad():
            hf(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return seen
