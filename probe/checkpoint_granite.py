"""IBM Granite checkpoints (granite-3.x, dense and mixture-of-experts): Llama's layers with four scalars,
`embedding_multiplier` (on the embeddings), `residual_multiplier` (on each sublayer's write before the residual
adds it), `attention_multiplier` (the scores' scale, in place of 1/sqrt(d_head)) and `logits_scaling` (the logits
divided by it).

The three linear ones are folded into the weights on loading (W_E times the embedding multiplier, each W_O and W_out
and their biases times the residual one, W_U divided by the logit scaling), so the block stays Llama's and the hooks
hold what the residual stream receives: hook_embed, hook_attn_out, hook_mlp_out and each head's hook_result are the
scaled writes, as TL 4's bridge exposes them. The unembedding is then never the embedding's transpose, so the model
is untied. Saving writes the folded weights with every multiplier 1 (the same function; transformers loads it).

GraniteMoE (granite-3.0-1b-a400m, -3b-a800m) puts a mixture of experts in each MLP's place: a bias-free router
(`block_sparse_moe.router.layer`) choosing experts by logit, weighted by the softmax over the chosen
(Experts.softmax_over "chosen"), and the experts stored fused: `input_linear` [expert 2*d_mlp d_model] (the gate's
rows, then the up projection's) and `output_linear` [expert d_model d_mlp]."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_hf, llama_to_probe
from probe.checkpoint_moe import require_routing
from probe.checkpoint_source import Source
from probe.config import DecoderConfig, Experts
from probe.tokenizer import Tokenizer

FOLDED = ("embedding_multiplier", "residual_multiplier", "logits_scaling")


def granite_config(hf: dict) -> DecoderConfig:
    scale = hf.get("attention_multiplier", 1.0)  # the scores are q.k times it: sqrt(attn_scale_dim) = 1 / scale
    return dataclasses.replace(llama_config(hf), attn_scale_dim=scale ** -2, tied_embeddings=False)


def granite_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer], model_type: str = "granite") -> dict:
    out = llama_config_to_hf(cfg, tokenizer, model_type)
    out.update({name: 1.0 for name in FOLDED}, attention_multiplier=(cfg.attn_scale_dim or cfg.d_head) ** -0.5)
    return out


def granite_moe_config(hf: dict) -> DecoderConfig:
    experts = Experts(n=hf["num_local_experts"], per_token=hf["num_experts_per_tok"], softmax_over="chosen")
    return dataclasses.replace(granite_config(hf), experts=experts)


def granite_moe_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    experts = cfg.experts
    if experts is None or experts.softmax_over != "chosen" or experts.clamped_glu is not None or experts.shared:
        raise ValueError(f"a granitemoe checkpoint holds experts chosen by logit, without a clamp or a shared expert; "
                         f"this model has experts={experts!r}")
    require_routing(experts, "granitemoe", softmax_over="chosen")  # (every layer sparse, the experts d_mlp wide)
    out = granite_config_to_hf(cfg, tokenizer, "granitemoe")
    out.pop("mlp_bias")  # (GraniteMoE's experts have no biases, and its config no such field)
    out.update(num_local_experts=experts.n, num_experts_per_tok=experts.per_token)
    return out


def fold_multipliers(out: dict[str, torch.Tensor], hf: dict) -> dict[str, torch.Tensor]:
    """The embedding multiplier into W_E, the residual one into every write to the residual (each W_O, W_out,
    expert's and shared expert's W_out and Mamba-2 out_proj, with their biases), the logit divisor into W_U: new
    tensors, so a tied W_U is not W_E."""
    residual = hf.get("residual_multiplier", 1.0)
    writes = (".attn.out.weight", ".attn.out.bias", ".mlp.fc_out.weight", ".mlp.fc_out.bias", ".W_out.weight",
              ".W_out.bias", ".shared_expert.fc_out.weight", ".mixer.out_proj.weight", ".mixer.out_proj.bias")
    out = {name: t * residual if name.endswith(writes) else t for name, t in out.items()}
    out["unembed.weight"] = out["unembed.weight"] / hf.get("logits_scaling", 1.0)
    out["embed.W_E"] = out["embed.W_E"] * hf.get("embedding_multiplier", 1.0)
    return out


def take_granite_experts(source: Source, cfg: DecoderConfig, out: dict[str, torch.Tensor]) -> None:
    """Each layer's router and fused experts (`block_sparse_moe`), as probe's tensors into `out`."""
    n, d, m = cfg.experts.n, cfg.d_model, cfg.d_mlp
    for l in range(cfg.n_layers):
        o, t = f"blocks.{l}.mlp", f"layers.{l}.block_sparse_moe"
        out[f"{o}.W_gate.weight"] = source.take(f"{t}.router.layer.weight", (n, d))
        gate_up = source.take(f"{t}.input_linear.weight", (n, 2 * m, d))
        down = source.take(f"{t}.output_linear.weight", (n, d, m))
        for e in range(n):
            x = f"{o}.experts.{e}"
            out[f"{x}.W_gate.weight"], out[f"{x}.W_in.weight"] = gate_up[e, :m], gate_up[e, m:]
            out[f"{x}.W_out.weight"] = down[e]


def granite_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    tied = source.config.get("tie_word_embeddings", False)
    out = llama_to_probe(source, dataclasses.replace(cfg, tied_embeddings=tied))
    if cfg.experts is not None:
        take_granite_experts(source, cfg, out)
    return fold_multipliers(out, source.config)


def granite_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_hf(params, cfg)
    out.update(granite_experts_to_hf(params, cfg))
    return {k: v.contiguous() for k, v in out.items()}


def granite_experts_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """take_granite_experts' inverse: the routers and fused experts under the file's names."""
    out = {}
    for l in range(cfg.n_layers) if cfg.experts is not None else ():
        o, t = f"blocks.{l}.mlp", f"model.layers.{l}.block_sparse_moe"
        experts = [f"{o}.experts.{e}" for e in range(cfg.experts.n)]
        out[f"{t}.router.layer.weight"] = params[f"{o}.W_gate.weight"]
        out[f"{t}.input_linear.weight"] = torch.stack(
            [torch.cat([params[f"{x}.W_gate.weight"], params[f"{x}.W_in.weight"]]) for x in experts])
        out[f"{t}.output_linear.weight"] = torch.stack([params[f"{x}.W_out.weight"] for x in experts])
    return {k: v.contiguous() for k, v in out.items()}
