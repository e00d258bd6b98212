"""transformer-lens's ActivationCache methods that stack the residual stream, mixed into probe.DecoderCache.

A face over probe's own arithmetic (probe.residual_stack): the methods translate transformer-lens's names,
keywords and shapes; the numbers are transformer-lens's bridge's on the same checkpoint. Where a block differs
from what those methods assume, they refuse and say why rather than return a stack that does not add up:

- post-norm blocks (GPT-1): the residual stream is a normalised sum, not a sum of writes, so nothing decomposes
  it; a block's ln1 reads resid_pre + attn_out, so its scale is not that of the block's input either.
- sandwich blocks (Gemma 2): each head's z @ W_O and each neuron's write pass through ln1_post / ln2_post
  before the residual receives them, so per-head and per-neuron stacks are not residual contributions (the bridge
  returns the pre-norm values anyway, which do not add up); attn_out and mlp_out are the normalised writes, so
  decompose_resid works. analyses.residual_decomposition splits Gemma 2's heads through ln1_post's cached scale.
- parallel blocks (GPT-NeoX, Pythia): both sublayers read resid_pre; there is no resid_mid, and the MLP's input
  holds no attn_out of its own layer, so incl_mid= and mlp_input= (where they would add attn_out) are refused:
  the mlp_input=False stack is already the MLP's input. apply_ln_to_stack(mlp_input=True) is ln2's scale of resid_pre.
- grouped-query attention: hook_z holds every query head (keys and values already shared out), so head results
  are per query head, as the bridge's.
- RMSNorm: the cached scale divides without centring (LayerNorm centres first), as transformer-lens does.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch

import probe.residual_stack as rs
from probe.hooks.names import UnknownNameError
from probe.config import Norm, NormPlacement
from probe.names import act_name
from probe.prediction_head import refuse_prediction_head


class ModelGoneError(ReferenceError):
    """A cache method needs the model's weights, and the model the cache came from no longer exists."""


class StackMethods:
    """Mixed into DecoderCache (which provides the mapping, `_acts`, `_model`, `_cfg` and `has_batch_dim`)."""

    # ---- what the methods need ------------------------------------------------------------------------
    def _live_model(self, method: str):
        model = None if self._model is None else self._model()
        if model is None:
            why = ("the model this cache came from has been deleted (the cache keeps only a weak reference, so it "
                   "never keeps a model alive)") if self._model is not None else "this cache was made without a model"
            raise ModelGoneError(f"{method} needs the model's weights, but {why}; keep the model alive while you "
                                 f"use the cache's methods, or run the prompt again")
        return model

    @property
    def _config(self):
        if self._cfg is None:
            raise ValueError("this cache was made without a model, so it does not know the architecture; get it from "
                             "model.run_with_cache(...)")
        return self._cfg

    def _layer(self, layer: Optional[int], method: str) -> int:
        """transformer-lens's layer argument: None or -1 are n_layers (the residual stream the unembedding reads)."""
        n_layers = self._config.n_layers
        if layer is None or layer == -1:
            return n_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= n_layers:
            raise ValueError(f"{method}: layer={layer!r} must be an int in [0, n_layers={n_layers}], or -1 / None for "
                             f"n_layers (the input to the unembedding)")
        return layer

    def _mlp_layer(self, layer: Optional[int], mlp_input: bool, method: str) -> int:
        layer = self._layer(layer, method)
        if mlp_input and self._config.attn_only:
            raise ValueError(f"{method}: mlp_input=True: this attention-only model has no MLPs; leave it False")
        if mlp_input and layer == self._config.n_layers:
            raise ValueError(f"{method}: mlp_input=True needs the layer whose MLP reads the stack, below n_layers="
                             f"{layer}; layer=-1 / None is the unembedding, which has no MLP")
        return layer

    def _need(self, key, method: str) -> torch.Tensor:
        try:
            return self[key]
        except KeyError as error:
            raise UnknownNameError(f"{method} needs an activation this cache lacks: {error}; run_with_cache without "
                                   f"names= caches it, or include it in names=/names_filter=") from None

    def _require_sum_of_writes(self, method: str, per_component: bool = False) -> None:
        rs.require_sum_of_writes(self._config, method, per_component)

    def _refuse_without_neurons(self, method: str) -> None:
        if self._config.attn_only or self._config.experts is not None:
            raise ValueError(f"{method}: this " + ("attention-only model has no MLPs" if self._config.attn_only else
                             "model's MLPs are mixtures of experts (each expert's neurons see only its tokens)")
                             + ", so no neurons (get_full_resid_decomposition keeps each MLP's output whole with "
                               "expand_neurons=False)")

    def _residual_embeds(self) -> list[str]:
        """The cached embedding writes that the residual stream holds: a shortformer model's positions join only
        the queries' and keys' inputs, so they are not one (transformer-lens counts them, and its stack then does
        not add up to the residual)."""
        names = ("hook_embed", "hook_pos_embed") if self._config.positions_in_residual else ("hook_embed",)
        return [name for name in names if name in self._acts]

    def _refuse_parallel(self, method: str, argument: str) -> None:
        if self._config.norm_placement is NormPlacement.PARALLEL:
            raise ValueError(f"{method}: {argument} has no meaning in a parallel block (GPT-NeoX): attention and MLP "
                             f"both read resid_pre, so there is no resid_mid and the MLP's input holds no attn_out of "
                             f"its own layer; the stack with mlp_input=False is the MLP's input")

    def _scale(self, layer: int, mlp_input: bool, pos, batch) -> Optional[torch.Tensor]:
        cfg = self._config
        if cfg.norm is Norm.NONE:
            return None  # no norm divides anything (a cache of everything holds no scale of 1 here, as TL's holds none)
        if layer == cfg.n_layers:
            if not cfg.final_norm:
                return None  # the unembedding reads the residual itself
            key = "ln_final.hook_scale"
        else:
            if cfg.norm_placement is NormPlacement.POST:
                raise ValueError(f"apply_ln: in a post-norm block ln1 and ln2 normalise sums after the sublayers, not "
                                 f"the input to layer {layer}; only the final layer (layer=-1) has an input norm here")
            if not cfg.input_norms:
                return None  # OLMo 2: the sublayers read the residual itself
            key = act_name("scale", layer, "ln2" if mlp_input else "ln1")
        scale = _residual_scale(self._need(key, "apply_ln"), 2 + self.has_batch_dim, key)
        scale = rs.take(scale, pos, -2)
        return rs.take(scale, batch, 0) if self.has_batch_dim else scale

    # ---- stacks of the residual stream --------------------------------------------------------------------
    def apply_ln_to_stack(self, residual_stack: torch.Tensor, layer: Optional[int] = None, mlp_input: bool = False,
                          pos_slice=None, batch_slice=None, has_batch_dim: bool = True,
                          recompute_ln: bool = False) -> torch.Tensor:
        """Each component of `residual_stack` [component ... d_model], as the input to `layer`'s ln1 (ln2 with
        `mlp_input`; ln_final for -1 / None / n_layers), through that norm with its scale frozen at the cached value:
        centred (LayerNorm) and divided, w and b not applied. `pos_slice` / `batch_slice` say which positions /
        prompts the stack holds (already applied to it: they select the scales). `recompute_ln=True` at the final
        layer runs ln_final itself on each component (its own statistics, w and b), the published logit lens."""
        layer = self._layer(layer, "apply_ln_to_stack")
        batch = rs.to_index(batch_slice, "batch_slice")
        if has_batch_dim:
            residual_stack = rs.take(residual_stack, batch, 1)
        if recompute_ln and layer == self._config.n_layers:
            ln_final = self._live_model("apply_ln_to_stack(recompute_ln=True)").ln_final
            weight = next(ln_final.parameters(), residual_stack)
            with torch.no_grad():
                return ln_final(residual_stack.to(weight.device, weight.dtype)).to(residual_stack.device)
        scale = self._scale(layer, mlp_input, rs.to_index(pos_slice), batch)
        if scale is None:
            return residual_stack
        return rs.apply_cached_scale(residual_stack, scale, centred=self._config.norm is Norm.LAYER)

    def accumulated_resid(self, layer: Optional[int] = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice=None, mlp_input: bool = False, return_labels: bool = False):
        """The residual stream entering each layer up to `layer` (-1 / None: and the final one, "final_post"), stacked
        [component ... d_model]; `incl_mid` adds each resid_mid before `layer`, `mlp_input` that of `layer`.
        `apply_ln` runs ln_final on each (its own statistics, w and b: the logit lens, as transformer-lens) when the
        stack reaches the final layer, and else divides by `layer`'s cached ln1 (ln2) scale."""
        layer = self._layer(layer, "accumulated_resid")
        if incl_mid or mlp_input:
            self._refuse_parallel("accumulated_resid", "incl_mid=True / mlp_input=True")
            if self._config.attn_only:
                raise ValueError("accumulated_resid: incl_mid=True / mlp_input=True: this attention-only model has no "
                                 "MLPs, so no resid_mid")
        sites = rs.accumulated_sites(self._config.n_layers, layer, incl_mid, mlp_input)
        pos = rs.to_index(pos_slice)
        stack = torch.stack([rs.take(self._need(name, "accumulated_resid"), pos, -2) for _, name in sites])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice, has_batch_dim=self.has_batch_dim,
                                           recompute_ln=layer == self._config.n_layers)
        return (stack, [label for label, _ in sites]) if return_labels else stack

    def decompose_resid(self, layer: Optional[int] = None, mlp_input: bool = False,
                        mode: Literal["all", "mlp", "attn"] = "all", apply_ln: bool = False, pos_slice=None,
                        incl_embeds: bool = True, return_labels: bool = False):
        """The writes that add up to the residual stream entering `layer` (its MLP with `mlp_input`): embed and
        pos_embed (those cached, with `incl_embeds`), then each layer's attn_out and mlp_out (`mode` "attn" / "mlp":
        only those), stacked [component ... d_model]; `apply_ln` divides by that layer's cached norm scale."""
        self._require_sum_of_writes("decompose_resid")
        if mlp_input:
            self._refuse_parallel("decompose_resid", "mlp_input=True")
        layer = self._mlp_layer(layer, mlp_input, "decompose_resid")
        embeds = self._residual_embeds() if incl_embeds else []
        sites = rs.decomposition_sites(layer, mode, mlp_input, embeds, not self._config.attn_only, rs.mixers_beside(self._config))
        pos = rs.to_index(pos_slice)
        stack = torch.stack([rs.take(self._need(name, "decompose_resid"), pos, -2) for _, name in sites])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice)
        return (stack, [label for label, _ in sites]) if return_labels else stack

    def logit_attrs(self, residual_stack: torch.Tensor, tokens, incorrect_tokens=None, pos_slice=None,
                    batch_slice=None, has_batch_dim: bool = True) -> torch.Tensor:
        """Each component's direct contribution to the logit of `tokens` (minus that of `incorrect_tokens`):
        the stack through ln_final's cached scale, dotted with the tokens' W_U columns -> [component ...].
        `tokens`: a string or id (one token everywhere), [batch] (one per prompt), [pos] when its length is not the
        batch's (one per position), or [batch pos]. ln_final's w and b (and a logit softcap) are not applied, as in
        transformer-lens."""
        model = self._live_model("logit_attrs")
        refuse_prediction_head(model.cfg, "logit_attrs")
        directions, shape = self._directions(model, tokens)
        if incorrect_tokens is not None:
            wrong, wrong_shape = self._directions(model, incorrect_tokens)
            if wrong_shape != shape:
                raise ValueError(f"tokens and incorrect_tokens must have the same shape, got {tuple(shape)} and "
                                 f"{tuple(wrong_shape)}")
            directions = directions - wrong
        scaled = self.apply_ln_to_stack(residual_stack, -1, pos_slice=pos_slice, batch_slice=batch_slice,
                                        has_batch_dim=has_batch_dim)
        one_prompt = isinstance(rs.to_index(batch_slice, "batch_slice"), int)
        return rs.logit_attributions(scaled, directions, has_batch_dim and not one_prompt)

    @staticmethod
    def _directions(model, tokens) -> tuple[torch.Tensor, torch.Size]:
        """The tokens' W_U columns, and the shape transformer-lens compares: () for a string or an int."""
        shape = tokens.shape if isinstance(tokens, torch.Tensor) else torch.Size([])
        return model.tokens_to_residual_directions(tokens), shape

    # ---- heads and neurons ---------------------------------------------------------------------------------
    def compute_head_results(self) -> None:
        """Add each layer's `attn.hook_result` [... head d_model] (each head's write before b_O), from the cached
        hook_z and the model's W_O, where the cache lacks it: the one way a probe cache changes after it is made."""
        for layer in range(self._config.n_layers):
            name = act_name("result", layer)
            if name not in self._acts and self._config.layer_has_attention(layer):
                self._acts[name] = self._head_results(layer, "compute_head_results")

    def _head_results(self, layer: int, method: str) -> torch.Tensor:
        if not self._config.layer_has_attention(layer):
            kind, write = ("a linear-attention", "hook_attn_out") if self._config.layer_has_mixer(layer) else (
                "an MLP-only", "hook_mlp_out")  # (NemotronH's)
            raise ValueError(f"{method}: layer {layer} is {kind} layer, with no attention heads to stack; "
                             f"decompose_resid gives its write whole (blocks.{layer}.{write})")
        name = act_name("result", layer)
        if name in self._acts:
            return self._acts[name]
        W_O = self._live_model(method).blocks[layer].attn.W_O
        return rs.head_writes(self._need(act_name("z", layer), method), W_O)

    def _empty_stack(self, pos, width: Optional[int] = None) -> torch.Tensor:
        like = rs.take(self._need(act_name("resid_pre", 0), "an empty stack's shape"), pos, -2)
        return like.new_zeros(0, *like.shape[:-1], like.shape[-1] if width is None else width)

    def stack_head_results(self, layer: int = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice=None, apply_ln: bool = False):
        """Every head's write (hook_result, computed from hook_z and W_O where not cached) in the layers before
        `layer`, stacked [(layer head) ... d_model], labelled L0H0...; `incl_remainder` adds the rest of the residual
        stream entering `layer`; `apply_ln` divides by its cached ln1 scale (ln_final's for -1)."""
        self._require_sum_of_writes("stack_head_results", per_component=True)
        layer = self._layer(layer, "stack_head_results")
        pos = rs.to_index(pos_slice)
        heads = [rs.take(self._head_results(l, "stack_head_results"), pos, -3) for l in range(layer)]
        labels = [f"L{l}H{h}" for l, r in enumerate(heads) for h in range(r.shape[-2])]
        stack = torch.cat(heads, dim=-2).movedim(-2, 0) if heads else self._empty_stack(pos)
        if incl_remainder:  # layer 0: the remainder is everything, as transformer-lens's resid_post of layer -1
            whole = rs.take(self._need(("resid_post", layer - 1), "stack_head_results"), pos, -2)
            stack = torch.cat([stack, (whole - stack.sum(dim=0))[None]])
            labels.append("remainder")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def stack_activation(self, activation_name: str, layer: int = -1, sublayer_type: Optional[str] = None) -> torch.Tensor:
        """cache[activation_name, l, sublayer_type] of every layer before `layer` (-1: all), stacked [layer ...]."""
        layer = self._layer(layer, "stack_activation")
        return torch.stack([self[activation_name, l, sublayer_type] for l in range(layer)])

    def get_neuron_results(self, layer: int, neuron_slice=None, pos_slice=None,
                           project_output_onto: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Each neuron's write in `layer` (its activation times its row of W_out, no b_out) [... neuron d_model], for
        the neurons of `neuron_slice`; `project_output_onto` [d_model] or [d_model out] projects each write."""
        self._require_sum_of_writes("get_neuron_results", per_component=True)
        self._refuse_without_neurons("get_neuron_results")
        W_out = self._live_model("get_neuron_results").blocks[layer].mlp.W_out
        return self._neuron_results(layer, W_out, rs.to_index(neuron_slice, "neuron_slice"), rs.to_index(pos_slice),
                                    project_output_onto)

    def _neuron_results(self, layer: int, W_out: torch.Tensor, neurons, pos, project_output_onto) -> torch.Tensor:
        post = rs.take(self._need(("post", layer), "the neuron results"), pos, -2)
        project, squeeze = _as_matrix(project_output_onto)
        writes = rs.neuron_writes(rs.take(post, neurons, -1), rs.take(W_out, neurons, 0), project)
        return writes.squeeze(-1) if squeeze else writes

    def stack_neuron_results(self, layer: int, pos_slice=None, neuron_slice=None, return_labels: bool = False,
                             incl_remainder: bool = False, apply_ln: bool = False,
                             project_output_onto: Optional[torch.Tensor] = None, mlp_input: bool = False):
        """Every neuron's write in the layers before `layer`, stacked [(layer neuron) ... d_model], labelled L0N0...;
        `incl_remainder` adds the rest of the residual entering `layer` (its MLP with `mlp_input`); `apply_ln`
        divides by that norm's cached scale; `project_output_onto` projects each write without building
        [... neuron d_model]."""
        self._require_sum_of_writes("stack_neuron_results", per_component=True)
        self._refuse_without_neurons("stack_neuron_results")
        if mlp_input and incl_remainder:
            self._refuse_parallel("stack_neuron_results", "mlp_input=True with incl_remainder=True")
        layer = self._mlp_layer(layer, mlp_input, "stack_neuron_results")
        model = self._live_model("stack_neuron_results") if layer else None
        neurons = rs.to_index(neuron_slice, "neuron_slice")
        neurons = torch.tensor([neurons]) if isinstance(neurons, int) else neurons  # layers concatenate along neurons
        pos = rs.to_index(pos_slice)
        project, squeeze = _as_matrix(project_output_onto)
        # with a projection the cached-scale norm is folded in: centring a write is centring its W_out row
        fold = apply_ln and project is not None
        centred = fold and self._config.norm is Norm.LAYER
        parts = []
        for l in range(layer):
            W_out = model.blocks[l].mlp.W_out
            parts.append(self._neuron_results(l, rs.center(W_out) if centred else W_out, neurons, pos, project))
        ids = rs.take(torch.arange(self._config.d_mlp), neurons, 0).tolist()
        labels = [f"L{l}N{n}" for l in range(layer) for n in ids]
        width = None if project is None else project.shape[-1]
        stack = torch.cat(parts, dim=-2).movedim(-2, 0) if parts else self._empty_stack(pos, width)
        if fold:
            scale = self._scale(layer, mlp_input, pos, None)
            stack = stack if scale is None else rs.apply_cached_scale(stack, scale, centred=False)
        if incl_remainder:
            target = ("resid_mid", layer) if mlp_input else ("resid_post", layer - 1)
            whole = rs.take(self._need(target, "stack_neuron_results"), pos, -2)
            if fold:
                whole = self.apply_ln_to_stack(whole[None], layer, mlp_input, pos_slice)[0]
            if project is not None:
                whole = whole @ project.to(whole.device, whole.dtype)
            stack = torch.cat([stack, (whole.to(stack.dtype) - stack.sum(dim=0))[None]])
            labels.append("remainder")
        if apply_ln and not fold:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice)
        stack = stack.squeeze(-1) if squeeze else stack
        return (stack, labels) if return_labels else stack

    def get_full_resid_decomposition(self, layer: Optional[int] = None, mlp_input: bool = False,
                                     expand_neurons: bool = True, apply_ln: bool = False, pos_slice=None,
                                     return_labels: bool = False, project_output_onto: Optional[torch.Tensor] = None):
        """The residual entering `layer` (its MLP with `mlp_input`) as every head's write, every neuron's (each
        MLP's output without `expand_neurons`), embed, pos_embed and the accumulated biases ("bias"), stacked
        [component ... d_model] in that order; the components add up to that residual stream."""
        self._require_sum_of_writes(rs.refuse_beside_heads(self._config, "get_full_resid_decomposition"), True)
        if mlp_input:
            self._refuse_parallel("get_full_resid_decomposition", "mlp_input=True")
        layer = self._mlp_layer(layer, mlp_input, "get_full_resid_decomposition")
        model = self._live_model("get_full_resid_decomposition")
        project, squeeze = _as_matrix(project_output_onto)
        fold = apply_ln and project is not None

        def finish(stack: torch.Tensor) -> torch.Tensor:  # folded: each part through the norm, then projected
            if fold:
                stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice)
            return stack if project is None else stack @ project.to(stack.device, stack.dtype)

        heads, labels = self.stack_head_results(layer + mlp_input, pos_slice=pos_slice, return_labels=True)
        parts = [finish(heads)]
        attn_only = self._config.attn_only
        if layer > 0 and expand_neurons and not attn_only:
            neurons, names = self.stack_neuron_results(layer, pos_slice, return_labels=True, apply_ln=fold,
                                                       project_output_onto=project, mlp_input=mlp_input)
            parts.append(neurons)
            labels += names
        elif layer > 0 and not attn_only:
            mlps, names = self.decompose_resid(layer, mlp_input, "mlp", pos_slice=pos_slice, incl_embeds=False,
                                               return_labels=True)
            parts.append(finish(mlps))
            labels += names
        pos = rs.to_index(pos_slice)
        for name in self._residual_embeds():
            parts.append(finish(rs.take(self._acts[name], pos, -2)[None]))
            labels.append(name.removeprefix("hook_"))
        blocks = model.blocks
        b_out = [None if attn_only or not hasattr(b.mlp, "b_out") else b.mlp.b_out for b in blocks]  # experts: none
        bias = rs.accumulated_bias([b.attn.b_O for b in blocks], b_out, layer,
                                   self._config.d_model, mlp_input, include_mlp_biases=expand_neurons)
        bias = bias.to(heads.device, heads.dtype).expand(1, *heads.shape[1:-1], bias.shape[-1])
        parts.append(finish(bias) if fold or project is not None else bias)
        labels.append("bias")
        stack = torch.cat(parts)
        if apply_ln and not fold:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice)
        stack = stack.squeeze(-1) if squeeze else stack
        return (stack, labels) if return_labels else stack


def _residual_scale(scale: torch.Tensor, dims: int, key: str) -> torch.Tensor:
    """A norm's cached scale as [... pos 1]. While a per-head attention input is on (set_use_split_qkv_input /
    set_use_attn_in) ln1 norms each head's copy of the residual, so its hook_scale is [... pos head 1]; the copies
    are the one residual, so each head's scale is the residual's and one is kept. Copies a hook made differ refuse."""
    if scale.dim() != dims + 1:
        return scale
    first = scale[..., :1, :]
    if not torch.allclose(scale, first.expand_as(scale), rtol=1e-5, atol=0):
        raise ValueError(f"apply_ln: {key} holds one scale per head (a per-head attention input was on) and the heads' "
                         f"differ (a hook edited one head's input), so no one scale is the residual stream's; run the "
                         f"cache again without that hook, or with set_use_split_qkv_input(False) / set_use_attn_in(False)")
    return first[..., 0, :]


def _as_matrix(project: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], bool]:
    """A projection [d_model] or [d_model out] as [d_model out], and whether to squeeze `out` away at the end."""
    if project is None or project.dim() == 2:
        return project, False
    if project.dim() != 1:
        raise ValueError(f"project_output_onto must be [d_model] or [d_model out], got shape {tuple(project.shape)}")
    return project[:, None], True
