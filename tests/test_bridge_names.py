"""transformer-lens 4's own hook names, as TL 4 code writes them without compatibility mode (`blocks.0.hook_out`,
`blocks.0.attn.q.hook_out`, `blocks.0.ln1.hook_out`, `unembed.hook_out`, ...), on a model loaded with TL 4's loading
line, `HookedDecoder.boot_transformers` (probe/bridge_names.py, probe/tl_bridge.py). The oracle: TL 4's
TransformerBridge booted over the same checkpoint, also without compatibility mode, on nine block arrangements."""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

import probe
from probe import HookedDecoder
from probe.hooks import HookPoint, UnknownNameError
from test_family_defaults import BLOOM_FILES, tokenized_checkpoint
from test_variants import build
from oracle_process import oracle
from tl_oracle import assert_same, booted

FAMILIES = ("gpt2", "gpt1", "llama", "neox", "gemma2", "qwen3", "gptneo", "opt", "phi", "olmo2", "bloom", "mixtral")
# learned/post-norm/GQA gated/parallel/sandwich/q-k norms/local layers/OPT's layout/one norm for two parallel
# sublayers/write norms only/ALiBi and a norm on the embeddings/a mixture of experts


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    dirs = {"gpt2": probe.DEFAULT_MODEL}
    for family in FAMILIES[1:]:
        directory = tmp_path_factory.mktemp(family)
        if family in ("llama", "olmo2", "bloom", "mixtral"):  # the bridge needs a tokenizer it can load for these
            directory = tokenized_checkpoint(family, directory / "checkpoint",
                                             *([BLOOM_FILES] if family == "bloom" else []))
        else:
            build(family, directory)
        dirs[family] = directory
    return dirs


def native_bridge(directory):
    from transformer_lens.model_bridge import TransformerBridge

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its deprecation warnings for the classic names
        model = TransformerBridge.boot_transformers(str(directory), device="cpu")
    return model.eval()


def both(directory):
    return HookedDecoder.boot_transformers(directory).eval(), native_bridge(directory)


def tokens(model) -> torch.Tensor:
    return torch.randint(3, min(model.cfg.d_vocab, 90), (2, 7), generator=torch.Generator().manual_seed(0))


def classic_names(model) -> set[str]:
    """probe's own point names that HookedTransformer has too (compared with the bridge in compatibility mode by the
    other TL tests; some the bridge lays out otherwise without it)."""
    return {name for name in model.hook_names if not model.hook_point(name).bridge_only}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_bridge_name_holds_the_bridges_value_or_says_what_to_hook(family, family_dirs):
    ours, theirs = both(family_dirs[family])
    toks = tokens(ours)
    with torch.no_grad():
        _, our_cache = ours.run_with_cache(toks)  # a cache of everything, as the bridge's lists its own names
        _, their_cache = theirs.run_with_cache(toks)
    compared = 0
    for name in sorted(set(their_cache.keys()) - classic_names(ours)):
        if name not in our_cache:
            with pytest.raises(UnknownNameError, match=f"no hook point {name!r}: .*hook"):
                ours.hook_point(name)  # left out, saying what to hook instead
            continue
        theirs_value = their_cache[name]
        if (family, name) == ("opt", "pos_embed.hook_in"):  # there OPT's position module's first argument, the mask
            assert torch.equal(theirs_value, torch.ones(toks.shape))
            continue
        if name == "pos_embed.hook_in":  # one row there when nothing is padded, a row per sequence here
            theirs_value = theirs_value.expand_as(our_cache[name])
        assert_same(our_cache[name], theirs_value, what=f"{family}: {name}")
        compared += 1
    assert compared >= 22 * (family != "gpt1") + 12, f"{family}: only {compared} names compared"


PHI_SHARED_INPUTS = {"blocks.0.attn.hook_in", "blocks.0.attn.q.hook_in", "blocks.1.attn.k.hook_in",
                     "blocks.0.attn.v.hook_in"}


@pytest.mark.parametrize("family", FAMILIES)
def test_edits_at_bridge_names_do_what_they_do_on_the_bridge(family, family_dirs):
    ours, theirs = both(family_dirs[family])
    toks, last = tokens(ours), ours.cfg.n_layers - 1
    names = ["embed.hook_out", "blocks.0.hook_out", f"blocks.{last}.hook_in", "blocks.0.ln1.hook_in",
             "blocks.0.ln1.hook_out", "blocks.0.attn.hook_in", "blocks.0.attn.hook_out", "blocks.0.attn.q.hook_out",
             "blocks.0.attn.v.hook_out", "blocks.0.attn.o.hook_in", "blocks.1.ln2.hook_in", "blocks.1.ln2.hook_out",
             "blocks.1.mlp.hook_in", "blocks.1.mlp.in.hook_out", "blocks.1.mlp.out.hook_in", "blocks.1.mlp.hook_out",
             "unembed.hook_in", "unembed.hook_out", "blocks.0.attn.q.hook_in", "blocks.1.attn.k.hook_in",
             "blocks.0.attn.v.hook_in"]
    names += {"gpt2": ["pos_embed.hook_out", "ln_final.hook_in", "ln_final.hook_out"],
              "llama": ["blocks.1.mlp.gate.hook_out", "ln_final.hook_out"], "qwen3": ["blocks.0.mlp.gate.hook_out"],
              "gemma2": ["blocks.0.ln1_post.hook_in", "blocks.1.ln2_post.hook_in", "blocks.1.ln2_post.hook_out"],
              "gpt1": ["pos_embed.hook_out"], "neox": ["ln_final.hook_in"], "gptneo": ["pos_embed.hook_out"],
              "opt": ["pos_embed.hook_out", "ln_final.hook_out"], "phi": ["ln_final.hook_in"],
              "olmo2": ["blocks.0.ln1_post.hook_in", "blocks.1.ln2_post.hook_out", "ln_final.hook_out"],
              "bloom": ["embed_ln.hook_in", "embed_ln.hook_normalized", "embed_ln.hook_out", "ln_final.hook_in"],
              "mixtral": ["blocks.0.mlp.hook_pre", "blocks.0.mlp.hook_post", "ln_final.hook_out"]}[family]
    if family == "olmo2":
        # OLMo 2's sublayers read the residual itself: the bridge has no ln1 or ln2 (probe's are identities)
        for name in ("blocks.0.ln1.hook_in", "blocks.0.ln1.hook_out", "blocks.1.ln2.hook_in", "blocks.1.ln2.hook_out"):
            names.remove(name)
    if family == "phi":
        # TL 4's Phi block has one norm, ln1, which both sublayers read: an edit at ln1's ends reaches the MLP there.
        # probe keeps TL 3's two copies (ln2 is ln1's), so an edit at ln1's ends reaches attention only; the bridge
        # has no ln2 to edit (docs/from_transformer_lens.md)
        for name in ("blocks.0.ln1.hook_in", "blocks.0.ln1.hook_out", "blocks.1.ln2.hook_in", "blocks.1.ln2.hook_out"):
            names.remove(name)
    if family == "mixtral":  # a mixture of experts: no one up or down projection in the block
        names.remove("blocks.1.mlp.in.hook_out"), names.remove("blocks.1.mlp.out.hook_in")
    if family == "gpt1":
        # the bridge's GPT-1 blocks never fire hook_out (nor cache it): probe's is hook_resid_post. Post-norm sublayers
        # read the residual itself, so probe leaves their inputs out (test above: it says what to hook instead)
        for name in ("blocks.0.hook_out", "blocks.0.attn.hook_in", "blocks.1.mlp.hook_in"):
            names.remove(name)

    def replace(x, hook):
        return x * 1.25 + 0.05

    def in_place(x, hook):
        x[..., 1] += 0.5

    with torch.no_grad():
        for name in names:
            # the bridge's position embeddings are one row per position broadcast over the batch: no in-place edit there
            # and in a Phi block attention's input is the tensor the MLP reads too: edited in place, both see it
            shared = name == "pos_embed.hook_out" or (family == "phi" and name in PHI_SHARED_INPUTS)
            for edit in (replace,) if shared else (replace, in_place):
                assert_same(ours.run_with_hooks(toks, fwd_hooks=[(name, edit)]),
                            theirs.run_with_hooks(toks, fwd_hooks=[(name, edit)]), what=f"{family}: {edit.__name__} {name}")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_one_projections_input_and_the_ids_as_the_bridge_hooks_them(family, family_dirs):
    """`attn.q.hook_in` (k, v) reaches that projection alone, forward and backward; `embed.hook_in` and
    `pos_embed.hook_in` hold the token and position ids, and an edit there embeds other ids."""
    ours, theirs = both(family_dirs[family])
    toks = tokens(ours)
    with torch.no_grad():
        listed = [list(model.run_with_cache(toks)[1].keys()) for model in (ours, theirs)]
    keys = [set(names) for names in listed]
    if family == "gpt2":  # nothing of the bridge's cache of everything is missing here now
        assert keys[0] == keys[1]
        # listed as the activations arrived, as there, but for k and v's inputs (probe's arrive together with q's)
        # and resid_mid (the bridge's is ln2's input, after it)
        placed_otherwise = ("attn.k.hook_in", "attn.v.hook_in", "hook_resid_mid")
        assert [[name for name in names if not name.endswith(placed_otherwise)] for names in listed] == [
            [name for name in listed[1] if not name.endswith(placed_otherwise)]] * 2
    else:  # the rotary angles, which probe does not hook, and the gated MLP's two projections' own inputs
        assert keys[1] - keys[0] and all(name.startswith("rotary_emb.") or name.endswith(
            ("attn.hook_cos", "attn.hook_sin", "mlp.gate.hook_in", "mlp.in.hook_in")) for name in keys[1] - keys[0])
    edits = [("blocks.1.attn.q.hook_in", lambda x, hook: x * 0.5), ("blocks.1.attn.v.hook_in", lambda x, hook: x + 1.0),
             ("blocks.0.attn.k.hook_in", lambda x, hook: x.flip(1)),
             ("embed.hook_in", lambda ids, hook: ids.roll(1, dims=1))]
    if family == "gpt2":
        edits.append(("pos_embed.hook_in", lambda at, hook: at + 3))
    for name, edit in edits:
        with torch.no_grad():
            changed = [model.run_with_hooks(toks, fwd_hooks=[(name, edit)]) for model in (ours, theirs)]
        assert_same(changed[0], changed[1], what=f"{family}: {name}")
        assert not torch.allclose(changed[0], ours(toks)), f"{family}: the edit at {name} changed nothing"
    grads = []
    for model in (ours, theirs):
        seen = {}

        def keep(grad, hook, seen=seen):
            seen[hook.name] = grad.detach().clone()

        with model.hooks(bwd_hooks=[(f"blocks.1.attn.{part}.hook_in", keep) for part in "qkv"]):
            model(toks, return_type="loss").backward()
        grads.append(seen)
    assert_same(grads[0], grads[1], what=f"{family}: gradients at q, k and v's inputs")
    assert not torch.allclose(grads[0]["blocks.1.attn.q.hook_in"], grads[0]["blocks.1.attn.k.hook_in"])


@pytest.mark.parametrize("family", ["gpt2", "gemma2"])
def test_predicates_and_gradients_over_bridge_names(family, family_dirs):
    ours, theirs = both(family_dirs[family])
    toks = tokens(ours)
    ends = lambda name: name.endswith(".hook_out")  # noqa: E731
    with torch.no_grad():
        _, our_cache = ours.run_with_cache(toks, names_filter=ends)
        _, their_cache = theirs.run_with_cache(toks, names_filter=ends)
    names = {name for name in their_cache.keys() if ends(name) and name in our_cache}
    assert len(names) >= 20 and {name for name in our_cache.keys() if ends(name)} <= set(their_cache.keys())
    for name in names:
        assert_same(our_cache[name], their_cache[name], what=f"{family}: {name} by predicate")
    grads = {}
    for model, side in ((ours, "ours"), (theirs, "theirs")):
        def keep(grad, hook, side=side):
            grads[side, hook.name] = grad.detach().clone()

        with model.hooks(bwd_hooks=[("blocks.0.hook_out", keep), ("blocks.1.ln1.hook_out", keep)]):
            model(toks, return_type="loss").backward()
    assert_same(sorted(v.sum().item() for (side, _), v in grads.items() if side == "ours"),
                sorted(v.sum().item() for (side, _), v in grads.items() if side == "theirs"), what="gradients")


def test_a_model_loaded_as_hookedtransformer_lists_its_points_without_the_bridges_own():
    # TL 3 code lists hook_dict or mod_dict and hooks every entry (activation dumpers): a norm's ends, points only the
    # bridge has, must not join them. The oracle: HookedTransformer (transformer-lens 3.9) on the same weights
    theirs = json.loads(oracle("hook_listing", probe.DEFAULT_MODEL))
    ours = HookedDecoder.from_pretrained(probe.DEFAULT_MODEL).eval()
    layers = range(ours.cfg.n_layers)
    # documented: the oracle's class, SAELens's HookedSAETransformer, adds an mlp.hook_in point to every block (TL 3.9
    # itself lists unembed.hook_in / hook_out, as probe does); probe lists the bridge's per-head input names
    added_by_saelens = {f"blocks.{layer}.mlp.hook_in" for layer in layers}
    per_head_inputs = {f"blocks.{layer}.attn.hook_{part}" for layer in layers
                       for part in ("q_input", "k_input", "v_input", "attn_in")}
    assert set(ours.hook_dict) == set(theirs["hook_dict"]) - added_by_saelens | per_head_inputs
    listed_points = {name for name, module in ours.mod_dict.items() if isinstance(module, HookPoint)}
    assert listed_points == {name for name in theirs["mod_dict"] if "hook_" in name.rsplit(".", 1)[-1]} - added_by_saelens
    assert len(ours.hook_points()) == len(listed_points)
    seen = []
    for point in ours.hook_dict.values():
        point.add_hook(lambda x, hook: seen.append(hook.name))
    with torch.no_grad():
        ours(torch.tensor([[1, 2, 3]]))
    ours.reset_hooks()
    # the per-head inputs, per-head results and hook_mlp_in fire when hooked (documented); nothing else is extra
    per_head = {f"blocks.{layer}.{name}" for layer in layers for name in (
        "hook_q_input", "hook_k_input", "hook_v_input", "hook_attn_in", "attn.hook_result", "hook_mlp_in")}
    assert set(seen) == set(theirs["seen"]) - added_by_saelens | per_head
    # a cache of everything: HookedTransformer's names in its order, and without a return value (return_type=None) no
    # unembedding, which HookedTransformer skips then
    for return_type in ("logits", None):
        with torch.no_grad():
            listed = list(ours.run_with_cache(torch.tensor([[1, 2, 3]]), return_type=return_type)[1].keys())
        assert listed == [name for name in theirs["cached"][str(return_type)] if name not in added_by_saelens]
        assert ("unembed.hook_out" in listed) == (return_type is not None)
    # a hook on a bridge-only point by its exact name still works, and reset_hooks removes it
    ours.add_hook("blocks.0.ln1.hook_out", lambda x, hook: seen.append(hook.name))
    ours.reset_hooks()
    assert not ours.blocks[0].ln1.hook_out.handles


def test_transformer_lens_4s_loading_line_and_compatibility_mode(family_dirs):
    directory = family_dirs["gpt2"]
    ours = HookedDecoder.boot_transformers(directory, device="cpu", dtype=torch.float32)
    from transformer_lens.model_bridge import TransformerBridge

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TL 4's notebooks never call eval(): booted, both are in eval mode
        assert ours.training is TransformerBridge.boot_transformers(str(directory)).training is False
    classic = HookedDecoder.from_pretrained(directory).eval()
    toks = tokens(ours)
    with torch.no_grad():
        assert_same(ours(toks), classic(toks), what="booted: the checkpoint's own weights")
        _, plain = classic.run_with_cache(toks)
        # HookedTransformer's names alone (transformer-lens 3.9's among them: the unembedding's input and output)
        assert [name for name in plain if name.endswith(("hook_in", "hook_out"))] == ["unembed.hook_in", "unembed.hook_out"]
        assert plain["blocks.0.hook_out"] is plain["blocks.0.hook_resid_post"]  # but they answer to the bridge's
        named = classic.run_with_cache(toks, names_filter=["blocks.0.ln1.hook_out", "unembed.hook_in"])[1]  # by name
        assert_same(named["blocks.0.ln1.hook_out"], ours.run_with_cache(toks)[1]["blocks.0.attn.hook_in"])
        assert_same(named["unembed.hook_in"], plain["ln_final.hook_normalized"] * classic.ln_final.w + classic.ln_final.b)
    # HookedTransformer code attaching a hook to every hook_dict entry attaches it once per point; the bridge lists both
    assert "blocks.0.hook_out" not in classic.hook_dict and "blocks.0.hook_out" in ours.hook_dict
    assert ours.hook_dict["blocks.0.hook_out"] is ours.hook_dict["blocks.0.hook_resid_post"]
    copied = copy.deepcopy(ours)  # (probe.process_weights copies): the attributes reach the copy's own points
    assert copied.blocks[1].attn.q.hook_out.point is copied.blocks[1].attn.hook_q is not ours.blocks[1].attn.hook_q
    assert ours.compatibility_mode is native_bridge(directory).compatibility_mode is False
    ours.enable_compatibility_mode()
    processed = booted(directory)  # the bridge's compatibility mode with its defaults: HookedTransformer's processing
    assert ours.compatibility_mode is processed.compatibility_mode is True
    with torch.no_grad():
        assert_same(ours(toks), processed(toks), what="compatibility mode")
        assert_same(ours.run_with_cache(toks)[1]["blocks.1.hook_out"],
                    processed.run_with_cache(toks)[1]["blocks.1.hook_out"], what="processed cache by the bridge's name")
    for keyword, value in (("hf_config_overrides", {"n_ctx": 8}), ("n_ctx", 8)):
        with pytest.raises(TypeError, match=f"does not take {keyword}="):
            HookedDecoder.boot_transformers(directory, **{keyword: value})


@pytest.mark.parametrize("family", ["gpt2", "llama", "neox"])
def test_booting_without_weights_gives_transformers_initial_weights_as_the_bridge(family, family_dirs):
    """`boot_transformers(name, load_weights=False)`: the architecture with transformers' own initial draw, under
    the same seed the bridge's weights (which come in training mode, with transformers' dropout: compared in eval)."""
    from transformer_lens.model_bridge import TransformerBridge

    models = []
    for boot in (HookedDecoder.boot_transformers, TransformerBridge.boot_transformers):
        torch.manual_seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            models.append(boot(str(family_dirs[family]), load_weights=False).eval())
    ours, theirs = models
    their_params = theirs.get_params()
    assert list(ours.get_params()) == list(their_params)
    for name, value in ours.get_params().items():
        assert torch.equal(value.detach(), their_params[name].detach()), name
    toks = tokens(ours)
    with torch.no_grad():
        assert_same(ours(toks), theirs(toks), atol=1e-5, what="logits")
    assert not torch.equal(ours.W_E, HookedDecoder.boot_transformers(family_dirs[family]).W_E)  # not the checkpoint's


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_the_bridges_model_methods(family, family_dirs):
    """The bridge's own conveniences over names and weights, as TL 4's composition-score and SVD tools call them."""
    ours, theirs = both(family_dirs[family])
    left_out = set(theirs.block_hooks(0)) - set(ours.block_hooks(0))
    assert left_out and all(ours.get_hook_point(f"blocks.0.{name}") is None for name in left_out)
    with pytest.raises(UnknownNameError, match="no hook point"):
        ours.hook_point(f"blocks.0.{sorted(left_out)[0]}")  # each left out with its reason
    assert set(ours.block_hooks(0)) <= set(theirs.block_hooks(0))
    assert ours.get_hook_point("blocks.0.hook_out") is ours.get_hook_point("blocks.0.hook_resid_post")
    assert ours.get_hook_point("blocks.0.no_such_point") is theirs.get_hook_point("blocks.0.no_such_point") is None
    assert_same_params(ours, theirs, family)
    assert ours.attn_head_labels == theirs.attn_head_labels
    assert ours.composition_layer_indices() == theirs.composition_layer_indices()
    for which in ("OV_for_attn_layers", "QK_for_attn_layers"):
        (our_layers, our_circuit), (their_layers, their_circuit) = getattr(ours, which)(), getattr(theirs, which)()
        assert our_layers == their_layers
        assert_same(our_circuit.AB, their_circuit.AB, what=which)
    for submodule in ("mlp", "ln1_post"):
        assert [i for i, _ in ours.blocks_with(submodule)] == [i for i, _ in theirs.blocks_with(submodule)]
    for submodule, path in (("attn", "attn.W_Q"), ("attn", "attn.W_O"), ("mlp", "mlp.W_in")):
        assert_same(ours.stack_params_for(submodule, path, reshape_fn=lambda w: w * 2),
                    theirs.stack_params_for(submodule, path, reshape_fn=lambda w: w * 2), what=path)
    ours.process_weights(), theirs.process_weights()
    toks = tokens(ours)
    with torch.no_grad():
        assert_same(ours(toks), theirs(toks), what="process_weights")
    # the folded norms' w = 1, b = 0 are listed, as the bridge lists them (in compatibility mode: after a bare
    # process_weights() its get_params() still reads the norms' and MLP biases' old values, though it runs the new)
    ours = HookedDecoder.boot_transformers(family_dirs[family])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the steps a model cannot take, skipped on both sides
        ours.enable_compatibility_mode()
    assert_same_params(ours, booted(family_dirs[family]), family)


def assert_same_params(ours, theirs, family) -> None:
    """get_params() and tl_parameters() / tl_named_parameters() (one dict on the bridge): the bridge's names in its
    order (Main_Demo prints them), with its values."""
    our_params, their_params = ours.get_params(), theirs.get_params()
    assert list(our_params) == list(ours.tl_parameters()) == [name for name, _ in ours.tl_named_parameters()]
    assert [name for name, _ in theirs.tl_named_parameters()] == list(their_params)
    # Gemma 2's sandwich norms' own weights, which the bridge does not list
    assert [name for name in our_params if name.split(".")[-2] not in ("ln1_post", "ln2_post")] == list(their_params)
    # Gemma's norms multiply by 1 + w and store w: probe's (and HookedTransformer's) weight is the 1 + w they multiply by
    stored = {name: our_params[name] - float(name.endswith(".w") and family == "gemma2") for name in their_params}
    assert_same(stored, their_params, what="get_params")


def test_a_hook_attached_by_a_bridge_name_sees_that_name(family_dirs):
    """TL 4 code keeps what a hook sees under `hook.name` and reads it back by the name it hooked."""
    ours, theirs = both(family_dirs["gpt2"])
    toks = tokens(ours)
    names = ["blocks.0.hook_out", "blocks.1.attn.q.hook_out", "blocks.0.ln1.hook_out", "unembed.hook_out"]
    kept = []
    for model in (ours, theirs):
        store, layers = {}, {}

        def keep(x, hook, store=store, layers=layers):
            store[hook.name] = x.detach().clone()
            layers[hook.name] = hook.layer() if hook.name.startswith("blocks.") else None
            hook.ctx["seen"] = True

        with torch.no_grad():
            model.run_with_hooks(toks, fwd_hooks=[(name, keep) for name in names])
            model.add_hook("blocks.1.hook_in", keep)
            model(toks)
        model.reset_hooks(clear_contexts=False)
        kept.append((store, layers))
    assert_same(kept[0], kept[1], what="kept by hook.name")
    assert set(kept[0][0]) == {*names, "blocks.1.hook_in"}
    assert ours.hook_point("blocks.0.hook_resid_post").ctx == {"seen": True}  # the point's own ctx


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_bridge_names_as_attributes_and_transformer_lens_4s_own_tools(family, family_dirs):
    """TL 4 code reaching points as attributes (`model.blocks[0].hook_out.add_hook(...)`) and TL 4's analysis tools,
    which read the bridge's description of its blocks."""
    from transformer_lens.tools.analysis import get_act_patch_direct_path, logit_lens, logit_readout

    ours, theirs = both(family_dirs[family])
    toks = tokens(ours)
    seen = []
    for model in (ours, theirs):
        store = {}

        def keep(x, hook, store=store):
            store[hook.name] = x.detach().clone()

        block = model.blocks[1]
        for point in (block.hook_out, block.attn.hook_out, block.attn.q.hook_in, block.attn.q.hook_out,
                      block.attn.o.hook_in, block.mlp.out.hook_in, model.embed.hook_in, model.embed.hook_out,
                      model.unembed.hook_out):
            point.add_hook(keep)
        with torch.no_grad():
            model(toks)
        model.reset_hooks()
        seen.append(store)
    assert_same(seen[0], seen[1], what="kept through attributes")
    if ours.cfg.gated_mlp:
        with pytest.raises(AttributeError, match="reads one input for both"):
            getattr(ours.blocks[0].mlp, "in").hook_in  # left out, saying what to hook
    if family == "gemma2":  # ln1_post between the head sum and the residual: both refuse direct paths
        for model in (ours, theirs):
            model.enable_compatibility_mode(no_processing=True)
            with torch.no_grad():
                _, clean = model.run_with_cache(toks)
            with pytest.raises(ValueError, match="ln1_post"):
                get_act_patch_direct_path(model, toks, clean, clean, lambda logits: logits[:, -1, 0].mean(), 0, 0, "q")
        return
    with torch.no_grad():
        assert_same(logit_lens(ours, toks[:1]).readout.values, logit_lens(theirs, toks[:1]).readout.values,
                    what="TL 4's logit_lens")
        directions = torch.randn(3, ours.cfg.d_model, generator=torch.Generator().manual_seed(0))
        assert_same(logit_readout(ours, directions).values, logit_readout(theirs, directions).values,
                    what="TL 4's logit_readout")


@pytest.mark.parametrize("family", ["gpt2", "neox"])
def test_filtered_caches_list_and_hooks_see_the_names_the_filter_accepted(family, family_dirs):
    """A cache lists the names its filter accepted (bridge names among them), gradients included, and a hook a
    predicate attaches sees the name it accepted: the bridge's own names, or after compatibility mode the classic
    ones, as on the bridge."""
    ours, theirs = both(family_dirs[family])
    toks = tokens(ours)
    filters = ["blocks.0.hook_out", ["blocks.1.attn.hook_out", "blocks.0.hook_resid_post", "unembed.hook_in"],
               lambda name: name.endswith(("blocks.0.mlp.hook_out", "attn.q.hook_out")),
               # (hook_result left out: a predicate selects it on probe, and TL fires it only with its switch on)
               # masked scores are -inf here, the dtype's minimum there; TL 3's rotated q and k are probe's alone
               lambda name: name.startswith("blocks.1.") and "attn" in name and not name.endswith(
                   ("hook_result", "hook_attn_scores", "hook_rot_q", "hook_rot_k"))]
    for names in filters:
        caches = [model.run_with_cache(toks, names_filter=names)[1] for model in (ours, theirs)]
        if callable(names):  # the bridge lists the names its predicate accepted (of the points both have)
            assert (sorted(name for name in caches[0].keys() if theirs.get_hook_point(name))
                    == sorted(name for name in caches[1].keys() if ours.get_hook_point(name)))
        else:  # and those given (with a classic name, its own as well: probe lists the names given alone)
            assert sorted(caches[0].keys()) == sorted([names] if isinstance(names, str) else names)
            assert set(caches[0].keys()) <= set(caches[1].keys())
        assert len(caches[0]) == len(caches[0].keys())
        assert_same(dict(caches[0].items()), {name: caches[1][name] for name in caches[0].keys()}, what=str(names))
    with_grads = [model.run_with_cache(toks, return_type="loss", incl_bwd=True, names_filter=["blocks.0.hook_out"])[1]
                  for model in (ours, theirs)]
    assert sorted(with_grads[0].keys()) == sorted(with_grads[1].keys()) == ["blocks.0.hook_out", "blocks.0.hook_out_grad"]
    assert_same(with_grads[0]["blocks.0.hook_out_grad"], with_grads[1]["blocks.0.hook_out_grad"], what="gradient")
    everything = lambda name: True  # noqa: E731
    for compatibility in (False, True):
        kept = []
        for model in (ours, theirs):
            if compatibility:
                model.enable_compatibility_mode(no_processing=True)
            store = {}
            model.add_hook(everything, lambda x, hook, store=store: store.__setitem__(hook.name, x.detach().clone()))
            with torch.no_grad():
                model(toks)
            model.reset_hooks()
            kept.append(store)
        # (the bridge's compatibility mode shows most points by their classic names, but not blocks.l.hook_in / _out)
        read = (["blocks.0.hook_attn_out", "blocks.1.attn.hook_z", "blocks.1.attn.hook_q", "hook_embed"] if compatibility else
                ["blocks.0.hook_out", "blocks.1.attn.o.hook_in", "embed.hook_out", "blocks.0.ln1.hook_out"])
        assert_same({name: kept[0][name] for name in read}, {name: kept[1][name] for name in read},
                    what=f"kept by hook.name, compatibility mode {compatibility}")


def test_transformer_lens_caching_hooks_store_under_the_bridges_names(family_dirs):
    """`get_caching_hooks` / `cache_some` with bridge names and predicates store what the bridge stores, where it
    stores it (a point the bridge holds twice in a row, attn.o.hook_out then attn.hook_out, is stored once here)."""
    ours, theirs = both(family_dirs["gpt2"])
    toks = tokens(ours)
    kept = []
    for model in (ours, theirs):
        cache, fwd, _ = model.get_caching_hooks(lambda name: name.startswith("blocks.1.") and name.endswith("hook_out"))
        some = {}
        model.cache_some(some, ["blocks.0.hook_out", "blocks.1.attn.q.hook_out", "unembed.hook_in"])
        with torch.no_grad():
            model.run_with_hooks(toks, fwd_hooks=fwd)
        model.reset_hooks()
        kept.append((cache, some))
    (ours_cache, our_some), (their_cache, their_some) = kept
    assert_same(our_some, their_some, what="cache_some")
    assert set(ours_cache) <= set(their_cache)
    stored_points = {ours.hook_point(name).name for name in ours_cache}
    assert all(ours.hook_point(name).name in stored_points for name in set(their_cache) - set(ours_cache))
    assert_same(ours_cache, {name: their_cache[name] for name in ours_cache}, what="get_caching_hooks")
