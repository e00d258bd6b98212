"""Residual-stack arithmetic on cached activations: which hooks a decomposition stacks, each head's and neuron's
write, the cached norm scale applied to a stack and logit attributions.

Plain functions of tensors and hook names, so the cache's transformer-lens methods (probe.decoder_cache) and
any analysis can share them. Dimensions: `component` is the stacked axis in front; `...` is whatever the cache
keeps of `batch pos` (no batch after remove_batch_dim, no pos after an int pos_slice).
"""
from __future__ import annotations

import operator
from typing import Literal, Optional, Sequence, Union

import torch
from einops import einsum

from probe.config import NormPlacement
from probe.names import act_name

Index = Union[int, slice, torch.Tensor, None]
SliceInput = Union[int, slice, tuple, list, torch.Tensor, None]


# ---- transformer-lens's Slice, as one torch index ---------------------------------------------------
def to_index(spec: SliceInput, what: str = "pos_slice") -> Index:
    """transformer-lens's slice inputs as a torch index: None (everything), an int (drops the dimension), a slice,
    a tuple (the arguments of slice(): (1, 5) is 1:5), or a list / 1-D tensor / array of indices. A
    transformer_lens.utilities.Slice is read through its `.slice`."""
    if hasattr(spec, "mode") and hasattr(spec, "slice"):  # transformer-lens's own Slice object
        spec = spec.slice
    if spec is None or isinstance(spec, slice):
        return spec
    if isinstance(spec, tuple):
        return slice(*spec)
    if isinstance(spec, bool):
        raise ValueError(f"{what}={spec!r}: a bool is not a position; pass an int, a slice, a tuple or a list of ints")
    if isinstance(spec, torch.Tensor) and spec.dim() == 0:
        return operator.index(spec)
    if not isinstance(spec, (list, torch.Tensor)):
        try:  # an int, a numpy integer; a numpy array falls through to the list case
            return operator.index(spec)
        except TypeError:
            pass
    try:
        index = torch.as_tensor(spec)
    except (TypeError, ValueError, RuntimeError):
        index = None
    if index is None or index.dim() != 1 or index.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"{what}={spec!r} is not a slice input; pass None, an int, a slice, a tuple (slice's "
                         f"arguments, e.g. (1, 5) for 1:5) or a 1-D list / tensor of int indices")
    return index.long()


def take(tensor: torch.Tensor, index: Index, dim: int) -> torch.Tensor:
    """`tensor` indexed by `index` (from to_index) along `dim` (negative counts from the end)."""
    if index is None:
        return tensor
    where = [slice(None)] * tensor.dim()
    where[dim] = index.to(tensor.device) if isinstance(index, torch.Tensor) else index
    return tensor[tuple(where)]


# ---- which hooks a stack is made of -----------------------------------------------------------------
def accumulated_sites(n_layers: int, layer: int, incl_mid: bool = False, mlp_input: bool = False) -> list[tuple[str, str]]:
    """(label, hook name) of the residual stream entering each of layers 0..`layer` (`layer` = n_layers: the final
    residual, "final_post"); `incl_mid` adds each earlier layer's resid_mid, `mlp_input` that of `layer` itself."""
    sites = []
    for l in range(layer + 1):
        if l == n_layers:
            sites.append(("final_post", act_name("resid_post", n_layers - 1)))
            break
        sites.append((f"{l}_pre", act_name("resid_pre", l)))
        if (incl_mid and l < layer) or (mlp_input and l == layer):
            sites.append((f"{l}_mid", act_name("resid_mid", l)))
    return sites


def decomposition_sites(layer: int, mode: Literal["all", "mlp", "attn"] = "all", mlp_input: bool = False,
                        embeds: Sequence[str] = ("hook_embed", "hook_pos_embed"),
                        with_mlps: bool = True, beside: Sequence[int] = ()) -> list[tuple[str, str]]:
    """(label, hook name) of the writes that add up to the residual stream entering `layer` (its MLP with
    `mlp_input`): the `embeds` given (those cached), then each earlier layer's attn_out, its mixer_out where the
    layer is in `beside` (Falcon-H1's Mamba-2 mixer, writing beside attention: `mixers_beside`), and mlp_out (none
    in an attention-only model: `with_mlps=False`)."""
    if mode not in ("all", "mlp", "attn"):
        raise ValueError(f"mode={mode!r} is not one of 'all', 'mlp', 'attn'")
    sites = [(name.removeprefix("hook_"), name) for name in embeds]
    for l in range(layer + mlp_input):
        if mode != "mlp":
            sites.append((f"{l}_attn_out", act_name("attn_out", l)))
            sites += [(f"{l}_mixer_out", f"blocks.{l}.hook_mixer_out")] * (l in beside)
        if mode != "attn" and with_mlps and l < layer:
            sites.append((f"{l}_mlp_out", act_name("mlp_out", l)))
    return sites


def require_sum_of_writes(cfg, method: str, per_component: bool = False) -> None:
    """Refuse `method`, which takes the residual stream for the sum of its sublayers' writes (and, `per_component`,
    of its heads' and neurons'), where it is not: post-norm blocks, sandwich blocks per component, and Gemma 4's
    blocks, which scale the whole residual and add a per-layer input."""
    placement = cfg.norm_placement
    if placement is NormPlacement.POST:
        raise ValueError(f"{method}: this model normalises after each sublayer (post-norm), so its residual stream "
                         f"is not a sum of the sublayers' writes and does not decompose")
    if per_component and placement is NormPlacement.SANDWICH:
        raise ValueError(f"{method}: in a sandwich block (Gemma 2) each head's and neuron's write passes through "
                         f"ln1_post / ln2_post before the residual receives it, so per-head and per-neuron writes "
                         f"are not residual contributions and would not add up (transformer-lens's bridge returns "
                         f"them anyway); decompose_resid gives the normalised attn_out / mlp_out, "
                         f"probe.analyses.residual_decomposition splits the heads through ln1_post's cached scale, and "
                         f"cache.stack_activation('result') stacks the pre-norm head writes")
    if cfg.shared_blocks is not None:
        raise ValueError(f"{method}: layers {cfg.shared_blocks.hybrid_layers} of this model (Zamba2) run a shared "
                         f"block whose attention and MLP write into the layer's Mamba-2 mixer's input, not into the "
                         f"residual stream, so their hook_attn_out / hook_mlp_out are no residual writes; the stream's "
                         f"writes are the mixers' (blocks.L.hook_mixer_out in those layers, hook_attn_out elsewhere)")
    if cfg.layer_scalars:
        raise ValueError(f"{method}: every block of this model (Gemma 4) multiplies the whole residual by its scalar "
                         f"(layer_scalar)" + (", and adds a per-layer input after its MLP" if cfg.per_layer_inputs else "")
                         + ", so the residual is not the sum of its sublayers' writes; probe.analyses."
                         "residual_decomposition and direct_logit_attribution stack each write as the final residual "
                         "holds it, times the scalars after it")


def mixers_beside(cfg) -> list[int]:
    """The layers whose Mamba-2 mixer writes beside attention (Falcon-H1's), which a decomposition by sublayer lists
    (decomposition_sites' `beside`)."""
    return [l for l in range(cfg.n_layers) if cfg.layer_has_parallel_mixer(l)]


def refuse_beside_heads(cfg, method: str) -> str:
    """`method`, a decomposition into heads and neurons, refused on a model whose layers also write a Mamba-2
    mixer's output beside their heads (it has neither to split into); else its name, as given."""
    layers = mixers_beside(cfg)
    if layers:
        raise ValueError(f"{method}: layers {layers} write a Mamba-2 mixer's output beside their heads (Falcon-H1), "
                         "which has no heads or neurons to split into; cache.decompose_resid lists it whole "
                         "(blocks.L.hook_mixer_out), and probe.analyses.residual_decomposition splits the heads beside it")
    return method


# ---- writes -----------------------------------------------------------------------------------------
def _common(t: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # weights are read from the live model, which may sit elsewhere or in another dtype than the cache
    dtype = torch.promote_types(t.dtype, weight.dtype)
    return t.to(dtype), weight.detach().to(t.device, dtype)


def head_writes(z: torch.Tensor, W_O: torch.Tensor) -> torch.Tensor:
    """Each head's write before b_O, hook_result: z [... head d_head], W_O [head d_head d_model] -> [... head d_model]."""
    z, W_O = _common(z, W_O)
    return einsum(z, W_O, "... head d_head, head d_head d_model -> ... head d_model")


def neuron_writes(post: torch.Tensor, W_out: torch.Tensor, project: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each neuron's write before b_out: post [... d_mlp] times its row of W_out [d_mlp d_model] -> [... d_mlp d_model];
    with `project` [d_model out], projected before the product ([... d_mlp out]), so d_mlp x d_model is never built."""
    post, W_out = _common(post, W_out)
    if project is not None:
        W_out = W_out @ project.to(W_out.device, W_out.dtype)
    return post[..., None] * W_out


def accumulated_bias(b_O: Sequence[Optional[torch.Tensor]], b_out: Sequence[Optional[torch.Tensor]], layer: int,
                     d_model: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> torch.Tensor:
    """[d_model] float32: the attention (and MLP) output biases the residual stream entering `layer` has received
    (b_O, b_out: each layer's, None where it has none); with `mlp_input`, `layer`'s own attention bias too."""
    terms = list(b_O[:layer]) + (list(b_out[:layer]) if include_mlp_biases else []) + ([b_O[layer]] if mlp_input else [])
    total = torch.zeros(d_model)
    for term in terms:
        if term is not None:
            total = total.to(term.device) + term.detach().float()
    return total


# ---- the cached norm scale on a stack ---------------------------------------------------------------
def center(stack: torch.Tensor) -> torch.Tensor:
    """LayerNorm's centring over d_model: linear, so it commutes with summing the stack."""
    return stack - stack.mean(dim=-1, keepdim=True)


def apply_cached_scale(stack: torch.Tensor, scale: torch.Tensor, centred: bool) -> torch.Tensor:
    """What each component of `stack` [component ... d_model] contributes to a norm's normalised output, with the
    norm's scale frozen at its cached value `scale` [... 1]: (x - mean(x)) / scale for LayerNorm (`centred`),
    x / scale for RMSNorm. Linear in x, so the components still add up; w and b are not applied (as transformer-lens)."""
    stack = center(stack) if centred else stack
    scale = scale.to(stack.device)
    return stack / scale.to(torch.promote_types(stack.dtype, scale.dtype))


# ---- logits ------------------------------------------------------------------------------
def logit_attributions(scaled_stack: torch.Tensor, directions: torch.Tensor, stack_has_batch: bool = True) -> torch.Tensor:
    """Each component's dot product with the token directions: [component ... d_model] x [... d_model] -> [component ...].
    Directions of one token per prompt ([batch d_model]) broadcast over positions, as transformer-lens does."""
    directions = directions.to(scaled_stack.device, scaled_stack.dtype)
    if (stack_has_batch and scaled_stack.dim() == 4 and directions.dim() == 2
            and directions.shape[0] == scaled_stack.shape[1]):
        directions = directions.unsqueeze(-2)
    return (scaled_stack * directions).sum(dim=-1)
