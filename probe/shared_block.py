"""Zamba2's hybrid layers (Zyphra 2024, "Zamba2"): a transformer block whose weights several layers share, then the
layer's own Mamba-2 mixer (probe.state_space).

In a hybrid layer, with x the residual and e the original token embeddings:

    t = mlp(ln2(attn(ln_shared([x; e]))))           (no residual inside the shared block)
    y = x + mixer(ln1(x + linear(t)))               (linear: the layer's own d_model -> d_model projection)

so the shared block writes into the mixer's input, never into the residual stream itself. Its attention reads the
2 d_model wide concatenation, its n_heads heads 2 d_model / n_heads wide, scores scaled by (d_head / 2)^-0.5; W_O
writes d_model. Each invocation adds its own low-rank adapters (LowRank) to the MLP's gate and up projections and,
where the config says, to q, k and v: so a layer's W_Q, W_K, W_V, W_gate and W_in views are the shared weight plus
that layer's adapter (read-only where an adapter exists). The shared weights are one Parameter held by every layer
that runs the block (share_block_weights), so they count once and an edit reaches every invocation; the hook points
are each layer's own."""
from __future__ import annotations

import dataclasses

import torch
from einops import rearrange
from torch import nn

from probe.attention import Attention
from probe.config import DecoderConfig
from probe.hooks import HookPoint
from probe.mlp import GatedMLP
from probe.norm import make_norm
from probe.state_space import Mamba2Mixer

# the per-head input points and switches of an attention block (probe.blocks.PreNormBlock), which this block lacks
PER_HEAD_INPUTS = ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input", "split_qkv_input", "attention_input")
# each shared block's parameters, as one hybrid layer's block holds them: the same Parameter in every layer running it
SHARED_PARAMETERS = ("ln_shared.w", "attn.qkv.weight", "attn.out.weight", "ln2.w", "mlp.gate.weight",
                     "mlp.fc_in.weight", "mlp.fc_out.weight")


class LowRank(nn.Module):
    """x -> up(down(x)), rank `rank`: one invocation's adapter (transformers' nn.Sequential of two bias-free Linears)."""

    def __init__(self, d_in: int, rank: int, d_out: int):
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))

    @property
    def product(self) -> torch.Tensor:  # [d_out d_in], as an nn.Linear's weight
        return self.up.weight @ self.down.weight


def adapted_view(part: int, inherited: property) -> property:
    """W_Q / W_K / W_V: the shared projection plus this invocation's adapter, [head d_model d_head] (2 d_model in),
    read-only where there is an adapter (a sum has no parameter to write into); the inherited view otherwise."""
    def read(attn):
        if attn.adapters is None:
            return inherited.fget(attn)
        weight = attn.qkv.weight.split(attn.qkv_sizes)[part] + attn.adapters[part].product
        return rearrange(weight, "(head d_head) d_model -> head d_model d_head", d_head=attn.d_head)

    def write(attn, value):
        if attn.adapters is not None:
            raise AttributeError("this layer's q/k/v weights are a shared projection plus its own low-rank adapter: "
                                 "assign to attn.qkv.weight (shared by every layer running the block) or to "
                                 "attn.adapters[i].up / .down instead")
        inherited.fset(attn, value)
    return property(read, write, doc=inherited.__doc__)


class AdaptedAttention(Attention):
    """The shared block's attention: q, k, v from the normed [residual; embeddings], each plus the invocation's adapter
    (`adapters`: q's, k's, v's, or None); W_O back to d_model. No per-projection input points (the bridge has no
    attention names for this model, and an adapter reads the same input as its projection)."""

    def __init__(self, cfg: DecoderConfig, layer: int):
        wide = dataclasses.replace(cfg, d_model=2 * cfg.d_model, shared_blocks=None)
        super().__init__(wide, layer)
        del self.q, self.k, self.v
        self.out = nn.Linear(self.n_heads * self.d_head, cfg.d_model, bias=False)
        spec = cfg.shared_blocks
        self.adapters = None if not spec.attention_adapters else nn.ModuleList(
            LowRank(2 * cfg.d_model, spec.adapter_rank, size) for size in self.qkv_sizes)

    def project(self, x):
        q, k, v = super().project(x)
        if self.adapters is None:
            return q, k, v
        return tuple(t + rearrange(adapter(x), "batch pos (head d_head) -> batch pos head d_head", d_head=self.d_head)
                     for t, adapter in zip((q, k, v), self.adapters))

    def projection_inputs(self) -> tuple:
        return ()

    W_Q = adapted_view(0, Attention.W_Q)
    W_K = adapted_view(1, Attention.W_K)
    W_V = adapted_view(2, Attention.W_V)


class AdaptedMLP(GatedMLP):
    """act(gate(x) + a_gate(x)) * (up(x) + a_up(x)) -> down: the shared gated MLP plus the invocation's adapter, whose
    output's first d_mlp channels join the gate's pre-activation and the rest the up projection's (transformers'
    gate_up_proj_adapter). W_gate and W_in are the sums (read-only)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__(cfg)
        self.adapter = LowRank(cfg.d_model, cfg.shared_blocks.adapter_rank, 2 * cfg.d_mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_extra, up_extra = self.adapter(x).chunk(2, dim=-1)
        pre = self.hook_pre(self.gate(x) + gate_extra)
        pre_linear = self.hook_pre_linear(self.fc_in(x) + up_extra)
        return self.fc_out(self.hook_post(self.act_fn(pre) * pre_linear))

    @property
    def W_gate(self) -> torch.Tensor:  # [d_model d_mlp]
        return (self.gate.weight + self.adapter.product.chunk(2)[0]).T

    @property
    def W_in(self) -> torch.Tensor:  # [d_model d_mlp]
        return (self.fc_in.weight + self.adapter.product.chunk(2)[1]).T


class SharedBlockLayer(nn.Module):
    """A hybrid layer (module docstring): the shared block's attention and MLP under the usual names (attn, mlp,
    hook_attn_out, hook_mlp_out), the mixer under the bridge's (`mixer`), its write hook_mixer_out. `allowed` is the
    pair (the keys each query sees, the new positions' padding mask [batch pos]); `embeds` [batch pos d_model] the
    original embeddings the model hands every block."""

    mixer_name = "mixer"

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__()
        self.layer = layer
        self.ln_shared = make_norm(cfg, 2 * cfg.d_model)  # the shared block's input_layernorm, over [x; e]
        self.attn = AdaptedAttention(cfg, layer)
        self.ln2 = make_norm(cfg)  # pre_ff_layernorm: over the attention's output
        self.mlp = AdaptedMLP(cfg)
        self.linear = nn.Linear(cfg.d_model, cfg.d_model, bias=False)  # the layer's own, unshared
        self.ln1 = make_norm(cfg, foldable=True, ends=True)  # the mixer's norm (mamba_decoder.input_layernorm)
        self.mixer = Mamba2Mixer(cfg)
        self.hook_resid_pre = HookPoint()  # [batch pos d_model]
        self.hook_shared_in = HookPoint()  # [batch pos 2*d_model]: [residual; embeddings], what ln_shared reads
        self.hook_attn_out = HookPoint()  # [batch pos d_model]: the shared attention's output (not a residual write)
        self.hook_mlp_out = HookPoint()  # [batch pos d_model]: the shared MLP's output
        self.hook_shared_out = HookPoint()  # [batch pos d_model]: linear(mlp_out), added to the mixer's input
        self.hook_mixer_in = HookPoint()  # [batch pos d_model]: residual + shared_out, what ln1 normalises
        self.hook_mixer_out = HookPoint()  # [batch pos d_model]: the mixer's write, the layer's only one
        self.hook_resid_post = HookPoint()  # [batch pos d_model]

    def __getattr__(self, name: str):
        if name in PER_HEAD_INPUTS:  # what the per-head input switches reach for: say why this block has none
            raise AttributeError(f"layer {self.layer}'s shared attention reads the normed [residual; embeddings], "
                                 f"2 d_model wide, not the residual, so it has no per-head copies of its input ({name}); "
                                 f"hook blocks.{self.layer}.hook_shared_in (what its norm reads) instead")
        return super().__getattr__(name)

    def forward(self, resid_pre, positions=None, allowed=(None, None), past=None, embeds=None):
        if embeds is None:
            raise ValueError(f"layer {self.layer} runs a shared block that reads the original token embeddings beside "
                             "the residual: a run from a residual (start_at_layer) needs tokens=..., or call the "
                             "model from tokens")
        keys, real = allowed
        resid_pre = self.hook_resid_pre(resid_pre)
        wide = self.hook_shared_in(torch.cat([resid_pre, embeds], dim=-1))
        attn_out = self.hook_attn_out(self.attn(self.ln_shared(wide), positions, keys, past))
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(attn_out)))
        mixer_in = self.hook_mixer_in(resid_pre + self.hook_shared_out(self.linear(mlp_out)))
        mixer_out = self.hook_mixer_out(self.mixer(self.ln1(mixer_in), real, past))
        return self.hook_resid_post(resid_pre + mixer_out)


def share_block_weights(cfg: DecoderConfig, blocks: nn.ModuleList) -> None:
    """Every hybrid layer's shared parameters made the very Parameters of the first layer running the same block."""
    spec = cfg.shared_blocks
    if spec is None:
        return
    for layer in spec.hybrid_layers:
        source = blocks[spec.first_layer(spec.block_of(layer))]
        if source is blocks[layer]:
            continue
        for name in SHARED_PARAMETERS:
            path, attr = name.rsplit(".", 1)
            setattr(blocks[layer].get_submodule(path), attr, source.get_parameter(name))
