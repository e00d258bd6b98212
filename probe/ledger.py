"""The parameter ledger: where a decoder's parameters, FLOPs and KV-cache bytes go, from its config."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pandas as pd
import torch

from probe.config import DecoderConfig, Norm, NormPlacement, Positions
from probe.config_gate import output_gate_of
from probe.shared_block_ledger import add_shared_block


@dataclass(frozen=True)
class Ledger:
    cfg: DecoderConfig
    n_ctx: int
    dtype: torch.dtype
    rows: list[dict]

    def to_frame(self) -> pd.DataFrame:
        """One row per (component, layer): `component`, `layer` (None for whole-model parts), `group`, `params`."""
        return pd.DataFrame(self.rows, columns=["component", "layer", "group", "params"])

    @property
    def total_params(self) -> int:
        return sum(r["params"] for r in self.rows)

    def group_params(self, group: str) -> int:
        return sum(r["params"] for r in self.rows if r["group"] == group)

    @property
    def flops_per_token(self) -> int:
        """Forward FLOPs for one token at context `n_ctx`: 2 per multiply-add in every matmul (the
        unembedding included), plus attention's scores and weighted sum over n_ctx keys, 2 * n_ctx *
        d_head per head each (as Hoffmann et al. 2022 count; Kaplan et al. 2020's 2 * n_ctx * d_attn
        per layer is half this attention term); a layer with a sliding window (or Llama 4's chunks) sees at most
        that many keys. A causal mask would halve the average; not counted."""
        cfg = self.cfg
        matmul_weights = sum(r["params"] for r in self.rows if r["component"].endswith("weight") and r["group"] != "embedding")
        if cfg.tied_embeddings:  # the unembedding matmul happens even when its weights are the embedding's
            matmul_weights += cfg.d_vocab * cfg.d_model
        if cfg.positions is Positions.SHORTFORMER:  # each layer projects the positions through W_Q and W_K too
            matmul_weights += sum(cfg.d_model * (cfg.layer_heads(l) + cfg.layer_kv_heads(l)) * cfg.d_head
                                  for l in range(cfg.n_layers))
        if cfg.experts is not None:  # each token runs only per_token of the experts
            experts = sum(r["params"] for r in self.rows if r["component"].startswith(("mlp.experts.", "experts.experts."))
                          and r["component"].endswith("weight"))
            matmul_weights -= experts * (cfg.experts.n - cfg.experts.per_token) // cfg.experts.n
        moa = cfg.mixture_of_attention
        if moa is not None:  # (and per_token of the attention experts)
            experts = sum(r["params"] for r in self.rows if r["component"].startswith("attn.experts."))
            matmul_weights -= experts * (moa.n - moa.per_token) // moa.n
        # a linear-attention layer reads a fixed state, not the keys: counted as a layer that sees no keys (its
        # state update and read, ~4 d_key_head d_value_head per value head, are left out, as the convolution is)
        keys = [0 if cfg.layer_is_linear(l) or not cfg.layer_has_mixer(l) else  # (MLP-only layers read no keys)
                min(self.n_ctx, getattr(cfg.layer_mask_key(l), "size", cfg.layer_window(l)) or self.n_ctx)
                for l in range(cfg.n_layers)]
        # scores over d_qk and the weighted sum over d_head (both d_head but in latent attention; Gemma 4's full
        # layers' heads are wider)
        widths = [cfg.layer_d_head(l) + (cfg.layer_d_head(l) if cfg.latent_attention is None else cfg.latent_attention.d_qk)
                  for l in range(cfg.n_layers)]
        indexer = cfg.latent_attention.indexer if cfg.latent_attention is not None else None
        if indexer is not None:  # its heads score every key; the attention's read only the topk chosen
            attention = 2 * sum(indexer.n_heads * keys[l] * indexer.d_head for l in range(cfg.n_layers)
                                if not indexer.layer_shared(l))
            keys = [min(k, indexer.topk) for k in keys]
        else:
            attention = 0
        attention += 2 * sum(cfg.layer_heads(l) * keys[l] * widths[l] for l in range(cfg.n_layers))
        return 2 * matmul_weights + attention

    @property
    def kv_bytes_per_token(self) -> int:
        cfg = self.cfg
        # (a linear-attention layer's state has one size whatever the length: no bytes per token)
        # (nor does a layer reusing an earlier one's keys and values: Gemma 4's)
        width = 2 * sum(cfg.layer_kv_heads(l) * cfg.layer_d_head(l) for l in range(cfg.n_layers)
                        if not cfg.layer_is_linear(l) and cfg.layer_has_mixer(l) and cfg.layer_kv_source(l) is None)
        if cfg.latent_attention is not None:  # the latent and the shared rotated key part, as transformers caches them
            width = cfg.n_layers * (cfg.latent_attention.kv_rank + cfg.latent_attention.d_rope)
            indexer = cfg.latent_attention.indexer
            if indexer is not None:  # and each indexer's one key per position
                width += indexer.d_head * sum(not indexer.layer_shared(l) for l in range(cfg.n_layers))
        return width * torch.finfo(self.dtype).bits // 8

    @property
    def kv_bytes_per_sequence(self) -> int:
        return self.kv_bytes_per_token * self.n_ctx

    def summary(self) -> pd.DataFrame:
        attention, mlp = self.group_params("attention"), self.group_params("mlp")
        values = {
            "parameters": self.total_params,
            "attention parameters": attention,
            "mlp parameters": mlp,
            "mlp share of attention + mlp": mlp / (attention + mlp),
            f"forward FLOPs per token at n_ctx={self.n_ctx}": self.flops_per_token,
            f"KV-cache bytes per token ({self.dtype})": self.kv_bytes_per_token,
            f"KV-cache bytes per sequence of {self.n_ctx}": self.kv_bytes_per_sequence,
        }
        return pd.DataFrame({"quantity": list(values), "value": pd.Series(list(values.values()), dtype=object)})


def _per_norm(cfg: DecoderConfig) -> int:
    """A norm's learned parameters per dimension: w (and a LayerNorm's b)."""
    return {Norm.LAYER: 2, Norm.NONE: 0}.get(cfg.norm, 1)


def _add_attention(cfg: DecoderConfig, add, layer: int) -> None:
    """An attention layer's parameters: q (and an output gate's), k, v, o, their biases, q/k norms and sinks."""
    d, dh, per_norm = cfg.d_model, cfg.layer_d_head(layer), _per_norm(cfg)
    h, kv = cfg.layer_heads(layer), cfg.layer_kv_heads(layer)
    # Gemma 4: a layer reusing an earlier one's keys projects neither (nor norms them); values from the keys: no v
    own_k = cfg.layer_kv_source(layer) is None
    own_v = own_k and not cfg.layer_values_from_keys(layer)
    add("attn.q.weight", "attention", d * h * dh, layer)
    gate = h * output_gate_of(cfg).width(dh) if cfg.attn_output_gate else 0  # (Laguna's: one logit per head)
    add("attn.gate.weight", "attention", d * gate, layer)
    qk_norm = (h + kv) * dh if cfg.qk_norm_over_heads else (1 + own_k) * dh  # OLMo 2's span every head
    add("attn.qk_norm", "norm", qk_norm * per_norm if cfg.qk_norm else 0, layer)
    add("attn.k.weight", "attention", d * kv * dh * own_k, layer)
    add("attn.v.weight", "attention", d * kv * dh * own_v, layer)
    add("attn.qkv.bias", "attention", (h + (own_k + own_v) * kv) * dh + gate if cfg.qkv_bias else 0, layer)
    add("attn.o.weight", "attention", h * dh * d, layer)
    add("attn.o.bias", "attention", d if cfg.out_bias else 0, layer)
    add("attn.sinks", "attention", h if cfg.attn_sinks else 0, layer)
    add("attn.z_norm", "norm", h * dh * cfg.norm_weights * cfg.sub_norms, layer)  # (BitNet's, over every head's z)


def _add_mixture_of_attention(cfg: DecoderConfig, add, layer: int) -> None:
    """JetMoE's attention experts (probe.mixture_of_attention): the router, each expert's query and output
    projections, the keys' and values' one projection, the bias on the output."""
    spec, d, width = cfg.mixture_of_attention, cfg.d_model, cfg.n_kv_heads * cfg.d_head
    add("attn.router.weight", "attention", d * spec.n, layer)
    add("attn.experts.q.weight", "attention", spec.n * d * width, layer)
    add("attn.kv.weight", "attention", 2 * d * width, layer)
    add("attn.experts.o.weight", "attention", spec.n * width * d, layer)
    add("attn.o.bias", "attention", d, layer)


def _add_latent_attention(cfg: DecoderConfig, add, layer: int) -> None:
    """A latent attention layer's parameters (probe.latent_attention): its projections and the latents' norms."""
    latent, d, h = cfg.latent_attention, cfg.d_model, cfg.n_heads
    queries = d * h * latent.d_qk if latent.q_rank is None else latent.q_rank * (d + h * latent.d_qk)
    add("attn.q.weight", "attention", queries, layer)
    add("attn.kv_a_proj_with_mqa.weight", "attention", d * (latent.kv_rank + latent.d_rope), layer)
    add("attn.kv_b_proj.weight", "attention", latent.kv_rank * h * (latent.d_nope + cfg.d_head), layer)
    biases = (latent.q_rank or 0) + latent.kv_rank + latent.d_rope
    add("attn.qkv.bias", "attention", biases if cfg.qkv_bias else 0, layer)
    add("attn.latent_norms", "norm", (latent.q_rank or 0) + latent.kv_rank, layer)
    add("attn.o.weight", "attention", h * cfg.d_head * d, layer)
    add("attn.o.bias", "attention", d if cfg.out_bias else 0, layer)
    indexer = latent.indexer
    if indexer is not None and not indexer.layer_shared(layer):  # (probe.sparse_indexer)
        add("attn.indexer.weight", "attention", indexer.n_heads * (latent.q_rank * indexer.d_head + d)
            + d * indexer.d_head, layer)
        add("attn.indexer.k_norm", "norm", 2 * indexer.d_head, layer)


def _add_state_space(cfg: DecoderConfig, add, layer: int, space=None, name: str = "mixer") -> None:
    """A Mamba-2 layer's parameters (probe.state_space): its projections are matmuls ("weight"), its convolution, step
    and decay rates, skips and gated norm are not. `space` and `name`: a mixer beside attention (Falcon-H1's `mamba`)."""
    space, d = cfg.state_space if space is None else space, cfg.d_model
    inner, channels = space.n_heads * space.d_head, space.n_heads * space.d_head + 2 * space.n_groups * space.d_state
    add(f"{name}.in_proj.weight", "attention", d * (inner + channels + space.n_heads), layer)
    add(f"{name}.conv1d", "attention", channels * (space.conv_kernel + space.conv_bias), layer)
    add(f"{name}.decay", "attention", 3 * space.n_heads, layer)  # dt_bias, A_log and D
    add(f"{name}.norm", "norm", inner if space.inner_norm is not None else 0, layer)
    add(f"{name}.out_proj.weight", "attention", inner * d, layer)
    out_bias = space.proj_bias if space.out_bias is None else space.out_bias
    add(f"{name}.proj_bias", "attention", (inner + channels + space.n_heads) * space.proj_bias + d * out_bias, layer)


def _add_selective_scan(cfg: DecoderConfig, add, layer: int) -> None:
    """A Mamba-1 layer's parameters (probe.selective_scan): its projections are matmuls ("weight"), its convolution,
    step bias, decay rates and skips are not."""
    space, d = cfg.state_space, cfg.d_model
    inner, rank, n = space.d_inner, space.dt_rank, space.d_state
    add("mixer.in_proj.weight", "attention", d * 2 * inner, layer)
    add("mixer.conv1d", "attention", inner * (space.conv_kernel + space.conv_bias), layer)
    add("mixer.x_proj.weight", "attention", inner * (rank + 2 * n), layer)
    add("mixer.dt_proj.weight", "attention", rank * inner, layer)
    add("mixer.decay", "attention", inner * (n + 2), layer)  # A_log, D and dt_proj's bias
    add("mixer.out_proj.weight", "attention", inner * d, layer)
    add("mixer.proj_bias", "attention", 2 * inner + d if space.proj_bias else 0, layer)
    add("mixer.bcdt_norms", "norm", rank + 2 * n if space.bcdt_norm_weights else 0, layer)  # (Jamba's scales)


def _add_short_conv(cfg: DecoderConfig, add, layer: int) -> None:
    """An LFM2 short-convolution layer's parameters (probe.short_conv): its projections are matmuls ("weight"), its
    depthwise convolution is not."""
    spec, d = cfg.short_conv, cfg.d_model
    add("conv.in_proj.weight", "attention", d * 3 * d, layer)
    add("conv.conv", "attention", d * (spec.conv_kernel + spec.bias), layer)
    add("conv.out_proj.weight", "attention", d * d, layer)
    add("conv.proj_bias", "attention", 4 * d if spec.bias else 0, layer)


def _add_rg_lru(cfg: DecoderConfig, add, layer: int) -> None:
    """A Griffin recurrent block's parameters (probe.rg_lru): its three projections are matmuls ("weight"); its
    convolution, block-diagonal gates, decay rates and biases are not."""
    spec, d = cfg.rg_lru, cfg.d_model
    add("recurrent.linear.weight", "attention", 3 * d * spec.width, layer)  # linear_x, linear_y, linear_out
    add("recurrent.conv_1d", "attention", spec.width * (spec.conv_kernel + 1), layer)
    add("recurrent.rg_lru.gates", "attention", 2 * spec.width * (spec.block_width + 1), layer)
    add("recurrent.rg_lru.recurrent_param", "attention", spec.width, layer)
    add("recurrent.linear.bias", "attention", 2 * spec.width + d, layer)


def _add_rwkv(cfg: DecoderConfig, add, layer: int) -> None:
    """An RWKV-4 layer's parameters beyond the MLP rows' (probe.rwkv): the time mix's key, value, receptance and output
    are matmuls ("weight"), its decay rates, bonuses and token-shift mixes are not; the channel mix's key and value
    are the MLP's in and out, its receptance a matmul beside them, its two token-shift mixes not."""
    d, width = cfg.d_model, cfg.rwkv.d_attention
    add("time_mix.projections.weight", "attention", 4 * d * width, layer)
    add("time_mix.decay_and_shift", "attention", 2 * width + 3 * d, layer)  # time_decay, time_first, three mixes
    add("channel_mix.receptance.weight", "mlp", d * d, layer)
    add("channel_mix.shift", "mlp", 2 * d, layer)


def _add_linear_attention(cfg: DecoderConfig, add, layer: int) -> None:
    """A Gated DeltaNet layer's parameters (probe.linear_attention): its projections are matmuls ("weight"), its
    convolution, decay rates and gated norm are not."""
    linear, d = cfg.linear_attention, cfg.d_model
    keys, values = linear.key_heads * linear.d_key_head, linear.value_heads * linear.d_value_head
    add("linear_attn.in_proj.weight", "attention", d * (2 * keys + 2 * values + 2 * linear.value_heads), layer)
    add("linear_attn.conv1d", "attention", (2 * keys + values) * linear.conv_kernel, layer)
    add("linear_attn.decay", "attention", 2 * linear.value_heads, layer)  # A_log and dt_bias
    add("linear_attn.norm", "norm", linear.d_value_head, layer)
    add("linear_attn.out_proj.weight", "attention", values * d, layer)


def _add_gemma4_extras(cfg: DecoderConfig, add, layer: int) -> None:
    """Gemma 4's experts beside the dense MLP (26B-A4B: the router with its scale, per-expert scales, the experts'
    gate, up and down projections, three norms) and a layer's use of its per-layer input (E2B, E4B)."""
    d, per_norm = cfg.d_model, _per_norm(cfg)
    if cfg.layer_sparse(layer):
        n, w = cfg.experts.n, cfg.expert_width
        add("experts.router.weight", "mlp", d * n, layer)
        add("experts.router.scales", "mlp", d + n, layer)
        add("experts.experts.weight", "mlp", 3 * n * d * w, layer)
        add("experts.norms", "norm", 3 * d * per_norm, layer)
    if cfg.per_layer_inputs is not None:
        add("per_layer.weight", "per_layer_inputs", 2 * d * cfg.per_layer_inputs.d, layer)
        add("per_layer.ln", "norm", d * per_norm, layer)


def ledger(cfg: DecoderConfig, n_ctx: Optional[int] = None, dtype: torch.dtype = torch.float32) -> Ledger:
    if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 1):
        raise ValueError(f"n_ctx={n_ctx!r}: give a positive number of positions, or None for the model's n_ctx")
    d, m, v = cfg.d_model, cfg.d_mlp, cfg.d_vocab
    rows: list[dict] = []

    def add(component: str, group: str, params: int, layer: Optional[int] = None) -> None:
        if params:
            rows.append({"component": component, "layer": layer, "group": group, "params": params})

    add("embed.weight", "embedding", v * d)
    if cfg.positions in (Positions.LEARNED, Positions.SHORTFORMER):
        add("pos_embed.weight", "embedding", cfg.n_ctx * d)
    if cfg.embed_norm:  # a learned LayerNorm whatever the blocks' norms, never folded; NanoChat's learns nothing
        add("embed.ln", "norm", 2 * d if cfg.embed_norm is True else 0)
    per_norm = _per_norm(cfg)
    norm_params = d * per_norm if cfg.norm_weights else 0  # ln1, ln2, ln_final: see DecoderConfig.norm_weights
    input_params = norm_params if cfg.input_norms else 0  # OLMo 2's blocks normalise only their writes
    for layer in range(cfg.n_layers):
        has_mixer = cfg.layer_has_mixer(layer)  # (NemotronH's MLP-only layers have neither ln1 nor a mixer)
        # a recurrent layer's block is pre-norm whatever the attention layers' are (OLMo-Hybrid's are sandwiches)
        pre_norms = norm_params if cfg.layer_is_linear(layer) else input_params
        add("ln1", "norm", pre_norms * has_mixer * (cfg.first_ln1 or layer > 0), layer)  # (ModernBERT's layer 0: none)
        mixer = _add_attention if cfg.latent_attention is None else _add_latent_attention
        if cfg.mixture_of_attention is not None:
            mixer = _add_mixture_of_attention
        if cfg.layer_is_linear(layer):
            mixer = _add_state_space if cfg.layer_is_state_space(layer) else _add_linear_attention
            if cfg.layer_is_state_space(layer) and cfg.state_space.kind == "mamba1":
                mixer = _add_selective_scan
            if cfg.layer_is_short_conv(layer):
                mixer = _add_short_conv
            if cfg.layer_is_rg_lru(layer):
                mixer = _add_rg_lru
            if cfg.rwkv is not None:
                mixer = _add_rwkv
        if cfg.layer_has_shared_block(layer):  # Zamba2's: a shared block before the layer's Mamba-2 mixer
            add_shared_block(cfg, add, layer)
            mixer = _add_state_space
        if has_mixer:
            mixer(cfg, add, layer)
        if cfg.layer_has_parallel_mixer(layer):  # Falcon-H1's Mamba-2 mixer beside the attention
            _add_state_space(cfg, add, layer, cfg.parallel_state_space, "mamba")
        if not cfg.layer_has_mlp(layer):
            continue
        add("ln2", "norm", pre_norms, layer)
        if cfg.norm_placement is NormPlacement.SANDWICH and not cfg.layer_is_linear(layer):
            add("ln1_post", "norm", d * per_norm, layer)
            add("ln2_post", "norm", d * per_norm, layer)
        if cfg.layer_scalars:  # Gemma 4's experts beside the MLP and per-layer input (its scalar is a buffer)
            _add_gemma4_extras(cfg, add, layer)
        # a mixture of experts: n gated MLPs of their own width and a router (Gemma 4's are beside the MLP, above)
        sparse = cfg.layer_sparse(layer) and not cfg.layer_scalars
        n, w = (cfg.experts.n, cfg.expert_width) if sparse else (1, cfg.layer_d_mlp(layer))
        mlp = "mlp.experts" if sparse else "mlp"
        de = (cfg.experts.latent or d) if sparse else d  # what the experts read and write (NemotronH's latent)
        add("mlp.latent_proj.weight", "mlp", 2 * d * de if de != d else 0, layer)
        add("mlp.latent_proj.bias", "mlp", de + d if de != d and cfg.mlp_bias else 0, layer)
        biased = cfg.mlp_bias and (not sparse or cfg.experts.routed_bias)  # (ERNIE 4.5's router and experts: none)
        if sparse:  # (a selection bias is a buffer, set by a balancing rule: not counted, as transformers does not)
            add("mlp.router.weight", "mlp", d * n, layer)
            add("mlp.router.bias", "mlp", n if biased else 0, layer)
        if cfg.gated_mlp:
            add(f"{mlp}.gate.weight", "mlp", n * de * w, layer)
            add(f"{mlp}.gate.bias", "mlp", n * w if biased else 0, layer)
        add(f"{mlp}.in.weight", "mlp", n * de * w, layer)
        add(f"{mlp}.in.bias", "mlp", n * w if biased else 0, layer)
        add("mlp.act_fn", "mlp", 2 if cfg.activation.learned else 0, layer)  # xIELU's alpha_p and alpha_n
        # a SoLU-LN MLP's LayerNorm over d_mlp, read by W_out (probe.mlp.NormedMLP)
        add("mlp.ln", "norm", 2 * m if cfg.mlp_norm_learned else w * cfg.norm_weights * cfg.sub_norms, layer)  # (BitNet's)
        add(f"{mlp}.out.weight", "mlp", n * w * de, layer)
        add(f"{mlp}.out.bias", "mlp", n * de if biased else 0, layer)
        add("mlp.output_bias", "mlp", d if sparse and cfg.experts.output_bias else 0, layer)  # (JetMoE's)
        shared = (cfg.experts.shared or 0) if sparse else 0
        gate = int(bool(shared) and cfg.experts.shared_gate)  # Qwen2-MoE's shared expert's sigmoid gate
        glu = int(cfg.experts.gated) if sparse else 1  # (NemotronH's shared expert is ungated, as its experts are)
        add("mlp.shared_expert.weight", "mlp", (2 + glu) * d * shared + gate * d if shared else 0, layer)
        add("mlp.shared_expert.bias", "mlp", (1 + glu) * shared + d + gate if shared and cfg.mlp_bias else 0, layer)
    if cfg.per_layer_inputs is not None:  # Gemma 4's per-layer embedding: its table, projection and norm
        spec, wide = cfg.per_layer_inputs, cfg.n_layers * cfg.per_layer_inputs.d
        add("per_layer_embed.weight", "embedding", spec.d_vocab * wide)
        add("per_layer_embed.projection.weight", "per_layer_inputs", d * wide)
        add("per_layer_embed.ln", "norm", spec.d * per_norm)
    if cfg.final_norm:
        add("ln_final", "norm", norm_params)
    if not cfg.tied_embeddings:  # tied: the embedding's row already counts these weights
        add("unembed.weight", "unembedding", d * cfg.d_vocab_out)
    add("unembed.bias", "unembedding", cfg.d_vocab_out if cfg.unembed_bias else 0)
    if cfg.prediction_head is not None:  # ModernBERT's dense, activation and LayerNorm before W_U
        add("unembed.head", "unembedding", d * d + d * cfg.prediction_head.bias + 2 * d)
    return Ledger(cfg=cfg, n_ctx=cfg.n_ctx if n_ctx is None else n_ctx, dtype=dtype, rows=rows)
