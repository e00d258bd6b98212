"""transformer-lens's `setup()`: code that changes a model's module tree calls it so the model reads the tree again.

transformer-lens's pre-SAELens HookedSAETransformer, and the research code that copied it, splice an SAE by putting
the SAE module (a HookedRootModule with HookPoints, transformer-lens's own classes) where a hook point was, call
`setup()`, and turn it off by putting a fresh `HookPoint()` back. Other code wraps a layer in a module of its own
with transformer-lens HookPoints around it, hooks those directly and keeps references to them. So a
transformer-lens point stays where the code put it, with its own hooks, and probe gives it a shadow: one of probe's
points, run on its output by a forward hook, which probe's names, hooks and caches reach."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from probe.hooks.hook_point import HookPoint


def is_foreign_point(module: nn.Module) -> bool:
    """Another library's hook point (transformer-lens's, whichever version): named so, and not probe's."""
    return type(module).__name__ == "HookPoint" and not isinstance(module, HookPoint)


def observed(slot: nn.Module) -> bool:
    """Whether the forward must compute what the hook point in this slot sees. probe's point: while something is
    attached. Any other module code put in its place (auto_circuit's patch wrappers, another library's point): always,
    since it is there to be called, as transformer-lens calls its points."""
    return slot.active if isinstance(slot, HookPoint) else True


def _run_shadow(shadow: HookPoint, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    return shadow(output)


class TreeSetup:
    """Mixed into HookedRootModule, whose `setup_hooks` and registries it uses."""

    def setup(self) -> None:
        """Name every hook point in the tree again, as after construction. A module put where a point was takes its
        place in the names (an SAE at `blocks.1.attn.hook_z` brings `blocks.1.attn.hook_z.hook_sae_acts_post`).
        A transformer-lens HookPoint gets a shadow point of probe's under its name (its own hooks, and code holding
        it, keep working); one put back where probe had a point of its own gives way to that point again (an
        opt-in point such as `hook_result` stays opt-in), and is refused if it carries hooks: attach them through
        the model after `setup()`. Points lent for a block (`lent_hook_points`: SAEs `add_sae` spliced in) stay.
        A model that has not named its points yet (a subclass's `__init__` ending in `self.setup()`, as TL's
        own root modules end) names them here."""
        if "_hook_points" not in self.__dict__:
            self.setup_hooks()
        displaced = self.__dict__.setdefault("_displaced_points", {})  # probe's points taken out of the tree
        shadows = self.__dict__.setdefault("_shadow_points", {})  # id(foreign point): (it, its shadow)
        in_tree = {id(module) for module in self.modules()} | {id(shadow) for _, shadow in shadows.values()}
        for name, point in self._hook_points.items():
            if id(point) not in in_tree:
                displaced.setdefault(name, point)
        foreign = {}
        for name, module in list(self.named_modules()):
            if not is_foreign_point(module):
                continue
            if name in displaced:
                if module._forward_hooks or module._backward_hooks or module._forward_pre_hooks:
                    raise ValueError(f"setup(): the transformer-lens HookPoint put back at {name} carries hooks of its "
                                     f"own, and probe's point takes its place there; attach them through the model "
                                     f"after setup()")
                parent_name, _, attribute = name.rpartition(".")
                setattr(self.get_submodule(parent_name) if parent_name else self, attribute, displaced.pop(name))
                continue
            if shadows.get(id(module), (None,))[0] is not module:
                shadow = HookPoint()
                module.register_forward_hook(partial(_run_shadow, shadow))
                shadows[id(module)] = (module, shadow)
            foreign[name] = shadows[id(module)][1]
        kept = {id(shadow) for shadow in foreign.values()}  # a point taken out of the tree leaves its shadow behind
        self.__dict__["_shadow_points"] = {key: pair for key, pair in shadows.items() if id(pair[1]) in kept}
        lent = self._lent_points
        self.setup_hooks({alias: name for alias, name in self._aliases.items() if alias not in foreign}, self._left_out)
        for name, shadow in foreign.items():
            shadow.name = name
        self._hook_points.update(foreign)
        self._lent_points = lent
