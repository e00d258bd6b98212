"""JetMoE checkpoints (`jetmoe`, JetMoeForCausalLM: jetmoe-8b, -8b-sft, -8b-chat): config.json <-> DecoderConfig and
the tensors.

Every layer has a mixture of attention heads (probe.mixture_of_attention: `self_attention.experts`, its router
`router.layer`, per-expert query and output projections `input_linear` / `output_linear` [experts out in], its bias
`bias`; the shared `kv_proj`, keys' rows then values') and a mixture of gated experts (`mlp`: `router.layer`,
`input_linear` [experts 2*d_mlp d_model], the gate's rows then the up projection's, `output_linear`, and `bias` after
their weighted sum: Experts(softmax_over="chosen", output_bias=True)). Both routers choose num_experts_per_tok of
num_local_experts by logit and weigh them by the softmax over the chosen ones. RMSNorms, rotary, a head tied or not.

transformers builds the blocks' two norms with eps 1e-6 whatever rms_norm_eps says (JetMoeDecoderLayer) and the final
norm with rms_norm_eps: probe's eps is the blocks' 1e-6 and `final_eps` the final norm's, where it differs.
"""
from __future__ import annotations

from typing import Optional

import torch

from probe.checkpoint_source import (GPT_ACTIVATION_NAMES, GPT_ACTIVATIONS, Source, activation_of, require_fields,
                                     rope_from_hf, rope_to_hf, special_token_ids, take_unembed, with_defaults)
from probe.config import DecoderConfig, Experts, Norm, NormPlacement, Positions
from probe.config_file import CheckpointError
from probe.config_moa import MixtureOfAttention
from probe.tokenizer import Tokenizer

# transformers' JetMoeConfig defaults, for the fields a config.json leaves out
DEFAULTS = dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=12, num_key_value_heads=16, kv_channels=128,
                intermediate_size=5632, max_position_embeddings=4096, activation_function="silu", num_local_experts=8,
                num_experts_per_tok=2, tie_word_embeddings=True)
BLOCK_EPS = 1e-6  # (JetMoeDecoderLayer's norms: JetMoeRMSNorm's default)


def jetmoe_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, **DEFAULTS)
    rope, scaling = rope_from_hf(hf)
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("partial_rotary_factor: transformers' JetMoE rotates whole heads; set it to 1.0")
    n, per_token, kv_heads = hf["num_local_experts"], hf["num_experts_per_tok"], hf["num_key_value_heads"]
    if per_token > n:
        raise CheckpointError(f"num_experts_per_tok={per_token} is more than num_local_experts={n}, as transformers "
                              "refuses too")
    return DecoderConfig(
        n_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=per_token * kv_heads, n_kv_heads=kv_heads,
        d_head=hf["kv_channels"], d_mlp=hf["intermediate_size"], d_vocab=hf["vocab_size"],
        n_ctx=hf["max_position_embeddings"], eps=BLOCK_EPS,
        final_eps=None if hf.get("rms_norm_eps", BLOCK_EPS) == BLOCK_EPS else float(hf["rms_norm_eps"]),
        activation=activation_of(hf["activation_function"], GPT_ACTIVATIONS), gated_mlp=True, norm=Norm.RMS,
        positions=Positions.ROTARY, rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rotary_scaling=scaling, qkv_bias=False, out_bias=False, mlp_bias=False,
        tied_embeddings=bool(hf["tie_word_embeddings"]),
        experts=Experts(n=n, per_token=per_token, softmax_over="chosen", output_bias=True),
        mixture_of_attention=MixtureOfAttention(n=n, per_token=per_token))


def jetmoe_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    spec, experts = cfg.mixture_of_attention, cfg.experts
    if spec is None:
        raise ValueError("a JetMoE checkpoint holds a mixture of attention heads in every layer; this model has none "
                         "(mixture_of_attention=None)")
    wanted = Experts(n=spec.n, per_token=spec.per_token, softmax_over="chosen", output_bias=True)
    if experts != wanted:
        raise ValueError(f"a JetMoE checkpoint's MLPs are experts routed as its attention's are, {wanted!r}; this model "
                         f"has experts={experts!r}")
    require_fields(cfg, "JetMoE", norm=Norm.RMS, norm_placement=NormPlacement.PRE, final_norm=True,
                   positions=Positions.ROTARY, rotary_dim=cfg.d_head, gated_mlp=True, mlp_bias=False,
                   unembed_bias=False, eps=BLOCK_EPS, experts=wanted, mixture_of_attention=spec, final_eps=cfg.final_eps)
    return {
        "model_type": "jetmoe", "architectures": ["JetMoeForCausalLM"], "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.d_model, "num_key_value_heads": cfg.n_kv_heads, "kv_channels": cfg.d_head,
        "intermediate_size": cfg.d_mlp, "vocab_size": cfg.d_vocab, "max_position_embeddings": cfg.n_ctx,
        "rms_norm_eps": cfg.final_eps or cfg.eps, "activation_function": GPT_ACTIVATION_NAMES[cfg.activation],
        "tie_word_embeddings": cfg.tied_embeddings, "num_local_experts": spec.n, "num_experts_per_tok": spec.per_token,
        **rope_to_hf(cfg), **special_token_ids(tokenizer),
    }


def _names(cfg: DecoderConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape) for every tensor but the experts' fused gate/up projections and the
    unembedding's; names relative to the file's `model.`."""
    d, n, width = cfg.d_model, cfg.mixture_of_attention.n, cfg.n_kv_heads * cfg.d_head
    table = {"embed.W_E": ("embed_tokens.weight", (cfg.d_vocab, d)), "ln_final.w": ("norm.weight", (d,))}
    for l in range(cfg.n_layers):
        b, t = f"blocks.{l}", f"layers.{l}"
        a, ta = f"{b}.attn", f"{t}.self_attention"
        table.update({
            f"{b}.ln1.w": (f"{t}.input_layernorm.weight", (d,)), f"{b}.ln2.w": (f"{t}.post_attention_layernorm.weight", (d,)),
            f"{a}.W_gate.weight": (f"{ta}.experts.router.layer.weight", (n, d)),
            f"{a}.q_experts.weight": (f"{ta}.experts.input_linear.weight", (n, width, d)),
            f"{a}.out_experts.weight": (f"{ta}.experts.output_linear.weight", (n, d, width)),
            f"{a}.out_bias.bias": (f"{ta}.experts.bias", (d,)), f"{a}.kv.weight": (f"{ta}.kv_proj.weight", (2 * width, d)),
            f"{b}.mlp.W_gate.weight": (f"{t}.mlp.router.layer.weight", (cfg.experts.n, d)),
            f"{b}.mlp.out_bias.bias": (f"{t}.mlp.bias", (d,))})
    return table


def jetmoe_to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {ours: source.take(theirs, shape) for ours, (theirs, shape) in _names(cfg).items()}
    n, d, m = cfg.experts.n, cfg.d_model, cfg.d_mlp
    for l in range(cfg.n_layers):
        fused = source.take(f"layers.{l}.mlp.input_linear.weight", (n, 2 * m, d))  # the gate's rows, then the up's
        down = source.take(f"layers.{l}.mlp.output_linear.weight", (n, d, m))
        for e in range(n):
            o = f"blocks.{l}.mlp.experts.{e}"
            out.update({f"{o}.W_gate.weight": fused[e, :m], f"{o}.W_in.weight": fused[e, m:],
                        f"{o}.W_out.weight": down[e]})
    out["unembed.weight"] = take_unembed(source, cfg, out["embed.W_E"])
    return out


def jetmoe_to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    out = {f"model.{theirs}": params[ours] for ours, (theirs, _) in _names(cfg).items()}
    for l in range(cfg.n_layers):
        o = f"blocks.{l}.mlp.experts"
        experts = range(cfg.experts.n)
        out[f"model.layers.{l}.mlp.input_linear.weight"] = torch.stack([
            torch.cat([params[f"{o}.{e}.W_gate.weight"], params[f"{o}.{e}.W_in.weight"]]) for e in experts])
        out[f"model.layers.{l}.mlp.output_linear.weight"] = torch.stack([params[f"{o}.{e}.W_out.weight"]
                                                                         for e in experts])
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = params["unembed.weight"]
    return {k: v.contiguous() for k, v in out.items()}
