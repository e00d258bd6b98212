"""GLM and GLM-4 checkpoints (Zhipu AI's GLM-4-9B, GLM-4-0414, GLM-Z1): Llama's tensor names and block with q/k/v biases
(none on the output), rotary on the first half of each head with adjacent dimensions paired (GPT-J's), and the MLP's
gate and up projections fused in the file (`mlp.gate_up_proj`: the gate's rows, then the up projection's), split on
loading and fused again on saving. GLM-4 (`glm4`) normalises each sublayer's write too (a sandwich block, Gemma 2's:
`post_self_attn_layernorm` and `post_mlp_layernorm`).

GLM-4V's language model (`glm4v`: GLM-4.1V, GLM-4.6V-Flash, Glyph, AutoGLM) is GLM-4's, read from text_config, the vision
tower (`model.visual.`) never read: heads hidden_size / heads wide, q/k/v biases always, rotary on
`partial_rotary_factor` of each head (all of it when the rope names none). Its multimodal rope gives each of its three
sections a text token's one position, so on text it is GLM-4's 1-D rope (tested against the multimodal model); it
saves as the text-only GLM-4."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_hf, llama_to_probe
from probe.checkpoint_source import Source, require_fields, special_token_ids, text_config, with_defaults, with_fields
from probe.config import DecoderConfig, NormPlacement
from probe.config_file import ConfigFields
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


# transformers' Glm4vTextConfig defaults (GLM-4.1V-9B's shape), for what a text_config leaves out
GLM4V_DEFAULTS = {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40,
                  "num_attention_heads": 32, "num_key_value_heads": 2, "hidden_act": "silu",
                  "max_position_embeddings": 32768, "rms_norm_eps": 1e-5}


def glm4v_config(hf: dict) -> DecoderConfig:
    text = text_config(hf, "GLM-4V", default_tied=False)
    # (its config copies text_config's tie_word_embeddings up, as pre-v5 files kept it there)
    tied = bool(hf.get("tie_word_embeddings", False)) or bool(hf["text_config"].get("tie_word_embeddings", False))
    text = ConfigFields({**GLM4V_DEFAULTS, **text}, text.path, text.prefix)
    rope = text.get("rope_parameters") or {}
    return glm_config("glm4")(with_fields(
        text, tie_word_embeddings=tied, head_dim=text["hidden_size"] // text["num_attention_heads"], attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **rope,
                         "partial_rotary_factor": rope.get("partial_rotary_factor", 1.0)}))


def glm4v_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    raise ValueError("probe keeps a GLM-4V model's language model only; it saves as the text-only GLM-4 (glm4), which "
                     "transformers loads")


def glm4v_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    source.set_aside(("model.visual.", "visual."))  # never read
    return glm_to_probe(source, cfg)


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
