"""Mistral 3's checkpoints: the language model of the multimodal files (`mistral3`: Mistral-Small-3.1 and 3.2,
Magistral Small, Devstral Small, Ministral 3), whose text_config is a Mistral or a Ministral 3 one (the Pixtral vision
tower and its projector are never read), and Ministral 3's text-only files (`ministral3`).

Ministral 3 is Mistral with YaRN rope and a query temperature growing with the position,
1 + llama_4_scaling_beta * log(1 + floor(position / original_max_position_embeddings)): exactly 1 below the
pretraining context, so probe reads the model there, its n_ctx that context (a longer input is refused by name
rather than computed without the temperature). probe keeps the text model only, so every one of these saves as the
text-only Mistral, which transformers' MistralForCausalLM loads and which computes the same within n_ctx."""
from __future__ import annotations

import dataclasses

from probe.checkpoint_llama import llama_to_probe, mistral_config
from probe.checkpoint_source import language_model_of, with_defaults
from probe.config import DecoderConfig
from probe.config_file import CheckpointError

# transformers' Ministral3Config's rope for a file that names none
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 16384,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                   "llama_4_scaling_beta": 0.1}


def ministral3_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, rope_parameters=MINISTRAL3_ROPE, head_dim=128, rms_norm_eps=1e-5, sliding_window=None)
    cfg = mistral_config(hf)
    rope = hf.get("rope_parameters") or {}
    if rope.get("llama_4_scaling_beta"):  # the temperature is 1 only before the pretraining context
        cfg = dataclasses.replace(cfg, n_ctx=min(cfg.n_ctx, int(rope["original_max_position_embeddings"])))
    return cfg


def _mistral_text_config(text: dict) -> DecoderConfig:
    kind = text.get("model_type", "mistral")
    if kind not in ("mistral", "ministral3"):
        raise CheckpointError(f"text_config.model_type={kind!r} is not supported in a Mistral 3 checkpoint; its "
                              "language model must be a mistral or ministral3 one")
    return mistral_config(text) if kind == "mistral" else ministral3_config(text)


mistral3 = language_model_of("Mistral 3", "Mistral (mistral)", _mistral_text_config, llama_to_probe,
                             default_tied=False)


def ministral3_config_to_hf(cfg, tokenizer) -> dict:
    raise ValueError("probe reads Ministral 3 within its pretraining context, where it is Mistral with YaRN rope; it "
                     "saves as the text-only Mistral (mistral), which transformers' MistralForCausalLM loads")
