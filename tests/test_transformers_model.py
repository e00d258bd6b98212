"""`model.original_model` (probe/transformers_model.py): the model as a `transformers` model of its family, as
transformer-lens 4's bridge gives it to lm-eval and to TL 4's LLaMA notebook. Oracles: `transformers` itself loading
the same checkpoint (the unprocessed weights, tensor for tensor), and TL 4's TransformerBridge's own
`original_model` after `enable_compatibility_mode()` (processed weights)."""
from __future__ import annotations

import pytest
import torch

import probe
from probe import HookedDecoder, HookedTransformerConfig
from test_bridge_names import native_bridge
from test_family_defaults import tokenized_checkpoint
from test_variants import build
from tl_oracle import assert_same

CASES = {  # learned positions and tied (the bundled GPT-2), GQA untied, parallel partial rotary, sandwich soft caps
    "gpt2": None, "llama": ("llama", {}), "neox": ("neox", {}), "gemma2": ("gemma2", {}),
    "qwen2": ("qwen2", {}),  # processing gives it an output bias that only Llama's format holds: a LlamaForCausalLM
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    dirs = {"gpt2": probe.DEFAULT_MODEL}
    for name, spec in CASES.items():
        if spec is None:
            continue
        directory = tmp_path_factory.mktemp(name)
        if name in ("llama", "qwen2"):  # the bridge needs a tokenizer it can load for these
            directory = tokenized_checkpoint(spec[0], directory / "checkpoint", **spec[1])
        else:
            build(spec[0], directory, **spec[1])
        dirs[name] = directory
    return dirs


def tokens(model) -> torch.Tensor:
    return torch.randint(3, min(model.cfg.d_vocab, 90), (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", sorted(CASES))
def test_original_model_is_the_checkpoint_as_transformers_loads_it(name, checkpoints):
    import transformers

    ours = HookedDecoder.boot_transformers(checkpoints[name])
    oracle = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[name]).eval()
    copy = ours.original_model
    assert type(copy) is type(oracle) and not copy.training
    theirs = oracle.state_dict()
    assert copy.state_dict().keys() == theirs.keys()
    for key, value in copy.state_dict().items():  # Gemma's norms hold 1 + w: w comes back to rounding
        torch.testing.assert_close(value, theirs[key], atol=1e-6, rtol=0, msg=key)
    toks = tokens(ours)
    with torch.no_grad():
        assert_same(copy(toks).logits, oracle(toks).logits, atol=1e-5, what="logits")
    # a separate model: its weights do not follow the model's
    with torch.no_grad():
        copy.get_input_embeddings().weight.zero_()
    assert ours.embed.W_E.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(CASES))
def test_after_compatibility_mode_it_computes_the_processed_model_as_the_bridges_does(name, checkpoints):
    """TL 4's LLaMA notebook: `hf_model = model.original_model` after `enable_compatibility_mode()`, then
    `assert torch.allclose(hf_model(ids).logits, model(ids), atol=1e-4, rtol=1e-2)` prompt by prompt."""
    import transformers

    ours = HookedDecoder.boot_transformers(checkpoints[name])
    ours.enable_compatibility_mode(disable_warnings=True)
    bridge = native_bridge(checkpoints[name])
    bridge.enable_compatibility_mode(disable_warnings=True)
    copy = ours.original_model
    assert isinstance(copy, transformers.PreTrainedModel)
    if name == "qwen2":
        assert type(copy).__name__ == "LlamaForCausalLM"
    else:
        assert type(copy) is type(bridge.original_model)
    toks = tokens(ours)
    with torch.no_grad():
        assert_same(copy(toks).logits, ours(toks), atol=1e-4, what="ours")
        assert_same(copy(toks).logits, bridge.original_model(toks).logits, atol=1e-4, what="the bridge's")
    fresh = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[name]).eval()
    with torch.no_grad():  # processing moved the logits by a constant per position at most
        assert_same(copy(toks).logits.log_softmax(-1), fresh(toks).logits.log_softmax(-1), atol=1e-4, what="log-probs")


def test_a_model_no_checkpoint_format_holds_is_refused_by_name():
    cfg = HookedTransformerConfig(n_layers=1, d_model=16, d_head=4, n_ctx=8, d_vocab=20, act_fn="gelu", attn_only=True)
    with pytest.raises(ValueError, match="original_model: no Hugging Face checkpoint format holds attention-only"):
        HookedDecoder(cfg).original_model
