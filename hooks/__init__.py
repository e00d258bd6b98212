"""Generic hook machinery: named hook points, scoped hooks, activation caches. Knows nothing about transformers."""
from hooks.cache import ActivationCache
from hooks.hook_point import HookFn, HookHandle, HookPoint
from hooks.names import UnknownNameError
from hooks.root import CacheTooLargeError, HookedRootModule, NameFilter

__all__ = ["ActivationCache", "CacheTooLargeError", "HookFn", "HookHandle", "HookPoint", "HookedRootModule", "NameFilter", "UnknownNameError"]
