"""TransformerLens code, run unchanged on probe: each case is written in TL's own idiom (the calls, keywords,
indexing and signatures of TL's Main_Demo, Exploratory_Analysis_Demo, Activation_Patching_in_TL_Demo,
Attribution_Patching_Demo, Head_Detector_Demo and ARENA 1.2; written here) as a function of `model` alone. Each
runs on the bundled model and on transformer-lens's TransformerBridge over the same directory (compatibility
mode, unprocessed weights), and the results must agree to 1e-4."""
from __future__ import annotations

import contextlib
import io
from functools import partial

import pytest
import torch

from probe import DEFAULT_MODEL, HookedDecoder
from tl_oracle import assert_same, bridge

PROMPT = "ROMEO. But soft, what light through yonder window breaks?"
PROMPTS = ["ROMEO. But soft, what light", "JULIET. O Romeo, Romeo! wherefore art thou Romeo?", "KING."]


@pytest.fixture(scope="module")
def models():
    ours = HookedDecoder.from_pretrained(DEFAULT_MODEL).eval()
    return ours, bridge(DEFAULT_MODEL)


def clean_and_corrupted(model):
    clean = model.to_tokens("ROMEO. But soft, what")  # short: patching sweeps run one forward per site
    corrupted = clean.clone()
    corrupted[0, 1] = clean[0, 3]  # the speaker's name replaced by another token: same length
    return clean, corrupted


def logit_diff(logits):
    return logits[0, -1, 17] - logits[0, -1, 42]


# ---- the forward and its keywords ------------------------------------------------------------------------
def case_logits_of_text(model):
    return model(PROMPT)


def case_logits_of_tokens(model):
    tokens = model.to_tokens(PROMPT)
    return model(tokens, return_type="logits")[0, -1]


def case_loss(model):
    return model(PROMPT, return_type="loss")


def case_loss_of_a_right_padded_batch(model):
    return model(PROMPTS, return_type="loss")


def case_loss_of_a_left_padded_batch(model):
    return model(PROMPTS, return_type="loss", padding_side="left")


def case_loss_per_token(model):
    return model(model.to_tokens(PROMPTS), return_type="loss", loss_per_token=True)


def case_both(model):
    logits, loss = model(PROMPT, return_type="both")
    return logits[:, -3:], loss


def case_return_type_none(model):
    return model(PROMPT, return_type=None)


def case_without_bos(model):
    return model(PROMPT, prepend_bos=False, return_type="loss")


def case_stop_at_layer(model):
    return model(model.to_tokens(PROMPT), stop_at_layer=2)


def case_loss_fn(model):
    tokens = model.to_tokens(PROMPTS)
    logits = model(tokens)
    return model.loss_fn(logits, tokens), model.loss_fn(logits, tokens, per_token=True)


def case_loss_with_attention_mask(model):
    tokens = model.to_tokens(PROMPTS)
    mask = (tokens != model.tokenizer.pad_token_id).long()
    mask[:, 0] = 1  # the BOS is the pad token here
    return model(tokens, attention_mask=mask, return_type="loss")


def case_bos_attention(model):
    # Main_Demo: how much attention every head pays to the BOS token
    _, cache = model.run_with_cache(PROMPT)
    return torch.stack([cache["pattern", layer][0, :, :, 0].mean(-1) for layer in range(model.cfg.n_layers)])


# ---- run_with_cache ----------------------------------------------------------------------------------
def case_cache_by_full_name(model):
    logits, cache = model.run_with_cache(model.to_tokens(PROMPT))
    return logits, cache["blocks.0.attn.hook_pattern"], cache["blocks.3.hook_resid_post"], cache["ln_final.hook_scale"]


def case_cache_short_keys(model):
    _, cache = model.run_with_cache(PROMPT)
    return (cache["pattern", 0], cache["pattern", 1, "attn"], cache["resid_post", -1], cache["embed"],
            cache["pos_embed"], cache["scale", 2, "ln1"], cache["scale"], cache["q", 1], cache["z", 3, "attn"],
            cache["post", 2], cache["mlp_out", 0], cache["attn_scores", 1][..., :1, :1])


def case_names_filter_predicate(model):
    _, cache = model.run_with_cache(PROMPT, names_filter=lambda name: name.endswith("hook_z"))
    return {name: cache[name] for name in cache.keys()}


def case_names_filter_list_and_string(model):
    _, some = model.run_with_cache(PROMPT, names_filter=["blocks.1.hook_resid_pre", "blocks.2.mlp.hook_post"])
    _, one = model.run_with_cache(PROMPT, names_filter="blocks.0.hook_attn_out")
    return sorted(some.keys()), some["blocks.2.mlp.hook_post"], list(one.keys()), one["blocks.0.hook_attn_out"]


def case_remove_batch_dim(model):
    _, cache = model.run_with_cache(PROMPT, remove_batch_dim=True)
    return cache["pattern", 2], cache["resid_pre", 1], cache["scale", 0, "ln2"]


def case_cache_with_loss(model):
    loss, cache = model.run_with_cache(PROMPT, return_type="loss")
    return loss, cache["resid_mid", 2]


def case_incl_bwd(model):
    loss, cache = model.run_with_cache(PROMPT, return_type="loss", incl_bwd=True,
                                       names_filter=lambda name: name.endswith(("resid_pre", "hook_z")))
    return cache["blocks.1.hook_resid_pre_grad"], cache["blocks.2.attn.hook_z_grad"], cache["blocks.0.hook_resid_pre"]


def case_plain_dict_cache(model):
    _, cache = model.run_with_cache(PROMPT, return_cache_object=False, names_filter=lambda n: "hook_resid" in n)
    return type(cache).__name__, sorted(cache), cache["blocks.2.hook_resid_mid"]


def case_stop_at_layer_cache(model):
    resid, cache = model.run_with_cache(PROMPT, stop_at_layer=2, names_filter=lambda n: n.endswith("resid_pre"))
    return resid, sorted(cache.keys())


# ---- hooks --------------------------------------------------------------------------------------------
def head_ablation_hook(z, hook, head_index_to_ablate):
    z[:, :, head_index_to_ablate, :] = 0.0
    return z


def case_ablate_a_head(model):
    tokens = model.to_tokens(PROMPT)
    hook = partial(head_ablation_hook, head_index_to_ablate=3)
    return model.run_with_hooks(tokens, return_type="loss", fwd_hooks=[("blocks.1.attn.hook_z", hook)])


def case_patch_resid_at_a_position(model):
    clean, corrupted = clean_and_corrupted(model)
    _, clean_cache = model.run_with_cache(clean)

    def patch_residual(resid, hook, position):
        resid[:, position, :] = clean_cache[hook.name][:, position, :]
        return resid

    out = []
    for layer in range(model.cfg.n_layers):
        logits = model.run_with_hooks(corrupted, fwd_hooks=[(f"blocks.{layer}.hook_resid_pre",
                                                             partial(patch_residual, position=1))])
        out.append(logit_diff(logits))
    return torch.stack(out)


def case_hook_name_and_layer(model):
    seen = []

    def record(act, hook):
        seen.append((hook.name, hook.layer(), tuple(act.shape)))

    model.run_with_hooks(PROMPT, fwd_hooks=[(lambda name: name.endswith("pattern"), record)])
    return seen


def case_hook_ctx(model):
    def store(act, hook):
        hook.ctx["norm"] = act.norm(dim=-1)

    model.run_with_hooks(PROMPT, fwd_hooks=[("blocks.2.hook_resid_post", store)])
    norm = model.hook_dict["blocks.2.hook_resid_post"].ctx["norm"]
    model.reset_hooks()  # clears the contexts too
    return norm, len(model.hook_dict["blocks.2.hook_resid_post"].ctx)


def case_hooks_context_manager(model):
    def double_mlp(out, hook):
        return out * 2

    with model.hooks(fwd_hooks=[("blocks.0.hook_mlp_out", double_mlp)]):
        hooked = model(PROMPT, return_type="loss")
    return hooked, model(PROMPT, return_type="loss")


def case_add_hook_persists_until_reset(model):
    model.reset_hooks()
    model.add_hook("blocks.1.hook_attn_out", lambda out, hook: out * 0.5)
    first, second = model(PROMPT, return_type="loss"), model(PROMPT, return_type="loss")
    model.reset_hooks()
    return first, second, model(PROMPT, return_type="loss")


def case_permanent_hook(model):
    model.reset_hooks(including_permanent=True)
    model.add_hook("blocks.0.hook_resid_post", lambda resid, hook: resid * 1.5, is_permanent=True)
    model.reset_hooks()
    still = model(PROMPT, return_type="loss")
    model.reset_hooks(including_permanent=True)
    return still, model(PROMPT, return_type="loss")


def case_backward_hooks_with_add_hook(model):
    # Attribution_Patching_Demo: forward and backward caches from add_hook, then one backward pass
    model.reset_hooks()
    fwd, grads = {}, {}

    def forward_cache_hook(act, hook):
        fwd[hook.name] = act.detach()

    def backward_cache_hook(grad, hook):
        grads[hook.name] = grad.detach()

    names = lambda name: name.endswith(("hook_z", "mlp.hook_post", "hook_pattern"))  # noqa: E731
    model.add_hook(names, forward_cache_hook, "fwd")
    model.add_hook(names, backward_cache_hook, "bwd")
    value = logit_diff(model(model.to_tokens(PROMPT)))
    value.backward()
    model.reset_hooks()
    return value, {k: fwd[k] for k in sorted(fwd)}, {k: grads[k] for k in sorted(grads)}


def case_run_with_hooks_bwd_hooks(model):
    grads = {}

    def save_grad(grad, hook):
        grads[hook.name] = grad.detach()

    loss = model.run_with_hooks(PROMPT, return_type="loss", bwd_hooks=[("blocks.2.hook_mlp_out", save_grad)],
                                reset_hooks_end=False)
    loss.backward()
    model.reset_hooks()
    return grads["blocks.2.hook_mlp_out"]


def case_hook_point_add_hook(model):
    point = model.blocks[1].hook_resid_mid if hasattr(model.blocks[1], "hook_resid_mid") else None
    point.add_hook(lambda resid, hook: resid + 1.0)
    hooked = model(PROMPT, return_type="loss")
    point.remove_hooks()
    return hooked, model(PROMPT, return_type="loss")


def case_split_qkv_input(model):
    # ARENA 1.2-style path patching needs each head's own query input
    model.set_use_split_qkv_input(True)
    try:
        def scale_one_head(q_input, hook):
            q_input[:, :, 2] = q_input[:, :, 2] * 0.5
            return q_input

        _, cache = model.run_with_cache(PROMPT, names_filter=lambda n: n.endswith(("q_input", "hook_q")))
        patched = model.run_with_hooks(PROMPT, return_type="loss", fwd_hooks=[("blocks.1.hook_q_input", scale_one_head)])
        return cache["blocks.1.hook_q_input"], cache["blocks.1.attn.hook_q"], patched
    finally:
        model.set_use_split_qkv_input(False)


def case_hook_mlp_in_and_attn_result(model):
    model.set_use_hook_mlp_in(True)
    model.set_use_attn_result(True)
    try:
        def halve(x, hook):
            return x * 0.5

        loss = model.run_with_hooks(PROMPT, return_type="loss", fwd_hooks=[("blocks.2.hook_mlp_in", halve)])
        _, cache = model.run_with_cache(PROMPT, names_filter=lambda n: n.endswith(("mlp_in", "hook_result")))
        return loss, cache["blocks.1.hook_mlp_in"], cache["blocks.3.attn.hook_result"]
    finally:
        model.set_use_hook_mlp_in(False)
        model.set_use_attn_result(False)


# ---- the config and the weights -------------------------------------------------------------------------
def case_cfg_fields(model):
    cfg = model.cfg
    return {name: getattr(cfg, name) for name in (
        "n_layers", "n_heads", "d_model", "d_head", "d_mlp", "d_vocab", "n_ctx", "act_fn", "normalization_type",
        "positional_embedding_type", "default_prepend_bos", "n_key_value_heads", "device", "model_name")}


def case_weights(model):
    return (model.W_E, model.W_pos, model.W_U, model.W_Q[1], model.W_K[2], model.W_V[0], model.W_O[3], model.b_Q,
            model.b_O, model.W_in[1], model.W_out[2], model.b_in, model.b_out)


def case_per_block_weights(model):
    return model.blocks[2].attn.W_Q, model.blocks[0].attn.b_V, model.blocks[3].mlp.W_in


def case_ov_circuit(model):
    ov = model.OV[1, 4]
    return ov.AB, (model.W_E[:50] @ ov @ model.W_U[:, :50]).AB, model.OV.shape, model.QK[2, 0].AB


def case_eigenvalues(model):
    # copying scores: the sign of the OV circuit's eigenvalues (Main_Demo)
    full = model.W_E @ model.OV @ model.W_U
    eigenvalues = full.eigenvalues
    return ((eigenvalues.sum(-1) / eigenvalues.abs().sum(-1)).real)


def case_tokens_to_residual_directions(model):
    return model.tokens_to_residual_directions(" love"), model.tokens_to_residual_directions(
        model.to_tokens(" love light", prepend_bos=False)[0])


def case_composition_scores(model):
    return model.all_composition_scores("Q"), model.all_composition_scores("K"), model.all_composition_scores("V")


# ---- tokens and generation -----------------------------------------------------------------------------
def case_tokens(model):
    tokens = model.to_tokens(PROMPTS)
    return (tokens, model.to_tokens(PROMPT, prepend_bos=False), model.to_str_tokens(PROMPT),
            model.to_str_tokens(tokens[0]), model.to_string(tokens[1]), model.to_single_token(" love"),
            model.get_token_position(" soft", PROMPT))


def case_tokenizer(model):
    tok = model.tokenizer
    return (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.decode([11, 12, 13]),
            tok.batch_decode([[11, 12], [13]]), len(tok))


def case_greedy_generation(model):
    # use_past_kv_cache=False: transformer-lens 4.3's bridge continues wrongly from its KV cache on this model
    return model.generate(PROMPT, max_new_tokens=8, do_sample=False, verbose=False, use_past_kv_cache=False)


def case_generation_of_tokens(model):
    tokens = model.to_tokens("KING. Good")
    return model.generate(tokens, max_new_tokens=6, do_sample=False, verbose=False, stop_at_eos=False,
                          use_past_kv_cache=False)


# ---- the cache's methods --------------------------------------------------------------------------------
def case_logit_lens(model):
    # Exploratory_Analysis_Demo: the accumulated residual, normed by the final scale, onto the answer direction
    tokens = model.to_tokens(PROMPT)
    _, cache = model.run_with_cache(tokens)
    direction = model.tokens_to_residual_directions(tokens[0, -1])
    accumulated, labels = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, apply_ln=True,
                                                  return_labels=True)
    return labels, accumulated @ direction


def case_decompose_resid(model):
    _, cache = model.run_with_cache(PROMPT)
    stack, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
    scaled = cache.apply_ln_to_stack(stack, layer=-1, pos_slice=-1)
    return labels, stack, scaled


def case_head_attribution(model):
    tokens = model.to_tokens(PROMPT)
    _, cache = model.run_with_cache(tokens)
    per_head, labels = cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
    per_head = cache.apply_ln_to_stack(per_head, layer=-1, pos_slice=-1)
    return labels, cache.logit_attrs(per_head, tokens=tokens[0, 3], incorrect_tokens=tokens[0, 4], pos_slice=-1)


def case_full_decomposition(model):
    _, cache = model.run_with_cache(PROMPT)
    stack, labels = cache.get_full_resid_decomposition(layer=2, expand_neurons=False, pos_slice=-2,
                                                       return_labels=True)
    return labels, stack


def case_stack_activation(model):
    _, cache = model.run_with_cache(PROMPT)
    return cache.stack_activation("resid_post"), cache.stack_activation("pattern", layer=2)


# ---- transformer-lens's own functions, given the model -------------------------------------------------------
def case_tl_patching_resid_pre(model):
    from transformer_lens import patching

    clean, corrupted = clean_and_corrupted(model)
    _, clean_cache = model.run_with_cache(clean)
    return patching.get_act_patch_resid_pre(model, corrupted, clean_cache, logit_diff)


def case_tl_patching_head_out(model):
    from transformer_lens import patching

    clean, corrupted = clean_and_corrupted(model)
    _, clean_cache = model.run_with_cache(clean)
    return patching.get_act_patch_attn_head_out_all_pos(model, corrupted, clean_cache, logit_diff)


def case_tl_patching_every(model):
    from transformer_lens import patching

    clean, corrupted = clean_and_corrupted(model)
    _, clean_cache = model.run_with_cache(clean)
    return (patching.get_act_patch_attn_head_all_pos_every(model, corrupted, clean_cache, logit_diff),
            patching.get_act_patch_block_every(model, corrupted, clean_cache, logit_diff))


def case_tl_detect_head(model):
    from transformer_lens.head_detector import detect_head

    return (detect_head(model, PROMPT, "previous_token_head"), detect_head(model, PROMPT + PROMPT, "induction_head"),
            detect_head(model, [PROMPT, PROMPTS[1]], "duplicate_token_head"))


def case_tl_test_prompt(model):
    from transformer_lens.utilities import test_prompt

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        test_prompt("ROMEO. But soft, what light through yonder window", " breaks", model, top_k=5)
    return out.getvalue()


def case_tl_activation_cache_of_probe_hooks(model):
    # Attribution_Patching_Demo builds TL's own ActivationCache around the model it ran
    from transformer_lens import ActivationCache

    fwd = {}
    model.reset_hooks()
    model.add_hook(lambda name: name.endswith(("hook_z", "hook_attn_out", "hook_mlp_out", "hook_scale", "hook_embed")),
                   lambda act, hook: fwd.__setitem__(hook.name, act.detach()))
    model(PROMPT)
    model.reset_hooks()
    cache = ActivationCache(classic(fwd), model)
    return cache.stack_head_results(layer=-1, pos_slice=-1), cache.decompose_resid(layer=-1, pos_slice=-1)


def classic(value):
    """transformer-lens's classic names only: the bridge also reports its components' own hooks (`.hook_in`,
    `.hook_out`) beside them, which HookedTransformer never had (but the unembedding's two, TL 3.9's too)."""
    def keep(name):
        return name.startswith("unembed.") or not name.removesuffix("_grad").endswith((".hook_in", ".hook_out"))

    if isinstance(value, dict):
        return {k: v for k, v in value.items() if keep(k)}
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, str) and "hook" in v for v in value):
            return [v for v in value if keep(v)]
        return type(value)(classic(v) for v in value)
    return value


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_transformer_lens_code_runs_unchanged(models, name):
    ours, theirs = models
    case = CASES[name]
    torch.manual_seed(0)
    expected = case(theirs)
    torch.manual_seed(0)
    got = case(ours)
    if name == "cfg_fields":  # the bridge may describe the same file another way: compare what both say
        expected = {k: v for k, v in expected.items() if k != "model_name"}
        got = {k: v for k, v in got.items() if k != "model_name"}
    assert_same(got, classic(expected), what=name)


def test_there_are_at_least_forty_cases():
    assert len(CASES) >= 40


# ---- the cache's methods while a per-head attention input is on ------------------------------------------
@pytest.mark.parametrize("switch", ["set_use_split_qkv_input", "set_use_attn_in"])
def test_apply_ln_at_a_layer_with_per_head_attention_inputs(models, switch):
    # ARENA 1.2 turns on per-head inputs for path patching, then reads the same cache with TL's stacking methods:
    # the residual entering layer 2, through ln1's cached scale, must be what it is with the switch off
    def stacks(model):
        getattr(model, switch)(True)
        try:
            _, cache = model.run_with_cache(PROMPT)
        finally:
            getattr(model, switch)(False)
        return (cache.decompose_resid(layer=2, apply_ln=True, pos_slice=-1),
                cache.accumulated_resid(layer=2, incl_mid=True, apply_ln=True, pos_slice=[1, 3]),
                cache.stack_head_results(layer=2, apply_ln=True, pos_slice=-1, incl_remainder=True),
                cache.apply_ln_to_stack(cache.decompose_resid(layer=1), layer=1))

    ours, theirs = models
    assert_same(stacks(ours), stacks(theirs), what=switch)


def test_remove_batch_dim_told_the_batch_size(models):
    # transformer-lens 4's remove_batch_dim takes the true batch size when the caller knows it
    def case(model):
        _, cache = model.run_with_cache(PROMPT)
        cache = cache.remove_batch_dim(batch_size=1)
        return cache.has_batch_dim, cache["resid_pre", 1], cache.accumulated_resid(layer=2, apply_ln=True, pos_slice=-1)

    ours, theirs = models
    assert_same(case(ours), case(theirs), what="remove_batch_dim(batch_size=1)")
    _, cache = ours.run_with_cache(PROMPTS)
    with pytest.raises(ValueError, match="one prompt"):
        cache.remove_batch_dim(batch_size=3)


def test_a_negative_layer_past_the_first_is_a_key_error_naming_it(models):
    # TL counts cache["resid_pre", -l] from the end and raises KeyError past the first layer; the message must name
    # the layer the user wrote, not the one it became
    ours, theirs = models
    _, tl_cache = theirs.run_with_cache(PROMPT)
    with pytest.raises(KeyError):
        tl_cache["resid_pre", -5]
    _, cache = ours.run_with_cache(PROMPT)
    with pytest.raises(KeyError, match=r"-5") as caught:
        cache["resid_pre", -5]
    assert "-1" not in str(caught.value)


def test_cache_to_as_a_statement_moves_the_cache(models):
    # TL users write `cache.to("cpu")` on its own line to free the GPU: TL moves the cache in place and returns it.
    # The meta device shows the move on a CPU machine.
    def case(model):
        _, cache = model.run_with_cache(PROMPT)
        returned = cache.to("meta")
        return returned is cache, sorted({t.device.type for t in cache.values()})

    ours, theirs = models
    assert case(theirs) == (True, ["meta"])  # what TL does, on the same checkpoint
    assert case(ours) == case(theirs)
