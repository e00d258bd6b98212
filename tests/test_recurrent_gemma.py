"""RecurrentGemma (probe/rg_lru.py, probe/checkpoint_recurrent_gemma.py). The logits and every residual of each case are
compared with transformers in test_variants.py (CASES) with saving; here: Griffin's recurrent block against
transformers' own RecurrentGemmaRecurrentBlock and RecurrentGemmaRglru (whole, with a restart inside the sequence, and
one token at a time through each one's cache), each of probe's mixer points against what transformers' modules see,
the bfloat16-rounded embedding scale, generation through the carried state and past the attention window, left
padding as transformers' generation pads, TL 4's bridge hook by hook, the ledger, the report and the refusals."""
from __future__ import annotations

import math

import pytest
import torch

from probe import DecoderConfig, HookedDecoder
from probe.config_rg_lru import RGLRU, bfloat16_rounded
from probe.kv_cache import KVCache
from family_checks import (assert_saved_files_read_back, assert_cached_parts_are_one_forward, assert_generation_and_processing_match,
                           assert_on_the_device_as_transformers, cache_of_everything, report_page, seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import CASES, build

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("case", sorted(c for c in CASES if c.startswith("recurrent-gemma")))
def test_saving_keeps_every_setting(case, tmp_path):
    """Each test_variants case saved by probe and read back by transformers (the layer cycle, LRU width, kernel,
    rotary fraction, biases as the case sets them) gives the original's logits, and probe reads its own file back to
    the same config."""
    assert_saved_files_read_back(*CASES[case], tmp_path, TOKENS)


def test_the_block_is_transformers_whole_restarted_and_one_token_at_a_time(tmp_path):
    """probe's recurrent block and RG-LRU against transformers' modules with the same weights: a whole sequence; one
    whose state restarts at position 0 half way (a second document); then a prefix and single tokens through each
    one's cache (transformers' one-token path is its own, the convolution as a sum over its carried window), the
    carried state and window transformers' own."""
    hf = build("recurrent_gemma", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    theirs, ours = hf.model.layers[0].temporal_block, model.blocks[0].recurrent
    x = torch.randn(2, 9, 48, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(9).expand(2, 9)
    restarted = torch.cat([torch.arange(5), torch.arange(4)]).expand(2, 9)
    with torch.no_grad():
        for where in (positions, restarted):
            expected, _ = theirs(x, position_ids=where, attention_mask=None, use_cache=False)
            torch.testing.assert_close(ours(x, where), expected, atol=1e-5, rtol=0)
            theirs.rg_lru.recurrent_states = None
            torch.testing.assert_close(ours.rg_lru(x, where == 0)[0], theirs.rg_lru(x, where), atol=1e-5, rtol=0)
        assert not torch.allclose(ours(x, restarted)[:, 5:], ours(x, positions)[:, 5:], atol=1e-3)
        theirs._setup_cache(2, x.device, x.dtype)
        past = KVCache(1, batch_size=2).layers[0]
        for start, end in ((0, 5), (5, 6), (6, 7), (7, 8), (8, 9)):
            expected, _ = theirs(x[:, start:end], position_ids=positions[:, start:end], attention_mask=None,
                                 use_cache=True)
            torch.testing.assert_close(ours(x[:, start:end], positions[:, start:end], past), expected, atol=1e-5,
                                       rtol=0)
    assert past.seen == 9 and past.state.dtype == torch.float32
    torch.testing.assert_close(past.state, theirs.rg_lru.recurrent_states, atol=1e-6, rtol=0)
    torch.testing.assert_close(past.conv_window, theirs.conv1d_state.mT, atol=1e-6, rtol=0)


def test_every_mixer_point_is_what_transformers_modules_see(tmp_path):
    """Logits and residuals, and each of probe's recurrent-block points against transformers' modules' inputs and
    outputs in the same forward: the two branches, the convolution, the RG-LRU's output, linear_out's input and the
    block's write."""
    hf = build("recurrent_gemma", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (2, 20), generator=torch.Generator().manual_seed(1))
    block = hf.model.layers[1].temporal_block
    seen = seen_in_forward(hf, tokens, {"linear_x": block.linear_x, "linear_y": block.linear_y, "conv": block.conv_1d,
                                        "rg_lru": block.rg_lru, "linear_out": block.linear_out, "block": block})
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    r = "blocks.1.recurrent"
    pairs = {f"{r}.hook_x": seen["linear_x"][1], f"{r}.hook_y": block.act_fn(seen["linear_y"][1]),
             f"{r}.hook_conv_out": seen["conv"][1][..., :20].mT, f"{r}.rg_lru.hook_state": seen["rg_lru"][1],
             f"{r}.hook_gated": seen["linear_out"][0][0], "blocks.1.hook_attn_out": seen["block"][1][0]}
    for name, expected in pairs.items():
        torch.testing.assert_close(cache[name], expected, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
    # the state remembers: it is not its own input
    assert (cache[f"{r}.rg_lru.hook_state"] - cache[f"{r}.rg_lru.hook_scan_in"]).abs().max() > 1e-2


def test_in_bfloat16_the_recurrent_block_rounds_as_transformers(tmp_path):
    """From a bfloat16 file, in bfloat16: the branches, the convolution, the RG-LRU's gates (one baddbmm per block,
    the bias inside), its float32 scan and the gated product are transformers' bit for bit. (linear_out's output
    is not: transformers multiplies a transposed layout, which bfloat16 sums in another order.)"""
    hf = build("recurrent_gemma", tmp_path / "f32")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    hf = type(hf).from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16).eval()
    model = HookedDecoder.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16).eval()
    block = hf.model.layers[0].temporal_block  # (the first: later layers read that difference in the residual)
    seen = seen_in_forward(hf, TOKENS, {"linear_x": block.linear_x, "conv": block.conv_1d, "rg_lru": block.rg_lru,
                                        "linear_out": block.linear_out})
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS)
    r = "blocks.0.recurrent"
    pairs = {f"{r}.hook_x": seen["linear_x"][1], f"{r}.hook_conv_out": seen["conv"][1][..., :13].mT,
             f"{r}.rg_lru.hook_state": seen["rg_lru"][1], f"{r}.hook_gated": seen["linear_out"][0][0]}
    for name, expected in pairs.items():
        assert cache[name].dtype == torch.bfloat16 and torch.equal(cache[name], expected), name


def test_the_embedding_scale_is_rounded_to_bfloat16_as_transformers_buffer(tmp_path):
    """sqrt(48) = 6.928... multiplies the embeddings as bfloat16 holds it, 6.9375 (transformers' normalizer buffer), in
    a float32 model; sqrt(2560), the 2B model's, as 50.5."""
    build("recurrent_gemma", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS, names=["hook_embed"])
    assert model.embed.scale == 6.9375 == bfloat16_rounded(math.sqrt(48)) != math.sqrt(48)
    assert bfloat16_rounded(math.sqrt(2560)) == 50.5 == torch.tensor(math.sqrt(2560), dtype=torch.bfloat16).item()
    torch.testing.assert_close(cache["hook_embed"], model.embed.W_E[TOKENS] * 6.9375, atol=0, rtol=0)


def test_generation_carries_the_state_past_the_attention_window(tmp_path):
    """Greedy generation (6 + 8 tokens, past the 5-token window) is transformers', and so are the processed model's
    log-probs; a prompt, then two tokens, then the rest through one cache are one forward."""
    hf = build("recurrent_gemma", tmp_path)
    assert_generation_and_processing_match(hf, tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    cache, _ = assert_cached_parts_are_one_forward(model, torch.randint(0, 101, (2, 16),
                                                                        generator=torch.Generator().manual_seed(6)))
    assert cache.layers[0].state.shape == (2, 48) and cache.layers[0].conv_window.shape == (2, 3, 48)


@pytest.mark.parametrize("kernel", [4, 1])
def test_left_padding_is_transformers_generation_padding(kernel, tmp_path):
    """A left-padded batch is transformers' given the positions its generate gives (padding at 0, so the state
    restarts at the first real token), and generated together it is transformers' generation; transformers lets the
    padding's projections into the convolution's window, and so does probe: with a one-position kernel the padded
    prompt is the prompt alone."""
    hf = build("recurrent_gemma", tmp_path, conv1d_width=kernel)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    ids = torch.randint(4, 101, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        padded, alone = model(ids, attention_mask=mask), model(ids[1:, 4:])
        theirs = hf(ids, attention_mask=mask, position_ids=positions).logits
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, verbose=False)
        expected = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(padded[0], theirs[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(padded[1, 4:], theirs[1, 4:], atol=1e-4, rtol=0)
    assert torch.equal(generated, expected)
    assert torch.allclose(padded[1, 4:], alone[0], atol=1e-5) == (kernel == 1)


def test_every_bridge_point_matches_the_bridge(tmp_path):
    """TL 4's bridge wraps each layer whole (its RecurrentGemmaBlockBridge: the residual before and after a layer),
    with the embedding, final norm and unembedding: every point it fires is probe's under the same name, but its
    embedding's (embed.hook_out and the bridge's alias hook_embed), which is the table's row before transformers'
    sqrt(d_model) scale: probe's hook_embed is the scaled one, as classic transformer-lens's for Gemma."""
    from transformer_lens.model_bridge import TransformerBridge

    from probe.hooks import UnknownNameError

    directory = tokenized_checkpoint("recurrent_gemma", tmp_path / "rg")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(directory).eval()
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, ours = model.run_with_cache(tokens, names=lambda n: n in theirs)
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    compared = set()
    for name, value in theirs.items():
        if name in ("embed.hook_out", "hook_embed"):
            torch.testing.assert_close(value, model.embed.W_E[tokens], atol=0, rtol=0)
            continue
        torch.testing.assert_close(ours[name], value, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
        compared.add(name.split(".", 2)[-1] if name.startswith("blocks.") else name)
    assert {"hook_in", "hook_out", "hook_resid_pre", "hook_resid_post", "ln_final.hook_out"} <= compared
    with pytest.raises(UnknownNameError, match="before RecurrentGemma's sqrt"):
        model.hook_point("embed.hook_out")


def test_compatibility_mode_is_the_bridges(tmp_path):
    """enable_compatibility_mode() on both: probe folds the norms into the recurrent blocks' two branches, attention
    and the MLPs (transformer-lens skips centring before RMSNorm, and the unembedding's before a soft cap), and every
    point the bridge fires but its unscaled embedding is probe's."""
    from transformer_lens.model_bridge import TransformerBridge

    directory = tokenized_checkpoint("recurrent_gemma", tmp_path / "rg")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(str(directory))
    with pytest.warns(UserWarning, match="skipping center_writing_weights"):
        model.enable_compatibility_mode()
    bridge.enable_compatibility_mode()
    assert bool((model.blocks[0].ln1.w == 1).all()) and bool((model.blocks[0].recurrent.linear_x.weight != 0).any())
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        our_logits, ours = model.run_with_cache(tokens)
        their_logits, theirs = bridge.run_with_cache(tokens)
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    names = [n for n in theirs if n not in ("embed.hook_out", "hook_embed")]
    assert len(names) > 3 * 4
    for name in names:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")


def test_the_ledger_counts_what_transformers_holds(tmp_path):
    hf = build("recurrent_gemma", tmp_path, lru_width=64, num_key_value_heads=2, attention_bias=True)
    model = HookedDecoder.from_pretrained(tmp_path)
    book = model.ledger()
    assert book.total_params == sum(p.numel() for p in model.parameters()) == hf.num_parameters()


def test_the_report_runs_and_says_why_head_analyses_do_not(tmp_path):
    directory = tokenized_checkpoint("recurrent_gemma", tmp_path / "rg")
    page = report_page(directory, tmp_path / "out")
    assert ("Not run: head ablation reads every layer&#x27;s attention heads, and layers [0, 1] of this hybrid model "
            "are recurrent (Griffin RG-LRU) layers") in page
    assert (tmp_path / "out" / "patching.csv").exists()


def test_every_cached_point_has_its_predicted_shape_and_heads_refuse_by_name(tmp_path):
    from probe.analyses.architecture import require_attention_heads

    build("recurrent_gemma", tmp_path)
    model, _, cache, shapes = cache_of_everything(tmp_path)
    assert {name: tuple(value.shape) for name, value in cache.items()} == {n: shapes[n] for n in cache}
    assert "blocks.0.recurrent.rg_lru.hook_a" in cache and "blocks.2.attn.hook_pattern" in cache
    with pytest.raises(ValueError, match=r"recurrent \(Griffin RG-LRU\) layers have no attention heads"):
        model.W_Q
    with pytest.raises(ValueError, match=r"layers \[0, 1\] of this hybrid model are recurrent \(Griffin RG-LRU\)"):
        require_attention_heads(model, "head ablation")
    with pytest.raises(AttributeError, match="recurrent \\(Griffin RG-LRU\\) layer: it has no attention heads"):
        model.blocks[0].attn


def test_analyses_of_heads_refuse_and_analyses_of_layers_run(tmp_path):
    """Head analyses name the recurrent layers; direct logit attribution makes each recurrent block's write one
    component, `L{l} recurrent`, and adds up to transformers' logit difference (a cap too high to bend it: the
    attribution is of the logits before the cap)."""
    import probe.analyses as A

    hf = build("recurrent_gemma", tmp_path, logits_soft_cap=1e4)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with pytest.raises(ValueError, match=r"layers \[0, 1\] of this hybrid model are recurrent \(Griffin RG-LRU\)"):
        A.head_scores(model, "induction", n_samples=4)
    dla = A.direct_logit_attribution(model, TOKENS, torch.tensor([5, 5]), torch.tensor([9, 9]))
    with torch.no_grad():
        logits = hf(TOKENS).logits[:, -1]
    torch.testing.assert_close(dla.total, logits[:, 5] - logits[:, 9], atol=1e-4, rtol=0)
    assert {"L0 recurrent", "L1 recurrent", "L2H0"} <= set(dla.to_frame()["component"])


def test_the_config_refuses_what_the_block_is_not_built_with():
    base = dict(n_layers=3, d_model=48, n_heads=4, d_vocab=11, n_ctx=8, positions="rotary", gated_mlp=True)
    with pytest.raises(ValueError, match="must be a multiple of n_blocks=5"):
        RGLRU(layers=(True, False, True), width=48, n_blocks=5)
    with pytest.raises(ValueError, match="gives 2 layers; the model has n_layers=3"):
        DecoderConfig(**base, rg_lru={"layers": (True, False), "width": 48, "n_blocks": 4})
    with pytest.raises(ValueError, match="these settings differ: short_conv"):
        DecoderConfig(**base, rg_lru={"layers": (True, False, True), "width": 48, "n_blocks": 4},
                      short_conv={"layers": (True, False, True)})
    cfg = DecoderConfig(**base, rg_lru={"layers": (True, False, True), "width": 48, "n_blocks": 4})
    assert cfg.rg_lru.block_width == 12 and [cfg.layer_is_linear(l) for l in range(3)] == [True, False, True]


def test_the_hybrid_on_the_device_is_transformers_there(tmp_path, device_under_test):
    """On the GPU (the GPU list): a 40-token prompt's logits (the window passed eight times) and its greedy
    continuation through the carried state and window, against transformers' model on the same device."""
    hf = build("recurrent_gemma", tmp_path)
    assert_on_the_device_as_transformers(hf, tmp_path, device_under_test, 40)
