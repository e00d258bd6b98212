"""The shape of every hook point for an input size, known before running (to size caches)."""
from __future__ import annotations

from collections.abc import Collection
from typing import Optional

from probe.config import DecoderConfig, NormPlacement, Positions
from probe.config_gate import output_gate_of
from probe.rwkv_names import rwkv_shapes
from probe.shared_block_names import shared_block_shapes


ID_HOOKS = ("hook_tokens", "embed.hook_in", "pos_embed.hook_in")  # int64 ids, whatever the model's dtype
PER_HEAD_INPUTS = ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input")


def hook_shapes(cfg: DecoderConfig, batch: int, pos: int, key_pos: Optional[int] = None,
                per_head_input_layers: Collection[int] = ()) -> dict[str, tuple[int, ...]]:
    """name -> shape for a pass over `pos` new positions attending to `key_pos` keys (default pos).

    In `per_head_input_layers` (where a per-head input point is hooked) the input norm runs on each head's copy,
    last on the values' inputs, so its hooks hold [batch pos kv_head ...]."""
    key_pos = pos if key_pos is None else key_pos
    resid = (batch, pos, cfg.d_model)
    shapes = {"hook_tokens": (batch, pos)} if cfg.use_hook_tokens else {}
    shapes["embed.hook_in"] = (batch, pos)

    def norm(prefix: str) -> None:
        shapes[f"{prefix}.hook_scale"] = (batch, pos, 1)
        shapes[f"{prefix}.hook_normalized"] = shapes[f"{prefix}.hook_in"] = shapes[f"{prefix}.hook_out"] = resid

    if cfg.embed_norm:
        norm("embed.ln")
    shapes["hook_embed"] = resid
    if cfg.positions not in (Positions.ROTARY, Positions.ALIBI):
        shapes["pos_embed.hook_in"] = (batch, pos)
        shapes["hook_pos_embed"] = resid

    for layer in range(cfg.n_layers):
        b, heads = f"blocks.{layer}", cfg.layer_heads(layer)
        # keys and values are hooked once per query head once transformer-lens's switch ungroups them
        kv = heads if cfg.ungroup_grouped_query_attention else cfg.layer_kv_heads(layer)
        shapes[f"{b}.hook_resid_pre"] = resid
        shapes[f"{b}.hook_attn_in"] = (batch, pos, heads, cfg.d_model)
        shapes[f"{b}.hook_q_input"] = (batch, pos, heads, cfg.d_model)
        shapes[f"{b}.hook_k_input"] = (batch, pos, kv, cfg.d_model)
        shapes[f"{b}.hook_v_input"] = (batch, pos, kv, cfg.d_model)
        norm(f"{b}.ln1")
        for part in "qkv":
            shapes[f"{b}.attn.{part}.hook_in"] = resid
        if layer in per_head_input_layers and cfg.norm_placement is not NormPlacement.POST:
            shapes[f"{b}.ln1.hook_scale"] = (batch, pos, kv, 1)
            for end in ("normalized", "in", "out"):
                shapes[f"{b}.ln1.hook_{end}"] = (batch, pos, kv, cfg.d_model)
        shapes[f"{b}.attn.hook_q"] = (batch, pos, heads, cfg.d_head)
        shapes[f"{b}.attn.hook_k"] = (batch, pos, kv, cfg.d_head)
        shapes[f"{b}.attn.hook_v"] = (batch, pos, kv, cfg.d_head)
        if cfg.attn_output_gate:  # (gated heads, Qwen3.5's and AFMoE's: the gate's logits, per head)
            shapes[f"{b}.attn.hook_q_gate"] = (batch, pos, heads, output_gate_of(cfg).width(cfg.d_head))
        chunked = cfg.chunked_attention  # Llama 4's: a weightless q/k norm on the rotary layers, tuned NoPE queries
        if cfg.qk_norm or (chunked is not None and chunked.qk_norm and cfg.layer_rotates(layer)):
            for which, n in (("q", heads), ("k", kv)):
                # each head's own scale, or (OLMo 2) one over all heads, normalising them flattened
                over = cfg.qk_norm_over_heads
                shapes[f"{b}.attn.{which}_norm.hook_scale"] = (batch, pos, 1) if over else (batch, pos, n, 1)
                shapes[f"{b}.attn.{which}_norm.hook_normalized"] = (batch, pos, n * cfg.d_head) if over else \
                    (batch, pos, n, cfg.d_head)
                shapes[f"{b}.attn.hook_{which}_normed"] = (batch, pos, n, cfg.d_head)
        if chunked is not None and chunked.floor_scale is not None and not cfg.layer_rotates(layer):
            shapes[f"{b}.attn.hook_q_scaled"] = (batch, pos, heads, cfg.d_head)
        if cfg.layer_rotates(layer):
            shapes[f"{b}.attn.hook_rot_q"] = (batch, pos, heads, cfg.d_head)
            shapes[f"{b}.attn.hook_rot_k"] = (batch, pos, kv, cfg.d_head)
        moa = cfg.mixture_of_attention
        if moa is not None:  # (probe.mixture_of_attention's routing, one row per token)
            shapes.update({f"{b}.attn.hook_expert_weights": (batch * pos, moa.n),
                           f"{b}.attn.hook_expert_indices": (batch * pos, moa.per_token)})
        if cfg.latent_attention is not None:
            latent_shapes(cfg.latent_attention, shapes, f"{b}.attn", batch, pos, heads)
            if cfg.latent_attention.indexer is not None:
                indexer_shapes(cfg.latent_attention, layer, shapes, f"{b}.attn", batch, pos, key_pos)
        if cfg.layer_is_state_space(layer) and cfg.state_space.kind == "mamba1":  # probe.selective_scan's points
            space = cfg.state_space
            shapes.update({f"{b}.mixer.hook_in_proj": (batch, pos, 2 * space.d_inner),
                           f"{b}.mixer.hook_x_proj": (batch, pos, space.dt_rank + 2 * space.d_state)})
            shapes.update({f"{b}.mixer.hook_{name}": (batch, pos, space.d_inner)
                           for name in ("conv", "dt", "scan_out", "gated")})
            for norm_name, width in (("dt", space.dt_rank), ("b", space.d_state), ("c", space.d_state)):
                if space.bcdt_norm_weights:  # (Jamba's learned-scale norms, modules with hooked ends)
                    n = f"{b}.mixer.{norm_name}_layernorm"
                    shapes[f"{n}.hook_scale"] = (batch, pos, 1)
                    shapes[f"{n}.hook_in"] = shapes[f"{n}.hook_out"] = shapes[f"{n}.hook_normalized"] = (batch, pos, width)
        elif cfg.layer_is_state_space(layer) or cfg.layer_has_parallel_mixer(layer):  # a Mamba-2 mixer's points
            # (probe.state_space), in place of attention (`mixer`) or beside it (Falcon-H1's `mamba`, its write apart)
            space, m = (cfg.state_space, "mixer") if cfg.layer_is_state_space(layer) else (cfg.parallel_state_space, "mamba")
            inner, channels = space.n_heads * space.d_head, space.n_heads * space.d_head + 2 * space.n_groups * space.d_state
            shapes.update({f"{b}.{m}.hook_in_proj": (batch, pos, inner + channels + space.n_heads),
                           f"{b}.{m}.hook_conv": (batch, pos, channels), f"{b}.{m}.hook_dt": (batch, pos, space.n_heads),
                           f"{b}.{m}.hook_scan_out": (batch, pos, space.n_heads, space.d_head),
                           f"{b}.{m}.hook_inner_norm": (batch, pos, inner)})
            if m == "mamba":
                shapes[f"{b}.hook_mixer_out"] = resid
        if cfg.layer_has_shared_block(layer):  # Zamba2's shared block before the mixer (probe.shared_block)
            shapes.update(shared_block_shapes(cfg, b, batch, pos))
        if cfg.linear_attention is not None and cfg.linear_attention.layers[layer]:  # (probe.linear_attention's)
            shapes.update(deltanet_shapes(cfg, f"{b}.linear_attn", batch, pos))
        if cfg.layer_is_rg_lru(layer):  # Griffin's recurrent block (probe.rg_lru), every point the LRU's width
            width = (batch, pos, cfg.rg_lru.width)
            shapes.update({f"{b}.recurrent.hook_{name}": width for name in ("y", "x", "conv_out", "gated")})
            shapes.update({f"{b}.recurrent.rg_lru.hook_{name}": width
                           for name in ("input_gate", "recurrence_gate", "a", "scan_in", "state")})
        if cfg.rwkv is not None:  # RWKV-4's time and channel mixes (probe.rwkv)
            shapes.update(rwkv_shapes(cfg, b, batch, pos))
        if cfg.layer_is_short_conv(layer):  # LFM2's gated short convolution (probe.short_conv)
            shapes[f"{b}.conv.hook_in_proj"] = (batch, pos, 3 * cfg.d_model)
            shapes.update({f"{b}.conv.hook_{name}": resid for name in ("B", "C", "x", "conv_in", "conv_out", "gated")})
        shapes[f"{b}.attn.hook_attn_scores"] = (batch, heads, pos, key_pos)
        shapes[f"{b}.attn.hook_pattern"] = (batch, heads, pos, key_pos)
        shapes[f"{b}.attn.hook_z"] = (batch, pos, heads, cfg.d_head)
        if cfg.sub_norms:  # (BitNet's norm of every head's z together, before W_O)
            shapes.update({f"{b}.attn.z_norm.hook_scale": (batch, pos, 1), f"{b}.attn.hook_z_normed": shapes[f"{b}.attn.hook_z"],
                           f"{b}.attn.z_norm.hook_normalized": (batch, pos, heads * cfg.d_head)})
        shapes[f"{b}.attn.hook_result"] = (batch, pos, heads, cfg.d_model)
        sandwich = cfg.norm_placement is NormPlacement.SANDWICH  # each write normalised before it is added
        if sandwich:
            norm(f"{b}.ln1_post")
        shapes[f"{b}.hook_attn_out"] = resid
        if cfg.layer_has_mlp(layer):  # (Gemma 4's experts are beside its MLP: gemma4_shapes)
            mlp_shapes(cfg, shapes, b, batch, pos, norm, cfg.layer_sparse(layer) and not cfg.layer_scalars)
        if cfg.layer_scalars:
            gemma4_shapes(cfg, shapes, layer, batch, pos, norm)
        shapes[f"{b}.hook_resid_post"] = resid
    if cfg.final_norm:
        norm("ln_final")
    if cfg.prediction_head is not None:  # (ModernBERT's, before W_U)
        shapes.update({"unembed.head.hook_pre": resid, "unembed.head.hook_post": resid,
                       "unembed.head.ln.hook_scale": (batch, pos, 1), "unembed.head.ln.hook_normalized": resid})
    shapes["unembed.hook_in"] = resid
    shapes["unembed.hook_out"] = (batch, pos, cfg.d_vocab_out)
    return shapes


def gemma4_shapes(cfg: DecoderConfig, shapes: dict, layer: int, batch: int, pos: int, norm) -> None:
    """Gemma 4's layer `layer`: its heads' own width, normed values, no keys or values where it reuses an earlier
    layer's (no value input where its values are its keys), its MLP's own width, its per-layer input, and its
    experts beside the MLP; the model's per-layer embedding."""
    b, a, dh, heads = f"blocks.{layer}", f"blocks.{layer}.attn", cfg.layer_d_head(layer), cfg.layer_heads(layer)
    kv = heads if cfg.ungroup_grouped_query_attention else cfg.layer_kv_heads(layer)
    for name, n in (("hook_q", heads), ("hook_q_normed", heads), ("hook_rot_q", heads), ("hook_z", heads),
                    ("hook_k", kv), ("hook_k_normed", kv), ("hook_rot_k", kv), ("hook_v", kv), ("hook_v_normed", kv),
                    ("q_norm.hook_normalized", heads), ("k_norm.hook_normalized", kv), ("v_norm.hook_normalized", kv)):
        shapes[f"{a}.{name}"] = (batch, pos, n, dh)
    shapes[f"{a}.v_norm.hook_scale"] = (batch, pos, kv, 1)
    if cfg.layer_kv_source(layer) is not None:
        for name in ("hook_k", "hook_k_normed", "hook_rot_k", "hook_v", "hook_v_normed", "k.hook_in", "v.hook_in",
                     "k_norm.hook_scale", "k_norm.hook_normalized", "v_norm.hook_scale", "v_norm.hook_normalized"):
            del shapes[f"{a}.{name}"]
    elif cfg.layer_values_from_keys(layer):
        del shapes[f"{a}.v.hook_in"]
    width = cfg.layer_d_mlp(layer)
    shapes.update({f"{b}.mlp.{name}": (batch, pos, width) for name in ("hook_pre", "hook_pre_linear", "hook_post")})
    if cfg.layer_sparse(layer):
        tokens = batch * pos
        shapes[f"{b}.experts.hook_expert_weights"] = (tokens, cfg.experts.n)
        shapes[f"{b}.experts.hook_expert_indices"] = (tokens, cfg.experts.per_token)
        shapes.update({f"{b}.experts.experts.{e}.{point}": (tokens, cfg.expert_width)
                       for e in range(cfg.experts.n) for point in ("hook_gate", "hook_pre", "hook_post")})
        for name in ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"):
            norm(f"{b}.{name}")
        shapes[f"{b}.experts.router_norm.hook_scale"] = (tokens, 1)
        shapes[f"{b}.experts.router_norm.hook_normalized"] = (tokens, cfg.d_model)
    spec = cfg.per_layer_inputs
    if spec is not None:
        shapes.update({f"{b}.per_layer.hook_in": (batch, pos, cfg.d_model), f"{b}.per_layer.hook_gate": (batch, pos, spec.d),
                       f"{b}.per_layer.hook_gated": (batch, pos, spec.d), f"{b}.hook_per_layer_out": (batch, pos, cfg.d_model)})
        norm(f"{b}.per_layer.ln")
        if layer == 0:
            shapes.update({"per_layer_embed.hook_out": (batch, pos, cfg.n_layers, spec.d),
                           "per_layer_embed.ln.hook_scale": (batch, pos, cfg.n_layers, 1),
                           "per_layer_embed.ln.hook_normalized": (batch, pos, cfg.n_layers, spec.d)})


def mlp_shapes(cfg: DecoderConfig, shapes: dict, b: str, batch: int, pos: int, norm, sparse: bool) -> None:
    """The points of block `b` from resid_mid to mlp_out (an attention-only block has none of them), its MLP a
    mixture of experts where `sparse`."""
    resid = (batch, pos, cfg.d_model)
    if cfg.norm_placement is not NormPlacement.PARALLEL:  # both sublayers read resid_pre: nothing between them
        shapes[f"{b}.hook_resid_mid"] = resid
    shapes[f"{b}.hook_mlp_in"] = resid
    norm(f"{b}.ln2")
    if sparse:
        experts_shapes(cfg, shapes, b, batch * pos)
    else:
        dense_mlp_shapes(cfg, shapes, b, batch, pos)
    if cfg.norm_placement is NormPlacement.SANDWICH:
        norm(f"{b}.ln2_post")
    shapes[f"{b}.hook_mlp_out"] = resid


def experts_shapes(cfg: DecoderConfig, shapes: dict, b: str, tokens: int) -> None:
    """A mixture of experts' points: the routing, a row per token; each expert's, a row per token routed to it, so
    their first size is at most `tokens` (what a cache's size estimate assumes)."""
    shapes[f"{b}.mlp.hook_expert_weights"] = (tokens, cfg.experts.n)
    shapes[f"{b}.mlp.hook_expert_indices"] = (tokens, cfg.experts.per_token)
    for e in range(cfg.experts.n):
        for point in ("hook_gate", "hook_pre", "hook_post"):
            shapes[f"{b}.mlp.experts.{e}.{point}"] = (tokens, cfg.expert_width)
    if cfg.experts.shared is not None:  # a gated MLP every token runs: exact
        if cfg.experts.shared_gate:
            shapes[f"{b}.mlp.hook_shared_expert_gate"] = (tokens, 1)
        for point in ("hook_pre", "hook_pre_linear", "hook_post"):
            shapes[f"{b}.mlp.shared_expert.{point}"] = (tokens, cfg.experts.shared)


def deltanet_shapes(cfg: DecoderConfig, m: str, batch: int, pos: int) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet's points: queries and keys per key head, values and what they become per value head, the
    write strengths and decays one per value head."""
    linear = cfg.linear_attention
    keys, values = (batch, pos, linear.key_heads, linear.d_key_head), (batch, pos, linear.value_heads, linear.d_value_head)
    return {**{f"{m}.hook_{name}": keys for name in ("q_pre_conv", "k_pre_conv", "q", "k")},
            **{f"{m}.hook_{name}": values for name in ("v_pre_conv", "v", "recurrence_out", "gate_input", "z")},
            **{f"{m}.hook_{name}": (batch, pos, linear.value_heads) for name in ("beta_logit", "beta", "log_decay")}}


def dense_mlp_shapes(cfg: DecoderConfig, shapes: dict, b: str, batch: int, pos: int) -> None:
    shapes[f"{b}.mlp.hook_pre"] = (batch, pos, cfg.d_mlp)
    if cfg.gated_mlp:
        shapes[f"{b}.mlp.hook_pre_linear"] = (batch, pos, cfg.d_mlp)
    if cfg.activation.normed or (cfg.sub_norms and cfg.gated_mlp):  # act, then a norm over d_mlp (SoLU-LN, BitNet)
        shapes[f"{b}.mlp.hook_mid"] = (batch, pos, cfg.d_mlp)
        shapes[f"{b}.mlp.ln.hook_scale"] = (batch, pos, 1)
        shapes[f"{b}.mlp.ln.hook_normalized"] = (batch, pos, cfg.d_mlp)
    shapes[f"{b}.mlp.hook_post"] = (batch, pos, cfg.d_mlp)


def indexer_shapes(latent, layer: int, shapes: dict, a: str, batch: int, pos: int, key_pos: int) -> None:
    """A sparse indexer's points (probe.sparse_indexer): the chosen keys and their mask, and where the layer has an
    indexer of its own, its queries, keys, weights and scores."""
    spec = latent.indexer
    shapes[f"{a}.hook_topk_indices"] = (batch, pos, min(spec.topk, key_pos))
    shapes[f"{a}.hook_dsa_mask"] = (batch, pos, key_pos)
    if not spec.layer_shared(layer):
        shapes.update({f"{a}.indexer.hook_q": (batch, pos, spec.n_heads, spec.d_head),
                       f"{a}.indexer.hook_k": (batch, pos, spec.d_head),
                       f"{a}.indexer.hook_weights": (batch, pos, spec.n_heads),
                       f"{a}.indexer.hook_scores": (batch, pos, key_pos)})


def latent_shapes(latent, shapes: dict, a: str, batch: int, pos: int, heads: int) -> None:
    """Latent attention's own points (probe.latent_attention): its latents, their norms' points, and queries and keys
    d_qk wide, the keys' rotated part one for every head."""
    for name, width in (("q", latent.q_rank), ("kv", latent.kv_rank)):
        if width is not None:
            shapes[f"{a}.hook_{name}_latent"] = (batch, pos, width)
            shapes[f"{a}.{name}_a_layernorm.hook_scale"] = (batch, pos, 1)
            for end in ("normalized", "in", "out"):
                shapes[f"{a}.{name}_a_layernorm.hook_{end}"] = (batch, pos, width)
    shapes[f"{a}.hook_q"] = shapes[f"{a}.hook_k"] = (batch, pos, heads, latent.d_qk)
    shapes[f"{a}.hook_rot_q"] = (batch, pos, heads, latent.d_rope)
    shapes[f"{a}.hook_rot_k"] = (batch, pos, 1, latent.d_rope)
    for part in "qkv":
        shapes.pop(f"{a}.{part}.hook_in", None)
