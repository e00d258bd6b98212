"""The analyses on a SoLU-LN model (transformer-lens's act_fn="solu_ln": SoLU, then a LayerNorm over d_mlp, then
W_out). hook_post is what W_out reads, so everything that reads a neuron as hook_post times its row of W_out (FFN
memories, neuron results, trigger scans) stays exact, and everything that treats the MLP as a whole (patching
mlp_out, transcoders in an attribution graph) does not look inside it: each is checked against a plain forward."""
from __future__ import annotations

import functools

import torch

from probe import DEFAULT_MODEL, HookedDecoder, HookedTransformerConfig
from probe.analyses import Site, attribution_graph, logit_diff_metric, memory_lookup, patch, sub_updates, top_triggers
from probe.names import act_name
from toy_helpers import assert_graph_complete, copied_from, random_transcoders, randomised

ANSWER, WRONG = 3, 5


@functools.cache
def solu_model() -> HookedDecoder:
    cfg = HookedTransformerConfig(d_model=32, d_head=8, n_heads=4, n_layers=2, n_ctx=32, d_vocab=60, d_mlp=64,
                                  act_fn="solu_ln")
    return randomised(HookedDecoder(cfg), seed=6).double()


def tokens(seed: int = 0, n: int = 9) -> torch.Tensor:
    return torch.randint(0, 60, (n,), generator=torch.Generator().manual_seed(seed))


def test_memories_read_hook_post_and_their_sub_updates_add_up_to_the_mlp_output():
    model, toks = solu_model(), tokens()
    with torch.no_grad():
        _, cache = model.run_with_cache(toks[None])
    lookup = memory_lookup(model, toks[None], position=-1, k=5)
    for li, layer in enumerate(lookup.layers):
        post = cache[act_name("post", layer)][0, -1]
        assert torch.allclose(lookup.coefficients[li].double(), post, atol=1e-6)
        mlp = model.blocks[layer].mlp
        written = sub_updates(model, layer, post).sum(0) + mlp.b_out
        assert torch.allclose(written, cache[act_name("mlp_out", layer)][0, -1], atol=1e-8)


def test_top_triggers_rank_hook_post():
    cfg = HookedTransformerConfig(d_model=32, d_head=8, n_layers=2, n_ctx=32, d_mlp=64, act_fn="solu_ln",
                                  tokenizer_name=str(DEFAULT_MODEL))  # text in: the bundled model's tokenizer
    model = randomised(HookedDecoder(cfg), seed=7)
    corpus = ["To be, or not to be, that is the question.", "ROMEO. But soft, what light through yonder window breaks?"]
    found = top_triggers(model, corpus, layers=[1], neurons=[0, 7], k=2, progress=False)
    with torch.no_grad():
        post = torch.cat([model.run_with_cache(text, names=[act_name("post", 1)])[1][act_name("post", 1)][0, 1:]
                          for text in corpus])  # [pos d_mlp], BOS left out as the scan leaves it
    best = post[:, [0, 7]].topk(2, dim=0).values.T  # [neuron k]
    assert torch.allclose(found.activations[0].float(), best, atol=1e-5)


def test_patching_an_mlp_output_is_the_forward_with_it_patched():
    model = solu_model()
    clean, corrupted = tokens(1)[None], tokens(2)[None]
    metric = logit_diff_metric(model, ANSWER, WRONG)
    site = Site("mlp_out", 0, pos=4)
    result = patch(model, clean, corrupted, metric, sites=[site])
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean)
        name = act_name("mlp_out", 0)
        logits = model.run_with_hooks(corrupted, fwd_hooks=[(name, copied_from(clean_cache, name, (slice(None), 4)))])
    expected = float(logits[0, -1, ANSWER] - logits[0, -1, WRONG])
    assert abs(float(result.patched[0]) - expected) < 1e-6


def test_an_attribution_graph_with_transcoders_explains_the_models_logits():
    """Transcoders replace the MLPs whole (the LayerNorm inside them never enters the linearisation): the graph is
    complete, each target's edges adding up to its value."""
    model = solu_model()
    transcoders = [sae.double() for sae in random_transcoders(model, torch.Generator().manual_seed(11))]
    toks = tokens(3)
    graph = attribution_graph(model, transcoders, toks, batch_size=8)
    with torch.no_grad():
        logits = model(toks[None])[0, -1]
    assert_graph_complete(graph, logits)
