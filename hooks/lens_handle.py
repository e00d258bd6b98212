"""What transformer-lens code reads off a hook's handle beyond removing it.

TL keeps each hook as a LensHandle: `hook`, torch's RemovableHandle of the module hook TL wraps the function in,
`is_permanent`, `context_level` and `user_hook` (the function itself). Code that inspects which hooks a point
carries goes through torch's handle: ACDC reads `hook_point.fwd_hooks[i].hook.hooks_dict_ref()`, the point's
{id: wrapper} dict, and checks each wrapper's `__name__`, which TL sets to the repr of the function it wraps.
probe's HookHandle answers the same reads (`HookHandle.hook` is a TorchHandleView of it)."""
from __future__ import annotations

from functools import partial
from typing import Any, Callable


class TorchHandleView:
    """torch's RemovableHandle, as TL's LensHandle.hook holds it, for one of probe's hook handles: `id`, `remove()`
    and `hooks_dict_ref()`."""

    __slots__ = ("handle",)

    def __init__(self, handle: Any):
        self.handle = handle

    @property
    def id(self) -> int:
        return id(self.handle)

    def remove(self) -> None:
        self.handle.remove()

    def hooks_dict_ref(self) -> dict[int, Callable]:
        """The point's hooks in this hook's direction, in the order they run, as torch's dict of module hooks:
        {id: wrapper}, each wrapper named as TL names it (the same wrapper on every call, so two reads compare
        equal, as two reads of torch's dict do)."""
        return {id(handle): handle.module_hook for handle in self.handle.registry}


def module_hook(fn: Callable) -> Callable:
    """The module hook TL would register for `fn`: called as torch calls a module's forward hook, (module, inputs,
    output), it runs `fn` on the output; its `__name__` is `fn`'s repr (a partial's, its function's), as TL names it."""
    def wrapper(module, module_input, module_output):
        return fn(module_output, module)

    # a partial's own repr would print its arguments, which may be large tensors: TL names it by its function
    wrapper.__name__ = f"partial({fn.func!r},...)" if isinstance(fn, partial) else repr(fn)
    return wrapper
