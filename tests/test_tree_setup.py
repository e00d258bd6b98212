"""`setup()` after the module tree changed (hooks/tree_setup.py), and a subclass's own `acts_to_saes`: transformer-lens's
pre-SAELens HookedSAETransformer pattern (tests/sae_splice_idioms.py), against HookedTransformer (transformer-lens
3.9) running the same code with its own classes."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import probe
from probe import HookedTransformer, SAEConfig, SparseAutoencoder
from patch_wrapper_idioms import patch_wrapper_idioms
from sae_splice_idioms import NAME, make_sae, sae_splice_idioms, set_deep_attr, subclass_of, wrapper_idioms
from test_sae_training import needs_saelens, oracle
from tl_oracle import assert_same


def tokens() -> torch.Tensor:
    return torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(7))


@needs_saelens
def test_an_sae_module_spliced_in_and_out_as_transformer_lens_code_does_it(tmp_path):
    from transformer_lens import HookedRootModule  # transformer-lens's classes (4.x's import path)
    from transformer_lens.hook_points import HookPoint

    save_file({"tokens": tokens()}, str(tmp_path / "tokens.safetensors"))
    printed = oracle("sae_splice", probe.DEFAULT_MODEL, tmp_path / "tokens.safetensors", tmp_path / "theirs.safetensors")
    their_names = json.loads(printed.splitlines()[-1])
    theirs = load_file(str(tmp_path / "theirs.safetensors"))
    model = subclass_of(HookedTransformer).from_pretrained_no_processing(probe.DEFAULT_MODEL).eval()
    assert model.acts_to_saes == {}  # the subclass's own dict, assigned in its __init__
    ours, names = sae_splice_idioms(model, HookedRootModule, HookPoint, tokens())
    wrapped, wrapped_names = wrapper_idioms(model, HookPoint, tokens())
    ours.update({f"wrapper.{key}": t for key, t in wrapped.items()})
    assert {**names, **wrapped_names, "acts_to_saes": sorted(model.acts_to_saes)} == their_names
    assert names["spliced"] and not names["off"]
    assert set(ours) == set(theirs)
    for key in theirs:
        assert_same(ours[key], theirs[key], atol=1e-4, what=key)
    assert not torch.allclose(ours["spliced"], ours["plain"])
    assert_same(ours["off"], ours["plain"], what="turned off")


def test_setup_puts_probes_own_point_back_and_refuses_a_hooked_foreign_one():
    from transformer_lens import HookedRootModule
    from transformer_lens.hook_points import HookPoint

    model = HookedTransformer.from_pretrained_no_processing(probe.DEFAULT_MODEL).eval()
    model.add_sae(SparseAutoencoder(SAEConfig(d_in=192, d_sae=16, hook_name="blocks.0.hook_resid_pre")))
    result = model.blocks[1].attn.hook_result  # computed only while hooked (opt-in)
    set_deep_attr(model, "blocks.1.attn.hook_result", make_sae(HookedRootModule, HookPoint, 6 * 192, 8))
    model.setup()
    assert "blocks.1.attn.hook_result" not in model.hook_names
    set_deep_attr(model, "blocks.1.attn.hook_result", HookPoint())
    model.setup()
    assert model.blocks[1].attn.hook_result is result and model.hook_point("blocks.1.attn.hook_result") is result
    assert result.opt_in and "blocks.1.attn.hook_result" not in model.run_with_cache(tokens())[1]
    # an SAE add_sae spliced in (by hooks, its points lent to the model) is still there
    assert "blocks.0.hook_resid_pre.hook_sae_acts_post" in model.run_with_cache(tokens())[1]
    hooked = HookPoint()
    hooked.add_hook(lambda x, hook: x * 2)
    set_deep_attr(model, "blocks.1.attn.hook_result", hooked)
    with pytest.raises(ValueError, match=r"HookPoint put back at blocks\.1\.attn\.hook_result carries hooks"):
        model.setup()


ROTARY_LOCAL = dict(n_layers=2, d_model=16, d_head=4, n_ctx=8, d_vocab=10, act_fn="silu", normalization_type="RMS",
                    positional_embedding_type="rotary", rotary_dim=4, rotary_base=500, use_local_attn=True,
                    window_size=3, attn_types=["global", "local"])


# GPT-J's adjacent pairs, and Gemma 3's local layers: their own base, and no rescaling there
ADJACENT_LOCAL_BASE = dict(ROTARY_LOCAL, rotary_adjacent_pairs=True, rotary_base_local=50, rotary_scaling_factor=2.0)
# YaRN's tables: its frequencies, times its attention factor
YARN = dict(ROTARY_LOCAL, use_yarn_rope=True, yarn_factor=4.0, yarn_attention_factor=1.3,
            yarn_original_max_position_embeddings=4)


@needs_saelens
@pytest.mark.parametrize("config", [ROTARY_LOCAL, ADJACENT_LOCAL_BASE, YARN], ids=["half-split", "adjacent-local-base",
                                                                                   "yarn"])
def test_attention_buffers_read_as_transformer_lens_3_9s_and_shared_as_circuit_tracer_shares_them(config, tmp_path):
    printed = oracle("attention_buffers", json.dumps(config), tmp_path / "theirs.safetensors")
    theirs = load_file(str(tmp_path / "theirs.safetensors"))
    model = HookedTransformer(probe.HookedTransformerConfig(**config))
    assert [block.attn.attn_type for block in model.blocks] == json.loads(printed.splitlines()[-1])
    for layer, block in enumerate(model.blocks):
        for name in ("mask", "rotary_sin", "rotary_cos"):
            ours = getattr(block.attn, name)
            assert ours.shape == theirs[f"{layer}.{name}"].shape and ours.dtype == theirs[f"{layer}.{name}"].dtype
            assert_same(ours, theirs[f"{layer}.{name}"], atol=1e-6, what=f"{layer}.{name}")
    if config is not ROTARY_LOCAL:
        return  # layers with their own rotary base have tables of their own: nothing to share
    # circuit-tracer's _deduplicate_attention_buffers: every layer given the first layer's tensors
    for block in model.blocks:
        block.attn.mask, block.attn.rotary_sin = model.blocks[0].attn.mask, model.blocks[0].attn.rotary_sin
    with pytest.raises(ValueError, match="attn.rotary_cos: probe computes it from the config"):
        model.blocks[1].attn.rotary_cos = model.blocks[0].attn.rotary_cos * 2  # a value probe would not read


@needs_saelens
def test_circuit_tracers_attribution_graph_and_interventions_are_transformer_lenss(tmp_path):
    """circuit-tracer 0.5 (Anthropic's attribution graphs) subclasses HookedTransformer: it wraps every MLP and the
    unembedding in modules with TL's HookPoints, calls setup(), shares the attention buffers across layers, runs its
    backward passes after its hooks block, and reads cfg.to_dict() by TL's names. With its import of
    HookedTransformer rebound to probe's, its graph and interventions on a random grouped-query rotary model with
    random transcoders are the ones it computes on HookedTransformer (transformer-lens 3.9), in the oracle's
    environment (tests/saelens_oracle.py: circuit_tracer_graphs)."""
    from pathlib import Path

    oracle("circuit_tracer_graphs", Path(probe.DEFAULT_MODEL) / "tokenizer.json", tmp_path / "graphs.safetensors")
    out = load_file(str(tmp_path / "graphs.safetensors"))
    for key in ("active", "selected"):  # which features are active, and the ones the graph keeps
        assert torch.equal(out[f"probe/{key}"], out[f"tl/{key}"]), key
    assert out["tl/selected"].numel() == 40 and out["tl/adjacency"].abs().max() > 1.0
    for key in ("adjacency", "values", "intervened_logits", "intervened_activations"):
        assert_same(out[f"probe/{key}"], out[f"tl/{key}"], atol=1e-5, what=key)


@needs_saelens
def test_auto_circuit_finds_the_circuits_on_probe_that_it_finds_on_transformer_lens(tmp_path):
    """auto_circuit 1.0.1 (UFO-101's AutoCircuit) wraps the hook points it patches in modules of its own, without
    setup(), keys key/value caches by `previous_attention_mask`, and runs ACDC from cached residuals. With its
    `HookedTransformer` rebound to probe's, its scores (edge attribution patching, mask gradients plain and integrated,
    ACDC) and its circuits' outputs and KL divergences, with q/k/v inputs apart and with one attention input, are the
    ones it computes on HookedTransformer 3.9 (tests/saelens_oracle.py: auto_circuit_scores)."""
    oracle("auto_circuit_scores", "tl", tmp_path, tmp_path / "tl.safetensors")
    oracle("auto_circuit_scores", "probe", tmp_path, tmp_path / "probe.safetensors")
    theirs, ours = load_file(str(tmp_path / "tl.safetensors")), load_file(str(tmp_path / "probe.safetensors"))
    assert set(ours) == set(theirs) and int(theirs["qkv/n_edges"]) == 46 and int(theirs["attn_in/n_edges"]) == 26
    assert sum(key.startswith(("qkv/eap/", "qkv/acdc/", "attn_in/mask_grad/")) for key in theirs) >= 15
    for key, value in theirs.items():
        infinite = value.isinf()  # ACDC scores the edges it never prunes as infinite
        assert torch.equal(ours[key].isinf(), infinite), key
        finite = value.masked_fill(infinite, 0)
        # scores summed over integrated-gradient steps reach ~20: float32 noise relative to the scores' own scale
        assert_same(ours[key].masked_fill(infinite, 0), finite, atol=1e-4 * max(1.0, float(finite.abs().max())), what=key)


@needs_saelens
def test_modules_put_where_points_were_run_as_transformer_lens_runs_them(tmp_path):
    """auto_circuit's patch wrappers, put in place of points without setup(), and the per-head input switches'
    precedence (tests/patch_wrapper_idioms.py), against HookedTransformer 3.9 running the same code."""
    save_file({"tokens": tokens()}, str(tmp_path / "tokens.safetensors"))
    printed = oracle("patch_wrappers", probe.DEFAULT_MODEL, tmp_path / "tokens.safetensors", tmp_path / "theirs.safetensors")
    their_calls = json.loads(printed.splitlines()[-1])
    theirs = load_file(str(tmp_path / "theirs.safetensors"))
    model = HookedTransformer.from_pretrained_no_processing(probe.DEFAULT_MODEL).eval()
    ours, calls = patch_wrapper_idioms(model, tokens())
    assert calls == their_calls
    assert all(len(seen) == 1 for seen in calls.values())  # each wrapper ran, once per forward
    assert set(ours) == set(theirs)
    for key in theirs:
        assert_same(ours[key], theirs[key], atol=1e-4, what=key)
    assert_same(ours["both.attn_in"], ours["plain"], what="an edit at hook_attn_in beside split inputs")
    assert not torch.allclose(ours["attn_in_alone"], ours["plain"])


def _root_module_idioms(root: type, point: type) -> dict:
    """A model written on HookedRootModule as transformer-lens's docs write one: points, then `self.setup()`."""

    class Toy(root):
        def __init__(self):
            super().__init__()
            self.hook_a, self.hook_b = point(), point()
            self.setup()

        def forward(self, x):
            return self.hook_b(self.hook_a(x) * 2)

    model, x = Toy(), torch.arange(3.0)
    out = {"names": sorted(model.hook_dict), "named": repr(model.hook_a), "unnamed": repr(point())}
    out["cache"] = {name: t.tolist() for name, t in model.run_with_cache(x)[1].items()}
    for _ in range(2):
        model.hook_b.add_hook(lambda t, hook: t + 1)
    out["hooked"], out["run"] = repr(model.hook_b), model(x).tolist()
    model.reset_hooks()
    out["reset"] = repr(model.hook_b)
    return out


def test_a_root_module_subclass_sets_itself_up_as_on_transformer_lens():
    from transformer_lens import HookedRootModule  # transformer-lens's classes (4.x's import path)
    from transformer_lens.hook_points import HookPoint

    assert _root_module_idioms(probe.HookedRootModule, probe.HookPoint) == _root_module_idioms(HookedRootModule, HookPoint)
