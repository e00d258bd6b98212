"""transformer-lens code that puts modules of its own where hook points were, without `setup()`, written once: the
oracle (tests/saelens_oracle.py `patch_wrappers`, HookedTransformer of transformer-lens 3.9) and
tests/test_tree_setup.py (probe's HookedTransformer) each run `patch_wrapper_idioms` on the bundled model.

auto_circuit's `patchable_model` wraps each point it patches in a module that edits the activation and then calls the
point it holds; TL's blocks call whatever module is in the slot. Also the precedence of transformer-lens's per-head
input switches: with use_split_qkv_input on, an edit at hook_attn_in reaches nothing."""
from __future__ import annotations

import torch
from torch import nn

WRAPPED = ("blocks.0.attn.hook_result", "blocks.1.hook_q_input", "blocks.1.hook_k_input", "blocks.0.hook_v_input",
           "blocks.0.hook_mlp_in", "blocks.1.hook_resid_pre", "blocks.1.attn.hook_pattern", "blocks.0.ln2.hook_normalized")


class PatchWrapper(nn.Module):
    """The shape of auto_circuit's PatchWrapperImpl: the point it replaced is its child, called on an edited input."""

    def __init__(self, module: nn.Module, shift: float):
        super().__init__()
        self.module, self.shift, self.calls = module, shift, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(list(x.shape))
        ramp = torch.linspace(-1, 1, x.shape[-1], dtype=x.dtype, device=x.device)
        return self.module(x + self.shift * ramp)


def _swap(model, name: str, module: nn.Module) -> nn.Module:
    parent, _, attribute = name.rpartition(".")
    owner = model.get_submodule(parent)
    held = getattr(owner, attribute)
    setattr(owner, attribute, module)
    return held


def _shift_by(amount: float):
    return lambda x, hook: x + amount * torch.linspace(-1, 1, x.shape[-1], dtype=x.dtype)


def patch_wrapper_idioms(model, tokens: torch.Tensor) -> tuple[dict, dict]:
    """({result name: tensor}, {name: how often and on what shape each wrapper was called})."""
    out, calls = {}, {}
    with torch.no_grad():
        out["plain"] = model(tokens)
        model.cfg.use_attn_result = True
        model.cfg.use_split_qkv_input = True
        model.cfg.use_hook_mlp_in = True
        for index, name in enumerate(WRAPPED):  # one wrapper at a time
            wrapper = PatchWrapper(_swap(model, name, None), 0.05 * (index + 1))
            _swap(model, name, wrapper)
            out[f"one.{name}"] = model(tokens)
            calls[name] = wrapper.calls
            _swap(model, name, wrapper.module)
        wrappers = [PatchWrapper(_swap(model, name, None), 0.02) for name in WRAPPED]
        for name, wrapper in zip(WRAPPED, wrappers):
            _swap(model, name, wrapper)
        out["all"], cache = model.run_with_cache(tokens, names_filter=list(WRAPPED))
        for name in WRAPPED:  # the point inside its wrapper: the cache sees the edited activation
            out[f"cached.{name}"] = cache[name]
        out["all_hooked"] = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_q_input", _shift_by(0.3))])
        for name, wrapper in zip(WRAPPED, wrappers):
            _swap(model, name, wrapper.module)
        out["unwrapped"] = model(tokens)

        model.cfg.use_attn_in = True  # both switches: q, k and v read the residual; hook_attn_in only observes
        out["both.attn_in"] = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_attn_in", _shift_by(0.4))])
        out["both.q_input"] = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_q_input", _shift_by(0.4))])
        out["both.attn_in_cached"] = model.run_with_cache(tokens, names_filter="blocks.0.hook_attn_in")[1][
            "blocks.0.hook_attn_in"]
        model.cfg.use_split_qkv_input = False  # attn_in alone: q, k and v read it
        out["attn_in_alone"] = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_attn_in", _shift_by(0.4))])
        model.cfg.use_attn_in = False
    return {key: t.detach().clone().contiguous() for key, t in out.items()}, calls
