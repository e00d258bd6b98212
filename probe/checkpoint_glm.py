"""GLM and GLM-4 checkpoints (Zhipu AI's GLM-4-9B, GLM-4-0414, GLM-Z1): Llama's tensor names and block with q/k/v biases
(none on the output), rotary on the first half of each head with adjacent dimensions paired (GPT-J's), and the MLP's
gate and up projections fused in the file (`mlp.gate_up_proj`: the gate's rows, then the up projection's), split on
loading and fused again on saving. GLM-4 (`glm4`) normalises each sublayer's write too (a sandwich block, Gemma 2's:
`post_self_attn_layernorm` and `post_mlp_layernorm`)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_hf, llama_to_probe
from probe.checkpoint_source import Source, require_fields, special_token_ids, with_defaults
from probe.config import DecoderConfig, NormPlacement
from probe.tokenizer import Tokenizer

ARCHITECTURES = {"glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM"}
# GLM-4's sandwich: ours -> theirs (its post_attention_layernorm is the MLP's input norm, as Llama's)
GLM4_NORMS = {"ln1": "input_layernorm", "ln1_post": "post_self_attn_layernorm", "ln2": "post_attention_layernorm",
              "ln2_post": "post_mlp_layernorm"}


def glm_config(model_type: str) -> Callable[[dict], DecoderConfig]:
    def config_from_hf(hf: dict) -> DecoderConfig:
        base = llama_config(with_defaults(hf, head_dim=128), qkv_bias=hf.get("attention_bias", True))
        rope = hf.get("rope_parameters") or {}
        fraction = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
        placement = NormPlacement.SANDWICH if model_type == "glm4" else NormPlacement.PRE
        return dataclasses.replace(base, rotary_dim=int(base.d_head * fraction), rotary_adjacent_pairs=True,
                                   norm_placement=placement, eps=hf.get("rms_norm_eps", 1.5625e-7))  # (GLM's default)
    return config_from_hf


def glm_config_to_hf(model_type: str) -> Callable[[DecoderConfig, Optional[Tokenizer]], dict]:
    def config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
        placement = NormPlacement.SANDWICH if model_type == "glm4" else NormPlacement.PRE
        require_fields(cfg, model_type, rotary_adjacent_pairs=True, norm_placement=placement, out_bias=False,
                       mlp_bias=False)
        # (Llama's writer checks the rest; its output bias follows the q/k/v biases, GLM's has none)
        plain = dataclasses.replace(cfg, rotary_adjacent_pairs=False, rotary_dim=cfg.d_head,
                                    norm_placement=NormPlacement.PRE, out_bias=cfg.qkv_bias)
        out = llama_config_to_hf(plain, tokenizer, "llama")
        out.pop("mlp_bias", None)
        out["rope_parameters"] = {**out["rope_parameters"], "partial_rotary_factor": cfg.rotary_dim / cfg.d_head}
        out.update(special_token_ids(tokenizer))
        out.update(model_type=model_type, architectures=[ARCHITECTURES[model_type]], attention_bias=cfg.qkv_bias)
        return out
    return config_to_hf


def _norms(cfg: DecoderConfig) -> Optional[dict[str, str]]:
    return GLM4_NORMS if cfg.norm_placement is NormPlacement.SANDWICH else None


def glm_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    m, d = cfg.d_mlp, cfg.d_model
    for l in range(cfg.n_layers):  # the fused projection put back in the file as Llama's two
        t = f"layers.{l}.mlp"
        gate_up = source.take(f"{t}.gate_up_proj.weight", (2 * m, d))
        source.state[f"{t}.gate_proj.weight"], source.state[f"{t}.up_proj.weight"] = gate_up[:m], gate_up[m:]
    return llama_to_probe(source, cfg, norms=_norms(cfg))


def glm_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_hf(params, cfg, norms=_norms(cfg))
    for l in range(cfg.n_layers):
        t = f"model.layers.{l}.mlp"
        out[f"{t}.gate_up_proj.weight"] = torch.cat([out.pop(f"{t}.gate_proj.weight"), out.pop(f"{t}.up_proj.weight")])
    return out
