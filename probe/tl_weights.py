"""transformer-lens's per-head weight names, written through to the parameters they are views of.

probe keeps fused parameters where TL keeps one per name: `attn.qkv.weight` holds W_Q, W_K and W_V, `attn.W_O` is
`out.weight` rearranged, `mlp.W_out` is `fc_out.weight.T`. Reading them is a view, so an in-place edit
(`W_O[head] = 0`, `nn.init.zeros_(W_V)`) already reaches the model. TL code also edits them in three ways a plain
view would not follow: abliteration assigns `block.attn.W_O.data = orthogonalized` (on a plain view that replaces a
temporary's storage and changes nothing, silently), model editing writes `mlp.W_out += u v^T` (the augmented
assignment ends in `mlp.W_out = ...`), and some code assigns `attn.W_O = nn.Parameter(new)`. `weight_view` makes
each of them copy the new values into the fused parameter, as they land in TL's own.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


class WeightView(torch.Tensor):
    """A view of a fused parameter under TL's name: a tensor like any other (its arithmetic gives plain tensors),
    except that assigning `.data` writes the new values through to the parameter."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        write_into(self, value, "this weight")

    @property
    def grad(self) -> Optional[torch.Tensor]:
        """The gradient the parameter it views holds, read through the same view, as TL code reads `attn.W_Q.grad`
        after a backward (a view's own .grad is always None); None where the parameter has none yet."""
        base = self._base
        grad = getattr(base, "grad", None)
        if grad is None:
            return None
        if grad.stride() != base.stride():  # laid out as the parameter is, so the view's strides and offset apply
            grad = torch.empty_strided(base.shape, base.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)
        offset = grad.storage_offset() + self.storage_offset() - base.storage_offset()
        return grad.as_strided(self.shape, self.stride(), offset)

    def requires_grad_(self, requires_grad: bool = True) -> "WeightView":
        # torch refuses it on a view ("only ... leaf variables"); say which parameter holds these weights
        raise RuntimeError("this TL-named weight is a view of one of probe's fused parameters, so it cannot be frozen "
                           "or trained apart: freeze or optimise the parameter it views, by its name in "
                           "model.named_parameters() (attn.qkv.weight holds W_Q, W_K and W_V; attn.out.weight W_O; "
                           "mlp.fc_in.weight W_in; mlp.fc_out.weight W_out; unembed.weight W_U)")


def write_into(view: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} takes a tensor of shape {tuple(view.shape)}, got {type(value).__name__}")
    if value.shape != view.shape:
        raise ValueError(f"{name} is {tuple(view.shape)} and the new value is {tuple(value.shape)}: probe writes the "
                         "values into its fused parameter, which keeps its shape; give a tensor of the same shape")
    if value.data_ptr() == view.data_ptr() and value.stride() == view.stride():
        return  # `W_out += delta` already wrote in place; the assignment that ends it has nothing left to do
    with torch.no_grad():
        torch.Tensor.copy_(view, value.detach())


def weight_view(getter: Callable[[torch.nn.Module], Optional[torch.Tensor]],
                absent: Optional[Callable[[torch.nn.Module], tuple[int, ...]]] = None) -> property:
    """A property for `getter`'s view of a parameter (None where the model has no such weight): reads give a
    WeightView, assignments write into the parameter. `absent` (a bias's shape, from its module): where the model
    has no such bias, reads give transformer-lens's zeros instead, all one element (so an edit in place is refused,
    `add_` / `copy_` / `[...] =`, rather than lost), and assignments are refused."""
    name = getter.__name__

    def read(module):
        view = getter(module)
        if view is None and absent is not None:
            like = next(module.parameters())
            return like.new_zeros(()).expand(absent(module))
        if view is None or torch.compiler.is_compiling():  # a compiled forward reads it as the plain view it is
            return view
        return view.as_subclass(WeightView)  # shares storage and autograd history with the parameter

    def write(module, value):
        view = getter(module)
        if view is None:
            raise ValueError(f"this model has no {name} (it was built without that bias) to assign to")
        write_into(view, value, name)

    return property(read, write, doc=getter.__doc__)


def bias_view(absent: Callable[[torch.nn.Module], tuple[int, ...]]) -> Callable[[Callable], property]:
    """weight_view for a bias some models lack: zeros of shape `absent(module)` there, as transformer-lens has them
    (EAP-IG stacks every block's `attn.b_O`). probe's own code asks the fused parameter whether there is one."""
    return lambda getter: weight_view(getter, absent)


class WritableWeights:
    """Mixed into the modules with weight views: `module.W_O = nn.Parameter(new)` reaches the view's setter, where
    torch.nn.Module would try to register a parameter of that name and fail."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(getattr(type(self), name, None), property):
            object.__setattr__(self, name, value)  # the property's setter (or its "no setter" error)
        else:
            super().__setattr__(name, value)
