"""transformer-lens 4's TransformerBridge names for probe's hook points.

The bridge names each point after the module it sits on (`blocks.0.hook_in`, `blocks.0.attn.q.hook_out`,
`blocks.0.mlp.out.hook_in`, `unembed.hook_out`) and calls the classic HookedTransformer names aliases, kept for
old code and deprecated. probe keeps the classic names and answers to the bridge's: most are aliases of a classic
point, worked out per block arrangement from what the bridge hooks on each family (tests/test_bridge_names.py
compares every one with the bridge's value); the norms' inputs and outputs, the token and position ids and each of
q, k and v's own input, which HookedTransformer never hooked, are points of their own (`bridge_only`), and so are
the unembedding's input and output, which transformer-lens 3.9 took from the bridge (listed everywhere). The bridge
names that probe has no point for are listed with what to hook instead, so asking for one says so rather than
"unknown name"."""
from __future__ import annotations

from typing import Optional

from torch import nn

from probe.config import DecoderConfig, NormPlacement, Positions
from probe.hooks import PointUnderName
from probe.delegated_attention_names import delegated_attention_names, delegates_attention
from probe.parallel_hybrid_names import add_parallel_hybrid_names
from probe.prediction_head import prediction_head_names
from probe.short_conv_names import short_conv_names
from probe.rwkv_names import rwkv_names
from probe.shared_block_names import mamba_layer_names, shared_block_names

_ROTARY = ("the rotary angles depend on the positions alone, and probe does not hook them; the rotated queries and "
           "keys are blocks.{l}.attn.hook_rot_q / hook_rot_k")


def bridge_names(cfg: DecoderConfig) -> tuple[dict[str, str], dict[str, str]]:
    """({bridge name: probe point}, {bridge name probe has no point for: what to hook instead}) for a model of `cfg`."""
    aliases: dict[str, str] = {"embed.hook_out": "hook_embed", "hook_unembed": "unembed.hook_out"}
    left_out = {}
    if cfg.embed_norm:  # the bridge's embed.hook_out is the table's row
        aliases["embed.hook_out"] = "embed.ln.hook_in"
    if cfg.embed_norm is True:  # Bloom's embed_ln is probe's embed.ln (NanoChat's adapter runs the norm as ln_final)
        aliases.update({f"embed_ln.{point}": f"embed.ln.{point}"
                        for point in ("hook_in", "hook_scale", "hook_normalized", "hook_out")})
    if cfg.rg_lru is not None:  # (RecurrentGemma's model multiplies by sqrt(d_model) after the embedding module)
        del aliases["embed.hook_out"]
        left_out["embed.hook_out"] = ("the bridge's embed.hook_out is the table's row before RecurrentGemma's "
                                      "sqrt(d_model) scale; probe's hook_embed is the scaled one blocks.0 reads, and "
                                      "the row itself is model.embed.W_E[tokens]")
    if cfg.positions in (Positions.LEARNED, Positions.SINUSOIDAL, Positions.SHORTFORMER):
        aliases["pos_embed.hook_out"] = "hook_pos_embed"
    else:
        left_out.update({f"rotary_emb.hook_{end}": _ROTARY.format(l=0) for end in ("in", "out", "cos", "sin")})
    for layer in range(cfg.n_layers):
        if cfg.original_architecture in SCALED_WRITES:
            left_out.update(_unscaled_outputs(f"blocks.{layer}"))
        if cfg.original_architecture == "GraniteMoeHybridForCausalLM":
            aliases.update(_granite_hybrid_mlp_names(f"blocks.{layer}", left_out))
        if cfg.layer_has_parallel_mixer(layer):  # Falcon-H1's: the mixer beside attention, multipliers folded
            add_parallel_hybrid_names(cfg, f"blocks.{layer}", aliases, left_out)
        if cfg.layer_has_shared_block(layer):  # Zamba2's hybrid layers: the bridge hooks their ends alone
            block_aliases, block_left_out = shared_block_names(f"blocks.{layer}")
            aliases.update(block_aliases)
            left_out.update(block_left_out)
            continue
        if cfg.rwkv is not None:  # (RWKV's embedding norm is the bridge's blocks.0.pre_ln, not its embed_ln)
            aliases = {k: v for k, v in aliases.items() if not k.startswith("embed_ln.")}
            aliases.update(rwkv_names(f"blocks.{layer}", layer))
            continue
        if cfg.rg_lru is not None:  # RecurrentGemma's: the bridge wraps each layer whole, its residual points alone
            aliases.update({f"blocks.{layer}.hook_in": f"blocks.{layer}.hook_resid_pre",
                            f"blocks.{layer}.hook_out": f"blocks.{layer}.hook_resid_post"})
            continue
        mixer = ("mixer" if cfg.layer_is_state_space(layer) else "conv" if cfg.layer_is_short_conv(layer) else
                 "linear_attn" if cfg.layer_is_linear(layer) else None)
        block_aliases, block_left_out = _block_names(cfg, f"blocks.{layer}", mixer,
                                                   # (Gemma 4's experts are beside its MLP: delegated_attention_names)
                                                   cfg.layer_sparse(layer) and not cfg.layer_scalars) if \
            cfg.sublayers is None else _one_sublayer_names(f"blocks.{layer}", cfg.sublayers[layer])
        if cfg.shared_blocks is not None:  # (Zamba2's Mamba-2 layers: the bridge hooks their output projections too)
            block_aliases.update(mamba_layer_names(f"blocks.{layer}"))
        if delegates_attention(cfg):  # the bridge's delegated attention (Gemma 4, AFMoE, Qwen3-VL)
            delegated_attention_names(cfg, layer, block_aliases, block_left_out)
        aliases.update({k: v for k, v in block_aliases.items() if k not in left_out})
        left_out.update({name: why.replace("{l}", str(layer)) for name, why in block_left_out.items()})
    prediction_head_names(cfg, aliases, left_out)  # (ModernBERT decoder's head before W_U, and its fused Wi)
    return aliases, left_out


# Granite's: the residual multiplier is folded into every output projection (probe.checkpoint_granite), so probe has
# each sublayer's write only after it; the bridge also hooks the sublayer modules' outputs before it
SCALED_WRITES = ("GraniteForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeHybridForCausalLM")


def _unscaled_outputs(b: str) -> dict[str, str]:
    why = (f"probe folds Granite's residual_multiplier into the output projections, so it has this sublayer's output "
           f"only as the residual receives it, times that multiplier: {b}.hook_attn_out / hook_mlp_out (the bridge's "
           f"same names)")
    return dict.fromkeys((f"{b}.attn.hook_out", f"{b}.attn.o.hook_out", f"{b}.attn.hook_hidden_states",
                          f"{b}.mixer.hook_out", f"{b}.hook_mixer_out", f"{b}.mixer.hook_ssm_out",
                          f"{b}.mlp.hook_out", f"{b}.mlp.out.hook_out"), why)


def _granite_hybrid_mlp_names(b: str, left_out: dict[str, str]) -> dict[str, str]:
    """Granite 4.0-H's MLP under the bridge's names (`shared_mlp`, `moe`): their input is ln2's output; their points
    inside are left out, saying where probe has them."""
    shared = (f"probe's shared MLP is {b}.mlp.shared_expert (or, without experts, {b}.mlp), its points hold the "
              f"tokens flattened, [batch*pos d_mlp], as every expert's do")
    routing = (f"probe's routing points are {b}.mlp.hook_expert_weights (the router's softmax over the chosen "
               f"experts) and {b}.mlp.hook_expert_indices; the bridge (TL 4.3) holds the router's logits under its "
               f"expert indices")
    left_out.update({f"{b}.shared_mlp.{name}": shared for name in (
        "hook_pre", "hook_pre_linear", "hook_post", "gate.hook_out", "in.hook_out", "out.hook_in", "gate.hook_in",
        "in.hook_in")})
    left_out.update({f"{b}.moe.{name}": routing for name in (
        "hook_expert_indices", "hook_expert_weights", "gate.hook_expert_indices", "gate.hook_expert_weights",
        "gate.hook_in", "gate.hook_out")})
    left_out.update({f"{b}.{name}": left_out.get(f"{b}.mlp.hook_out", "") or shared for name in (
        "shared_mlp.hook_out", "shared_mlp.out.hook_out", "moe.hook_out", "moe.hook_post")})
    return dict.fromkeys((f"{b}.shared_mlp.hook_in", f"{b}.moe.hook_in", f"{b}.moe.hook_pre"), f"{b}.ln2.hook_out")


def _linear_attention_names(b: str) -> tuple[dict[str, str], dict[str, str]]:
    """A linear-attention block's names for its mixer (the bridge's GatedDeltaNetBridge, its aliases too)."""
    mixer = f"{b}.linear_attn"
    aliases = {f"{b}.hook_in": f"{b}.hook_resid_pre", f"{b}.hook_out": f"{b}.hook_resid_post",
               f"{mixer}.hook_in": f"{b}.ln1.hook_out", f"{mixer}.hook_linear_attn_in": f"{b}.ln1.hook_out",
               f"{mixer}.hook_out": f"{b}.hook_attn_out", f"{mixer}.hook_linear_attn_out": f"{b}.hook_attn_out",
               f"{mixer}.hook_ssm_out": f"{b}.hook_attn_out", f"{mixer}.hook_ssm_C": f"{mixer}.hook_q",
               f"{mixer}.hook_ssm_B": f"{mixer}.hook_k", f"{mixer}.hook_ssm_decay": f"{mixer}.hook_log_decay",
               f"{mixer}.hook_ssm_write": f"{mixer}.hook_beta"}
    why = (f"probe does not keep the state at every position (a [batch pos v_head d_key_head d_value_head] tensor); "
           f"what it writes and reads is hooked: {mixer}.hook_k, hook_v, hook_beta, hook_log_decay, hook_q and "
           f"hook_recurrence_out")
    return aliases, {f"{mixer}.hook_ssm_state": why}


def _state_space_names(b: str) -> tuple[dict[str, str], dict[str, str]]:
    """A state-space block's names for its Mamba-2 mixer (the bridge's SSM2MixerBridge under `mixer`, its aliases
    too)."""
    mixer = f"{b}.mixer"
    aliases = {f"{b}.hook_in": f"{b}.hook_resid_pre", f"{b}.hook_out": f"{b}.hook_resid_post",
               f"{mixer}.hook_in": f"{b}.ln1.hook_out", f"{b}.hook_mixer_in": f"{b}.ln1.hook_out",
               f"{mixer}.in_proj.hook_in": f"{b}.ln1.hook_out",  # (the one layer that reads the mixer's input)
               f"{mixer}.hook_out": f"{b}.hook_attn_out", f"{b}.hook_mixer_out": f"{b}.hook_attn_out",
               f"{mixer}.hook_ssm_out": f"{b}.hook_attn_out", f"{mixer}.in_proj.hook_out": f"{mixer}.hook_in_proj",
               f"{mixer}.conv1d.hook_out": f"{mixer}.hook_conv", f"{mixer}.inner_norm.hook_out": f"{mixer}.hook_inner_norm"}
    left_out = {f"{mixer}.{name}": why for name, why in (
        ("hook_ssm_state", f"probe does not keep the state at every position (a [batch pos head d_head d_state] "
                           f"tensor); what writes and reads it is hooked: {mixer}.hook_conv (x, B, C), hook_dt and "
                           f"hook_scan_out"),
        ("hook_ssm_write", f"probe does not form each position's write dt x B^T; its parts are {mixer}.hook_conv and "
                           f"hook_dt"),
        ("conv1d.hook_in", f"the convolution's input is {mixer}.hook_in_proj's x, B and C channels ([batch pos ...], "
                           f"not the convolution's [batch channel pos])"),
        ("inner_norm.hook_in", f"the gated norm's input is {mixer}.hook_scan_out ([batch pos head d_head]; flatten "
                               f"its last two dimensions for the bridge's) and its gate the first channels of "
                               f"{mixer}.hook_in_proj"))}
    return aliases, left_out


def _one_sublayer_names(b: str, kind: str) -> tuple[dict[str, str], dict[str, str]]:
    """A one-sublayer block's names (NemotronH's, the bridge's SSMBlockBridge): its norm `norm` (ln1; ln2 before an MLP)
    and its sublayer `mixer` whatever `kind` it is (passed through), with a Mamba-2 mixer's points inside."""
    if kind == "mixer":
        aliases, left_out = _state_space_names(b)
        aliases.update({f"{b}.mixer.out_proj.hook_in": f"{b}.mixer.hook_inner_norm",
                        f"{b}.mixer.out_proj.hook_out": f"{b}.hook_attn_out"})
    else:  # (the bridge lists a state on every layer; it fires on the Mamba-2 ones alone)
        why = f"this layer's one sublayer is {'attention' if kind == 'attn' else 'an MLP (or experts)'}: it keeps no state"
        aliases, left_out = {}, dict.fromkeys((f"{b}.mixer.hook_ssm_state", f"{b}.mixer.hook_ssm_write"), why)
    norm, write = ("ln2", "hook_mlp_out") if kind == "mlp" else ("ln1", "hook_attn_out")
    aliases.update({f"{b}.hook_in": f"{b}.hook_resid_pre", f"{b}.hook_out": f"{b}.hook_resid_post",
                    **{f"{b}.norm.{p}": f"{b}.{norm}.{p}" for p in ("hook_in", "hook_scale", "hook_normalized", "hook_out")},
                    **dict.fromkeys((f"{b}.mixer.hook_in", f"{b}.hook_mixer_in"), f"{b}.{norm}.hook_out"),
                    **dict.fromkeys((f"{b}.mixer.hook_out", f"{b}.hook_mixer_out", f"{b}.mixer.hook_ssm_out"), f"{b}.{write}")})
    return aliases, left_out


def _selective_scan_names(b: str, normed: bool = False) -> tuple[dict[str, str], dict[str, str]]:
    """A state-space block's names for its Mamba-1 mixer (the bridge's SSMMixerBridge under `mixer`, its aliases
    too); `normed`: its step input passes a learned norm first (Jamba's dt_layernorm, whose ends are its own points)."""
    mixer = f"{b}.mixer"
    aliases = {f"{b}.hook_in": f"{b}.hook_resid_pre", f"{b}.hook_out": f"{b}.hook_resid_post",
               f"{mixer}.hook_in": f"{b}.ln1.hook_out", f"{mixer}.in_proj.hook_in": f"{b}.ln1.hook_out",
               f"{b}.hook_mixer_in": f"{b}.ln1.hook_out", f"{b}.hook_mixer_out": f"{b}.hook_attn_out",
               f"{mixer}.hook_out": f"{b}.hook_attn_out", f"{mixer}.hook_ssm_out": f"{b}.hook_attn_out",
               f"{mixer}.out_proj.hook_out": f"{b}.hook_attn_out", f"{mixer}.in_proj.hook_out": f"{mixer}.hook_in_proj",
               f"{mixer}.x_proj.hook_in": f"{mixer}.hook_conv", f"{mixer}.x_proj.hook_out": f"{mixer}.hook_x_proj",
               f"{mixer}.out_proj.hook_in": f"{mixer}.hook_gated"}
    low_rank = f"{mixer}.dt_layernorm.hook_out" if normed else f"the first channels of {mixer}.hook_x_proj"
    step = (f"probe hooks the step after its softplus, {mixer}.hook_dt ([batch pos d_inner], float32); its low-rank "
            f"input is {low_rank} (transformers reads dt_proj's weight, not the module)")
    conv = (f"probe hooks the convolution after its silu, {mixer}.hook_conv ([batch pos d_inner]); its input is "
            f"{mixer}.hook_in_proj's first half (transformers reads conv1d's weight, not the module)")
    left_out = {f"{mixer}.{name}": why for name, why in (
        ("hook_ssm_state", f"probe does not keep the state at every position (a [batch pos d_inner d_state] tensor); "
                           f"what writes and reads it is hooked: {mixer}.hook_conv, hook_x_proj, hook_dt and "
                           f"hook_scan_out"),
        ("hook_ssm_write", f"probe does not form each position's write dt x B; its parts are {mixer}.hook_conv, "
                           f"hook_x_proj and hook_dt"),
        ("dt_proj.hook_in", step), ("dt_proj.hook_out", step), ("hook_dt_proj", step), ("hook_ssm_dt", step),
        ("conv1d.hook_in", conv), ("conv1d.hook_out", conv))}
    return aliases, left_out


def _block_names(cfg: DecoderConfig, b: str, mixer: Optional[str] = None,
                 sparse: bool = False) -> tuple[dict[str, str], dict[str, str]]:
    """One block's names: its token mixer's (attention, or the recurrent layer `mixer` names: "linear_attn" or
    "mixer"), then its MLP's (a mixture of experts where `sparse`)."""
    recurrent = {"linear_attn": _linear_attention_names, "mixer": _state_space_names, "conv": short_conv_names}
    if mixer == "mixer" and cfg.state_space.kind == "mamba1":
        recurrent["mixer"] = lambda b: _selective_scan_names(b, cfg.state_space.bcdt_norm_weights)
    aliases, left_out = recurrent[mixer](b) if mixer else _attention_names(cfg, b)
    if mixer == "mixer" and cfg.attn_only:  # Mamba-2's own blocks: the bridge names their one norm `norm`
        aliases.update({f"{b}.norm.{point}": f"{b}.ln1.{point}"
                        for point in ("hook_in", "hook_scale", "hook_normalized", "hook_out")})
    if cfg.attn_only:
        return aliases, left_out
    # (a recurrent layer's block is pre-norm whatever the attention layers' are: OLMo-Hybrid's are sandwiches)
    return _mlp_names(cfg, b, aliases, left_out, sparse, pre_norm=mixer is not None)


def _attention_names(cfg: DecoderConfig, b: str) -> tuple[dict[str, str], dict[str, str]]:
    post = cfg.norm_placement is NormPlacement.POST  # GPT-1: each norm follows its sum, so sublayers read the residual
    sandwich = cfg.norm_placement is NormPlacement.SANDWICH  # Gemma 2: the bridge's sublayer outputs are before ln*_post
    # a post-norm block's sublayers read the residual stream itself, which has no point of the sublayer's own: the
    # bridge's attn.hook_in and mlp.hook_in there are left out, since an edit at hook_resid_pre reaches the residual too
    attn_in = None if post else f"{b}.ln1.hook_out"
    attn_out = f"{b}.ln1_post.hook_in" if sandwich else f"{b}.hook_attn_out"
    # Bloom's attention and MLP modules add the residual themselves, so the bridge's outputs of those modules (not of
    # their output projections) are the residual after each sublayer
    residual_added = cfg.original_architecture == "BloomForCausalLM"
    attn_module_out = f"{b}.hook_resid_mid" if residual_added else attn_out
    # a point's names in the order the bridge's cache lists them
    aliases = {f"{b}.hook_in": f"{b}.hook_resid_pre", f"{b}.hook_out": f"{b}.hook_resid_post",
               f"{b}.attn.o.hook_out": attn_out, f"{b}.attn.hook_hidden_states": attn_module_out,
               f"{b}.attn.hook_out": attn_module_out,  # (BitNet's W_O reads every head's z normalised together)
               f"{b}.attn.o.hook_in": f"{b}.attn.hook_z_normed" if cfg.sub_norms else f"{b}.attn.hook_z",
               # the bridge also spells the per-head inputs inside attention, as its own patching code hooks them
               f"{b}.attn.hook_attn_in": f"{b}.hook_attn_in"}
    left_out = {}
    if post:
        left_out[f"{b}.attn.hook_in"] = (
            f"attention in a post-norm block reads the residual stream itself, so an edit at {b}.hook_resid_pre also "
            f"reaches the residual; hook {b}.hook_attn_in (a copy per head) for attention alone")
    else:
        aliases[f"{b}.attn.hook_in"] = attn_in
    for part in "qkv":
        aliases[f"{b}.attn.{part}.hook_out"] = f"{b}.attn.hook_{part}"
        aliases[f"{b}.attn.hook_{part}_input"] = f"{b}.hook_{part}_input"
    fused = (f"the bridge's fused q/k/v projection: its input is {attn_in or b + '.hook_resid_pre'}, and its outputs "
             f"are {b}.attn.hook_q, hook_k and hook_v ([batch pos head d_head] each)")
    left_out.update({f"{b}.attn.qkv.hook_in": fused, f"{b}.attn.qkv.hook_out": fused})
    if cfg.positions is Positions.ROTARY:
        left_out.update({f"{b}.attn.hook_cos": _ROTARY, f"{b}.attn.hook_sin": _ROTARY})
    if cfg.latent_attention is not None:
        _latent_attention_names(cfg, b, aliases, left_out)
    if cfg.qk_norm:
        layout = "[batch pos (head d_head)], every head's flattened" if cfg.qk_norm_over_heads else \
            "[batch head pos d_head]"
        for part in "qk":
            left_out[f"{b}.attn.{part}_norm.hook_in"] = left_out[f"{b}.attn.{part}_norm.hook_out"] = (
                f"the bridge holds the {part} norm's input and output as {layout}; probe hooks "
                f"the same values as {b}.attn.hook_{part} and {b}.attn.hook_{part}_normed, [batch pos head d_head]")
    return aliases, left_out


def _latent_attention_names(cfg: DecoderConfig, b: str, aliases: dict[str, str], left_out: dict[str, str]) -> None:
    """Latent attention's projections (the bridge's MLAAttentionBridge) in place of q, k and v's: the latents' norms
    are points of their own (their ends), the projections' ends aliases of them or left out."""
    a = f"{b}.attn"
    for part in "qkv":
        del aliases[f"{a}.{part}.hook_out"]
    aliases[f"{a}.kv_b_proj.hook_in"] = f"{a}.hook_kv_latent"
    if cfg.latent_attention.q_rank is not None:
        aliases.update({f"{a}.q_a_proj.hook_out": f"{a}.q_a_layernorm.hook_in",
                        f"{a}.q_b_proj.hook_in": f"{a}.hook_q_latent"})
    reads = (f"what attention reads is {b}.ln1.hook_out (all of it; each projection's own input is not hooked), or "
             f"each head's own copy, {b}.hook_q_input / hook_k_input / hook_v_input")
    queries = f"the queries before rotation are not hooked whole: {a}.hook_q holds them after ([batch pos head d_qk])"
    left_out.update({f"{a}.q_a_proj.hook_in": reads, f"{a}.q_proj.hook_in": reads,
                     f"{a}.kv_a_proj_with_mqa.hook_in": reads, f"{a}.q_b_proj.hook_out": queries,
                     f"{a}.q_proj.hook_out": queries,
                     f"{a}.kv_a_proj_with_mqa.hook_out": f"it is split: the latent before its norm is "
                     f"{a}.kv_a_layernorm.hook_in, the keys' rotated part {a}.hook_rot_k (after rotation)",
                     f"{a}.kv_b_proj.hook_out": f"it is split per head: the keys' unrotated part is "
                     f"{a}.hook_k[..., :d_nope], the values {a}.hook_v"})


def _mlp_names(cfg: DecoderConfig, b: str, aliases: dict[str, str], left_out: dict[str, str],
               sparse: bool, pre_norm: bool = False) -> tuple[dict[str, str], dict[str, str]]:
    """`aliases` and `left_out` with the MLP's names added: a mixture of experts' where `sparse`; a dense layer of a
    model with experts elsewhere is the bridge's MoE block bound to a gated MLP, its projections `dense_gate`,
    `dense_in` and `dense_out`."""
    post = cfg.norm_placement is NormPlacement.POST and not pre_norm
    sandwich = cfg.norm_placement is NormPlacement.SANDWICH and not pre_norm
    residual_added = cfg.original_architecture == "BloomForCausalLM"
    mlp_in = f"{b}.hook_mlp_in" if post else f"{b}.ln2.hook_out"
    mlp_out = f"{b}.ln2_post.hook_in" if sandwich else f"{b}.hook_mlp_out"
    mlp_module_out = f"{b}.hook_resid_post" if residual_added else mlp_out
    if sparse:  # the bridge's MoE block: its input and output (also as hook_pre / hook_post)
        aliases.update({f"{b}.mlp.hook_out": mlp_module_out, f"{b}.mlp.hook_in": mlp_in, f"{b}.mlp.hook_pre": mlp_in,
                        f"{b}.mlp.hook_post": mlp_out,
                        f"{b}.mlp.gate.hook_expert_indices": f"{b}.mlp.hook_expert_indices"})
        scores = ("the scores over every expert (the softmax, or each expert's sigmoid before any selection bias; "
                  "[batch*pos experts]; an edit there changes which experts run)" if cfg.experts.softmax_over == "all"
                  else "the chosen experts' weights, zeros elsewhere ([batch*pos experts]; the choice is by logit)")
        routing = (f"probe hooks the routing as transformer-lens 3.9 does: {b}.mlp.hook_expert_weights, {scores}, "
                   f"and {b}.mlp.hook_expert_indices; the router reads {mlp_in} with the experts")
        left_out.update({f"{b}.mlp.gate.hook_expert_weights": routing.replace(
            "probe hooks", "the bridge's are the chosen experts' weights (zeros elsewhere); probe hooks"),
            f"{b}.mlp.gate.hook_in": routing, f"{b}.mlp.gate.hook_out": routing,
            # (Jamba's router, whose output the bridge takes for the router's logits)
            f"{b}.mlp.router.hook_in": routing, f"{b}.mlp.router.hook_out": routing})
        if cfg.experts.shared is not None and not cfg.experts.shared_gate:  # DeepSeek's, GLM's, ERNIE's
            where = (f"probe's shared expert is {b}.mlp.shared_expert (hook_pre, hook_pre_linear, hook_post), its points "
                     f"holding the tokens flattened, [batch*pos d_mlp], as every expert's do")
            left_out.update({f"{b}.mlp.shared_experts.{point}": where for point in (
                "hook_in", "hook_out", "hook_pre", "hook_pre_linear", "hook_post", "gate.hook_in", "gate.hook_out",
                "in.hook_in", "in.hook_out", "out.hook_in", "out.hook_out")})
        return aliases, left_out
    # (Gemma 4's experts are beside its MLP, which keeps its own names)
    dense_among_sparse = cfg.experts is not None and not cfg.layer_scalars
    gate, up, down = ("dense_gate", "dense_in", "dense_out") if dense_among_sparse else ("gate", "in", "out")
    # (in the order the bridge's cache lists them)
    aliases.update({f"{b}.mlp.{down}.hook_out": mlp_out, f"{b}.mlp.hook_out": mlp_module_out,
                    f"{b}.mlp.{down}.hook_in": f"{b}.mlp.hook_post"})
    mlp_reads = [f"{b}.mlp.hook_in"] + ([] if cfg.gated_mlp else [f"{b}.mlp.{up}.hook_in"])
    if post:
        left_out.update({name: f"the MLP in a post-norm block reads the residual stream itself; hook {mlp_in} (a copy "
                               f"the MLP alone reads)" for name in mlp_reads})
    else:
        aliases.update(dict.fromkeys(mlp_reads, mlp_in))
    if cfg.gated_mlp:
        aliases.update({f"{b}.mlp.{gate}.hook_out": f"{b}.mlp.hook_pre", f"{b}.mlp.{up}.hook_out": f"{b}.mlp.hook_pre_linear"})
        for part in (gate, up):
            left_out[f"{b}.mlp.{part}.hook_in"] = (
                f"the bridge hooks the {part} projection's input alone there, but probe's MLP reads one input for "
                f"both: hook {mlp_in} (the bridge's {b}.mlp.hook_in) to read or edit it")
    else:
        aliases[f"{b}.mlp.{up}.hook_out"] = f"{b}.mlp.hook_pre"
    return aliases, left_out


class BridgeSubmodule:
    """A submodule the bridge has and probe does not (`attn.q`, `mlp.out`), holding the hook points its names name as
    attributes, so that `model.blocks[0].attn.q.hook_out` is `model.blocks[0].attn.hook_q`, as TL 4 code reaches it.
    A name probe leaves out raises an AttributeError saying what to hook instead."""

    def __init__(self, path: str, left_out: dict[str, str]):
        self._path, self._left_out = path, left_out

    def __getattr__(self, name: str):
        if name.startswith("_"):  # its own fields, unset while it is copied or unpickled
            raise AttributeError(name)
        why = self._left_out.get(f"{self._path}.{name}", "the bridge has no such point either")
        raise AttributeError(f"no hook point {self._path}.{name}: {why}")

    def __repr__(self) -> str:
        return f"BridgeSubmodule({self._path!r})"


def describe_blocks_as_the_bridge(model: nn.Module) -> None:
    """What transformer-lens 4's analysis tools read off the bridge's blocks before trusting a decomposition: every
    probe block's output is one residual stream (its `logit_lens` and `logit_readout` need that), and a sandwich
    block's attention write passes ln1_post after the head sum (its direct-path and edge tools then refuse the block,
    as probe's own per-head decompositions refuse it)."""
    for block in model.blocks:
        object.__setattr__(block, "hook_out_is_single_residual_stream", True)
        if hasattr(block, "ln1_post"):
            object.__setattr__(block, "submodules", {"ln1": block.ln1, "attn": block.attn, "ln1_post": block.ln1_post})
            object.__setattr__(block, "hook_aliases", {"hook_attn_out": "ln1_post.hook_out"})


def attach_bridge_attributes(model: nn.Module, aliases: dict[str, str], left_out: dict[str, str]) -> None:
    """Each alias as an attribute path too (`model.blocks[0].hook_out`), as TL 4 code writes them: plain attributes,
    not submodules, so the module tree, the state dict and `named_modules()` stay probe's. A path through one of
    torch's own modules (the gated MLP's `gate` Linear) is left to the string name."""
    for alias, target in aliases.items():
        *path, last = alias.split(".")
        owner = model
        for depth, part in enumerate(path):
            child = owner[int(part)] if part.isdigit() else getattr(owner, part, None)
            if child is None:
                child = BridgeSubmodule(".".join(path[:depth + 1]), left_out)
                object.__setattr__(owner, part, child)
            elif not (isinstance(child, (BridgeSubmodule, nn.ModuleList)) or type(child).__module__.startswith("probe.")):
                break  # never decorate torch's own layers
            owner = child
        else:
            if not hasattr(owner, last):
                object.__setattr__(owner, last, PointUnderName(model.hook_point(target), alias))
