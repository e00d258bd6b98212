"""The language model of Mistral 3's multimodal checkpoints (`mistral3`: Mistral-Small-3.1 and 3.2, Magistral Small,
Devstral Small): text_config is a Mistral one, read as `mistral`'s; the Pixtral vision tower and its projector are
never read. probe keeps the text model only, so it saves as the text-only Mistral, which transformers'
MistralForCausalLM loads."""
from __future__ import annotations

from typing import Optional

import torch

from probe.checkpoint_llama import llama_to_probe, mistral_config
from probe.checkpoint_source import Source, drop_vision_tower, text_config
from probe.config import DecoderConfig
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer


def mistral3_config(hf: dict) -> DecoderConfig:
    text = text_config(hf, "Mistral 3", default_tied=False)
    if text.get("model_type", "mistral") != "mistral":
        raise CheckpointError(f"text_config.model_type={text.get('model_type')!r} is not supported in a Mistral 3 "
                              "checkpoint; its language model must be a mistral one")
    return mistral_config(text)


def mistral3_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    raise ValueError("probe keeps a multimodal Mistral 3's language model only; it saves as the text-only Mistral "
                     "(mistral), which transformers' MistralForCausalLM loads")


def mistral3_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    drop_vision_tower(source)
    return llama_to_probe(source, cfg)
