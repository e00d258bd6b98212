"""Gemma 4's blocks: Gemma 2's sandwich with its output times a learned scalar (layer_scalar), and, in the models
with per-layer embeddings (E2B, E4B), each token's small embedding for this layer gated by the residual and added to
it. The model computes every layer's per-layer input once (PerLayerEmbed) and hands it to every block."""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from probe.blocks import SandwichBlock
from probe.config import DecoderConfig
from probe.experts_beside import ExpertsBeside
from probe.hooks import HookPoint
from probe.mlp import ACTIVATIONS
from probe.norm import make_norm


class PerLayerEmbed(nn.Module):
    """Every layer's input [batch pos layer d] from the token ids and their scaled embedding: a table lookup (times
    sqrt(d)) plus a projection of the embedding (times d_model^-0.5, normalised over d), the sum times 2^-0.5."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        spec = cfg.per_layer_inputs
        self.n_layers, self.d, self.d_model = cfg.n_layers, spec.d, cfg.d_model
        # a table shorter than the vocabulary needs the ids checked (a sync on a GPU); the released ones are not
        self.shorter = spec.d_vocab < cfg.d_vocab
        self.W_E = nn.Parameter(torch.empty(spec.d_vocab, cfg.n_layers * spec.d))  # embed_tokens_per_layer
        self.projection = nn.Linear(cfg.d_model, cfg.n_layers * spec.d, bias=False)  # per_layer_model_projection
        self.ln = make_norm(cfg, spec.d)  # per_layer_projection_norm
        self.hook_out = HookPoint()  # [batch pos layer d]

    def forward(self, tokens: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        if self.shorter and tokens.max() >= self.W_E.shape[0]:
            raise ValueError(f"token id {int(tokens.max())} has no per-layer embedding: the table has "
                             f"{self.W_E.shape[0]} rows (per_layer_inputs.d_vocab)")
        # scaled as Gemma scales its embeddings: sqrt(d) rounded to the table's dtype
        table = F.embedding(tokens, self.W_E) * torch.tensor(math.sqrt(self.d), dtype=self.W_E.dtype)
        projected = self.projection(embedded) * self.d_model**-0.5
        projected = self.ln(projected.unflatten(-1, (self.n_layers, self.d)))
        return self.hook_out((projected + table.unflatten(-1, (self.n_layers, self.d))) * 2**-0.5)


class PerLayerInput(nn.Module):
    """One layer's use of its per-layer input: act(resid W_gate) times the input [batch pos d], projected back to
    d_model and normalised; the block adds it to the residual. Named as the bridge names its modules' points."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        d = cfg.per_layer_inputs.d
        self.gate = nn.Linear(cfg.d_model, d, bias=False)  # per_layer_input_gate
        self.act = ACTIVATIONS[cfg.activation]()
        self.projection = nn.Linear(d, cfg.d_model, bias=False)  # per_layer_projection
        self.ln = make_norm(cfg, ends=True)  # post_per_layer_input_norm
        self.hook_in = HookPoint()  # [batch pos d_model]: the residual the gate reads (the block's, after the MLP)
        self.hook_gate = HookPoint()  # [batch pos d]: resid W_gate, before the activation
        self.hook_gated = HookPoint()  # [batch pos d]: act(gate) times the per-layer input, what is projected

    def forward(self, resid: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        gated = self.hook_gated(self.act(self.hook_gate(self.gate(self.hook_in(resid)))) * per_layer_input)
        return self.ln(self.projection(gated))


class ScaledSandwichBlock(SandwichBlock):
    """h = x + ln1_post(attn(ln1(x))); y = s * (h + ln2_post(mlp(ln2(h)))), s the layer's learned scalar
    (`layer_scalar`, a buffer as in transformers: no gradient, not a parameter). The scalar multiplies the whole
    residual, so hook_resid_post is s times the sum of what came in and what the block wrote."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        # the dense MLP: wider in the layers that reuse keys and values (Gemma 4's double-wide), and beside any experts
        # rather than in their place (ExpertsBesideBlock adds them)
        super().__init__(dataclasses.replace(cfg, d_mlp=cfg.layer_d_mlp(layer), experts=None), layer)
        self.layer = layer
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, resid_pre, positions=None, allowed=None, past=None, per_layer=None):
        resid_pre = self.hook_resid_pre(resid_pre)
        attn_out = self.hook_attn_out(self.ln1_post(self.attn(self.attention_input(resid_pre, self.ln1), positions, allowed, past)))
        resid_mid = self.hook_resid_mid(resid_pre + attn_out)
        mlp_out = self.hook_mlp_out(self.ln2_post(self.mlp_write(self.hook_mlp_in(resid_mid))))
        resid = self.add_per_layer_input(resid_mid + mlp_out, per_layer)
        return self.hook_resid_post(resid * self.layer_scalar)

    def mlp_write(self, resid: torch.Tensor) -> torch.Tensor:
        """What ln2_post normalises into the MLP's write: the MLP of ln2's output."""
        return self.mlp(self.ln2(resid))

    def add_per_layer_input(self, resid: torch.Tensor, per_layer) -> torch.Tensor:
        return resid


class PerLayerInputBlock(ScaledSandwichBlock):
    """ScaledSandwichBlock with the layer's per-layer input added before the scalar: y = s * (h' + p), h' the
    residual after the MLP and p = per_layer(h', the layer's slice of PerLayerEmbed's output), hooked as
    hook_per_layer_out [batch pos d_model]."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__(cfg, layer)
        self.per_layer = PerLayerInput(cfg)
        self.hook_per_layer_out = HookPoint()  # [batch pos d_model]: what the per-layer input adds to the residual

    def add_per_layer_input(self, resid: torch.Tensor, per_layer) -> torch.Tensor:
        if per_layer is None:
            raise ValueError("this model adds a per-layer embedding of each token in every layer, computed from the "
                             "token ids: a run from a residual (start_at_layer) needs them, tokens=..., or call the "
                             "model from tokens")
        return resid + self.hook_per_layer_out(self.per_layer(resid, per_layer[:, :, self.layer]))


class ExpertsBesideBlock(ScaledSandwichBlock):
    """ScaledSandwichBlock whose MLP write is the dense MLP's and the experts' (ExpertsBeside), each normalised apart
    (Gemma 4 26B-A4B): ln2_post(post_feedforward_layernorm_1(mlp(ln2(h))) + post_feedforward_layernorm_2(experts(
    pre_feedforward_layernorm_2(h), routed by h))). The three norms keep transformers' (and the bridge's) names."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__(cfg, layer)
        self.experts = ExpertsBeside(cfg)
        self.post_feedforward_layernorm_1 = make_norm(cfg, ends=True)
        self.pre_feedforward_layernorm_2 = make_norm(cfg, ends=True)
        self.post_feedforward_layernorm_2 = make_norm(cfg, ends=True)

    def mlp_write(self, resid: torch.Tensor) -> torch.Tensor:
        dense = self.post_feedforward_layernorm_1(self.mlp(self.ln2(resid)))
        routed = self.experts(self.pre_feedforward_layernorm_2(resid), resid)
        return dense + self.post_feedforward_layernorm_2(routed)


class PerLayerInputExpertsBlock(PerLayerInputBlock, ExpertsBesideBlock):
    """Both: experts beside the MLP and a per-layer input (no released Gemma 4 has both; the config allows it)."""


def gemma4_block(cfg: DecoderConfig, layer: int) -> nn.Module:
    """`layer`'s Gemma 4 block: with a per-layer input (E2B, E4B), experts beside the MLP (26B-A4B), both or neither."""
    experts = cfg.layer_sparse(layer)
    if cfg.per_layer_inputs is not None:
        return (PerLayerInputExpertsBlock if experts else PerLayerInputBlock)(cfg, layer)
    return (ExpertsBesideBlock if experts else ScaledSandwichBlock)(cfg, layer)
