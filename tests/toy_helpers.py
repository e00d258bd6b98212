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
