"""The language model of Mistral 3's multimodal checkpoints (`mistral3`: Mistral-Small-3.1 and 3.2, Magistral Small,
Devstral Small): text_config is a Mistral one, read as `mistral`'s; the Pixtral vision tower and its projector are
never read. probe keeps the text model only, so it saves as the text-only Mistral, which transformers'
MistralForCausalLM loads."""
from __future__ import annotations

from probe.checkpoint_llama import llama_to_probe, mistral_config
from probe.checkpoint_source import language_model_of
from probe.config import DecoderConfig
from probe.config_file import CheckpointError


def _mistral_text_config(text: dict) -> DecoderConfig:
    if text.get("model_type", "mistral") != "mistral":
        raise CheckpointError(f"text_config.model_type={text.get('model_type')!r} is not supported in a Mistral 3 "
                              "checkpoint; its language model must be a mistral one")
    return mistral_config(text)


mistral3 = language_model_of("Mistral 3", "Mistral (mistral)", _mistral_text_config, llama_to_probe,
                             default_tied=False)
