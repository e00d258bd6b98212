"""Generic hook machinery: named hook points, scoped hooks, activation caches. Knows nothing about transformers."""
from probe.hooks.cache import ActivationCache
from probe.hooks.hook_point import HookFn, HookHandle, HookPoint
from probe.hooks.names import UnknownNameError
from probe.hooks.root import CacheTooLargeError, HookedRootModule, NameFilter

__all__ = ["ActivationCache", "CacheTooLargeError", "HookFn", "HookHandle", "HookPoint", "HookedRootModule", "NameFilter", "UnknownNameError"]
