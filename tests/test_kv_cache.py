"""transformer-lens's own key/value cache loops (probe/kv_cache.py: `KVCache.init_cache`, `freeze` / `unfreeze`, the
forward's `past_kv_cache=`): greedy decoding by hand, a frozen prefix shared by continuations, hooks and caches on
cached runs; and TL 3.9's `generate_stream` (probe/generation.py). The oracle: HookedTransformer of transformer-lens
3.9 with its TransformerLensKeyValueCache
(tests/saelens_oracle.py `kv_cache_loop` runs tests/kv_cache_idioms.py) on the same config and weights."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

import probe
from conftest import TINY, build_hf_checkpoint
from kv_cache_idioms import kv_cache_idioms
from probe import HookedDecoder, HookedTransformerConfig
from test_sae_training import needs_saelens, oracle
from toy_helpers import randomised

CASES = {
    "learned-positions": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="gelu_new"),
    "rotary-gqa": dict(n_layers=2, d_model=32, d_head=8, n_heads=4, n_key_value_heads=2, n_ctx=16, d_vocab=50,
                       act_fn="silu", normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=8,
                       gated_mlp=True, final_rms=True),
}
# no id 0, the tokenizer's <|endoftext|>: TL masks trailing pad ids of a run with a cache
TOKENS = torch.randint(1, 50, (2, 7), generator=torch.Generator().manual_seed(4))


@needs_saelens
@pytest.mark.parametrize("case", sorted(CASES))
def test_kv_cache_loops_agree_with_hooked_transformer(case, tmp_path):
    model = randomised(HookedDecoder(HookedTransformerConfig(**CASES[case])), seed=2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.fc_in.bias", "mlp.gate.bias")) and model.cfg.gated_mlp:
                param.zero_()  # TL's gated MLP has no bias before its product
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "state.safetensors"))
    save_file({"tokens": TOKENS}, str(tmp_path / "tokens.safetensors"))
    build_hf_checkpoint(tmp_path / "tokenizer", **TINY)
    oracle("kv_cache_loop", json.dumps(CASES[case]), tmp_path / "state.safetensors", tmp_path / "tokens.safetensors",
           tmp_path / "theirs.safetensors", tmp_path / "tokenizer")
    theirs = load_file(str(tmp_path / "theirs.safetensors"))
    model.set_tokenizer(AutoTokenizer.from_pretrained(tmp_path / "tokenizer"))  # the pad id, as TL's model has it
    ours = kv_cache_idioms(model, probe.TransformerLensKeyValueCache, TOKENS)
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key].to(value.dtype), value, atol=1e-4 * float(value.abs().max()) + 1e-6,
                                   rtol=0, msg=key)
    # the cached runs are the model's own: continuation a is the full prompt's last positions
    with torch.no_grad():
        full = model(TOKENS)
    torch.testing.assert_close(ours["continuation_a"], full[:, 3:], atol=1e-4, rtol=0)


def test_one_cache_under_two_names_is_taken_and_two_are_refused():
    model = HookedDecoder(HookedTransformerConfig(**CASES["learned-positions"]))
    cache = probe.HookedTransformerKeyValueCache.init_cache(model.cfg, model.cfg.device, 1)
    model(TOKENS[:1, :3], kv_cache=cache, past_kv_cache=cache)
    assert cache.length == 3
    with pytest.raises(ValueError, match="past_kv_cache is transformer-lens's name"):
        model(TOKENS[:1, 3:4], kv_cache=cache, past_kv_cache=probe.KVCache(model.cfg.n_layers))


def test_generate_stream_refuses_what_it_cannot_stream_naming_the_fix():
    model = HookedDecoder(HookedTransformerConfig(**CASES["learned-positions"]))
    with pytest.raises(ValueError, match="max_tokens_per_yield must be a positive int"):
        next(model.generate_stream(TOKENS[:1], 2, max_tokens_per_yield=0))
    with pytest.raises(ValueError, match="use generate\\(\\) for embeddings"):
        next(model.generate_stream(model.embed(TOKENS[:1]), 2))


def test_a_residual_run_refuses_a_cache_it_would_leave_inconsistent():
    model = HookedDecoder(HookedTransformerConfig(**CASES["learned-positions"]))
    cache = probe.HookedTransformerKeyValueCache.init_cache(model.cfg, model.cfg.device, 1)
    model(TOKENS[:1, :3], past_kv_cache=cache)
    residual = model(TOKENS[:1, 3:5], stop_at_layer=0)
    with pytest.raises(ValueError, match="freeze the cache"):
        model(residual, start_at_layer=1, past_kv_cache=cache)
    with pytest.raises(ValueError, match="input_to_embed\\(..., past_kv_cache=cache\\) returned"):
        model(residual, start_at_layer=0, attention_mask=torch.ones(1, 5, dtype=torch.long), past_kv_cache=cache)
    assert cache.length == 3 and cache.previous_attention_mask.shape == (1, 3)  # nothing kept from either
