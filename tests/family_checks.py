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


def caches_in_compatibility_mode(directory, tokens: torch.Tensor) -> tuple:
    """(the model, our logits, our cache, the bridge's logits, its cache) after `enable_compatibility_mode()` on both,
    probe's warning that it skips fold_ln as the bridge's adapter does checked on the way."""
    import pytest
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(str(directory))
    with pytest.warns(UserWarning, match="skipping fold_ln, which transformer-lens 4's bridge does not apply"):
        model.enable_compatibility_mode()
    bridge.enable_compatibility_mode()
    tokens = tokens % model.cfg.d_vocab
    with torch.no_grad():
        return (model, *model.run_with_cache(tokens), *bridge.run_with_cache(tokens))


def report_page(directory, out) -> str:
    """`probe report` on a checkpoint with a corrupted prompt beside its prompt: the page's HTML (files in `out`)."""
    from probe.cli.cli import main

    assert main(["report", "--model", str(directory), "--out", str(out), "--prompt", "a b c a b",
                 "--corrupted", "a b a a b", "--quiet"]) in (0, None)
    return (out / "report.html").read_text()


def assert_on_the_device_as_transformers(hf, directory, device, n_pos: int) -> None:
    """On `device`: the logits of a prompt of `n_pos` tokens and a greedy continuation through the cache, against
    transformers' model on the same device."""
    hf = hf.to(device)
    hf.generation_config.eos_token_id = None
    model = HookedDecoder.from_pretrained(directory, device=device).eval()
    tokens = torch.randint(0, 101, (2, n_pos), generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=0)
        prompt = tokens[:, :9]
        expected = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False, verbose=False), expected)


def assert_cached_parts_are_one_forward(model, tokens: torch.Tensor):
    """A prompt, then two tokens, then the rest, through one cache, give the whole sequence's logits in one pass; a
    frozen cache of the prompt reads it twice without keeping more. Returns (the cache, the frozen one), for a test's
    own checks of what they hold."""
    from probe.kv_cache import KVCache

    with torch.no_grad():
        whole = model(tokens)
        cache = KVCache.init_cache(model.cfg, batch_size=tokens.shape[0])
        parts = [model(tokens[:, :10], past_kv_cache=cache), model(tokens[:, 10:12], past_kv_cache=cache),
                 model(tokens[:, 12:], past_kv_cache=cache)]
        torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=0)
        prefix = KVCache.init_cache(model.cfg, batch_size=tokens.shape[0])
        model(tokens[:, :10], past_kv_cache=prefix)
        prefix.freeze()
        for _ in range(2):  # the same continuation twice: the frozen cache is read, never advanced
            torch.testing.assert_close(model(tokens[:, 10:], past_kv_cache=prefix), whole[:, 10:], atol=1e-5, rtol=0)
    assert cache.length == tokens.shape[1] and prefix.length == 10
    return cache, prefix


def left_padded_logits(model, hf, vocab: int = 101) -> tuple:
    """(probe's logits on two 9-token prompts, the second left-padded by 4; its logits on that prompt alone;
    transformers' logits on the same padded batch): what a padding test of a recurrent layer compares."""
    ids = torch.randint(4, vocab, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        return model(ids, attention_mask=mask), model(ids[1:, 4:]), hf(ids, attention_mask=mask).logits


def assert_left_padded_generation_matches(hf, directory, vocab: int = 101) -> None:
    """Two prompts, one left-padded, generated together through the cache: each continuation is transformers' (given
    the same mask), and the padded one is its prompt's alone."""
    hf.generation_config.eos_token_id = None  # (probe's tokenizer-less model has no end token either)
    model = HookedDecoder.from_pretrained(directory).eval()
    ids = torch.randint(4, vocab, (2, 7), generator=torch.Generator().manual_seed(1))
    ids[1, :3] = 0
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        alone = hf.generate(ids[1:, 3:], max_new_tokens=6, do_sample=False, pad_token_id=0)
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, verbose=False)
    assert torch.equal(ours, theirs) and torch.equal(ours[1, 3:], alone[0])


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


def compared_with_the_delegating_bridge(directory, tokens: torch.Tensor) -> set:
    """Every point TL 4's bridge fires on the checkpoint in `directory`, under its own name, against probe's (the
    families whose adapters delegate attention to transformers: Gemma 4's, AFMoE's). Their hook_attn_scores holds the
    pattern (transformers computes no scores the bridge can hook), so it is compared with probe's hook_pattern; a
    point holding tokens flattened, [batch*pos ...], with probe's flattened. A name probe has no point for must say
    what to hook. Returns the names compared, without their `blocks.L.`."""
    import pytest
    from transformer_lens.model_bridge import TransformerBridge

    from probe.hooks import UnknownNameError

    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(directory).eval()
    tokens = tokens % model.cfg.d_vocab
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, ours = model.run_with_cache(tokens, names=lambda n: n in theirs)
        patterns = model.run_with_cache(tokens, names=lambda n: n.endswith("hook_pattern"))[1]
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    compared = set()
    for name, value in theirs.items():
        if name not in ours:
            with pytest.raises(UnknownNameError, match="hook|probe"):
                model.hook_point(name)
            continue
        if name.endswith("mlp.hook_expert_weights"):  # (the bridge's: the chosen experts' weights; probe's, as TL 3.9's:
            continue  # the scores of every expert, test_moe_routing.py)
        ours_value = patterns[name.replace("hook_attn_scores", "hook_pattern")] if name.endswith(
            "hook_attn_scores") else ours[name]
        if name.endswith("hook_expert_indices"):  # (the bridge's come unsorted)
            ours_value, value = ours_value.sort(-1).values, value.sort(-1).values
        if ours_value.shape != value.shape:
            ours_value = ours_value.flatten(0, 1)
        torch.testing.assert_close(ours_value, value, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
        compared.add(name.split(".", 2)[-1])
    return compared


def runs_with_one_heads_input_swapped(model, tokens: torch.Tensor, point: str, head: int) -> tuple:
    """(plain logits, their cache, logits with each head reading its own inputs, that cache, another prompt's cache,
    the cache with `point`'s (a per-head input's) head `head` replaced by the other prompt's): what a test of heads
    reading their own inputs compares."""
    other = torch.randint(0, 101, tokens.shape, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        plain, base = model.run_with_cache(tokens)
        model.set_use_split_qkv_input(True)
        split, cache = model.run_with_cache(tokens)
        _, theirs = model.run_with_cache(other)

        def swap(x, hook):
            x[:, :, head] = theirs[point][:, :, head]
            return x

        with model.hooks(fwd_hooks=[(point, swap)]):
            _, edited = model.run_with_cache(tokens)
    return plain, base, split, cache, theirs, edited


def assert_saved_files_read_back(kind: str, overrides: dict, tmp_path, tokens: torch.Tensor) -> tuple:
    """A test_variants case saved by probe and read back by transformers gives the original's logits, and probe reads
    its own file back to the same config; (transformers' original, probe's model)."""
    from test_variants import build

    hf = build(kind, tmp_path / "src", **overrides)
    model = HookedDecoder.from_pretrained(tmp_path / "src")
    out = model.save_pretrained(tmp_path / "saved")
    again = type(hf).from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, atol=1e-5, rtol=0)
    assert HookedDecoder.from_pretrained(out).cfg == model.cfg
    return hf, model

