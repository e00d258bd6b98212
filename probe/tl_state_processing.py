"""transformer-lens's state-dict processing methods on a model: `fold_layer_norm(state_dict)`,
`center_writing_weights`, `center_unembed`, `fold_value_biases`, `refactor_factored_attn_matrices`.

TL code processes a checkpoint before loading it, one step at a time, in the order it likes (ARENA's monthly
problems centre the writers first, then fold), and loads the result with `load_state_dict(..., strict=False)`.
Each method takes a state dict in TL's layout and returns a new one, leaving the input as it was, as TL 3.9's do
(but `center_writing_weights`, which writes its result into the given dict too, as TL's says and does): the dict
is loaded into a scratch copy of the model, that one step of probe.processing runs there, and the copy's state
dict is read back. The result has the input's keys: a folded norm's weights become ones (its biases zeros), as
transformer-lens 3.9 leaves them, and a key the model has no use for (TL's `mask` / `IGNORE` buffers) passes through
unchanged. Where TL's step changes what a model computes (centring the writers of a model without LayerNorms, or the
readers of one without norm weights), this does the same, with a warning."""
from __future__ import annotations

import copy
import warnings
from typing import Callable

import torch

from probe.config import Norm
from probe.processing import (can_center_writing_weights, center_readers, center_writers, check_processing,
                              process_weights_in_place, untie_embeddings)
from probe.tl_state_dict import TL_BUFFERS

_STEPS = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases", "refactor_factored_attn_matrices")


def _changes_the_model(what: str) -> None:
    warnings.warn(f"{what} changes what this model computes; transformer-lens does it all the same, and so does this",
                  stacklevel=3)


class StateDictProcessing:
    """Mixed into HookedDecoder (see the module docstring)."""

    def fold_layer_norm(self, state_dict: dict, fold_biases: bool = True, center_weights: bool = True) -> dict:
        """Each norm's weight (and bias) folded into the layers that read it, leaving it ones (and zeros).
        A LayerNorm folds with its bias and centres its readers (TL's defaults); an RMSNorm has neither, so TL
        folds it with `fold_biases=False, center_weights=False`. Norms without weights (none, or TL's LNPre) have
        nothing to fold, and `center_weights=True` still centres their readers' weights, as TL's does."""
        if not self.cfg.norm_weights or self.cfg.norm is Norm.NONE:
            if self.cfg.norm is not Norm.LAYER and center_weights:
                _changes_the_model("fold_layer_norm: centring the weights that read a residual no LayerNorm centres")
            return self._process_state_dict(state_dict, center_readers if center_weights else lambda model: None)
        layer_norm = self.cfg.norm is Norm.LAYER
        if (fold_biases, center_weights) != (layer_norm, layer_norm):
            how = "fold_biases=True, center_weights=True" if layer_norm else "fold_biases=False, center_weights=False"
            raise ValueError(f"fold_layer_norm(fold_biases={fold_biases}, center_weights={center_weights}): this "
                             f"model's norms are {self.cfg.norm.value}, which fold with {how} (as transformer-lens's "
                             f"process_weights folds them)")
        # the norms' weights by name (the same names in TL's layout), without building that layout's copies
        norms = [key for key, _ in self.named_parameters() if key.endswith((".w", ".b")) and ".ln" in f".{key}"]
        missing = [key for key in norms if key not in state_dict]
        if missing:
            raise KeyError(f"fold_layer_norm: the state dict has no {missing[0]} (and {len(missing) - 1} more norm "
                           f"weights): it was folded already, or is not this model's; pass the unfolded state dict")
        return self._process_state_dict(state_dict, self._step("fold_ln"))

    def center_writing_weights(self, state_dict: dict) -> dict:
        """Every vector written into the residual stream (W_E, W_pos, W_O, b_O, W_out, b_out) less its mean; the
        given dict holds the result too. In a model whose residual is not read by LayerNorms alone (ARENA's
        cumulative-sum problem has no norms, and loads so) this changes what it computes, as TL's does."""
        if can_center_writing_weights(self.cfg):
            step = self._step("center_writing_weights")
        else:
            _changes_the_model("center_writing_weights: centring the writers of a residual no LayerNorm centres")

            def step(model) -> None:
                untie_embeddings(model)
                center_writers(model)
        state_dict.update(self._process_state_dict(state_dict, step))
        return state_dict

    def center_unembed(self, state_dict: dict) -> dict:
        """W_U (and b_U) less their mean over the vocabulary."""
        return self._process_state_dict(state_dict, self._step("center_unembed"))

    def fold_value_biases(self, state_dict: dict) -> dict:
        """b_O += the sum over heads of b_V W_O; b_V = 0."""
        return self._process_state_dict(state_dict, self._step("fold_value_biases"))

    def refactor_factored_attn_matrices(self, state_dict: dict) -> dict:
        """Each head's W_Q W_K^T and W_V W_O rewritten from their SVD (see probe.processing)."""
        return self._process_state_dict(state_dict, self._step("refactor_factored_attn_matrices"))

    def _step(self, name: str) -> Callable:
        """probe's processing step `name` alone, refused by name where this model cannot take it."""
        steps = dict.fromkeys(_STEPS, False) | {name: True}
        check_processing(self.cfg, **steps)
        return lambda model: process_weights_in_place(model, **steps)

    def _process_state_dict(self, state_dict: dict, step: Callable) -> dict:
        scratch = copy.deepcopy(self)
        known = set(scratch.state_dict())
        unexpected = scratch.load_state_dict(state_dict, strict=False).unexpected_keys
        if unexpected:
            raise KeyError(f"the state dict's {unexpected[0]} (and {len(unexpected) - 1} more) is not a weight of "
                           f"this model")
        with torch.no_grad():
            step(scratch)
        processed = scratch.state_dict()

        def after_step(key: str, value: torch.Tensor) -> torch.Tensor:
            if key.rsplit(".", 1)[-1] in TL_BUFFERS:  # the dict's own (an older TL saved the whole causal mask)
                return value
            if key in processed:
                return processed[key]
            if key in known:  # a norm the fold left without weights: the identity, as TL writes it
                return torch.ones_like(value) if key.endswith(".w") else torch.zeros_like(value)
            return value

        return {key: after_step(key, value) for key, value in state_dict.items()}
