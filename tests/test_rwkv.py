"""RWKV-4 (probe/rwkv.py, probe/checkpoint_rwkv.py). The logits and every residual of each case are compared with
transformers in test_variants.py (CASES) with saving; here: the WKV recurrence against transformers' CPU path
(rwkv_linear_attention_cpu) where its exponents overflow float32 without the running maximum, and against the formula
in float64; each mixer against transformers' own module, whole and a few tokens at a time through transformers' state;
a time mix narrower than the residual; each point against what transformers' modules see; rescale_every; generation
through the carried state; left padding (which transformers does not mask); TL 4's bridge hook by hook and by its
names; compatibility mode; the report; the ledger; and the analyses that refuse by name or run."""
from __future__ import annotations

import pytest
import torch

from probe import HookedDecoder
from probe.rwkv import empty_wkv_state, wkv_stepwise
from family_checks import (assert_saved_files_read_back, TL_PROCESSING, assert_cached_parts_are_one_forward, cache_of_everything,
                           caches_in_compatibility_mode, report_page, seen_in_forward)
from test_family_defaults import tokenized_checkpoint
from test_variants import CASES, build

TOKENS = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("case", sorted(c for c in CASES if c.startswith("rwkv")))
def test_saving_keeps_every_setting(case, tmp_path):
    """Each test_variants case saved by probe and read back by transformers gives the original's logits, and probe
    reads its own file back to the same config."""
    assert_saved_files_read_back(*CASES[case], tmp_path, TOKENS)


def test_a_narrower_time_mix_is_transformers_and_saves(tmp_path):
    """attention_hidden_size below hidden_size: transformers' cached path sizes its state by hidden_size and fails, so
    it runs without a cache here; probe's logits and residuals are its, and the width survives saving."""
    hf = build("rwkv", tmp_path / "src", attention_hidden_size=24)
    model = HookedDecoder.from_pretrained(tmp_path / "src").eval()
    assert model.cfg.rwkv.d_attention == 24 and model.blocks[0].time_mix.output.in_features == 24
    with torch.no_grad():
        expected = hf(TOKENS, use_cache=False, output_hidden_states=True)
        logits, cache = model.run_with_cache(TOKENS)
        torch.testing.assert_close(logits, expected.logits, atol=1e-4, rtol=0)
        for layer in range(1, 3):
            torch.testing.assert_close(cache[f"blocks.{layer}.hook_resid_pre"], expected.hidden_states[layer - 1],
                                       atol=1e-4, rtol=0)
        again = type(hf).from_pretrained(model.save_pretrained(tmp_path / "saved")).eval()
        torch.testing.assert_close(again(TOKENS, use_cache=False).logits, expected.logits, atol=1e-5, rtol=0)


def test_the_recurrence_is_transformers_cpu_path_and_the_formula():
    """Keys of size 60 put e^k far past float32's range: transformers' running maximum keeps it finite, and so does
    probe's, to the same numbers and state, in one pass or two through the state. With small keys both are the
    formula of the module docstring, summed in float64."""
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    gen = torch.Generator().manual_seed(0)
    decay, bonus = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    k, v = 60 * torch.randn(2, 9, 16, generator=gen), torch.randn(2, 9, 16, generator=gen)
    w = -torch.exp(decay)
    expected, state = rwkv_linear_attention_cpu(decay, bonus, k, v, return_state=True)
    ours, carried = wkv_stepwise(w, bonus, k, v, empty_wkv_state(2, 16))
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(carried, torch.stack(state, dim=1), atol=1e-5, rtol=1e-5)
    first, middle = wkv_stepwise(w, bonus, k[:, :4], v[:, :4], empty_wkv_state(2, 16))
    second, _ = wkv_stepwise(w, bonus, k[:, 4:], v[:, 4:], middle)
    torch.testing.assert_close(torch.cat([first, second], dim=1), expected, atol=1e-5, rtol=1e-5)

    k = k / 60
    ours, _ = wkv_stepwise(w, bonus, k, v, empty_wkv_state(2, 16))
    k, v, w, bonus = k.double(), v.double(), w.double(), bonus.double()
    for t in range(9):
        weights = torch.cat([((t - 1 - torch.arange(t).double())[:, None] * w + k[:, :t]).exp(),
                             (bonus + k[:, t:t + 1]).exp()], dim=1)  # [batch s channel], s <= t
        by_hand = (weights * v[:, :t + 1]).sum(1) / weights.sum(1)
        torch.testing.assert_close(ours[:, t].double(), by_hand, atol=1e-5, rtol=1e-5)


def test_padding_leaves_the_state_as_it_was():
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 6, 8, generator=gen), torch.randn(1, 6, 8, generator=gen)
    w, u = -torch.rand(8, generator=gen), torch.randn(8, generator=gen)
    real = torch.tensor([[False, False, True, True, True, True]])
    padded, state = wkv_stepwise(w, u, k, v, empty_wkv_state(1, 8), real)
    alone, alone_state = wkv_stepwise(w, u, k[:, 2:], v[:, 2:], empty_wkv_state(1, 8))
    torch.testing.assert_close(padded[:, 2:], alone, atol=1e-6, rtol=0)
    torch.testing.assert_close(state, alone_state, atol=1e-6, rtol=0)


def _transformers_state(hf, batch: int) -> list[torch.Tensor]:
    """transformers' recurrent state before any token, as RwkvModel makes it."""
    shape = (batch, hf.config.hidden_size, hf.config.num_hidden_layers)
    state = [torch.zeros(shape) for _ in range(5)]
    state[4] -= 1e30
    return state


def test_the_mixers_are_transformers_modules_whole_and_a_few_tokens_at_a_time(tmp_path):
    """probe's time mix and channel mix against transformers' RwkvSelfAttention and RwkvFeedForward with the same
    weights: a whole sequence, then parts through each one's state (transformers' one-token path reads the shift
    from its state alone, and broadcasts it wrongly beside a batch of more than one: one sequence here); the
    carried WKV state is transformers' numerator, denominator and exponent."""
    hf = build("rwkv", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    time, channel = model.blocks[1].time_mix, model.blocks[1].channel_mix
    their_time, their_channel = hf.rwkv.blocks[1].attention, hf.rwkv.blocks[1].feed_forward
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(time(x)[0], their_time(x)[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(channel(x), their_channel(x)[0], atol=1e-5, rtol=0)
        state, last, wkv = _transformers_state(hf, 1), None, None
        for start, end in ((0, 5), (5, 6), (6, 7), (7, 9)):
            part = x[:1, start:end]
            ours, wkv = time(part, last, wkv)
            torch.testing.assert_close(ours, their_time(part, state=state, use_cache=True)[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(channel(part, last), their_channel(part, state=state)[0], atol=1e-5, rtol=0)
            last = part[:, -1]
    torch.testing.assert_close(wkv, torch.stack([s[:, :, 1] for s in state[2:]], dim=1), atol=1e-5, rtol=1e-5)


def test_every_point_is_what_transformers_modules_see(tmp_path):
    """Each of probe's mixer points against the inputs and outputs of transformers' projections in its own forward;
    the WKV output against transformers' CPU path run on those keys and values."""
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    hf = build("rwkv", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    block = hf.rwkv.blocks[2]
    modules = {f"time.{n}": getattr(block.attention, n) for n in ("key", "value", "receptance", "output")}
    modules.update({f"channel.{n}": getattr(block.feed_forward, n) for n in ("key", "value", "receptance")})
    modules["ln1"] = block.ln1
    seen = seen_in_forward(hf, TOKENS, modules)
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS)
    t, c = "blocks.2.time_mix", "blocks.2.channel_mix"
    pairs = {f"{t}.hook_key_in": seen["time.key"][0][0], f"{t}.hook_k": seen["time.key"][1],
             f"{t}.hook_value_in": seen["time.value"][0][0], f"{t}.hook_v": seen["time.value"][1],
             f"{t}.hook_receptance_in": seen["time.receptance"][0][0], f"{t}.hook_r": seen["time.receptance"][1],
             f"{t}.hook_gated": seen["time.output"][0][0], "blocks.2.hook_attn_out": seen["time.output"][1],
             f"{c}.hook_key_in": seen["channel.key"][0][0], f"{c}.hook_pre": seen["channel.key"][1],
             f"{c}.hook_post": seen["channel.value"][0][0], f"{c}.hook_value": seen["channel.value"][1],
             f"{c}.hook_receptance_in": seen["channel.receptance"][0][0], f"{c}.hook_r": seen["channel.receptance"][1]}
    for name, value in pairs.items():
        torch.testing.assert_close(cache[name], value, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
    wkv, _ = rwkv_linear_attention_cpu(block.attention.time_decay, block.attention.time_first, seen["time.key"][1],
                                       seen["time.value"][1])
    torch.testing.assert_close(cache[f"{t}.hook_wkv"], wkv, atol=1e-5, rtol=0)
    gate = torch.sigmoid(cache[f"{c}.hook_r"]) * cache[f"{c}.hook_value"]
    torch.testing.assert_close(cache["blocks.2.hook_mlp_out"], gate, atol=1e-6, rtol=0)
    # the shift reads the position before: its share of the mix is real
    assert (cache[f"{t}.hook_key_in"] - seen["ln1"][1]).abs().mean() > 0.1


def test_rescaling_changes_transformers_residuals_by_powers_of_two_not_probes(tmp_path):
    """With rescale_every=1 transformers halves its residual stream after every layer in eval mode (and its output
    projections to match): its hidden states are probe's over 2^(layer+1) and its logits probe's, each up to the
    norms' eps (each norm reads a residual 2^l smaller, its eps unscaled: differences near 1e-3 here). In training mode
    (no dropout in RWKV) it rescales nothing, and is probe's to 1e-4; probe's weights stay the file's."""
    hf = build("rwkv", tmp_path, rescale_every=1)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        rescaled = hf(TOKENS, output_hidden_states=True)
        assert hf.rwkv.layers_are_rescaled
        logits, cache = model.run_with_cache(TOKENS)
        as_trained = hf.train()(TOKENS, output_hidden_states=True, use_cache=False)
    assert not hf.rwkv.layers_are_rescaled
    torch.testing.assert_close(logits, as_trained.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, rescaled.logits, atol=5e-3, rtol=0)
    for layer in range(1, 3):
        ours = cache[f"blocks.{layer}.hook_resid_pre"]
        torch.testing.assert_close(ours, as_trained.hidden_states[layer - 1], atol=1e-4, rtol=0)
        torch.testing.assert_close(ours, rescaled.hidden_states[layer - 1] * 2 ** layer, atol=5e-3, rtol=0)
    torch.testing.assert_close(model.blocks[2].time_mix.output.weight, hf.rwkv.blocks[2].attention.output.weight)


def test_generation_processing_and_cached_parts_are_transformers(tmp_path):
    """Greedy generation through the carried shifts and WKV state is transformers'; processing skips fold_ln, which a
    shift's zero before the first token does not allow, and keeps the log-probs; a prompt in parts is one pass."""
    hf = build("rwkv", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    prompts = torch.randint(4, 101, (2, 6), generator=torch.Generator().manual_seed(1))
    assert_generation_matches_row_by_row(hf, model, prompts)
    with pytest.warns(UserWarning, match="skipping fold_ln"):
        processed = HookedDecoder.from_pretrained(tmp_path, **TL_PROCESSING).eval()
    with torch.no_grad():
        torch.testing.assert_close(processed(TOKENS).log_softmax(-1), hf(TOKENS).logits.log_softmax(-1), atol=1e-4,
                                   rtol=0)
    whole = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(6))
    cache, _ = assert_cached_parts_are_one_forward(model, whole)
    assert cache.layers[0].conv_window.shape == (2, 2, 32) and cache.layers[2].state.shape == (2, 3, 32)
    assert cache.layers[0].k is None and model.ledger().kv_bytes_per_token == 0


def assert_generation_matches_row_by_row(hf, model, ids, mask=None, starts=(0, 0)) -> None:
    """probe's greedy continuation of a batch of prompts (`mask` their padding) is transformers' of each prompt alone
    from `starts` (its first real token): transformers' cached step broadcasts its shift state wrongly across a
    batch of more than one, so its batched generation is not each row's."""
    hf.generation_config.eos_token_id = None  # (probe's tokenizer-less model has no end token either)
    with torch.no_grad():
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, verbose=False)
        for row, start in enumerate(starts):
            theirs = hf.generate(ids[row:row + 1, start:], max_new_tokens=6, do_sample=False, pad_token_id=0)
            assert torch.equal(ours[row, start:], theirs[0]), row


def test_left_padding_is_inert_where_transformers_reads_no_mask(tmp_path):
    """transformers' RWKV ignores the attention mask (it warns), so a left-padded row reads its padding as tokens;
    probe zeroes the padding's mixer inputs and keeps the WKV state through it, so the row computes what it computes
    alone, which is transformers' on the row alone, in one pass and through generation."""
    hf = build("rwkv", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    ids = torch.randint(4, 101, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        padded = model(ids, attention_mask=mask)
        torch.testing.assert_close(padded[1, 4:], hf(ids[1:, 4:]).logits[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(padded[0], hf(ids[:1]).logits[0], atol=1e-4, rtol=0)
        assert not torch.allclose(hf(ids, attention_mask=mask).logits[1, 4:], padded[1, 4:], atol=1e-3)
    assert_generation_matches_row_by_row(hf, model, ids, mask, starts=(0, 4))


def test_every_bridge_point_under_its_name_matches_the_bridge(tmp_path):
    """TL 4's bridge (its RWKV adapter: time_mix and channel_mix over transformers' modules) hook by hook: every
    point it fires, under its own name, is probe's; only its classic names for block 0's input (before pre_ln, which
    transformers runs inside block 0) are probe's embedding before its norm, where probe's are after it."""
    from transformer_lens.model_bridge import TransformerBridge

    directory = tokenized_checkpoint("rwkv", tmp_path / "rwkv")
    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu")
    model = HookedDecoder.boot_transformers(directory).eval()
    tokens = TOKENS % model.cfg.d_vocab
    with torch.no_grad():
        their_logits, theirs = bridge.run_with_cache(tokens)
        our_logits, ours = model.run_with_cache(tokens, names=list(theirs))
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    before_norm = {"hook_embed", "blocks.0.hook_resid_pre"}
    for name in set(theirs) - before_norm:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
    for name in before_norm:
        torch.testing.assert_close(theirs[name], ours["blocks.0.pre_ln.hook_in"], atol=1e-6, rtol=0)
        assert not torch.allclose(ours[name], theirs[name], atol=1e-2)
    assert {"blocks.1.time_mix.key.hook_out", "blocks.1.time_mix.output.hook_in", "blocks.2.channel_mix.out.hook_in",
            "blocks.2.channel_mix.receptance.hook_out", "blocks.0.pre_ln.hook_out", "blocks.2.hook_out"} <= set(theirs)
    zero = lambda value, hook: torch.zeros_like(value)  # noqa: E731
    with torch.no_grad():  # an edit at a bridge name reaches what it reaches on the bridge
        for name in ("blocks.0.hook_in", "blocks.0.pre_ln.hook_out", "blocks.1.time_mix.key.hook_in",
                     "blocks.1.time_mix.receptance.hook_out", "blocks.1.time_mix.output.hook_in",
                     "blocks.2.channel_mix.in.hook_in", "blocks.2.channel_mix.out.hook_in",
                     "blocks.2.channel_mix.receptance.hook_in"):
            edited = model.run_with_hooks(tokens, fwd_hooks=[(name, zero)])
            torch.testing.assert_close(edited, bridge.run_with_hooks(tokens, fwd_hooks=[(name, zero)]), atol=1e-4,
                                       rtol=0, msg=lambda m: f"{name}: {m}")
            assert not torch.allclose(edited, our_logits, atol=1e-3), name


def test_compatibility_mode_centres_the_embedding_as_the_bridge_and_the_report_runs(tmp_path):
    """The bridge's RWKV adapter folds no norm and centres the embedding alone (and the unembedding): probe skips
    fold_ln, saying so, and gives the bridge's activations; `probe report` runs and says why its head sections are
    not run."""
    directory = tokenized_checkpoint("rwkv", tmp_path / "rwkv")
    model, ours, our_cache, theirs, their_cache = caches_in_compatibility_mode(directory, TOKENS)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    for ours_name, theirs_name in (("blocks.0.ln1.hook_out", "blocks.0.ln1.hook_out"),
                                   ("blocks.1.hook_attn_out", "blocks.1.hook_time_mix_out"),
                                   ("blocks.1.hook_mlp_out", "blocks.1.hook_channel_mix_out"),
                                   ("blocks.1.hook_resid_mid", "blocks.1.hook_resid_mid"),
                                   ("blocks.2.hook_resid_post", "blocks.2.hook_resid_post"),
                                   ("ln_final.hook_out", "ln_final.hook_out")):
        torch.testing.assert_close(our_cache[ours_name], their_cache[theirs_name], atol=1e-4, rtol=0, msg=ours_name)
    torch.testing.assert_close(our_cache["embed.ln.hook_in"], their_cache["embed.hook_out"], atol=1e-6, rtol=0)
    assert model.W_E.mean(-1).abs().max() < 1e-6
    page = report_page(directory, tmp_path / "out")
    assert ("Not run: head ablation reads every layer&#x27;s attention heads, and layers [0, 1, 2] of this hybrid "
            "model are RWKV time-mix layers") in page
    assert (tmp_path / "out" / "patching.csv").exists()


def test_bfloat16_keeps_the_decay_rates_in_float32_as_transformers(tmp_path):
    """In a bfloat16 model the time mix's time_decay and time_first stay float32, as transformers keeps them in a
    float16 one (_keep_in_fp32_modules; transformers 5 rounds them in bfloat16), through a move and back; the logits
    are transformers' float32 model's to bfloat16's rounding."""
    hf = build("rwkv", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    time = model.blocks[0].time_mix
    exact = hf.rwkv.blocks[0].attention.time_decay
    assert time.time_decay.dtype == time.time_first.dtype == torch.float32 and time.key.weight.dtype == torch.bfloat16
    assert torch.equal(time.time_decay, exact)
    assert torch.equal(model.to(torch.float16).blocks[0].time_mix.time_decay, exact)
    model.to(torch.bfloat16)
    with torch.no_grad():
        ours, theirs = model(TOKENS).float(), hf(TOKENS).logits
    torch.testing.assert_close(ours, theirs, atol=0.05 * theirs.abs().max().item(), rtol=0)


def test_the_model_on_the_device_is_transformers_there(tmp_path, device_under_test):
    """On the GPU (the GPU list): a prompt's logits, and a greedy continuation of one prompt through the carried
    state, against transformers' model on the same device (its CPU recurrence there: the CUDA kernel is a download)."""
    hf = build("rwkv", tmp_path).to(device_under_test)
    model = HookedDecoder.from_pretrained(tmp_path, device=device_under_test).eval()
    tokens = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(5)).to(device_under_test)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=0)
    assert_generation_matches_row_by_row(hf, model, tokens[:, :9], starts=(0, 0))


@pytest.mark.parametrize("overrides", [{}, {"attention_hidden_size": 24, "tie_word_embeddings": True}])
def test_the_ledger_counts_what_transformers_holds(overrides, tmp_path):
    hf = build("rwkv", tmp_path, **overrides)
    model = HookedDecoder.from_pretrained(tmp_path)
    book = model.ledger()
    assert book.total_params == sum(p.numel() for p in model.parameters()) == hf.num_parameters()
    assert book.kv_bytes_per_token == 0  # a state of one size whatever the length


def test_analyses_of_heads_refuse_and_analyses_of_layers_run(tmp_path):
    """Head analyses name the RWKV layers; the blocks say where the mixers are; residual decomposition treats each
    mix's write as one component, and direct logit attribution adds up to transformers' logit difference."""
    import probe.analyses as A

    hf = build("rwkv", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    with pytest.raises(ValueError, match=r"layers \[0, 1, 2\] of this hybrid model are RWKV time-mix layers"):
        A.head_scores(model, "induction", n_samples=4)
    with pytest.raises(AttributeError, match="RWKV time-mix layer: it has no attention heads"):
        model.blocks[0].attn
    with pytest.raises(AttributeError, match="channel mix"):
        model.blocks[0].mlp
    dla = A.direct_logit_attribution(model, TOKENS, torch.tensor([5, 5]), torch.tensor([9, 9]))
    with torch.no_grad():
        logits = hf(TOKENS).logits[:, -1]
    torch.testing.assert_close(dla.total, logits[:, 5] - logits[:, 9], atol=1e-4, rtol=0)
    assert {"L0 time_mix", "L0 mlp", "L2 time_mix", "L2 mlp"} <= set(dla.to_frame()["component"])


def test_hook_shapes_predict_the_mixers_points(tmp_path):
    build("rwkv", tmp_path, attention_hidden_size=24)
    _, _, cache, predicted = cache_of_everything(tmp_path)
    assert {name: tuple(value.shape) for name, value in cache.items()} == {name: predicted[name] for name in cache}
    assert cache["blocks.2.time_mix.hook_wkv"].shape[-1] == 24


def test_config_errors_name_the_fix(tmp_path):
    import json

    from probe import DecoderConfig
    from probe.config_file import CheckpointError

    base = dict(n_layers=2, d_model=32, n_heads=1, d_vocab=50, n_ctx=16, embed_norm=True, mlp_bias=False)
    with pytest.raises(ValueError, match="settings differ: norm, gated_mlp"):
        DecoderConfig(**base, norm="rms", gated_mlp=True, rwkv={"d_attention": 32})
    with pytest.raises(ValueError, match="settings differ: embed_norm"):
        DecoderConfig(**{**base, "embed_norm": False}, rwkv={"d_attention": 32})
    with pytest.raises(ValueError, match="positive int"):
        DecoderConfig(**base, rwkv={"d_attention": 0})
    build("rwkv", tmp_path, layer_norm_epsilon=1e-6)
    with pytest.raises(CheckpointError, match="eps 1e-05 whatever this says"):
        HookedDecoder.from_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["layer_norm_epsilon"] == 1e-6


def test_weight_stacks_say_why_they_are_not_there(tmp_path):
    """model.W_Q and model.W_in name what RWKV's layers hold instead of a bare missing attribute."""
    build("rwkv", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model.W_Q: this model's RWKV time-mix layers have no attention heads.*no "
                                         r"attention layer"):
        model.W_Q
    with pytest.raises(ValueError, match="model.W_in: this model's MLPs are RWKV channel mixes"):
        model.W_in

