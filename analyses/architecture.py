"""What an analysis may assume of a model's blocks and positions, and the refusals of analyses that need what a
model lacks: an attention-only model (`attn_only`, toy models) has no MLPs, so no hook_resid_mid, hook_mlp_in,
hook_mlp_out, ln2 or mlp.* points; a shortformer model's positions join every layer's queries and keys, never the
residual stream, so its hook_pos_embed is not a write to the residual; a bidirectional model's queries see every key,
later ones too, so its output at a position is no prediction of the next token (a next-token loss measures nothing
it does) and it cannot generate. Each refusal names the problem and what to do instead, before any work, where the
model would otherwise fail deep inside with a missing attribute or name, or give a number that means nothing. A hybrid
model's linear-attention layers (Qwen3.5) have no heads, so analyses of every layer's heads refuse it; latent
attention's heads (DeepSeek) have no W_Q, W_K or W_V, so analyses of those weights refuse it."""
from __future__ import annotations

import re

from probe import HookedDecoder, Positions
from probe.prediction_head import refuse_prediction_head as refuse_head_of

# the points of a block from the residual between its sublayers to the MLP's output: what an attention-only block lacks
MLP_POINT = re.compile(r"^blocks\.\d+\.(hook_resid_mid|hook_mlp_in|hook_mlp_out|ln2\.|ln2_post\.|mlp\.)")


def require_mlps(model: HookedDecoder, what: str, so: str, instead: str) -> None:
    """Refuse `what` on an attention-only model: "{what}: this attention-only model has no MLPs, so {so}; {instead}"."""
    if model.cfg.attn_only:
        raise ValueError(f"{what}: this attention-only model has no MLPs, so {so}; {instead}")
    if model.cfg.rwkv is not None:  # (blocks.L.channel_mix: sigmoid(r) * W_out post, r from the shifted input)
        raise ValueError(f"{what}: this model's MLPs are RWKV channel mixes, which gate each value vector's write "
                         f"channel by channel by a receptance of the shifted input, so {so}; {instead}")


def check_block_point(model: HookedDecoder, name: str, what: str, instead: str) -> None:
    """Refuse a hook name of a point an attention-only block lacks (resid_mid, the MLP's points), with the reason,
    rather than the bare unknown-name error the model would give at the first forward."""
    if model.cfg.attn_only and MLP_POINT.match(str(name)):
        raise ValueError(f"{what} {name!r}: this attention-only model has no MLPs, so its blocks have no resid_mid, "
                         f"mlp_in, mlp_out, ln2 or mlp.* points; {instead}")


def require_attention_heads(model: HookedDecoder, what: str) -> None:
    """Refuse `what`, which reads every layer's attention heads, on a hybrid model whose recurrent layers have none
    (Qwen3.5's Gated DeltaNet layers, Granite 4.0-H's Mamba-2 ones), naming the layer-level analyses that work."""
    linear, kind = headless_layers(model)
    if linear:
        raise ValueError(f"{what}: layers {linear} of this hybrid model are {kind} layers, "
                         f"with no attention heads, and {what} reads every layer's heads; analyses by layer work on it "
                         f"(logit_lens, patch(..., sites='resid_pre' / 'attn_out' / 'mlp_out'), the cache's "
                         f"decompose_resid), and its attention layers' heads are model.blocks[l].attn")


def headless_layers(model: HookedDecoder) -> tuple[list[int], str]:
    """(the layers without attention heads, what they are in messages): a hybrid's recurrent layers, and NemotronH's
    layers of an MLP alone."""
    cfg = model.cfg
    layers = [layer for layer in range(cfg.n_layers) if not cfg.layer_has_attention(layer)]
    kinds = [f"state-space ({cfg.state_space.label})" if cfg.state_space is not None else cfg.recurrent_kind] * any(
        map(cfg.layer_is_linear, layers)) + ["MLP-only"] * any(not cfg.layer_has_mixer(layer) for layer in layers)
    return layers, " or ".join(kinds)


def require_head_weights(model: HookedDecoder, what: str) -> None:
    """Refuse `what`, which reads each head's W_Q, W_K and W_V (linear maps of the residual), on latent attention,
    whose queries, keys and values pass normalised low-rank latents (DeepSeek-V2/V3), and on a mixture of attention
    heads (JetMoE), whose heads' query and output weights are those of the experts each token chose, naming what
    works instead."""
    if model.cfg.mixture_of_attention is not None:
        raise ValueError(f"{what}: this model's mixture of attention heads (JetMoE) routes each token to experts of "
                         f"its own, so a head's W_Q and W_O change with the token (blocks.L.attn.hook_expert_indices), "
                         f"and there are no fixed per-head weights for {what} to read; the analyses of the heads' "
                         f"activations work on it (attention_patterns, head_scores, ablate_heads, patch(..., "
                         f"sites='heads'), direct_logit_attribution through hook_result), and the experts' own "
                         f"weights are model.blocks[l].attn.q_experts / out_experts")
    if model.cfg.latent_attention is not None:
        sparse = (", and a sparse indexer (GLM-5's) chooses the keys each query reads"
                  if model.cfg.latent_attention.indexer is not None else "")
        raise ValueError(f"{what}: this model's latent attention reads queries, keys and values through normalised "
                         f"low-rank latents{sparse}, so its heads have no W_Q, W_K or W_V (linear maps of the "
                         f"residual) for {what} to read; the analyses of the heads' activations work on it (attention_patterns, "
                         f"head_scores, ablate_heads, patch(..., sites='heads'), direct_logit_attribution), and its "
                         f"W_O is model.blocks[l].attn.W_O")


def require_own_keys_and_one_width(model: HookedDecoder, what: str, one_width: bool = False) -> None:
    """Refuse `what`, which reads every head's own W_K and W_V (and, `one_width`, stacks every head's weights), on
    Gemma 4 models whose last layers reuse earlier layers' keys and values (or whose full-attention heads are wider
    than the windowed ones), naming what works."""
    cfg = model.cfg
    shared = [] if cfg.shared_kv is None else [l for l in range(cfg.n_layers) if cfg.layer_kv_source(l) is not None]
    widths = sorted({cfg.layer_d_head(l) for l in range(cfg.n_layers)})
    if shared or (one_width and len(widths) > 1):
        why = (f"layers {shared} compute no keys or values (they attend over earlier layers')" if shared else
               f"its heads differ in width between layers ({widths})")
        raise ValueError(f"{what}: {why}, and {what} reads every head's own weights" + (" side by side" if one_width
                         else "") + "; one head's QK and OV circuits (qk_circuit, ov_circuit) work on the layers that "
                         "have them, and the analyses of the heads' activations on every layer (attention_patterns, "
                         "head_scores, ablate_heads, patch(..., sites='heads'), direct_logit_attribution)")


def refuse_shared_keys_and_scaled_layers(model: HookedDecoder, what: str) -> None:
    """Refuse `what`, whose graph takes each head's key and value inputs for its own layer's residual and the residual
    for the sum of its writers' outputs, on Gemma 4: later layers attend over earlier layers' keys and values, the
    values are normalised per head, and every block scales the whole residual."""
    cfg = model.cfg
    if cfg.shared_kv is not None or cfg.value_norm or cfg.layer_scalars:
        raise ValueError(f"{what}: this model (Gemma 4) normalises each head's values, scales the whole residual "
                         f"after every block (layer_scalar)" + (" and lets its last layers attend over earlier "
                         "layers' keys and values" if cfg.shared_kv is not None else "") + f", which {what}'s graph "
                         f"of linear edges does not hold; analyses by head and by layer work on it "
                         f"(direct_logit_attribution, residual_decomposition, ablate_heads, head_scores, "
                         f"patch(..., sites='heads' / 'attn_out' / 'mlp_out'))")


def refuse_mixers_beside_heads(model: HookedDecoder, what: str) -> None:
    """Refuse `what`, which takes the residual stream for the sum of its heads', MLPs' and embeddings' writes, on a
    model whose layers also write a Mamba-2 mixer's output beside their heads (Falcon-H1's parallel hybrid)."""
    layers = [layer for layer in range(model.cfg.n_layers) if model.cfg.layer_has_parallel_mixer(layer)]
    if layers:
        raise ValueError(f"{what}: layers {layers} of this model (Falcon-H1's parallel hybrid) also write a Mamba-2 "
                         f"mixer's output (blocks.L.hook_mixer_out) beside their heads, which is no node of {what}'s "
                         f"graph, so the residual stream is not the sum of its writers; analyses by head and by layer "
                         f"work on it (direct_logit_attribution and residual_decomposition name each mixer's write "
                         f"`L{{l}} mamba`; ablate_heads, head_scores, patch(..., sites='heads' / 'attn_out'))")


def refuse_shared_blocks(model: HookedDecoder, what: str) -> None:
    """Refuse `what`, which takes the residual stream for the sum of its heads', MLPs' and mixers' writes, on a model
    whose hybrid layers' shared blocks (Zamba2's) write into their mixer's input, not into the residual stream."""
    spec = model.cfg.shared_blocks
    if spec is not None:
        raise ValueError(f"{what}: layers {spec.hybrid_layers} of this model (Zamba2) run a shared transformer block "
                         f"whose heads and MLP write into the layer's Mamba-2 mixer's input (blocks.L.hook_mixer_in), "
                         f"not into the residual stream, whose only writes are the mixers' (blocks.L.hook_mixer_out, "
                         f"hook_attn_out in the Mamba-2 layers); analyses by layer work on it (logit_lens, patch(..., "
                         f"sites='resid_pre'), attention_patterns of the hybrid layers' heads)")


def refuse_shortformer(model: HookedDecoder, what: str, why: str, instead: str) -> None:
    """Refuse `what` on a model whose positions are not in the residual stream (shortformer)."""
    if model.cfg.positions is Positions.SHORTFORMER:
        raise ValueError(f"{what}: this model's shortformer positions are added to every layer's queries and keys, not "
                         f"to the residual stream, so {why}; {instead}")


def refuse_bidirectional(model: HookedDecoder, what: str, why: str, instead: str) -> None:
    """Refuse `what` on a bidirectional model: "{what}: this model's attention is bidirectional, so {why}; {instead}"."""
    if model.cfg.bidirectional:
        raise ValueError(f"{what}: this model's attention is bidirectional, so {why}; {instead}")


def refuse_next_token_metric(model: HookedDecoder, metric, what: str) -> None:
    """Refuse a next-token metric (one marked `metric.next_token = True`: loss_metric, loglik_metric, the pruning
    loss) on a bidirectional model, whose every position already sees the token the metric asks it to predict."""
    if getattr(metric, "next_token", False):
        name = getattr(metric, "label", None) or getattr(metric, "__name__", "metric")
        refuse_bidirectional(model, f"{what} with the next-token {name} metric",
                             "every position already sees the token after it and a next-token loss measures nothing "
                             "the model computes",
                             "pass a metric of what it outputs, e.g. logit_diff_metric(model, answer, wrong, "
                             "position=0) for a classifier read at its first position")


def refuse_prediction_head(model: HookedDecoder, what: str) -> None:
    """Refuse `what`, which reads the logits as W_U times the final norm's output (direct logit attribution, token
    directions, v W_U), on a model with a prediction head between the two (ModernBERT's decoders)."""
    refuse_head_of(model.cfg, what)
