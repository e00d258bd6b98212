"""IBM Granite checkpoints (granite-3.x dense, granite-4.0 dense "-h"-less ones): Llama's layers with four scalars,
`embedding_multiplier` (on the embeddings), `residual_multiplier` (on each sublayer's write before the residual
adds it), `attention_multiplier` (the scores' scale, in place of 1/sqrt(d_head)) and `logits_scaling` (the logits
divided by it).

The three linear ones are folded into the weights on loading (W_E times the embedding multiplier, each W_O and W_out
and their biases times the residual one, W_U divided by the logit scaling), so the block stays Llama's and the hooks
hold what the residual stream receives: hook_embed, hook_attn_out, hook_mlp_out and each head's hook_result are the
scaled writes, as TL 4's bridge exposes them. The unembedding is then never the embedding's transpose, so the model
is untied. Saving writes the folded weights with every multiplier 1 (the same function; transformers loads it)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_probe
from probe.checkpoint_source import Source
from probe.config import DecoderConfig
from probe.tokenizer import Tokenizer

FOLDED = ("embedding_multiplier", "residual_multiplier", "logits_scaling")


def granite_config(hf: dict) -> DecoderConfig:
    scale = hf.get("attention_multiplier", 1.0)  # the scores are q.k times it: sqrt(attn_scale_dim) = 1 / scale
    return dataclasses.replace(llama_config(hf), attn_scale_dim=scale ** -2, tied_embeddings=False)


def granite_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    out = llama_config_to_hf(cfg, tokenizer, "granite")
    out.update({name: 1.0 for name in FOLDED}, attention_multiplier=(cfg.attn_scale_dim or cfg.d_head) ** -0.5)
    return out


def granite_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    hf = source.config
    tied = hf.get("tie_word_embeddings", False)
    out = llama_to_probe(source, dataclasses.replace(cfg, tied_embeddings=tied))
    embedding, residual = hf.get("embedding_multiplier", 1.0), hf.get("residual_multiplier", 1.0)
    out["unembed.weight"] = out["unembed.weight"] / hf.get("logits_scaling", 1.0)  # a new tensor, also when tied
    out["embed.W_E"] = out["embed.W_E"] * embedding
    for l in range(cfg.n_layers):
        for name in (f"blocks.{l}.attn.out.weight", f"blocks.{l}.attn.out.bias", f"blocks.{l}.mlp.fc_out.weight",
                     f"blocks.{l}.mlp.fc_out.bias"):
            if name in out:
                out[name] = out[name] * residual
    return out

