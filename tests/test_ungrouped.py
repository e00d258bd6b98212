"""transformer-lens's `ungroup_grouped_query_attention` on grouped-query models (probe/attention.py `hooked_kv_heads`,
HookedDecoder.set_ungroup_grouped_query_attention): keys, values and their per-head inputs hooked once per query head.

The oracle: HookedTransformer of transformer-lens 3 (tests/saelens_oracle.py's `ungrouped` command) runs
tests/ungrouped_idioms.py, EAP-IG's reads, edits and gradients, on the same configs and weights as probe here."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from probe import HookedDecoder, HookedTransformerConfig
from probe.analyses import edge_attribution, faithfulness, logit_diff_metric, path_patch
from test_sae_training import needs_saelens, oracle
from ungrouped_idioms import ungrouped_idioms

LLAMA = dict(n_layers=2, d_model=32, d_head=8, n_heads=4, n_key_value_heads=2, d_mlp=48, d_vocab=50, n_ctx=16,
             act_fn="silu", normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=8, gated_mlp=True,
             final_rms=True)
CASES = {"llama-gqa": LLAMA, "qwen3-mqa": dict(LLAMA, n_key_value_heads=1, use_qk_norm=True)}
TOKENS = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def theirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ungrouped")
    save_file({"tokens": TOKENS}, str(tmp / "in.safetensors"))
    oracle("ungrouped", json.dumps(CASES), tmp / "in.safetensors", tmp / "out.safetensors")
    return load_file(str(tmp / "out.safetensors"))


def probe_model(theirs: dict, case: str) -> HookedDecoder:
    model = HookedDecoder(HookedTransformerConfig(**CASES[case])).eval()
    prefix = f"{case}/state."
    model.load_state_dict({k.removeprefix(prefix): v for k, v in theirs.items() if k.startswith(prefix)}, strict=True)
    return model


@needs_saelens
@pytest.mark.parametrize("case", sorted(CASES))
def test_ungrouped_reads_edits_and_gradients_agree_with_hooked_transformer(theirs, case):
    model = probe_model(theirs, case)
    ours = ungrouped_idioms(model, TOKENS)
    expected = {k.removeprefix(f"{case}/"): v for k, v in theirs.items()
                if k.startswith(f"{case}/") and not k.startswith(f"{case}/state.")}
    assert sorted(ours) == sorted(expected)
    assert ours["cache.k0"].shape[2] == ours["cache.v_input1"].shape[2] == 4 and ours["k_after"].shape[2] < 4
    for key, value in expected.items():
        torch.testing.assert_close(ours[key].to(value.dtype), value, atol=1e-4 * float(value.abs().max()) + 1e-6,
                                   rtol=0, msg=key)
    # the edits reached one query head's key or value: the logits moved
    assert float((expected["edited"] - expected["logits"]).abs().max()) > 1e-3


@needs_saelens
def test_generation_with_the_key_value_cache_ungrouped_is_generation_without_it(theirs):
    model = probe_model(theirs, "llama-gqa")
    model.cfg.ungroup_grouped_query_attention = True
    cached = model.generate(TOKENS[:1, :4], max_new_tokens=3, do_sample=False, stop_at_eos=False, verbose=False)
    assert torch.equal(cached, theirs["llama-gqa/generated"])


@needs_saelens
def test_circuit_analyses_score_a_grouped_model_the_same_with_the_switch_on(theirs):
    model = probe_model(theirs, "llama-gqa")
    clean, corrupted = TOKENS, TOKENS.flip(0)
    metric = logit_diff_metric(model, [3, 5], [5, 3])

    def analyses():
        scores = edge_attribution(model, clean, corrupted, metric, method="eap-ig-inputs", ig_steps=2)
        circuit = scores.circuit(n_edges=10)
        return [scores.scores, faithfulness(model, circuit, clean, corrupted, metric).circuit_values,
                path_patch(model, clean, corrupted, metric, senders="L0H1", receivers="L1KV0<k").patched]

    grouped = analyses()
    model.cfg.ungroup_grouped_query_attention = True
    ungrouped = analyses()
    assert model.cfg.ungroup_grouped_query_attention and model.blocks[0].attn.hooked_kv_heads == 4
    for got, expected in zip(ungrouped, grouped):
        torch.testing.assert_close(got, expected)


def test_hook_shapes_predict_an_ungrouped_models_cache():
    from probe.shapes import hook_shapes

    model = HookedDecoder(HookedTransformerConfig(**CASES["llama-gqa"]))
    model.cfg.ungroup_grouped_query_attention = True
    model.set_use_split_qkv_input(True)
    with torch.no_grad():
        _, cache = model.run_with_cache(TOKENS, names=lambda n: True)
    predicted = hook_shapes(model.cfg, *TOKENS.shape, per_head_input_layers=range(model.cfg.n_layers))
    assert {n: tuple(t.shape) for n, t in cache.items()} == {n: s for n, s in predicted.items() if n in cache}
    assert cache["k", 0].shape[2] == 4 and cache["blocks.1.hook_v_input"].shape[2] == 4
    assert model.estimate_cache_bytes(list(cache), None, TOKENS) == sum(t.numel() * t.element_size() for t in cache.values())
