"""GPT-OSS checkpoints (gpt-oss-20b, gpt-oss-120b): Llama's layout with biased attention, each head's sink logit
(`self_attn.sinks`), every other layer windowed, YaRN on every layer's rope, and a mixture of experts stored fused per
layer: the router `mlp.router.weight` / `.bias`; `mlp.experts.gate_up_proj` [expert d_model 2*d_mlp] (the gate's and
the up projection's columns interleaved, gate first) with `gate_up_proj_bias` [expert 2*d_mlp]; `down_proj` [expert
d_mlp d_model] with `down_proj_bias`. The experts choose by logit, then softmax over the chosen (Experts.softmax_over)
and apply a clamped SwiGLU (Experts.clamped_glu).

OpenAI's released files hold the experts' two weights in MXFP4 (`quantization_config.quant_method` "mxfp4"):
`gate_up_proj_blocks` [expert 2*d_mlp d_model/32 16] uint8, two 4-bit floats (e2m1) per byte, low nibble first, and
`gate_up_proj_scales` [expert 2*d_mlp d_model/32] uint8, a power of two per 32 values (exponent + 127); `down_proj`
likewise, rows d_model. They are dequantised on loading, exactly (every value is a bfloat16 one); probe saves the
plain layout.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_hf, llama_to_probe
from probe.checkpoint_moe import require_routing
from probe.checkpoint_source import LAYER_KINDS, Source, layer_kinds, layer_types_to_hf, with_defaults
from probe.config import DecoderConfig, Experts, Norm
from probe.config_choices import ClampedSwiGLU
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

# e2m1's sixteen values, by their 4-bit code (the sign is the top bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values sharing one scale


def gpt_oss_config(hf: dict) -> DecoderConfig:
    quantization = hf.get("quantization_config") or {}
    if quantization and quantization.get("quant_method") != "mxfp4":
        raise CheckpointError(f"quantization_config.quant_method={quantization.get('quant_method')!r} is not supported "
                              "for GPT-OSS (OpenAI's MXFP4 files are): dequantise the checkpoint")
    sliding = tuple(kind == LAYER_KINDS[0] for kind in layer_kinds(hf, 2))
    window = hf.get("sliding_window") if any(sliding) else None
    experts = Experts(n=hf["num_local_experts"], per_token=hf["num_experts_per_tok"], softmax_over="chosen",
                      clamped_glu=ClampedSwiGLU(float(hf.get("swiglu_alpha", 1.702)), float(hf.get("swiglu_limit", 7.0))))
    # transformers' defaults for what a file leaves out: the released models' YaRN rope, 64-wide heads, biases
    hf = with_defaults(hf, head_dim=64, attention_bias=True, rope_parameters={
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096, "rope_theta": 150000.0})
    # float32 RMSNorm with its weight applied before rounding back, as transformers' GptOssRMSNorm
    return dataclasses.replace(llama_config(hf), norm=Norm.RMS_FLOAT32, eps=hf.get("rms_norm_eps", 1e-5),
                               attn_sinks=True, mlp_bias=True, experts=experts, sliding_window=window,
                               sliding_layers=None if window is None else sliding)


def gpt_oss_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    experts = cfg.experts
    if experts is None or experts.softmax_over != "chosen" or experts.clamped_glu is None or experts.shared is not None:
        raise ValueError(f"a gpt_oss checkpoint holds experts chosen by logit with a clamped SwiGLU; this model has "
                         f"experts={experts!r}")
    require_routing(experts, "gpt_oss", softmax_over="chosen")  # (every layer sparse, the experts d_mlp wide)
    out = llama_config_to_hf(cfg, tokenizer, "gpt_oss")
    out.pop("mlp_bias")  # (GPT-OSS's experts always have biases, and its config has no such field)
    out.update(num_local_experts=experts.n, num_experts_per_tok=experts.per_token, attention_bias=cfg.qkv_bias,
               swiglu_alpha=experts.clamped_glu.alpha, swiglu_limit=experts.clamped_glu.limit,
               layer_types=layer_types_to_hf(cfg),
               sliding_window=cfg.sliding_window, router_aux_loss_coef=0.0, output_router_logits=False)
    return out


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[... rows in] from MXFP4's packed `blocks` [... rows in/32 16] and `scales` [... rows in/32]."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [... rows groups 32]
    values = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)[codes]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)  # exact: a power of two times e2m1
    return values.flatten(-2).to(dtype)


def _expert_weight(source: Source, name: str, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """`name` [expert in out], stored plain or (OpenAI's files) as MXFP4 blocks and scales of its transpose."""
    if f"{name}_blocks" not in source.state:
        return source.take(name, shape)
    n, d_in, d_out = shape
    if d_in % MXFP4_BLOCK:
        raise CheckpointError(f"{name}: MXFP4 packs {MXFP4_BLOCK} values per scale, but the rows hold {d_in}")
    groups = d_in // MXFP4_BLOCK
    blocks = source.take_packed(f"{name}_blocks", (n, d_out, groups, MXFP4_BLOCK // 2), torch.uint8)
    scales = source.take_packed(f"{name}_scales", (n, d_out, groups), torch.uint8)
    return dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2)


def gpt_oss_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_probe(source, cfg)  # embeddings, norms, attention; the experts are below
    dtype = out["embed.W_E"].dtype
    n, d, m = cfg.experts.n, cfg.d_model, cfg.d_mlp
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"layers.{l}"
        out[f"{o}.attn.sinks"] = source.take(f"{t}.self_attn.sinks", (cfg.layer_heads(l),))
        out[f"{o}.mlp.W_gate.weight"] = source.take(f"{t}.mlp.router.weight", (n, d))
        out[f"{o}.mlp.W_gate.bias"] = source.take(f"{t}.mlp.router.bias", (n,))
        gate_up = _expert_weight(source, f"{t}.mlp.experts.gate_up_proj", (n, d, 2 * m), dtype)
        gate_up_bias = source.take(f"{t}.mlp.experts.gate_up_proj_bias", (n, 2 * m))
        down = _expert_weight(source, f"{t}.mlp.experts.down_proj", (n, m, d), dtype)
        down_bias = source.take(f"{t}.mlp.experts.down_proj_bias", (n, d))
        for e in range(n):
            x = f"{o}.mlp.experts.{e}"
            out[f"{x}.W_gate.weight"], out[f"{x}.W_gate.bias"] = gate_up[e, :, 0::2].T, gate_up_bias[e, 0::2]
            out[f"{x}.W_in.weight"], out[f"{x}.W_in.bias"] = gate_up[e, :, 1::2].T, gate_up_bias[e, 1::2]
            out[f"{x}.W_out.weight"], out[f"{x}.W_out.bias"] = down[e].T, down_bias[e]
    return {k: v.contiguous() for k, v in out.items()}


def gpt_oss_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_hf(params, cfg)
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}", f"model.layers.{l}"
        experts = [f"{o}.mlp.experts.{e}" for e in range(cfg.experts.n)]
        out[f"{t}.self_attn.sinks"] = params[f"{o}.attn.sinks"]
        out[f"{t}.mlp.router.weight"] = params[f"{o}.mlp.W_gate.weight"]
        out[f"{t}.mlp.router.bias"] = params[f"{o}.mlp.W_gate.bias"]
        # [expert d_model d_mlp 2]: each gate column beside its up column
        gate_up = torch.stack([torch.stack([params[f"{x}.W_gate.weight"].T, params[f"{x}.W_in.weight"].T], dim=-1)
                               for x in experts])
        out[f"{t}.mlp.experts.gate_up_proj"] = gate_up.flatten(-2)
        out[f"{t}.mlp.experts.gate_up_proj_bias"] = torch.stack(
            [torch.stack([params[f"{x}.W_gate.bias"], params[f"{x}.W_in.bias"]], dim=-1) for x in experts]).flatten(-2)
        out[f"{t}.mlp.experts.down_proj"] = torch.stack([params[f"{x}.W_out.weight"].T for x in experts])
        out[f"{t}.mlp.experts.down_proj_bias"] = torch.stack([params[f"{x}.W_out.bias"] for x in experts])
    return {k: v.contiguous() for k, v in out.items()}
