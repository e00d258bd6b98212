"""probe on an accelerator, in float32 and bfloat16: against transformers on the same device, and
against probe itself on the CPU in float32.

The device is $PROBE_TEST_DEVICE, else CUDA when present; with neither the module is skipped.
`PROBE_TEST_DEVICE=cpu python3 -m pytest tests/test_gpu.py` runs everything on the CPU, which checks
the tests themselves (bfloat16 works there too).

float32 is held to the CPU suite's bars: logits within 1e-4 of transformers, analyses and gradients
within 1e-4 of the CPU's, relative to each result's scale. bfloat16 cannot meet those; its yardstick
is transformers' own bfloat16 forward on the same device (`assert_bf16_as_close_as_transformers`).
"""
from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from probe.analyses import (ablate_heads, attention_patterns, attribution_patch, copying_scores, direct_logit_attribution,
                      head_ablation_effects, head_importance, head_scores, logit_diff_metric, logit_lens,
                      memory_lookup, patch, prune_heads, residual_decomposition, top_triggers, train_tuned_lens,
                      value_tokens)
from probe import DEFAULT_MODEL, HELDOUT_TEXT, HookedDecoder
from probe.kv_cache import KVCache

from conftest import build_hf_checkpoint

DEVICE = os.environ.get("PROBE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
# a mark rather than a module-level skip: the tests are collected and reported skipped, so a run of this
# file alone on a machine without a GPU exits 0 instead of "no tests collected"
pytestmark = pytest.mark.skipif(
    DEVICE is None, reason="needs a GPU (or PROBE_TEST_DEVICE=cpu to check these tests on the CPU)")
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")]
GPT2_SMALL = dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
# checkpoint -> (the fixture giving its directory, positions per row, whether to also run a padded batch);
# GPT-2-small size gets one forward per implementation (the plain causal path), to stay cheap on a CPU
CHECKPOINTS = {
    "tiny": ("tiny_dir", 48, True),
    "bundled": ("bundled_dir", 128, True),
    "gpt2-small-size": ("gpt2_small_dir", 256, False),
    # other families; the windowed ones unpadded: transformers counts padded slots inside a window, probe does not
    "neox": ("neox_dir", 40, True),
    "mistral-window": ("mistral_dir", 40, False),
    "gemma2": ("gemma2_dir", 40, False),
}
PROMPTS = [  # for the bundled model, which was trained on plays in this layout
    "DUKE.\nIf music be the food of love, play on;\nGive me excess of it, that, surfeiting,",
    "ROMEO.\nBut soft, what light through yonder window breaks?",
    "HAMLET.\nTo be, or not to be, that is the question:",
    "KING HENRY.\nOnce more unto the breach, dear friends, once more;",
]


@pytest.fixture(scope="module", autouse=True)
def exact_float32_matmuls():
    """TF32 rounds float32 matmul inputs to 10 mantissa bits (~1e-3 relative error), which would break
    the 1e-4 float32 bars below for reasons that have nothing to do with probe; cuDNN enables it by
    default and other code may have enabled it for matmuls. Off for this module, restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def gpt2_small_dir(tmp_path_factory) -> Path:
    return build_hf_checkpoint(tmp_path_factory.mktemp("gpt2-small-size"), **GPT2_SMALL)


def _family_dir(tmp_path_factory, kind: str) -> Path:
    from test_variants import build

    directory = tmp_path_factory.mktemp(kind)
    build(kind, directory)
    return directory


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory) -> Path:
    return _family_dir(tmp_path_factory, "neox")


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> Path:
    return _family_dir(tmp_path_factory, "mistral")


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory) -> Path:
    return _family_dir(tmp_path_factory, "gemma2")


@pytest.fixture(scope="module")
def bundled_dir() -> Path:
    return Path(DEFAULT_MODEL)


# ---- helpers ----------------------------------------------------------------------------------------
def load_on_device(directory, dtype) -> HookedDecoder:
    model = HookedDecoder.from_pretrained(directory, device=DEVICE, dtype=dtype).eval()
    assert model.device.type == torch.device(DEVICE).type and model.embed.W_E.dtype == dtype
    return model


def on_device(model: HookedDecoder, dtype) -> HookedDecoder:
    """A copy of a CPU model on DEVICE in `dtype`; the session fixtures stay untouched."""
    return copy.deepcopy(model).to(DEVICE, dtype).eval()


def transformers_model(directory, dtype=torch.float32):
    """transformers' model of the checkpoint's family on DEVICE with eager attention: a plain matmul and
    softmax, an oracle that shares no attention kernel with probe's fused path."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").to(DEVICE, dtype).eval()


@torch.no_grad()
def transformers_logits(hf, tokens, mask=None) -> torch.Tensor:
    """transformers' logits in float32; with a mask, positions count real tokens only (as in probe, and
    in transformers' own generate), so left-padded rows match."""
    if mask is None:
        return hf(tokens).logits.float()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return hf(tokens, attention_mask=mask, position_ids=position_ids).logits.float()


def padded_batch(d_vocab: int, n_pos: int, seed: int = 0):
    """Token ids [4 n_pos] and mask on DEVICE: rows 0 and 3 unpadded, row 1 left-padded by a quarter,
    row 2 right-padded by an eighth."""
    tokens = torch.randint(0, d_vocab, (4, n_pos), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(tokens)
    mask[1, : n_pos // 4] = 0
    mask[2, n_pos - n_pos // 8:] = 0
    return tokens.to(DEVICE), mask.to(DEVICE)


def heldout_tokens(model: HookedDecoder, rows: int, n_pos: int) -> torch.Tensor:
    """[rows n_pos] consecutive windows of the bundled held-out text (CPU)."""
    text = Path(HELDOUT_TEXT).read_text(encoding="utf-8")[10_000:40_000]
    ids = torch.tensor(model.tokenizer.encode(text, add_special_tokens=False)[: rows * n_pos])
    return ids.view(rows, n_pos)


def rms(x: torch.Tensor) -> float:
    return float(x.float().pow(2).mean().sqrt())


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten().double(), b.flatten().double()]))[0, 1])


def assert_bf16_as_close_as_transformers(ours, theirs, reference):
    """`ours` and `theirs`: probe's and transformers' bfloat16 logits; `reference`: float32 logits of
    the same positions.

    bfloat16 keeps 8 significant bits, so neither implementation gets within 1e-4 of float32; what can
    be asked is that probe loses no more than transformers does. The measure is the RMS error over
    every logit (the largest of ~1e5 rounding errors is too noisy to compare): probe's may be up to 2x
    transformers' (measured on the CPU: 0.86-1.01x; on CUDA transformers' eager GELU rounds more than
    probe's fused one). It must also stay a rounding error, under 5% of the logits' RMS (measured:
    0.5-1.1%); a wrong mask, position or dtype cast gives an error the size of the logits. Directly
    against each other, the two bfloat16 results may differ by up to 4x transformers' largest error
    (measured: 0.8-1.5x)."""
    ours, theirs, reference = ours.float(), theirs.float(), reference.float()
    our_error, their_error = rms(ours - reference), rms(theirs - reference)
    assert our_error <= 2 * their_error, f"probe bf16 RMS error {our_error:.3g}, transformers bf16 {their_error:.3g}"
    assert our_error <= 0.05 * rms(reference), f"probe bf16 RMS error {our_error:.3g}, logits' RMS {rms(reference):.3g}"
    their_max = float((theirs - reference).abs().max())
    between = float((ours - theirs).abs().max())
    assert between <= 4 * their_max, (
        f"probe and transformers bf16 differ by {between:.3g}; transformers' error {their_max:.3g}")


# ---- (1) logits against transformers ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_logits_match_transformers(checkpoint, dtype, request):
    fixture, n_pos, padded = CHECKPOINTS[checkpoint]
    directory = request.getfixturevalue(fixture)
    ours = load_on_device(directory, dtype)
    if ours.cfg.tied_embeddings:
        assert ours.unembed.weight is ours.embed.W_E  # the tie survives loading onto the device
    hf = transformers_model(directory)
    tokens, mask = padded_batch(ours.cfg.d_vocab, n_pos)
    batches = {"unpadded": (tokens, None)} | ({"padded": (tokens, mask)} if padded else {})
    # padded positions hold meaningless values in both implementations
    real = {name: torch.ones_like(tokens, dtype=torch.bool) if m is None else m.bool()
            for name, (_, m) in batches.items()}
    with torch.no_grad():
        got = {name: ours(ids, attention_mask=m)[real[name]] for name, (ids, m) in batches.items()}
        reference = {name: transformers_logits(hf, ids, m)[real[name]] for name, (ids, m) in batches.items()}
        if dtype == torch.bfloat16:
            hf = transformers_model(directory, dtype)
            theirs = {name: transformers_logits(hf, ids, m)[real[name]] for name, (ids, m) in batches.items()}
    for name in batches:
        if dtype == torch.float32:
            torch.testing.assert_close(got[name], reference[name], atol=1e-4, rtol=0, msg=lambda s: f"{name}: {s}")
        else:
            assert_bf16_as_close_as_transformers(got[name], theirs[name], reference[name])


# ---- (2) the fused attention path against the explicit one ----------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("checkpoint", ["tiny", "bundled"])
def test_fused_attention_equals_explicit_attention(checkpoint, dtype, request):
    fixture, n_pos, _ = CHECKPOINTS[checkpoint]
    directory = request.getfixturevalue(fixture)
    ours = load_on_device(directory, dtype)
    tokens, mask = padded_batch(ours.cfg.d_vocab, n_pos, seed=1)
    if dtype == torch.bfloat16:
        hf, hf_bf16 = transformers_model(directory), transformers_model(directory, dtype)
    seen = []

    def observe(pattern, hook):  # anything attached to hook_pattern makes attention materialise the pattern
        seen.append(hook.name)

    with torch.no_grad():
        for m in (None, mask):
            real = torch.ones_like(tokens, dtype=torch.bool) if m is None else m.bool()
            fused = ours(tokens, attention_mask=m)[real]
            with ours.hooks([(lambda name: name.endswith("attn.hook_pattern"), observe)]):
                explicit = ours(tokens, attention_mask=m)[real]
            assert len(seen) == ours.cfg.n_layers  # the explicit path did run, in every layer
            seen.clear()
            if dtype == torch.float32:
                torch.testing.assert_close(explicit, fused, atol=1e-4, rtol=0)
            else:
                reference = transformers_logits(hf, tokens, m)[real]
                theirs = transformers_logits(hf_bf16, tokens, m)[real]
                assert_bf16_as_close_as_transformers(fused, theirs, reference)
                assert_bf16_as_close_as_transformers(explicit, theirs, reference)


# ---- (3) the activation cache -------------------------------------------------------------------------
def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_on_device_matches_cpu_and_stores_where_asked(dtype, bundled_model):
    n = bundled_model.cfg.n_layers
    names = ([f"blocks.{l}.hook_resid_pre" for l in range(n)] + [f"blocks.{l}.attn.hook_pattern" for l in range(n)]
             + [f"blocks.{l}.mlp.hook_post" for l in range(n)] + ["ln_final.hook_scale"])
    tokens = heldout_tokens(bundled_model, 2, 96)
    with torch.no_grad():
        _, expected = bundled_model.run_with_cache(tokens, names=names)
        model = on_device(bundled_model, dtype)
        _, cache = model.run_with_cache(tokens.to(DEVICE), names=names)
        _, on_cpu = model.run_with_cache(tokens.to(DEVICE), names=names, device="cpu")
        _, as_bf16 = model.run_with_cache(tokens.to(DEVICE), names=names, device="cpu", dtype=torch.bfloat16)
    stores = {"default": (cache, torch.device(DEVICE).type, dtype), "device=cpu": (on_cpu, "cpu", dtype),
              "device=cpu, dtype=bfloat16": (as_bf16, "cpu", torch.bfloat16)}
    for store, (cached, device, stored_dtype) in stores.items():
        assert set(cached) == set(names), store
        for name in names:
            got = cached[name]
            assert got.device.type == device and got.dtype == stored_dtype, f"{store}: {name}"
            got = got.cpu()
            if dtype == torch.float32:
                # stored in bfloat16: rounded to 8 significant bits (at most 2**-8 relative) on top of the
                # device's float32 differences
                rtol = 1e-4 + (2**-8 if stored_dtype == torch.bfloat16 else 0)
                torch.testing.assert_close(got.float(), expected[name], atol=1e-4, rtol=rtol,
                                           msg=lambda s: f"{store}: {name}: {s}")
            else:  # rounding compounds through the layers: measured 0.2-1% relative (L2) on the CPU
                assert relative_error(got, expected[name]) < 0.05, f"{store}: {name}"


# ---- (4) generation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_cache_steps_equal_full_forward(dtype, bundled_dir):
    """Prefill, then one token per pass through the cache: each pass's logits equal the full forward's."""
    ours = load_on_device(bundled_dir, dtype)
    hf = transformers_model(bundled_dir)
    tokens, mask = padded_batch(ours.cfg.d_vocab, 40, seed=2)
    tokens, mask = tokens[:2], mask[:2]  # row 1 is left-padded, as generation pads
    n_prompt = 24
    with torch.no_grad():
        kv_cache = KVCache(ours.cfg.n_layers)
        steps = [ours(tokens[:, :n_prompt], attention_mask=mask[:, :n_prompt], kv_cache=kv_cache)[:, -1]]
        for p in range(n_prompt, tokens.shape[1]):
            steps.append(ours(tokens[:, p: p + 1], kv_cache=kv_cache)[:, -1])
        cached = torch.stack(steps, dim=1)  # [batch step vocab]: positions n_prompt-1 ... end
        full = ours(tokens, attention_mask=mask)[:, n_prompt - 1:]
        reference = transformers_logits(hf, tokens, mask)[:, n_prompt - 1:]
        if dtype == torch.float32:
            torch.testing.assert_close(cached, full, atol=1e-4, rtol=0)
            torch.testing.assert_close(cached, reference, atol=1e-4, rtol=0)
        else:
            theirs = transformers_logits(transformers_model(bundled_dir, dtype), tokens, mask)[:, n_prompt - 1:]
            assert_bf16_as_close_as_transformers(cached, theirs, reference)
            assert_bf16_as_close_as_transformers(full, theirs, reference)


# The bundled model's bfloat16 logits are off by up to ~0.1 (measured: 0.08 on these continuations), so a
# bfloat16 greedy choice can trail float32's best by about that where two tokens nearly tie (its top two
# are often within 0.1 of each other, so exact agreement cannot be asked).
# A stale cache or a wrong position picks tokens that trail by whole units (the logits' std is ~2.3).
BF16_TRAIL = 0.25


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_generation_with_and_without_kv_cache(dtype, bundled_model, bundled_dir):
    """float32: token for token, with the cache, without it, and as transformers' greedy generate.
    bfloat16: every token chosen, with the cache or without, is float32's best or trails it by a
    rounding error only (near ties may flip, after which the continuations differ)."""
    n_new = 24
    tokens, mask = bundled_model.to_tokens(PROMPTS, return_attention_mask=True, padding_side="left")
    tokens, mask = tokens.to(DEVICE), mask.to(DEVICE)
    n_prompt = tokens.shape[1]
    hf = transformers_model(bundled_dir)
    ours = on_device(bundled_model, dtype)
    cached = ours.generate(tokens, n_new, attention_mask=mask)
    uncached = ours.generate(tokens, n_new, attention_mask=mask, use_cache=False)
    assert cached.device.type == torch.device(DEVICE).type and cached.shape == (len(PROMPTS), n_prompt + n_new)
    if dtype == torch.float32:
        hf.generation_config.eos_token_id = None  # plain greedy for n_new tokens, as probe's generate does
        with torch.no_grad():
            expected = hf.generate(tokens, attention_mask=mask, max_new_tokens=n_new, do_sample=False,
                                   pad_token_id=bundled_model.tokenizer.pad_id)
        assert cached.tolist() == expected.tolist()
        assert uncached.tolist() == expected.tolist()
        return
    full_mask = torch.cat([mask, torch.ones(len(PROMPTS), n_new, dtype=mask.dtype, device=DEVICE)], dim=1)
    for name, generated in (("with the KV cache", cached), ("without it", uncached)):
        assert torch.equal(generated[:, :n_prompt], tokens)
        # float32 logits of what each new token was chosen from
        logits = transformers_logits(hf, generated, full_mask)[:, n_prompt - 1: -1]
        chosen = logits.gather(-1, generated[:, n_prompt:, None])[..., 0]
        trail = logits.max(dim=-1).values - chosen  # [batch new]
        assert float(trail.max()) < BF16_TRAIL, f"{name}: a choice trails float32's best by {float(trail.max()):.3f}"


def test_a_model_split_between_the_cpu_and_the_device_computes_what_one_device_does(bundled_model, bundled_dir):
    """device_map: the embedding, head and first half of the blocks on the device, the rest on the CPU (the
    residual goes there and back); float32 logits, a cache and greedy KV-cache generation as on the CPU alone."""
    n = bundled_model.cfg.n_layers
    device_map = {"embed": DEVICE, "head": DEVICE, **{layer: DEVICE if layer < n // 2 else "cpu" for layer in range(n)}}
    split = HookedDecoder.from_pretrained(bundled_dir, device_map=device_map).eval()
    assert split.blocks[0].ln1.w.device.type == torch.device(DEVICE).type and split.blocks[n - 1].ln1.w.device.type == "cpu"
    tokens, mask = bundled_model.to_tokens(PROMPTS, return_attention_mask=True, padding_side="left")
    with torch.no_grad():
        expected, expected_cache = bundled_model.run_with_cache(tokens, attention_mask=mask)
        logits, cache = split.run_with_cache(tokens.to(DEVICE), attention_mask=mask.to(DEVICE))
    torch.testing.assert_close(logits.cpu(), expected, rtol=1e-4, atol=1e-4)
    assert cache[f"blocks.{n - 1}.hook_resid_post"].device.type == "cpu"
    torch.testing.assert_close(cache["blocks.0.hook_resid_post"].cpu(), expected_cache["blocks.0.hook_resid_post"],
                               rtol=1e-4, atol=1e-4)
    generated = split.generate(tokens.to(DEVICE), 12, attention_mask=mask.to(DEVICE))
    assert generated.cpu().tolist() == bundled_model.generate(tokens, 12, attention_mask=mask).tolist()


# ---- (5) analyses ------------------------------------------------------------------------------------
def run_logit_lens(model):
    result = logit_lens(model, PROMPTS)
    real = result.mask.cpu()
    by_position = lambda t: t.float().cpu().movedim(1, 2)[real]  # noqa: E731  [batch layer pos ...] -> [real layer ...]
    return {name: by_position(getattr(result, name)) for name in ("logits", "kl", "target_prob")}


def run_direct_logit_attribution(model):
    result = direct_logit_attribution(model, PROMPTS, answer=[5, 9, 40, 100], counterfactual=17)
    return {"contributions": result.contributions, "actual": result.actual, "accumulated": result.accumulated}


def run_head_ablation_effects(model):
    result = head_ablation_effects(model, PROMPTS)
    return {"per_prompt": result.per_prompt, "baseline": result.baseline}


def patching_prompts(model):
    """Two held-out windows; the corrupted copy swaps their tokens two positions from the end. The metric
    (the text's next token against the token swapped in) moves by ~1.7 under the corruption, far above
    bfloat16's resolution at these logits (~0.016), so the sites' differences survive in bfloat16."""
    window = heldout_tokens(model, 2, 21)
    clean, next_token = window[:, :20], window[:, 20]
    corrupted = clean.clone()
    corrupted[:, 18] = clean[:, 18].flip(0)
    return clean, corrupted, logit_diff_metric(model, next_token.tolist(), corrupted[:, 18].tolist())


def run_patch(model):
    result = patch(model, *patching_prompts(model), sites="heads")
    return {"patched": result.patched, "clean_and_corrupted": torch.tensor([result.clean, result.corrupted])}


def run_attribution_patch(model):
    result = attribution_patch(model, *patching_prompts(model), sites="heads")
    return {"patched": result.patched, "clean_and_corrupted": torch.tensor([result.clean, result.corrupted])}


def run_head_scores(model):
    return {"scores": head_scores(model, "induction", n_samples=4, seq_len=30).scores}


def run_head_importance(model):
    return {"raw": head_importance(model, heldout_tokens(model, 4, 64), batch_size=2, progress=False).raw}


def run_tuned_lens(model):
    """A lens trained (tiny, seeded) and kept on the CPU reads the model's residuals on the device."""
    lens = cpu_tuned_lens(model)
    result = logit_lens(model, PROMPTS, lens=lens)
    real = result.mask.cpu()
    return {"kl": result.kl.float().cpu().movedim(1, 2)[real]}


_LENSES = {}


def cpu_tuned_lens(model):
    if "lens" not in _LENSES:
        cpu_model = copy.deepcopy(model).to("cpu", torch.float32)
        _LENSES["lens"] = train_tuned_lens(cpu_model, steps=3, batch_tokens=256, seed=0)
    return _LENSES["lens"]


def run_residual_decomposition(model):
    result = residual_decomposition(model, PROMPTS)
    return {"components": result.components.float().cpu()[result.mask.cpu()]}  # [real-token component d_model]


def run_attention_patterns(model):
    return {"pattern": attention_patterns(model, PROMPTS[0]).pattern}


def run_ablate_heads_mean_and_resample(model):
    tokens = heldout_tokens(model, 3, 24)
    reference = heldout_tokens(model, 6, 24).flip(0)
    return {method: ablate_heads(model, tokens, [(1, 2), (2, 0)], method=method, reference=reference, seed=3)[:, -1]
            for method in ("mean", "resample")}


def run_memories(model):
    values = value_tokens(model, 2, neurons=list(range(32)), k=5, through_final_norm=True)
    lookup = memory_lookup(model, PROMPTS[0], layer=3, k=8)
    triggers = top_triggers(model, [PROMPTS[1] * 3, PROMPTS[2] * 3], layers=[1], neurons=list(range(64)), k=4,
                            batch_size=2, progress=False)
    return {"value_logits": values.top_logits, "lookup_sizes": lookup.sizes, "lookup_effect": lookup.prediction_effect,
            "trigger_activations": triggers.activations}


def run_copying_scores(model):
    return {"scores": copying_scores(model).scores}


def run_pruned_forward(model):
    pruned = prune_heads(model, [(0, 1), (2, 3), (2, 4), (3, 0)])
    with torch.no_grad():
        return {"logits": pruned(heldout_tokens(model, 2, 32).to(model.device))[:, -4:]}


def run_edge_attribution(model):
    """EAP and EAP-IG over every edge, a circuit's faithfulness and a path patch: the circuit tools on the device."""
    from probe.analyses import edge_attribution, faithfulness, path_patch

    clean, corrupted, metric = patching_prompts(model)
    eap = edge_attribution(model, clean, corrupted, metric)
    ig = edge_attribution(model, clean, corrupted, metric, method="eap-ig-inputs", ig_steps=3)
    circuit = eap.circuit(n_edges=30)  # chosen on each device: equal scores choose the same edges
    kept = faithfulness(model, circuit, clean, corrupted, metric)
    paths = path_patch(model, clean, corrupted, metric, senders=["L0H1"], receivers=["L2H0<k"])
    return {"eap": eap.per_example, "eap_ig": ig.per_example, "faithfulness": kept.circuit_values,
            "path_patch": paths.patched}


def run_attribution_graph(model):
    """The bundled transcoders' attribution graph. In float32 the whole adjacency and each target's value and bias;
    in bfloat16 the features kept can differ (their influence ranking moves) and the error nodes carry bfloat16's
    rounding of the transcoders' reconstructions (their edges correlate ~0.89 with float32's on the CPU), so only the
    two logits' values: that the graph is built on the device at all."""
    from probe.analyses import attribution_graph

    graph = attribution_graph(model, "bundled", PROMPTS[0], max_feature_nodes=64, batch_size=16,
                              logit_targets=[" the", " and"])
    out = {"logit_values": graph.value[-2:]}
    if model.W_U.dtype == torch.float32:
        out.update(adjacency=graph.adjacency, value=graph.value, bias=graph.bias)
    return out


ANALYSES = {
    "logit_lens": run_logit_lens,
    "tuned_lens": run_tuned_lens,
    "direct_logit_attribution": run_direct_logit_attribution,
    "head_ablation_effects": run_head_ablation_effects,
    "patch": run_patch,
    "attribution_patch": run_attribution_patch,
    "head_scores": run_head_scores,
    "head_importance": run_head_importance,
    "residual_decomposition": run_residual_decomposition,
    "attention_patterns": run_attention_patterns,
    "ablate_heads_mean_and_resample": run_ablate_heads_mean_and_resample,
    "memories": run_memories,
    "pruned_forward": run_pruned_forward,
    "copying_scores": run_copying_scores,
    "edge_attribution": run_edge_attribution,
    "attribution_graph": run_attribution_graph,
}


@pytest.fixture(scope="module")
def cpu_results(bundled_model):
    """Each analysis on the CPU in float32, computed once for both dtypes."""
    done = {}

    def get(analysis):
        if analysis not in done:
            done[analysis] = ANALYSES[analysis](bundled_model)
        return done[analysis]

    return get


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("analysis", list(ANALYSES))
def test_analysis_on_device_matches_cpu(analysis, dtype, bundled_model, cpu_results):
    """float32: equal within 1e-4 of each result's scale. bfloat16: finite and correlated (measured on
    the CPU: >= 0.9995), since bfloat16's rounding is not small next to the smaller effects."""
    expected = cpu_results(analysis)
    got = ANALYSES[analysis](on_device(bundled_model, dtype))
    # in bfloat16 an analysis may return only what no ranking that bfloat16 can reorder decides (attribution_graph)
    assert set(got) == set(expected) if dtype == torch.float32 else (got and set(got) <= set(expected))
    for name, value in got.items():
        value, reference = value.detach().float().cpu(), expected[name].float()
        assert value.shape == reference.shape, name
        if dtype == torch.float32:
            scale = max(1.0, float(reference.abs().max()))
            torch.testing.assert_close(value, reference, atol=1e-4 * scale, rtol=0, msg=lambda s: f"{name}: {s}")
        else:
            assert bool(value.isfinite().all()), name
            if value.numel() >= 8:  # a correlation of a handful of values says little
                assert correlation(value, reference) > 0.99, f"{name}: correlation {correlation(value, reference):.3f}"


# ---- (6) gradients ------------------------------------------------------------------------------------
def loss_and_gradients(model, tokens):
    """Next-token loss (float32) and its gradient for every parameter, without touching `.grad`."""
    params = dict(model.named_parameters())
    tokens = tokens.to(model.device)
    logits = model(tokens)[:, :-1].float()
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    return loss.detach(), dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_cpu(dtype, bundled_model):
    """Head importance and pruning differentiate through the model on the device."""
    tokens = heldout_tokens(bundled_model, 2, 64)
    expected_loss, expected = loss_and_gradients(bundled_model, tokens)
    loss, got = loss_and_gradients(on_device(bundled_model, dtype), tokens)
    assert set(got) == set(expected)
    for name, grad in got.items():
        assert grad.device.type == torch.device(DEVICE).type and grad.dtype == dtype, name
    if dtype == torch.float32:
        torch.testing.assert_close(loss.cpu(), expected_loss, atol=1e-5, rtol=0)
        for name, grad in got.items():
            scale = float(expected[name].abs().max())
            torch.testing.assert_close(grad.cpu(), expected[name], atol=1e-4 * scale, rtol=0,
                                       msg=lambda s: f"{name}: {s}")
    else:
        assert abs(float(loss) - float(expected_loss)) < 0.01 * float(expected_loss)
        for name, grad in got.items():
            cosine = float(F.cosine_similarity(grad.float().cpu().flatten(), expected[name].flatten(), dim=0))
            assert cosine > 0.99, f"{name}: cosine {cosine:.3f} with the CPU float32 gradient"


@pytest.mark.parametrize("dtype", DTYPES)
def test_cached_gradients_and_backward_hooks_match_cpu(dtype, bundled_model):
    """run_with_cache(grads_of=...) and a backward hook on the device see the CPU float32 gradients."""
    tokens = heldout_tokens(bundled_model, 2, 64)
    names = ["blocks.1.hook_resid_pre", "blocks.2.attn.hook_pattern", "blocks.3.mlp.hook_post"]

    def score(logits):
        return logits[:, :-1].float().log_softmax(-1).gather(-1, tokens[:, 1:, None].to(logits.device)).mean()

    def gradients(model):
        _, cache = model.run_with_cache(tokens.to(model.device), names=names, grads_of=score)
        seen = {}
        with model.hooks(bwd_hooks=[(names, lambda grad, hook: seen.__setitem__(hook.name, grad.detach()))]):
            torch.autograd.grad(score(model(tokens.to(model.device))), model.embed.W_E)
        return {n: cache[f"{n}_grad"] for n in names}, seen

    (expected, _), (got, seen) = gradients(bundled_model), gradients(on_device(bundled_model, dtype))
    for name in names:
        for found in (got[name], seen[name]):
            assert found.device.type == torch.device(DEVICE).type, name
            found, reference = found.float().cpu(), expected[name]
            if dtype == torch.float32:
                scale = float(reference.abs().max())
                torch.testing.assert_close(found, reference, atol=1e-4 * scale, rtol=0, msg=lambda s: f"{name}: {s}")
            else:
                cosine = float(F.cosine_similarity(found.flatten(), reference.flatten(), dim=0))
                assert cosine > 0.99, f"{name}: cosine {cosine:.3f} with the CPU float32 gradient"


@pytest.mark.parametrize("dtype", DTYPES)
def test_processed_weights_on_the_device_keep_the_log_probs(dtype, bundled_model):
    from probe import process_weights

    tokens = heldout_tokens(bundled_model, 2, 64)
    with torch.no_grad():
        expected = bundled_model(tokens).float().log_softmax(-1)
        got = process_weights(on_device(bundled_model, dtype))(tokens.to(DEVICE)).float().log_softmax(-1).cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    else:  # bfloat16 rounding of weights that were rewritten in float32: the same error as the unprocessed model's
        with torch.no_grad():
            unprocessed = on_device(bundled_model, dtype)(tokens.to(DEVICE)).float().log_softmax(-1).cpu()
        assert (got - expected).abs().mean() < 2 * (unprocessed - expected).abs().mean() + 1e-3
