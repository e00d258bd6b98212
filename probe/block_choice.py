"""Which block each layer of a config gets (probe.blocks' classes, and Gemma 4's, probe.per_layer_block's, which build
on them): the model builds its blocks here."""
from __future__ import annotations

from torch import nn

from probe.blocks import (AttnOnlyBlock, LinearAttentionBlock, MLPOnlyBlock, ParallelBlock, ParallelHybridBlock,
                          PostNormBlock, PreNormBlock, SandwichBlock, ShortConvBlock, StateSpaceBlock,
                          StateSpaceOnlyBlock)
from probe.config import DecoderConfig, NormPlacement
from probe.per_layer_block import gemma4_block
from probe.rg_lru import RecurrentBlock
from probe.rwkv import RwkvBlock
from probe.shared_block import SharedBlockLayer, share_block_weights
from probe.sparse_indexer import share_key_choices


def make_blocks(cfg: DecoderConfig) -> nn.ModuleList:
    """Every layer's block (make_block), the layers that read an earlier layer's choice of keys linked to it."""
    blocks = nn.ModuleList([make_block(cfg, layer) for layer in range(cfg.n_layers)])
    share_key_choices(cfg, blocks)
    share_block_weights(cfg, blocks)  # (Zamba2's shared blocks: one Parameter in every layer running one)
    return blocks


def make_block(cfg: DecoderConfig, layer: int) -> nn.Module:
    """`layer`'s block: the config's arrangement of the norms, or a linear-attention block where the config says; a
    one-sublayer layer (cfg.sublayers, NemotronH's) is a block of that sublayer alone."""
    if not cfg.layer_has_mixer(layer):
        return MLPOnlyBlock(cfg, layer)
    alone = not cfg.layer_has_mlp(layer)  # attn_only, or a one-sublayer mixer layer
    if cfg.layer_has_shared_block(layer):  # Zamba2's hybrid layers: a shared block, then the layer's mixer
        return SharedBlockLayer(cfg, layer)
    if cfg.rwkv is not None:
        return RwkvBlock(cfg, layer)
    if cfg.layer_is_state_space(layer):
        return (StateSpaceOnlyBlock if alone else StateSpaceBlock)(cfg, layer)
    if cfg.layer_is_short_conv(layer):
        return ShortConvBlock(cfg, layer)
    if cfg.layer_is_rg_lru(layer):
        return RecurrentBlock(cfg, layer)
    if cfg.layer_is_linear(layer):
        return LinearAttentionBlock(cfg, layer)
    if cfg.layer_has_parallel_mixer(layer):
        return ParallelHybridBlock(cfg, layer)
    if cfg.layer_scalars:  # Gemma 4's
        return gemma4_block(cfg, layer)
    return (AttnOnlyBlock if alone else BLOCKS[cfg.norm_placement])(cfg, layer)  # (attn_only is pre-norm only)


BLOCKS = {NormPlacement.PRE: PreNormBlock, NormPlacement.POST: PostNormBlock, NormPlacement.PARALLEL: ParallelBlock,
          NormPlacement.SANDWICH: SandwichBlock}
