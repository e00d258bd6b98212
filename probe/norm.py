"""Normalisation layers with their scale and normalised input exposed as hook points."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from probe.hooks import HookPoint, observed
from probe.config import DecoderConfig, Norm


class FixedWeights:
    """A norm without learned weights (transformer-lens's LNPre / RMSPre): w is ones and b zeros, kept as buffers
    outside the state dict, so everything that reads a norm's w and b reads the right values."""

    def fix_weights(self, d_model: int, names: tuple[str, ...]) -> None:
        self.fixed = {name: 1.0 if name == "w" else 0.0 for name in names}
        for name, value in self.fixed.items():
            self.register_buffer(name, torch.full((d_model,), value), persistent=False)

    def drop_weights(self) -> None:
        """Turn learned weights that are already ones and zeros (folded away: probe.processing) into fixed ones."""
        names = tuple(name for name in ("w", "b") if isinstance(getattr(self, name, None), nn.Parameter))
        if names:
            like = self.w
            for name in names:
                delattr(self, name)
            self.fix_weights(like.shape[0], names)
            for name in names:
                setattr(self, name, getattr(self, name).to(device=like.device, dtype=like.dtype))

    def build_buffers(self) -> None:  # after building on the meta device (probe.loading)
        for name, value in getattr(self, "fixed", {}).items():
            old = getattr(self, name)
            setattr(self, name, torch.full(old.shape, value, device="cpu" if old.is_meta else old.device))


def folded_norm_weights(norm: Optional[nn.Module], name: str) -> dict[str, torch.Tensor]:
    """A LayerNorm's or RMSNorm's fixed w = 1 (and b = 0) by `name`.w / .b, where folding (or LNPre) left it none to
    learn; nothing for a norm with learned weights, for no norm, or for the identity of normalization_type=None."""
    if not isinstance(norm, (LayerNorm, RMSNorm)):
        return {}
    return {f"{name}.{weight}": getattr(norm, weight) for weight in getattr(norm, "fixed", {})}


class HookedEnds:
    """A norm's input and output as hook points too, `ln1.hook_in` / `ln1.hook_out` (transformer-lens 4's bridge names;
    HookedTransformer has neither, so caches of everything and predicates leave them out: HookPoint.bridge_only).
    Per-head q and k norms (Qwen3) have none: the bridge's points there hold [batch head pos d_head]."""

    ends = False

    def add_ends(self, ends: bool) -> None:
        if ends:
            self.ends = True
            # not a copy: ln1's and ln2's input is the residual stream that flows past them, and an edit made there in
            # place reaches it too, as on the bridge (hook_mlp_in, HookedTransformer's point, hooks a copy)
            self.hook_in = HookPoint(bridge_only=True)  # [batch pos d_model]
            self.hook_out = HookPoint(bridge_only=True)  # [batch pos d_model]: after w (and b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hook_out(self.normalize(self.hook_in(x))) if self.ends else self.normalize(x)


class LayerNorm(FixedWeights, HookedEnds, nn.Module):
    def __init__(self, d_model: int, eps: float, learned: bool = True, ends: bool = False):
        super().__init__()
        self.add_ends(ends)
        self.eps = eps
        if learned:
            self.w = nn.Parameter(torch.ones(d_model))
            self.b = nn.Parameter(torch.zeros(d_model))
        else:
            self.fix_weights(d_model, ("w", "b"))
        self.hook_scale = HookPoint()  # [batch pos 1]: sqrt(var + eps), what the centred input is divided by
        self.hook_normalized = HookPoint()  # [batch pos d_model]: centred / scale, before w and b (as TransformerLens)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if not (observed(self.hook_scale) or observed(self.hook_normalized)):
            return F.layer_norm(x, self.w.shape, self.w, self.b, self.eps)  # fused: nothing to observe
        # in float32 whatever the model's dtype, as the fused kernel computes: float16 squares overflow
        # past 256, so a cached scale would otherwise turn a float16 model's output into garbage. The
        # hooks still see (and may replace) tensors in the model's dtype.
        x32 = x.float()
        centred = x32 - x32.mean(-1, keepdim=True)
        scale_seen = (centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt().to(x.dtype)
        # an edit in place shows in the version counter; tensors made under torch.inference_mode() keep none, so
        # there the output always follows the hooked tensors
        tracked = not scale_seen.is_inference()
        versions = scale_seen._version if tracked else 0
        scale = self.hook_scale(scale_seen)
        normalized_seen = (centred / scale.float()).to(x.dtype)
        versions += normalized_seen._version if tracked else 0
        normalized = self.hook_normalized(normalized_seen)
        if scale is not scale_seen or normalized is not normalized_seen or x.dtype != self.w.dtype or not tracked or \
                versions != scale_seen._version + normalized_seen._version:
            return self._apply_weights(normalized, x.dtype)  # a hook replaced or edited one: the output follows it
        # hooks that only read give the unhooked forward's very numbers, so what a cache holds does not depend on
        # what else it caches (TL's demo asserts a filtered cache's pattern equal to a full cache's), while
        # gradients still flow through the hooked tensors (backward hooks, retain_grad)
        fused = F.layer_norm(x, self.w.shape, self.w, self.b, self.eps)
        if not (torch.is_grad_enabled() and (normalized.requires_grad or self.w.requires_grad or self.b.requires_grad)):
            return fused
        out = self._apply_weights(normalized, x.dtype)
        return fused.detach() + (out - out.detach())

    def _apply_weights(self, normalized: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (normalized.float() * self.w.float() + self.b.float()).to(dtype)


class RMSNorm(FixedWeights, HookedEnds, nn.Module):
    def __init__(self, d_model: int, eps: float, learned: bool = True, ends: bool = False):
        super().__init__()
        self.add_ends(ends)
        self.eps = eps
        if learned:
            self.w = nn.Parameter(torch.ones(d_model))
        else:
            self.fix_weights(d_model, ("w",))
        self.hook_scale = HookPoint()  # [batch pos 1] float32: sqrt(mean(x^2) + eps)
        self.hook_normalized = HookPoint()  # [batch pos d_model] float32: x / scale, before w

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        # in float32 whatever the model's dtype, as Llama does: low-precision squares overflow or lose digits
        x32 = x.float()
        scale = self.hook_scale((x32.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.w * self.hook_normalized(x32 / scale).to(x.dtype)


class RMSNormFloat32(RMSNorm):
    """Gemma's RMSNorm: w multiplies in float32 and the product is rounded once (Llama rounds first), and w itself
    stays float32 in a bfloat16 model: Gemma stores w - 1, and 1 + w rounded to 8 bits would lose its digits."""

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        scale = self.hook_scale((x32.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return (self.hook_normalized(x32 / scale) * self.w.float()).to(x.dtype)

    def _apply(self, fn, recurse=True):
        exact = self.w.detach().float()
        super()._apply(fn, recurse)
        self.w.data = exact.to(self.w.device)  # follow a move, not a cast
        return self


class NoNorm(FixedWeights, HookedEnds, nn.Module):
    """No normalisation (transformer-lens's normalization_type=None): the output is the input. Its scale is 1, kept
    as a hook point reached by name (and w, b as fixed ones and zeros) so that what hooks a norm's scale or reads its
    weights (the lenses, attribution graphs, processing) reads the identity rather than needing a case of its own."""

    def __init__(self, d_model: int, eps: float, learned: bool = True, ends: bool = False):
        super().__init__()
        self.add_ends(ends)
        self.eps = eps
        self.fix_weights(d_model, ("w", "b"))
        # TL's model without norms has no such points: listings, caches of everything and predicates leave them out
        self.hook_scale = HookPoint(unlisted=True)  # [batch pos 1]: ones
        self.hook_normalized = HookPoint(unlisted=True)  # [batch pos d_model]: the input

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if not (observed(self.hook_scale) or observed(self.hook_normalized)):
            return x
        scale = self.hook_scale(x.new_ones(*x.shape[:-1], 1))  # a hook may replace it (a frozen scale)
        return self.hook_normalized(x / scale)


# the norms whose hook_scale / hook_normalized hold float32 whatever the model's dtype (they compute in it)
FLOAT32_HOOK_NORMS = frozenset({Norm.RMS, Norm.RMS_FLOAT32})


NORMS = {Norm.LAYER: LayerNorm, Norm.RMS: RMSNorm, Norm.RMS_FLOAT32: RMSNormFloat32, Norm.NONE: NoNorm}


def make_norm(cfg: DecoderConfig, dim: Optional[int] = None, foldable: bool = False, ends: bool = False,
              kind: Optional[Norm] = None, eps: Optional[float] = None) -> nn.Module:
    """The config's norm (or `kind`) over the last `dim` (default d_model) dimensions. `foldable`: one whose output a
    linear layer reads (ln1, ln2, ln_final), which learns no weights when cfg.norm_weights is False. `ends`: its input
    and output are hook points too (the residual stream's norms; see HookedEnds)."""
    return NORMS[cfg.norm if kind is None else kind](dim or cfg.d_model, cfg.eps if eps is None else eps,
                                                     learned=cfg.norm_weights or not foldable, ends=ends)


class OverHeads:
    """Mixed into a norm that normalises q or k [batch pos head d_head] over all its heads together (OLMo 2), as
    transformers does to the projection before splitting it into heads: its w is [head * d_head]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(-2)).unflatten(-1, x.shape[-2:])


# one class per norm kind, made once (a class per call would give each layer's norm a type of its own)
OVER_HEADS = {norm: type(f"{kind.__name__}OverHeads", (OverHeads, kind), {}) for norm, kind in NORMS.items()}


def make_qk_norm(cfg: DecoderConfig, heads: int, d_head: Optional[int] = None) -> nn.Module:
    """The q (or k) norm of an attention with `heads` heads of `d_head` (default cfg.d_head): none, each head's over
    d_head (Qwen3, Gemma 3), or all heads' together (qk_norm_over_heads: OLMo 2)."""
    d_head = d_head or cfg.d_head
    if not cfg.qk_norm:
        return nn.Identity()
    if not cfg.qk_norm_over_heads:
        return make_norm(cfg, d_head)
    return OVER_HEADS[cfg.norm](heads * d_head, cfg.eps)


def make_z_norm(cfg: DecoderConfig, heads: int, d_head: int) -> nn.Module:
    """Every head's z [batch pos head d_head] RMS-normalised together, over head * d_head, with a learned w (fixed
    ones once folded into W_O: cfg.norm_weights), before W_O (cfg.sub_norms: BitNet's attn_sub_norm), or nothing."""
    return OVER_HEADS[Norm.RMS](heads * d_head, cfg.eps, learned=cfg.norm_weights) if cfg.sub_norms else nn.Identity()


def make_value_norm(cfg: DecoderConfig, d_head: int) -> nn.Module:
    """Each head's values normalised over d_head by the config's norm kind, learning no weight (cfg.value_norm:
    Gemma 4's v_norm), or nothing."""
    return NORMS[cfg.norm](d_head, cfg.eps, learned=False) if cfg.value_norm else nn.Identity()
