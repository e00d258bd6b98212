"""What the toy-model tests share: random weights as a trained model's are (every path matters, norm weights near
1), and the hand-written oracles of the ablation and patching tests (a head zeroed, a patch, attribution patching
by autograd)."""
from __future__ import annotations

import torch

from probe import HookedDecoder


def randomised(model: HookedDecoder, seed: int) -> HookedDecoder:
    """`model` in eval mode with fresh weights: norm weights 1 + 0.2 N(0, 1) (a dropped norm would show), the rest
    0.3 N(0, 1), large enough that attention is sharp."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if name.endswith(".w") else 0.3 * noise)
    return model.eval()


def copied_from(cache, name: str, where):
    """A hook that replaces `where` (an index) of the activation at `name` with the same cells of `cache`."""
    def swap(activation, hook):
        activation = activation.clone()
        activation[where] = cache[name][where]
        return activation
    return swap


def attribution_by_hand(metric_of, clean_cache, names: list[str], sites) -> list[float]:
    """Each head site's attribution-patching estimate, by autograd: the corrupted run's metric plus
    ((clean - corrupted) z . d metric / d z) over the site's head. `metric_of(fwd_hooks)` runs the corrupted input
    with those hooks and returns the scalar metric; the hooks keep every z in `names` undetached, so an earlier
    layer's gradient includes its path through later heads."""
    kept = {}

    def keep(z, hook):
        kept[hook.name] = z if z.requires_grad else z.detach().requires_grad_(True)
        return kept[hook.name]

    value = metric_of([(name, keep) for name in names])
    grads = dict(zip(names, torch.autograd.grad(value, [kept[n] for n in names])))
    return [float(value.detach() + ((clean_cache[s.hook_name] - kept[s.hook_name].detach())
                                    * grads[s.hook_name])[:, :, s.head].sum()) for s in sites]


def zero_head(head: int):
    """A hook on hook_z that zeroes one head's output."""
    def hook(z, hook):
        z = z.clone()
        z[:, :, head] = 0.0
        return z
    return hook


def random_transcoders(model: HookedDecoder, gen: torch.Generator, reads: str = "blocks.{layer}.ln2.hook_normalized"):
    """One top-k transcoder per layer from `reads` (formatted with the layer) to hook_mlp_out, random weights drawn
    from `gen` (left advanced), in float32."""
    from probe import SAEConfig, SparseAutoencoder

    d_model, out = model.cfg.d_model, []
    for layer in range(model.cfg.n_layers):
        sae = SparseAutoencoder(SAEConfig(d_in=d_model, d_sae=24, hook_name=reads.format(layer=layer),
                                          architecture="topk", k=6, d_out=d_model, apply_b_dec_to_input=False,
                                          hook_name_out=f"blocks.{layer}.hook_mlp_out"))
        with torch.no_grad():
            for name, param in sae.named_parameters():
                param.copy_({"W_enc": 0.3, "b_enc": 0.1, "W_dec": 0.2, "b_dec": 0.05}[name]
                            * torch.randn(param.shape, generator=gen))
        out.append(sae)
    return out


def assert_graph_complete(graph, logits: torch.Tensor) -> None:
    """An attribution graph explains `logits` [vocab] (the read position's): each logit node's value is its centred
    logit, and every feature's and logit's edges, unvisited share and bias add up to its value."""
    from probe.analyses.attribution_graph import FEATURE, LOGIT

    is_logit = graph.kind == LOGIT
    assert torch.allclose(graph.value[is_logit], (logits - logits.mean())[graph.token[is_logit]], atol=1e-6)
    targets = (graph.kind == FEATURE) | is_logit
    total = graph.adjacency.sum(1) + graph.unvisited + graph.bias
    assert torch.allclose(total[targets], graph.value[targets], atol=1e-6)
