"""transformer-lens 4's toy-model line, `TransformerBridge.boot_native(TransformerBridgeConfig(...))`, on HookedDecoder:
the model TL 4 builds from those keywords, with TL 4's initial weights, so TL 4 code that trains or studies a toy
model runs with only the class on that line changed.

TL 4's native model is a pre-norm decoder with learned positions (or rotary ones, adjacent dimensions paired),
biases on every attention projection and on a plain MLP (none on a gated one, nor on the unembedding), an untied
unembedding, and attention scaled by sqrt(d_head) unless `attn_scale` is given. Its initial draw ("gpt2" init) is
N(0, initializer_range) for every matrix but the output projections (attention's W_O, the MLP's W_out), which get
1/sqrt(2 n_layers) of it, drawn in the order embedding, positions, then per block W_Q, W_K, W_V, W_O and the MLP's
input (gate first) and output, then the unembedding; norms start at w = 1, b = 0 and biases at 0. With a seed it
draws from its own generator and leaves torch's global one where it was; without, it draws from the global one after
the `nn.Linear` / `nn.Embedding` defaults of building the model have drawn from it too. Both are reproduced here, so
the random tokens a notebook draws next are TL 4's."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from probe.tl_config import HookedTransformerConfig

# TransformerBridgeConfig's fields that TL 4's native model reads; it ignores the rest, and so does this
NATIVE_FIELDS = ("n_layers", "d_model", "d_head", "n_heads", "n_ctx", "d_vocab", "d_vocab_out", "d_mlp", "act_fn",
                 "normalization_type", "final_rms", "eps", "n_key_value_heads", "attn_only", "gated_mlp",
                 "attention_dir", "initializer_range", "attn_scores_soft_cap", "output_logits_soft_cap", "default_prepend_bos",
                 "use_attn_result", "use_split_qkv_input", "use_hook_mlp_in", "use_attn_in", "model_name")
INIT_MODES: dict[str, Callable] = {  # each takes (tensor, generator, gain); TL 4's four besides "gpt2"
    "xavier_uniform": lambda t, g, gain: nn.init.xavier_uniform_(t, gain=gain, generator=g),
    "xavier_normal": lambda t, g, gain: nn.init.xavier_normal_(t, gain=gain, generator=g),
    "kaiming_uniform": lambda t, g, gain: nn.init.kaiming_uniform_(t, nonlinearity="relu", generator=g).mul_(gain),
    "kaiming_normal": lambda t, g, gain: nn.init.kaiming_normal_(t, nonlinearity="relu", generator=g).mul_(gain),
}


def native_settings(config: Any) -> dict:
    """The keywords of a TransformerBridgeConfig (transformer-lens's own object, or a dict of its fields)."""
    fields = dict(config) if isinstance(config, dict) else vars(config)
    positions = (fields.get("positional_embedding_type") or "standard").lower()
    if positions not in ("standard", "rotary"):
        raise ValueError(f"boot_native(positional_embedding_type={positions!r}) is not supported: TL 4's native model "
                         "has 'standard' (learned) or 'rotary' positions")
    if positions == "rotary" and fields.get("rope_scaling"):
        raise ValueError(f"boot_native with rope_scaling={fields['rope_scaling']!r} is not supported here: build the "
                         "model with HookedTransformerConfig (rotary_scaling_factor, use_NTK_by_parts_rope)")
    init_mode = fields.get("init_mode") or "gpt2"
    if init_mode.lower() != "gpt2" and init_mode.lower() not in INIT_MODES:
        raise ValueError(f"boot_native(init_mode={init_mode!r}): TL 4's native model takes 'gpt2' or "
                         f"{sorted(INIT_MODES)}")
    return fields


def native_config(fields: dict):
    """probe's DecoderConfig for TL 4's native model of these fields."""
    settings = {name: fields[name] for name in NATIVE_FIELDS if fields.get(name) is not None}
    if settings.get("act_fn") == "swish":
        settings["act_fn"] = "silu"
    d_head = fields["d_head"]
    scale = fields.get("attn_scale", -1.0)
    # TL 4's native attention divides by attn_scale when it is given and positive, else by sqrt(d_head)
    settings["attn_scale"] = scale if fields.get("use_attn_scale", True) and scale > 0 else math.sqrt(d_head)
    if (fields.get("positional_embedding_type") or "standard").lower() == "rotary":
        # TL 4's native rotary pairs dimension 2i with 2i + 1, over rotary_dim (else d_head), by rotary_base
        settings.update(positional_embedding_type="rotary", rotary_adjacent_pairs=True,
                        rotary_dim=fields.get("rotary_dim") or d_head, rotary_base=fields.get("rotary_base", 10000))
    cfg = HookedTransformerConfig(**settings)
    return dataclasses.replace(cfg, unembed_bias=False, mlp_bias=not fields.get("gated_mlp"), tied_embeddings=False,
                               transformer_lens_init=False)  # drawn by draw_like_native, not HookedTransformer's scheme


def native_draws(model: nn.Module) -> list[tuple[torch.Tensor, Optional[torch.Tensor], str]]:
    """(weight, bias, role) for each matrix of TL 4's native model in the order it builds and draws them: `weight`
    and `bias` are the probe tensors they fill (rows of the fused qkv for W_Q, W_K, W_V; bias None where TL's module
    has none), `role` "embedding", "matrix" or "output" (a write into the residual stream, drawn smaller)."""
    draws = [(model.embed.W_E, None, "embedding")]
    if isinstance(getattr(model.pos_embed, "W_pos", None), nn.Parameter):
        draws.append((model.pos_embed.W_pos, None, "embedding"))
    for block in model.blocks:
        attn, start = block.attn, 0
        for size in attn.qkv_sizes:  # W_Q, W_K, W_V
            draws.append((attn.qkv.weight[start:start + size], attn.qkv.bias[start:start + size], "matrix"))
            start += size
        draws.append((attn.out.weight, attn.out.bias, "output"))
        mlp = getattr(block, "mlp", None)
        if mlp is not None:
            draws += [(layer.weight, layer.bias, "matrix") for layer in ([mlp.gate] if hasattr(mlp, "gate") else [])]
            draws += [(mlp.fc_in.weight, mlp.fc_in.bias, "matrix"), (mlp.fc_out.weight, mlp.fc_out.bias, "output")]
    draws.append((model.unembed.weight, None, "matrix"))
    return draws


@torch.no_grad()
def draw_like_native(model: nn.Module, fields: dict) -> None:
    """Fill `model` with TL 4's native initial weights for these fields (see the module docstring)."""
    draws = native_draws(model)
    for name, tensor in model.named_parameters():  # norms start at w = 1, b = 0 and every bias at 0
        if name.endswith((".w", ".b", "bias")):
            tensor.fill_(1.0 if name.endswith(".w") else 0.0)
    seed, init_weights = fields.get("seed"), fields.get("init_weights", True)
    if seed is None or not init_weights:
        # TL builds its modules from torch's global stream (nn.Embedding, nn.Linear, in build order) and, told not to
        # initialise, keeps what that drew
        for weight, bias, role in draws:
            built = nn.Embedding(*weight.shape) if role == "embedding" else \
                nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
            if not init_weights:
                weight.copy_(built.weight)
                if bias is not None:
                    bias.copy_(built.bias)
        if not init_weights:
            return
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    mode = (fields.get("init_mode") or "gpt2").lower()
    std, n_layers = model.cfg.init_std, model.cfg.n_layers  # init_std: initializer_range, or 0.8 / sqrt(d_model)
    given = fields.get("initializer_range", -1.0)
    for weight, _, role in draws:
        staging = torch.empty(weight.shape, dtype=torch.float32)  # drawn on the CPU in float32, as TL does
        if mode == "gpt2":
            staging.normal_(0.0, std / math.sqrt(2 * n_layers) if role == "output" else std, generator=generator)
        else:
            INIT_MODES[mode](staging, generator, given if given > 0 else 1.0)
        weight.copy_(staging)
