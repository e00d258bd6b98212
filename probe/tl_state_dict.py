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
buffers (`mask`, `IGNORE`, `rotary_sin`, `rotary_cos`) are dropped; saving writes TL 3.9's `mask` and `IGNORE` (an
empty mask and -inf) so that code editing them in a state dict finds them. The parameters themselves keep probe's names
(`named_parameters()` lists `attn.qkv.weight`).
"""
from __future__ import annotations

from typing import Optional

import torch
from einops import rearrange
from torch import nn

from probe.attention import Attention
from probe.config import Positions
from probe.embedding import Unembed
from probe.mlp import MLP

TL_BUFFERS = ("mask", "IGNORE", "rotary_sin", "rotary_cos")  # recomputed from the config: nothing to load
TL_UNWRITTEN = ("rotary_sin", "rotary_cos")  # of those, the ones state_dict() does not write (mask, IGNORE are)


# the order of transformer-lens 4's get_params() / tl_parameters() within a block; other names follow these
BRIDGE_BLOCK_ORDER = ("attn.W_Q", "attn.W_K", "attn.W_V", "attn.W_O", "attn.b_Q", "attn.b_K", "attn.b_V", "attn.b_O",
                      "mlp.W_in", "mlp.W_out", "mlp.b_in", "mlp.b_out", "mlp.W_gate", "mlp.b_gate",
                      "ln1.w", "ln1.b", "ln2.w", "ln2.b")
BRIDGE_OUTER_ORDER = ("embed.W_E", "pos_embed.W_pos", "ln_final.w", "ln_final.b", "unembed.W_U", "unembed.b_U")


def bridge_rank(name: str) -> tuple:
    """A sort key putting TL-layout weight names in the order of the bridge's get_params(): the embeddings, each
    block in turn (its attention, MLP, then norms), the final norm and the unembedding; names it does not list
    (Gemma 2's ln1_post, per-head q/k norms) come after the ones it does, in their block."""
    parts = name.split(".")
    if parts[0] == "blocks":
        rest = ".".join(parts[2:])
        order = BRIDGE_BLOCK_ORDER.index(rest) if rest in BRIDGE_BLOCK_ORDER else len(BRIDGE_BLOCK_ORDER)
        return (1, int(parts[1]), order)
    order = BRIDGE_OUTER_ORDER.index(name) if name in BRIDGE_OUTER_ORDER else len(BRIDGE_OUTER_ORDER)
    return (0 if order < 2 else 2, order, 0)


def use_tl_layout(model: nn.Module) -> None:
    """Give every attention, MLP and unembedding module of `model` transformer-lens's state_dict layout, and the
    model the check that a tied unembedding loads what its embedding does."""
    for module in model.modules():
        for kind, (save, load) in LAYOUTS.items():
            if isinstance(module, kind):
                _on_save(module, save)
                _on_load(module, load)
    _on_load(model, _check_tied_unembedding)
    if model.cfg.positions is Positions.ALIBI:
        _on_save(model, _save_unused_positions)
        _on_load(model, _drop_unused_positions)


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
    own = (True, *module.projects)  # (Gemma 4's layers reusing keys project q alone; values from keys: no v)
    for name, part, kept in zip(names, weight.split(module.qkv_sizes), own):
        if kept:
            state[prefix + name] = rearrange(part, "(head d_head) d_model -> head d_model d_head", d_head=d_head).contiguous()
    parts = bias.split(module.qkv_sizes) if bias is not None else [weight.new_zeros(n) for n in module.qkv_sizes]
    for name, part, kept in zip(names, parts, own):
        if kept:
            state[prefix + name.replace("W", "b")] = part.reshape(-1, d_head).contiguous()
    state[prefix + "W_O"] = rearrange(out_weight, "d_model (head d_head) -> head d_head d_model", d_head=d_head).contiguous()
    state[prefix + "b_O"] = _or_zeros(out_bias, out_weight.shape[0], out_weight)
    # TL 3.9's attention buffers as its state dict holds them, for code that edits them there (ARENA's grokking loader
    # sets IGNORE before loading); loading drops the mask, since probe's attention computes its own, and keeps IGNORE,
    # what a hidden key's score reads (an older TL saved -1e5, and its caches' attn_scores hold that)
    state[prefix + "mask"] = torch.empty((0, 0), dtype=torch.bool, device=out_weight.device)
    state[prefix + "IGNORE"] = torch.tensor(module.masked_score, device=out_weight.device)


def _mlp_weights(module: MLP) -> list[tuple[str, str]]:
    """(probe's linear, TL's weight name) of every projection of the MLP."""
    return [("fc_in", "W_in"), ("fc_out", "W_out")] + ([("gate", "W_gate")] if hasattr(module, "gate") else [])


def _save_mlp(module: MLP, state: dict, prefix: str, local_metadata) -> None:
    gated = hasattr(module, "gate")
    for linear, name in _mlp_weights(module):
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
# A module whose TL tensors are only partly given keeps its own for the rest, and their TL names count as missing:
# load_state_dict(strict=True) then raises for them, and strict=False reports them, as for any other key.


def _into(state: dict, key: str, target: str, shape: tuple, current: torch.Tensor, errors: list, missing: list,
          reshape=lambda t: t) -> None:
    """TL's `key` (of `shape`) into probe's `target`, reshaped; absent: the module keeps `current`, `key` missing."""
    tensor = state.pop(key, None)
    if tensor is None:
        missing.append(key)
        state[target] = current
    elif tuple(tensor.shape) != tuple(shape):
        errors.append(f"{key} has shape {tuple(tensor.shape)}, but this model needs {tuple(shape)}")
    else:
        state[target] = reshape(tensor)


def _bias_into(state: dict, key: str, target: str, shape: tuple, current: Optional[torch.Tensor], errors: list,
               missing: list, what: str, fix: str = "load it into a model built with that bias, or drop the key") -> None:
    """TL's bias `key` into probe's `target` (`current`: the module's bias, None when it has none, and then a zero
    TL bias is dropped and a non-zero one refused)."""
    if current is not None:
        _into(state, key, target, shape, current, errors, missing, lambda t: t.reshape(-1))
        return
    bias = state.pop(key, None)
    if bias is None:
        return
    if tuple(bias.shape) != tuple(shape):
        errors.append(f"{key} has shape {tuple(bias.shape)}, but this model needs {tuple(shape)}")
    elif bias.count_nonzero():
        errors.append(f"{key} is not zero, but this model has no {what}: {fix}")


def _current(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach()


def _load_attention(module: Attention, state: dict, prefix: str, local_metadata, strict, missing, unexpected,
                    errors: list) -> None:
    ignore = state.get(prefix + "IGNORE")
    if ignore is not None:
        module.masked_score = float(ignore)
    for name in TL_BUFFERS:
        state.pop(prefix + name, None)
    grouped = module.n_kv_heads != module.n_heads
    k, v = ("_W_K", "_W_V") if grouped else ("W_K", "W_V")
    names = ("W_Q", k, v, "W_O", "b_Q", k.replace("W", "b"), v.replace("W", "b"), "b_O")
    if not any(prefix + name in state for name in names):
        return  # probe's own layout (or nothing for this module)
    d_model, d_head, n_q, n_kv = module.qkv.in_features, module.d_head, module.n_heads, module.n_kv_heads
    heads = (n_q, n_kv, n_kv)[:len(module.projection_inputs())]  # (fewer where a layer projects fewer: Gemma 4)
    # q, k and v go into the one fused projection: each is staged under its own key, then joined
    staged = [prefix + f"qkv.{part}" for part in "qkv"][:len(heads)]
    for name, target, n, current in zip(names[:3], staged, heads, module.qkv.weight.detach().split(module.qkv_sizes)):
        _into(state, prefix + name, target, (n, d_model, d_head), current, errors, missing,
              lambda t: rearrange(t, "head d_model d_head -> (head d_head) d_model"))
    if all(key in state for key in staged):
        state[prefix + "qkv.weight"] = torch.cat([state[key] for key in staged])
    has_bias = module.qkv.bias is not None
    biases = module.qkv.bias.detach().split(module.qkv_sizes) if has_bias else (None, None, None)
    staged_bias = [prefix + f"qkv.bias.{part}" for part in "qkv"][:len(heads)]
    for name, target, n, current in zip(names[4:7], staged_bias, heads, biases):
        _bias_into(state, prefix + name, target, (n, d_head), current, errors, missing, "q/k/v bias (qkv_bias)")
    if has_bias and all(key in state for key in staged_bias):
        state[prefix + "qkv.bias"] = torch.cat([state[key] for key in staged_bias])
    for key in staged + staged_bias:
        state.pop(key, None)
    _into(state, prefix + "W_O", prefix + "out.weight", (n_q, d_head, d_model), module.out.weight.detach(), errors,
          missing, lambda t: rearrange(t, "head d_head d_model -> d_model (head d_head)"))
    _bias_into(state, prefix + "b_O", prefix + "out.bias", (d_model,), _current(module.out.bias), errors, missing,
               "output bias (out_bias)")


def _load_mlp(module: MLP, state: dict, prefix: str, local_metadata, strict, missing, unexpected, errors: list) -> None:
    gated = hasattr(module, "gate")
    if not any(prefix + name in state for name in ("W_in", "W_out", "W_gate", "b_in", "b_out")):
        return
    for linear_name, name in _mlp_weights(module):
        linear = getattr(module, linear_name)
        _into(state, prefix + name, prefix + linear_name + ".weight", (linear.in_features, linear.out_features),
              linear.weight.detach(), errors, missing, lambda t: t.T)
    d_mlp, d_model = module.fc_in.out_features, module.fc_out.out_features
    _bias_into(state, prefix + "b_out", prefix + "fc_out.bias", (d_model,), _current(module.fc_out.bias), errors,
               missing, "MLP bias (mlp_bias)")
    if not gated:
        _bias_into(state, prefix + "b_in", prefix + "fc_in.bias", (d_mlp,), _current(module.fc_in.bias), errors,
                   missing, "MLP bias (mlp_bias)")
        return
    # see _save_mlp: TL's b_in comes after the gate's product, where probe has no bias
    _bias_into(state, prefix + "b_in", prefix + "b_in.after_gate", (d_mlp,), None, errors, missing,
               "bias after the gate's product (transformer-lens's gated MLP adds b_in after act(gate) * up)",
               fix="probe's gated MLP, as transformers', biases the up projection inside the product instead, so a "
                   "non-zero TL b_in has no place in it")
    for name, linear_name in (("b_up", "fc_in"), ("b_gate", "gate")):
        linear = getattr(module, linear_name)
        if linear.bias is not None and prefix + name not in state:
            state[prefix + name] = linear.weight.new_zeros(d_mlp)  # absent: zero, as TL's gated MLP has it
        _bias_into(state, prefix + name, prefix + linear_name + ".bias", (d_mlp,), _current(linear.bias), errors,
                   missing, "MLP bias (mlp_bias)")


def _load_unembed(module: Unembed, state: dict, prefix: str, local_metadata, strict, missing, unexpected,
                  errors: list) -> None:
    if prefix + "W_U" not in state and prefix + "b_U" not in state:
        return
    d_vocab, d_model = module.weight.shape
    _into(state, prefix + "W_U", prefix + "weight", (d_model, d_vocab), module.weight.detach(), errors, missing,
          lambda t: t.T)
    _bias_into(state, prefix + "b_U", prefix + "bias", (d_vocab,), _current(module.bias), errors, missing,
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


# transformer-lens 3.9 builds a learned position table for an ALiBi model too, which its forward never reads: its state
# dict holds pos_embed.W_pos, written here as zeros (so a HookedTransformer loads probe's state dict strictly) and
# dropped on loading, whatever its values
def _save_unused_positions(model: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    state[prefix + "pos_embed.W_pos"] = model.embed.W_E.new_zeros(model.cfg.n_ctx, model.cfg.d_model)


def _drop_unused_positions(model: nn.Module, state: dict, prefix: str, local_metadata, strict, missing, unexpected,
                           errors: list) -> None:
    state.pop(prefix + "pos_embed.W_pos", None)
