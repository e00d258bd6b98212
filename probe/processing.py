"""Weight processing, as transformer-lens applies it when loading: rewrite the weights so they read
more simply, leaving what the model computes unchanged.

- `fold_ln`: each norm's weight (and bias) moves into the layer that reads the norm's output, so
  the norm only normalises (w = 1, b = 0) and `hook_normalized` is exactly what that layer reads.
- `center_writing_weights`: everything that writes into the residual stream (embeddings, attention
  and MLP outputs) writes a mean-zero vector (fixed sinusoidal positions are not weights and keep
  their mean). Every reader of the residual is a LayerNorm, which subtracts the mean first, so
  nothing downstream changes, while the residual itself (and so each component's direct
  contribution) loses a direction no reader can see.
- `center_unembed`: each position's logits lose their mean over the vocabulary; probabilities, log-
  probabilities and logit differences are unchanged.
- `fold_value_biases`: the value bias moves into the output bias. Each query's attention weights
  sum to 1, so a head passes its value bias through unchanged: `hook_v` and `hook_z` then hold the
  part of the values that depends on the tokens.

The result is a new model (the input is left as it was) whose unembedding is no longer tied to the
embedding, and which has an unembedding bias when a final LayerNorm bias was folded in (so it cannot
be saved in a Hugging Face format). Folding needs pre-norm, parallel or sandwich blocks; centring the writers needs
LayerNorm everywhere.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from probe.config import DecoderConfig, Norm, NormPlacement
from probe.model import HookedDecoder


def can_fold_ln(cfg: DecoderConfig) -> bool:
    """Folding needs each norm to feed layers (pre-norm, parallel or sandwich blocks; a sandwich block's write
    norms stay as they are): in a post-norm model the norm's output is the residual stream itself."""
    return cfg.norm_placement in (NormPlacement.PRE, NormPlacement.PARALLEL, NormPlacement.SANDWICH)


def can_center_writing_weights(cfg: DecoderConfig) -> bool:
    """Centring the writers needs every reader of the residual stream to be a LayerNorm (which subtracts the mean)."""
    return cfg.norm is Norm.LAYER and cfg.final_norm and cfg.norm_placement in (NormPlacement.PRE, NormPlacement.PARALLEL)


@torch.no_grad()
def process_weights(
    model: HookedDecoder,
    *,
    fold_ln: bool = True,
    center_writing_weights: bool = True,
    center_unembed: bool = True,
    fold_value_biases: bool = True,
) -> HookedDecoder:
    """A copy of `model` with its weights processed (see the module docstring); its log-probabilities
    equal the original's up to rounding."""
    cfg = model.cfg
    if fold_ln and not can_fold_ln(cfg):
        raise ValueError("fold_ln needs pre-norm, parallel or sandwich blocks: in a post-norm model (GPT-1) the norm's output is the "
                         "residual stream itself, not the input of one layer; pass fold_ln=False")
    if center_writing_weights and not can_center_writing_weights(cfg):
        raise ValueError("center_writing_weights needs every reader of the residual stream to be a LayerNorm (pre-norm "
                         f"or parallel blocks and a final LayerNorm); this model has norm={cfg.norm.value}, "
                         f"final_norm={cfg.final_norm}, norm_placement={cfg.norm_placement.value}; "
                         "pass center_writing_weights=False")
    if center_unembed and cfg.logit_softcap is not None:
        raise ValueError("center_unembed shifts each position's logits, which a logit soft cap (Gemma 2) does not "
                         "pass through unchanged; pass center_unembed=False")
    processed = copy.deepcopy(model)
    _untie(processed)
    if fold_ln:
        _fold_norms(processed)
    if center_writing_weights:
        _center_writers(processed)
    if center_unembed:
        unembed = processed.unembed  # weight [vocab d_model]: each logit's mean over the vocabulary goes
        unembed.weight -= unembed.weight.mean(dim=0, keepdim=True)
        if unembed.bias is not None:
            unembed.bias -= unembed.bias.mean()
    if fold_value_biases:
        _fold_value_biases(processed)
    return processed


def _untie(model: HookedDecoder) -> None:
    if model.cfg.tied_embeddings:
        model.unembed.weight = nn.Parameter(model.unembed.weight.detach().clone())
        model.cfg = dataclasses.replace(model.cfg, tied_embeddings=False)


def _mlp_inputs(block: nn.Module) -> list[nn.Module]:
    """The MLP's layers that read ln2: the up projection, and the gate of a gated MLP."""
    return [block.mlp.fc_in] + ([block.mlp.gate] if hasattr(block.mlp, "gate") else [])


def _fold_norms(model: HookedDecoder) -> None:
    for block in model.blocks:
        _fold_norm_into(block.ln1, [block.attn.qkv], model, "qkv_bias")
        _fold_norm_into(block.ln2, _mlp_inputs(block), model, "mlp_bias")
    if model.cfg.final_norm:
        _fold_norm_into(model.ln_final, [model.unembed], model, "unembed_bias")


def _fold_norm_into(norm: nn.Module, readers: list[nn.Module], model: HookedDecoder, bias_field: str) -> None:
    """reader(w * n + b) == reader'(n) with reader'.weight = reader.weight * w and reader'.bias =
    reader.bias + reader.weight @ b; the norm keeps w = 1 (and b = 0)."""
    w = norm.w.float()
    b = norm.b.float() if hasattr(norm, "b") else None
    fold_bias = b is not None and bool(b.any())
    for reader in readers:
        weight = reader.weight.float()  # [out in]
        if fold_bias:
            if reader.bias is None:  # the folded norm bias needs somewhere to live
                _add_biases(model, bias_field)
            reader.bias.copy_(reader.bias.float() + weight @ b)
        reader.weight.copy_(weight * w)
    norm.w.fill_(1.0)
    if b is not None:
        norm.b.zero_()


def _biased_layers(model: HookedDecoder, bias_field: str) -> list[nn.Module]:
    """Every layer whose bias the config field `bias_field` switches on (as the constructors read it)."""
    if bias_field == "unembed_bias":
        return [model.unembed]
    if bias_field == "qkv_bias":
        return [block.attn.qkv for block in model.blocks]
    if bias_field == "out_bias":
        return [block.attn.out for block in model.blocks]
    if bias_field == "mlp_bias":
        return [layer for block in model.blocks for layer in _mlp_inputs(block) + [block.mlp.fc_out]]
    raise ValueError(f"unknown bias field {bias_field!r}")


def _add_biases(model: HookedDecoder, bias_field: str) -> None:
    """Turn `bias_field` on, giving a zero bias to every layer it governs that has none. All of them, not
    only the layer receiving a folded bias: a model rebuilt from the config (pruning, loading a state
    dict) expects each one to have a bias once the field says so."""
    for layer in _biased_layers(model, bias_field):
        if layer.bias is None:
            layer.bias = nn.Parameter(torch.zeros(layer.weight.shape[0], dtype=layer.weight.dtype, device=layer.weight.device))
    model.cfg = dataclasses.replace(model.cfg, **{bias_field: True})


def _center_writers(model: HookedDecoder) -> None:
    """Subtract, from every vector written into the residual stream, its mean over d_model."""
    model.embed.W_E -= model.embed.W_E.mean(dim=-1, keepdim=True)
    if isinstance(getattr(model.pos_embed, "W_pos", None), nn.Parameter):  # sinusoids are fixed, not weights
        model.pos_embed.W_pos -= model.pos_embed.W_pos.mean(dim=-1, keepdim=True)
    for block in model.blocks:
        for writer in (block.attn.out, block.mlp.fc_out):  # weight [d_model in]: each column is a written vector
            writer.weight -= writer.weight.mean(dim=0, keepdim=True)
            if writer.bias is not None:
                writer.bias -= writer.bias.mean()


def _fold_value_biases(model: HookedDecoder) -> None:
    """b_O += sum over heads of b_V(head) @ W_O(head); b_V = 0."""
    for block in model.blocks:
        attn = block.attn
        if attn.qkv.bias is None or attn.n_heads == 0:
            continue
        b_v = attn.b_V  # [kv_head d_head], a view of the qkv bias
        per_head = b_v.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=0)  # [head d_head]: each query head's kv head
        folded = torch.einsum("hd,hdm->m", per_head.float(), attn.W_O.float())
        if attn.out.bias is None:
            _add_biases(model, "out_bias")
        attn.out.bias.copy_(attn.out.bias.float() + folded)
        b_v.zero_()
