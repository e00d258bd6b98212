"""Which of transformer-lens's weight-processing steps a model can take without changing what it computes
(probe.processing applies them)."""
from __future__ import annotations

from probe.config import DecoderConfig, Norm, NormPlacement, Positions


def can_fold_ln(cfg: DecoderConfig) -> bool:
    """Folding needs each norm to feed layers (pre-norm, parallel or sandwich blocks; a sandwich block's write
    norms stay as they are): in a post-norm model the norm's output is the residual stream itself. Shortformer
    positions join ln1's output before W_Q and W_K, so ln1's weight cannot move into them."""
    return (cfg.norm is not Norm.NONE and cfg.positions is not Positions.SHORTFORMER
            and cfg.norm_placement in (NormPlacement.PRE, NormPlacement.PARALLEL, NormPlacement.SANDWICH)
            # (a recurrent layer's projections have no biases to take a LayerNorm's b)
            and not ((cfg.linear_attention is not None or cfg.state_space is not None or cfg.short_conv is not None)
                     and cfg.norm is Norm.LAYER)
            # Zamba2's shared blocks: their norms' weights are shared by layers and read beside per-layer adapters
            and cfg.shared_blocks is None
            and cfg.rwkv is None  # (an RWKV token shift reads zeros before the first position, not a norm's bias)
            and cfg.prediction_head is None)  # (ModernBERT's final norm feeds its head's dense layer, not W_U)


def can_center_writing_weights(cfg: DecoderConfig) -> bool:
    """Centring the writers needs every reader of the residual stream to be a LayerNorm (which subtracts the mean)."""
    return (cfg.norm is Norm.LAYER and cfg.final_norm and cfg.norm_placement in (NormPlacement.PRE, NormPlacement.PARALLEL)
            and cfg.first_ln1)  # (ModernBERT's layer 0 reads the residual without a norm)


def can_center_unembed(cfg: DecoderConfig) -> bool:
    """Shifting each position's logits passes through to the probabilities unless a soft cap bends them (Gemma 2)."""
    return cfg.logit_softcap is None


def can_fold_value_biases(cfg: DecoderConfig) -> bool:
    """A head passes its value bias through unchanged only where its pattern's rows sum to 1 and the values are
    linear in it and reaches W_O unchanged: an attention sink (GPT-OSS) takes a share of each row, different at every
    position, Gemma 4 normalises each value after its bias (value_norm), and an output gate (AFMoE, Qwen3.5)
    multiplies z, the bias's share too, by a gate that changes with the position."""
    return not cfg.attn_sinks and not cfg.value_norm and not cfg.attn_output_gate and not cfg.sub_norms  # (BitNet's z norm)


def can_refactor_factored_attn_matrices(cfg: DecoderConfig) -> bool:
    """Rotary positions rotate q and k between W_Q and the scores, and a key/value head shared by several query
    heads cannot be balanced against each of them at once; the value biases must fold first."""
    return (cfg.positions is not Positions.ROTARY and cfg.n_kv_heads == cfg.n_heads and can_fold_value_biases(cfg)
            and cfg.linear_attention is None)
