"""probe: a hookable decoder-only transformer for mechanistic interpretability."""
from probe.bundled import DEFAULT_MODEL, HELDOUT_TEXT
from probe.config import (Activation, ChunkedAttention, DecoderConfig, ExpertGroups, Experts, GlobalLayers,
                          LatentAttention, LinearAttention, Norm, NormPlacement, PerLayerInputs, Positions, RotaryScaling,
                          SharedBlocks, SharedKV, ShortConv, SparseIndexer, StateSpace)
from probe.config_gate import OutputGate
from probe.config_head import PredictionHead
from probe.config_moa import MixtureOfAttention
from probe.config_rg_lru import RGLRU
from probe.config_rwkv import Rwkv
from probe.factored import FactoredMatrix
from probe.kv_cache import KVCache
from probe.decoder_cache import DecoderCache
from probe.hooks import HookedRootModule, HookPoint
from probe.blocks import AttnOnlyBlock, Block, ParallelBlock, PostNormBlock, PreNormBlock, SandwichBlock
from probe.model import HookedDecoder
from probe.names import act_name
from probe.processing import process_weights
from probe.sae import SAEConfig, SparseAutoencoder, spliced
from probe.sae_training import TrainingConfig, train_sae
from probe.tl_class import HookedSAETransformer, HookedTransformer
from probe.tl_config import HookedTransformerConfig
from probe.tokenizer import Tokenizer

# transformer-lens's names for its key/value cache class (TL 3.9's, and the earlier HookedTransformerKeyValueCache)
TransformerLensKeyValueCache = HookedTransformerKeyValueCache = KVCache
# and for its activation cache: `ActivationCache(cache_dict, model, has_batch_dim=True)`, as TL code builds one
ActivationCache = DecoderCache

__all__ = [
    "DEFAULT_MODEL", "HELDOUT_TEXT", "Activation", "ActivationCache", "AttnOnlyBlock", "Block", "DecoderCache",
    "DecoderConfig", "ExpertGroups", "Experts", "FactoredMatrix", "HookPoint", "HookedDecoder", "HookedRootModule", "HookedSAETransformer",
    "ChunkedAttention", "GlobalLayers", "LatentAttention", "LinearAttention", "PerLayerInputs", "SharedBlocks", "SharedKV", "ShortConv", "RGLRU", "OutputGate", "PredictionHead", "MixtureOfAttention", "Rwkv", "SparseIndexer", "StateSpace", "HookedTransformer", "HookedTransformerConfig", "HookedTransformerKeyValueCache", "KVCache", "Norm", "NormPlacement",
    "ParallelBlock", "Positions", "PostNormBlock", "PreNormBlock", "RotaryScaling", "SAEConfig", "SandwichBlock",
    "SparseAutoencoder", "Tokenizer", "TrainingConfig", "TransformerLensKeyValueCache", "act_name", "process_weights",
    "spliced", "train_sae",
]
