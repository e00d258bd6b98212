"""q, k and v clamped after their norms (DecoderConfig.clip_qkv: OLMo-7B-0424 and later, OLMoE, MPT; transformer-lens's
clip_qkv). The oracles: HookedTransformer 3.9 on a toy built from its config (hook by hook, and processed);
transformers on OLMo, OLMoE and MPT checkpoints (test_variants.py's *-clip-qkv cases); faithfulness 1 and 0 of the
full and empty circuits, which the hooked engine runs (the sparse one computes attention from the weights)."""
from __future__ import annotations

import pytest
import torch

from probe import HookedDecoder, HookedTransformerConfig
from probe.analyses import logit_diff_metric
from probe.analyses.circuit import Circuit
from probe.analyses.circuit_graph import circuit_graph
from probe.analyses.faithfulness import CircuitRunner
from test_sae_training import needs_saelens
from test_variants import build
from tl_cases import assert_processed_as_hooked_transformer, assert_same_cache, hooked_transformer_outputs, part

CASES = {"clipped": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="gelu", clip_qkv=0.2,
                         positional_embedding_type="rotary", rotary_dim=8)}


def tokens() -> torch.Tensor:
    return torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def hooked_transformers(tmp_path_factory) -> dict:
    return hooked_transformer_outputs(tmp_path_factory.mktemp("tl_clip"), CASES, tokens(), processed=("clipped",))[0]


@needs_saelens
def test_every_hook_agrees_with_hooked_transformer_and_the_clamp_bites(hooked_transformers):
    out = part(hooked_transformers, "clipped/")
    model = HookedDecoder(HookedTransformerConfig(**CASES["clipped"])).eval()
    assert model.cfg.clip_qkv == 0.2
    model.load_state_dict(part(out, "state."), strict=True)
    assert_same_cache(model, tokens(), part(out, "cache."), out["logits"])
    q = part(out, "cache.")["blocks.1.attn.hook_q"]  # before the clamp (TL hooks nothing after it)
    assert q.abs().max() > 0.2
    assert_processed_as_hooked_transformer(CASES["clipped"], out, tokens())


def test_circuits_run_on_the_hooked_engine(tmp_path):
    build("olmo", tmp_path, clip_qkv=0.05)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    gen = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 101, (2, 8), generator=gen)
    corrupted = clean.clone()
    corrupted[:, 2:5] = torch.randint(0, 101, (2, 3), generator=gen)
    metric = logit_diff_metric(model, [5, 9], [7, 2])
    graph = circuit_graph(model)
    with pytest.raises(ValueError, match="nor clamped q, k and v"):
        CircuitRunner.prepare(model, clean, corrupted, metric, engine="sparse")
    runner = CircuitRunner.prepare(model, clean, corrupted, metric)
    assert runner.run is None  # auto: the hooked forward
    full = runner.faithfulness(Circuit(graph=graph, edges=torch.arange(graph.n_edges)))
    empty = runner.faithfulness(Circuit(graph=graph, edges=torch.zeros(0, dtype=torch.long)))
    assert full.value == pytest.approx(1.0, abs=1e-3) and empty.value == pytest.approx(0.0, abs=1e-3)
