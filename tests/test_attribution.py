"""Residual decomposition and direct logit attribution, checked against `transformers` and by hand."""
from __future__ import annotations

import pytest
import torch

from hf_oracle import hf_forward_states, hf_head_writes

from probe.analyses.attribution import direct_logit_attribution, residual_decomposition

ATOL = 1e-4


def hf_run(hf, tokens):
    """transformers' logits, every block's attention output, hidden states and the residual entering ln_f."""
    logits, attn_out, hidden, final = hf_forward_states(hf, tokens)
    resid = list(hidden[:-1]) + [final]  # embeddings, after each block (HF's last is after ln_f)
    return logits, attn_out, resid


def test_components_sum_to_final_residual(tiny_model, tiny_hf, tokens):
    result = residual_decomposition(tiny_model, tokens)
    cfg = tiny_model.cfg
    assert result.components.shape == (3, tokens.shape[1], 2 + cfg.n_layers * (cfg.n_heads + 2), cfg.d_model)
    _, attn_out, resid = hf_run(tiny_hf, tokens)
    torch.testing.assert_close(result.total(), resid[-1], atol=ATOL, rtol=0)
    # every layer's heads plus its output bias are that layer's attention output
    names = result.index.names
    for layer in range(cfg.n_layers):
        cols = [i for i, n in enumerate(names) if n.startswith(f"L{layer}H") or n == f"L{layer} attn bias"]
        assert len(cols) == cfg.n_heads + 1
        torch.testing.assert_close(result.components[:, :, cols].sum(2), attn_out[layer], atol=ATOL, rtol=0)
    # and each head column is that head's own write (a sum alone would not see heads swapped)
    for layer, writes in enumerate(hf_head_writes(tiny_hf, tokens)):
        for head in range(cfg.n_heads):
            torch.testing.assert_close(result.components[:, :, names.index(f"L{layer}H{head}")], writes[:, :, head],
                                       atol=ATOL, rtol=0)
    # the embedding rows are rows of the weight matrices
    torch.testing.assert_close(result.components[:, :, 0], tiny_hf.transformer.wte.weight[tokens], atol=0, rtol=0)
    torch.testing.assert_close(result.components[:, :, 1, :], tiny_hf.transformer.wpe.weight[: tokens.shape[1]].expand(3, -1, -1),
                               atol=0, rtol=0)


def test_accumulated_is_the_residual_after_each_layer(tiny_model, tiny_hf, tokens):
    result = residual_decomposition(tiny_model, tokens)
    _, attn_out, resid = hf_run(tiny_hf, tokens)
    accumulated = result.accumulated()
    assert accumulated.shape[1] == tiny_model.cfg.n_layers + 1
    for layer, expected in enumerate(resid):
        torch.testing.assert_close(accumulated[:, layer], expected, atol=ATOL, rtol=0)
    with_mid = result.accumulated(include_mid=True)
    for layer in range(tiny_model.cfg.n_layers):
        torch.testing.assert_close(with_mid[:, 2 * layer + 1], resid[layer] + attn_out[layer], atol=ATOL, rtol=0)


def test_decomposition_frame_and_figure(tiny_model):
    result = residual_decomposition(tiny_model, ["To be, or not", "<b>markup</b> & the fox"])
    frame = result.to_frame()
    n_comp = len(result.index.names)
    assert len(frame) == int(result.mask.sum()) * n_comp
    assert {"prompt", "position", "token", "component", "kind", "layer", "head", "norm"} <= set(frame.columns)
    assert frame[frame.kind != "head"]["head"].isna().all() and frame[frame.kind == "head"]["head"].notna().all()
    row = frame[(frame.prompt == 1) & (frame.position == 2) & (frame.component == "L1H3")].iloc[0]
    h3 = result.index.names.index("L1H3")
    assert row.norm == pytest.approx(float(result.components[1, 2, h3].norm()), rel=1e-5)
    fig = result.figure(prompt=1)
    assert "<b>" not in fig.layout.title.text and list(fig.data[0].x) == result.index.names


def test_dla_adds_up_to_the_logit_difference(tiny_model, tiny_hf, tokens):
    answer, counterfactual = [5, 40, 100], 17
    result = direct_logit_attribution(tiny_model, tokens, answer, counterfactual)
    logits, _, _ = hf_run(tiny_hf, tokens)
    expected = logits[torch.arange(3), -1, answer] - logits[:, -1, counterfactual]
    torch.testing.assert_close(result.actual, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(result.total, expected, atol=ATOL, rtol=0)
    frame = result.to_frame()
    torch.testing.assert_close(torch.tensor(frame.groupby("prompt").contribution.sum().to_numpy()).double(), expected.double(),
                               atol=ATOL, rtol=0)
    plain = direct_logit_attribution(tiny_model, tokens, answer)
    torch.testing.assert_close(plain.total, logits[torch.arange(3), -1, answer], atol=ATOL, rtol=0)


def test_dla_rows_by_hand(tiny_model, tiny_hf, tokens):
    """Each row is its component through the final norm with the actual scale frozen, dotted with the unembedding."""
    position, answer, counterfactual = 6, 33, 90
    result = direct_logit_attribution(tiny_model, tokens, answer, counterfactual, position=position)
    _, attn_out, resid = hf_run(tiny_hf, tokens)
    ln, W_U = tiny_hf.transformer.ln_f, tiny_hf.lm_head.weight
    final = resid[-1][:, position]
    scale = (final.var(-1, unbiased=False, keepdim=True) + ln.eps).sqrt()
    direction = (W_U[answer] - W_U[counterfactual]) * ln.weight

    def through_norm(x):
        return ((x - x.mean(-1, keepdim=True)) / scale) @ direction

    names = result.index.names
    embed = tiny_hf.transformer.wte.weight[tokens[:, position]]
    torch.testing.assert_close(result.contributions[:, names.index("embed")], through_norm(embed), atol=ATOL, rtol=0)
    mlp0 = resid[1][:, position] - resid[0][:, position] - attn_out[0][:, position]
    torch.testing.assert_close(result.contributions[:, names.index("L0 mlp")], through_norm(mlp0), atol=ATOL, rtol=0)
    bias = tiny_hf.transformer.h[1].attn.c_proj.bias.expand(3, -1)
    torch.testing.assert_close(result.contributions[:, names.index("L1 attn bias")], through_norm(bias), atol=ATOL, rtol=0)
    torch.testing.assert_close(result.ln_bias, (ln.bias @ (W_U[answer] - W_U[counterfactual])).expand(3), atol=ATOL, rtol=0)
    assert bool((result.unembed_bias == 0).all())  # GPT-2 has no unembedding bias
    # the heads of a layer add up to its attention output (minus b_O), through the same linear map
    heads = result.head_contributions()
    torch.testing.assert_close(heads[:, 1].sum(-1) + result.contributions[:, names.index("L1 attn bias")],
                               through_norm(attn_out[1][:, position]), atol=ATOL, rtol=0)
    for layer, writes in enumerate(hf_head_writes(tiny_hf, tokens)):  # and one by one, in head order
        for head in range(tiny_model.cfg.n_heads):
            expected = through_norm(writes[:, position, head])
            torch.testing.assert_close(result.contributions[:, names.index(f"L{layer}H{head}")], expected, atol=ATOL, rtol=0)
            torch.testing.assert_close(heads[:, layer, head], expected, atol=ATOL, rtol=0)
    # the accumulated line: the residual after each sublayer, through the same frozen norm
    sites = [resid[0]]
    for layer in range(tiny_model.cfg.n_layers):
        sites += [resid[layer] + attn_out[layer], resid[layer + 1]]
    for i, r in enumerate(sites):
        torch.testing.assert_close(result.accumulated[:, i], through_norm(r[:, position]) + result.ln_bias, atol=ATOL, rtol=0)


def test_dla_padded_batch_uses_each_prompts_last_token(tiny_model, tiny_hf):
    prompts = ["To be, or not to be, that is the question", "The quick brown fox"]
    result = direct_logit_attribution(tiny_model, prompts, " the", " dog")
    a, c = tiny_model.tokenizer.encode(" the", add_special_tokens=False), tiny_model.tokenizer.encode(" dog", add_special_tokens=False)
    assert len(a) == len(c) == 1
    for i, prompt in enumerate(prompts):
        ids = tiny_model.to_tokens(prompt)
        logits, _, _ = hf_run(tiny_hf, ids)
        expected = logits[0, -1, a[0]] - logits[0, -1, c[0]]
        assert int(result.positions[i]) == ids.shape[1] - 1
        assert float(result.total[i]) == pytest.approx(float(expected), abs=ATOL)
    mean = result.to_frame(mean=True)
    assert float(mean.contribution.sum()) == pytest.approx(float(result.actual.mean()), abs=ATOL)


def test_answers_as_strings_or_ids_and_errors(tiny_model, tokens):
    the = tiny_model.tokenizer.encode(" the", add_special_tokens=False)[0]
    by_string = direct_logit_attribution(tiny_model, tokens, " the")
    by_id = direct_logit_attribution(tiny_model, tokens, torch.tensor([the] * 3))
    assert torch.equal(by_string.contributions, by_id.contributions)
    with pytest.raises(ValueError, match="not one"):
        direct_logit_attribution(tiny_model, tokens, " question mark")
    with pytest.raises(ValueError, match="one per prompt"):
        direct_logit_attribution(tiny_model, tokens, [1, 2])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        direct_logit_attribution(tiny_model, tokens, 10**6)
    with pytest.raises(ValueError, match="past the end"):
        direct_logit_attribution(tiny_model, tokens, 1, position=tokens.shape[1])


def test_dla_frame_and_figures(tiny_model, tokens):
    result = direct_logit_attribution(tiny_model, tokens, 5, 7)
    frame = result.to_frame()
    assert {"prompt", "component", "layer", "head", "contribution"} <= set(frame.columns)
    assert frame[frame.kind != "head"]["head"].isna().all()
    bar = result.figure("bar", top=5)
    assert len(bar.data[0].y) == 5
    top = result.to_frame(mean=True).contribution.abs().nlargest(5)
    assert float(abs(bar.data[0].x[-1])) == pytest.approx(float(top.iloc[0]), rel=1e-5)  # the largest is on top
    heads = result.figure("heads", prompt=1)
    torch.testing.assert_close(torch.tensor(heads.data[0].z), result.head_contributions()[1].float())
    line = result.figure("accumulated")
    assert float(line.data[0].y[-1]) == pytest.approx(float(result.actual.mean()), abs=ATOL)


def test_figure_titles_escape_answers(tiny_model):
    answer = tiny_model.tokenizer.encode("<", add_special_tokens=False)
    assert len(answer) == 1
    fig = direct_logit_attribution(tiny_model, "To be", "<").figure()
    assert "logit(&lt;)" in fig.layout.title.text


ARCHITECTURES = {
    "llama-like": dict(norm="rms", positions="rotary", qkv_bias=False, out_bias=False, mlp_bias=False,
                       gated_mlp=True, activation="silu", n_kv_heads=2),
    "no final norm": dict(final_norm=False),
    "pruned heads": dict(heads_per_layer=(4, 2)),
    "pythia-like": dict(norm_placement="parallel", positions="rotary", rotary_dim=4, activation="gelu", tied_embeddings=False),
}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_other_architectures_add_up(arch):
    """RMS norm, rotary positions (no position row), no biases, no final norm, uneven heads: the table still
    adds up to the model's own logit difference, and the components to the final residual."""
    from probe import DecoderConfig, HookedDecoder

    cfg = DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, **ARCHITECTURES[arch])
    torch.manual_seed(0)
    model = HookedDecoder(cfg).eval()
    with torch.no_grad():  # norm weights away from 1 so the frozen scale and w matter
        for name, param in model.named_parameters():
            if name.endswith(".w"):
                param.add_(0.3 * torch.randn_like(param))
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    result = direct_logit_attribution(model, tokens, [3, 4], 7)
    logits, cache = model.run_with_cache(tokens, names="blocks.1.hook_resid_post")
    expected = logits[torch.arange(2), -1, torch.tensor([3, 4])] - logits[:, -1, 7]
    torch.testing.assert_close(result.total, expected, atol=ATOL, rtol=0)
    decomposition = residual_decomposition(model, tokens)
    torch.testing.assert_close(decomposition.total(), cache["blocks.1.hook_resid_post"], atol=ATOL, rtol=0)
    assert ("pos_embed" in result.index.names) == (arch not in ("llama-like", "pythia-like"))
    heads = result.head_contributions()
    assert int(heads.isnan().sum()) == (2 * 2 if arch == "pruned heads" else 0)
    # the accumulated line reads the residuals this model has: after each block, and after each attention
    # sublayer only where one exists (a parallel block's MLP reads the residual entering the block)
    parallel = arch == "pythia-like"
    assert result.sites == [s for s in model.hook_names if s.endswith(("resid_pre", "resid_mid", "resid_post"))
                            and s != "blocks.1.hook_resid_pre"]
    assert result.accumulated.shape[1] == len(result.sites) == (3 if parallel else 5)
    _, cache = model.run_with_cache(tokens, names=result.sites)
    residuals = torch.stack([cache[s] for s in result.sites], dim=1)  # [batch site pos d_model]
    torch.testing.assert_close(decomposition.accumulated(include_mid=not parallel), residuals, atol=ATOL, rtol=0)
    if parallel:
        with pytest.raises(ValueError, match="parallel"):
            decomposition.accumulated(include_mid=True)


def test_post_norm_is_refused():
    from probe import DecoderConfig, HookedDecoder

    model = HookedDecoder(DecoderConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=20, n_ctx=8, norm_placement="post"))
    with pytest.raises(ValueError, match="post-norm"):
        direct_logit_attribution(model, torch.tensor([[1, 2, 3]]), 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dla_of_a_half_precision_model_linearises_its_own_activations_exactly(tiny_model, tokens, dtype):
    """The oracle: the half-precision model's own cached writes and weights, through the frozen final norm
    in float64. Rounding N(c) and N(0) to bfloat16 before their difference would cost small rows ~1%."""
    import copy

    model = copy.deepcopy(tiny_model).to(dtype)
    answer, counterfactual = 33, 90
    result = direct_logit_attribution(model, tokens, answer, counterfactual)
    names = ["hook_embed", "hook_pos_embed", "ln_final.hook_scale"]
    names += [f"blocks.{l}.{n}" for l in range(model.cfg.n_layers) for n in ("attn.hook_result", "hook_mlp_out")]
    _, cache = model.run_with_cache(tokens, names=names)
    rows = [cache["hook_embed"][:, -1], cache["hook_pos_embed"][:, -1]]
    for layer, block in enumerate(model.blocks):
        rows += list(cache[f"blocks.{layer}.attn.hook_result"][:, -1].unbind(1))  # one per head
        rows += [block.attn.b_O.detach().expand_as(rows[0]), cache[f"blocks.{layer}.hook_mlp_out"][:, -1]]
    writes = torch.stack(rows, dim=1).double()  # [batch component d_model]
    scale = cache["ln_final.hook_scale"][:, -1].double()[:, None]  # [batch 1 1]
    W_U = model.unembed.weight.detach().double()
    direction = (W_U[answer] - W_U[counterfactual]) * model.ln_final.w.detach().double()
    expected = ((writes - writes.mean(-1, keepdim=True)) / scale) @ direction
    assert len(result.index.names) == expected.shape[1]
    bound = 1e-5 * float(expected.abs().max())
    torch.testing.assert_close(result.contributions.double(), expected, atol=bound, rtol=0)
    ln_bias = model.ln_final.b.detach().double() @ (W_U[answer] - W_U[counterfactual])
    torch.testing.assert_close(result.ln_bias.double(), ln_bias.expand(tokens.shape[0]), atol=bound, rtol=0)


def test_bundled_model_dla_adds_up(bundled_model):
    result = direct_logit_attribution(bundled_model, ["ROMEO: What light through yonder", "KING: My lord, I"],
                                      answer=5, counterfactual=9)
    torch.testing.assert_close(result.total, result.actual, atol=ATOL, rtol=0)


def test_gpu_matches_cpu(tiny_model, tokens, device_under_test):
    import copy

    model = copy.deepcopy(tiny_model).to(device_under_test)
    on_gpu = direct_logit_attribution(model, tokens, 5, 7)
    on_cpu = direct_logit_attribution(tiny_model, tokens, 5, 7)
    torch.testing.assert_close(on_gpu.contributions.cpu(), on_cpu.contributions, atol=1e-3, rtol=0)
    torch.testing.assert_close(on_gpu.total, on_gpu.actual, atol=1e-3, rtol=0)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_every_head_pruned_still_gives_a_head_table():
    """A model whose layers all keep no head: the per-head table is empty, not an IndexError."""
    from probe import DecoderConfig, HookedDecoder

    torch.manual_seed(0)
    model = HookedDecoder(DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16,
                                        heads_per_layer=(0, 0))).eval()
    tokens = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    result = direct_logit_attribution(model, tokens, 3, 4)
    with torch.no_grad():
        logits = model(tokens)
    torch.testing.assert_close(result.total, logits[:, -1, 3] - logits[:, -1, 4], atol=ATOL, rtol=0)
    assert result.head_contributions().shape == (2, 2, 0)
    result.figure("heads")


def test_answer_ids_must_be_integers(tiny_model, tokens):
    import numpy as np

    by_int = direct_logit_attribution(tiny_model, tokens, 5, 7)
    by_numpy = direct_logit_attribution(tiny_model, tokens, np.int64(5), [np.int32(7)] * 3)
    assert torch.equal(by_numpy.answer, by_int.answer) and torch.equal(by_numpy.counterfactual, by_int.counterfactual)
    torch.testing.assert_close(by_numpy.contributions, by_int.contributions, atol=0, rtol=0)
    with pytest.raises(TypeError, match="integer token ids"):  # was .long(): 5.9 silently became token 5
        direct_logit_attribution(tiny_model, tokens, torch.tensor([5.9, 5.0, 5.0]))
    with pytest.raises(TypeError, match="not a token id"):
        direct_logit_attribution(tiny_model, tokens, [True])


def test_decomposition_figure_checks_the_prompt(tiny_model, tokens):
    with pytest.raises(ValueError, match="prompt=3 is outside the batch of 3"):
        residual_decomposition(tiny_model, tokens).figure(prompt=3)


@pytest.mark.parametrize("kind", ["gemma2", "olmo2"])
def test_sandwich_heads_share_the_normalised_write_and_add_up_to_the_logit_before_the_cap(kind, tmp_path):
    """Sandwich blocks normalise each write (Gemma 2; OLMo 2, whose sublayers read the residual unnormalised); with
    ln1_post's scale frozen each head's share is linear, so the components still add up, to the final residual and
    to transformers' logit (before Gemma 2's soft cap)."""
    from test_variants import build

    from probe import HookedDecoder

    hf = build(kind, tmp_path, **({"num_hidden_layers": 3, "attention_bias": True} if kind == "olmo2" else {}))
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (2, 14), generator=torch.Generator().manual_seed(3))
    decomposition = residual_decomposition(model, tokens)
    _, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(decomposition.total(), cache["blocks.2.hook_resid_post"], atol=ATOL, rtol=0)
    kinds, layers = decomposition.index.kinds, decomposition.index.layers
    for layer in range(3):  # the heads' shares (and b_O's) add up to the block's normalised attention write
        heads = [i for i, (part, l) in enumerate(zip(kinds, layers)) if part in ("head", "attn_bias") and l == layer]
        torch.testing.assert_close(decomposition.components[:, :, heads].sum(2), cache[f"blocks.{layer}.hook_attn_out"],
                                   atol=ATOL, rtol=0)
    result = direct_logit_attribution(model, tokens, 5, 9)
    with torch.no_grad():
        out = hf(tokens, output_hidden_states=True)
        before_cap = out.hidden_states[-1][:, -1] @ hf.lm_head.weight.T  # transformers' final-normed residual, unembedded
    torch.testing.assert_close(result.total, before_cap[:, 5] - before_cap[:, 9], atol=ATOL, rtol=0)
    if kind == "gemma2":
        capped = out.logits[:, -1, 5] - out.logits[:, -1, 9]
        assert not torch.allclose(result.total, capped, atol=1e-3)  # the cap bites, so the test tells them apart


def test_sandwich_blocks_with_layernorm_write_norms_are_refused():
    from probe import DecoderConfig, HookedDecoder

    model = HookedDecoder(DecoderConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=20, n_ctx=8, norm_placement="sandwich"))
    with pytest.raises(ValueError, match="sandwich blocks are decomposed with RMSNorm write norms"):
        direct_logit_attribution(model, torch.tensor([[1, 2, 3]]), 4)


def test_bfloat16_sandwich_heads_are_linearised_in_float32(tmp_path):
    """Each Gemma 2 head's row is its cached result through ln1_post (scale frozen) and the frozen final norm, onto
    the answer direction: computed in float64 from the bfloat16 model's own activations and weights. Rounding the
    head's share result * w / scale to bfloat16 before the final norm cost ~2e-3 of the largest row."""
    from test_variants import build

    from probe import HookedDecoder
    from probe.analyses.residual_components import component_hooks

    build("gemma2", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval().to(torch.bfloat16)
    tokens = torch.randint(1, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    result = direct_logit_attribution(model, tokens, 5, 9)
    _, cache = model.run_with_cache(tokens, names=component_hooks(model) + ["ln_final.hook_scale"])
    W_U = model.unembed.W_U.detach().double()
    direction = (W_U[:, 5] - W_U[:, 9]) * model.ln_final.w.detach().double() / cache["ln_final.hook_scale"][:, -1].double()
    expected = []
    for layer, block in enumerate(model.blocks):
        result_h = cache[f"blocks.{layer}.attn.hook_result"][:, -1].double()  # [batch head d_model]
        through = block.ln1_post.w.detach().double() / cache[f"blocks.{layer}.ln1_post.hook_scale"][:, -1].double()
        expected.append(torch.einsum("bhd,bd->bh", result_h * through[:, None], direction))
    expected = torch.stack(expected, dim=1)  # [batch layer head]
    bound = 1e-5 * float(expected.abs().max())
    torch.testing.assert_close(result.head_contributions().double(), expected, atol=bound, rtol=0)
