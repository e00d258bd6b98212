"""transformer-lens attributes tutorials read that probe's own API spells otherwise: `cache.cache_dict`,
`model.unembed.b_U`, `model.blocks[l].attn.OV` / `.QK`, `hook_point.fwd_hooks` / `.bwd_hooks`, and
`tl_parameters()` (what TL 4's SVDInterpreter reads). The oracles: HookedTransformer's own cache and state dict
(tests/saelens_oracle.py's `tl_cache`), TL 4's SVDInterpreter on its bridge over the same checkpoint, and the
weights by hand."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import probe
from probe import HookedDecoder, HookedTransformerConfig
from test_sae_training import needs_saelens, oracle
from tl_oracle import bridge

SETTINGS = dict(d_model=32, d_head=8, n_heads=4, n_layers=2, n_ctx=16, d_vocab=50, d_mlp=64, act_fn="gelu")


@pytest.fixture(scope="module")
def hooked_transformer(tmp_path_factory):
    """(probe's model with HookedTransformer's weights, the oracle's outputs, tokens)."""
    tmp = tmp_path_factory.mktemp("tl_cache")
    tokens = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(2))
    save_file({"tokens": tokens}, str(tmp / "tokens.safetensors"))
    oracle("tl_cache", json.dumps(SETTINGS), tmp / "tokens.safetensors", tmp / "out.safetensors")
    out = load_file(str(tmp / "out.safetensors"))
    model = HookedDecoder(HookedTransformerConfig(**SETTINGS)).eval()
    model.load_state_dict({k.removeprefix("state."): v for k, v in out.items() if k.startswith("state.")}, strict=True)
    return model, out, tokens


@needs_saelens
def test_cache_dict_holds_hooked_transformers_activations_by_name(hooked_transformer):
    """The Attribution_Patching_Demo idiom: iterate `cache.cache_dict` by name; every activation HookedTransformer
    caches is there under its name, with its value."""
    model, out, tokens = hooked_transformer
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    theirs = {k.removeprefix("cache."): v for k, v in out.items() if k.startswith("cache.") and ".hook_" in k}
    assert set(theirs) == set(cache.cache_dict) and "unembed.hook_in" in theirs
    for name, value in theirs.items():
        torch.testing.assert_close(cache.cache_dict[name], value, atol=1e-4, rtol=1e-4, msg=name)
    z_only = {name: t for name, t in cache.cache_dict.items() if name.endswith("hook_z")}
    assert sorted(z_only) == [f"blocks.{l}.attn.hook_z" for l in range(2)]
    cache.cache_dict["blocks.0.attn.hook_z"] = torch.zeros(1)  # TL's attribute is the cache's own dict
    assert cache["z", 0].shape == (1,)


@needs_saelens
def test_unembed_b_u_and_a_modules_ov_and_qk_are_hooked_transformers(hooked_transformer):
    """ARENA 1.1's unembedding by hand (`x @ model.unembed.W_U + model.unembed.b_U`) gives HookedTransformer's
    logits; `blocks[l].attn.OV` / `.QK` are W_V W_O and W_Q W_K^T per head from TL's own state dict."""
    model, out, tokens = hooked_transformer
    normed = out["cache.ln_final.hook_normalized"]
    w = out["state.ln_final.w"]
    logits = (normed * w + out["state.ln_final.b"]) @ model.unembed.W_U + model.unembed.b_U
    torch.testing.assert_close(logits, out["logits"], atol=1e-4, rtol=1e-4)
    for l in range(2):
        W_Q, W_K, W_V, W_O = (out[f"state.blocks.{l}.attn.{n}"] for n in ("W_Q", "W_K", "W_V", "W_O"))
        torch.testing.assert_close(model.blocks[l].attn.OV.AB, W_V @ W_O, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.blocks[l].attn.QK.AB, W_Q @ W_K.mT, atol=1e-5, rtol=1e-5)


def test_a_grouped_query_modules_ov_repeats_each_key_value_head():
    model = HookedDecoder(HookedTransformerConfig(**SETTINGS, n_key_value_heads=2)).eval()
    attn = model.blocks[1].attn
    for h in range(4):
        torch.testing.assert_close(attn.OV.AB[h], attn.W_V[h // 2] @ attn.W_O[h])
        torch.testing.assert_close(attn.QK.AB[h], attn.W_Q[h] @ attn.W_K[h // 2].T)


def test_fwd_hooks_and_bwd_hooks_list_what_is_attached():
    """`len(model.hook_dict[name].fwd_hooks)`, as transformer-lens code counts a point's hooks."""
    model = HookedDecoder(HookedTransformerConfig(**SETTINGS)).eval()
    point = model.hook_dict["blocks.0.hook_resid_post"]
    assert point.fwd_hooks == [] and point.bwd_hooks == []
    point.add_hook(lambda x, hook: None)
    point.add_hook(lambda g, hook: None, dir="bwd")
    point.add_hook(lambda x, hook: None, is_permanent=True)
    with model.hooks([("blocks.0.hook_resid_post", lambda x, hook: None)]):
        assert len(point.fwd_hooks) == 3 and len(point.bwd_hooks) == 1
    assert len(point.fwd_hooks) == 2
    model.reset_hooks()
    assert len(point.fwd_hooks) == 1 and point.bwd_hooks == []  # the permanent one stays
    point.fwd_hooks[0].remove()
    assert point.fwd_hooks == []


def test_svd_interpreter_reads_tl_parameters_as_on_the_bridge():
    """TL 4's SVDInterpreter on a probe model (it reads `tl_parameters()`) gives what it gives on TL's own bridge
    over the same checkpoint, for OV, w_in and w_out singular vectors."""
    from transformer_lens.SVDInterpreter import SVDInterpreter

    ours = HookedDecoder.from_pretrained(probe.DEFAULT_MODEL).eval()
    theirs = bridge(probe.DEFAULT_MODEL)
    for kind, head in (("OV", 2), ("w_in", None), ("w_out", None)):
        got = SVDInterpreter(ours).get_singular_vectors(kind, layer_index=1, head_index=head, num_vectors=4)
        want = SVDInterpreter(theirs).get_singular_vectors(kind, layer_index=1, head_index=head, num_vectors=4)
        # singular vectors are defined up to sign: compare each one's absolute values
        torch.testing.assert_close(got.abs(), want.abs().to(got.dtype), atol=1e-4, rtol=1e-3, msg=kind)


def test_tl_parameters_are_tl_names_in_the_graph_of_probes_weights():
    """A loss on `tl_parameters()["blocks.0.attn.W_Q"]` sends its gradient to the query rows of the fused weight."""
    model = HookedDecoder(HookedTransformerConfig(**SETTINGS)).eval()
    params = model.tl_parameters()
    # the state dict's weights: its TL buffers (mask, IGNORE) are not parameters
    weights = {name: value for name, value in model.state_dict().items() if not name.endswith(("mask", "IGNORE"))}
    assert dict(model.tl_named_parameters()).keys() == params.keys() == weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(params[name].detach(), value, msg=name)
    (params["blocks.0.attn.W_Q"] ** 2).sum().backward()
    grad = model.blocks[0].attn.qkv.weight.grad
    n_q = 4 * 8
    torch.testing.assert_close(grad[:n_q], 2 * model.blocks[0].attn.qkv.weight[:n_q].detach())
    assert not grad[n_q:].any()


def test_transformer_lens_three_input_attention_call_is_refused_naming_the_one_input_call():
    model = HookedDecoder(HookedTransformerConfig(**SETTINGS)).eval()
    x = torch.randn(1, 5, 32)
    with pytest.raises(TypeError, match=r"not transformer-lens's attn\(query_input, key_input, value_input\): call "
                                        r"attn\(x\)"):
        model.blocks[0].attn(x, x, x)
    torch.testing.assert_close(model.blocks[0].attn(x), model.blocks[0].attn(x, torch.arange(5)[None]))


@pytest.mark.parametrize("source", ["bundled", "toy"])
def test_a_config_rebuilt_from_its_dict_builds_the_same_model(source):
    """TL code's `HookedTransformerConfig(**model.cfg.to_dict())` (and the same through JSON, as a training script
    saves its config): the config rebuilt is the model's, and a model built from it with the same state dict gives
    the same logits."""
    import json as json_module

    if source == "bundled":
        model = HookedDecoder.from_pretrained(probe.DEFAULT_MODEL).eval()
    else:
        model = HookedDecoder(HookedTransformerConfig(**SETTINGS, n_key_value_heads=2)).eval()
    for values in (model.cfg.to_dict(), json_module.loads(json_module.dumps(model.cfg.to_dict()))):
        rebuilt = HookedTransformerConfig(**values)
        assert rebuilt == model.cfg
        copy = HookedDecoder(rebuilt).eval()
        copy.load_state_dict(model.state_dict(), strict=True)
        tokens = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(copy(tokens), model(tokens), atol=1e-4, rtol=1e-4)  # GPT-2 weights lie transposed
