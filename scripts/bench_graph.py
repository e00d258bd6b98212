"""Benchmark workload 15: an attribution graph of one 64-token prompt on the small model with its transcoders
(issue 20): time and memory, against one forward pass."""
from __future__ import annotations

from probe.cli.bench_harness import PROBE, Case, Context, at_most, no_grad, workload

GRAPH_TOKENS = 64
GRAPH_BUDGET = 5000  # loose: ~1,030 targets, 64 per backward pass, against one 64-token forward; 68x measured on 12-01


def transcoders_for(model):
    """The bundled transcoders when the model has the bundled model's shape, else random TopK ones of its shape
    (--quick's tiny model): the cost depends on the shapes, not on what the features mean."""
    import torch

    from probe import SAEConfig, SparseAutoencoder

    if (model.cfg.n_layers, model.cfg.d_model) == (4, 192):
        return "bundled"
    gen = torch.Generator().manual_seed(0)
    out = []
    for layer in range(model.cfg.n_layers):
        d = model.cfg.d_model
        sae = SparseAutoencoder(SAEConfig(d_in=d, d_sae=4 * d, hook_name=f"blocks.{layer}.ln2.hook_normalized",
                                          architecture="topk", k=min(32, d // 8), apply_b_dec_to_input=False,
                                          hook_name_out=f"blocks.{layer}.hook_mlp_out", d_out=d))
        with torch.no_grad():
            for param in sae.parameters():
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        out.append(sae.to(model.device, model.embed.W_E.dtype))
    return out


@workload("graph_small", 15, f"Attribution graph of one {GRAPH_TOKENS}-token prompt (small model, its transcoders)",
          f"graph with 1024 feature nodes <= {GRAPH_BUDGET}x one forward", floor="probe forward",
          check=at_most("attribution graph, 1024 feature nodes", "probe forward", GRAPH_BUDGET), model="small", shape="single")
def graph_small(ctx: Context) -> list[Case]:
    from probe.analyses.attribution_graph import attribution_graph
    from probe.analyses.replacement_model import load_transcoders

    probe = ctx.probe_model()
    tokens = ctx.tokens(seed=0, batch=1, seq=min(GRAPH_TOKENS, ctx.seq, probe.cfg.n_ctx))[0]  # fewer with --quick
    transcoders = load_transcoders(probe, transcoders_for(probe))
    graph = attribution_graph(probe, transcoders, tokens, max_feature_nodes=1024)
    return [
        Case("probe forward", PROBE, no_grad(lambda: probe(tokens[None]))),
        Case("attribution graph, 1024 feature nodes", PROBE,
             lambda: attribution_graph(probe, transcoders, tokens, max_feature_nodes=1024),
             note=f"{graph.n_active} features active; batch 64, logits then features in influence order"),
        Case("attribution graph, 256 feature nodes", PROBE,
             lambda: attribution_graph(probe, transcoders, tokens, max_feature_nodes=256)),
        Case("prune and draw the page", PROBE, lambda: graph.prune().page(),
             note="node 0.8, edge 0.98 (circuit-tracer's defaults); the interactive HTML"),
    ]
