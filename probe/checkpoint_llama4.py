"""Llama 4 checkpoints (`llama4_text`, Llama4ForCausalLM; `llama4`, Llama4ForConditionalGeneration: Scout and
Maverick, read for their language model): config.json <-> DecoderConfig and the tensors.

Llama's pre-norm blocks with interleaved rope (pairs 2i, 2i + 1: transformers' complex rotation), llama3-rescaled,
in the rope layers (no_rope_layers 1) alone; those layers attend within chunks of attention_chunk_size positions and
(use_qk_norm) normalise q and k after the rotation with no weight, and the others (NoPE) see every earlier key with
their queries temperature-tuned (attn_temperature_tuning, floor_scale, attn_scale): probe.config_chunked. The MoE
layers (moe_layers, else every interleave_moe_layer_step-th) hold num_local_experts experts of intermediate_size
(fused: gate_up_proj [expert d_model 2*width], the gates' columns first; down_proj [expert width d_model]), one per
token chosen by router logit, its sigmoid scaling what it reads (Experts.scale_inputs), beside a shared expert as
wide; the other layers a dense MLP of intermediate_size_mlp. The multimodal file's vision model and projector are
never read; its language model saves as llama4_text."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_hf, llama_to_probe
from probe.checkpoint_source import Source, require_fields, special_token_ids, text_config, with_defaults
from probe.config import DecoderConfig, Experts, Norm, NormPlacement, Positions
from probe.config_chunked import ChunkedAttention
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

# transformers' Llama4TextConfig defaults, for the fields a config.json leaves out (Scout's shape)
DEFAULTS = dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, tie_word_embeddings=False,
                num_experts_per_tok=1, num_local_experts=16, interleave_moe_layer_step=1, use_qk_norm=True,
                no_rope_layer_interval=4, attention_chunk_size=8192, attn_temperature_tuning=True, floor_scale=8192,
                attn_scale=0.1, attention_bias=False, rope_theta=500000.0)
LAYER_TYPES = ("chunked_attention", "full_attention")
VISION = ("vision_model.", "multi_modal_projector.")  # (after the language model's prefixes are stripped)


def _layers(hf: dict) -> tuple[tuple[bool, ...], tuple[bool, ...], tuple[bool, ...]]:
    """(rope layers, MoE layers, chunked layers) as transformers' Llama4TextConfig derives them."""
    n = hf["num_hidden_layers"]
    rope = hf.get("no_rope_layers") or [int((l + 1) % hf["no_rope_layer_interval"] != 0) for l in range(n)]
    step = hf["interleave_moe_layer_step"]
    moe = hf.get("moe_layers")
    moe = set(range(step - 1, n, step) if moe is None else moe)
    chunk = hf.get("attention_chunk_size")
    kinds = hf.get("layer_types") or [LAYER_TYPES[0] if r and chunk is not None else LAYER_TYPES[1] for r in rope]
    if len(rope) < n or len(kinds) != n or set(kinds) - set(LAYER_TYPES):
        raise CheckpointError(f"no_rope_layers must give at least num_hidden_layers={n} entries and layer_types one of "
                              f"{', '.join(LAYER_TYPES)} for each layer; got {len(rope)} and {kinds!r}")
    return (tuple(bool(r) for r in rope[:n]), tuple(l in moe for l in range(n)),
            tuple(kind == LAYER_TYPES[0] for kind in kinds))


def llama4_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, **DEFAULTS)
    rope, sparse, chunked = _layers(hf)
    if any(chunked) and hf.get("attention_chunk_size") is None:
        raise CheckpointError("layer_types names chunked_attention layers but attention_chunk_size is null: give the "
                              "chunk size, or make every layer full_attention")
    width = hf["intermediate_size"]
    experts = Experts(n=hf["num_local_experts"], per_token=hf["num_experts_per_tok"], scoring="sigmoid", shared=width,
                      shared_gate=False, width=width, layers=sparse, scale_inputs=True)
    spec = ChunkedAttention(size=hf.get("attention_chunk_size"), layers=chunked, qk_norm=bool(hf["use_qk_norm"]),
                            floor_scale=hf["floor_scale"] if hf["attn_temperature_tuning"] else None,
                            attn_scale=float(hf["attn_scale"]))
    return dataclasses.replace(llama_config(hf, default_eps=1e-5), d_mlp=hf["intermediate_size_mlp"],
                               rotary_adjacent_pairs=True, rotary_layers=rope,
                               experts=experts if any(sparse) else None, chunked_attention=spec)


def llama4_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    experts, spec = cfg.experts, cfg.chunked_attention
    if spec is None:
        raise ValueError("a Llama 4 checkpoint holds chunked_attention (its rope and NoPE layers' settings); this "
                         "model has none")
    wanted = dict(n=experts.n, per_token=experts.per_token, scoring="sigmoid", shared=cfg.expert_width,
                  shared_gate=False, width=experts.width, layers=experts.layers, scale_inputs=True) if experts else {}
    if experts is not None and experts != Experts(**wanted):
        raise ValueError(f"a Llama 4 checkpoint holds sigmoid-routed experts that scale their inputs, unrenormalised, "
                         f"beside an ungated shared expert as wide; this model has experts={experts!r}")
    require_fields(cfg, "Llama 4", norm=Norm.RMS, norm_placement=NormPlacement.PRE, final_norm=True, gated_mlp=True,
                   positions=Positions.ROTARY, rotary_dim=cfg.d_head, rotary_adjacent_pairs=True, mlp_bias=False,
                   out_bias=cfg.qkv_bias, experts=experts, rotary_layers=cfg.rotary_layers, chunked_attention=spec)
    plain = dataclasses.replace(cfg, rotary_adjacent_pairs=False, rotary_layers=None, experts=None,
                                chunked_attention=None)
    out = llama_config_to_hf(plain, tokenizer, "llama")
    out.pop("mlp_bias", None)
    out.update(special_token_ids(tokenizer))
    sparse = [l for l in range(cfg.n_layers) if cfg.layer_sparse(l)]
    out.update(model_type="llama4_text", architectures=["Llama4ForCausalLM"], attention_bias=cfg.qkv_bias,
               intermediate_size=cfg.expert_width if experts else cfg.d_mlp, intermediate_size_mlp=cfg.d_mlp,
               num_local_experts=experts.n if experts else 1, num_experts_per_tok=experts.per_token if experts else 1,
               moe_layers=sparse, no_rope_layers=[int(cfg.layer_rotates(l)) for l in range(cfg.n_layers)],
               layer_types=[LAYER_TYPES[0] if spec.layers[l] else LAYER_TYPES[1] for l in range(cfg.n_layers)],
               attention_chunk_size=spec.size, use_qk_norm=spec.qk_norm,
               attn_temperature_tuning=spec.floor_scale is not None, floor_scale=spec.floor_scale or 8192,
               attn_scale=spec.attn_scale)
    return out


def _experts_table(cfg: DecoderConfig, l: int) -> dict[str, str]:
    """ours -> theirs for layer `l`'s router and shared expert (the fused experts are split apart)."""
    o, t = f"blocks.{l}.mlp", f"layers.{l}.feed_forward"
    return {f"{o}.W_gate.weight": f"{t}.router.weight",
            f"{o}.shared_expert.gate.weight": f"{t}.shared_expert.gate_proj.weight",
            f"{o}.shared_expert.fc_in.weight": f"{t}.shared_expert.up_proj.weight",
            f"{o}.shared_expert.fc_out.weight": f"{t}.shared_expert.down_proj.weight"}


def llama4_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    d, w = cfg.d_model, cfg.expert_width
    for l in range(cfg.n_layers):  # the dense layers' MLPs under Llama's names, for llama_to_probe
        if not cfg.layer_sparse(l):
            for p in ("gate", "up", "down"):
                name = f"layers.{l}.feed_forward.{p}_proj.weight"
                if name in source.state:
                    source.state[f"layers.{l}.mlp.{p}_proj.weight"] = source.state.pop(name)
    out = llama_to_probe(source, cfg)  # everything but the experts
    for l in filter(cfg.layer_sparse, range(cfg.n_layers)):
        n, t = cfg.experts.n, f"layers.{l}.feed_forward"
        shapes = {"router": (n, d), "shared_expert.gate_proj": (w, d), "shared_expert.up_proj": (w, d),
                  "shared_expert.down_proj": (d, w)}
        for ours, theirs in _experts_table(cfg, l).items():
            out[ours] = source.take(theirs, shapes[theirs.removeprefix(f"{t}.").removesuffix(".weight")])
        gate_up = source.take(f"{t}.experts.gate_up_proj", (n, d, 2 * w))
        down = source.take(f"{t}.experts.down_proj", (n, w, d))
        for e in range(n):  # (stored [in, out]; ours are nn.Linear's [out, in])
            o = f"blocks.{l}.mlp.experts.{e}"
            out[f"{o}.W_gate.weight"], out[f"{o}.W_in.weight"] = gate_up[e, :, :w].T, gate_up[e, :, w:].T
            out[f"{o}.W_out.weight"] = down[e].T
    return out


def llama4_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = llama_to_hf(params, cfg)
    for name in [n for n in out if ".mlp." in n]:
        out[name.replace(".mlp.", ".feed_forward.")] = out.pop(name)
    for l in filter(cfg.layer_sparse, range(cfg.n_layers)):
        out.update({f"model.{theirs}": params[ours].contiguous() for ours, theirs in _experts_table(cfg, l).items()})
        experts = [f"blocks.{l}.mlp.experts.{e}" for e in range(cfg.experts.n)]
        t = f"model.layers.{l}.feed_forward.experts"
        out[f"{t}.gate_up_proj"] = torch.stack([torch.cat([params[f"{o}.W_gate.weight"], params[f"{o}.W_in.weight"]]).T
                                                for o in experts]).contiguous()
        out[f"{t}.down_proj"] = torch.stack([params[f"{o}.W_out.weight"].T for o in experts]).contiguous()
    return out


# ---- the multimodal file (Llama4ForConditionalGeneration): its language model alone -------------------------
def llama4_multimodal_config(hf: dict) -> DecoderConfig:
    return llama4_config(text_config(hf, "Llama 4", default_tied=False))


def llama4_multimodal_config_to_hf(cfg: DecoderConfig, tokenizer) -> dict:
    raise ValueError("probe keeps a multimodal Llama 4's language model only; it saves as the text-only Llama 4 "
                     "(llama4_text), which transformers' Llama4ForCausalLM loads")


def llama4_multimodal_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    source.set_aside(VISION)  # never read: the vision model and its projector stay on disk
    return llama4_to_probe(source, cfg)
