"""transformer-lens's state_dict layout, for `model.state_dict()` and `model.load_state_dict(...)`.

probe keeps one fused q/k/v projection per layer and `nn.Linear`s for the output, the MLP and the unembedding;
transformer-lens keeps per-head tensors: `attn.W_Q` [head d_model d_head], `W_K`/`W_V` (`_W_K`/`_W_V` when key/value
heads are grouped), `W_O` [head d_head d_model], their biases, `mlp.W_in` [d_model d_mlp], `W_gate`, `W_out`, `b_in`,
`b_out`, and `unembed.W_U` [d_model vocab], `b_U`. The other names (embed.W_E, pos_embed.W_pos, ln1.w, ...) are
already the same. So TL code that moves weights by state dict runs unchanged:
`my_model.load_state_dict(model.state_dict(), strict=False)` (ARENA's transformer-from-scratch), the same for one
module (`model.blocks[0].attn.state_dict()`), and a HookedTransformer's saved state dict loaded into a probe model.

Saving writes TL's layout: the reorganised tensors are contiguous copies (so `safetensors` saves them), and a bias the
model lacks is written as zeros, as TL has it. Loading takes either layout: TL's tensors are put back into the fused
ones, a zero bias the model has no room for is dropped (a non-zero one is an error naming the key), and TL's derived
buffers (`mask`, `IGNORE`, `rotary_sin`, `rotary_cos`) are dropped. The parameters themselves keep probe's names
(`named_parameters()` lists `attn.qkv.weight`).
"""
from __future__ import annotations

from typing import Optional

import torch
from einops import rearrange
from torch import nn

from probe.attention import Attention
from probe.embedding import Unembed
from probe.mlp import MLP

TL_BUFFERS = ("mask", "IGNORE", "rotary_sin", "rotary_cos")  # recomputed from the config: nothing to load


def use_tl_layout(model: nn.Module) -> None:
    """Give every attention, MLP and unembedding module of `model` transformer-lens's state_dict layout, and the
    model the check that a tied unembedding loads what its embedding does."""
    for module in model.modules():
        for kind, (save, load) in LAYOUTS.items():
            if isinstance(module, kind):
                _on_save(module, save)
                _on_load(module, load)
    _on_load(model, _check_tied_unembedding)


def _on_save(module: nn.Module, hook) -> None:
    if hasattr(module, "register_state_dict_post_hook"):
        module.register_state_dict_post_hook(hook)
    else:  # torch < 2.5 has the same hook under its older name
        module._register_state_dict_hook(hook)


def _on_load(module: nn.Module, hook) -> None:
    if hasattr(module, "register_load_state_dict_pre_hook"):
        module.register_load_state_dict_pre_hook(hook)
    else:  # torch < 2.5
        module._register_load_state_dict_pre_hook(hook, with_module=True)


# ---- saving: probe's tensors -> TL's --------------------------------------------------------------------------


def _or_zeros(bias: Optional[torch.Tensor], size: int, like: torch.Tensor) -> torch.Tensor:
    return like.new_zeros(size) if bias is None else bias


def _save_attention(module: Attention, state: dict, prefix: str, local_metadata) -> None:
    weight, bias = state.pop(prefix + "qkv.weight"), state.pop(prefix + "qkv.bias", None)
    out_weight, out_bias = state.pop(prefix + "out.weight"), state.pop(prefix + "out.bias", None)
    d_head, grouped = module.d_head, module.n_kv_heads != module.n_heads
    names = ("W_Q", "_W_K", "_W_V") if grouped else ("W_Q", "W_K", "W_V")
    for name, part in zip(names, weight.split(module.qkv_sizes)):
        state[prefix + name] = rearrange(part, "(head d_head) d_model -> head d_model d_head", d_head=d_head).contiguous()
    parts = bias.split(module.qkv_sizes) if bias is not None else [weight.new_zeros(n) for n in module.qkv_sizes]
    for name, part in zip(names, parts):
        state[prefix + name.replace("W", "b")] = part.reshape(-1, d_head).contiguous()
    state[prefix + "W_O"] = rearrange(out_weight, "d_model (head d_head) -> head d_head d_model", d_head=d_head).contiguous()
    state[prefix + "b_O"] = _or_zeros(out_bias, out_weight.shape[0], out_weight)


def _save_mlp(module: MLP, state: dict, prefix: str, local_metadata) -> None:
    gated = hasattr(module, "gate")
    for linear, name in [("fc_in", "W_in"), ("fc_out", "W_out")] + ([("gate", "W_gate")] if gated else []):
        state[prefix + name] = state.pop(prefix + linear + ".weight").T.contiguous()
    d_mlp, like = module.fc_in.out_features, state[prefix + "W_in"]
    state[prefix + "b_out"] = _or_zeros(state.pop(prefix + "fc_out.bias", None), module.fc_out.out_features, like)
    up_bias = state.pop(prefix + "fc_in.bias", None)
    if not gated:
        state[prefix + "b_in"] = _or_zeros(up_bias, d_mlp, like)
        return
    # TL's gated MLP adds b_in after act(gate) * up, and has no other bias; probe's biases sit inside the up and gate
    # projections (as transformers' do), which TL cannot hold: they go under names of their own when not zero
    state[prefix + "b_in"] = like.new_zeros(d_mlp)
    for name, bias in (("b_up", up_bias), ("b_gate", state.pop(prefix + "gate.bias", None))):
        if bias is not None and bias.count_nonzero():
            state[prefix + name] = bias


def _save_unembed(module: Unembed, state: dict, prefix: str, local_metadata) -> None:
    weight = state.pop(prefix + "weight")
    state[prefix + "W_U"] = weight.T.contiguous()
    state[prefix + "b_U"] = _or_zeros(state.pop(prefix + "bias", None), weight.shape[0], weight)


# ---- loading: TL's tensors -> probe's (left alone when the state dict has probe's) ------------------------------


def _take(state: dict, key: str, shape: tuple, errors: list) -> Optional[torch.Tensor]:
    """state[key] (popped) when it has `shape`; None with an error recorded when it is absent or shaped otherwise."""
    tensor = state.pop(key, None)
    if tensor is None:
        errors.append(f"{key} is missing: a transformer-lens state dict needs every one of the module's tensors")
    elif tuple(tensor.shape) != tuple(shape):
        errors.append(f"{key} has shape {tuple(tensor.shape)}, but this model needs {tuple(shape)}")
        tensor = None
    return tensor


def _bias_into(state: dict, key: str, target: str, shape: tuple, has_bias: bool, errors: list, what: str,
               fix: str = "load it into a model built with that bias, or drop the key") -> None:
    """TL's bias `key` into probe's `target`; dropped when the model has no such bias and it is zero."""
    if key not in state:
        return  # TL always writes its biases; a state dict without one leaves the model's as they are
    bias = _take(state, key, shape, errors)
    if bias is None:
        return
    if has_bias:
        state[target] = bias.reshape(-1)
    elif bias.count_nonzero():
        errors.append(f"{key} is not zero, but this model has no {what}: {fix}")


def _load_attention(module: Attention, state: dict, prefix: str, local_metadata, strict, missing, unexpected,
                    errors: list) -> None:
    for name in TL_BUFFERS:
        state.pop(prefix + name, None)
    grouped_names = {prefix + "_W_K", prefix + "_W_V"}
    if prefix + "W_Q" not in state and not grouped_names & set(state):
        return  # probe's own layout (or nothing for this module)
    k_name = "_W_K" if prefix + "_W_K" in state else "W_K"
    v_name = "_W_V" if prefix + "_W_V" in state else "W_V"
    d_model, d_head, n_q, n_kv = module.qkv.in_features, module.d_head, module.n_heads, module.n_kv_heads
    parts = [_take(state, prefix + name, (n, d_model, d_head), errors)
             for name, n in (("W_Q", n_q), (k_name, n_kv), (v_name, n_kv))]
    w_o = _take(state, prefix + "W_O", (n_q, d_head, d_model), errors)
    # q, k and v's biases go into one fused bias: each is staged under its own key, then joined
    staged = [prefix + f"qkv.bias.{part}" for part in "qkv"]
    for name, target, n in zip(("b_Q", k_name.replace("W", "b"), v_name.replace("W", "b")), staged, (n_q, n_kv, n_kv)):
        _bias_into(state, prefix + name, target, (n, d_head), module.qkv.bias is not None, errors,
                   "q/k/v bias (qkv_bias)")
    if all(key in state for key in staged):
        state[prefix + "qkv.bias"] = torch.cat([state.pop(key) for key in staged])
    for key in staged:  # a partial set of biases: the model keeps its own
        state.pop(key, None)
    _bias_into(state, prefix + "b_O", prefix + "out.bias", (d_model,), module.out.bias is not None, errors,
               "output bias (out_bias)")
    if any(p is None for p in parts) or w_o is None:
        return
    state[prefix + "qkv.weight"] = torch.cat([rearrange(p, "head d_model d_head -> (head d_head) d_model") for p in parts])
    state[prefix + "out.weight"] = rearrange(w_o, "head d_head d_model -> d_model (head d_head)")


def _load_mlp(module: MLP, state: dict, prefix: str, local_metadata, strict, missing, unexpected, errors: list) -> None:
    if prefix + "W_in" not in state:
        return
    gated = hasattr(module, "gate")
    for linear_name, name in [("fc_in", "W_in"), ("fc_out", "W_out")] + ([("gate", "W_gate")] if gated else []):
        linear = getattr(module, linear_name)
        weight = _take(state, prefix + name, (linear.in_features, linear.out_features), errors)
        if weight is not None:
            state[prefix + linear_name + ".weight"] = weight.T
    d_mlp, d_model = module.fc_in.out_features, module.fc_out.out_features
    _bias_into(state, prefix + "b_out", prefix + "fc_out.bias", (d_model,), module.fc_out.bias is not None, errors,
               "MLP bias (mlp_bias)")
    if not gated:
        _bias_into(state, prefix + "b_in", prefix + "fc_in.bias", (d_mlp,), module.fc_in.bias is not None, errors,
                   "MLP bias (mlp_bias)")
        return
    # see _save_mlp: TL's b_in comes after the gate's product, where probe has no bias
    _bias_into(state, prefix + "b_in", prefix + "b_in.after_gate", (d_mlp,), False, errors,
               "bias after the gate's product (transformer-lens's gated MLP adds b_in after act(gate) * up)",
               fix="probe's gated MLP, as transformers', biases the up projection inside the product instead, so a "
                   "non-zero TL b_in has no place in it")
    for name, linear in (("b_up", module.fc_in), ("b_gate", module.gate)):
        if linear.bias is not None and prefix + name not in state:
            state[prefix + name] = linear.weight.new_zeros(d_mlp)  # absent: zero, as TL's gated MLP has it
        _bias_into(state, prefix + name, prefix + ("fc_in" if name == "b_up" else "gate") + ".bias", (d_mlp,),
                   linear.bias is not None, errors, "MLP bias (mlp_bias)")


def _load_unembed(module: Unembed, state: dict, prefix: str, local_metadata, strict, missing, unexpected,
                  errors: list) -> None:
    if prefix + "W_U" not in state:
        return
    d_vocab, d_model = module.weight.shape
    weight = _take(state, prefix + "W_U", (d_model, d_vocab), errors)
    if weight is not None:
        state[prefix + "weight"] = weight.T
    _bias_into(state, prefix + "b_U", prefix + "bias", (d_vocab,), module.bias is not None, errors,
               "unembedding bias (unembed_bias)")


def _check_tied_unembedding(model: nn.Module, state: dict, prefix: str, local_metadata, strict, missing, unexpected,
                            errors: list) -> None:
    """A tied model holds one tensor for W_E and W_U: a state dict whose two differ (a processed TL model's, with its
    unembedding centred) cannot load into it; without this check the later of the two would silently win."""
    if not model.cfg.tied_embeddings or prefix + "embed.W_E" not in state:
        return
    embedding = state[prefix + "embed.W_E"]
    if prefix + "unembed.W_U" in state:
        unembedding = state[prefix + "unembed.W_U"].T
    elif prefix + "unembed.weight" in state:
        unembedding = state[prefix + "unembed.weight"]
    else:
        return
    if unembedding is embedding or unembedding.data_ptr() == embedding.data_ptr():
        return  # one tensor (probe's loading passes the tied one twice)
    if unembedding.shape == embedding.shape and not torch.equal(unembedding.to(embedding.dtype), embedding):
        errors.append("this state dict's unembedding is not its embedding transposed, but this model ties the two "
                      "(cfg.tied_embeddings=True): load it into a model built with "
                      "dataclasses.replace(model.cfg, tied_embeddings=False)")


LAYOUTS = {Attention: (_save_attention, _load_attention), MLP: (_save_mlp, _load_mlp),
           Unembed: (_save_unembed, _load_unembed)}
