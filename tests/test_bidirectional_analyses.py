"""The analyses on a bidirectional model (transformer-lens's attention_dir="bidirectional": every query sees every
real key, later ones too), ARENA's balanced-bracket classifier: each gives the number an independent computation
gives (a hand-written hook, the model's weights, autograd by hand, a prompt run alone) or refuses up front saying
why and what to do instead.

The classifier reads its answer at position 0 (logit 1 "balanced" minus logit 0), so a patch at a later position
reaching it at all is the bidirectional attention at work; its prompts are right-padded as ARENA pads them, the
padding hidden by the attention mask. A second bidirectional model, with the bundled model's tokenizer, checks the
corpus scans, whose batches of short documents are right-padded too."""
from __future__ import annotations

import functools
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from probe import HookedDecoder, HookedTransformerConfig, SAEConfig, SparseAutoencoder
from probe.analyses import (
    Site, ablate_heads, agreement, attention_patterns, attention_view, attribution_graph, attribution_patch,
    direct_logit_attribution, edge_attribution, evaluate_masks, faithfulness, feature_inputs, feature_logits, feature_scan,
    head_ablation_effects, head_importance, head_scores, intervene, logit_diff_metric, logit_lens, loss_metric,
    memory_lookup, patch, path_patch, prune_by_importance, prune_heads, residual_decomposition, sae_eval, sae_features,
    sae_loss_recovered, steer, steering_sweep, steering_vector, top_triggers,
)
from probe.analyses.attribution_graph import FEATURE, LOGIT
from probe.analyses.circuit import Circuit
from probe.analyses.circuit_graph import circuit_graph
from probe.analyses.faithfulness import CircuitRunner
from probe.analyses.graph_interventions import FeatureEdit
from brackets_idioms import CONFIG, END, PAD, START
from test_attention_view import hovered_in_chromium
from test_circuit_forward import random_circuits
from toy_helpers import attribution_by_hand, copied_from, random_transcoders, randomised, zero_head

OPEN, CLOSE = 3, 4
BIDIRECTIONAL = "this model's attention is bidirectional"


@functools.cache
def classifier(softcap=None) -> HookedDecoder:
    """ARENA's config; with `softcap`, attention scores capped (Gemma 2's), which the fused kernel cannot do."""
    return randomised(HookedDecoder(HookedTransformerConfig(**CONFIG, attn_scores_soft_cap=softcap)), seed=1)


@functools.cache
def with_tokenizer() -> HookedDecoder:
    """A bidirectional model reading the bundled model's vocabulary, for what takes text."""
    from probe import DEFAULT_MODEL
    from probe.loading import load_tokenizer

    cfg = HookedTransformerConfig(n_ctx=64, d_model=32, d_head=16, n_heads=2, d_mlp=64, n_layers=2, d_vocab=4096,
                                  attention_dir="bidirectional", act_fn="gelu")
    return randomised(HookedDecoder(cfg, tokenizer=load_tokenizer(DEFAULT_MODEL)), seed=3)


def brackets(seed: int, lengths=(9, 7, 5)) -> tuple[torch.Tensor, torch.Tensor]:
    """[start] brackets [end], right-padded with [pad] as ARENA's tokenizer pads them, and the mask of real tokens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.full((len(lengths), max(lengths)), PAD)
    for row, length in enumerate(lengths):
        tokens[row, 0], tokens[row, length - 1] = START, END
        tokens[row, 1:length - 1] = torch.randint(OPEN, CLOSE + 1, (length - 2,), generator=gen)
    return tokens, (tokens != PAD).long()


def paired(seed: int, lengths=(9, 7, 5)):
    """(clean, corrupted, mask): the corrupted prompts flip about half the brackets, padding alike."""
    clean, mask = brackets(seed, lengths)
    flip = (clean >= OPEN) & (torch.rand(clean.shape, generator=torch.Generator().manual_seed(seed + 100)) < 0.5)
    return clean, torch.where(flip, OPEN + CLOSE - clean, clean), mask


def diff(model: HookedDecoder):
    return logit_diff_metric(model, 1, 0, position=0)


def diff_of(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, 0, 1] - logits[:, 0, 0]


def run(model, tokens, mask, hooks=()) -> torch.Tensor:
    return model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=list(hooks))


def close(got, want, atol=1e-4, rtol=1e-4) -> None:
    def tensor(x):
        return x if isinstance(x, torch.Tensor) else torch.tensor(np.array(x, dtype=float))
    torch.testing.assert_close(tensor(got).float(), tensor(want).float(), atol=atol, rtol=rtol)


@torch.no_grad()
def test_position_0_reads_later_tokens_and_never_the_padding():
    """The premise of every test below."""
    model = classifier()
    tokens, mask = brackets(0)
    changed = tokens.clone()
    changed[0, 6] = OPEN + CLOSE - changed[0, 6]
    assert not torch.allclose(diff_of(model(tokens, attention_mask=mask))[0],
                              diff_of(model(changed, attention_mask=mask))[0], atol=1e-3)
    close(model(tokens, attention_mask=mask)[2, :5], model(tokens[2:, :5])[0])  # the short prompt alone


# ---- attention ------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_attention_patterns_keep_the_weights_on_later_keys():
    model = classifier()
    tokens = brackets(1)[0][0]  # the longest prompt: no padding
    n = len(tokens)
    result = attention_patterns(model, tokens)
    _, cache = model.run_with_cache(tokens[None])
    pattern = torch.stack([cache[f"blocks.{l}.attn.hook_pattern"][0] for l in range(3)])
    close(result.pattern, pattern, atol=1e-6)
    assert float(pattern[..., torch.ones(n, n, dtype=torch.bool).triu(1)].sum()) > 1.0  # real weight above it
    frame = result.to_frame()
    assert len(frame) == 3 * 2 * n * n  # every (query, key) pair, not the lower triangle
    close(frame.groupby(["layer", "head", "query_pos"]).weight.sum().to_numpy(), np.ones(3 * 2 * n), atol=1e-5)
    later = frame[frame.key_pos > frame.query_pos]
    at = [torch.tensor(later[column].to_numpy()) for column in ("layer", "head", "query_pos", "key_pos")]
    close(later.weight.to_numpy(), pattern[tuple(at)], atol=1e-6)
    close(np.array(result.figure(layer=1, head=0).data[0].z), pattern[1, 0], atol=1e-6)  # no blanked triangle
    for trace in result.figure().data:
        assert not np.isnan(np.array(trace.z, dtype=float)).any()
    # a long prompt is max-pooled to 32 cells a side in the overview: blocks above the diagonal keep their maximum
    long = torch.randint(0, 5, (40,), generator=torch.Generator().manual_seed(2))
    overview = attention_patterns(model, long).figure()
    _, cache = model.run_with_cache(long[None])
    first = cache["blocks.0.attn.hook_pattern"][0, 0]  # the first trace: layer 0, head 0
    pooled = F.max_pool2d(first[None, None], 2)[0, 0]
    close(np.array(overview.data[0].z, dtype=float), pooled, atol=1e-6)
    # the interactive view carries every key of every row
    data = attention_view(model, tokens).data()
    assert data["causal"] is False
    close(torch.tensor(data["rows"][2][1]), pattern[2, 1], atol=1e-4)


@pytest.mark.slow
def test_the_view_in_chromium_shows_a_querys_weights_on_later_keys(tmp_path):
    model = classifier()
    tokens = brackets(1)[0][0]
    layer, head, position = 1, 0, 2
    result = hovered_in_chromium(attention_view(model, tokens), layer, head, position, tmp_path)
    assert not [line for line in result.stderr.splitlines() if ":CONSOLE" in line]
    shown = [float(w) for w in re.findall(r'<span class="pa-tok[^"]*"[^>]*data-weight="([0-9.]+)"', result.stdout)]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens[None])
    expected = cache[f"blocks.{layer}.attn.hook_pattern"][0, head, position]
    close(torch.tensor(shown), expected, atol=1e-4)  # the later keys' weights too, not zeros
    info = re.search(r'<div class="pa-info">(.*?)</div>', result.stdout).group(1)
    assert f"({int(expected.argmax())}), weight" in info


@torch.no_grad()
def test_head_scores_are_the_weight_on_each_target_by_hand():
    model = classifier()
    tokens = torch.randint(0, 5, (4, 12), generator=torch.Generator().manual_seed(3))
    _, cache = model.run_with_cache(tokens)
    previous = head_scores(model, "previous_token", tokens).scores
    duplicate = head_scores(model, "duplicate_token", tokens).scores
    earlier = torch.ones(12, 12, dtype=torch.bool).tril(-1)
    copies = (tokens[:, :, None] == tokens[:, None, :]) & earlier  # [batch query key]: earlier copies only
    for layer in range(3):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        for head in range(2):
            close(previous[layer, head], pattern[:, head].diagonal(offset=-1, dim1=-2, dim2=-1).mean(), atol=1e-5)
            mass = (pattern[:, head] * copies).sum(-1)[copies.any(-1)]
            close(duplicate[layer, head], mass.mean(), atol=1e-5)


# ---- attribution and lenses -------------------------------------------------------------------------------------
@torch.no_grad()
def test_direct_logit_attribution_adds_up_at_the_classifiers_position():
    model = classifier()
    tokens, mask = brackets(2)
    result = direct_logit_attribution(model, tokens, 1, 0, position=0, attention_mask=mask)
    logits, cache = model.run_with_cache(tokens, attention_mask=mask)
    close(result.total, diff_of(logits))
    direction, scale = model.W_U[:, 1] - model.W_U[:, 0], cache["ln_final.hook_scale"][:, 0]
    names = result.index.names
    for layer in range(3):
        for head in range(2):
            write = cache[f"blocks.{layer}.attn.hook_z"][:, 0, head] @ model.blocks[layer].attn.W_O[head]
            want = ((write - write.mean(-1, keepdim=True)) / scale * model.ln_final.w) @ direction
            close(result.contributions[:, names.index(f"L{layer}H{head}")], want)
    decomposition = residual_decomposition(model, tokens, attention_mask=mask)
    real = mask.bool()
    close(decomposition.total()[real], cache["blocks.2.hook_resid_post"][real])


@torch.no_grad()
def test_the_logit_lens_targets_the_models_own_prediction_everywhere():
    """No next-token target: every position of a bidirectional model sees its next token."""
    model = classifier()
    tokens, mask = brackets(3)
    result = logit_lens(model, tokens, k=2, attention_mask=mask)  # two classes: k is at most d_vocab_out
    logits = model(tokens, attention_mask=mask)
    real = mask.bool()
    close(result.logits[:, -1][real], logits[real])
    assert torch.equal(result.target[real], logits.argmax(-1)[real])
    assert bool((result.target_rank[:, -1][real] == 0).all())


def final_logits_by_hand(model: HookedDecoder, resid: torch.Tensor) -> torch.Tensor:
    """The final LayerNorm and the unembedding written out from the weights."""
    centred = resid - resid.mean(-1, keepdim=True)
    normed = centred / centred.pow(2).mean(-1, keepdim=True).add(model.cfg.eps).sqrt() * model.ln_final.w + model.ln_final.b
    return normed @ model.W_U + model.unembed.bias


@torch.no_grad()
def test_the_logit_lens_default_k_fits_two_classes_and_a_larger_k_is_refused():
    """The default top-5 was refused by a model with two output tokens: it keeps both, ranked as the weights rank
    them; a k the vocabulary cannot give is refused, saying what to pass."""
    model = classifier()
    tokens, mask = brackets(3)
    result = logit_lens(model, tokens, attention_mask=mask)
    _, cache = model.run_with_cache(tokens, attention_mask=mask)
    real = mask.bool()
    assert result.top_tokens.shape[-1] == 2
    for i, site in enumerate(result.sites):
        want = final_logits_by_hand(model, cache[site]).sort(-1, descending=True)
        assert torch.equal(result.top_tokens[:, i][real], want.indices[real])
        close(result.top_probs[:, i][real], want.values.softmax(-1)[real])
    with pytest.raises(ValueError, match=r"k=3 must be an integer in \[1, d_vocab_out=2\]: there are only 2; pass k=2 "
                                         r"or less, or leave k unset"):
        logit_lens(model, tokens, k=3, attention_mask=mask)


# ---- ablation, patching, pruning ----------------------------------------------------------------------------------
@torch.no_grad()
def test_head_ablation_is_a_hand_written_hook():
    model = classifier()
    tokens, mask = brackets(4)
    real = mask.bool()
    logits = ablate_heads(model, tokens, [(0, 1), (2, 0)], attention_mask=mask)
    close(logits[real], run(model, tokens, mask, [("blocks.0.attn.hook_z", zero_head(1)),
                                                  ("blocks.2.attn.hook_z", zero_head(0))])[real])
    # each head alone, every layer restarting from the cached residual with the prompts' mask
    effects = head_ablation_effects(model, tokens, diff(model), attention_mask=mask)
    close(effects.baseline, diff_of(model(tokens, attention_mask=mask)))
    for layer in range(3):
        for head in range(2):
            close(effects.per_prompt[layer, head], diff_of(run(model, tokens, mask, [(f"blocks.{layer}.attn.hook_z",
                                                                                      zero_head(head))])))
    # mean ablation: the head's output averaged over the prompts' real tokens, position by position
    _, cache = model.run_with_cache(tokens, attention_mask=mask)
    z = cache["blocks.1.attn.hook_z"]
    weight = mask.float() / mask.float().sum(0)
    mean = torch.einsum("bp,bphd->phd", weight, z)

    def with_mean(act, hook):
        act = act.clone()
        act[:, :, 1] = mean[None, :, 1]
        return act
    got = ablate_heads(model, tokens, [(1, 1)], method="mean", attention_mask=mask)
    close(got[real], run(model, tokens, mask, [("blocks.1.attn.hook_z", with_mean)])[real])


@torch.no_grad()
def test_a_reference_longer_than_the_prompts_is_refused_and_one_as_long_is_a_hand_written_mean():
    """A causal position reads only the tokens up to it, so a longer reference cut to the prompts' length is still
    comparable; a bidirectional position reads its whole prompt, so the reference's first positions saw tokens the
    prompts lack: refused, naming the fix. References of the prompts' own length are the hand-written hook."""
    model = classifier()
    tokens = brackets(4, lengths=(9, 9, 9))[0]
    longer = brackets(5, lengths=(12, 12, 12, 12))[0]
    same = brackets(6, lengths=(9, 9, 9, 9))[0]
    refused = rf"{BIDIRECTIONAL}.*give reference prompts of the same length as the input \(9 positions\)"
    for method in ("mean", "resample"):
        with pytest.raises(ValueError, match=rf"{method} ablation with a reference of 12 positions .*{refused}"):
            ablate_heads(model, tokens, [(1, 1)], method=method, reference=longer)
        with pytest.raises(ValueError, match=refused):
            head_ablation_effects(model, tokens, diff(model), method=method, reference=longer)
    _, cache = model.run_with_cache(same)
    mean = cache["blocks.1.attn.hook_z"].mean(0)  # [pos head d_head]: every reference position is real

    def with_mean(z, hook):
        z = z.clone()
        z[:, :, 1] = mean[None, :, 1]
        return z
    close(ablate_heads(model, tokens, [(1, 1)], method="mean", reference=same),
          run(model, tokens, None, [("blocks.1.attn.hook_z", with_mean)]))
    effects = head_ablation_effects(model, tokens, diff(model), method="mean", reference=same)
    close(effects.per_prompt[1, 1], diff_of(run(model, tokens, None, [("blocks.1.attn.hook_z", with_mean)])))


@torch.no_grad()
def test_resample_ablation_draws_from_reference_prompts_of_the_same_length():
    """Each prompt's sample comes from a reference prompt of its own length (a longer one's activations saw more
    tokens), the hand-written swap of that prompt's head output; a prompt no reference matches is refused."""
    model = classifier()
    tokens, mask = brackets(7, lengths=(9, 9, 7, 7, 5, 5))
    lengths = mask.sum(1)
    _, cache = model.run_with_cache(tokens, attention_mask=mask)
    z = cache["blocks.1.attn.hook_z"]
    for seed in range(6):
        got = ablate_heads(model, tokens, [(1, 0)], method="resample", seed=seed, attention_mask=mask)
        for row in range(len(tokens)):
            real = mask[row].bool()
            candidates = []
            for ref in range(len(tokens)):
                def swap(act, hook, ref=ref):
                    act = act.clone()
                    act[row, :, 0] = z[ref, :, 0]
                    return act
                swapped = run(model, tokens, mask, [("blocks.1.attn.hook_z", swap)])[row]
                if torch.allclose(got[row][real], swapped[real], atol=1e-4, rtol=1e-4):
                    candidates.append(ref)
            assert candidates and all(int(lengths[ref]) == int(lengths[row]) for ref in candidates), (seed, row)
    with pytest.raises(ValueError, match=rf"resample ablation of input prompt\(s\) \[1, 2\]: {BIDIRECTIONAL}.*same "
                                         r"length.*give reference prompts of the same lengths"):
        ablate_heads(model, tokens[[0, 2, 4]], [(1, 0)], method="resample", reference=tokens[:2],
                     attention_mask=mask[[0, 2, 4]])


def test_patching_is_a_hand_written_patch_and_its_gradient_estimate():
    model = classifier()
    clean, corrupted, mask = paired(5)
    metric = diff(model)
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean, attention_mask=mask)

    def patched(name: str, where) -> float:
        with torch.no_grad():
            return float(diff_of(run(model, corrupted, mask, [(name, copied_from(clean_cache, name, where))])).mean())

    sites = [Site("resid_pre", 2, pos=4), Site("resid_pre", 1, pos=6), Site("attn_out", 0), Site("mlp_out", 1, pos=5)]
    exact = patch(model, clean, corrupted, metric, sites, attention_mask=mask)
    for site, value in zip(sites, exact.patched.tolist()):
        where = (slice(None), slice(None)) if site.pos is None else (slice(None), site.pos)
        assert value == pytest.approx(patched(site.hook_name, where), abs=1e-4)
    assert abs(exact.patched[0] - exact.corrupted) > 1e-3  # a later position reaches position 0
    heads = patch(model, clean, corrupted, metric, "heads", attention_mask=mask)
    for site, value in zip(heads.sites, heads.patched.tolist()):
        assert value == pytest.approx(patched(site.hook_name, (slice(None), slice(None), site.head)), abs=1e-4)
    # attribution patching: (clean - corrupted) . d metric / d z, the gradient taken by hand
    estimate = attribution_patch(model, clean, corrupted, metric, "heads", attention_mask=mask)
    names = [f"blocks.{l}.attn.hook_z" for l in range(3)]
    expected = attribution_by_hand(lambda hooks: diff_of(run(model, corrupted, mask, hooks)).mean(), clean_cache, names,
                                   estimate.sites)
    for got, value in zip(estimate.patched.tolist(), expected):
        assert got == pytest.approx(value, abs=1e-4)


@torch.no_grad()
def test_a_pruned_model_equals_the_heads_zeroed():
    model = classifier()
    tokens, mask = brackets(6)
    pruned = prune_heads(model, [(0, 0), (2, 1)])
    by_hand = run(model, tokens, mask, [("blocks.0.attn.hook_z", zero_head(0)), ("blocks.2.attn.hook_z", zero_head(1))])
    real = mask.bool()
    close(pruned(tokens, attention_mask=mask)[real], by_hand[real])


def test_head_importance_is_the_gates_gradient_by_hand():
    model = classifier()
    tokens = torch.randint(0, 5, (4, 10), generator=torch.Generator().manual_seed(7))
    result = head_importance(model, tokens, metric=diff(model), normalize=False, progress=False)
    xi = torch.ones(4, 3, 2, requires_grad=True)
    hooks = [(f"blocks.{l}.attn.hook_z", lambda z, hook, l=l: z * xi[:, l, None, :, None]) for l in range(3)]
    (grad,) = torch.autograd.grad(diff_of(model.run_with_hooks(tokens, fwd_hooks=hooks)).sum(), xi)
    close(result.raw, grad.abs().mean(0), atol=1e-5)


# ---- circuits ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ablation, softcap, lengths", [("patch", None, (9, 7, 5)), ("mean", None, (9, 7, 5)),
                                                       ("zero", None, (9, 9, 9)), ("patch", 2.0, (9, 9, 9))])
def test_the_sparse_circuit_forward_is_the_hooked_one(ablation, softcap, lengths):
    """The sparse engine computes attention itself: with the model's own (bidirectional) masks, not causal ones, in
    the fused kernel and in the explicit path of capped scores, padded (a mask) or not (the attention's default)."""
    model = classifier(softcap)
    clean, corrupted, mask = paired(8, lengths)
    metric = diff(model)
    sparse = CircuitRunner.prepare(model, clean, corrupted, metric, ablation, attention_mask=mask, engine="sparse")
    hooked = CircuitRunner.prepare(model, clean, corrupted, metric, ablation, attention_mask=mask, engine="hooked")
    n = sparse.graph.n_edges
    circuits = random_circuits(n, [0, 1, 5, n // 3, n // 2, n - 3, n])
    close(sparse.evaluate(circuits), hooked.evaluate(circuits), atol=2e-4)
    if ablation == "patch":  # every edge kept is the clean run, none the corrupted one
        with torch.no_grad():
            close(sparse.evaluate(circuits[-1:])[0], diff_of(model(clean, attention_mask=mask)))
            close(sparse.evaluate(circuits[:1])[0], diff_of(model(corrupted, attention_mask=mask)))


@pytest.mark.parametrize("engine", ["sparse", "hooked"])
@pytest.mark.parametrize("kind", ["q", "k", "v"])
@torch.no_grad()
def test_one_path_through_a_head_is_its_hand_written_attention(engine, kind):
    """embed -> L1H0's q, k or v input, and L1H0 -> logits, under patching: the head's attention by hand, every real
    key allowed to every query (padding hidden), from the corrupted run's residual plus the clean embedding's change."""
    model = classifier()
    clean, corrupted, mask = paired(9)
    circuit = Circuit.from_edges(circuit_graph(model), [("embed", f"L1H0<{kind}"), ("L1H0", "logits")])
    got = faithfulness(model, circuit, clean, corrupted, diff(model), attention_mask=mask, engine=engine).circuit_values
    _, cc = model.run_with_cache(clean, attention_mask=mask)
    _, cr = model.run_with_cache(corrupted, attention_mask=mask)
    attn, ln1 = model.blocks[1].attn, model.blocks[1].ln1
    moved = cr["blocks.1.hook_resid_pre"] + cc["blocks.0.hook_resid_pre"] - cr["blocks.0.hook_resid_pre"]
    inputs = {part: moved if part == kind else cr["blocks.1.hook_resid_pre"] for part in "qkv"}
    q, k, v = (ln1(inputs[part]) @ w[0] + b[0] for part, w, b in
               (("q", attn.W_Q, attn.b_Q), ("k", attn.W_K, attn.b_K), ("v", attn.W_V, attn.b_V)))
    allowed = mask.bool()[:, None, :] | torch.eye(mask.shape[1], dtype=torch.bool)
    pattern = (q @ k.transpose(1, 2) / math.sqrt(28)).masked_fill(~allowed, -math.inf).softmax(-1)
    change = (pattern @ v - cr["blocks.1.attn.hook_z"][:, :, 0]) @ attn.W_O[0]
    logits = model.unembed(model.ln_final(cr["blocks.2.hook_resid_post"] + change))
    close(got, diff_of(logits))


def test_eap_scores_are_the_readers_gradients_by_hand():
    """(clean - corrupted output of the writer) . d metric / d (the reader's own input), every reader recomputed
    from its input plus a zero leaf of its own, so one backward gives each reader's gradient."""
    model = classifier()
    clean, corrupted, mask = paired(10)
    scores = edge_attribution(model, clean, corrupted, diff(model), attention_mask=mask)
    graph = scores.graph

    def outputs(cache) -> list[torch.Tensor]:
        out = []
        for kind, layer, head in zip(graph.writer_kind, graph.writer_layer, graph.writer_head):
            out.append(cache["blocks.0.hook_resid_pre"] if kind == "embed" else cache[f"blocks.{layer}.hook_mlp_out"]
                       if kind == "mlp" else cache[f"blocks.{layer}.attn.hook_z"][:, :, head] @ model.blocks[layer].attn.W_O[head])
        return out
    with torch.no_grad():
        deltas = [a - b for a, b in zip(outputs(model.run_with_cache(clean, attention_mask=mask)[1]),
                                        outputs(model.run_with_cache(corrupted, attention_mask=mask)[1]))]
    leaves = [torch.zeros(*clean.shape, 56, requires_grad=True) for _ in graph.readers]
    seen = {}

    def remember(x, hook):
        seen[hook.name] = x

    def projections(kind: str, layer: int):
        def hook(x, hook):
            x = x.clone()
            attn = model.blocks[layer].attn
            w, b = {"q": (attn.W_Q, attn.b_Q), "k": (attn.W_K, attn.b_K), "v": (attn.W_V, attn.b_V)}[kind]
            for r, (rk, rl, rh) in enumerate(zip(graph.reader_kind, graph.reader_layer, graph.reader_head)):
                if (rk, rl) == (kind, layer):
                    x[:, :, rh] = model.blocks[layer].ln1(seen[f"blocks.{layer}.hook_resid_pre"] + leaves[r]) @ w[rh] + b[rh]
            return x
        return hook

    def mlp(layer: int, r: int):
        block = model.blocks[layer]
        return lambda x, hook: block.mlp(block.ln2(seen[f"blocks.{layer}.hook_resid_mid"] + leaves[r]))

    hooks = []
    for layer in range(3):
        hooks += [(f"blocks.{layer}.hook_resid_pre", remember), (f"blocks.{layer}.hook_resid_mid", remember)]
        hooks += [(f"blocks.{layer}.attn.hook_{kind}", projections(kind, layer)) for kind in "qkv"]
        hooks.append((f"blocks.{layer}.hook_mlp_out", mlp(layer, graph.readers.index(f"L{layer} mlp"))))
    hooks.append(("blocks.2.hook_resid_post", lambda x, hook: x + leaves[graph.readers.index("logits")]))
    grads = torch.autograd.grad(diff_of(run(model, corrupted, mask, hooks)).sum(), leaves)
    expected = torch.stack([(deltas[w] * grads[r]).sum((1, 2)).mean() for w, r in
                            zip(graph.edge_writer.tolist(), graph.edge_reader.tolist())])
    close(scores.scores, expected, atol=1e-5 * float(expected.abs().max()), rtol=1e-3)


@torch.no_grad()
def test_path_patching_a_head_into_a_head_by_hand():
    """L0H0's clean output reaches L1H0's q, k and v alone, through ln1 at the corrupted run's scale; everything after
    L1H0 runs as the model runs."""
    model = classifier()
    clean, corrupted, mask = paired(11)
    result = path_patch(model, clean, corrupted, diff(model), "L0H0", "L1H0", attention_mask=mask)
    _, cc = model.run_with_cache(clean, attention_mask=mask)
    _, cr = model.run_with_cache(corrupted, attention_mask=mask)
    w_o = model.blocks[0].attn.W_O[0]
    x = cr["blocks.1.hook_resid_pre"] + (cc["blocks.0.attn.hook_z"][:, :, 0] - cr["blocks.0.attn.hook_z"][:, :, 0]) @ w_o
    ln1, attn = model.blocks[1].ln1, model.blocks[1].attn
    normed = (x - x.mean(-1, keepdim=True)) / cr["blocks.1.ln1.hook_scale"] * ln1.w + ln1.b

    def receive(w, b):
        def hook(act, hook):
            act = act.clone()
            act[:, :, 0] = normed @ w[0] + b[0]
            return act
        return hook
    hooks = [(f"blocks.1.attn.hook_{part}", receive(w, b)) for part, w, b in
             (("q", attn.W_Q, attn.b_Q), ("k", attn.W_K, attn.b_K), ("v", attn.W_V, attn.b_V))]
    close(result.patched[0], diff_of(run(model, corrupted, mask, hooks)))


def padding_hooks(model: HookedDecoder) -> None:
    """ARENA's padding mask: permanent hooks reading the tokens and hiding [pad] keys at every hook_attn_scores."""
    seen = {}

    def tokens(toks, hook):
        seen["pad"] = (toks == PAD)[:, None, None, :]

    def scores(s, hook):
        return s.masked_fill(seen["pad"], -1e5)
    model.hook_point("hook_tokens").add_perma_hook(tokens)
    for layer in range(3):
        model.hook_point(f"blocks.{layer}.attn.hook_attn_scores").add_perma_hook(scores)


def test_a_circuit_of_a_model_with_permanent_hooks_runs_them():
    """The sparse engine recomputes attention from the weights, so it would skip ARENA's padding hooks: 'auto' takes
    the hooked forward, which runs them, and 'sparse' is refused."""
    model = randomised(HookedDecoder(HookedTransformerConfig(**CONFIG)), seed=1)
    clean, corrupted, mask = paired(12)
    padding_hooks(model)
    metric = diff(model)
    with pytest.raises(ValueError, match="engine='sparse' computes the circuit's forward from the weights, without "
                                         "the hooks attached to .*hook_attn_scores"):
        CircuitRunner.prepare(model, clean, corrupted, metric, engine="sparse")
    auto = CircuitRunner.prepare(model, clean, corrupted, metric)
    assert auto.run is None  # the hooked engine
    n = auto.graph.n_edges
    with torch.no_grad():
        values = auto.evaluate(random_circuits(n, [n, 0]))
        close(values[0], diff_of(model(clean, attention_mask=mask)))  # the hooks hide the padding as the mask does
        close(values[1], diff_of(model(corrupted, attention_mask=mask)))


# ---- attribution graphs -------------------------------------------------------------------------------------------
def transcoders(model: HookedDecoder, seed: int) -> list[SparseAutoencoder]:
    return random_transcoders(model, torch.Generator().manual_seed(seed))


def test_an_attribution_graph_explains_the_logits_through_the_bidirectional_patterns():
    model = classifier()
    tokens = brackets(13)[0][0]
    graph = attribution_graph(model, transcoders(model, 14), tokens, batch_size=8)
    with torch.no_grad():
        logits = model(tokens[None])[0, -1]
        logits_at_0 = model(tokens[None])[0, 0]
    is_logit = graph.kind == LOGIT
    close(graph.value[is_logit], (logits - logits.mean())[graph.token[is_logit]], atol=1e-5)
    targets = (graph.kind == FEATURE) | is_logit
    total = graph.adjacency.sum(1) + graph.unvisited + graph.bias
    close(total[targets], graph.value[targets], atol=1e-4)  # completeness: the linearisation is exact
    # an edge from a feature at a later position into one at an earlier one: the patterns carry it
    later = (graph.pos[None, :] > graph.pos[:, None]) & (graph.kind[:, None] == FEATURE) & (graph.kind[None, :] == FEATURE)
    assert float(graph.adjacency[later].abs().max()) > 0
    # an intervention that changes nothing is the model itself; one at a later position reaches position 0
    with torch.no_grad():
        found = model.run_with_cache(tokens[None])[1]["blocks.0.ln2.hook_normalized"][0, 6]
    feature = int(transcoders(model, 14)[0].feature_activations(found).argmax())
    same = intervene(model, transcoders(model, 14), tokens, [FeatureEdit(0, 6, feature, scale=1.0)])
    close(same.edited, same.clean, atol=1e-4)
    moved = intervene(model, transcoders(model, 14), tokens, [FeatureEdit(0, 6, feature, value=0.0)])
    assert float((moved.edited[0] - moved.clean[0]).abs().max()) > 1e-4
    # its table lists ten tokens each way by default: both of the two classes here, ranked by the change
    frame = moved.to_frame(pos=0)
    change = (moved.edited - moved.clean)[0]
    for direction, order in (("up", change.argsort(descending=True)), ("down", change.argsort())):
        rows = frame[frame.direction == direction]
        assert rows.token_id.tolist() == order.tolist() and rows["rank"].tolist() == [1, 2]
        close(rows.logit_change.to_numpy(), change[order])
        close(rows.clean_prob.to_numpy(), logits_at_0.softmax(-1)[order])
    with pytest.raises(ValueError, match=r"k=3 must be an integer in \[1, d_vocab_out=2\]"):
        moved.to_frame(k=3)


# ---- SAEs, steering, memories ------------------------------------------------------------------------------------
def sae_at(hook_name: str, d_in: int = 56, seed: int = 15) -> SparseAutoencoder:
    sae = SparseAutoencoder(SAEConfig(d_in=d_in, d_sae=16, hook_name=hook_name))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in sae.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    return sae


@torch.no_grad()
def test_sae_features_read_the_padded_batch_as_its_mask_says():
    model = classifier()
    tokens, mask = brackets(16)
    sae = sae_at("blocks.1.hook_resid_pre")
    result = sae_features(model, sae, tokens, attention_mask=mask)
    real = mask.bool()
    for row in range(3):  # each prompt alone, unpadded
        length = int(mask[row].sum())
        _, cache = model.run_with_cache(tokens[row:row + 1, :length])
        acts = sae.encode(cache["blocks.1.hook_resid_pre"])[0]
        assert torch.equal(result.l0[row, :length], (acts > 0).sum(-1))
        close(result.top_activations[row, :length, 0], acts.max(-1).values.clamp(min=0), atol=1e-5)
    assert bool((result.l0[~real] == 0).all())


@torch.no_grad()
def test_the_feature_token_lists_default_to_what_the_vocabularies_hold():
    """Ten tokens per feature by default: the classifier has two output tokens (five input ones), and a k between
    them passed the old check of d_vocab and failed inside topk. The output side ranks the decoder rows through the
    final norm and W_U, the input side the embeddings through W_enc, by hand from the weights."""
    model = classifier()
    sae = sae_at("blocks.1.hook_resid_pre")
    features = [0, 5]
    logits = feature_logits(model, sae, features)
    rows = sae.W_dec[features]
    want = ((rows - rows.mean(-1, keepdim=True)) * model.ln_final.w @ model.W_U).sort(-1, descending=True)
    assert torch.equal(logits.top_ids, want.indices) and torch.equal(logits.bottom_ids, want.indices.flip(-1))
    close(logits.top_logits, want.values, atol=1e-5)
    inputs = feature_inputs(model, sae, features)
    scores = (model.W_E @ sae.W_enc[:, features]).T.sort(-1, descending=True)
    assert torch.equal(inputs.top_ids, scores.indices)
    close(inputs.top_logits, scores.values, atol=1e-5)
    with pytest.raises(ValueError, match=r"k=3 must be an integer in \[1, d_vocab_out=2\]: there are only 2"):
        feature_logits(model, sae, features, k=3)
    with pytest.raises(ValueError, match=r"k=6 must be an integer in \[1, d_vocab=5\]"):
        feature_inputs(model, sae, features, k=6)


@torch.no_grad()
def test_steering_every_position_is_a_hand_written_hook():
    model = classifier()
    tokens, mask = brackets(17)
    direction = torch.randn(56, generator=torch.Generator().manual_seed(18))
    with steer(model, direction, 2.0, layers=1):
        got = model(tokens, attention_mask=mask)
    by_hand = run(model, tokens, mask, [("blocks.1.hook_resid_pre", lambda x, hook: x + 2.0 * direction)])
    real = mask.bool()
    close(got[real], by_hand[real])


@torch.no_grad()
def test_a_steering_vector_from_padded_text_is_each_prompt_alone():
    model = with_tokenizer()
    positive, negative = ["the king is dead, long live", "no"], ["a", "my lord, the queen is here now"]
    vector = steering_vector(model, positive, negative, 1, batch_size=2)

    def last(prompt: str) -> torch.Tensor:
        _, cache = model.run_with_cache(model.to_tokens(prompt))
        return cache["blocks.1.hook_resid_pre"][0, -1]
    want = torch.stack([last(p) for p in positive]).mean(0) - torch.stack([last(p) for p in negative]).mean(0)
    close(vector.direction, want, atol=1e-5)


@torch.no_grad()
def test_memory_lookup_reads_the_coefficients_and_the_prediction_at_a_position():
    model = classifier()
    tokens = brackets(19)[0][0]
    result = memory_lookup(model, tokens, position=2, layer=1, k=4, n_tokens=2)
    logits, cache = model.run_with_cache(tokens[None])
    close(result.coefficients[0], cache["blocks.1.mlp.hook_post"][0, 2], atol=1e-6)
    assert result.predicted_token == int(logits[0, 2].argmax())


DOCUMENTS = ["To be, or not to be", "the rest is silence", "O", "my kingdom for a horse, a horse", "alas, poor Yorick"]


def alone(model: HookedDecoder, name: str) -> list[torch.Tensor]:
    """Each document's activations at `name` [pos ...] run alone (BOS + its tokens, no padding), BOS dropped."""
    out = []
    for text in DOCUMENTS:
        _, cache = model.run_with_cache(model.to_tokens(text), names=[name])
        out.append(cache[name][0, 1:])
    return out


@torch.no_grad()
def test_top_triggers_of_right_padded_windows_are_each_document_alone():
    model = with_tokenizer()
    found = top_triggers(model, DOCUMENTS, layers=0, neurons=[0, 3, 7], k=4, batch_size=4, progress=False)
    acts = alone(model, "blocks.0.mlp.hook_post")
    for i, neuron in enumerate([0, 3, 7]):
        every = torch.cat([a[:, neuron] for a in acts])
        close(found.activations[0, i], every.topk(4).values, atol=1e-5)
        for slot in range(4):
            doc, pos = int(found.docs[0, i, slot]), int(found.positions[0, i, slot])
            close(found.activations[0, i, slot], acts[doc][pos, neuron], atol=1e-5)


@torch.no_grad()
def test_a_feature_scan_of_right_padded_windows_is_each_document_alone():
    model = with_tokenizer()
    sae = sae_at("blocks.1.hook_resid_pre", d_in=32)
    scan = feature_scan(model, sae, DOCUMENTS, k=3, batch_size=4, before=2, after=1, progress=False)
    acts = torch.cat([sae.feature_activations(a) for a in alone(model, "blocks.1.hook_resid_pre")])  # [token feature]
    assert torch.equal(scan.active, (acts > 0).sum(0))
    top = acts.topk(3, dim=0).values.T  # [feature k]
    close(scan.top_activations, torch.where(top > 0, top, 0.0), atol=1e-5)


# ---- refusals ----------------------------------------------------------------------------------------------------
TOKENS, MASK = brackets(20)
OTHER = paired(20)[1]
NEXT_TOKEN = f"with the next-token loss metric: {BIDIRECTIONAL}, so every position already sees the token after it"


def empty(model):
    return Circuit(graph=circuit_graph(model), edges=torch.zeros(0, dtype=torch.long))


REFUSED = {
    "head_ablation_effects default": (lambda m: head_ablation_effects(m, TOKENS),
                                      f"head_ablation_effects {NEXT_TOKEN}.*logit_diff_metric"),
    "patch loss": (lambda m: patch(m, TOKENS, OTHER, loss_metric), f"patch {NEXT_TOKEN}"),
    "attribution_patch loss": (lambda m: attribution_patch(m, TOKENS, OTHER, loss_metric), f"patch {NEXT_TOKEN}"),
    "edge_attribution loss": (lambda m: edge_attribution(m, TOKENS, OTHER, loss_metric), f"edge_attribution {NEXT_TOKEN}"),
    "faithfulness loss": (lambda m: faithfulness(m, empty(m), TOKENS, OTHER, loss_metric), f"faithfulness {NEXT_TOKEN}"),
    "path_patch loss": (lambda m: path_patch(m, TOKENS, OTHER, loss_metric, "L0H0", "L1H0"), f"path_patch {NEXT_TOKEN}"),
    "head_importance default": (lambda m: head_importance(m, TOKENS, progress=False), f"head_importance {NEXT_TOKEN}"),
    "evaluate_masks": (lambda m: evaluate_masks(m, [TOKENS], torch.ones(1, 3, 2)),
                       f"evaluate_masks: {BIDIRECTIONAL}.*next-token loss and accuracy.*head_importance"),
    "prune_by_importance": (lambda m: prune_by_importance(m, TOKENS, progress=False),
                            f"prune_by_importance: {BIDIRECTIONAL}.*then prune_heads"),
    "sae_loss_recovered": (lambda m: sae_loss_recovered(m, sae_at("blocks.1.hook_resid_pre"), TOKENS),
                           f"sae_loss_recovered: {BIDIRECTIONAL}.*sae_features' fvu and l0"),
    "sae_eval": (lambda m: sae_eval(m, sae_at("blocks.1.hook_resid_pre")), f"sae_eval: {BIDIRECTIONAL}.*sae_features"),
    "steering_sweep": (lambda m: steering_sweep(m, torch.ones(56), TOKENS, [1.0], layers=1, progress=False),
                       f"steering_sweep: {BIDIRECTIONAL}.*fluency cost.*with steer"),
    "steer prompt": (lambda m: steer(m, torch.ones(56), layers=1, positions="prompt"),
                     f"steering positions='prompt': {BIDIRECTIONAL}, so it does not generate.*positions='all'"),
    "steer generated": (lambda m: steer(m, torch.ones(56), layers=1, positions="generated"),
                        f"steering positions='generated': {BIDIRECTIONAL}"),
    "agreement": (lambda m: agreement(m, None), f"agreement: {BIDIRECTIONAL}.*memory_lookup"),
    "generate": (lambda m: m.generate(TOKENS[:1], 2), f"generate: {BIDIRECTIONAL}"),
    "generate uncached": (lambda m: m.generate(TOKENS[:1], 2, use_past_kv_cache=False), f"generate: {BIDIRECTIONAL}"),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_what_needs_a_causal_model_is_refused_up_front_saying_what_to_do(what):
    call, match = REFUSED[what]
    with pytest.raises(ValueError, match=match):
        call(classifier())
