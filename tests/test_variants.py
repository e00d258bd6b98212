"""Decoder variants and the checkpoint families (Llama, Qwen2/3, Mistral, OLMo, OLMo 2, OLMo 3, Gemma, Gemma 2, Gemma 3, GPT-1,
GPT-NeoX,
GPT-Neo, GPT-J, OPT, Phi, Phi-3), each
against `transformers`."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from probe import DecoderConfig, HookedDecoder, NormPlacement, Positions


def perturbed(model, seed=0):
    """transformers initialises norms to 1 and biases to 0; random values make the comparison see them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and name.endswith("weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    return model.eval()


def build(kind, directory, **overrides):
    import transformers as tf

    if kind == "llama":
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=40, tie_word_embeddings=False)
        cfg = tf.LlamaConfig(**{**settings, **overrides})
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        settings = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                        num_key_value_heads=3, max_position_embeddings=40, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        cfg = tf.Qwen2Config(**{**settings, **overrides})
        model = tf.Qwen2ForCausalLM(cfg)
    elif kind == "neox":  # Pythia's layout: parallel sublayers, a quarter of each head rotated, an untied head
        settings = dict(vocab_size=103, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=40, layer_norm_eps=1e-4,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25})
        cfg = tf.GPTNeoXConfig(**{**settings, **overrides})
        model = tf.GPTNeoXForCausalLM(cfg)
    elif kind == "mistral":  # Llama without biases; a sliding window shorter than the tests' sequences
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=8, max_position_embeddings=40, sliding_window=6)
        cfg = tf.MistralConfig(**{**settings, **overrides})
        model = tf.MistralForCausalLM(cfg)
    elif kind == "gemma":  # (1 + w) norms, embeddings times sqrt(d_model), GeGLU, d_head * n_heads != d_model
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=24, max_position_embeddings=40)
        model = tf.GemmaForCausalLM(tf.GemmaConfig(**{**settings, **overrides}))
    elif kind == "gemma2":  # and sandwich norms, soft caps small enough to bite, a window on every other layer
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=24, max_position_embeddings=40, sliding_window=6,
                        query_pre_attn_scalar=20, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**{**settings, **overrides}))
    elif kind == "vaultgemma":  # Gemma 2's settings in a pre-norm block (no norms of the sublayers' writes)
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=24, max_position_embeddings=40, sliding_window=6,
                        query_pre_attn_scalar=20, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
        model = tf.VaultGemmaForCausalLM(tf.VaultGemmaConfig(**{**settings, **overrides}))
    elif kind == "gemma3":  # Gemma 2's block, q/k norms, local layers with their own rotary base, no score cap
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=40, sliding_window=6,
                        query_pre_attn_scalar=20, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**{**settings, **overrides}))
    elif kind == "llama4":  # chunked rope layers (interleaved pairs, llama3-rescaled) with a weightless q/k norm after
        # the rotation, a NoPE layer whose temperature tuning bites within the tests' prompts, dense and MoE layers mixed
        settings = dict(vocab_size=101, hidden_size=32, intermediate_size=24, intermediate_size_mlp=40,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        max_position_embeddings=40, num_local_experts=4, num_experts_per_tok=1,
                        interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 1], attention_chunk_size=6, floor_scale=4,
                        attn_scale=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 16})
        model = tf.Llama4ForCausalLM(tf.Llama4TextConfig(**{**settings, **overrides}))
        gen = torch.Generator().manual_seed(8)
        with torch.no_grad():  # a router whose sigmoids are far from 1/2, experts whose writes rival the shared one's
            for layer in model.model.layers:
                if layer.is_moe_layer:
                    moe = layer.feed_forward
                    moe.router.weight.copy_(torch.randn(moe.router.weight.shape, generator=gen))
                    moe.experts.gate_up_proj.mul_(10), moe.experts.down_proj.mul_(10)
    elif kind == "afmoe":  # sandwich norms, q/k norms, gated heads, NoPE full layers, a window, DeepSeek-style experts
        settings = dict(vocab_size=101, hidden_size=32, intermediate_size=48, moe_intermediate_size=12,
                        num_hidden_layers=4, num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, max_position_embeddings=40, num_experts=4, num_experts_per_tok=2,
                        num_shared_experts=1, route_scale=1.5, global_attn_every_n_layers=2, sliding_window=4,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
        model = tf.AfmoeForCausalLM(tf.AfmoeConfig(**{**settings, **overrides}))
        with torch.no_grad():  # (the selection bias, which `perturbed` leaves at zero, and a router that is not)
            for layer in model.model.layers[{**settings, **overrides}["num_dense_layers"]:]:
                layer.mlp.expert_bias.copy_(torch.linspace(-0.2, 0.2, layer.mlp.expert_bias.numel()))
                layer.mlp.router.gate.weight.normal_(0, 0.5)
    elif kind == "laguna":  # heads per layer over shared keys, softplus gates, per-kind rope, sparse and dense layers
        settings = dict(vocab_size=101, hidden_size=32, intermediate_size=48, moe_intermediate_size=12,
                        shared_expert_intermediate_size=20, num_hidden_layers=4, num_attention_heads=4,
                        num_attention_heads_per_layer=[4, 8, 2, 6], num_key_value_heads=2, head_dim=8,
                        max_position_embeddings=40, num_experts=4, num_experts_per_tok=2, moe_routed_scaling_factor=1.5,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                        sliding_window=4, mlp_layer_types=["dense", "sparse", "sparse", "dense"],
                        moe_router_logit_softcapping=0.4,
                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0,
                                                            "partial_rotary_factor": 0.5},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0,
                                                               "partial_rotary_factor": 1.0}})
        model = tf.LagunaForCausalLM(tf.LagunaConfig(**{**settings, **overrides}))
        with torch.no_grad():  # (a router that is not near uniform; `perturbed` draws the selection bias)
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.weight.normal_(0, 0.5)
    elif kind == "gemma4":  # Gemma 3's block with value norms, unscaled scores and scaled layer outputs; wider
        # full-attention heads whose values are their keys, a quarter of them rotating; the last two layers reusing
        # keys and values with MLPs twice as wide; per-layer token inputs; a window shorter than the tests' inputs
        kinds = ["sliding_attention", "sliding_attention", "full_attention"] * 2
        settings = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
                        sliding_window=4, layer_types=kinds, max_position_embeddings=40,
                        vocab_size_per_layer_input=overrides.get("vocab_size", 101),
                        hidden_size_per_layer_input=4, attention_k_eq_v=True, num_kv_shared_layers=2,
                        use_double_wide_mlp=True, final_logit_softcapping=30.0, pad_token_id=0)
        model = tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(**{**settings, **overrides}))
        with torch.no_grad():  # (buffers and scales, which `perturbed` leaves at their initial ones)
            for index, layer in enumerate(model.model.layers):
                layer.layer_scalar.fill_(0.6 + 0.1 * index)
                if layer.enable_moe_block:
                    layer.router.scale.copy_(torch.linspace(0.5, 1.5, layer.router.scale.numel()))
                    layer.router.per_expert_scale.copy_(torch.linspace(0.7, 1.3, layer.router.per_expert_scale.numel()))
    elif kind == "olmo":  # Llama's block with LayerNorms that learn nothing
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=40, pad_token_id=1, eos_token_id=2)
        model = tf.OlmoForCausalLM(tf.OlmoConfig(**{**settings, **overrides}))
    elif kind == "olmo2":  # no input norms, an RMSNorm on each write, q and k normalised over all heads together
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=40, pad_token_id=1, eos_token_id=2)
        model = tf.Olmo2ForCausalLM(tf.Olmo2Config(**{**settings, **overrides}))
    elif kind == "olmo3":  # OLMo 2's block, three sliding layers in four with their own rope, YaRN on the full ones
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=1, eos_token_id=2, sliding_window=6,
                        rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                                                            "original_max_position_embeddings": 16},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 300.0}})
        model = tf.Olmo3ForCausalLM(tf.Olmo3Config(**{**settings, **overrides}))
    elif kind == "qwen3":  # Llama's layout with each head's q and k RMS-normalised before rotary
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=40, tie_word_embeddings=True)
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**{**settings, **overrides}))
    elif kind == "gptneo":  # unscaled q.k, bias-free q/k/v, "local" layers with a window shorter than the sequences
        settings = dict(vocab_size=101, hidden_size=64, num_layers=3, num_heads=4, max_position_embeddings=40,
                        window_size=5, attention_types=[[["global", "local"], 1], [["local"], 1]])
        model = tf.GPTNeoForCausalLM(tf.GPTNeoConfig(**{**settings, **overrides}))
    elif kind == "opt":  # separate q/k/v/out projections, ReLU, a position table offset by two rows
        settings = dict(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=96,
                        max_position_embeddings=40)
        model = tf.OPTForCausalLM(tf.OPTConfig(**{**settings, **overrides}))
    elif kind == "gptj":  # one norm for two parallel sublayers, adjacent-pair rotary on part of each head
        settings = dict(vocab_size=101, n_embd=64, n_layer=2, n_head=4, n_positions=40, rotary_dim=8)
        model = tf.GPTJForCausalLM(tf.GPTJConfig(**{**settings, **overrides}))
    elif kind == "phi":  # a parallel block reading one norm, partial rotary, biased q/k/v, an unembedding bias
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=40, partial_rotary_factor=0.4)
        model = tf.PhiForCausalLM(tf.PhiConfig(**{**settings, **overrides}))
    elif kind == "phi3":  # Llama's block with fused q/k/v and gate/up projections
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=40, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**{**settings, **overrides}))
    elif kind == "bloom":  # ALiBi instead of positions, a LayerNorm on the embeddings, q/k/v fused per head
        settings = dict(vocab_size=101, hidden_size=64, n_layer=2, n_head=4, seq_length=40)
        model = tf.BloomForCausalLM(tf.BloomConfig(**{**settings, **overrides}))
    elif kind == "mixtral":  # Mistral's attention, a router choosing two of four experts, their weights renormalised
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=2, max_position_embeddings=40, num_local_experts=4, num_experts_per_tok=2)
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**{**settings, **overrides}))
    elif kind == "phimoe":  # Mixtral's layout with LayerNorms, sparsemixer routing by a router far from uniform
        settings = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, num_local_experts=4, num_experts_per_tok=2)
        model = tf.PhimoeForCausalLM(tf.PhimoeConfig(**{**settings, **overrides}))
        with torch.no_grad():  # (at init every logit is near 0, and the mask around the best keeps most experts)
            for index, layer in enumerate(model.model.layers):
                weight = layer.mlp.router.weight
                weight.copy_(0.5 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(index)))
    elif kind == "olmoe":  # q and k normalised over all heads; three of six experts, weights as the softmax gave them
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=40, num_experts=6, num_experts_per_tok=3, pad_token_id=1, eos_token_id=2)
        model = tf.OlmoeForCausalLM(tf.OlmoeConfig(**{**settings, **overrides}))
    elif kind == "qwen3_moe":  # each head's q and k normalised; the experts narrower than the dense width
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=40,
                        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=40, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**{**settings, **overrides}))
    elif kind == "falcon":  # Falcon-7B's block: parallel sublayers reading one norm, one key/value head, no biases
        settings = dict(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=40)
        model = tf.FalconForCausalLM(tf.FalconConfig(**{**settings, **overrides}))
    elif kind == "smollm3":  # Llama's layers, every fourth without positions (NoPE)
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, pad_token_id=1, bos_token_id=2, eos_token_id=3)
        model = tf.SmolLM3ForCausalLM(tf.SmolLM3Config(**{**settings, **overrides}))
    elif kind == "mpt":  # ALiBi, no biases anywhere (its LayerNorms' too), an exact-GELU MLP
        settings = dict(vocab_size=101, d_model=64, n_heads=8, n_layers=2, max_seq_len=40)
        model = tf.MptForCausalLM(tf.MptConfig(**{**settings, **overrides}))
    elif kind == "stablelm":  # Llama's layers with LayerNorms (biased), a quarter of each head rotated, q/k/v biases
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, use_qkv_bias=True)
        model = tf.StableLmForCausalLM(tf.StableLmConfig(**{**settings, **overrides}))
    elif kind == "qwen2_moe":  # Qwen2's attention, routed experts and a shared one every token runs, behind a gate
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=40,
                        shared_expert_intermediate_size=56, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=2, max_position_embeddings=40, num_experts=4, num_experts_per_tok=2)
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**{**settings, **overrides}))
    elif kind == "glm4_moe":  # a dense first layer; sigmoid-scored experts, biased choice in the best 2 of 4 groups
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=40, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                        n_shared_experts=2, routed_scaling_factor=2.5, first_k_dense_replace=1)
        model = tf.Glm4MoeForCausalLM(tf.Glm4MoeConfig(**{**settings, **overrides}))
        with torch.no_grad():  # a router sharp enough, and a bias large enough, to change which experts run
            gen = torch.Generator().manual_seed(5)
            for layer in model.model.layers[model.config.first_k_dense_replace:]:
                layer.mlp.gate.weight.mul_(10)
                layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(model.config.n_routed_experts,
                                                                               generator=gen))
    elif kind == "bigcode":  # GPT-2's block with nn.Linear layers and one key/value head for every query head
        settings = dict(vocab_size=101, n_embd=64, n_layer=2, n_head=4, n_positions=40, n_inner=80)
        model = tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(**{**settings, **overrides}))
    elif kind == "gpt_oss":  # sinks, windows on every other layer, YaRN, experts chosen by logit with a clamped GLU
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=40, sliding_window=6,
                        num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.1)
        model = tf.GptOssForCausalLM(tf.GptOssConfig(**{**settings, **overrides}))
        with torch.no_grad():  # sink logits as large as the scores (initialised near 0, they would hardly matter)
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=torch.Generator().manual_seed(5)))
    elif kind == "apertus":  # q/k norms, an ungated MLP with xIELU (learned per layer), Llama 3's rope scaling
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 12e6, "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
        model = tf.ApertusForCausalLM(tf.ApertusConfig(**{**settings, **overrides}))
        gen = torch.Generator().manual_seed(6)
        with torch.no_grad():  # each layer's xIELU its own, far from the defaults (eps large enough to bite)
            for layer in model.model.layers if overrides.get("hidden_act", "xielu") == "xielu" else ():
                act = layer.mlp.act_fn
                for name, low, high in (("alpha_p", -1.0, 1.0), ("alpha_n", -1.0, 1.0), ("beta", 0.2, 0.8),
                                        ("eps", -0.5, -0.1)):
                    getattr(act, name).copy_(low + (high - low) * torch.rand(getattr(act, name).shape, generator=gen))
    elif kind == "arcee":  # Llama's attention, an ungated relu^2 MLP
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, bos_token_id=1, eos_token_id=2)
        model = tf.ArceeForCausalLM(tf.ArceeConfig(**{**settings, **overrides}))
    elif kind == "granite":  # Llama's layers with Granite's four scalars, far from 1
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, embedding_multiplier=6.0,
                        residual_multiplier=0.3, attention_multiplier=0.1, logits_scaling=4.0, tie_word_embeddings=True)
        model = tf.GraniteForCausalLM(tf.GraniteConfig(**{**settings, **overrides}))
    elif kind == "granitemoe":  # Granite's scalars around experts chosen by logit, weighted by the chosen's softmax
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, embedding_multiplier=6.0,
                        residual_multiplier=0.3, attention_multiplier=0.1, logits_scaling=4.0, num_local_experts=4,
                        num_experts_per_tok=2)
        model = tf.GraniteMoeForCausalLM(tf.GraniteMoeConfig(**{**settings, **overrides}))
    elif kind == "xglm":  # OPT's names, embeddings times sqrt(d_model), fairseq's sinusoids for positions
        settings = dict(vocab_size=101, d_model=64, ffn_dim=96, num_layers=2, attention_heads=4,
                        max_position_embeddings=40, dropout=0.0, attention_dropout=0.0, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2)
        model = tf.XGLMForCausalLM(tf.XGLMConfig(**{**settings, **overrides}))
    elif kind == "exaone":  # Llama's model (transformers runs it) under GPT-2-style tensor names
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, eos_token_id=None)
        model = tf.AutoModelForCausalLM.from_config(tf.ExaoneConfig(**{**settings, **overrides}))
    elif kind == "codegen":  # GPT-J's block, q/v/k fused per model-parallel shard
        settings = dict(vocab_size=101, n_embd=64, n_layer=2, n_head=4, n_positions=40, rotary_dim=8, n_inner=96)
        model = tf.CodeGenForCausalLM(tf.CodeGenConfig(**{**settings, **overrides}))
    elif kind == "cohere":  # a parallel block reading one bias-free LayerNorm, adjacent-pair rotary, a logit scale
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, logit_scale=0.5, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
        model = tf.CohereForCausalLM(tf.CohereConfig(**{**settings, **overrides}))
    elif kind == "cohere2":  # Cohere's block; three windowed, rotating layers in four, the fourth without positions
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, logit_scale=0.5, sliding_window=5,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = tf.Cohere2ForCausalLM(tf.Cohere2Config(**{**settings, **overrides}))
    elif kind == "qwen3_5":  # Gated DeltaNet layers (three in four) and gated attention, zero-centred norms
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                        max_position_embeddings=40, tie_word_embeddings=False)
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**{**settings, **overrides}))
    elif kind in ("qwen3_5_moe", "qwen3_next"):  # and experts with a shared one; Qwen3-Next's projections fused
        settings = dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                        linear_value_head_dim=12, max_position_embeddings=40, tie_word_embeddings=False, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32)
        if kind == "qwen3_5_moe":
            model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**{**settings, **overrides}))
        else:
            model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**{**settings, "norm_topk_prob": False, **overrides}))
    elif kind == "olmo_hybrid":  # OLMo 3's post-norm attention (NoPE, as released) among pre-norm Gated DeltaNet layers
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=4,
                        linear_key_head_dim=8, linear_value_head_dim=12, max_position_embeddings=40,
                        rope_parameters={"rope_type": "default", "rope_theta": None}, pad_token_id=0, eos_token_id=2)
        model = tf.OlmoHybridForCausalLM(tf.OlmoHybridConfig(**{**settings, **overrides}))
        with torch.no_grad():  # (transformers draws A from [0, 16]: most heads forget at once; a gentler decay shows)
            for layer in model.model.layers:
                if hasattr(layer, "linear_attn"):
                    layer.linear_attn.A_log.copy_(torch.rand(layer.linear_attn.A_log.shape, generator=torch.Generator().manual_seed(6)).log())
    elif kind == "starcoder2":  # LayerNorms, an ungated tanh-GELU MLP, biases everywhere, a window
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, sliding_window=6, bos_token_id=1,
                        eos_token_id=2)
        model = tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**{**settings, **overrides}))
    elif kind == "nemotron":  # LayerNorm1P (w - 1 stored), relu^2, rotary on half of each head
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, bos_token_id=1, eos_token_id=2)
        model = tf.NemotronForCausalLM(tf.NemotronConfig(**{**settings, **overrides}))
    elif kind == "jais2":  # LayerNorms, an ungated relu^2 MLP, biases everywhere by default
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, bos_token_id=1, eos_token_id=2)
        model = tf.Jais2ForCausalLM(tf.Jais2Config(**{**settings, **overrides}))
    elif kind == "seed_oss":  # Llama with q/k/v biases and the output's own switch
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=40, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2)
        model = tf.SeedOssForCausalLM(tf.SeedOssConfig(**{**settings, **overrides}))
    elif kind in ("glm", "glm4"):  # q/k/v biases, half of each head rotated in adjacent pairs, gate and up fused
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=40, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2)
        config, causal = (tf.GlmConfig, tf.GlmForCausalLM) if kind == "glm" else (tf.Glm4Config, tf.Glm4ForCausalLM)
        model = causal(config(**{**settings, **overrides}))
    elif kind == "flex_olmo":  # OLMo 2's write norms and q/k norms over every head, OLMoE's experts
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=40,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = tf.FlexOlmoForCausalLM(tf.FlexOlmoConfig(**{**settings, **overrides}))
    elif kind == "exaone4":  # write norms only, per-head q/k norms, three windowed rotating layers in four, NoPE full
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, sliding_window=5, bos_token_id=1,
                        eos_token_id=2, layer_types=["sliding_attention"] * 3 + ["full_attention"])
        model = tf.Exaone4ForCausalLM(tf.Exaone4Config(**{**settings, **overrides}))
    elif kind == "hunyuan":  # q and k normalised after rotary, the alpha-stretched rope base
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=40, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 50.0,
                                                         "factor": 1.0})
        model = tf.HunYuanDenseV1ForCausalLM(tf.HunYuanDenseV1Config(**{**settings, **overrides}))
    elif kind == "nanochat":  # weightless norms (one after the embedding), q/k norms after rotating the other way, a cap
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, final_logit_softcapping=3.0, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
        model = tf.NanoChatForCausalLM(tf.NanoChatConfig(**{**settings, **overrides}))
    elif kind == "bitnet":  # Llama with a gated relu^2 MLP and an RMSNorm before each output projection
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, bos_token_id=1, eos_token_id=2)
        model = tf.BitNetForCausalLM(tf.BitNetConfig(**{**settings, **overrides}))
    elif kind == "ernie4_5":  # Llama with adjacent-pair rotary and one switch for every bias, tied
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=40)
        model = tf.Ernie4_5ForCausalLM(tf.Ernie4_5Config(**{**settings, **overrides}))
    elif kind in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "youtu", "glm_moe_dsa"):  # latent attention
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=20, qk_rope_head_dim=8,
                        qk_nope_head_dim=12, v_head_dim=16, max_position_embeddings=40, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2)
        experts = dict(n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
                       routed_scaling_factor=1.5, n_group=2, topk_group=1)  # (a dense first layer, then experts)
        settings.update({"deepseek_v3": dict(first_k_dense_replace=1, **experts),
                         "deepseek_v2": dict(first_k_dense_replace=1, topk_method="group_limited_greedy", **experts),
                         "glm4_moe_lite": dict(mlp_layer_types=["dense", "sparse"], **experts),
                         # GLM-5's sparse attention: an index_topk well under the tests' lengths, so keys are dropped
                         "glm_moe_dsa": dict(first_k_dense_replace=1, index_topk=5, index_head_dim=16, index_n_heads=4,
                                             **experts)}.get(kind, {}))
        config, causal = {"deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM),
                          "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
                          "glm4_moe_lite": (tf.Glm4MoeLiteConfig, tf.Glm4MoeLiteForCausalLM),
                          "youtu": (tf.YoutuConfig, tf.YoutuForCausalLM),
                          "glm_moe_dsa": (tf.GlmMoeDsaConfig, tf.GlmMoeDsaForCausalLM)}[kind]
        model = causal(config(**{**settings, **overrides}))
    elif kind == "minimax_m2":  # q/k norms over all heads, half of each head rotated, sigmoid-scored experts, biased choice
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, rotary_dim=8, max_position_embeddings=40,
                        num_local_experts=6, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = tf.MiniMaxM2ForCausalLM(tf.MiniMaxM2Config(**{**settings, **overrides}))
        with torch.no_grad():  # a router sharp enough, and a bias large enough, to change which experts run
            gen = torch.Generator().manual_seed(5)
            for layer in model.model.layers:
                layer.mlp.gate.weight.mul_(10)
                layer.mlp.e_score_correction_bias.copy_(0.3 * torch.randn(model.config.num_local_experts, generator=gen))
    elif kind == "ernie4_5_moe":  # a dense first layer, softmax-scored experts (a biased choice) and a shared one
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40,
                        moe_num_experts=6, moe_k=2, moe_num_shared_experts=1)
        model = tf.Ernie4_5_MoeForCausalLM(tf.Ernie4_5_MoeConfig(**{**settings, **overrides}))
        with torch.no_grad():  # scores far enough apart that the selection bias (perturbed below) changes some choices
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.weight.mul_(10)
    elif kind == "granitemoehybrid":  # Mamba-2 layers and one attention layer, experts beside a shared MLP
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40, num_local_experts=4,
                        num_experts_per_tok=2, shared_intermediate_size=48, mamba_n_heads=8, mamba_d_head=16,
                        mamba_n_groups=2, mamba_d_state=16, mamba_expand=2, position_embedding_type="rope",
                        layer_types=["mamba", "attention", "mamba"], embedding_multiplier=2.0, residual_multiplier=0.5,
                        attention_multiplier=0.3, logits_scaling=3.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(**{**settings, **overrides}))
        with torch.no_grad():  # (transformers starts every head alike: A = 1..heads, D = 1, dt_bias = 1)
            for layer in model.model.layers:
                if layer.mamba is not None:
                    for param, low, high in ((layer.mamba.A_log, -1, 1), (layer.mamba.D, -1, 1),
                                             (layer.mamba.dt_bias, -2, 1)):
                        param.copy_(low + (high - low) * torch.rand(param.shape, generator=torch.Generator().manual_seed(5)))
    elif kind == "bamba":  # Mamba-2 layers around an attention layer rotating half of each head, a gated MLP
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40, mamba_n_heads=8,
                        mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_expand=2, attn_layer_indices=[1],
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = tf.BambaForCausalLM(tf.BambaConfig(**{**settings, **overrides}))
        with torch.no_grad():  # (transformers starts every head alike: A = 1..heads, D = 1, dt_bias = 1)
            for layer in model.model.layers:
                if getattr(layer, "mamba", None) is not None:
                    for param, low, high in ((layer.mamba.A_log, -1, 1), (layer.mamba.D, -1, 1),
                                             (layer.mamba.dt_bias, -2, 1)):
                        param.copy_(low + (high - low) * torch.rand(param.shape, generator=torch.Generator().manual_seed(5)))
    elif kind == "mamba2":  # every layer a Mamba-2 mixer, no MLP, no attention
        settings = dict(vocab_size=101, hidden_size=64, num_hidden_layers=3, num_heads=8, head_dim=16, state_size=16,
                        n_groups=2, expand=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = tf.Mamba2ForCausalLM(tf.Mamba2Config(**{**settings, **overrides}))
        with torch.no_grad():  # (transformers starts every head alike: A = 1..heads, D = 1)
            for layer in model.backbone.layers:
                for param, low, high in ((layer.mixer.A_log, -1, 1), (layer.mixer.D, -1, 1),
                                         (layer.mixer.dt_bias, -2, 1)):
                    param.copy_(low + (high - low) * torch.rand(param.shape, generator=torch.Generator().manual_seed(5)))
    elif kind in ("mamba", "falcon_mamba"):  # every layer a Mamba-1 mixer, no MLP, no attention
        settings = dict(vocab_size=101, hidden_size=32, num_hidden_layers=3, state_size=8, expand=2,
                        time_step_rank=6, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        config = (tf.MambaConfig if kind == "mamba" else tf.FalconMambaConfig)(**{**settings, **overrides})
        model = (tf.MambaForCausalLM if kind == "mamba" else tf.FalconMambaForCausalLM)(config)
        with torch.no_grad():  # (transformers starts every channel alike: A = 1..d_state, D = 1)
            for layer in model.backbone.layers:
                for param, low, high in ((layer.mixer.A_log, -1, 1), (layer.mixer.D, -1, 1),
                                         (layer.mixer.dt_proj.bias, -2, 1)):
                    param.copy_(low + (high - low) * torch.rand(param.shape, generator=torch.Generator().manual_seed(5)))
    elif kind == "nemotron_h":  # one sublayer per layer: Mamba-2, routed experts, attention (no positions), an MLP
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=48, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=40, mamba_num_heads=8,
                        mamba_head_dim=16, n_groups=2, ssm_state_size=16, n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=24, moe_shared_expert_intermediate_size=32, n_group=2, topk_group=1,
                        routed_scaling_factor=1.5, layers_block_type=["mamba", "moe", "attention", "mlp"],
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = tf.NemotronHForCausalLM(tf.NemotronHConfig(**{**settings, **overrides}))
        with torch.no_grad():  # (transformers starts every head alike: A = 1..heads, D = 1, dt_bias = 1)
            for layer in model.model.layers:
                if layer.block_type == "linear_attention":
                    for param, low, high in ((layer.mixer.A_log, -1, 1), (layer.mixer.D, -1, 1),
                                             (layer.mixer.dt_bias, -2, 1)):
                        param.copy_(low + (high - low) * torch.rand(param.shape, generator=torch.Generator().manual_seed(5)))
                elif layer.block_type == "moe":  # scores far enough apart that the groups and the bias bite
                    layer.mixer.gate.weight.mul_(10)
                    layer.mixer.gate.e_score_correction_bias.copy_(
                        0.3 * torch.randn(4, generator=torch.Generator().manual_seed(6)))
                    for param in (layer.mixer.experts.up_proj, layer.mixer.experts.down_proj,
                                  layer.mixer.shared_experts.up_proj.weight):  # (relu^2 of small weights: ~nothing)
                        param.mul_(10)
                if layer.block_type == "mlp":
                    layer.mixer.up_proj.weight.mul_(10)
    elif kind == "falcon_h1":  # attention and a Mamba-2 mixer side by side in every layer, every multiplier not 1
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40, mamba_d_ssm=96,
                        mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8,
                        embedding_multiplier=2.0, lm_head_multiplier=0.5, key_multiplier=0.7,
                        attention_in_multiplier=1.3, attention_out_multiplier=0.8, ssm_in_multiplier=1.1,
                        ssm_out_multiplier=0.6, mlp_multipliers=[1.2, 0.9], ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 2.0],
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = tf.FalconH1ForCausalLM(tf.FalconH1Config(**{**settings, **overrides}))
        with torch.no_grad():  # (transformers starts every head alike: A = 1..heads, D = 1, dt_bias = 1)
            for layer in model.model.layers:
                for param, low, high in ((layer.mamba.A_log, -1, 1), (layer.mamba.D, -1, 1),
                                         (layer.mamba.dt_bias, -2, 1)):
                    param.copy_(low + (high - low) * torch.rand(param.shape, generator=torch.Generator().manual_seed(5)))
    elif kind == "zamba2":  # Mamba-2 layers, three running two shared blocks in turn, each with its own adapters
        settings = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
                        max_position_embeddings=40, n_mamba_heads=4, mamba_ngroups=2, mamba_d_state=8, chunk_size=8,
                        layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"], num_mem_blocks=2,
                        use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
        model = tf.Zamba2ForCausalLM(tf.Zamba2Config(**{**settings, **overrides}))
        with torch.no_grad():  # (transformers starts every head alike: A = 1..heads, D = 1, dt_bias = 1)
            for layer in model.model.layers:
                mixer = getattr(layer, "mamba", None) or layer.mamba_decoder.mamba
                for param, low, high in ((mixer.A_log, -1, 1), (mixer.D, -1, 1), (mixer.dt_bias, -2, 1)):
                    param.copy_(low + (high - low) * torch.rand(param.shape, generator=torch.Generator().manual_seed(5)))
            for name, param in model.named_parameters():  # adapters large enough to change each invocation
                if "adapter_list" in name:
                    param.mul_(10)
    elif kind == "lfm2":  # short convolutions around an attention layer; the MLP width rule (2/3, x1.3, multiple of 16)
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, layer_types=["conv", "full_attention", "conv"],
                        block_multiple_of=16, block_ffn_dim_multiplier=1.3, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2)
        model = tf.Lfm2ForCausalLM(tf.Lfm2Config(**{**settings, **overrides}))
    elif kind == "recurrent_gemma":  # Griffin: recurrent, recurrent, local attention (a window shorter than the tests'),
        # multi-query, half of each head rotated; d_model 48, whose sqrt bfloat16 rounds (6.928 -> 6.9375)
        settings = dict(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=1, attention_window_size=5, conv1d_width=4, logits_soft_cap=3.0,
                        max_position_embeddings=40,
                        pad_token_id=0, bos_token_id=2, eos_token_id=1)
        model = tf.RecurrentGemmaForCausalLM(tf.RecurrentGemmaConfig(**{**settings, **overrides}))
        with torch.no_grad():  # norms, biases and decay rates away from transformers' zeros and narrow range
            gen = torch.Generator().manual_seed(11)
            for name, param in model.named_parameters():
                if name.endswith(("norm.weight", "bias")):
                    param.copy_(0.3 * torch.randn(param.shape, generator=gen))
                elif name.endswith("recurrent_param"):
                    param.copy_(torch.randn(param.shape, generator=gen))
    elif kind == "lfm2_moe":  # and a dense first layer, then sigmoid-routed experts with a selection bias
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40,
                        layer_types=["conv", "full_attention", "conv"], num_dense_layers=1, num_experts=6,
                        num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = tf.Lfm2MoeForCausalLM(tf.Lfm2MoeConfig(**{**settings, **overrides}))
        with torch.no_grad():  # a selection bias that changes some choices (transformers starts it at zeros)
            for layer in model.model.layers:
                if hasattr(layer.feed_forward, "expert_bias"):
                    layer.feed_forward.gate.weight.mul_(10)
                    layer.feed_forward.expert_bias.copy_(0.3 * torch.randn(6, generator=torch.Generator().manual_seed(7)))
    elif kind == "jamba":  # Mamba-1 layers (learned dt/B/C norms) and NoPE attention, experts every other layer
        settings = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=40, num_experts=4, num_experts_per_tok=2,
                        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
                        mamba_d_state=8, mamba_dt_rank=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = tf.JambaForCausalLM(tf.JambaConfig(**{**settings, **overrides}))
        with torch.no_grad():  # (transformers starts every channel alike: A = 1..d_state, D = 1)
            for layer in model.model.layers:
                if hasattr(layer, "mamba"):
                    for param, low, high in ((layer.mamba.A_log, -1, 1), (layer.mamba.D, -1, 1),
                                             (layer.mamba.dt_proj.bias, -2, 1)):
                        param.copy_(low + (high - low) * torch.rand(param.shape, generator=torch.Generator().manual_seed(5)))
    elif kind == "modernbert_decoder":  # an embedding norm, layer 0 without an attention norm, windowed layers (half
        # local_attention, shorter than the tests' inputs) between full ones, each kind its own base, a prediction head
        settings = dict(vocab_size=101, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                        max_position_embeddings=40, local_attention=8, global_attn_every_n_layers=2,
                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}},
                        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
        model = tf.ModernBertDecoderForCausalLM(tf.ModernBertDecoderConfig(**{**settings, **overrides}))
    elif kind == "jetmoe":  # attention experts and MLP experts, both top-2 of 4, behind routers far from uniform
        settings = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
                        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=40,
                        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = tf.JetMoeForCausalLM(tf.JetMoeConfig(**{**settings, **overrides}))
        with torch.no_grad():  # (transformers draws every expert and router weight at std 0.01)
            for name, param in model.named_parameters():
                if name.endswith(("router.layer.weight", "input_linear.weight", "output_linear.weight")):
                    param.mul_(20 if "router" in name else 10)
    elif kind == "rwkv":  # every layer a time mix and a channel mix; no attention, no positions
        settings = dict(vocab_size=101, hidden_size=32, num_hidden_layers=3, intermediate_size=48, context_length=40,
                        bos_token_id=0, eos_token_id=0)
        model = tf.RwkvForCausalLM(tf.RwkvConfig(**{**settings, **overrides}))
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():  # (transformers starts every time_first at 1 and the mixes on one ramp)
            for block in model.rwkv.blocks:
                for mixer in (block.attention, block.feed_forward):
                    for name, param in mixer.named_parameters():
                        if name.startswith("time_"):
                            low, high = (-2, 1) if name in ("time_decay", "time_first") else (0, 1)
                            param.copy_(low + (high - low) * torch.rand(param.shape, generator=gen))
    elif kind == "gpt1":
        cfg = tf.OpenAIGPTConfig(vocab_size=89, n_embd=48, n_layer=3, n_head=4, n_positions=40, **overrides)
        model = tf.OpenAIGPTLMHeadModel(cfg)
    torch.manual_seed(0)
    model = perturbed(model)
    model.save_pretrained(directory)
    if kind == "phimoe":  # the releases' config.json names their remote code's class, which TL 4's bridge looks up
        _edit_config(directory, architectures=["PhiMoEForCausalLM"])
    reloaded = type(model).from_pretrained(directory, attn_implementation="eager").eval()
    return reloaded


# LongRoPE's per-pair divisors for the 16-wide heads of build("phi3") (8 pairs) and build("phimoe") (4), far apart
PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2],
                 "long_factor": [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0]}
PHIMOE_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.2, 1.5, 1.9],
                   "long_factor": [2.0, 5.0, 9.0, 14.0], "original_max_position_embeddings": 16, "short_mscale": 1.1,
                   "long_mscale": 1.35}

CASES = {
    "llama-gqa-untied": ("llama", {}),
    # a non-default epsilon: random-init residuals are small (~0.02), so eps=1e-4 changes every norm
    "llama-mqa-biases-eps": ("llama", {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True, "rms_norm_eps": 1e-4}),
    "qwen2-qkv-bias-tied": ("qwen2", {}),
    "gpt1-post-norm": ("gpt1", {}),
    "llama3-rope-scaling": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 16}}),
    "llama-linear-rope-scaling": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}}),
    "mistral-sliding-window": ("mistral", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "qwen3-biases-untied": ("qwen3", {"attention_bias": True, "tie_word_embeddings": False}),
    "gemma-scaled-embed-geglu": ("gemma", {}),
    "gemma2-sandwich-softcaps-windows": ("gemma2", {}),
    "vaultgemma-pre-norm-softcaps-windows": ("vaultgemma", {}),
    "vaultgemma-full-layers-tied": ("vaultgemma", dict(layer_types=["full_attention"] * 3, tie_word_embeddings=True)),
    "neox-parallel-partial-rotary": ("neox", {}),
    "neox-sequential-tied-no-bias": ("neox", {"use_parallel_residual": False, "tie_word_embeddings": True,
                                              "attention_bias": False, "hidden_act": "gelu_new"}),
    "gptneo-local-unscaled": ("gptneo", {}),
    "gptneo-global-untied-gelu": ("gptneo", {"attention_types": [[["global"], 3]], "tie_word_embeddings": False,
                                             "activation_function": "gelu", "intermediate_size": 80}),
    "opt-pre-norm-tied": ("opt", {}),
    # OPT-350m's layout: post-norm, no final norm, an embedding narrower than the residual (projected in and out)
    "opt-projected-post-norm": ("opt", {"word_embed_proj_dim": 32, "do_layer_norm_before": False}),
    "opt-projected-untied": ("opt", {"word_embed_proj_dim": 48, "tie_word_embeddings": False}),
    "opt-no-bias-no-affine-untied": ("opt", {"enable_bias": False, "layer_norm_elementwise_affine": False,
                                             "tie_word_embeddings": False}),
    "opt-no-final-norm": ("opt", {"_remove_final_layer_norm": True}),
    "phi-parallel-shared-norm": ("phi", {}),
    "phi-gqa-tied-relu": ("phi", {"num_key_value_heads": 2, "tie_word_embeddings": True, "hidden_act": "relu"}),
    "gemma3-local-rotary-base": ("gemma3", {}),
    # the larger models' linear x8 on full layers, a local base far from the global one, a logit cap; and the
    # attn_logit_softcapping a config may name, which transformers' Gemma 3 never applies
    "gemma3-scaled-full-layers-logit-cap": ("gemma3", {
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
        "final_logit_softcapping": 3.0, "attn_logit_softcapping": 5.0}),
    "llama4-chunks-qk-norm-temperature-moe-every-other": ("llama4", {}),
    # Maverick's settings: no q/k norm, no tuning, the default NoPE layers (here every second), every layer sparse;
    # biases and tied embeddings
    "llama4-maverick-like-biases-tied": ("llama4", {
        "use_qk_norm": False, "attn_temperature_tuning": False, "no_rope_layers": [], "no_rope_layer_interval": 2,
        "interleave_moe_layer_step": 1, "attention_bias": True, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
    # no chunks (every layer sees every earlier key), two experts a token, MoE layers named, a wider eps
    "llama4-unchunked-two-experts-named-moe-layers": ("llama4", {
        "attention_chunk_size": None, "num_experts_per_tok": 2, "moe_layers": [0, 2], "rms_norm_eps": 1e-4}),
    "afmoe-trinity": ("afmoe", {}),
    "afmoe-mup-biases-tied": ("afmoe", {"mup_enabled": True, "attention_bias": True, "tie_word_embeddings": True,
                                        "num_shared_experts": 0, "num_dense_layers": 2}),
    # heads per layer (4, 8, 2, 6) over 2 key/value heads, a softplus gate per head, sliding layers (window 4) rotating
    # whole heads by 100 and full ones half of each by 1000, dense-sparse-sparse-dense MLPs, a capped router
    "laguna-per-head-gates-mixed-heads-capped-router": ("laguna", {}),
    "laguna-per-channel-gates-uncapped-biases-tied": ("laguna", {"gating": "per-element", "attention_bias": True,
                                                                 "moe_router_logit_softcapping": 0.0,
                                                                 "tie_word_embeddings": True}),
    # YaRN on the full layers (their half of each head; the sliding ones unscaled), every MLP sparse, 40 tokens past
    # the pretraining context of 10
    "laguna-yarn-full-layers-every-layer-sparse": ("laguna", {
        "mlp_layer_types": ["sparse"] * 4, "rope_parameters": {
            "full_attention": {"rope_type": "yarn", "rope_theta": 1000.0, "partial_rotary_factor": 0.5, "factor": 4.0,
                               "original_max_position_embeddings": 10},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.75}}}),
    "laguna-every-layer-sliding": ("laguna", {"layer_types": ["sliding_attention"] * 4}),
    # transformers' defaults for the layout: every layer full attention and as many heads, the first MLP dense
    "laguna-default-layout-gating-false": ("laguna", {"num_attention_heads_per_layer": None, "layer_types": None,
                                                      "mlp_layer_types": None, "gating": False,
                                                      "moe_routed_scaling_factor": 1.0}),
    "gemma4-shared-kv-per-layer-inputs": ("gemma4", {}),  # E2B / E4B's
    "gemma4-values-from-keys": ("gemma4", {"hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0}),  # 31B's
    "gemma4-experts-beside-mlp": ("gemma4", {"hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,  # 26B-A4B's
                                             "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                                             "moe_intermediate_size": 12}),
    # experts beside the MLP, per-layer inputs and shared keys together (no released model has all), biases
    "gemma4-everything": ("gemma4", {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                                     "moe_intermediate_size": 12, "attention_bias": True}),
    # own value projections, biases, more key/value heads in full layers, a rescaled proportional rope, untied
    "gemma4-values-biases-rescaled": ("gemma4", {
        "attention_k_eq_v": False, "attention_bias": True, "num_global_key_value_heads": 2, "tie_word_embeddings": False,
        "per_layer_config": {str(l): {"head_dim": 16, "num_key_value_heads": 2} for l in (2, 5)},
        "rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                               "factor": 2.0, "rope_theta": 1000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}),
    "olmo-weightless-norms": ("olmo", {}),
    # OLMo-7B-0424's clamp, small enough to bite on random weights
    "olmo-clip-qkv": ("olmo", {"clip_qkv": 0.05}),
    "olmo-gqa-biases-tied": ("olmo", {"num_key_value_heads": 2, "attention_bias": True, "tie_word_embeddings": True}),
    "gptj-adjacent-pairs-partial": ("gptj", {}),
    "gptj-whole-head-tied-relu": ("gptj", {"rotary_dim": 16, "tie_word_embeddings": True, "activation_function": "relu"}),
    "olmo2-write-norms-qk-over-heads": ("olmo2", {}),
    "olmo2-gqa-biases-tied": ("olmo2", {"num_key_value_heads": 2, "attention_bias": True, "tie_word_embeddings": True}),
    "olmo3-sliding-layers-yarn": ("olmo3", {}),
    "olmo3-plain-rope-tied": ("olmo3", {"rope_parameters": None, "tie_word_embeddings": True}),
    "phi3-fused-projections": ("phi3", {}),
    # phi-4-mini's partial rotary, Phi-3-mini's window (here shorter than the sequences), grouped-query heads
    "phi3-gqa-partial-rotary-window": ("phi3", {"num_key_value_heads": 2, "sliding_window": 6, "tie_word_embeddings": True,
                                                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                    "partial_rotary_factor": 0.75}}),
    # Phi-3-mini-128k's / Phi-3.5-mini's LongRoPE (pretraining context 16 < the 40-token inputs: the long factors),
    # within the threshold (the short ones), and phi-4-mini's partial rotary with it
    "phi3-longrope-long": ("phi3", {"original_max_position_embeddings": 16, "rope_parameters": PHI3_LONGROPE}),
    "phi3-longrope-short": ("phi3", {"original_max_position_embeddings": 40, "rope_parameters": PHI3_LONGROPE}),
    "phi3-longrope-partial-rotary-gqa": ("phi3", {"original_max_position_embeddings": 16, "num_key_value_heads": 2,
                                                  "rope_parameters": {**PHI3_LONGROPE, "partial_rotary_factor": 0.75,
                                                                      "short_factor": [1.0, 1.5, 2.0, 2.5, 3.0, 3.5],
                                                                      "long_factor": [3.0, 5.0, 7.0, 9.0, 11.0, 13.0]}}),
    "jetmoe-attention-and-mlp-experts-top2-untied": ("jetmoe", {}),
    # (the blocks' norms keep transformers' fixed 1e-6; only the final norm reads rms_norm_eps)
    "jetmoe-final-norm-eps-of-its-own": ("jetmoe", {"rms_norm_eps": 0.05}),
    "jetmoe-top3-of-5-one-kv-head-tied-theta": ("jetmoe", {"num_local_experts": 5, "num_experts_per_tok": 3,
                                                           "num_key_value_heads": 1, "tie_word_embeddings": True,
                                                           "rope_parameters": {"rope_type": "default",
                                                                               "rope_theta": 1000.0}}),
    "phimoe-sparsemixer": ("phimoe", {}),
    "phimoe-biases-window-wide-mask": ("phimoe", {"attention_bias": True, "lm_head_bias": True, "sliding_window": 6,
                                                  "router_jitter_noise": 0.3}),
    # Phi-3.5-MoE's rope within its threshold (transformers 5.25 keeps the short factors past it: test_phimoe.py)
    "phimoe-longrope-short": ("phimoe", {"rope_parameters": {**PHIMOE_LONGROPE, "original_max_position_embeddings": 40}}),
    # past it with one set of factors for both regimes, so that only the attention factor switches
    "phimoe-longrope-long-mscale": ("phimoe", {"rope_parameters": {**PHIMOE_LONGROPE,
                                                                   "long_factor": PHIMOE_LONGROPE["short_factor"]}}),
    "mixtral-experts-renormalised": ("mixtral", {}),
    "mixtral-one-expert-window": ("mixtral", {"num_experts_per_tok": 1, "sliding_window": 6}),
    "olmoe-experts-qk-norms": ("olmoe", {}),
    "olmoe-renormalised-tied": ("olmoe", {"norm_topk_prob": True, "tie_word_embeddings": True}),
    "olmoe-clip-qkv": ("olmoe", {"clip_qkv": 0.05}),
    "qwen3-moe-experts": ("qwen3_moe", {}),
    "qwen2-moe-shared-expert": ("qwen2_moe", {}),
    "qwen2-moe-renormalised-tied": ("qwen2_moe", {"norm_topk_prob": True, "tie_word_embeddings": True}),
    # dense MLPs (intermediate_size) among the sparse layers (moe_intermediate_size)
    "qwen3-moe-mlp-only-layers": ("qwen3_moe", {"mlp_only_layers": [0]}),
    "qwen2-moe-sparse-step-shared": ("qwen2_moe", {"decoder_sparse_step": 2}),
    "glm4-moe-dense-first-sigmoid-groups-scaled": ("glm4_moe", {}),
    # two dense layers, one group of four kept of two, weights not renormalised, q/k norms and biases, whole-head rope
    "glm4-moe-unrenormalised-qk-norm-biases-tied": ("glm4_moe", {
        "norm_topk_prob": False, "use_qk_norm": True, "attention_bias": True, "tie_word_embeddings": True,
        "first_k_dense_replace": 2, "num_hidden_layers": 4, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 0.7,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0}}),
    "falcon-parallel-multi-query": ("falcon", {}),
    # Falcon-40B's: a norm for each parallel sublayer, key/value heads shared by groups of query heads
    "falcon-new-architecture-gqa": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2,
                                               "ffn_hidden_size": 96}),
    "falcon-sequential-heads-biases": ("falcon", {"multi_query": False, "parallel_attn": False, "bias": True,
                                                  "tie_word_embeddings": False}),
    "smollm3-nope-layers": ("smollm3", {}),
    "smollm3-two-nope-layers-biases": ("smollm3", {"no_rope_layers": [0, 1, 0, 1], "attention_bias": True,
                                                   "tie_word_embeddings": False}),
    "mpt-alibi-no-bias": ("mpt", {}),
    "mpt-clip-qkv": ("mpt", {"attn_config": {"alibi": True, "clip_qkv": 0.05}}),
    "mpt-softmax-scale": ("mpt", {"attn_config": {"alibi": True, "softmax_scale": 0.5}, "layer_norm_epsilon": 1e-4}),
    "stablelm-partial-rotary-qkv-bias": ("stablelm", {}),
    # one norm for two parallel sublayers (StableLM's use_parallel_residual), no biases, a half of each head rotated
    "stablelm-parallel-no-bias-tied": ("stablelm", {"use_parallel_residual": True, "use_qkv_bias": False,
                                                    "tie_word_embeddings": True, "num_key_value_heads": 4,
                                                    "rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                                                        "partial_rotary_factor": 0.5}}),
    "bigcode-multi-query": ("bigcode", {}),
    # every head its own keys and values (fused per head), q.k unscaled, exact GELU, an untied head
    "bigcode-multi-head-unscaled": ("bigcode", {"multi_query": False, "scale_attn_weights": False,
                                                "activation_function": "gelu", "tie_word_embeddings": False}),
    "bloom-alibi-embed-norm": ("bloom", {}),
    # six heads: the slopes of four, then every other one of eight's (not a power of two)
    "bloom-six-heads-untied": ("bloom", {"hidden_size": 72, "n_head": 6, "tie_word_embeddings": False,
                                         "layer_norm_epsilon": 1e-4}),
    # the clamp (0.1) bites: the experts' pre-activations reach ~0.5
    "gpt-oss-sinks-windows-yarn-experts": ("gpt_oss", {}),
    "apertus-xielu-qk-norm-llama3-rope": ("apertus", {}),
    "apertus-biases-tied-silu-mha": ("apertus", {"attention_bias": True, "tie_word_embeddings": True, "hidden_act": "silu",
                                                 "num_key_value_heads": 4, "rope_parameters": None}),
    "granite-multipliers-tied": ("granite", {}),
    "granite-multipliers-untied-biases": ("granite", {"tie_word_embeddings": False, "attention_bias": True,
                                                      "mlp_bias": True}),
    "codegen-sharded-qkv-partial-rotary": ("codegen", {}),
    "codegen-whole-head-rotary-tied-relu": ("codegen", {"rotary_dim": 8, "tie_word_embeddings": True,
                                                        "activation_function": "relu", "n_head": 8}),
    "cohere-parallel-one-norm-tied": ("cohere", {}),
    "cohere-untied-biases-mha": ("cohere", {"tie_word_embeddings": False, "attention_bias": True,
                                            "num_key_value_heads": 4, "logit_scale": 2.0}),
    "cohere2-windows-nope-full-layers": ("cohere2", {}),
    "cohere2-layer-types-untied": ("cohere2", {"layer_types": ["sliding_attention", "full_attention"] * 2,
                                               "tie_word_embeddings": False}),
    "granitemoe-chosen-softmax-untied": ("granitemoe", {}),
    "granitemoe-one-expert-tied": ("granitemoe", {"num_experts_per_tok": 1, "tie_word_embeddings": True}),
    "xglm-scaled-sinusoids-tied": ("xglm", {}),
    "xglm-unscaled-untied-relu": ("xglm", {"scale_embedding": False, "tie_word_embeddings": False,
                                           "activation_function": "relu"}),
    "exaone-gqa-untied": ("exaone", {}),
    "exaone-tied-llama3-rope": ("exaone", {"tie_word_embeddings": True, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    "arcee-relu2-ungated": ("arcee", {}),
    "arcee-biases-tied-yarn": ("arcee", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True,
                                         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                             "original_max_position_embeddings": 16}}),
    "qwen3-5-deltanet-gated-attention": ("qwen3_5", {}),
    # two full layers, value heads as many as key heads, a wider convolution, the whole head rotated, tied
    "qwen3-5-two-full-layers-tied": ("qwen3_5", {"layer_types": ["linear_attention", "full_attention"] * 2,
                                                 "linear_num_value_heads": 2, "linear_conv_kernel_dim": 3,
                                                 "tie_word_embeddings": True, "rms_norm_eps": 1e-4,
                                                 "rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                                                     "partial_rotary_factor": 1.0}}),
    "olmo-hybrid-nope-three-deltanet-one-attention": ("olmo_hybrid", {}),
    # rotary attention, the attention first, beta in (0, 1), a narrower convolution, tied, grouped keys
    "olmo-hybrid-rope-attention-first-no-neg-eigval": ("olmo_hybrid", {
        "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, "linear_allow_neg_eigval": False,
        "linear_conv_kernel_dim": 3, "tie_word_embeddings": True, "rms_norm_eps": 1e-4}),
    # transformers' defaults for the DeltaNet's widths (0.75 d_model / heads, twice that), attention biases, yarn
    "olmo-hybrid-default-widths-biases-yarn": ("olmo_hybrid", {
        "layer_types": None, "num_hidden_layers": 3, "linear_num_key_heads": None, "linear_num_value_heads": None,
        "linear_key_head_dim": None, "linear_value_head_dim": None, "attention_bias": True, "num_key_value_heads": 4,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                            "original_max_position_embeddings": 16}}),
    "qwen3-5-moe-shared-expert": ("qwen3_5_moe", {}),
    "qwen3-next-fused-deltanet-unrenormalised": ("qwen3_next", {}),
    "qwen3-next-renormalised-tied-one-expert": ("qwen3_next", {"norm_topk_prob": True, "tie_word_embeddings": True,
                                                               "num_experts_per_tok": 1, "linear_num_value_heads": 6}),
    "starcoder2-biases-window-tied": ("starcoder2", {}),
    "starcoder2-no-bias-untied-whole-window": ("starcoder2", {"use_bias": False, "tie_word_embeddings": False,
                                                               "sliding_window": None, "norm_epsilon": 1e-3}),
    "nemotron-layernorm1p-relu2-partial": ("nemotron", {}),
    "nemotron-biases-tied-quarter-rotary": ("nemotron", {"attention_bias": True, "mlp_bias": True,
                                                         "tie_word_embeddings": True, "rope_parameters": {
                                                             "rope_type": "default", "rope_theta": 500.0,
                                                             "partial_rotary_factor": 0.25}}),
    "jais2-biases-relu2": ("jais2", {}),
    "jais2-no-bias-tied-gelu": ("jais2", {"attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
                                          "hidden_act": "gelu_pytorch_tanh"}),
    "seed-oss-qkv-bias": ("seed_oss", {}),
    "flex-olmo-write-norms-experts": ("flex_olmo", {}),
    "flex-olmo-renormalised-biases-tied": ("flex_olmo", {"norm_topk_prob": True, "attention_bias": True,
                                                         "tie_word_embeddings": True, "num_experts_per_tok": 1}),
    "exaone4-windows-nope-full-layers": ("exaone4", {}),
    # no window: every layer full and rotating
    "exaone4-global-tied": ("exaone4", {"sliding_window": None, "layer_types": ["full_attention"] * 4,
                                        "tie_word_embeddings": True}),
    "hunyuan-norms-after-rope-alpha": ("hunyuan", {}),
    "hunyuan-plain-rope-biases-tied": ("hunyuan", {"attention_bias": True, "tie_word_embeddings": True,
                                                   "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
    "ernie4-5-adjacent-rotary-tied": ("ernie4_5", {}),
    "modernbert-decoder-no-biases-tied-decoder-bias": ("modernbert_decoder", {}),
    # every bias (the norms' too), untied, no decoder bias, the tanh GELU in the MLP and ReLU in the head, a window
    # on two layers in three (layer_types given), an odd local_attention (its half rounds down), an epsilon that bites
    "modernbert-decoder-biases-untied-relu-head": ("modernbert_decoder", {
        "norm_bias": True, "attention_bias": True, "mlp_bias": True, "classifier_bias": True, "decoder_bias": False,
        "tie_word_embeddings": False, "hidden_activation": "gelu_pytorch_tanh", "classifier_activation": "relu",
        "local_attention": 7, "norm_eps": 1e-3,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]}),
    "nanochat-weightless-norms-clockwise-rope-softcap": ("nanochat", {}),
    "bitnet-sub-norms-relu2-gqa": ("bitnet", {}),
    "bitnet-biases-tied-mha-silu": ("bitnet", {"attention_bias": True, "tie_word_embeddings": True,
                                               "num_key_value_heads": 4, "hidden_act": "silu", "rms_norm_eps": 1e-4}),
    # every bias, one key/value head per query head, tied, no cap, another base, an epsilon that bites
    "nanochat-mha-biases-tied-uncapped": ("nanochat", {"num_key_value_heads": 4, "attention_bias": True,
                                                       "tie_word_embeddings": True, "final_logit_softcapping": None,
                                                       "rms_norm_eps": 1e-4,
                                                       "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
    "ernie4-5-biases-untied": ("ernie4_5", {"use_bias": True, "tie_word_embeddings": False}),
    "glm-biases-adjacent-half-rotary": ("glm", {}),
    "glm-no-bias-tied-whole-rotary": ("glm", {"attention_bias": False, "tie_word_embeddings": True,
                                              "rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                                                  "partial_rotary_factor": 1.0}}),
    "glm4-sandwich-norms": ("glm4", {}),
    "glm4-sandwich-no-bias-eps": ("glm4", {"attention_bias": False, "rms_norm_eps": 1e-4}),
    "seed-oss-out-bias-mlp-bias-tied": ("seed_oss", {"attention_out_bias": True, "mlp_bias": True,
                                                     "tie_word_embeddings": True}),
    # latent attention: V3's rotary pairs written back evens first, a low-rank query
    "deepseek-v3-latent-deinterleaved-rope-experts": ("deepseek_v3", {}),
    "deepseek-v3-half-split-rope-direct-query": ("deepseek_v3", {"rope_interleave": False, "q_lora_rank": None,
                                                                 "tie_word_embeddings": True}),
    # a long-context YaRN rope whose mscale_all_dim also scales the scores; biases on the down-projections and o_proj
    "deepseek-v3-yarn-mscale-biases": ("deepseek_v3", {"attention_bias": True, "rms_norm_eps": 1e-4, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 8, "beta_slow": 1}}),
    # every layer dense, the MLPs biased
    "deepseek-v2-rotary-pairs-in-place-mlp-bias": ("deepseek_v2", {"mlp_bias": True, "first_k_dense_replace": 2}),
    "deepseek-v3-all-dense": ("deepseek_v3", {"first_k_dense_replace": 2}),
    "deepseek-v2-greedy-two-experts-per-token": ("deepseek_v2", {"topk_method": "greedy", "n_shared_experts": 2}),
    "glm4-moe-lite-renormalised-one-expert": ("glm4_moe_lite", {"num_experts_per_tok": 1, "n_group": 1,
                                                                "topk_group": 1}),
    "deepseek-v2-lite-direct-query": ("deepseek_v2", {"q_lora_rank": None}),
    "glm4-moe-lite-latent": ("glm4_moe_lite", {}),
    "youtu-latent-tied": ("youtu", {}),
    # GLM-5: each query reads the 5 keys its layer's indexer scores highest, a dense first layer, then experts
    "glm-moe-dsa-sparse-keys-experts": ("glm_moe_dsa", {}),
    # a layer reading the keys the layer before chose (indexer_types "shared"), 3 keys each, a YaRN rope, biases, tied
    "glm-moe-dsa-shared-choice-yarn-biases-tied": ("glm_moe_dsa", {
        "num_hidden_layers": 4, "indexer_types": ["full", "shared", "full", "shared"], "index_topk": 3,
        "mlp_layer_types": ["dense", "dense", "sparse", "sparse"], "attention_bias": True, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                            "original_max_position_embeddings": 16, "mscale": 0.9, "mscale_all_dim": 0.7}}),
    # Mamba-2 layers around an attention layer, experts beside a shared MLP, Granite's scalars
    "granite-hybrid-mamba2-experts-rope": ("granitemoehybrid", {}),
    "bamba-mamba2-half-rotary": ("bamba", {}),
    # attention and a Mamba-2 mixer side by side, every muP multiplier not 1: without the gated norm (the released
    # models), with it after the gate, and before it with every bias, step limits and wider heads
    "falcon-h1-parallel-hybrid-no-inner-norm": ("falcon_h1", {}),
    "falcon-h1-inner-norm-after-gate-tied-one-group": ("falcon_h1", {
        "mamba_rms_norm": True, "mamba_norm_before_gate": False, "tie_word_embeddings": True, "mamba_n_groups": 1}),
    "falcon-h1-inner-norm-before-gate-biases-limits": ("falcon_h1", {
        "mamba_rms_norm": True, "attention_bias": True, "mlp_bias": True, "mamba_proj_bias": True,
        "projectors_bias": False, "mamba_conv_bias": False, "time_step_limit": (0.01, 0.5), "head_dim": 24,
        "rms_norm_eps": 1e-4}),
    "falcon-h1-out-proj-bias-only-d-ssm-from-expand": ("falcon_h1", {
        "projectors_bias": True, "mamba_d_ssm": None, "mamba_expand": 1, "mamba_n_heads": 4, "mamba_d_head": "auto"}),
    "mamba2-mixers-only": ("mamba2", {}),
    "mamba2-biases-tied-one-group-step-limits": ("mamba2", {"use_bias": True, "use_conv_bias": False, "n_groups": 1,
                                                            "tie_word_embeddings": True, "time_step_limit": (0.01, 0.5),
                                                            "layer_norm_epsilon": 1e-4}),
    "mamba-mixers-only-tied": ("mamba", {}),
    "rwkv-time-and-channel-mix-untied": ("rwkv", {}),
    "rwkv-wide-channel-mix-tied": ("rwkv", {"intermediate_size": 80, "tie_word_embeddings": True}),
    # one sublayer per layer: Mamba-2, grouped experts with a selection bias, attention without positions, a relu^2 MLP
    "nemotron-h-mamba2-experts-attention-mlp": ("nemotron_h", {}),
    # the latent experts, biases everywhere transformers reads them, one expert group, step limits, every kind twice
    "nemotron-h-latent-biases-one-group-step-limits": ("nemotron_h", {
        "moe_latent_size": 16, "mlp_bias": True, "use_bias": True, "use_conv_bias": False, "n_group": 1,
        "time_step_limit": (0.01, 0.5), "tie_word_embeddings": True, "norm_topk_prob": False, "n_groups": 1,
        "layers_block_type": ["attention", "mlp", "moe", "mamba", "moe", "mamba", "attention", "mlp"]}),
    # the released files' pattern string, without experts
    "nemotron-h-pattern-dense": ("nemotron_h", {"hybrid_override_pattern": "M-M*-", "layers_block_type": None,
                                                "layer_norm_epsilon": 1e-4, "head_dim": 24}),
    "mamba-biases-untied-no-conv-bias-auto-rank": ("mamba", {"use_bias": True, "use_conv_bias": False,
                                                             "tie_word_embeddings": False, "time_step_rank": "auto",
                                                             "layer_norm_epsilon": 1e-4}),
    "falcon-mamba-bcdt-norms-tied": ("falcon_mamba", {}),
    "jamba-mamba1-nope-attention-top2-experts-untied": ("jamba", {}),
    # Jamba-v0.1's layout (attention 1 in 8 from layer 4, experts every other layer from 1) at eight layers
    "jamba-v0-1-layout-auto-rank": ("jamba", {"num_hidden_layers": 8, "attn_layer_period": 8, "attn_layer_offset": 4,
                                              "mamba_dt_rank": "auto"}),
    "jamba-top1-experts-everywhere-attention-first-biases-tied": ("jamba", {
        "num_experts_per_tok": 1, "expert_layer_period": 1, "expert_layer_offset": 0, "attn_layer_period": 3,
        "attn_layer_offset": 0, "tie_word_embeddings": True, "mamba_proj_bias": True, "mamba_conv_bias": False}),
    # Jamba Reasoning's: one expert, so every MLP dense; a narrower mixer, a shorter kernel, another eps
    "jamba-dense-expand1-kernel3-eps": ("jamba", {"num_experts": 1, "mamba_expand": 1, "mamba_d_conv": 3,
                                                  "rms_norm_eps": 1e-4, "attn_layer_period": 4, "attn_layer_offset": 3}),
    "falcon-mamba-biases-untied-kernel3-norm-eps": ("falcon_mamba", {"use_bias": True, "tie_word_embeddings": False,
                                                                     "conv_kernel": 3, "mixer_rms_eps": 1e-2}),
    "bamba-biases-tied-one-group": ("bamba", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True,
                                              "mamba_n_groups": 1, "mamba_proj_bias": True, "attn_layer_indices": [0]}),
    "granite-hybrid-nope-dense-biases-one-group": ("granitemoehybrid", {
        "position_embedding_type": None, "num_local_experts": 0, "mamba_proj_bias": True, "mamba_conv_bias": False,
        "mamba_n_groups": 1, "time_step_limit": (0.01, 0.5), "layer_types": ["attention", "mamba", "mamba"]}),
    "gpt-oss-plain-rope-no-bias-one-expert": ("gpt_oss", {
        "attention_bias": False, "num_experts_per_tok": 1, "swiglu_alpha": 1.0, "swiglu_limit": 0.05,
        "layer_types": ["full_attention"] * 3, "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}),
    "minimax-m2-partial-rotary-biased-sigmoid-choice": ("minimax_m2", {}),
    # the rope dict's fraction over rotary_dim (whole heads), heads wider than d_model / n_heads, one key/value head
    "minimax-m2-whole-head-mqa-wide-heads-tied": ("minimax_m2", {
        "num_key_value_heads": 1, "head_dim": 24, "num_experts_per_tok": 3, "tie_word_embeddings": True,
        "rms_norm_eps": 1e-4, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                                  "partial_rotary_factor": 1.0}}),
    "ernie4-5-moe-dense-first-shared": ("ernie4_5_moe", {}),
    # use_bias: the attention, the dense and shared MLPs and the unembedding biased, the router and experts not
    "ernie4-5-moe-biases-tied-every-other-layer": ("ernie4_5_moe", {
        "use_bias": True, "moe_layer_start_index": 0, "moe_layer_interval": 2, "num_hidden_layers": 4,
        "moe_num_shared_experts": 0}),
    # a floor above most chosen pairs' sums, so the clamp changes the weights; every layer sparse; wider heads
    "ernie4-5-moe-clamped-sum-all-sparse-two-shared-untied": ("ernie4_5_moe", {
        "moe_norm_min": 0.8, "moe_layer_start_index": 0, "moe_num_shared_experts": 2, "tie_word_embeddings": False,
        "head_dim": 24}),
    "ernie4-5-moe-dense-last-layer": ("ernie4_5_moe", {"moe_layer_start_index": 0, "moe_layer_end_index": 1}),
    # Mamba-2 layers, three running two shared blocks in turn with rope and adapters on q/k/v and the MLP
    "zamba2-two-shared-blocks-adapters-rope": ("zamba2", {}),
    # one shared block run by every hybrid layer, no attention adapters (the MLP's are always there), no positions
    "zamba2-one-block-nope-no-attention-adapters": ("zamba2", {
        "num_mem_blocks": 1, "use_shared_attention_adapter": False, "use_mem_rope": False,
        "layers_block_type": ["hybrid", "mamba", "mamba", "hybrid", "mamba"]}),
    # grouped key/value heads, hybrid layers first and last, one group of B and C
    "zamba2-gqa-hybrid-first-and-last": ("zamba2", {
        "num_key_value_heads": 2, "use_shared_attention_adapter": False,
        "layers_block_type": ["hybrid", "mamba", "hybrid", "mamba", "hybrid"], "num_mem_blocks": 2, "mamba_ngroups": 1}),
    "lfm2-conv-attention-conv-width-rule": ("lfm2", {}),
    "lfm2-conv-biases-kernel4-untied": ("lfm2", {"conv_bias": True, "conv_L_cache": 4, "tie_word_embeddings": False}),
    "lfm2-attention-first-rounded-up-eps": ("lfm2", {"layer_types": ["full_attention", "conv", "conv"],
                                                     "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256,
                                                     "norm_eps": 1e-4}),
    "lfm2-width-as-written-kernel1": ("lfm2", {"block_auto_adjust_ff_dim": False, "conv_L_cache": 1}),
    "lfm2-moe-dense-first-sigmoid-selection-bias": ("lfm2_moe", {}),
    "lfm2-moe-all-sparse-unnormalised-scaled": ("lfm2_moe", {"num_dense_layers": 0, "use_expert_bias": False,
                                                             "norm_topk_prob": False, "routed_scaling_factor": 2.5}),
    "lfm2-moe-two-dense-conv-biases-untied": ("lfm2_moe", {"num_dense_layers": 2, "conv_bias": True,
                                                           "tie_word_embeddings": False,
                                                           "layer_types": ["full_attention", "conv", "conv"]}),
    "recurrent-gemma-griffin-multi-query-window": ("recurrent_gemma", {}),
    "recurrent-gemma-attention-first-wide-lru-grouped-biased-whole-heads-untied": (
        "recurrent_gemma", {"block_types": ["attention", "recurrent"], "num_hidden_layers": 4, "lru_width": 64,
                            "num_key_value_heads": 2, "conv1d_width": 2, "attention_bias": True, "rms_norm_eps": 1e-4,
                            "tie_word_embeddings": False,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                                "partial_rotary_factor": 1.0}}),
    # (transformers' cache cannot run a model without attention layers, Hawk's: every case has one)
    "recurrent-gemma-alternating-kernel1-exact-gelu": ("recurrent_gemma", {"block_types": ["recurrent", "attention"],
                                                                           "conv1d_width": 1, "hidden_activation": "gelu"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_matches_transformers(case, tmp_path):
    kind, overrides = CASES[case]
    hf = build(kind, tmp_path, **overrides)
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, ours.cfg.d_vocab, (2, ours.cfg.n_ctx), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens, output_hidden_states=True)
        logits, cache = ours.run_with_cache(tokens, names=lambda n: n.endswith("hook_resid_pre"))
        fast = ours(tokens)
    torch.testing.assert_close(logits, expected.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(fast, expected.logits, atol=1e-4, rtol=0)
    # (transformers' Mamba-1 and RWKV list each block's output, not the embedding)
    shift = kind in ("mamba", "falcon_mamba", "rwkv")
    for layer in range(shift, ours.cfg.n_layers):
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_resid_pre"], expected.hidden_states[layer - shift],
                                   atol=1e-4, rtol=0)


def test_llama_patterns_and_rotary_hooks(tmp_path):
    hf = build("llama", tmp_path)
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    assert ours.cfg.positions is Positions.ROTARY and ours.cfg.n_kv_heads == 2
    tokens = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(tokens, output_attentions=True)
        _, cache = ours.run_with_cache(tokens)
    for layer in range(2):
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_pattern"], expected.attentions[layer], atol=1e-4, rtol=0)
    # GQA: keys and values have n_kv_heads heads, queries and z have n_heads
    assert cache["blocks.0.attn.hook_k"].shape[2] == 2 and cache["blocks.0.attn.hook_rot_k"].shape[2] == 2
    assert cache["blocks.0.attn.hook_q"].shape[2] == 8 and cache["blocks.0.attn.hook_z"].shape[2] == 8
    # position 0 is not rotated; later positions are
    q, rot_q = cache["blocks.0.attn.hook_q"], cache["blocks.0.attn.hook_rot_q"]
    torch.testing.assert_close(rot_q[:, 0], q[:, 0])
    assert not torch.allclose(rot_q[:, 5], q[:, 5])
    # a rotation keeps each pair's length: pairs are (i, i + d_head/2)
    half = q.shape[-1] // 2
    pair_norm = lambda x: x[..., :half] ** 2 + x[..., half:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(rot_q), pair_norm(q), atol=1e-5, rtol=1e-5)
    assert "hook_pos_embed" not in ours.hook_names


def test_llama_weight_views_are_transformers_parameters(tmp_path):
    """GQA views: W_Q has n_heads heads, W_K and W_V n_kv_heads; nn.Linear stores [out, in], the views [in, out]."""
    hf = build("llama", tmp_path)
    ours = HookedDecoder.from_pretrained(tmp_path)
    dh = ours.cfg.d_head
    for block, theirs in zip(ours.blocks, hf.model.layers):
        attn, mlp = block.attn, block.mlp
        assert attn.W_Q.shape[0] == 8 and attn.W_K.shape[0] == attn.W_V.shape[0] == 2
        for name, views in (("q_proj", attn.W_Q), ("k_proj", attn.W_K), ("v_proj", attn.W_V)):
            weight = getattr(theirs.self_attn, name).weight
            for h in range(views.shape[0]):
                assert torch.equal(views[h], weight[h * dh:(h + 1) * dh].T), (name, h)
        for h in range(8):
            assert torch.equal(attn.W_O[h], theirs.self_attn.o_proj.weight[:, h * dh:(h + 1) * dh].T)
        assert torch.equal(mlp.W_gate, theirs.mlp.gate_proj.weight.T)
        assert torch.equal(mlp.W_in, theirs.mlp.up_proj.weight.T)
        assert torch.equal(mlp.W_out, theirs.mlp.down_proj.weight.T)
    assert torch.equal(ours.unembed.W_U, hf.lm_head.weight.T)


def test_rotary_angles_stay_exact_in_bfloat16(tmp_path):
    build("llama", tmp_path, max_position_embeddings=1024, num_hidden_layers=1)
    model = HookedDecoder.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    tokens = torch.randint(0, 101, (1, 1024), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names=["blocks.0.attn.hook_k", "blocks.0.attn.hook_rot_k"])
    k = cache["blocks.0.attn.hook_k"].double()
    half = k.shape[-1] // 2
    # angle = position * base^(-2i/d_head), computed by hand in float64
    angles = torch.arange(1024, dtype=torch.float64)[:, None] * model.cfg.rotary_base ** (-2 * torch.arange(half) / (2 * half))
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    first, second = k[..., :half], k[..., half:]
    by_hand = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    # bfloat16 rounds the input and output (8 bits each); rounded frequencies would be off by radians
    tol = 4 * 2**-8 * k.abs().max().item()
    torch.testing.assert_close(cache["blocks.0.attn.hook_rot_k"].double(), by_hand, atol=tol, rtol=0)
    assert model.blocks[0].attn.rotary.inv_freq.dtype == torch.float32


def test_save_round_trip_for_each_family(tmp_path):
    for kind in ("llama", "qwen2", "gpt1", "neox", "mistral", "gemma", "gemma2", "vaultgemma", "qwen3", "gptneo", "opt", "phi", "phi3", "gemma3",
                 "olmo", "gptj", "olmo2", "olmo3", "bloom", "mixtral", "phimoe", "jetmoe", "olmoe", "qwen3_moe", "bigcode",
                 "stablelm", "mpt", "smollm3", "falcon", "qwen2_moe", "gpt_oss", "apertus", "arcee", "granite", "codegen", "cohere",
                 "cohere2", "granitemoe", "xglm", "exaone", "qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "starcoder2", "nemotron", "seed_oss", "glm", "glm4", "ernie4_5", "flex_olmo", "exaone4", "hunyuan", "nanochat", "bitnet", "modernbert_decoder", "glm4_moe",
                 "jais2", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "youtu", "glm_moe_dsa", "minimax_m2",
                 "ernie4_5_moe",
                 "granitemoehybrid", "bamba", "falcon_h1", "mamba2", "mamba", "falcon_mamba", "rwkv", "jamba", "lfm2", "lfm2_moe", "nemotron_h",
                 "gemma4", "afmoe", "llama4", "zamba2", "recurrent_gemma", "laguna"):
        src = tmp_path / kind
        # a non-default eps and a rotary rescaling must be written (JetMoE's final norm's eps of its own too)
        hf = build(kind, src, **({"rms_norm_eps": 1e-4, **CASES["llama3-rope-scaling"][1]} if kind == "llama" else
                                 {"rms_norm_eps": 0.05} if kind == "jetmoe" else {}))
        ours = HookedDecoder.from_pretrained(src)
        out = ours.save_pretrained(tmp_path / f"{kind}-saved")
        again = type(hf).from_pretrained(out).eval()
        tokens = torch.randint(0, ours.cfg.d_vocab, (1, 9), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, atol=1e-5, rtol=0)


def test_sinusoidal_positions_follow_the_formula():
    cfg = DecoderConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=11, n_ctx=20, positions=Positions.SINUSOIDAL)
    model = HookedDecoder(cfg)
    _, cache = model.run_with_cache(torch.zeros(1, 20, dtype=torch.long), names="hook_pos_embed")
    table = cache["hook_pos_embed"][0]
    for pos in (0, 3, 19):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert math.isclose(table[pos, 2 * i].item(), math.sin(angle), abs_tol=1e-5)
            assert math.isclose(table[pos, 2 * i + 1].item(), math.cos(angle), abs_tol=1e-5)
    assert not any(name.endswith("W_pos") for name, _ in model.named_parameters())


def test_post_norm_block_normalises_the_sums():
    cfg = DecoderConfig(n_layers=2, d_model=16, n_heads=2, d_vocab=11, n_ctx=8, norm_placement=NormPlacement.POST, final_norm=False)
    model = HookedDecoder(cfg)
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.arange(8)[None])
    norm = lambda x, ln: torch.nn.functional.layer_norm(x, (16,), ln.w, ln.b, cfg.eps)  # noqa: E731
    for layer, block in enumerate(model.blocks):
        c = lambda name: cache[f"blocks.{layer}.{name}"]  # noqa: E731
        torch.testing.assert_close(c("hook_resid_mid"), norm(c("hook_resid_pre") + c("hook_attn_out"), block.ln1))
        torch.testing.assert_close(c("hook_resid_post"), norm(c("hook_resid_mid") + c("hook_mlp_out"), block.ln2))
    assert "ln_final.hook_scale" not in model.hook_names


def test_gqa_config_errors():
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        DecoderConfig(n_layers=1, d_model=16, n_heads=4, n_kv_heads=3, d_vocab=11, n_ctx=8)
    with pytest.raises(ValueError, match="d_head must be even"):
        DecoderConfig(n_layers=1, d_model=15, n_heads=5, d_vocab=11, n_ctx=8, positions="rotary")
    with pytest.raises(ValueError, match="rotary_dim must be even and at most d_head=4, got rotary_dim=6"):
        DecoderConfig(n_layers=1, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, positions="rotary", rotary_dim=6)
    with pytest.raises(ValueError, match="rotary_dim=2 applies only to positions=rotary"):
        DecoderConfig(n_layers=1, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, rotary_dim=2)
    with pytest.raises(ValueError, match="'rotary', 'shortformer', 'alibi'"):
        DecoderConfig(n_layers=1, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, positions="xpos")


def test_unsupported_model_type_lists_the_supported(tmp_path):
    from probe.loading import CheckpointError

    (tmp_path / "config.json").write_text('{"model_type": "rwkv5"}')
    with pytest.raises(CheckpointError, match="'rwkv5' is not supported; supported: gpt2, openai-gpt, llama, qwen2, "
                                              "qwen3, qwen3_5_text, qwen3_5_moe_text, qwen3_next, qwen3_vl, qwen2_5_vl, qwen3_vl_moe, qwen3_5, "
                                              "qwen3_5_moe, llama4_text, llama4, mistral, mistral3, ministral3, olmo, olmo2, olmo3, olmo_hybrid, smollm3, exaone, hunyuan_v1_dense, "
                                              "exaone4, arcee, nanochat, bitnet, glm, glm4, glm4v, ernie4_5, "
                                              "seed_oss, "
                                              "cohere, "
                                              "cohere2, granite, granitemoe, granitemoehybrid, bamba, falcon_h1, mamba2, nemotron_h, zamba2, modernbert-decoder, mamba, falcon_mamba, rwkv, jamba, lfm2, lfm2_moe, recurrent_gemma, apertus, gemma, gemma2, vaultgemma, gemma3_text, gemma3, "
                                              "afmoe, laguna, gemma4_text, gemma4, gemma4_unified, "
                                              "gpt_neox, "
                                              "gpt_neo, opt, xglm, phi, gptj, codegen, phi3, mixtral, phimoe, jetmoe, olmoe, flex_olmo, qwen3_moe, "
                                              "qwen2_moe, glm4_moe, minimax_m2, ernie4_5_moe, gpt_oss, falcon, mpt, stablelm, starcoder2, nemotron, jais2, deepseek_v2, deepseek_v3, "
                                              "glm4_moe_lite, youtu, glm_moe_dsa, gpt_bigcode, "
                                              "bloom, llava, llava_next, llava_onevision, idefics3, emu3, qwen2_audio, audioflamingo3, musicflamingo, glmasr$"):
        HookedDecoder.from_pretrained(tmp_path)


def test_per_layer_head_counts_run_save_and_load(tmp_path):
    cfg = DecoderConfig(n_layers=3, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, heads_per_layer=(4, 2, 0))
    model = HookedDecoder(cfg).eval()
    tokens = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fast = model(tokens)
        explicit, cache = model.run_with_cache(tokens, names=lambda n: "pattern" in n or "result" in n)
    torch.testing.assert_close(fast, explicit, atol=1e-5, rtol=0)
    assert cache["blocks.1.attn.hook_pattern"].shape[1] == 2 and cache["blocks.2.attn.hook_result"].shape[2] == 0
    again = HookedDecoder.from_pretrained(model.save_pretrained(tmp_path / "pruned"))
    assert again.cfg.heads_per_layer == (4, 2, 0)
    with torch.no_grad():
        assert torch.equal(again(tokens), fast)
    with pytest.raises(ValueError, match="heads_per_layer"):
        DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, heads_per_layer=(4, 5))


# ---- GPT-NeoX (Pythia) -------------------------------------------------------------------------------
def test_neox_patterns_partial_rotary_and_no_resid_mid(tmp_path):
    hf = build("neox", tmp_path)
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    assert ours.cfg.norm_placement is NormPlacement.PARALLEL and ours.cfg.rotary_dim == 4 and ours.cfg.d_head == 16
    tokens = torch.randint(0, 103, (2, 15), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf(tokens, output_attentions=True)
        _, cache = ours.run_with_cache(tokens)
    for layer in range(2):
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_pattern"], expected.attentions[layer], atol=1e-4, rtol=0)
    assert not any("resid_mid" in name for name in ours.hook_names)
    # only the first rotary_dim dimensions of q and k turn; the rest pass through
    q, rot_q = cache["blocks.0.attn.hook_q"], cache["blocks.0.attn.hook_rot_q"]
    assert torch.equal(rot_q[..., 4:], q[..., 4:])
    assert not torch.allclose(rot_q[:, 5, :, :4], q[:, 5, :, :4])
    pair_norm = lambda x: x[..., :2] ** 2 + x[..., 2:4] ** 2  # noqa: E731  pairs (i, i + rotary_dim/2)
    torch.testing.assert_close(pair_norm(rot_q), pair_norm(q), atol=1e-5, rtol=1e-5)


def test_neox_weight_views_are_transformers_parameters(tmp_path):
    """GPT-NeoX interleaves q, k, v per head in one [(head qkv d_head) d_model] matrix."""
    hf = build("neox", tmp_path)
    ours = HookedDecoder.from_pretrained(tmp_path)
    dh = ours.cfg.d_head
    for block, theirs in zip(ours.blocks, hf.gpt_neox.layers):
        weight, bias = theirs.attention.query_key_value.weight, theirs.attention.query_key_value.bias
        for h in range(4):
            rows = lambda part: slice((3 * h + part) * dh, (3 * h + part + 1) * dh)  # noqa: E731
            for part, (w_view, b_view) in enumerate(((block.attn.W_Q, block.attn.b_Q), (block.attn.W_K, block.attn.b_K),
                                                     (block.attn.W_V, block.attn.b_V))):
                assert torch.equal(w_view[h], weight[rows(part)].T), (h, part)
                assert torch.equal(b_view[h], bias[rows(part)]), (h, part)
            assert torch.equal(block.attn.W_O[h], theirs.attention.dense.weight[:, h * dh:(h + 1) * dh].T)
        assert torch.equal(block.mlp.W_in, theirs.mlp.dense_h_to_4h.weight.T)
        assert torch.equal(block.mlp.W_out, theirs.mlp.dense_4h_to_h.weight.T)
        assert torch.equal(block.ln2.w, theirs.post_attention_layernorm.weight)
    assert torch.equal(ours.unembed.W_U, hf.lm_head.weight.T)
    assert not torch.equal(ours.unembed.weight, ours.embed.W_E)


def test_neox_loads_a_pythia_style_checkpoint(tmp_path):
    """The files on the hub (Pythia) predate transformers 5: rotary_pct / rotary_emb_base in config.json,
    the head saved as embed_out, and the causal-mask and rotary buffers saved beside the weights."""
    import json

    from safetensors.torch import load_file, save_file

    hf = build("neox", tmp_path / "new")
    config = json.loads((tmp_path / "new" / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(rotary_pct=0.25, rotary_emb_base=1000, transformers_version="4.24.0")
    state = load_file(str(tmp_path / "new" / "model.safetensors"))
    head = state.pop("embed_out.weight", None)
    head = state.pop("lm_head.weight") if head is None else head
    for layer in range(2):
        state[f"gpt_neox.layers.{layer}.attention.bias"] = torch.ones(1, 1, 40, 40, dtype=torch.bool).tril()
        state[f"gpt_neox.layers.{layer}.attention.masked_bias"] = torch.tensor(-1e9)
        state[f"gpt_neox.layers.{layer}.attention.rotary_emb.inv_freq"] = torch.ones(2)
    tokens = torch.randint(0, 103, (1, 30), generator=torch.Generator().manual_seed(6))
    for head_name in ("embed_out.weight", "lm_head.weight"):  # the file format, and some conversions' name
        old = tmp_path / head_name
        old.mkdir()
        (old / "config.json").write_text(json.dumps(config))
        save_file({**state, head_name: head}, str(old / "model.safetensors"))
        ours = HookedDecoder.from_pretrained(old).eval()
        assert ours.cfg.rotary_dim == 4 and ours.cfg.rotary_base == 1000.0
        with torch.no_grad():
            torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-4, rtol=0)


def test_neox_config_without_a_rotary_fraction_rotates_a_quarter_as_transformers_does(tmp_path):
    import json

    build("neox", tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters")
    config.pop("rotary_pct", None)
    config["rotary_emb_base"] = 1000
    (tmp_path / "config.json").write_text(json.dumps(config))
    import transformers as tf

    theirs = tf.GPTNeoXForCausalLM.from_pretrained(tmp_path).eval()
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    assert ours.cfg.rotary_dim == theirs.gpt_neox.layers[0].attention.rotary_ndims == 4
    tokens = torch.randint(0, 103, (1, 30), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, atol=1e-4, rtol=0)


def test_neox_saved_rotary_fraction_survives_transformers_rounding(tmp_path):
    """transformers computes the rotated width as int(d_head * fraction); 4 / 49 * 49 truncates to 3."""
    cfg = DecoderConfig(n_layers=1, d_model=98, n_heads=2, d_vocab=30, n_ctx=12, positions="rotary", rotary_dim=4,
                        norm_placement="parallel", activation="gelu", tied_embeddings=False)
    assert int(49 * (4 / 49)) == 3
    model = HookedDecoder(cfg).eval()
    out = model.save_pretrained(tmp_path / "odd")
    import transformers as tf

    hf = tf.GPTNeoXForCausalLM.from_pretrained(out).eval()
    assert hf.gpt_neox.layers[0].attention.rotary_ndims == 4
    tokens = torch.randint(0, 30, (1, 12), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=0)
    assert HookedDecoder.from_pretrained(out).cfg == cfg


# ---- rotary scaling (Llama 3.1+) ----------------------------------------------------------------------
def test_llama3_frequencies_follow_the_published_rule(tmp_path):
    """Meta's rule, by wavelength: shorter than original / high_freq_factor kept, longer than original /
    low_freq_factor divided by the factor, between smoothly blended. Computed here in float64."""
    build("llama", tmp_path, max_position_embeddings=64, head_dim=32,
          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 512})
    model = HookedDecoder.from_pretrained(tmp_path)
    got = model.blocks[0].attn.rotary.inv_freq.double()
    expected = []
    for i in range(16):
        freq = 500000.0 ** (-2 * i / 32)
        wavelength = 2 * math.pi / freq
        if wavelength < 512 / 4.0:
            expected.append(freq)
        elif wavelength > 512 / 1.0:
            expected.append(freq / 8.0)
        else:
            smooth = (512 / wavelength - 1.0) / (4.0 - 1.0)
            expected.append((1 - smooth) * freq / 8.0 + smooth * freq)
    expected = torch.tensor(expected, dtype=torch.float64)
    kinds = {"kept": 0, "divided": 0, "blended": 0}
    for g, e, i in zip(got, expected, range(16)):
        freq = 500000.0 ** (-2 * i / 32)
        kinds["kept" if e == freq else "divided" if abs(e - freq / 8) < 1e-18 else "blended"] += 1
    assert all(kinds.values()), kinds  # the test covers all three regimes
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_rotary_scaling_changes_the_model_and_is_refused_where_unknown(tmp_path):
    hf = build("llama", tmp_path / "scaled", **CASES["llama3-rope-scaling"][1])
    scaled = HookedDecoder.from_pretrained(tmp_path / "scaled").eval()
    plain = HookedDecoder(dataclasses.replace(scaled.cfg, rotary_scaling=None)).eval()
    plain.load_state_dict(scaled.state_dict())
    tokens = torch.randint(0, 101, (1, 40), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert (plain(tokens) - hf(tokens).logits).abs().max() > 1e-3  # 10x the family test's tolerance: it can fail
    import json

    from probe.loading import CheckpointError

    config = json.loads((tmp_path / "scaled" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    (tmp_path / "scaled" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="rope scaling 'dynamic' is not supported; supported: default .*linear, llama3, "
                                              "yarn"):
        HookedDecoder.from_pretrained(tmp_path / "scaled")
    with pytest.raises(ValueError, match="rotary_scaling applies only to positions=rotary"):
        DecoderConfig(n_layers=1, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, rotary_scaling={"kind": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="llama3 rotary scaling needs original_n_ctx"):
        DecoderConfig(n_layers=1, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, positions="rotary",
                      rotary_scaling={"kind": "llama3", "factor": 2.0})
    cfg = DecoderConfig(n_layers=1, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, positions="rotary",
                        rotary_scaling={"kind": "linear", "factor": 2.0})
    assert DecoderConfig.from_dict(cfg.to_dict()) == cfg


# ---- sliding-window attention (Mistral) ----------------------------------------------------------------
def test_sliding_window_patterns_match_transformers_and_reach_back_window_tokens(tmp_path):
    hf = build("mistral", tmp_path)
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    assert ours.cfg.sliding_window == 6
    tokens = torch.randint(0, 101, (2, 30), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        expected = hf(tokens, output_attentions=True)
        _, cache = ours.run_with_cache(tokens, names=lambda n: n.endswith("hook_pattern"))
    for layer in range(2):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        torch.testing.assert_close(pattern, expected.attentions[layer], atol=1e-4, rtol=0)
        query, key = torch.meshgrid(torch.arange(30), torch.arange(30), indexing="ij")
        outside = (key > query) | (query - key >= 6)  # later, or 6 or more tokens back
        assert not pattern[..., outside].any() and (pattern[..., ~outside] > 0).all()


def test_sliding_window_counts_real_tokens_so_padding_changes_nothing(tmp_path):
    build("mistral", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(1, 101, (2, 20), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(tokens)
    mask[1, :7] = 0  # the second prompt is left-padded by 7
    with torch.no_grad():
        batched = model(tokens, attention_mask=mask)
        alone = model(tokens[1:, 7:])
    torch.testing.assert_close(batched[1, 7:], alone[0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        DecoderConfig(n_layers=1, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, sliding_window=0)


# ---- Gemma and Gemma 2 ---------------------------------------------------------------------------------
def test_gemma2_hooks_follow_its_sandwich_and_caps(tmp_path):
    """Against transformers' own modules: the embedding is scaled by sqrt(d_model) (rounded to the weights'
    dtype), each write is normalised (ln1_post, ln2_post), scores are capped before the mask, patterns on the
    windowed layers are zero past the window, and the logits are capped."""
    hf = build("gemma2", tmp_path)
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    assert ours.cfg.sliding_layers == (True, False, True) and ours.cfg.attn_scale_dim == 20
    tokens = torch.randint(0, 101, (2, 25), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        expected = hf(tokens, output_attentions=True, output_hidden_states=True)
        _, cache = ours.run_with_cache(tokens)
        embed = hf.model.embed_tokens(tokens)
        layer0 = hf.model.layers[0]
        torch.testing.assert_close(cache["hook_embed"], embed, atol=1e-5, rtol=0)
        normed = layer0.input_layernorm(embed)
        torch.testing.assert_close(cache["blocks.0.ln1.hook_normalized"] * ours.blocks[0].ln1.w, normed, atol=1e-5, rtol=0)
    for layer in range(3):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        torch.testing.assert_close(pattern, expected.attentions[layer], atol=1e-4, rtol=0)
        query, key = torch.meshgrid(torch.arange(25), torch.arange(25), indexing="ij")
        reach = (query - key >= 6) & (key <= query)
        assert bool(pattern[..., reach].any()) == (layer == 1)  # only the full-attention layer sees 6+ back
        scores = cache[f"blocks.{layer}.attn.hook_attn_scores"]
        assert float(scores[torch.isfinite(scores)].abs().max()) <= 5.0
        c = lambda n: cache[f"blocks.{layer}.{n}"]  # noqa: E731
        block = ours.blocks[layer]
        torch.testing.assert_close(c("hook_attn_out"), c("ln1_post.hook_normalized") * block.ln1_post.w, atol=1e-5, rtol=0)
        torch.testing.assert_close(c("hook_resid_mid"), c("hook_resid_pre") + c("hook_attn_out"), atol=1e-5, rtol=0)
        torch.testing.assert_close(c("hook_resid_post"), c("hook_resid_mid") + c("hook_mlp_out"), atol=1e-5, rtol=0)
    assert float(ours(tokens).detach().abs().max()) <= 3.0


def test_gemma_norm_weights_are_one_plus_the_stored_offset(tmp_path):
    hf = build("gemma", tmp_path)
    ours = HookedDecoder.from_pretrained(tmp_path)
    for block, theirs in zip(ours.blocks, hf.model.layers):
        assert torch.equal(block.ln1.w, 1 + theirs.input_layernorm.weight)
        assert torch.equal(block.ln2.w, 1 + theirs.post_attention_layernorm.weight)
    assert torch.equal(ours.ln_final.w, 1 + hf.model.norm.weight)
    assert ours.embed.scale == 8.0 and ours.unembed.weight is ours.embed.W_E  # tied, and unscaled in the unembedding


def _edit_config(directory, **changes):
    import json

    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DROP:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


_DROP = object()


@pytest.mark.parametrize("kind, changes", [
    ("gemma", dict(hidden_act="gelu")),  # the released Gemma configs: transformers reads it as the tanh GELU
    ("gemma2", dict(hidden_act="gelu", hidden_activation=_DROP)),  # Gemma 2 reads only hidden_activation
    ("gemma2", dict(query_pre_attn_scalar=_DROP, attn_logit_softcapping=_DROP, final_logit_softcapping=_DROP,
                    sliding_window=_DROP, layer_types=_DROP)),  # keys left out: transformers' defaults
    ("gemma2", dict(layer_types=["full_attention"] * 3)),  # a window no layer uses
    ("vaultgemma", dict(query_pre_attn_scalar=_DROP, attn_logit_softcapping=_DROP, final_logit_softcapping=_DROP,
                        sliding_window=_DROP, layer_types=_DROP, hidden_activation=_DROP)),
    ("mistral", dict(sliding_window=_DROP)),
])
def test_config_fields_are_read_as_transformers_reads_them(kind, changes, tmp_path):
    import transformers as tf

    build(kind, tmp_path, max_position_embeddings=5000)
    _edit_config(tmp_path, **changes)
    theirs = getattr(tf, {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "mistral": "MistralForCausalLM",
                          "vaultgemma": "VaultGemmaForCausalLM"}[kind])
    hf = theirs.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (1, 24), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-4, rtol=0)
    if kind == "mistral" or "sliding_window" in changes:
        assert ours.cfg.sliding_window == 4096
    again = HookedDecoder.from_pretrained(ours.save_pretrained(tmp_path / "saved"))
    assert again.cfg == ours.cfg


@pytest.mark.parametrize("kind", ["gemma", "gemma2"])
def test_a_bfloat16_gemma_file_loads_exactly_and_keeps_its_norms_in_float32(kind, tmp_path):
    """Gemma stores w - 1 and adds the 1 in float32; rounding 1 + w to bfloat16 would cost ~1e-2 in the logits."""
    hf = build(kind, tmp_path / "f32")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    theirs = type(hf).from_pretrained(tmp_path / "bf16", dtype=torch.float32, attn_implementation="eager").eval()
    ours = HookedDecoder.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    tokens = torch.randint(0, 101, (2, 20), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, atol=1e-4, rtol=0)
    half = HookedDecoder.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16).eval()
    assert half.blocks[0].ln1.w.dtype == torch.float32 and half.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
    assert torch.equal(half.blocks[0].ln1.w, 1 + theirs.model.layers[0].input_layernorm.weight)
    # in bfloat16 the norm rounds once, after multiplying in float32, as transformers' Gemma norm does
    x = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(16)).to(torch.bfloat16)
    hf_half = type(hf).from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        mine, theirs_norm = half.blocks[0].ln1(x), hf_half.model.layers[0].input_layernorm(x)
    assert mine.dtype == torch.bfloat16
    assert float((mine.float() - theirs_norm.float()).abs().max()) <= 2**-7 * float(theirs_norm.float().abs().max())
    assert float((mine != theirs_norm).float().mean()) < 0.01  # rsqrt vs sqrt-then-divide: a rare last-bit tie
    again = HookedDecoder.from_pretrained(half.save_pretrained(tmp_path / "saved"))
    assert torch.equal(again.blocks[0].ln1.w, half.blocks[0].ln1.w)  # w - 1 written in float32: nothing lost


def test_all_true_sliding_layers_are_the_same_config_as_none():
    base = dict(n_layers=2, d_model=16, n_heads=4, d_vocab=11, n_ctx=8, sliding_window=3)
    assert DecoderConfig(**base, sliding_layers=(True, True)) == DecoderConfig(**base)
    assert DecoderConfig(**base, sliding_layers=(True, False)).layer_window(1) is None


def test_qwen3_normalises_each_heads_query_and_key_before_rotating(tmp_path):
    """Against transformers' own q_norm / k_norm modules on the same projections: hook_q is the projection,
    hook_q_normed what rotary and the scores use (transformer-lens's names)."""
    hf = build("qwen3", tmp_path)
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 101, (2, 15), generator=torch.Generator().manual_seed(17))
    with torch.no_grad():
        _, cache = ours.run_with_cache(tokens)
        attn = hf.model.layers[1].self_attn
        x = hf.model.layers[1].input_layernorm(cache["blocks.1.hook_resid_pre"])
        q = attn.q_norm(attn.q_proj(x).view(2, 15, 8, 16))
        k = attn.k_norm(attn.k_proj(x).view(2, 15, 2, 16))
    torch.testing.assert_close(cache["blocks.1.attn.hook_q_normed"], q, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["blocks.1.attn.hook_k_normed"], k, atol=1e-5, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(cache["blocks.1.attn.hook_q"], attn.q_proj(x).view(2, 15, 8, 16), atol=1e-5, rtol=0)
    assert cache["blocks.1.attn.q_norm.hook_scale"].shape == (2, 15, 8, 1)
    assert torch.equal(ours.blocks[1].attn.q_norm.w, attn.q_norm.weight)


@pytest.mark.parametrize("kind, change, match", [
    ("qwen2", dict(use_sliding_window=True), "use_sliding_window=true"),
    ("gemma2", dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "chunked_attention"),
    ("neox", dict(tie_word_embeddings=False), "missing the tensor 'embed_out.weight'"),
    ("olmo", dict(clip_qkv=-8.0), r"clip_qkv must be a positive number or None, got -8.0"),
    # hostile or mistyped fields of the newer families: one line naming the file and the field
    ("gptneo", dict(window_size="256"), r"config.json: window_size must be a positive integer, got the string '256'"),
    ("gptneo", dict(num_layers=10**7), r"config.json: num_layers=10000000, but the weights hold 3 layers"),
    ("opt", dict(word_embed_proj_dim=0), r"config.json: word_embed_proj_dim must be a positive integer, got 0"),
    ("opt", dict(do_layer_norm_before="yes"), r"do_layer_norm_before must be true or false"),
    ("phi", dict(partial_rotary_factor="0.4"), r"partial_rotary_factor must be a finite number"),
    ("gptj", dict(rotary_dim=7), r"rotary_dim must be even"),
    ("bloom", dict(n_head=5), r"d_model=64 is not divisible by n_heads=5"),
    ("bloom", dict(seq_length="2048"), r"n_ctx must be a positive int, got '2048'"),
    ("mixtral", dict(num_experts_per_tok=9), r"per_token=9\) picks more experts than there are \(n=4\)"),
    ("mixtral", dict(num_local_experts=0), r"Experts.n must be a positive int, got 0"),
    ("olmoe", dict(num_experts_per_tok=True), r"Experts.per_token must be a positive int, got True"),
])
def test_checkpoint_settings_that_cannot_load_are_refused_by_name(kind, change, match, tmp_path):
    from safetensors.torch import load_file, save_file

    from probe.loading import CheckpointError

    build(kind, tmp_path)
    _edit_config(tmp_path, **change)
    if kind == "neox":  # the untied head's tensor is gone
        state = {k: v for k, v in load_file(str(tmp_path / "model.safetensors")).items()
                 if k not in ("embed_out.weight", "lm_head.weight")}
        save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=match):
        HookedDecoder.from_pretrained(tmp_path)


def test_a_gemma_model_with_exact_gelu_cannot_be_saved_as_gemma(tmp_path):
    build("gemma", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path)
    exact = HookedDecoder(dataclasses.replace(model.cfg, activation="gelu"))
    with pytest.raises(ValueError, match="tanh approximation"):
        exact.save_pretrained(tmp_path / "exact")
    assert not (tmp_path / "exact").exists()


def test_an_unembedding_is_checked_like_every_tensor(tmp_path):
    """An untied head with a NaN is refused like any corrupt tensor; a head saved beside a tied embedding must
    equal it (it used to be dropped without a word)."""
    from safetensors.torch import load_file, save_file

    from probe.loading import CheckpointError

    build("llama", tmp_path / "untied")  # tie_word_embeddings=False
    state = load_file(str(tmp_path / "untied" / "model.safetensors"))
    state["lm_head.weight"][0, 0] = float("nan")
    save_file(state, str(tmp_path / "untied" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'lm_head.weight'.*NaN"):
        HookedDecoder.from_pretrained(tmp_path / "untied")
    build("llama", tmp_path / "tied", tie_word_embeddings=True)
    state = load_file(str(tmp_path / "tied" / "model.safetensors"))
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1
    save_file(state, str(tmp_path / "tied" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="differs from the embedding, but the config ties them"):
        HookedDecoder.from_pretrained(tmp_path / "tied")


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "rope_theta": 500.0, "factor": 8.0, "original_max_position_embeddings": 12, "beta_fast": 16,
     "beta_slow": 2, "truncate": False},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707,
     "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
     "attention_factor": 1.3},
], ids=["default", "betas-untruncated", "mscale-ratio", "attention-factor"])
def test_yarn_rope_scaling_matches_transformers_and_survives_saving(rope, tmp_path):
    """YaRN (Qwen2.5's and DeepSeek's long-context rope): transformers' frequencies (a ramp between interpolated and
    kept dimensions), its attention factor on q and k (given, or from factor and mscale), past the pretraining
    context; written back so that transformers reads the same model."""
    import transformers as tf

    hf = build("llama", tmp_path / "original", rope_parameters=rope, max_position_embeddings=64)
    ours = HookedDecoder.from_pretrained(tmp_path / "original").eval()
    assert ours.cfg.rotary_scaling.kind == "yarn"
    tokens = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(21))
    again = tf.LlamaForCausalLM.from_pretrained(ours.save_pretrained(tmp_path / "saved"), attn_implementation="eager")
    with torch.no_grad():
        expected = hf(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(again.eval()(tokens).logits, expected, atol=1e-5, rtol=0)
