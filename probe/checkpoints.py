"""Hugging Face checkpoint families: how each one's config and tensor names map onto DecoderConfig.

One small table of functions per family: checkpoint_gpt.py (GPT-2, GPT-1, GPT-NeoX), checkpoint_gptneo.py (GPT-Neo),
checkpoint_gptj.py (GPT-J, CodeGen), checkpoint_opt.py (OPT, XGLM), checkpoint_bloom.py (Bloom), checkpoint_moe.py (Mixtral,
OLMoE, FlexOlmo, Qwen2/3-MoE, GLM-4.5), checkpoint_minimax.py (MiniMax-M2), checkpoint_ernie_moe.py (ERNIE 4.5 MoE),
checkpoint_gpt_oss.py (GPT-OSS), checkpoint_bigcode.py (SantaCoder, StarCoder),
checkpoint_stablelm.py (StableLM), checkpoint_mpt.py (MPT), checkpoint_falcon.py (Falcon), checkpoint_phi.py (Phi,
Phi-3), checkpoint_phimoe.py (PhiMoE), checkpoint_jetmoe.py (JetMoE), checkpoint_llama.py (Llama, Qwen2/3, Mistral, OLMo, OLMo 2 and 3, SmolLM3, Arcee, Seed-OSS, ERNIE 4.5, Gemma, Gemma 2,
VaultGemma),
checkpoint_gemma3.py (Gemma 3), checkpoint_gemma4.py (Gemma 4), checkpoint_afmoe.py (AFMoE), checkpoint_laguna.py (Laguna), checkpoint_mistral3.py (Mistral 3's language model, Ministral 3), checkpoint_apertus.py (Apertus), checkpoint_granite.py (Granite, GraniteMoE), checkpoint_mamba.py (Mamba-2, Granite 4.0-H, Bamba), checkpoint_falcon_h1.py (Falcon-H1), checkpoint_nemotron_h.py (Nemotron-H), checkpoint_zamba2.py (Zamba2: shared transformer blocks), checkpoint_modernbert.py (ModernBERT decoders: a prediction head before W_U), checkpoint_mamba1.py (Mamba, FalconMamba), checkpoint_rwkv.py (RWKV-4),
checkpoint_lfm2.py (LFM2, LFM2-MoE: short convolutions), checkpoint_recurrent_gemma.py (RecurrentGemma: Griffin's recurrent blocks), checkpoint_llama4.py (Llama 4 and its multimodal files' language model), checkpoint_jamba.py (Jamba: Mamba-1 mixers, attention, experts),
checkpoint_cohere.py (Cohere, Cohere 2), checkpoint_layernorm_llama.py (StarCoder 2, Nemotron, Jais 2), checkpoint_glm.py (GLM, GLM-4, GLM-4V's language model), checkpoint_hunyuan.py (HunYuan), checkpoint_nanochat.py (NanoChat), checkpoint_bitnet.py (BitNet), checkpoint_exaone.py (EXAONE 3, EXAONE 4), checkpoint_qwen35.py (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), checkpoint_olmo_hybrid.py (OLMo-Hybrid), checkpoint_qwen_vl.py (Qwen3-VL's and Qwen2.5-VL's language models), checkpoint_deepseek.py (DeepSeek-V2, DeepSeek-V3, GLM-4.7-Flash, Youtu: latent attention), checkpoint_glm_dsa.py (GLM-5: latent attention with a sparse indexer), checkpoint_wrapped.py (LLaVA,
LLaVA-NeXT, LLaVA-OneVision, Idefics3: any family's language model inside a multimodal file); checkpoint_source.py holds what they share and loading.py does the file handling for
all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from probe.checkpoint_afmoe import afmoe_config, afmoe_config_to_hf, afmoe_to_hf, afmoe_to_probe
from probe.checkpoint_laguna import laguna_config, laguna_config_to_hf, laguna_to_hf, laguna_to_probe
from probe.checkpoint_apertus import apertus_config, apertus_config_to_hf, apertus_to_hf, apertus_to_probe
from probe.checkpoint_bigcode import bigcode_config, bigcode_config_to_hf, bigcode_to_hf, bigcode_to_probe
from probe.checkpoint_bitnet import bitnet_config, bitnet_config_to_hf, bitnet_to_hf, bitnet_to_probe
from probe.checkpoint_bloom import bloom_config, bloom_config_to_hf, bloom_to_hf, bloom_to_probe
from probe.checkpoint_gpt import (gpt1_config, gpt1_config_to_hf, gpt2_config, gpt2_config_to_hf, gpt_to_hf, gpt_to_probe,
                                  gpt1_names, gpt2_names, neox_config, neox_config_to_hf, neox_to_hf, neox_to_probe)
from probe.checkpoint_deepseek import latent_config, latent_config_to_hf, latent_family
from probe.checkpoint_glm_dsa import glm_dsa_config, glm_dsa_config_to_hf, glm_dsa_to_hf, glm_dsa_to_probe
from probe.checkpoint_cohere import cohere2_config, cohere_config, cohere_config_to_hf, cohere_to_hf, cohere_to_probe
from probe.checkpoint_ernie_moe import (ernie4_5_moe_config, ernie4_5_moe_config_to_hf, ernie4_5_moe_to_hf,
                                        ernie4_5_moe_to_probe)
from probe.checkpoint_exaone import (exaone4_config, exaone4_config_to_hf, exaone_config, exaone_config_to_hf,
                                     exaone_to_hf, exaone_to_probe)
from probe.checkpoint_falcon import falcon_config, falcon_config_to_hf, falcon_to_hf, falcon_to_probe
from probe.checkpoint_falcon_h1 import falcon_h1_config, falcon_h1_config_to_hf, falcon_h1_to_hf, falcon_h1_to_probe
from probe.checkpoint_gemma3 import gemma3_config, gemma3_config_to_hf, gemma3_multimodal
from probe.checkpoint_gemma4 import (gemma4_config, gemma4_config_to_hf, gemma4_multimodal_config,
                                     gemma4_multimodal_config_to_hf, gemma4_multimodal_to_probe, gemma4_to_hf,
                                     gemma4_to_probe, gemma4_unified_config)
from probe.checkpoint_glm import (glm4v_config, glm4v_config_to_hf, glm4v_to_probe, glm_config, glm_config_to_hf,
                                 glm_to_hf, glm_to_probe)
from probe.checkpoint_mamba import (bamba_config, bamba_config_to_hf, bamba_to_hf, bamba_to_probe, granite_hybrid_config,
                                    granite_hybrid_config_to_hf, granite_hybrid_to_hf, granite_hybrid_to_probe,
                                    mamba2_config, mamba2_config_to_hf, mamba2_to_hf, mamba2_to_probe)
from probe.checkpoint_rwkv import rwkv_config, rwkv_config_to_hf, rwkv_to_hf, rwkv_to_probe
from probe.checkpoint_mamba1 import (falcon_mamba_config, falcon_mamba_config_to_hf, mamba_config, mamba_config_to_hf,
                                     mamba_to_hf, mamba_to_probe)
from probe.checkpoint_granite import (granite_config, granite_config_to_hf, granite_moe_config, granite_moe_config_to_hf,
                                      granite_to_hf, granite_to_probe)
from probe.checkpoint_jamba import jamba_config, jamba_config_to_hf, jamba_to_hf, jamba_to_probe
from probe.checkpoint_hunyuan import hunyuan_config, hunyuan_config_to_hf, hunyuan_to_hf, hunyuan_to_probe
from probe.checkpoint_llama4 import (llama4_config, llama4_config_to_hf, llama4_multimodal_config,
                                     llama4_multimodal_config_to_hf, llama4_multimodal_to_probe, llama4_to_hf,
                                     llama4_to_probe)
from probe.checkpoint_lfm2 import lfm2_config, lfm2_config_to_hf, lfm2_moe_config, lfm2_moe_config_to_hf, lfm2_to_hf, lfm2_to_probe
from probe.checkpoint_recurrent_gemma import (recurrent_gemma_config, recurrent_gemma_config_to_hf, recurrent_gemma_to_hf,
                                              recurrent_gemma_to_probe)
from probe.checkpoint_gpt_oss import gpt_oss_config, gpt_oss_config_to_hf, gpt_oss_to_hf, gpt_oss_to_probe
from probe.checkpoint_gptj import codegen_to_hf, codegen_to_probe, gptj_config, gptj_config_to_hf, gptj_to_hf, gptj_to_probe
from probe.checkpoint_gptneo import gptneo_config, gptneo_config_to_hf, gptneo_to_hf, gptneo_to_probe
from probe.checkpoint_layernorm_llama import (layernorm_llama_config, layernorm_llama_config_to_hf,
                                              layernorm_llama_to_hf, layernorm_llama_to_probe)
from probe.checkpoint_llama import (GEMMA_ACTIVATIONS, VAULTGEMMA_NORMS, vaultgemma_config, arcee_config, gemma2_config, gemma_config, gemma_config_to_hf, gemma_to_hf, gemma_to_probe,
                                    llama_config, llama_config_to_hf, llama_like, llama_to_hf, llama_to_probe, mistral_config,
                                    ernie4_5_config, olmo2_config, olmo3_config, olmo_config, seed_oss_config,
                                    smollm3_config,
                                    qwen2_config, qwen3_config)
from probe.checkpoint_minimax import minimax_m2_config, minimax_m2_config_to_hf, minimax_m2_to_hf, minimax_m2_to_probe
from probe.checkpoint_zamba2 import zamba2_config, zamba2_config_to_hf, zamba2_to_hf, zamba2_to_probe
from probe.checkpoint_nemotron_h import (nemotron_h_config, nemotron_h_config_to_hf, nemotron_h_to_hf,
                                         nemotron_h_to_probe)
from probe.checkpoint_mistral3 import ministral3_config, ministral3_config_to_hf, mistral3
from probe.checkpoint_moe import (flex_olmo_config, glm4_moe_config, mixtral_config, moe_family, olmoe_config,
                                  qwen2_moe_config, qwen3_moe_config)
from probe.checkpoint_modernbert import (modernbert_decoder_config, modernbert_decoder_config_to_hf,
                                         modernbert_decoder_to_hf, modernbert_decoder_to_probe)
from probe.checkpoint_mpt import mpt_config, mpt_config_to_hf, mpt_to_hf, mpt_to_probe
from probe.checkpoint_nanochat import nanochat_config, nanochat_config_to_hf, nanochat_to_hf, nanochat_to_probe
from probe.checkpoint_olmo_hybrid import (olmo_hybrid_config, olmo_hybrid_config_to_hf, olmo_hybrid_to_hf,
                                          olmo_hybrid_to_probe)
from probe.checkpoint_opt import (opt_config, opt_config_to_hf, opt_to_hf, opt_to_probe, xglm_config, xglm_config_to_hf,
                                  xglm_to_hf, xglm_to_probe)
from probe.checkpoint_phimoe import phimoe_config, phimoe_config_to_hf, phimoe_to_hf, phimoe_to_probe
from probe.checkpoint_jetmoe import jetmoe_config, jetmoe_config_to_hf, jetmoe_to_hf, jetmoe_to_probe
from probe.checkpoint_phi import (phi3_config, phi3_config_to_hf, phi3_to_hf, phi3_to_probe, phi_config, phi_config_to_hf,
                                  phi_to_hf, phi_to_probe)
from probe.checkpoint_qwen35 import (qwen35_config, qwen35_config_to_hf, qwen35_moe_config, qwen35_moe_multimodal,
                                     qwen35_multimodal, qwen35_to_hf, qwen35_to_probe, qwen3_next_config)
from probe.checkpoint_qwen_vl import (qwen2_5_vl_config, qwen3_vl_config, qwen3_vl_moe_config, qwen3_vl_moe_to_probe,
                                      qwen_vl_config_to_hf, vl_text_to_probe)
from probe.checkpoint_source import GPT_ACTIVATIONS, Source
from probe.checkpoint_wrapped import WRAPPERS, wrapped_language_model
from probe.checkpoint_stablelm import stablelm_config, stablelm_config_to_hf, stablelm_to_hf, stablelm_to_probe
from probe.config import Activation, DecoderConfig, NormPlacement
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

__all__ = ["CheckpointError", "Family", "FAMILIES", "GEMMA_ACTIVATIONS", "GPT_ACTIVATIONS", "Source", "family_for_config",
           "prepends_bos_by_default"]


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    prefixes: tuple[str, ...]  # stripped from tensor names (LM-head wrappers add them)
    config_from_hf: Callable[[dict], DecoderConfig]
    config_to_hf: Callable[[DecoderConfig, Optional[Tokenizer]], dict]
    to_probe: Callable[[Source, DecoderConfig], dict[str, torch.Tensor]]
    to_hf: Callable[[dict[str, torch.Tensor], DecoderConfig], dict[str, torch.Tensor]]
    # whether text gets BOS first by default (cfg.default_prepend_bos): transformer-lens's per-family choice, False
    # for GPT-NeoX/Pythia, Qwen, Phi, PhiMoE, Granite, GLM, ERNIE, MiniMax, EXAONE 4, StarCoder 2 and Seed-OSS, trained without one
    # (TL 3.9's convert_hf_model_config, TL 4's bridge)
    prepends_bos: bool = True
    # a multimodal checkpoint's: the text-only format its language model saves as
    saves_as: Optional[str] = None


FAMILIES = {
    family.model_type: family
    for family in (
        Family("gpt2", "GPT2LMHeadModel", ("transformer.",), gpt2_config, gpt2_config_to_hf,
               gpt_to_probe(gpt2_names), gpt_to_hf(gpt2_names)),
        Family("openai-gpt", "OpenAIGPTLMHeadModel", ("transformer.",), gpt1_config, gpt1_config_to_hf,
               gpt_to_probe(gpt1_names), gpt_to_hf(gpt1_names)),
        Family("llama", "LlamaForCausalLM", ("model.",), llama_config, llama_config_to_hf, llama_to_probe, llama_to_hf),
        Family("qwen2", "Qwen2ForCausalLM", ("model.",), qwen2_config, *llama_like("qwen2"), prepends_bos=False),
        Family("qwen3", "Qwen3ForCausalLM", ("model.",), qwen3_config, *llama_like("qwen3"), prepends_bos=False),
        *(Family(model_type, architecture, ("model.",), config, qwen35_config_to_hf(model_type),
                 qwen35_to_probe(model_type), qwen35_to_hf(model_type), prepends_bos=False)
          for model_type, architecture, config in (
              ("qwen3_5_text", "Qwen3_5ForCausalLM", qwen35_config),
              ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", qwen35_moe_config),
              ("qwen3_next", "Qwen3NextForCausalLM", qwen3_next_config))),
        # the language models of the multimodal files, saved as the text-only formats
        # Qwen3-VL's language models (on text, Qwen3's and Qwen3-MoE's): saved as those
        Family("qwen3_vl", "Qwen3VLForConditionalGeneration", ("model.language_model.",), qwen3_vl_config,
               qwen_vl_config_to_hf, vl_text_to_probe, llama_like("qwen3")[2], prepends_bos=False, saves_as="qwen3"),
        Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", ("model.language_model.", "model."), qwen2_5_vl_config,
               qwen_vl_config_to_hf, vl_text_to_probe, llama_like("qwen2")[2], prepends_bos=False, saves_as="qwen2"),
        Family("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", ("model.language_model.",), qwen3_vl_moe_config,
               qwen_vl_config_to_hf, qwen3_vl_moe_to_probe, moe_family("qwen3_moe")[2], prepends_bos=False,
               saves_as="qwen3_moe"),
        Family("qwen3_5", "Qwen3_5ForConditionalGeneration", ("model.language_model.", "language_model."),
               *qwen35_multimodal, qwen35_to_hf("qwen3_5_text"), prepends_bos=False, saves_as="qwen3_5_text"),
        Family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", ("model.language_model.", "language_model."),
               *qwen35_moe_multimodal, qwen35_to_hf("qwen3_5_moe_text"), prepends_bos=False,
               saves_as="qwen3_5_moe_text"),
        Family("llama4_text", "Llama4ForCausalLM", ("model.",), llama4_config, llama4_config_to_hf, llama4_to_probe,
               llama4_to_hf),
        # the language model of a multimodal one (Scout, Maverick): saved as llama4_text
        Family("llama4", "Llama4ForConditionalGeneration", ("language_model.model.", "language_model."),
               llama4_multimodal_config, llama4_multimodal_config_to_hf, llama4_multimodal_to_probe, llama4_to_hf,
               saves_as="llama4_text"),
        Family("mistral", "MistralForCausalLM", ("model.",), mistral_config, *llama_like("mistral")),
        Family("mistral3", "Mistral3ForConditionalGeneration", ("language_model.model.", "model.language_model.",
                                                                "language_model."),
               *mistral3, llama_to_hf, saves_as="mistral"),
        Family("ministral3", "Ministral3ForCausalLM", ("model.",), ministral3_config, ministral3_config_to_hf,
               llama_to_probe, llama_to_hf, saves_as="mistral"),
        Family("olmo", "OlmoForCausalLM", ("model.",), olmo_config, *llama_like("olmo")),
        Family("olmo2", "Olmo2ForCausalLM", ("model.",), olmo2_config, *llama_like("olmo2")),
        Family("olmo3", "Olmo3ForCausalLM", ("model.",), olmo3_config, *llama_like("olmo3")),
        Family("olmo_hybrid", "OlmoHybridForCausalLM", ("model.",), olmo_hybrid_config, olmo_hybrid_config_to_hf,
               olmo_hybrid_to_probe, olmo_hybrid_to_hf),
        Family("smollm3", "SmolLM3ForCausalLM", ("model.",), smollm3_config, *llama_like("smollm3")),
        Family("exaone", "ExaoneForCausalLM", ("transformer.", "model."), exaone_config, exaone_config_to_hf,
               exaone_to_probe, exaone_to_hf),
        Family("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM", ("model.",), hunyuan_config, hunyuan_config_to_hf,
               hunyuan_to_probe, hunyuan_to_hf),
        Family("exaone4", "Exaone4ForCausalLM", ("model.",), exaone4_config, exaone4_config_to_hf, llama_to_probe,
               llama_to_hf, prepends_bos=False),
        Family("arcee", "ArceeForCausalLM", ("model.",), arcee_config, *llama_like("arcee")),
        Family("nanochat", "NanoChatForCausalLM", ("model.",), nanochat_config, nanochat_config_to_hf,
               nanochat_to_probe, nanochat_to_hf),
        Family("bitnet", "BitNetForCausalLM", ("model.",), bitnet_config, bitnet_config_to_hf, bitnet_to_probe,
               bitnet_to_hf),
        *(Family(model_type, architecture, ("model.",), glm_config(model_type), glm_config_to_hf(model_type),
                 glm_to_probe, glm_to_hf, prepends_bos=False)
          for model_type, architecture in (("glm", "GlmForCausalLM"), ("glm4", "Glm4ForCausalLM"))),
        # GLM-4V's language model (on text, GLM-4's): saved as that
        Family("glm4v", "Glm4vForConditionalGeneration", ("model.language_model.",), glm4v_config, glm4v_config_to_hf,
               glm4v_to_probe, glm_to_hf, prepends_bos=False, saves_as="glm4"),
        Family("ernie4_5", "Ernie4_5ForCausalLM", ("model.",), ernie4_5_config, *llama_like("ernie4_5"),
               prepends_bos=False),
        Family("seed_oss", "SeedOssForCausalLM", ("model.",), seed_oss_config, *llama_like("seed_oss"), prepends_bos=False),
        Family("cohere", "CohereForCausalLM", ("model.",), cohere_config, cohere_config_to_hf, cohere_to_probe,
               cohere_to_hf),
        Family("cohere2", "Cohere2ForCausalLM", ("model.",), cohere2_config,
               lambda cfg, tok: cohere_config_to_hf(cfg, tok, "cohere2"), cohere_to_probe, cohere_to_hf),
        Family("granite", "GraniteForCausalLM", ("model.",), granite_config, granite_config_to_hf, granite_to_probe,
               granite_to_hf, prepends_bos=False),
        Family("granitemoe", "GraniteMoeForCausalLM", ("model.",), granite_moe_config, granite_moe_config_to_hf,
               granite_to_probe, granite_to_hf, prepends_bos=False),
        Family("granitemoehybrid", "GraniteMoeHybridForCausalLM", ("model.",), granite_hybrid_config,
               granite_hybrid_config_to_hf, granite_hybrid_to_probe, granite_hybrid_to_hf, prepends_bos=False),
        Family("bamba", "BambaForCausalLM", ("model.",), bamba_config, bamba_config_to_hf, bamba_to_probe, bamba_to_hf),
        Family("falcon_h1", "FalconH1ForCausalLM", ("model.",), falcon_h1_config, falcon_h1_config_to_hf,
               falcon_h1_to_probe, falcon_h1_to_hf),
        Family("mamba2", "Mamba2ForCausalLM", ("backbone.",), mamba2_config, mamba2_config_to_hf, mamba2_to_probe,
               mamba2_to_hf),
        Family("nemotron_h", "NemotronHForCausalLM", ("backbone.", "model."), nemotron_h_config,
               nemotron_h_config_to_hf, nemotron_h_to_probe, nemotron_h_to_hf),
        Family("zamba2", "Zamba2ForCausalLM", ("model.",), zamba2_config, zamba2_config_to_hf, zamba2_to_probe,
               zamba2_to_hf),
        Family("modernbert-decoder", "ModernBertDecoderForCausalLM", ("model.",), modernbert_decoder_config,
               modernbert_decoder_config_to_hf, modernbert_decoder_to_probe, modernbert_decoder_to_hf),
        Family("mamba", "MambaForCausalLM", ("backbone.",), mamba_config, mamba_config_to_hf, mamba_to_probe,
               mamba_to_hf),
        Family("falcon_mamba", "FalconMambaForCausalLM", ("backbone.",), falcon_mamba_config,
               falcon_mamba_config_to_hf, mamba_to_probe, mamba_to_hf),
        # (BOS first: TL 4's RWKV adapter keeps its default, though the Pile models were trained without one)
        Family("rwkv", "RwkvForCausalLM", ("rwkv.",), rwkv_config, rwkv_config_to_hf, rwkv_to_probe, rwkv_to_hf),
        Family("jamba", "JambaForCausalLM", ("model.",), jamba_config, jamba_config_to_hf, jamba_to_probe, jamba_to_hf),
        Family("lfm2", "Lfm2ForCausalLM", ("model.",), lfm2_config, lfm2_config_to_hf, lfm2_to_probe, lfm2_to_hf),
        Family("lfm2_moe", "Lfm2MoeForCausalLM", ("model.",), lfm2_moe_config, lfm2_moe_config_to_hf, lfm2_to_probe,
               lfm2_to_hf),
        Family("recurrent_gemma", "RecurrentGemmaForCausalLM", ("model.",), recurrent_gemma_config,
               recurrent_gemma_config_to_hf, recurrent_gemma_to_probe, recurrent_gemma_to_hf, prepends_bos=False),
        Family("apertus", "ApertusForCausalLM", ("model.",), apertus_config, apertus_config_to_hf, apertus_to_probe,
               apertus_to_hf),
        Family("gemma", "GemmaForCausalLM", ("model.",), gemma_config,
               lambda cfg, tok: gemma_config_to_hf(cfg, tok, "gemma"), gemma_to_probe, gemma_to_hf),
        Family("gemma2", "Gemma2ForCausalLM", ("model.",), gemma2_config,
               lambda cfg, tok: gemma_config_to_hf(cfg, tok, "gemma2"), gemma_to_probe, gemma_to_hf),
        Family("vaultgemma", "VaultGemmaForCausalLM", ("model.",), vaultgemma_config,
               lambda cfg, tok: gemma_config_to_hf(cfg, tok, "vaultgemma"),
               lambda source, cfg: gemma_to_probe(source, cfg, VAULTGEMMA_NORMS),
               lambda params, cfg: gemma_to_hf(params, cfg, VAULTGEMMA_NORMS)),
        Family("gemma3_text", "Gemma3ForCausalLM", ("model.",), gemma3_config, gemma3_config_to_hf, gemma_to_probe,
               gemma_to_hf),
        # the language model of a multimodal one: saved as gemma3_text (its config_to_hf says so and refuses)
        Family("gemma3", "Gemma3ForConditionalGeneration", ("language_model.model.", "model.language_model.",
                                                            "language_model."),
               *gemma3_multimodal, gemma_to_hf, saves_as="gemma3_text"),
        Family("afmoe", "AfmoeForCausalLM", ("model.",), afmoe_config, afmoe_config_to_hf, afmoe_to_probe, afmoe_to_hf),
        Family("laguna", "LagunaForCausalLM", ("model.",), laguna_config, laguna_config_to_hf, laguna_to_probe,
               laguna_to_hf),
        Family("gemma4_text", "Gemma4ForCausalLM", ("model.",), gemma4_config, gemma4_config_to_hf, gemma4_to_probe,
               gemma4_to_hf),
        # the language model of a multimodal one (E2B, E4B, 31B, 26B-A4B; the encoder-free 12B): saved as gemma4_text
        Family("gemma4", "Gemma4ForConditionalGeneration", ("model.language_model.",), gemma4_multimodal_config,
               gemma4_multimodal_config_to_hf, gemma4_multimodal_to_probe, gemma4_to_hf, saves_as="gemma4_text"),
        Family("gemma4_unified", "Gemma4UnifiedForConditionalGeneration", ("model.language_model.",),
               gemma4_unified_config, gemma4_multimodal_config_to_hf, gemma4_multimodal_to_probe, gemma4_to_hf,
               saves_as="gemma4_text"),
        Family("gpt_neox", "GPTNeoXForCausalLM", ("gpt_neox.",), neox_config, neox_config_to_hf, neox_to_probe, neox_to_hf,
               prepends_bos=False),
        Family("gpt_neo", "GPTNeoForCausalLM", ("transformer.",), gptneo_config, gptneo_config_to_hf, gptneo_to_probe,
               gptneo_to_hf),
        Family("opt", "OPTForCausalLM", ("model.", "decoder."), opt_config, opt_config_to_hf, opt_to_probe, opt_to_hf),
        Family("xglm", "XGLMForCausalLM", ("model.",), xglm_config, xglm_config_to_hf, xglm_to_probe, xglm_to_hf),
        Family("phi", "PhiForCausalLM", ("model.",), phi_config, phi_config_to_hf, phi_to_probe, phi_to_hf,
               prepends_bos=False),
        Family("gptj", "GPTJForCausalLM", ("transformer.",), gptj_config, gptj_config_to_hf, gptj_to_probe, gptj_to_hf),
        Family("codegen", "CodeGenForCausalLM", ("transformer.",), gptj_config,
               lambda cfg, tok: gptj_config_to_hf(cfg, tok, "codegen"), codegen_to_probe, codegen_to_hf),
        Family("phi3", "Phi3ForCausalLM", ("model.",), phi3_config, phi3_config_to_hf, phi3_to_probe, phi3_to_hf),
        Family("mixtral", "MixtralForCausalLM", ("model.",), mixtral_config, *moe_family("mixtral")),
        Family("phimoe", "PhimoeForCausalLM", ("model.",), phimoe_config, phimoe_config_to_hf, phimoe_to_probe,
               phimoe_to_hf, prepends_bos=False),
        Family("jetmoe", "JetMoeForCausalLM", ("model.",), jetmoe_config, jetmoe_config_to_hf, jetmoe_to_probe,
               jetmoe_to_hf),
        Family("olmoe", "OlmoeForCausalLM", ("model.",), olmoe_config, *moe_family("olmoe")),
        Family("flex_olmo", "FlexOlmoForCausalLM", ("model.",), flex_olmo_config, *moe_family("flex_olmo")),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", ("model.",), qwen3_moe_config, *moe_family("qwen3_moe"),
               prepends_bos=False),
        Family("qwen2_moe", "Qwen2MoeForCausalLM", ("model.",), qwen2_moe_config, *moe_family("qwen2_moe"),
               prepends_bos=False),
        Family("glm4_moe", "Glm4MoeForCausalLM", ("model.",), glm4_moe_config, *moe_family("glm4_moe"),
               prepends_bos=False),
        Family("minimax_m2", "MiniMaxM2ForCausalLM", ("model.",), minimax_m2_config, minimax_m2_config_to_hf,
               minimax_m2_to_probe, minimax_m2_to_hf, prepends_bos=False),
        Family("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", ("model.",), ernie4_5_moe_config, ernie4_5_moe_config_to_hf,
               ernie4_5_moe_to_probe, ernie4_5_moe_to_hf, prepends_bos=False),
        Family("gpt_oss", "GptOssForCausalLM", ("model.",), gpt_oss_config, gpt_oss_config_to_hf, gpt_oss_to_probe,
               gpt_oss_to_hf),
        Family("falcon", "FalconForCausalLM", ("transformer.",), falcon_config, falcon_config_to_hf, falcon_to_probe,
               falcon_to_hf),
        Family("mpt", "MptForCausalLM", ("transformer.",), mpt_config, mpt_config_to_hf, mpt_to_probe, mpt_to_hf),
        Family("stablelm", "StableLmForCausalLM", ("model.",), stablelm_config, stablelm_config_to_hf, stablelm_to_probe,
               stablelm_to_hf),
        *(Family(model_type, architecture, ("model.",), layernorm_llama_config(model_type),
                 layernorm_llama_config_to_hf(model_type), layernorm_llama_to_probe(model_type),
                 layernorm_llama_to_hf(model_type), prepends_bos=model_type != "starcoder2")
          for model_type, architecture in (("starcoder2", "Starcoder2ForCausalLM"), ("nemotron", "NemotronForCausalLM"),
                                           ("jais2", "Jais2ForCausalLM"))),
        *(Family(model_type, architecture, ("model.",), latent_config(model_type), latent_config_to_hf(model_type),
                 *latent_family(model_type), prepends_bos=model_type != "glm4_moe_lite")
          for model_type, architecture in (("deepseek_v2", "DeepseekV2ForCausalLM"),
                                           ("deepseek_v3", "DeepseekV3ForCausalLM"),
                                           ("glm4_moe_lite", "Glm4MoeLiteForCausalLM"), ("youtu", "YoutuForCausalLM"))),
        Family("glm_moe_dsa", "GlmMoeDsaForCausalLM", ("model.",), glm_dsa_config, glm_dsa_config_to_hf,
               glm_dsa_to_probe, glm_dsa_to_hf, prepends_bos=False),
        Family("gpt_bigcode", "GPTBigCodeForCausalLM", ("transformer.",), bigcode_config, bigcode_config_to_hf,
               bigcode_to_probe, bigcode_to_hf),
        Family("bloom", "BloomForCausalLM", ("transformer.",), bloom_config, bloom_config_to_hf, bloom_to_probe,
               bloom_to_hf, prepends_bos=False),
    )
}

# the multimodal files that wrap a language model of any family (LLaVA, LLaVA-NeXT, LLaVA-OneVision, Idefics3): read
# through the family their text_config names
FAMILIES.update({kind: Family(kind, wrapper.architecture, wrapper.prefixes, *wrapped_language_model(wrapper, FAMILIES))
                 for kind, wrapper in WRAPPERS.items()})


def prepends_bos_by_default(architecture: Optional[str]) -> bool:
    """The family's default for putting BOS before text (True for an architecture not listed, as for GPT-2). Case is
    ignored: Phi-3.5-MoE's config.json names its remote code's PhiMoEForCausalLM, transformers' class is Phimoe..."""
    return next((f.prepends_bos for f in FAMILIES.values() if f.architecture.lower() == str(architecture).lower()), True)


def family_for_config(cfg: DecoderConfig) -> Family:
    """The checkpoint format that can hold this model (for saving)."""
    if cfg.d_vocab_out != cfg.d_vocab:
        raise ValueError(f"no Hugging Face checkpoint format here predicts another vocabulary than it reads "
                         f"(d_vocab_out={cfg.d_vocab_out}, d_vocab={cfg.d_vocab}); save model.state_dict() with safetensors")
    if cfg.attn_only and cfg.state_space is None:  # (Mamba-2's format holds blocks without MLPs, of mixers only)
        raise ValueError("no Hugging Face checkpoint format holds attention-only blocks; save model.state_dict() with "
                         "safetensors and load it into HookedDecoder(cfg)")
    if cfg.activation in (Activation.SOLU, Activation.SOLU_LN):
        raise ValueError(f"no Hugging Face checkpoint format holds a SoLU MLP (activation={cfg.activation.value!r}: "
                         "transformers has no SoLU activation, nor a LayerNorm inside the MLP); save model.state_dict() "
                         "with safetensors (transformer-lens's layout) and load it into HookedDecoder(cfg)")
    if cfg.unembed_bias and not (cfg.norm_weights and (cfg.norm_placement is NormPlacement.PARALLEL
                                                       or cfg.experts is not None or cfg.prediction_head is not None)):
        raise ValueError("no Hugging Face checkpoint format here holds an unembedding bias beside these norms (Phi's "
                         "holds one in parallel blocks with learned norms, ERNIE 4.5 MoE's beside experts; a model "
                         "from process_weights has one, and folded norms); save the unprocessed model and process it "
                         "again after loading")
    errors = []
    # the format the model was loaded from first (or, from a multimodal file, its text-only one): an OPT model is also
    # a valid GPT-2 one, but not OPT's positions
    loaded = next((f for f in FAMILIES.values() if f.architecture == cfg.original_architecture), None)
    preferred = {cfg.original_architecture, FAMILIES[loaded.saves_as].architecture if loaded and loaded.saves_as else None}
    candidates = sorted(FAMILIES.values(), key=lambda f: f.architecture not in preferred)
    for family in candidates:
        try:
            family.config_to_hf(cfg, None)
            return family
        except ValueError as err:
            errors.append(str(err))
    raise ValueError("no Hugging Face checkpoint format holds this configuration: " + "; ".join(errors))
