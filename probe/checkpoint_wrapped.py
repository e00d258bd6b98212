"""Multimodal checkpoints that wrap a language model of any family: LLaVA (`llava`), LLaVA-NeXT (`llava_next`),
LLaVA-OneVision (`llava_onevision`), Idefics3 (`idefics3`; SmolVLM, Granite-Docling), and the audio models
Qwen2-Audio (`qwen2_audio`), Audio Flamingo 3 (`audioflamingo3`), Music Flamingo (`musicflamingo`) and GLM-ASR
(`glmasr`); and Emu3 (`emu3`), whose language model is Llama's. Their text_config names
the language model's own model_type (Llama, Mistral, Qwen2, Granite, Falcon, ...), and probe reads it through that
family, the vision (or audio) tower and projector never read: on token ids the multimodal model is its language model's body and
its own lm_head, so the logits are the wrapper's. (That head is lm_head alone: a text-only head's extra step, Granite's
logits_scaling or Cohere's logit_scale, is not the wrapper's, and is read as 1.)

The model is then that family's: `cfg.original_architecture` is the language model's architecture (transformers'
XForCausalLM), so BOS defaults, TL 4's bridge names and saving follow it, and it saves as that text-only format,
which transformers loads. (Mistral 3, Gemma 3 and 4, Qwen3.5 and the Qwen-VL files keep their own families: their
text_config is one family's.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Mapping

import torch

from probe.checkpoint_source import Source, text_config
from probe.config import DecoderConfig
from probe.config_file import CheckpointError, ConfigFields


@dataclass(frozen=True)
class Wrapper:
    name: str
    architecture: str
    default_text: str  # the language model transformers builds when text_config names none
    # when transformers ties the head: "either" config says so (LLaVA's and LLaVA-OneVision's configs copy
    # text_config's tie_word_embeddings up), the "top"-level field alone (default `tied`), or "never" (the audio
    # wrappers' configs have no such field, and their models never tie)
    tie_rule: Literal["either", "top", "never"]
    prefixes: tuple[str, ...]  # where the language model's tensors live (released and transformers 5 layouts)
    vision: tuple[str, ...]  # the rest of the file, never read
    # text_config model_types of the wrapper's own that are a family's (Emu3's emu3_text_model is Llama's)
    text_types: tuple[tuple[str, str], ...] = ()
    tied: bool = False  # the top-level field's default

    def ties(self, hf: dict) -> bool:
        top = bool(hf.get("tie_word_embeddings", self.tied))
        if self.tie_rule == "either":
            return top or bool(hf["text_config"].get("tie_word_embeddings", False))
        return top if self.tie_rule == "top" else False


# what text-only heads do after lm_head, which a wrapper's own lm_head does not (it runs the language model's body,
# then lm_head alone): Granite's logits divisor, Cohere's scale, Gemma 2's final soft cap, Falcon-H1's multiplier
HEAD_ONLY = {"logits_scaling": 1.0, "logit_scale": 1.0, "final_logit_softcapping": None, "lm_head_multiplier": 1.0}
LLAVA_PREFIXES = ("language_model.model.", "model.language_model.", "language_model.")
LLAVA_VISION = ("vision_tower.", "multi_modal_projector.", "image_newline", "model.vision_tower.",
                "model.multi_modal_projector.", "model.image_newline")
AUDIO = ("audio_tower.", "multi_modal_projector.", "model.audio_tower.", "model.multi_modal_projector.")
WRAPPERS = {
    "llava": Wrapper("LLaVA", "LlavaForConditionalGeneration", "llama", "either", LLAVA_PREFIXES, LLAVA_VISION),
    "llava_next": Wrapper("LLaVA-NeXT", "LlavaNextForConditionalGeneration", "llama", "top", LLAVA_PREFIXES,
                          LLAVA_VISION),
    "llava_onevision": Wrapper("LLaVA-OneVision", "LlavaOnevisionForConditionalGeneration", "qwen2", "either",
                               LLAVA_PREFIXES, LLAVA_VISION),
    "idefics3": Wrapper("Idefics3", "Idefics3ForConditionalGeneration", "llama", "top", ("model.text_model.",),
                        ("model.vision_model.", "model.connector.")),
    # Emu3's image tokens are ordinary vocabulary entries its VQ-VAE (`model.vqmodel.`, never read) encodes and decodes
    "emu3": Wrapper("Emu3", "Emu3ForConditionalGeneration", "emu3_text_model", "top",
                    ("text_model.model.", "model.text_model.", "text_model."), ("vqmodel.", "model.vqmodel."),
                    text_types=(("emu3_text_model", "llama"),)),
    # the audio models: an audio tower and projector in place of a vision tower
    "qwen2_audio": Wrapper("Qwen2-Audio", "Qwen2AudioForConditionalGeneration", "qwen2", "never", LLAVA_PREFIXES,
                           AUDIO),
    "audioflamingo3": Wrapper("Audio Flamingo 3", "AudioFlamingo3ForConditionalGeneration", "qwen2", "never",
                              LLAVA_PREFIXES, AUDIO),
    "musicflamingo": Wrapper("Music Flamingo", "MusicFlamingoForConditionalGeneration", "qwen2", "never",
                             LLAVA_PREFIXES, AUDIO),
    "glmasr": Wrapper("GLM-ASR", "GlmAsrForConditionalGeneration", "llama", "top", LLAVA_PREFIXES, AUDIO, tied=True),
}


def wrapped_language_model(wrapper: Wrapper, families: Mapping) -> tuple[Callable, Callable, Callable, Callable]:
    """(config_from_hf, config_to_hf, to_probe, to_hf) of a wrapper's checkpoints.Family, reading through the family
    text_config names (looked up in `families`, checkpoints.FAMILIES, when a file is read)."""
    def text_family(hf: dict):
        kind = text_type(wrapper, hf)
        family = families.get(kind)
        if family is None or family.saves_as is not None or kind in WRAPPERS:
            supported = ", ".join(k for k, f in families.items() if f.saves_as is None and k not in WRAPPERS)
            raise CheckpointError(f"text_config.model_type={kind!r} is not a language model probe reads inside "
                                  f"{wrapper.name} checkpoints; supported: {supported}")
        return family

    def text_fields(hf: dict) -> ConfigFields:
        text = text_config(hf, wrapper.name, default_tied=False)
        fields = {**text, "model_type": text_family(hf).model_type, "tie_word_embeddings": wrapper.ties(hf),
                  **{k: v for k, v in HEAD_ONLY.items() if k in text}}
        return ConfigFields(fields, text.path, text.prefix)

    def config_from_hf(hf: dict) -> DecoderConfig:
        return text_family(hf).config_from_hf(text_fields(hf))

    def config_to_hf(cfg: DecoderConfig, tokenizer) -> dict:
        raise ValueError(f"probe keeps a {wrapper.name} model's language model only; it saves as that model's "
                         "text-only format, which transformers loads")

    def to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        family = text_family(source.config)
        source.set_aside(wrapper.vision, strip=family.prefixes)  # (older files keep the text model's own prefix)
        source.config = text_fields(source.config)  # (the fields a family's tensors follow: Granite's multipliers)
        return family.to_probe(source, cfg)

    def to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        return config_to_hf(cfg, None)  # (raises: the text-only family saves)

    return config_from_hf, config_to_hf, to_probe, to_hf


def original_architecture(hf: dict, families: Mapping):
    """config.json's architecture, the language model's for a wrapper (what the model is on text)."""
    wrapper = WRAPPERS.get(hf.get("model_type"))
    if wrapper is None:
        return (hf.get("architectures") or [None])[0]
    return families[text_type(wrapper, hf)].architecture


def text_type(wrapper: Wrapper, hf: dict) -> str:
    """The family of the language model a wrapper's config.json names."""
    kind = hf.get("text_config", {}).get("model_type", wrapper.default_text)
    return dict(wrapper.text_types).get(kind, kind)
