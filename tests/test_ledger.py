"""The parameter ledger against published counts and the model's own parameters."""
import pytest
import torch

from probe import DecoderConfig, HookedDecoder
from probe.ledger import ledger

GPT2_SMALL = DecoderConfig(n_layers=12, d_model=768, n_heads=12, d_vocab=50257, n_ctx=1024)


def test_gpt2_small_has_124439808_parameters():
    assert ledger(GPT2_SMALL).total_params == 124_439_808


def test_one_bias_free_block_attention_and_mlp_counts():
    cfg = DecoderConfig(n_layers=1, d_model=512, n_heads=8, d_vocab=10, n_ctx=8, qkv_bias=False, out_bias=False, mlp_bias=False)
    book = ledger(cfg)
    assert book.group_params("attention") == 1_048_576
    assert book.group_params("mlp") == 2_097_152
    assert book.group_params("mlp") / (book.group_params("attention") + book.group_params("mlp")) == pytest.approx(2 / 3)


@pytest.mark.parametrize("overrides", [
    {}, {"tied_embeddings": False}, {"n_kv_heads": 2, "positions": "rotary", "norm": "rms", "gated_mlp": True,
                                     "activation": "silu", "qkv_bias": False, "out_bias": False, "mlp_bias": False},
    {"positions": "sinusoidal", "norm_placement": "post", "final_norm": False},
    {"heads_per_layer": (8, 3, 0)},
    {"norm_placement": "sandwich", "norm": "rms", "positions": "rotary", "scale_embed": True},  # Gemma 2's extra norms
    {"norm_placement": "parallel", "positions": "rotary", "rotary_dim": 4},
    {"norm_weights": False, "qk_norm": True},  # transformer-lens's LNPre: the q/k norms keep their weights
    {"norm_weights": False, "norm": "rms", "norm_placement": "sandwich"},  # RMSPre: so do the post norms
    {"norm": "none", "final_norm": False},  # transformer-lens's normalization_type=None
    {"norm_weights": False, "norm": "rms", "unembed_bias": True, "tied_embeddings": False},  # RMSPre, TL's b_U
    # OLMo 2: write norms only, q and k normalised over all (query / key-value) heads together
    {"norm_placement": "sandwich", "norm": "rms", "positions": "rotary", "input_norms": False, "qk_norm": True,
     "qk_norm_over_heads": True, "n_kv_heads": 2},
    {"positions": "alibi", "embed_norm": True},  # Bloom: no position table, a LayerNorm on the embeddings
    # Mixtral's experts (and a router) in place of the MLP, with and without biases
    {"experts": {"n": 4, "per_token": 2}, "gated_mlp": True, "norm": "rms", "positions": "rotary", "mlp_bias": False},
    {"experts": {"n": 3, "per_token": 1}, "gated_mlp": True},
    {"experts": {"n": 3, "per_token": 2, "shared": 40}, "gated_mlp": True},  # Qwen2-MoE's shared expert and its gate
    # GLM-4.5: a dense first layer (d_mlp) before sparse ones of narrower experts, an ungated shared expert, sigmoid
    # scores with a selection bias (a buffer: no parameter), with and without biases
    *({"experts": {"n": 4, "per_token": 2, "shared": 48, "shared_gate": False, "width": 24, "layers": (False, True, True),
                   "scoring": "sigmoid", "selection_bias": True, "groups": {"n": 2, "kept": 1}, "scaling": 2.5},
       "gated_mlp": True, "mlp_bias": bias} for bias in (False, True)),
    # ERNIE 4.5 MoE: use_bias biases the dense and shared MLPs and the unembedding, not the router or experts
    {"experts": {"n": 4, "per_token": 2, "shared": 48, "shared_gate": False, "width": 24, "layers": (False, True, True),
                 "renormalize": True, "renormalize_min": 1e-12, "selection_bias": True, "routed_bias": False},
     "gated_mlp": True, "mlp_bias": True, "unembed_bias": True, "tied_embeddings": False},
    {"positions": "alibi", "embed_norm": True, "norm": "rms", "norm_weights": False},  # a LayerNorm all the same
    # GPT-OSS: each head's sink logit, biased experts chosen by logit
    {"attn_sinks": True, "experts": {"n": 4, "per_token": 2, "softmax_over": "chosen", "clamped_glu": {}},
     "gated_mlp": True, "norm": "rms_float32", "positions": "rotary", "n_kv_heads": 2},
    # Qwen3.5: Gated DeltaNet layers beside gated attention
    {"linear_attention": {"layers": (True, False, True), "key_heads": 2, "value_heads": 4, "d_key_head": 8,
                          "d_value_head": 12, "conv_kernel": 3}, "attn_output_gate": True, "qk_norm": True,
     "norm": "rms_float32", "positions": "rotary", "gated_mlp": True, "n_kv_heads": 2, "qkv_bias": False},
    # LFM2: short convolutions (with and without biases) beside attention; LFM2-MoE's dense first layer and experts
    *({"short_conv": {"layers": (True, False, True), "conv_kernel": 3, "bias": bias}, "qk_norm": True, "norm": "rms",
       "positions": "rotary", "gated_mlp": True, "n_kv_heads": 2, "qkv_bias": False} for bias in (False, True)),
    {"short_conv": {"layers": (True, False, True)}, "experts": {"n": 4, "per_token": 2, "width": 24,
                                                                 "layers": (False, True, True), "scoring": "sigmoid",
                                                                 "selection_bias": True, "renormalize": True,
                                                                 "renormalize_eps": 1e-6},
     "qk_norm": True, "norm": "rms", "positions": "rotary", "gated_mlp": True, "mlp_bias": False},
    # NemotronH: one sublayer per layer (Mamba-2, attention, ungated latent experts beside an ungated shared one)
    *({"sublayers": ("mixer", "attn", "mlp"), "state_space": {"layers": (True, False, False), "n_heads": 4,
                                                              "d_head": 16, "d_state": 8, "n_groups": 2},
       "experts": {"n": 4, "per_token": 2, "shared": 40, "shared_gate": False, "width": 24, "gated": False,
                   "layers": (False, False, True), "latent": latent, "routed_bias": False, "selection_bias": True},
       "activation": "relu2", "norm": "rms", "positions": "rotary", "mlp_bias": bias}
      for latent, bias in ((None, False), (16, True))),
    # OLMo-Hybrid: pre-norm Gated DeltaNet layers beside OLMo 3's sandwich attention (no input norms, q/k norms over
    # every head), beta in (0, 2)
    {"linear_attention": {"layers": (True, False, True), "key_heads": 4, "value_heads": 4, "d_key_head": 8,
                          "d_value_head": 12, "beta_scale": 2.0, "norm_eps": 1e-5},
     "norm_placement": "sandwich", "input_norms": False, "qk_norm": True, "qk_norm_over_heads": True, "norm": "rms",
     "positions": "rotary", "rotary_layers": (False,) * 3, "gated_mlp": True, "n_kv_heads": 2, "qkv_bias": False},
    # Zamba2: Mamba-2 layers, two running one shared block (counted once) with adapters of their own, heads 2 d_model
    # wide in all, grouped keys and values without attention adapters
    *({"shared_blocks": {"layers": (True, False, True), "n_blocks": 1, "adapter_rank": 4, "attention_adapters": adapt},
       "state_space": {"layers": (True,) * 3, "n_heads": 4, "d_head": 32, "d_state": 8, "n_groups": 2},
       "d_head": 16, "n_kv_heads": 8 if adapt else 2, "attn_only": True, "gated_mlp": True, "norm": "rms",
       "positions": "rotary", "qkv_bias": False, "out_bias": False, "mlp_bias": False} for adapt in (True, False)),
    # Jamba: Mamba-1 mixers with learned dt/B/C norms beside NoPE attention, experts in one layer
    {"state_space": {"layers": (True, False, True), "n_heads": 128, "d_head": 1, "d_state": 8, "kind": "mamba1",
                     "dt_rank": 4, "bcdt_norm_eps": 1e-6, "bcdt_norm_weights": True, "proj_bias": True},
     "experts": {"n": 4, "per_token": 2, "layers": (False, True, False)}, "rotary_layers": (False,) * 3,
     "norm": "rms", "positions": "rotary", "gated_mlp": True, "n_kv_heads": 2, "qkv_bias": False, "mlp_bias": False},
    # RecurrentGemma: Griffin's recurrent blocks (a wider LRU, block-diagonal gates) beside multi-query local attention
    {"rg_lru": {"layers": (True, True, False), "width": 96, "n_blocks": 8, "conv_kernel": 4}, "n_kv_heads": 1,
     "sliding_window": 8, "norm": "rms_float32", "positions": "rotary", "rotary_dim": 4, "gated_mlp": True,
     "qkv_bias": False, "scale_embed": True, "logit_softcap": 30.0},
    # RWKV-4: a time mix narrower than the residual (four projections, decay rates, bonuses, three token-shift mixes)
    # and a channel mix (key, value, receptance, two mixes), after a LayerNorm of the embedding
    {"rwkv": {"d_attention": 48}, "embed_norm": True, "activation": "relu2", "positions": "rotary", "mlp_bias": False,
     "tied_embeddings": False},
    # JetMoE: attention experts (each with its own queries and output) over shared keys, MLP experts with an output bias
    {"mixture_of_attention": {"n": 4, "per_token": 2}, "n_kv_heads": 4, "d_head": 8, "experts": {
        "n": 4, "per_token": 2, "softmax_over": "chosen", "output_bias": True}, "norm": "rms", "positions": "rotary",
     "gated_mlp": True, "qkv_bias": False, "out_bias": False, "mlp_bias": False},
    # Laguna: each layer's own heads over shared keys, a softplus gate per head (with the q/k/v biases' zero bias),
    # the windowed layers rotating whole heads, a capped router over experts beside an ungated shared one
    {"heads_per_layer": (8, 4, 6), "n_kv_heads": 2, "attn_output_gate": True,
     "output_gate": {"activation": "softplus", "per_head": True}, "qk_norm": True, "positions": "rotary",
     "rotary_dim": 4, "sliding_window": 4, "sliding_layers": (True, False, True), "sliding_rotary_dim": 8,
     "norm": "rms", "gated_mlp": True, "mlp_bias": False, "experts": {
         "n": 4, "per_token": 2, "scoring": "sigmoid", "selection_bias": True, "renormalize": True, "shared": 24,
         "shared_gate": False, "width": 16, "layers": (False, True, True), "router_softcap": 30.0}},
])
def test_ledger_total_equals_the_models_unique_parameters(overrides):
    cfg = DecoderConfig(n_layers=3, d_model=64, n_heads=8, d_vocab=100, n_ctx=32, **overrides)
    with torch.device("meta"):
        model = HookedDecoder(cfg)
    assert ledger(cfg).total_params == sum(p.numel() for p in model.parameters())  # parameters() counts tied ones once


def test_a_mixture_of_experts_counts_every_expert_but_runs_per_token_of_them():
    dense = DecoderConfig(n_layers=2, d_model=64, n_heads=8, d_vocab=100, n_ctx=32, gated_mlp=True, mlp_bias=False)
    sparse = DecoderConfig(n_layers=2, d_model=64, n_heads=8, d_vocab=100, n_ctx=32, gated_mlp=True, mlp_bias=False,
                           experts={"n": 8, "per_token": 2})
    experts = 2 * 8 * 3 * 64 * 256  # layers x experts x (gate, up, down) x d_model x d_mlp
    assert ledger(sparse).group_params("mlp") == experts + 2 * 64 * 8  # and each layer's router
    # per token: two experts' matmuls and the router's, 2 FLOPs a weight
    assert ledger(sparse).flops_per_token - ledger(dense).flops_per_token == 2 * (experts // 4 + 2 * 64 * 8 - experts // 8)


def test_attention_experts_count_every_expert_but_run_per_token_of_them():
    """JetMoE's: of n attention experts' query and output projections, a token runs per_token; the shared key/value
    projection and the router every token runs."""
    common = dict(n_layers=2, d_model=64, n_heads=8, n_kv_heads=4, d_head=8, d_vocab=100, n_ctx=32, norm="rms",
                  positions="rotary", gated_mlp=True, qkv_bias=False, out_bias=False, mlp_bias=False)
    moa = DecoderConfig(**common, mixture_of_attention={"n": 4, "per_token": 2})
    experts = 2 * 2 * 4 * 64 * 32  # layers x (q, o) x experts x d_model x (kv_heads d_head)
    shared = 2 * (2 * 64 * 32 + 64 * 4 + 64)  # layers x (k and v, the router, b_O)
    assert ledger(moa).group_params("attention") == experts + shared
    dense = DecoderConfig(**{**common, "n_heads": 4})  # the same keys and values, one expert's queries and output
    # per token and layer: the router, two experts' q and o, k and v; against q, k, v and o; then 4 more heads' scores
    # and weighted sums over 32 keys of d_head 8, 2 FLOPs a multiply-add
    moa_weights, dense_weights = 64 * 4 + 2 * 2 * 64 * 32 + 2 * 64 * 32, 4 * 64 * 32
    assert ledger(moa).flops_per_token - ledger(dense).flops_per_token == 2 * 2 * (moa_weights - dense_weights) + (
        2 * 2 * 4 * 32 * (8 + 8))


def test_kv_bytes_and_flops():
    book = ledger(GPT2_SMALL, n_ctx=1024, dtype=torch.bfloat16)
    assert book.kv_bytes_per_token == 2 * 12 * 768 * 2  # keys and values, every layer, 2 bytes each
    assert book.kv_bytes_per_sequence == 1024 * book.kv_bytes_per_token
    # 2 FLOPs per weight in the non-embedding matmuls plus the unembedding, plus attention over 1024 keys
    non_embedding = 12 * (4 * 768 * 768 + 2 * 768 * 3072)
    assert book.flops_per_token == 2 * (non_embedding + 50257 * 768) + 4 * 12 * 768 * 1024
    frame = book.to_frame()
    assert frame["params"].sum() == book.total_params and set(frame.columns) == {"component", "layer", "group", "params"}
    assert HookedDecoder(DecoderConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=5, n_ctx=4)).ledger().total_params > 0


@pytest.mark.parametrize("n_ctx", [0, -5, 2.5, True])
def test_a_context_length_must_be_a_positive_int(n_ctx):
    """0 used to mean "the model's n_ctx" and -5 gave negative FLOPs, both silently."""
    with pytest.raises(ValueError, match="positive number of positions"):
        ledger(GPT2_SMALL, n_ctx=n_ctx)


def test_windowed_layers_count_only_the_keys_they_see():
    """Attention FLOPs: 4 * heads * d_head per key; a windowed layer sees min(n_ctx, window) keys."""
    import dataclasses

    gemma2_like = dataclasses.replace(GPT2_SMALL, positions="rotary", sliding_window=256,
                                      sliding_layers=tuple(l % 2 == 0 for l in range(12)))
    full, windowed = ledger(GPT2_SMALL, n_ctx=1024), ledger(gemma2_like, n_ctx=1024)
    assert full.flops_per_token - windowed.flops_per_token == 6 * 4 * 12 * 64 * (1024 - 256)  # six windowed layers
    short = ledger(gemma2_like, n_ctx=100)  # shorter than the window: every layer sees every key
    assert short.flops_per_token == ledger(dataclasses.replace(GPT2_SMALL, positions="rotary"), n_ctx=100).flops_per_token
