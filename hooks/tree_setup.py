"""transformer-lens's `setup()`: code that changes a model's module tree calls it so the model reads the tree again.

transformer-lens's pre-SAELens HookedSAETransformer, and the research code that copied it, splice an SAE by putting
the SAE module (a HookedRootModule with HookPoints, transformer-lens's own classes) where a hook point was, call
`setup()`, and turn it off by putting a fresh `HookPoint()` back. Both libraries' hook points pass their input
through unchanged, so a transformer-lens point met in the tree can become one of probe's in place: probe's hooks,
caches and names then reach it."""
from __future__ import annotations

from torch import nn

from probe.hooks.hook_point import HookPoint


def is_foreign_point(module: nn.Module) -> bool:
    """Another library's hook point (transformer-lens's, whichever version): named so, and not probe's."""
    return type(module).__name__ == "HookPoint" and not isinstance(module, HookPoint)


class TreeSetup:
    """Mixed into HookedRootModule, whose `setup_hooks` and registries it uses."""

    def setup(self) -> None:
        """Name every hook point in the tree again, as after construction. A module put where a point was takes its
        place in the names (an SAE at `blocks.1.attn.hook_z` brings `blocks.1.attn.hook_z.hook_sae_acts_post`).
        A transformer-lens HookPoint met on the way becomes probe's: where probe had a point of its own, that point
        comes back (with what it computes only when asked, such as per-head results, and its aliases), elsewhere a
        new one; a module holding a registry of those points (the SAE's own `hook_dict` / `mod_dict`) is pointed
        at probe's. A transformer-lens point that carries hooks of its own is refused: attach them through the
        model after `setup()`. Points lent for a block (`lent_hook_points`) stay lent."""
        displaced = self.__dict__.setdefault("_displaced_points", {})  # probe's points taken out of the tree
        in_tree = {id(module) for module in self.modules()}
        for name, point in self._hook_points.items():
            if id(point) not in in_tree:
                displaced.setdefault(name, point)
        replaced = {}
        for name, module in list(self.named_modules()):
            if not is_foreign_point(module):
                continue
            if module._forward_hooks or module._backward_hooks or module._forward_pre_hooks:
                raise ValueError(f"setup(): the transformer-lens HookPoint at {name} carries hooks of its own, which "
                                 f"probe's point in its place would not run; attach them through the model after setup()")
            parent_name, _, attribute = name.rpartition(".")
            point = displaced.pop(name) if name in displaced else HookPoint()
            setattr(self.get_submodule(parent_name) if parent_name else self, attribute, point)
            replaced[id(module)] = point
        for module in self.modules():
            for registry in (getattr(module, "hook_dict", None), getattr(module, "mod_dict", None)):
                if module is not self and isinstance(registry, dict):
                    registry.update({key: replaced[id(value)] for key, value in registry.items() if id(value) in replaced})
        lent = self._lent_points
        self.setup_hooks(self._aliases, self._left_out)
        self._lent_points = lent
