"""Weight processing, as transformer-lens applies it when loading: rewrite the weights so they read
more simply, leaving what the model computes unchanged.

- `fold_ln`: each norm's weight (and bias) moves into the layer that reads the norm's output, so
  the norm only normalises (w = 1, b = 0, no longer learned: `cfg.norm_weights` is False and
  `cfg.normalization_type` "LNPre" or "RMSPre", as in transformer-lens) and `hook_normalized` is exactly
  what that layer reads.
  A LayerNorm's readers also lose their weights' mean over d_model (its output has mean zero, so
  they never used it), as transformer-lens's fold_ln does.
- `center_writing_weights`: everything that writes into the residual stream (embeddings, attention
  and MLP outputs) writes a mean-zero vector (fixed sinusoidal positions are not weights and keep
  their mean). Every reader of the residual is a LayerNorm, which subtracts the mean first, so
  nothing downstream changes, while the residual itself (and so each component's direct
  contribution) loses a direction no reader can see.
- `center_unembed`: each position's logits lose their mean over the vocabulary; probabilities, log-
  probabilities and logit differences are unchanged.
- `fold_value_biases`: the value bias moves into the output bias. Each query's attention weights
  sum to 1, so a head passes its value bias through unchanged: `hook_v` and `hook_z` then hold the
  part of the values that depends on the tokens. Not with attention sinks, whose rows sum to less.
- `refactor_factored_attn_matrices` (off by default, as in transformer-lens): each head's W_Q W_K^T
  (with the query and key biases as an extra row) and W_V W_O are rewritten from their SVD U S V^T:
  W_Q = U sqrt(S) and W_K = V sqrt(S), W_V = U S and W_O = V^T (a rotation, so z has the norm of the
  head's write), as transformer-lens does. The products are unchanged, so are the scores and the
  output; q, k, v and z become the head's coordinates along its singular directions (each direction's
  sign is the SVD's choice). It needs positions that do not rotate q and k, and one key/value head per head.

The result is a new model (the input is left as it was) whose unembedding is no longer tied to the
embedding, and which has an unembedding bias when a final LayerNorm bias was folded in (so it cannot
be saved in a Hugging Face format). Folding needs pre-norm, parallel or sandwich blocks; centring the writers needs
LayerNorm everywhere.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from probe.blocks import attention_blocks
from probe.config import DecoderConfig, Norm, Positions
from probe.factored import FactoredMatrix
from probe.norm import LayerNorm
from probe.processing_rules import (can_center_unembed, can_center_writing_weights, can_fold_ln, can_fold_value_biases,
                                    can_refactor_factored_attn_matrices)

if TYPE_CHECKING:  # annotations only: HookedDecoder.from_pretrained processes through this module
    from probe.model import HookedDecoder


TL_PROCESSING_DEFAULTS = {  # HookedTransformer.from_pretrained's (and process_weights_'s, load_and_process_state_dict's)
    "fold_ln": True, "center_writing_weights": True, "center_unembed": True, "fold_value_biases": True,
    "refactor_factored_attn_matrices": False,
}


# the steps transformer-lens skips with a warning where a model cannot take them, even when asked for
TL_SKIPS = ("fold_ln", "center_writing_weights", "center_unembed")
# skipped with a warning even when given: those, and the value-bias fold beside attention sinks, which TL does anyway
# (changing the outputs)
SKIPPED_WHEN_GIVEN = (*TL_SKIPS, "fold_value_biases")


def tl_processing_steps(cfg: DecoderConfig, given: dict[str, bool], where: str, stacklevel: int = 4,
                        loading: bool = False) -> dict[str, bool]:
    """TL's processing for a model of `cfg`: the steps given, TL's defaults for the rest. A fold or centring that
    does not apply is skipped with a warning naming `where`, given or by default, as TL skips it (TL code spells out
    `fold_ln=True, center_writing_weights=True, center_unembed=True` for every model, a Llama too); a refactoring
    given is checked later, and refused where it cannot be done, as TL refuses it."""
    applies = {"fold_ln": can_fold_ln, "center_writing_weights": can_center_writing_weights,
               "center_unembed": can_center_unembed, "fold_value_biases": can_fold_value_biases,
               "refactor_factored_attn_matrices": can_refactor_factored_attn_matrices}
    # TL's from_pretrained leaves a shortformer model's weights unfolded and uncentred, though centring would be
    # exact: its numbers (Neel Nanda's attn-only models) are those of weights left as trained
    unprocessed_when_loaded = loading and cfg.positions is Positions.SHORTFORMER
    steps = {}
    for step, default in TL_PROCESSING_DEFAULTS.items():
        value = given.get(step, default)
        skipped = step in TL_SKIPS and unprocessed_when_loaded
        if value and (skipped or not applies[step](cfg)) and (step not in given or step in SKIPPED_WHEN_GIVEN):
            how = "given" if step in given else "transformer-lens's default"
            why = ("transformer-lens's from_pretrained processes no shortformer model" if skipped else
                   ("which a norm on the values or an output gate makes inexact" if cfg.value_norm or
                    cfg.attn_output_gate or cfg.sub_norms else "which attention sinks make inexact (transformer-lens folds them anyway, "
                    "changing the outputs)")
                   if step == "fold_value_biases" else "which this model's blocks do not allow, as transformer-lens "
                   "skips it")
            warnings.warn(f"{where}: skipping {step}=True ({how}), {why}; pass {step}=False to say so",
                          stacklevel=stacklevel)  # the user's call
            value = False
        steps[step] = value
    return steps


def process_weights(model: HookedDecoder, *, fold_ln: bool = True, center_writing_weights: bool = True,
                    center_unembed: bool = True, fold_value_biases: bool = True,
                    refactor_factored_attn_matrices: bool = False) -> HookedDecoder:
    """A copy of `model` with its weights processed (see the module docstring); its log-probabilities equal the
    original's up to rounding."""
    steps = dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights, center_unembed=center_unembed,
                 fold_value_biases=fold_value_biases, refactor_factored_attn_matrices=refactor_factored_attn_matrices)
    check_processing(model.cfg, **steps)
    processed = copy.deepcopy(model)
    process_weights_in_place(processed, **steps)
    return processed


def check_processing(cfg: DecoderConfig, *, fold_ln: bool = True, center_writing_weights: bool = True,
                     center_unembed: bool = True, fold_value_biases: bool = True,
                     refactor_factored_attn_matrices: bool = False) -> None:
    """A ValueError naming the step a model of `cfg` cannot take, and how to leave it out."""
    if fold_ln and not can_fold_ln(cfg):
        why = ("shortformer positions are added to ln1's output before W_Q and W_K, so ln1's weight cannot be "
               "folded into them" if cfg.positions is Positions.SHORTFORMER and cfg.norm is not Norm.NONE else
               "a shared block's norms (Zamba2's) are one weight in several layers, read by the shared projections "
               "and each layer's own adapters alike, so no one layer's weights can take them"
               if cfg.shared_blocks is not None else "an RWKV layer's token shift reads zeros before the first position, "
               "where a folded norm's bias would be read" if cfg.rwkv is not None else "the final norm feeds a "
               "prediction head's dense layer (ModernBERT's), not W_U" if cfg.prediction_head is not None else
               "it needs pre-norm, parallel or sandwich blocks with norms: in a post-norm model (GPT-1, OPT-350m) the "
               "norm's output is the residual stream itself, not the input of one layer")
        raise ValueError(f"fold_ln: {why}; pass fold_ln=False")
    if center_writing_weights and not can_center_writing_weights(cfg):
        raise ValueError("center_writing_weights needs every reader of the residual stream to be a LayerNorm (pre-norm "
                         f"or parallel blocks and a final LayerNorm); this model has norm={cfg.norm.value}, "
                         f"final_norm={cfg.final_norm}, norm_placement={cfg.norm_placement.value}, first_ln1="
                         f"{cfg.first_ln1} (False: layer 0's attention reads the residual itself); "
                         "pass center_writing_weights=False")
    if center_unembed and not can_center_unembed(cfg):
        raise ValueError("center_unembed shifts each position's logits, which a logit soft cap (Gemma 2) does not "
                         "pass through unchanged; pass center_unembed=False")
    if fold_value_biases and not can_fold_value_biases(cfg):
        raise ValueError("fold_value_biases moves each head's value bias into b_O, which is exact only where the "
                         "head's attention weights sum to 1 and its values reach W_O linearly; an attention sink "
                         "(GPT-OSS) takes a share of the weights, Gemma 4 normalises each value, and an output gate "
                         "(AFMoE, Qwen3.5) scales z by position: pass fold_value_biases=False")
    if refactor_factored_attn_matrices and not can_refactor_factored_attn_matrices(cfg):
        raise ValueError("refactor_factored_attn_matrices needs positions that do not rotate q and k (this model has "
                         f"positions={cfg.positions.value}) and a key/value head per query head (n_kv_heads="
                         f"{cfg.n_kv_heads}, n_heads={cfg.n_heads}), and value biases it can fold (no attention "
                         f"sinks: attn_sinks={cfg.attn_sinks}); pass refactor_factored_attn_matrices=False")


@torch.no_grad()
def process_weights_in_place(model: HookedDecoder, *, fold_ln: bool = True, center_writing_weights: bool = True,
                             center_unembed: bool = True, fold_value_biases: bool = True,
                             refactor_factored_attn_matrices: bool = False) -> HookedDecoder:
    """Process `model`'s own weights (no copy: for a model nothing else holds, as a fresh load) and return it."""
    check_processing(model.cfg, fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                     center_unembed=center_unembed, fold_value_biases=fold_value_biases,
                     refactor_factored_attn_matrices=refactor_factored_attn_matrices)
    untie_embeddings(model)
    if fold_ln and model.cfg.norm_weights:  # norms without weights (folded already, or LNPre) have nothing to fold
        _fold_norms(model)
    if center_writing_weights:
        center_writers(model)
    if center_unembed:
        unembed = model.unembed  # weight [vocab d_model]: each logit's mean over the vocabulary goes
        unembed.weight -= unembed.weight.mean(dim=0, keepdim=True)
        if unembed.bias is not None:
            unembed.bias -= unembed.bias.mean()
    if fold_value_biases or refactor_factored_attn_matrices:  # refactoring W_V W_O needs b_V out of the way
        _fold_value_biases(model)
    if refactor_factored_attn_matrices:
        for block in attention_blocks(model.blocks):
            _refactor_attention(block.attn)
    return model


def untie_embeddings(model: HookedDecoder) -> None:
    """Give the unembedding a copy of a tied embedding of its own (processing changes one and not the other)."""
    if model.cfg.tied_embeddings:
        model.unembed.weight = nn.Parameter(model.unembed.weight.detach().clone())
        model.cfg = dataclasses.replace(model.cfg, tied_embeddings=False)


def _mixer_inputs(block: nn.Module) -> list[nn.Module]:
    """The layers that read ln1: attention's q/k/v projection (and its output gate), latent attention's query and
    key/value down-projections, or a linear-attention layer's input projections."""
    if hasattr(block, "mamba"):  # Falcon-H1's parallel block: attention and the Mamba-2 mixer beside it read ln1
        return [block.attn.qkv, block.mamba.in_proj]
    if hasattr(block, "attn") and hasattr(block.attn, "readers"):
        return block.attn.readers
    if hasattr(block, "linear_attn"):
        mixer = block.linear_attn
        return [mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a]
    # a Mamba-2 layer: one projection reads it all (NemotronH's attention blocks answer to `mixer` too: bridge names)
    if isinstance(getattr(block, "mixer", None), nn.Module):
        return [block.mixer.in_proj]
    if hasattr(block, "conv"):  # an LFM2 short-convolution layer: so does its
        return [block.conv.in_proj]
    if hasattr(block, "recurrent"):  # a Griffin recurrent block: its two branches' projections
        return [block.recurrent.linear_x, block.recurrent.linear_y]
    return [block.attn.qkv] + ([] if block.attn.gate is None else [block.attn.gate])


def _mixer_output(block: nn.Module) -> nn.Module:
    if hasattr(block, "mixer_name"):  # a recurrent layer's (Gated DeltaNet's, Mamba-2's)
        return getattr(block, block.mixer_name).out_proj
    return block.attn.out


def _mlp_inputs(block: nn.Module) -> list[nn.Module]:
    """The MLP's layers that read ln2: the up projection, and the gate of a gated MLP (none in an attn-only block);
    in a mixture of experts the router and every expert's gate and up projection."""
    if not hasattr(block, "mlp"):
        return []
    if hasattr(block.mlp, "experts"):
        return block.mlp.residual_readers()
    return [block.mlp.fc_in] + ([block.mlp.gate] if hasattr(block.mlp, "gate") else [])


def _mlp_outputs(model: HookedDecoder) -> list[nn.Module]:
    """The layers that write the MLP's output: its down projection, or every expert's."""
    return [layer for block in model.blocks if hasattr(block, "mlp") for layer in _down_projections(block.mlp)]


def _down_projections(mlp: nn.Module) -> list[nn.Module]:
    return mlp.residual_writers() if hasattr(mlp, "experts") else [mlp.fc_out]


def _fold_norms(model: HookedDecoder) -> None:
    for block in model.blocks:
        if hasattr(block, "ln1"):  # (not in NemotronH's MLP-only layers)
            _fold_norm_into(block.ln1, _mixer_inputs(block), model, "qkv_bias")
        if hasattr(block, "ln2"):
            _fold_norm_into(block.ln2, _mlp_inputs(block), model, "mlp_bias")
        if model.cfg.mlp_norm_learned or model.cfg.sub_norms:  # a SoLU-LN MLP's LayerNorm (TL folds it too), BitNet's
            _fold_norm_into(block.mlp.ln, [block.mlp.fc_out], model, "mlp_bias")  # RMSNorm: into the W_out reading it
        if model.cfg.sub_norms:  # BitNet's norm of every head's z, into W_O (each column of W_O reads one channel)
            _fold_norm_into(block.attn.z_norm, [block.attn.out], model, "out_bias")
    if model.cfg.final_norm:
        _fold_norm_into(model.ln_final, [model.unembed], model, "unembed_bias")
    drop_norm_weights(model)  # the folded norms are left with nothing to learn


def drop_norm_weights(model: HookedDecoder) -> None:
    """ln1, ln2, ln_final (and a SoLU-LN MLP's mlp.ln) keep w = 1 (and b = 0) fixed, learning none: transformer-lens's
    LNPre / RMSPre, whose state dict has no norm weights (cfg.norm_weights False). For norms whose weights are ones and
    zeros already."""
    norms = [getattr(block, name) for block in model.blocks for name in ("ln1", "ln2") if hasattr(block, name)]
    norms += [block.mlp.ln for block in model.blocks if hasattr(getattr(block, "mlp", None), "ln")]  # SoLU-LN's, BitNet's
    norms += [block.attn.z_norm for block in model.blocks if hasattr(getattr(block, "attn", None), "z_norm")]
    for norm in norms + [model.ln_final]:
        if hasattr(norm, "drop_weights"):  # not the Identity of a model without a final norm
            norm.drop_weights()
    model.cfg = dataclasses.replace(model.cfg, norm_weights=False)


def _fold_norm_into(norm: nn.Module, readers: list[nn.Module], model: HookedDecoder, bias_field: str) -> None:
    """reader(w * n + b) == reader'(n) with reader'.weight = reader.weight * w and reader'.bias =
    reader.bias + reader.weight @ b; the norm keeps w = 1 (and b = 0). After a LayerNorm each reader's weight
    is also centred over its input, as transformer-lens's fold_ln does, which its mean-zero input cannot see."""
    w = norm.w.float()
    b = norm.b.float() if hasattr(norm, "b") else None
    fold_bias = b is not None and bool(b.any())
    for reader in readers:
        weight = reader.weight.float()  # [out in]
        if fold_bias:
            if reader.bias is None:  # the folded norm bias needs somewhere to live
                _add_biases(model, bias_field)
            reader.bias.copy_(reader.bias.float() + weight @ b)
        weight = weight * w
        if isinstance(norm, LayerNorm):  # its output has mean zero: what a reader reads along (1, ..., 1) is never used
            weight = weight - weight.mean(dim=1, keepdim=True)
        reader.weight.copy_(weight)
    norm.w.fill_(1.0)
    if b is not None:
        norm.b.zero_()


def _biased_layers(model: HookedDecoder, bias_field: str) -> list[nn.Module]:
    """Every layer whose bias the config field `bias_field` switches on (as the constructors read it)."""
    if bias_field == "unembed_bias":
        return [model.unembed]
    if bias_field == "qkv_bias":
        return [layer for block in attention_blocks(model.blocks) for layer in _mixer_inputs(block)]
    if bias_field == "out_bias":
        return [block.attn.out for block in attention_blocks(model.blocks)]
    if bias_field == "mlp_bias":
        return [layer for block in model.blocks for layer in _mlp_inputs(block)] + _mlp_outputs(model)
    raise ValueError(f"unknown bias field {bias_field!r}")


def _add_biases(model: HookedDecoder, bias_field: str) -> None:
    """Turn `bias_field` on, giving a zero bias to every layer it governs that has none. All of them, not
    only the layer receiving a folded bias: a model rebuilt from the config (pruning, loading a state
    dict) expects each one to have a bias once the field says so."""
    for layer in _biased_layers(model, bias_field):
        if layer.bias is None:
            layer.bias = nn.Parameter(torch.zeros(layer.weight.shape[0], dtype=layer.weight.dtype, device=layer.weight.device))
    changes: dict = {bias_field: True}
    experts = model.cfg.experts
    if bias_field == "mlp_bias" and experts is not None and not experts.routed_bias:  # (ERNIE's) they have theirs now
        changes["experts"] = dataclasses.replace(experts, routed_bias=True)
    model.cfg = dataclasses.replace(model.cfg, **changes)


def center_readers(model: HookedDecoder) -> None:
    """Subtract from every weight that reads the residual stream (W_Q, W_K, W_V, W_in, W_gate) its mean over d_model:
    what folding a LayerNorm does to them, and what transformer-lens's fold_layer_norm does to a model whose norms
    have no weights (nothing changes after a LayerNorm, whose output has mean zero)."""
    for block in model.blocks:
        for reader in (_mixer_inputs(block) if hasattr(block, "ln1") else []) + _mlp_inputs(block):
            reader.weight -= reader.weight.mean(dim=1, keepdim=True)  # weight [out d_model]


def center_writers(model: HookedDecoder) -> None:
    """Subtract, from every vector written into the residual stream, its mean over d_model."""
    model.embed.W_E -= model.embed.W_E.mean(dim=-1, keepdim=True)
    # sinusoids are fixed, not weights; shortformer positions join ln1's output, not the residual stream, so
    # centring them would change the queries and keys (transformer-lens centres them all the same)
    if isinstance(getattr(model.pos_embed, "W_pos", None), nn.Parameter) and model.cfg.positions_in_residual:
        model.pos_embed.W_pos -= model.pos_embed.W_pos.mean(dim=-1, keepdim=True)
    # (RWKV's: the embedding alone, as TL 4's bridge centres it; its channel mix gates its write channel by channel)
    mixers = [] if model.cfg.rwkv is not None else [_mixer_output(block) for block in model.blocks if hasattr(block, "ln1")]
    for writer in mixers + _mlp_outputs(model):
        writer.weight -= writer.weight.mean(dim=0, keepdim=True)  # weight [d_model in]: each column is a written vector
        if writer.bias is not None:
            writer.bias -= writer.bias.mean()


def _fold_value_biases(model: HookedDecoder) -> None:
    """b_O += sum over heads of b_V(head) @ W_O(head); b_V = 0."""
    for block in attention_blocks(model.blocks):
        attn = block.attn
        if not hasattr(attn, "qkv") or attn.qkv.bias is None or attn.n_heads == 0:  # (latent attention: no value bias)
            continue
        b_v = attn.b_V  # [kv_head d_head], a view of the qkv bias
        per_head = b_v.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=0)  # [head d_head]: each query head's kv head
        folded = torch.einsum("hd,hdm->m", per_head.float(), attn.W_O.float())
        if attn.out.bias is None:
            _add_biases(model, "out_bias")
        attn.out.bias.copy_(attn.out.bias.float() + folded)
        b_v.zero_()


def _refactor_attention(attn: nn.Module) -> None:
    """Every head's W_Q W_K^T as (U sqrt(S)) (sqrt(S) V^T) and W_V W_O as (U S) V^T; the query and key biases ride
    along as an extra input row (a constant 1), so the scores' bias terms are kept too."""
    if attn.n_heads == 0:
        return
    biased = attn.qkv.bias is not None

    def with_bias_row(weight, bias):  # [head d_model d_head] -> [head d_model+1 d_head]
        return torch.cat([weight, bias[:, None, :]], dim=1).double() if biased else weight.double()

    queries, keys = FactoredMatrix(with_bias_row(attn.W_Q, attn.b_Q), with_bias_row(attn.W_K, attn.b_K).mT).make_even().pair
    keys = keys.mT
    ov = FactoredMatrix(attn.W_V.double(), attn.W_O.double())
    values, outputs = ov.collapse_r(), ov.V.mT
    d_model = attn.W_Q.shape[1]
    attn.W_Q.copy_(queries[:, :d_model])
    attn.W_K.copy_(keys[:, :d_model])
    if biased:
        attn.b_Q.copy_(queries[:, d_model])
        attn.b_K.copy_(keys[:, d_model])
    attn.W_V.copy_(values)
    attn.W_O.copy_(outputs)
