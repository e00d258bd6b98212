"""transformer-lens's pre-SAELens HookedSAETransformer pattern, as research code copied it (Kissane et al.'s
attention-output SAEs): a subclass of HookedTransformer that keeps its own `acts_to_saes` dict, an SAE module built
on transformer-lens's HookedRootModule and HookPoint put where a hook point was, `setup()`, and a fresh `HookPoint()`
put back to turn it off; and a layer wrapped in a module with transformer-lens HookPoints around it, one of them hooked
directly (circuit-tracer's ReplacementMLP). Run on HookedTransformer by the oracle (tests/saelens_oracle.py: sae_splice) and on
probe by tests/test_tree_setup.py, with transformer-lens's classes for the SAE on both sides."""
from __future__ import annotations

import torch
from torch import nn

NAME = "blocks.1.attn.hook_z"


def subclass_of(base: type) -> type:
    class HookedSAETransformer(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.acts_to_saes = {}

    return HookedSAETransformer


def make_sae(root: type, point: type, d_in: int, d_sae: int):
    class HookedSAE(root):
        def __init__(self):
            super().__init__()
            gen = torch.Generator().manual_seed(3)
            self.W_enc = nn.Parameter(torch.randn(d_in, d_sae, generator=gen) / d_in ** 0.5)
            self.W_dec = nn.Parameter(torch.randn(d_sae, d_in, generator=gen) / d_sae ** 0.5)
            self.b_enc = nn.Parameter(torch.randn(d_sae, generator=gen) * 0.1 - 0.05)
            self.hook_sae_input, self.hook_sae_acts_post, self.hook_sae_output = point(), point(), point()
            self.setup()

        def forward(self, z):
            x = self.hook_sae_input(z.flatten(-2))
            acts = self.hook_sae_acts_post(torch.relu(x @ self.W_enc + self.b_enc))
            return self.hook_sae_output(acts @ self.W_dec).view(z.shape)

    return HookedSAE()


def set_deep_attr(obj, path: str, value) -> None:
    *parts, last = path.split(".")
    for part in parts:
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    setattr(obj, last, value)


def sae_splice_idioms(model, root: type, point: type, tokens: torch.Tensor) -> tuple[dict, dict]:
    """({result name: tensor}, {listing name: hook names})."""
    out, names = {}, {}
    sae = make_sae(root, point, model.cfg.n_heads * model.cfg.d_head, 48)
    with torch.no_grad():
        out["plain"] = model(tokens)
        model.acts_to_saes[NAME] = sae  # the subclass's own dict
        set_deep_attr(model, NAME, model.acts_to_saes[NAME])  # turn_saes_on
        model.setup()
        names["spliced"] = sorted(name for name in model.hook_dict if "hook_sae" in name)
        out["spliced"], cache = model.run_with_cache(tokens)
        for part in ("input", "acts_post", "output"):
            out[part] = cache[f"{NAME}.hook_sae_{part}"]
        out["feature_ablated"] = model.run_with_hooks(tokens, fwd_hooks=[
            (f"{NAME}.hook_sae_acts_post", lambda acts, hook: acts * (torch.arange(acts.shape[-1]) != 5))])
        # the SAE's own registry, as transformer-lens's HookedRootModule runs it, on the model's z
        _, own = sae.run_with_cache(out["input"].view(*out["input"].shape[:-1], model.cfg.n_heads, model.cfg.d_head))
        names["sae_cache"] = sorted(own.keys())
        out["sae_acts_post"] = own[f"{NAME}.hook_sae_acts_post"]
        set_deep_attr(model, NAME, point())  # turn_saes_off
        model.setup()
        names["off"] = sorted(name for name in model.hook_dict if "hook_sae" in name)
        out["off"], cache = model.run_with_cache(tokens)
        out["z_off"] = cache[NAME]
    return {key: t.detach().clone().contiguous() for key, t in out.items()}, names


class WrappedMLP(nn.Module):
    def __init__(self, old_mlp: nn.Module, point: type):
        super().__init__()
        self.old_mlp, self.hook_in, self.hook_out = old_mlp, point(), point()

    def forward(self, x):
        return self.hook_out(self.old_mlp(self.hook_in(x)))


def wrapper_idioms(model, point: type, tokens: torch.Tensor) -> tuple[dict, dict]:
    """({result name: tensor}, {listing name: hook names}) with block 0's MLP wrapped."""
    out = {}
    block = model.blocks[0]
    block.mlp = WrappedMLP(block.mlp, point)
    block.mlp.hook_in.add_hook(lambda x, hook: x * 0.5, is_permanent=True)  # the wrapper's own, on its point
    model.setup()
    names = {"wrapped": sorted(name for name in model.hook_dict if name.startswith("blocks.0.mlp."))}
    with torch.no_grad():
        out["wrapped"], cache = model.run_with_cache(tokens)
        out["mlp_in"], out["mlp_out"] = cache["blocks.0.mlp.hook_in"], cache["blocks.0.mlp.hook_out"]
        out["zeroed"] = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_out", lambda x, hook: x * 0)])
        held = block.mlp.hook_out  # code holding the point calls it directly
        seen = []
        with model.hooks(fwd_hooks=[("blocks.0.mlp.hook_out", lambda x, hook: seen.append(hook.name) or x + 1)]):
            out["held"] = held(torch.zeros(3))
        names["seen"] = seen
    return {key: t.detach().clone().contiguous() for key, t in out.items()}, names
