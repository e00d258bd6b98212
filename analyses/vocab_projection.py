"""Residual directions read through the unembedding: FFN value vectors and SAE decoder rows alike.

`top_tokens` ranks the tokens any set of residual directions promotes and suppresses (d W_U);
`value_directions` gives an FFN layer's value vectors v_i (what a sandwich block writes), and
`final_norm_directions` what the final norm does to a direction before the unembedding. FFN memories
(`analyses.memory_values`) and SAE features (`analyses.features`) both read their tokens through these.
"""
from __future__ import annotations

from typing import Callable

import torch
from einops import einsum

from probe import HookedDecoder, Norm
from probe.analyses.architecture import refuse_prediction_head


# value_tokens multiplies [neuron d_model] by [d_model vocab] in chunks of at most this many logits,
# so all 3072 neurons of a GPT-2 layer against a 50k vocabulary never sit in memory at once (and a
# half-precision unembedding is converted to float32 at most this many entries at a time)
LOGIT_CHUNK = 1 << 24


def value_directions(model: HookedDecoder, layer: int, neurons: torch.Tensor, through_final_norm: bool) -> torch.Tensor:
    """[neuron d_model] float32: the values v_i, or what the final norm does to them (`final_norm_directions`)."""
    # float32 whatever the model's dtype: the weights are exact, and bfloat16 arithmetic on them would
    # round v_i W_U to 8 bits, tying and reordering near-equal tokens (half the neurons' top-10 lists)
    block = model.blocks[layer]
    values = block.mlp.W_out[neurons.to(model.device)].float()
    if hasattr(block, "ln2_post"):  # a sandwich block's write: the MLP output times ln2_post.w over a per-position scale
        values = values * block.ln2_post.w.float()
    return final_norm_directions(model, values) if through_final_norm else values


def final_norm_directions(model: HookedDecoder, directions: torch.Tensor) -> torch.Tensor:
    """[n d_model] float32: what the final norm does to residual directions: a LayerNorm centres them and
    multiplies by its weight, an RMSNorm only multiplies, and a model without a final norm leaves them be
    (the scale is per position and never changes a ranking)."""
    if model.cfg.final_norm:
        if model.cfg.norm is Norm.LAYER:
            directions = directions - directions.mean(-1, keepdim=True)
        directions = directions * model.ln_final.w.float()
    return directions


@torch.no_grad()
def top_value_tokens(
    model: HookedDecoder, layer: int, neurons: torch.Tensor, k: int, through_final_norm: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k and bottom-k of v_i W_U for each neuron: (top_logits, top_ids, bottom_logits, bottom_ids), [neuron k]."""
    return top_tokens(model, lambda rows: value_directions(model, layer, neurons[rows], through_final_norm),
                       len(neurons), k)


@torch.no_grad()
def top_tokens(
    model: HookedDecoder, directions: Callable[[slice], torch.Tensor], n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`top_value_tokens` for any n residual directions, `directions(rows)` giving rows [rows d_model] float32."""
    refuse_prediction_head(model, "reading residual directions' tokens through W_U (d W_U)")
    W_U = model.unembed.W_U  # [d_model vocab]
    d_model, d_vocab = W_U.shape
    # float32 like the values: a half-precision W_U is converted a slice of columns at a time, so no
    # float32 copy of the whole unembedding is ever held (a float32 W_U is used whole, uncopied)
    cols = d_vocab if W_U.dtype == torch.float32 else max(1, LOGIT_CHUNK // d_model)
    chunk = max(1, LOGIT_CHUNK // d_vocab)
    outs = []
    for start in range(0, n, chunk):
        values = directions(slice(start, start + chunk))
        logits = values.new_empty(len(values), d_vocab)  # [neuron vocab]
        for col in range(0, d_vocab, cols):
            logits[:, col:col + cols] = einsum(values, W_U[:, col:col + cols].float(), "neuron d_model, d_model vocab -> neuron vocab")
        top = logits.topk(k, dim=-1)
        bottom = logits.topk(k, dim=-1, largest=False)
        outs.append((top.values, top.indices, bottom.values, bottom.indices))
    return tuple(torch.cat([o[i] for o in outs]).cpu() for i in range(4))
