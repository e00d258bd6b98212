"""transformer-lens as the oracle: its TransformerBridge over the same local checkpoint, booted once per directory.

compatibility mode with no_processing=True gives TL's classic HookedTransformer surface on the checkpoint's own
weights, which is what probe loads."""
from __future__ import annotations

import functools
import warnings

import torch


@functools.lru_cache(maxsize=4)
def bridge(directory: str):
    return booted(directory, no_processing=True)


def booted(directory, **compatibility) -> "TransformerBridge":  # noqa: F821
    """A fresh bridge over `directory` in compatibility mode with these settings (processing steps), in eval mode
    with gradients on (some idioms take them)."""
    from transformer_lens.model_bridge import TransformerBridge

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = TransformerBridge.boot_transformers(str(directory), device="cpu")
        model.enable_compatibility_mode(**compatibility)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def assert_same(ours, theirs, atol: float = 1e-4, what: str = "") -> None:
    """Equal tensors (or nested lists/tuples/dicts of them, or plain values) to atol."""
    if isinstance(theirs, torch.Tensor) or isinstance(ours, torch.Tensor):
        # the bridge returns some results as tensor subclasses that export through numpy: detach first
        ours, theirs = (torch.as_tensor(x.detach() if hasattr(x, "detach") else x) for x in (ours, theirs))
        assert ours.shape == theirs.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(theirs.shape)}"
        torch.testing.assert_close(ours.detach().float().cpu(), theirs.detach().float().cpu(), atol=atol, rtol=0,
                                   msg=lambda m: f"{what}: {m}")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), f"{what}: {len(ours)} items != {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, atol, f"{what}[{i}]")
    elif isinstance(theirs, dict):
        assert set(ours) == set(theirs), f"{what}: keys differ: {set(ours) ^ set(theirs)}"
        for k in theirs:
            assert_same(ours[k], theirs[k], atol, f"{what}[{k!r}]")
    elif isinstance(theirs, float):
        assert abs(ours - theirs) <= atol, f"{what}: {ours} != {theirs}"
    else:
        assert ours == theirs, f"{what}: {ours!r} != {theirs!r}"
