"""Generic hook machinery: named hook points, scoped hooks, activation caches. Knows nothing about transformers."""
from probe.hooks.cache import ActivationCache
from probe.hooks.hook_point import HookFn, HookHandle, HookPoint, PointUnderName
from probe.hooks.names import NameFilter, UnknownNameError
from probe.hooks.root import CacheTooLargeError, HookedRootModule
from probe.hooks.tree_setup import observed

__all__ = ["ActivationCache", "CacheTooLargeError", "HookFn", "HookHandle", "HookPoint", "HookedRootModule", "NameFilter", "PointUnderName", "UnknownNameError", "observed"]
