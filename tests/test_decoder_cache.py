"""The cache's transformer-lens methods, written as transformer-lens's demos write them (logit lens, logit difference
attribution by layer and by head, decompositions, gradient caches), each a function of `model` alone and run on
probe and on transformer-lens's bridge over the same checkpoint: the results must agree to 1e-4."""
from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
from einops import einsum, rearrange

import probe
from probe import HookedDecoder
from probe.decoder_cache import DecoderCache, ModelGoneError

from tl_oracle import assert_same, bridge

PROMPT = "To be, or not to be, that is the question"
PROMPTS = [PROMPT, "What light through yonder window breaks? It is"]  # both 13 tokens: no padding
ANSWERS = [(" the", " a"), (" the", " and")]


@pytest.fixture(scope="module")
def ours():
    return HookedDecoder.from_pretrained(probe.DEFAULT_MODEL).eval()


@pytest.fixture(scope="module")
def theirs():
    return bridge(probe.DEFAULT_MODEL)


def answer_tokens(model):
    return torch.tensor([[model.to_single_token(a) for a in pair] for pair in ANSWERS])  # [batch 2]


def residual_stack_to_logit_diff(model, cache, stack):
    """The Exploratory_Analysis_Demo's helper: the stack through ln_final's cached scale, dotted with each prompt's
    logit difference direction, averaged over prompts."""
    answers = answer_tokens(model)
    directions = model.W_U[:, answers[:, 0]] - model.W_U[:, answers[:, 1]]  # [d_model batch]
    scaled = cache.apply_ln_to_stack(stack, layer=-1, pos_slice=-1)
    return einsum(scaled, directions.T, "... batch d_model, batch d_model -> ...") / len(PROMPTS)


# ---- the cases: each takes a model (probe's or transformer-lens's) and returns what it computed ---------------------
def keys_in_short_forms(model):
    _, cache = model.run_with_cache(PROMPT)
    return [cache["pattern", 0], cache["pattern", 0, "attn"], cache["resid_post", -1], cache["embed"],
            cache["pos_embed"], cache["scale", 2, "ln1"], cache["scale"], cache["q", 1], cache["normalized", 3, "ln2"],
            cache["z", -2, "a"], cache["post", 1, "mlp"], cache["blocks.1.hook_mlp_out"], cache["resid_pre", 2, "b"]]


def logit_lens_at_the_last_position(model):
    _, cache = model.run_with_cache(PROMPT)
    accum, labels = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, apply_ln=True, return_labels=True)
    return accum @ model.W_U, labels


def logit_lens_rank_of_the_answer(model):
    _, cache = model.run_with_cache(PROMPT)
    accum, labels = cache.accumulated_resid(return_labels=True, apply_ln=True)
    layer_logits = accum[:, 0, -1, :] @ model.W_U
    ranks = (layer_logits.argsort(dim=-1, descending=True) == model.to_single_token(" the")).nonzero()[:, 1]
    return ranks.tolist(), labels


def accumulated_resid_into_a_middle_mlp(model):
    _, cache = model.run_with_cache(PROMPT)
    return cache.accumulated_resid(layer=2, mlp_input=True, apply_ln=True, return_labels=True)


def accumulated_resid_pos_slices(model):
    _, cache = model.run_with_cache(PROMPT)
    return [cache.accumulated_resid(pos_slice=s) for s in ((1, 5), [0, 3, 7], slice(2, None, 3), torch.tensor([1, 2]), 4)]


def logit_diff_by_accumulated_layer(model):
    _, cache = model.run_with_cache(model.to_tokens(PROMPTS))
    accum, labels = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, return_labels=True)
    return residual_stack_to_logit_diff(model, cache, accum), labels


def logit_diff_by_sublayer(model):
    _, cache = model.run_with_cache(model.to_tokens(PROMPTS))
    per_layer, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
    return residual_stack_to_logit_diff(model, cache, per_layer), labels


def logit_diff_by_head(model):
    _, cache = model.run_with_cache(model.to_tokens(PROMPTS))
    per_head, labels = cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
    diffs = residual_stack_to_logit_diff(model, cache, per_head)
    return rearrange(diffs, "(layer head_index) -> layer head_index", layer=model.cfg.n_layers), labels


def decompose_resid_modes(model):
    _, cache = model.run_with_cache(PROMPT)
    return [cache.decompose_resid(mode="attn", return_labels=True),
            cache.decompose_resid(mode="mlp", incl_embeds=False, return_labels=True),
            cache.decompose_resid(layer=2, mlp_input=True, apply_ln=True, return_labels=True),
            cache.decompose_resid(layer=0, return_labels=True)]


def stack_head_results_with_remainder(model):
    _, cache = model.run_with_cache(PROMPT)
    return [cache.stack_head_results(layer=2, incl_remainder=True, apply_ln=True, return_labels=True),
            cache.stack_head_results(layer=0, incl_remainder=True, return_labels=True),
            cache.stack_head_results(layer=0).shape]


def compute_head_results(model):
    _, cache = model.run_with_cache(PROMPT)
    cache.compute_head_results()
    return [cache["result", layer, "attn"] for layer in range(model.cfg.n_layers)] + [cache["blocks.1.attn.hook_result"]]


def full_decomposition_of_the_last_position(model):
    _, cache = model.run_with_cache(PROMPT)
    return cache.get_full_resid_decomposition(expand_neurons=False, apply_ln=True, pos_slice=-1, return_labels=True)


def full_decomposition_into_an_mlp_adds_up(model):
    _, cache = model.run_with_cache(PROMPT)
    stack, labels = cache.get_full_resid_decomposition(layer=2, mlp_input=True, return_labels=True)
    return stack, labels, stack.sum(dim=0)


def neuron_stack(model):
    _, cache = model.run_with_cache(PROMPT)
    return cache.stack_neuron_results(2, pos_slice=-1, neuron_slice=[0, 5, 17], return_labels=True,
                                      incl_remainder=True, apply_ln=True)


def neuron_results(model):
    _, cache = model.run_with_cache(PROMPT)
    return [cache.get_neuron_results(1, neuron_slice=(0, 10), pos_slice=-1), cache.get_neuron_results(3, neuron_slice=7)]


def neurons_projected_onto_the_answer(model):
    _, cache = model.run_with_cache(PROMPT)
    direction = model.W_U[:, model.to_single_token(" the")]
    both = model.W_U[:, [model.to_single_token(" the"), model.to_single_token(" a")]]
    return [cache.stack_neuron_results(2, apply_ln=True, project_output_onto=direction, incl_remainder=True),
            cache.stack_neuron_results(1, pos_slice=-1, project_output_onto=both),
            cache.get_full_resid_decomposition(apply_ln=True, pos_slice=-1, project_output_onto=both),
            cache.get_neuron_results(1, pos_slice=-1, project_output_onto=direction),
            cache.get_neuron_results(2, neuron_slice=(0, 9), project_output_onto=both)]


def logit_attrs_for_token_strings(model):
    _, cache = model.run_with_cache(PROMPT)
    stack, labels = cache.decompose_resid(return_labels=True)
    return cache.logit_attrs(stack, " the", incorrect_tokens=" a"), labels


def logit_attrs_one_answer_per_prompt(model):
    _, cache = model.run_with_cache(model.to_tokens(PROMPTS))
    answers = answer_tokens(model)
    stack = cache.accumulated_resid(pos_slice=-1)
    return [cache.logit_attrs(stack, answers[:, 0], pos_slice=-1),
            cache.logit_attrs(stack, answers[:, 0], incorrect_tokens=answers[:, 1], pos_slice=-1)]


def logit_attrs_of_every_next_token(model):
    tokens = model.to_tokens(PROMPTS)
    _, cache = model.run_with_cache(tokens)
    stack = cache.decompose_resid(pos_slice=(0, -1))
    return cache.logit_attrs(stack, tokens[:, 1:], pos_slice=(0, -1))


def logit_attrs_one_answer_everywhere_full_positions(model):
    _, cache = model.run_with_cache(model.to_tokens(PROMPTS))
    return cache.logit_attrs(cache.decompose_resid(), answer_tokens(model)[:, 0])


def batch_slices(model):
    _, cache = model.run_with_cache(model.to_tokens(PROMPTS))
    stack = cache.decompose_resid(pos_slice=-1)
    return [cache.apply_ln_to_stack(stack, layer=-1, pos_slice=-1, batch_slice=[1]),
            cache.logit_attrs(stack, model.to_single_token(" the"), pos_slice=-1, batch_slice=1),
            cache.apply_slice_to_batch_dim(1)["resid_post", 3]]


def stack_activation(model):
    _, cache = model.run_with_cache(PROMPT)
    return [cache.stack_activation("pattern"), cache.stack_activation("scale", sublayer_type="ln1"),
            cache.stack_activation("resid_post", layer=2)]


def apply_ln_into_a_middle_layer(model):
    _, cache = model.run_with_cache(PROMPT)
    stack = cache.decompose_resid(layer=1, mlp_input=True)
    return [cache.apply_ln_to_stack(stack, layer=1, mlp_input=True),
            cache.apply_ln_to_stack(cache.accumulated_resid(layer=3, pos_slice=5), layer=3, pos_slice=5)]


def cache_without_its_batch_dim(model):
    _, cache = model.run_with_cache(PROMPT, remove_batch_dim=True)
    stack = cache.decompose_resid(apply_ln=True)
    return [cache.has_batch_dim, cache["pattern", 1], cache.accumulated_resid(apply_ln=True, pos_slice=-1), stack,
            cache.stack_head_results(pos_slice=-1, apply_ln=True),
            cache.logit_attrs(cache.decompose_resid(), " the", has_batch_dim=False)]


def remove_batch_dim_afterwards(model):
    _, cache = model.run_with_cache(PROMPT)
    cache.remove_batch_dim()
    return [cache.has_batch_dim, cache["resid_pre", 1], cache.accumulated_resid(layer=2, apply_ln=True),
            cache.get_full_resid_decomposition(layer=1, apply_ln=True, pos_slice=[2, 4])]


def mapping_methods(model):
    _, cache = model.run_with_cache(PROMPT, names_filter=lambda name: name.endswith("hook_pattern"))
    return sorted(cache.keys()), {name: act for name, act in cache.items()}, len(list(cache.values()))


def moved_cache(model):
    _, cache = model.run_with_cache(PROMPT)
    cache = cache.to("cpu")
    return cache.accumulated_resid(apply_ln=True, pos_slice=-1), cache.stack_head_results(pos_slice=-1)


def gradient_cache(model):
    loss, cache = model.run_with_cache(PROMPT, return_type="loss", incl_bwd=True)
    return [loss, cache["blocks.0.hook_resid_pre_grad"], cache["resid_pre_grad", 2], cache["blocks.3.attn.hook_pattern_grad"]]


def attribution_patching_of_resid_pre(model):
    """The Attribution_Patching_Demo's linear estimate: gradient at the corrupted run times the clean - corrupted
    difference, summed over d_model, for each layer and position."""
    clean, corrupted = model.to_tokens(PROMPTS[0]), model.to_tokens(PROMPTS[1])
    _, clean_cache = model.run_with_cache(clean)
    _, grad_cache = model.run_with_cache(corrupted, return_type="loss", incl_bwd=True)
    return torch.stack([(grad_cache["resid_pre_grad", l] * (clean_cache["resid_pre", l] - grad_cache["resid_pre", l])).sum(-1)
                        for l in range(model.cfg.n_layers)])


CASES = [keys_in_short_forms, logit_lens_at_the_last_position, logit_lens_rank_of_the_answer,
         accumulated_resid_into_a_middle_mlp, accumulated_resid_pos_slices, logit_diff_by_accumulated_layer,
         logit_diff_by_sublayer, logit_diff_by_head, decompose_resid_modes, stack_head_results_with_remainder,
         compute_head_results, full_decomposition_of_the_last_position, full_decomposition_into_an_mlp_adds_up,
         neuron_stack, neuron_results, neurons_projected_onto_the_answer, logit_attrs_for_token_strings,
         logit_attrs_one_answer_per_prompt, logit_attrs_of_every_next_token,
         logit_attrs_one_answer_everywhere_full_positions, batch_slices, stack_activation,
         apply_ln_into_a_middle_layer, cache_without_its_batch_dim, remove_batch_dim_afterwards, mapping_methods,
         moved_cache, gradient_cache, attribution_patching_of_resid_pre]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__)
def test_runs_as_transformer_lens_runs_it(case, ours, theirs):
    assert_same(case(ours), case(theirs), what=case.__name__)


# ---- other families, where transformer-lens's bridge loads them -------------------------------------------------
def family_tokens(model):
    return torch.randint(0, 90, (2, 9), generator=torch.Generator().manual_seed(0))


def family_logit_lens(model):
    _, cache = model.run_with_cache(family_tokens(model))
    accum, labels = cache.accumulated_resid(apply_ln=True, pos_slice=-1, return_labels=True)
    return accum @ model.W_U, labels


def family_logit_attrs_by_sublayer(model):
    tokens = family_tokens(model)
    _, cache = model.run_with_cache(tokens)
    stack, labels = cache.decompose_resid(apply_ln=True, return_labels=True)
    return stack, labels, cache.logit_attrs(cache.decompose_resid(pos_slice=-1), tokens[:, -1], pos_slice=-1)


def family_heads(model):
    _, cache = model.run_with_cache(family_tokens(model))
    return [cache.stack_head_results(incl_remainder=True, apply_ln=True, pos_slice=-1, return_labels=True),
            cache.get_full_resid_decomposition(expand_neurons=False, apply_ln=True, return_labels=True)]


def family_mlp_norm_scale(model):
    _, cache = model.run_with_cache(family_tokens(model))
    return cache.apply_ln_to_stack(cache.accumulated_resid(layer=1), layer=1, mlp_input=True)


FAMILY_CASES = {  # the cases each family's blocks allow; the others are refused (see test_refusals_say_why)
    "qwen3": [family_logit_lens, family_logit_attrs_by_sublayer, family_heads, family_mlp_norm_scale],
    "neox": [family_logit_lens, family_logit_attrs_by_sublayer, family_heads, family_mlp_norm_scale],
    "gemma2": [family_logit_lens, family_logit_attrs_by_sublayer, family_mlp_norm_scale],
    "gptneo": [family_logit_lens, family_logit_attrs_by_sublayer, family_heads, family_mlp_norm_scale],
    # OPT's mlp_input norm scale too, but the bridge caches OPT's ln2 scale flattened and cannot apply it
    "opt": [family_logit_lens, family_logit_attrs_by_sublayer, family_heads],
    "phi": [family_logit_lens, family_logit_attrs_by_sublayer, family_heads],
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    from test_variants import build

    dirs = {}
    for family in FAMILY_CASES:
        dirs[family] = tmp_path_factory.mktemp(family)
        build(family, dirs[family])
    return dirs


@pytest.mark.parametrize("family,case", [(f, c) for f, cases in FAMILY_CASES.items() for c in cases],
                         ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_other_families_run_as_transformer_lens_runs_them(family, case, family_dirs):
    ours = HookedDecoder.from_pretrained(family_dirs[family]).eval()
    assert_same(case(ours), case(bridge(str(family_dirs[family]))), what=f"{family}: {case.__name__}")


def test_refusals_say_why(family_dirs, tmp_path):
    from test_variants import build

    def cache_of(directory):
        model = HookedDecoder.from_pretrained(directory).eval()
        return model, model.run_with_cache(family_tokens(model))[1]

    _, neox = cache_of(family_dirs["neox"])
    for call in (lambda: neox.decompose_resid(layer=1, mlp_input=True), lambda: neox.accumulated_resid(incl_mid=True),
                 lambda: neox.get_full_resid_decomposition(layer=1, mlp_input=True)):
        with pytest.raises(ValueError, match="parallel block .* no resid_mid"):
            call()
    _, gemma2 = cache_of(family_dirs["gemma2"])
    for call in (gemma2.stack_head_results, lambda: gemma2.stack_neuron_results(1), gemma2.get_full_resid_decomposition):
        with pytest.raises(ValueError, match="ln1_post / ln2_post .* not residual contributions"):
            call()
    gemma2.compute_head_results()  # hook_result itself is defined (z @ W_O, before ln1_post), and stacks on request
    assert gemma2.stack_activation("result").shape[:2] == (3, 2)
    build("gpt1", tmp_path)
    _, gpt1 = cache_of(tmp_path)
    with pytest.raises(ValueError, match="post-norm"):
        gpt1.decompose_resid()
    with pytest.raises(ValueError, match="post-norm block ln1 and ln2 normalise sums"):
        gpt1.accumulated_resid(layer=1, apply_ln=True)
    assert gpt1.accumulated_resid(apply_ln=True).shape[0] == 4  # no final norm: the residual is what the unembedding reads


# ---- probe's own behaviour where transformer-lens has none to compare with -----------------------------------------
def test_methods_that_need_weights_say_so_once_the_model_is_gone():
    model = HookedDecoder.from_pretrained(probe.DEFAULT_MODEL).eval()
    _, cache = model.run_with_cache(PROMPT)
    expected = cache.accumulated_resid(apply_ln=True)
    del model
    gc.collect()
    assert cache._model() is None  # the cache never kept the model alive
    # what the cache alone holds still works: keys, stacks, cached scales
    assert cache["pattern", -1].shape[1] == 6
    stack = cache.decompose_resid(apply_ln=True)
    assert cache.apply_ln_to_stack(cache.accumulated_resid(layer=2), layer=2).shape[0] == 3
    for call in (lambda: cache.accumulated_resid(apply_ln=True), lambda: cache.logit_attrs(stack, " the"),
                 cache.stack_head_results, cache.compute_head_results, lambda: cache.get_neuron_results(0),
                 cache.get_full_resid_decomposition):
        with pytest.raises(ModelGoneError, match="model this cache came from has been deleted.*keep the model alive"):
            call()
    assert expected.shape == (5, 1, 13, 192)


def test_a_cache_saved_with_torch_save_loads_its_activations_and_no_model(ours, tmp_path):
    # transformer-lens's ActivationCache pickles (with its model); users write torch.save(cache, f)
    _, cache = ours.run_with_cache(PROMPTS)
    sliced = cache.apply_slice_to_batch_dim(slice(0, 1))
    torch.save({"cache": cache, "sliced": sliced}, tmp_path / "cache.pt")
    loaded = torch.load(tmp_path / "cache.pt", weights_only=False)
    for original, back in ((cache, loaded["cache"]), (sliced, loaded["sliced"])):
        assert type(back) is DecoderCache and list(back) == list(original)
        assert back.has_batch_dim == original.has_batch_dim
        for name in original:
            assert torch.equal(back[name], original[name])
    back = loaded["cache"]
    # the config came along: what the activations alone give still works, TL's keys too
    assert torch.equal(back["pattern", 1], cache["pattern", 1])
    torch.testing.assert_close(back.decompose_resid(apply_ln=True), cache.decompose_resid(apply_ln=True))
    for call in (lambda: back.accumulated_resid(apply_ln=True), back.stack_head_results,
                 lambda: back.apply_slice_to_batch_dim(0).get_neuron_results(0)):
        with pytest.raises(ModelGoneError, match="loaded from a file.*run the prompt again"):
            call()
    # torch.load's default (weights_only=True) unpickles tensors and containers only, and says what it met
    with pytest.raises(pickle.UnpicklingError, match="DecoderCache"):
        torch.load(tmp_path / "cache.pt")
    torch.save(dict(cache.items()), tmp_path / "tensors.pt")  # the activations alone load with weights_only=True
    assert torch.equal(torch.load(tmp_path / "tensors.pt", weights_only=True)[PROMPT_NAME], cache[PROMPT_NAME])


def test_a_deep_copy_keeps_its_model(ours):
    _, cache = ours.run_with_cache(PROMPT)
    copied = copy.deepcopy(cache)
    assert copied._model() is ours and copied[PROMPT_NAME] is not cache[PROMPT_NAME]
    torch.testing.assert_close(copied.stack_head_results(), cache.stack_head_results())


PROMPT_NAME = "blocks.1.hook_resid_post"


def test_remove_batch_dim_needs_one_prompt_and_happens_once(ours):
    _, cache = ours.run_with_cache(ours.to_tokens(PROMPTS))
    with pytest.raises(ValueError, match=r"one prompt, got batch sizes \[2\].*apply_slice_to_batch_dim"):
        cache.remove_batch_dim()
    one = cache.apply_slice_to_batch_dim(1)
    assert isinstance(one, DecoderCache) and not one.has_batch_dim and one["embed"].shape == (13, 192)
    _, cache = ours.run_with_cache(PROMPT)
    before = cache["resid_pre", 1]
    assert cache.remove_batch_dim() is cache and cache.remove_batch_dim() is cache  # in place, as transformer-lens
    assert not cache.has_batch_dim and torch.equal(cache["resid_pre", 1], before[0])
    with pytest.raises(ValueError, match="no batch dimension"):
        cache.apply_slice_to_batch_dim(0)


def test_to_moves_in_place_and_keeps_the_model_and_the_batch_dim(ours):
    _, cache = ours.run_with_cache(PROMPT, remove_batch_dim=True)
    _, moved = ours.run_with_cache(PROMPT, remove_batch_dim=True)
    assert moved.to(dtype=torch.float64) is moved  # in place, as transformer-lens's to(), and returned
    assert type(moved) is DecoderCache and moved._model() is ours and moved.has_batch_dim is False
    assert moved["embed"].dtype == torch.float64 and cache["embed"].dtype == torch.float32
    assert moved.logit_attrs(moved.decompose_resid(), " the", has_batch_dim=False).dtype == torch.float64
    torch.testing.assert_close(moved.accumulated_resid(apply_ln=True).float(), cache.accumulated_resid(apply_ln=True))
    _, half = ours.run_with_cache(PROMPT, remove_batch_dim=True)
    half.to("cpu", torch.bfloat16)
    torch.testing.assert_close(half.stack_head_results(pos_slice=-1).float(), cache.stack_head_results(pos_slice=-1),
                               atol=2e-2, rtol=2e-2)  # bfloat16 storage, float32 weights: computed in float32


def test_keys_are_strict_and_helpful(ours):
    _, cache = ours.run_with_cache(PROMPT)
    assert ("pattern", 0) in cache and "embed" in cache and ("pattern", 9) not in cache and "k6" not in cache
    assert "k1" in cache  # transformer-lens's shorthand (test_transformer_lens_shorthand_keys)
    for key, message in ((("pattern", 9), "closest valid names: blocks"),
                         ("resid_pre", "inside a block: give its layer, e.g. cache\\['resid_pre', 0\\]"),
                         ("k6", "closest valid names"),
                         ("resid_pre6", "no shorthand with an underscore; write cache\\['resid_pre', 6\\]"),
                         ("k1m", "'k' is in attn, not in 'm'"),
                         (("resid_pre", 0, "attn"), "in the block itself, not in 'attn'"),
                         (("scale", 1), "needs a layer and norm='ln1' or 'ln2'"),
                         (("pattern", "0"), "layer must be an int"),
                         ("blocks.0.hook_resid_pre_grad", "incl_bwd=True"),
                         (3, "hook names \\(str\\) or \\(kind, layer")):
        with pytest.raises(KeyError, match=message):
            cache[key]
    _, grads = ours.run_with_cache(PROMPT, return_type="loss", incl_bwd=True)
    assert torch.equal(grads["pattern_grad", 1], grads["blocks.1.attn.hook_pattern_grad"])
    assert torch.equal(grads["scale_grad"], grads["ln_final.hook_scale_grad"])


def test_bad_arguments_name_the_fix(ours):
    _, cache = ours.run_with_cache(PROMPT)
    with pytest.raises(ValueError, match="pos_slice=2.5 is not a slice input"):
        cache.accumulated_resid(pos_slice=2.5)
    with pytest.raises(ValueError, match="layer=7 must be an int in \\[0, n_layers=4\\]"):
        cache.decompose_resid(layer=7)
    with pytest.raises(ValueError, match="mlp_input=True needs the layer whose MLP reads the stack"):
        cache.get_full_resid_decomposition(mlp_input=True)
    with pytest.raises(ValueError, match="mode='heads' is not one of"):
        cache.decompose_resid(mode="heads")
    with pytest.raises(ValueError, match="same shape"):
        cache.logit_attrs(cache.decompose_resid(), " the", incorrect_tokens=torch.tensor([259, 292]))
    with pytest.raises(RuntimeError, match="torch.set_grad_enabled\\(False\\)"):
        cache.toggle_autodiff()
    _, partial = ours.run_with_cache(PROMPT, names_filter=lambda n: "resid" in n)
    with pytest.raises(KeyError, match="apply_ln needs an activation this cache lacks: .*'blocks.2.ln1.hook_scale'.*names_filter"):
        partial.accumulated_resid(layer=2, apply_ln=True)


def test_transformer_lens_shorthand_keys(ours):
    """cache["k1"], cache["scale2ln1"], ...: the name transformer-lens's own get_act_name gives each shorthand."""
    utilities = pytest.importorskip("transformer_lens.utilities")
    _, cache = ours.run_with_cache(PROMPT)
    for key in ("k1", "q0", "pattern2", "attn2", "z3", "pre2", "post0", "scale2ln1", "normalized1ln2",
                "k1a", "pre2m", "scale0ln2"):
        name = utilities.get_act_name(key)
        assert name in cache.keys(), key
        assert cache[key] is cache[name], key
    _, grads = ours.run_with_cache(PROMPT, return_type="loss", incl_bwd=True)
    assert grads["k1_grad"] is grads["blocks.1.attn.hook_k_grad"]


def test_olmo2_sublayers_read_the_residual_itself():
    """OLMo 2 normalises only each sublayer's write: the residual a layer's attention or MLP reads is the stack
    itself, so apply_ln_to_stack below the final layer divides by nothing (the final layer's norm still applies)."""
    import tempfile

    from test_variants import build

    with tempfile.TemporaryDirectory() as directory:
        build("olmo2", directory)
        model = HookedDecoder.from_pretrained(directory).eval()
    tokens = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    stack = cache.accumulated_resid(layer=1)
    for mlp_input in (False, True):
        assert torch.equal(cache.apply_ln_to_stack(stack, layer=1, mlp_input=mlp_input), stack)
    final = cache.accumulated_resid(layer=-1)
    scale = cache["ln_final.hook_scale"]
    torch.testing.assert_close(cache.apply_ln_to_stack(final, layer=-1, recompute_ln=False), final / scale)
