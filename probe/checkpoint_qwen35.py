"""Qwen3.5 and Qwen3-Next checkpoints: hybrids of Gated DeltaNet layers (three in four) and gated attention layers.

- `qwen3_5_text` (and the language model of the multimodal `qwen3_5` files, which is how the models are released):
  Qwen3's dense SwiGLU MLP. `qwen3_5_moe_text` (and `qwen3_5_moe`): a mixture of experts with Qwen2-MoE's shared
  expert and its sigmoid gate, the chosen experts' weights renormalised. `qwen3_next`: the same experts
  (renormalised as `norm_topk_prob` says), and the DeltaNet's projections fused per key head (`in_proj_qkvz`: each
  key head's q, k, then its value heads' v and z; `in_proj_ba`: its value heads' beta logits, then their decay
  steps), laid out as Qwen3.5's on loading and packed again on saving.
- The attention layers: Qwen3's, with q_proj twice as wide (each head's query rows, then its output gate's rows:
  split into `attn.qkv` and `attn.gate` on loading), rotary on each head's first quarter (partial_rotary_factor), and
  z times sigmoid(gate) before o_proj.
- The linear-attention layers: probe.linear_attention.GatedDeltaNet, under Qwen3.5's tensor names.
- Every RMSNorm but the DeltaNet's gated one multiplies by 1 + w and stores w (Gemma's zero-centred norms): the 1 is
  added on loading and taken off on saving.
- The multimodal files' rotary sections (mrope) coincide for text, whose three position ids are equal: plain rotary.
  Their vision tower (`model.visual.`) and multi-token-prediction head (`mtp.`) are never read."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf
from probe.checkpoint_moe import every_layer_sparse, expert_names, require_routing, take_experts
from probe.checkpoint_source import Source, language_model_of, require_fields, take_unembed, with_defaults
from probe.config import DecoderConfig, Experts, LinearAttention, Norm
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

LAYER_TYPES = ("linear_attention", "full_attention")
UNREAD = ("model.visual.", "visual.", "mtp.")  # the vision tower, the multi-token-prediction head
FORMATS = {  # model_type -> (architecture, a mixture of experts, the DeltaNet's projections fused per key head)
    "qwen3_5_text": ("Qwen3_5ForCausalLM", False, False),
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", True, False),
    "qwen3_next": ("Qwen3NextForCausalLM", True, True),
}


def qwen35_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, head_dim=256)
    n_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [LAYER_TYPES[(i + 1) % hf.get("full_attention_interval", 4) == 0]
                                      for i in range(n_layers)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise CheckpointError(f"layer_types {unknown} are not supported in a Qwen3.5 checkpoint; supported: "
                              f"{', '.join(LAYER_TYPES)}")
    if hf.get("attention_bias"):
        raise CheckpointError("attention_bias=true is not supported in a Qwen3.5 checkpoint (the released models have "
                              "none)")
    rope = hf.get("rope_parameters") or {}
    base = llama_config(hf)
    fraction = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    linear = LinearAttention(layers=tuple(t == "linear_attention" for t in types),
                             key_heads=hf.get("linear_num_key_heads", 16), value_heads=hf.get("linear_num_value_heads", 32),
                             d_key_head=hf.get("linear_key_head_dim", 128), d_value_head=hf.get("linear_value_head_dim", 128),
                             conv_kernel=hf.get("linear_conv_kernel_dim", 4))
    return dataclasses.replace(base, norm=Norm.RMS_FLOAT32, qk_norm=True, attn_output_gate=True,
                               rotary_dim=int(base.d_head * fraction), linear_attention=linear)


def _moe_config(renormalize: Callable[[dict], bool]) -> Callable[[dict], DecoderConfig]:
    """A mixture-of-experts format's config reader: the experts' width is the MLP's, every layer sparse."""
    def config_from_hf(hf: dict) -> DecoderConfig:
        experts = Experts(n=hf["num_experts"], per_token=hf["num_experts_per_tok"], renormalize=renormalize(hf),
                          shared=hf.get("shared_expert_intermediate_size") or None)
        return dataclasses.replace(qwen35_config(every_layer_sparse(hf)), experts=experts)
    return config_from_hf


qwen35_moe_config = _moe_config(lambda hf: True)  # Qwen3.5's router always renormalises
qwen3_next_config = _moe_config(lambda hf: hf.get("norm_topk_prob", True))


def qwen35_config_to_hf(model_type: str) -> Callable[[DecoderConfig, Optional[Tokenizer]], dict]:
    architecture, moe, _ = FORMATS[model_type]

    def config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
        linear, experts = cfg.linear_attention, cfg.experts
        if linear is None:
            raise ValueError(f"a {model_type} checkpoint holds linear-attention layers; this model has none "
                             "(linear_attention=None)")
        if moe != (experts is not None) or (moe and model_type != "qwen3_next" and not experts.renormalize):
            raise ValueError(f"a {model_type} checkpoint holds " + ("a mixture of experts" if moe else "dense MLPs")
                             + f"{' whose weights are renormalised' if model_type == 'qwen3_5_moe_text' else ''}; "
                             f"this model has experts={experts!r}")
        require_routing(experts, model_type)
        require_fields(cfg, model_type, attn_output_gate=True, linear_attention=linear, norm=Norm.RMS_FLOAT32,
                       qk_norm=True, qkv_bias=False, out_bias=False, experts=experts)
        plain = dataclasses.replace(cfg, norm=Norm.RMS, attn_output_gate=False, linear_attention=None, experts=None,
                                    rotary_dim=cfg.d_head, mlp_bias=False)
        out = llama_config_to_hf(plain, tokenizer, "qwen3")
        out.pop("mlp_bias")
        out["rope_parameters"] = {**out["rope_parameters"], "partial_rotary_factor": cfg.rotary_dim / cfg.d_head}
        out.update(model_type=model_type, architectures=[architecture],
                   layer_types=[LAYER_TYPES[not is_linear] for is_linear in linear.layers],
                   linear_num_key_heads=linear.key_heads, linear_num_value_heads=linear.value_heads,
                   linear_key_head_dim=linear.d_key_head, linear_value_head_dim=linear.d_value_head,
                   linear_conv_kernel_dim=linear.conv_kernel)
        if moe:
            out.update(num_experts=experts.n, num_experts_per_tok=experts.per_token, moe_intermediate_size=cfg.d_mlp,
                       shared_expert_intermediate_size=experts.shared or 0)
        if model_type == "qwen3_next":
            out.update(norm_topk_prob=experts.renormalize, decoder_sparse_step=1, mlp_only_layers=[])
        return out
    return config_to_hf


def _deltanet_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    linear, d = cfg.linear_attention, cfg.d_model
    qkv = 2 * linear.key_heads * linear.d_key_head + linear.value_heads * linear.d_value_head
    v = linear.value_heads * linear.d_value_head
    return {"in_proj_qkv.weight": (qkv, d), "in_proj_z.weight": (v, d), "in_proj_b.weight": (linear.value_heads, d),
            "in_proj_a.weight": (linear.value_heads, d), "out_proj.weight": (d, v),
            "conv1d.weight": (qkv, 1, linear.conv_kernel), "A_log": (linear.value_heads,),
            "dt_bias": (linear.value_heads,), "norm.weight": (linear.d_value_head,)}


def _ours(part: str) -> str:
    return "norm.w" if part == "norm.weight" else part  # the gated norm's weight is a norm's `w`, as everywhere


def _unfuse(source: Source, cfg: DecoderConfig, t: str) -> None:
    """Qwen3-Next's in_proj_qkvz / in_proj_ba, grouped per key head, put back in the file as Qwen3.5's four
    projections, in Qwen3.5's order (every q, every k, every v; each value head's z, b and a)."""
    linear, d = cfg.linear_attention, cfg.d_model
    k, dk, dv, r = linear.key_heads, linear.d_key_head, linear.d_value_head, linear.value_heads // linear.key_heads
    qkvz = source.take(f"{t}.in_proj_qkvz.weight", (k * (2 * dk + 2 * r * dv), d)).view(k, -1, d)
    q, kk, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=1)
    b, a = source.take(f"{t}.in_proj_ba.weight", (k * 2 * r, d)).view(k, 2 * r, d).split([r, r], dim=1)
    state = source.state
    state[f"{t}.in_proj_qkv.weight"] = torch.cat([q.reshape(-1, d), kk.reshape(-1, d), v.reshape(-1, d)])
    state[f"{t}.in_proj_z.weight"], state[f"{t}.in_proj_b.weight"] = z.reshape(-1, d), b.reshape(-1, d)
    state[f"{t}.in_proj_a.weight"] = a.reshape(-1, d)


def _fuse(out: dict[str, torch.Tensor], cfg: DecoderConfig, t: str) -> None:
    """_unfuse's inverse, on a saved layer's tensors."""
    linear, d = cfg.linear_attention, cfg.d_model
    k, dk, dv, r = linear.key_heads, linear.d_key_head, linear.d_value_head, linear.value_heads // linear.key_heads
    q, kk, v = out.pop(f"{t}.in_proj_qkv.weight").split([k * dk, k * dk, k * r * dv])
    z, b, a = (out.pop(f"{t}.in_proj_{p}.weight") for p in "zba")
    groups = [q.view(k, dk, d), kk.view(k, dk, d), v.view(k, r * dv, d), z.view(k, r * dv, d)]
    out[f"{t}.in_proj_qkvz.weight"] = torch.cat(groups, dim=1).reshape(-1, d)
    out[f"{t}.in_proj_ba.weight"] = torch.cat([b.view(k, r, d), a.view(k, r, d)], dim=1).reshape(-1, d)


def qwen35_to_probe(model_type: str) -> Callable[[Source, DecoderConfig], dict[str, torch.Tensor]]:
    fused = FORMATS[model_type][2]

    def to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        for name in [n for n in source.state if n.startswith(UNREAD)]:
            del source.state[name]
        d, m, h, kv, dh = cfg.d_model, cfg.d_mlp, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        out = {"embed.W_E": source.take("embed_tokens.weight", (cfg.d_vocab, d)),
               "ln_final.w": source.take("norm.weight", (d,))}
        for l in range(cfg.n_layers):
            o, t = f"blocks.{l}", f"layers.{l}"
            out[f"{o}.ln1.w"] = source.take(f"{t}.input_layernorm.weight", (d,))
            out[f"{o}.ln2.w"] = source.take(f"{t}.post_attention_layernorm.weight", (d,))
            if cfg.experts is None:
                out[f"{o}.mlp.gate.weight"] = source.take(f"{t}.mlp.gate_proj.weight", (m, d))
                out[f"{o}.mlp.fc_in.weight"] = source.take(f"{t}.mlp.up_proj.weight", (m, d))
                out[f"{o}.mlp.fc_out.weight"] = source.take(f"{t}.mlp.down_proj.weight", (d, m))
            if cfg.layer_is_linear(l):
                if fused:
                    _unfuse(source, cfg, f"{t}.linear_attn")
                for part, shape in _deltanet_shapes(cfg).items():
                    out[f"{o}.linear_attn.{_ours(part)}"] = source.take(f"{t}.linear_attn.{part}", shape)
                continue
            # each head's query rows, then its gate's
            rows = source.take(f"{t}.self_attn.q_proj.weight", (2 * h * dh, d)).view(h, 2, dh, d)
            out[f"{o}.attn.qkv.weight"] = torch.cat([rows[:, 0].reshape(h * dh, d),
                                                     source.take(f"{t}.self_attn.k_proj.weight", (kv * dh, d)),
                                                     source.take(f"{t}.self_attn.v_proj.weight", (kv * dh, d))])
            out[f"{o}.attn.gate.weight"] = rows[:, 1].reshape(h * dh, d)
            out[f"{o}.attn.out.weight"] = source.take(f"{t}.self_attn.o_proj.weight", (d, h * dh))
            for which in "qk":
                out[f"{o}.attn.{which}_norm.w"] = source.take(f"{t}.self_attn.{which}_norm.weight", (dh,))
        if cfg.experts is not None:
            out.update(take_experts(source, cfg, "qwen3_5_moe"))
        out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
        # the zero-centred norms store w - 1 (the DeltaNet's gated norm stores w itself)
        return {k: v.float() + 1.0 if k.endswith(".w") and ".linear_attn." not in k else v for k, v in out.items()}
    return to_probe


def qwen35_to_hf(model_type: str) -> Callable[[dict[str, torch.Tensor], DecoderConfig], dict[str, torch.Tensor]]:
    fused = FORMATS[model_type][2]

    def to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        params = {k: v - 1.0 if k.endswith(".w") and ".linear_attn." not in k else v for k, v in params.items()}
        h, dh, d = cfg.n_heads, cfg.d_head, cfg.d_model
        out = {"model.embed_tokens.weight": params["embed.W_E"], "model.norm.weight": params["ln_final.w"]}
        for l in range(cfg.n_layers):
            o, t = f"blocks.{l}", f"model.layers.{l}"
            out[f"{t}.input_layernorm.weight"] = params[f"{o}.ln1.w"]
            out[f"{t}.post_attention_layernorm.weight"] = params[f"{o}.ln2.w"]
            for ours, theirs in (("gate", "gate"), ("fc_in", "up"), ("fc_out", "down")) if cfg.experts is None else ():
                out[f"{t}.mlp.{theirs}_proj.weight"] = params[f"{o}.mlp.{ours}.weight"]
            if cfg.layer_is_linear(l):
                for part in _deltanet_shapes(cfg):
                    out[f"{t}.linear_attn.{part}"] = params[f"{o}.linear_attn.{_ours(part)}"]
                if fused:
                    _fuse(out, cfg, f"{t}.linear_attn")
                continue
            q, k, v = params[f"{o}.attn.qkv.weight"].split([h * dh, cfg.n_kv_heads * dh, cfg.n_kv_heads * dh])
            gate = params[f"{o}.attn.gate.weight"]
            out[f"{t}.self_attn.q_proj.weight"] = torch.stack([q.view(h, dh, d), gate.view(h, dh, d)], dim=1).reshape(-1, d)
            out[f"{t}.self_attn.k_proj.weight"], out[f"{t}.self_attn.v_proj.weight"] = k, v
            out[f"{t}.self_attn.o_proj.weight"] = params[f"{o}.attn.out.weight"]
            for which in "qk":
                out[f"{t}.self_attn.{which}_norm.weight"] = params[f"{o}.attn.{which}_norm.w"]
        if cfg.experts is not None:
            out.update({f"model.{theirs}": params[ours] for ours, (theirs, _) in expert_names(cfg, "qwen3_5_moe").items()})
        if not cfg.tied_embeddings:
            out["lm_head.weight"] = params["unembed.weight"]
        return {k: v.contiguous() for k, v in out.items()}
    return to_hf


def _text_config(model_type: str, config_from_text: Callable[[dict], DecoderConfig]) -> Callable[[dict], DecoderConfig]:
    def read(text: dict) -> DecoderConfig:
        if text.get("model_type", model_type) != model_type:
            raise CheckpointError(f"text_config.model_type={text.get('model_type')!r} is not supported here; the "
                                  f"language model must be a {model_type} one")
        return config_from_text(text)
    return read


qwen35_multimodal = language_model_of("Qwen3.5", "Qwen3.5 (qwen3_5_text)", _text_config("qwen3_5_text", qwen35_config),
                                      qwen35_to_probe("qwen3_5_text"), default_tied=False)
qwen35_moe_multimodal = language_model_of("Qwen3.5-MoE", "Qwen3.5-MoE (qwen3_5_moe_text)",
                                          _text_config("qwen3_5_moe_text", qwen35_moe_config),
                                          qwen35_to_probe("qwen3_5_moe_text"), default_tied=False)
