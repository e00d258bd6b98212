"""Mixture-of-experts checkpoints (Mixtral, OLMoE, FlexOlmo, Qwen3-MoE, Qwen1.5/Qwen2-MoE, GLM-4.5/4.6): Llama's
attention and norms (probe.checkpoint_llama) and, in place of each sparse layer's MLP, a router and its experts
(probe.moe), with Qwen2-MoE's gated shared expert (`mlp.shared_expert`, `mlp.shared_expert_gate`) or DeepSeek's and
GLM-4.5's ungated ones (`mlp.shared_experts`, n_shared_experts experts' width).

The experts are stored one by one, [out, in] as nn.Linear: Mixtral's under `block_sparse_moe.experts.{e}.w1` (gate),
`w3` (up) and `w2` (down), the others' under `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj` (what
transformers 5 saves), or fused per layer (`mlp.experts.gate_up_proj` [expert 2*width d_model], the gates' rows
first, and `mlp.experts.down_proj`: transformers 5's modules, and some converted files), read either way; the router
is the block's `gate` (with DeepSeek's selection bias beside it, `gate.e_score_correction_bias`). Mixtral renormalises
the chosen experts' weights always, the others as `norm_topk_prob` says.

Dense layers among the sparse ones (Qwen-MoE's mlp_only_layers and decoder_sparse_step, DeepSeek's and GLM-4.5's
first_k_dense_replace) are Llama's MLPs of intermediate_size, the experts then moe_intermediate_size wide
(Experts.width); where every layer is sparse the experts' width is the model's d_mlp, as transformer-lens has it.
GLM-4.5 (`glm4_moe`): Llama's attention with q/k/v biases where attention_bias says, rotary on the first half of each
head (rotate-half pairs), optional per-head q/k norms (use_qk_norm), experts chosen by sigmoid scores with a
selection bias within the best groups (probe.config.Experts); its multi-token-prediction layers, stored after the
last (num_nextn_predict_layers), are never read.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from probe.checkpoint_llama import llama_config, llama_config_to_hf, llama_to_hf, llama_to_probe, olmo2_config
from probe.checkpoint_source import Source, require_fields, special_token_ids, with_defaults, with_fields
from probe.config import DecoderConfig, ExpertGroups, Experts, Positions
from probe.config_file import CheckpointError
from probe.tokenizer import Tokenizer

# model_type -> (the sparse block's name in a layer, each expert's (gate, up, down) projections, the shared expert's
# name: gated and singular in Qwen's formats, ungated and plural in DeepSeek's)
LAYOUTS = {**{model_type: ("block_sparse_moe", ("w1", "w3", "w2"), None) for model_type in ("mixtral", "minimax_m2")},
           **{model_type: ("mlp", ("gate_proj", "up_proj", "down_proj"), shared) for model_type, shared in (
               ("olmoe", None), ("flex_olmo", None), ("qwen3_moe", None), ("qwen2_moe", "shared_expert"),
               ("qwen3_5_moe", "shared_expert"),  # (Qwen3.5-MoE's and Qwen3-Next's)
               ("glm4_moe", "shared_experts"), ("deepseek_v2", "shared_experts"), ("deepseek_v3", "shared_experts"),
               ("glm4_moe_lite", "shared_experts"), ("glm_moe_dsa", "shared_experts"),
               ("ernie4_5_moe", "shared_experts"), ("afmoe", "shared_experts"), ("laguna", "shared_experts"))},
           "lfm2_moe": ("feed_forward", ("w1", "w3", "w2"), None),
           "jamba": ("feed_forward", ("gate_proj", "up_proj", "down_proj"), None)}  # (its router: checkpoint_jamba)
PROJECTIONS = ("W_gate", "W_in", "W_out")  # probe's (transformer-lens's) names for the same three
SHARED = ("gate", "fc_in", "fc_out")  # the shared expert's, a gated MLP's (probe.mlp.GatedMLP)


def _experts(hf: dict, count_key: str, renormalize: bool) -> Experts:
    return Experts(n=hf.get(count_key) or hf["num_local_experts"], per_token=hf["num_experts_per_tok"],
                   renormalize=renormalize)


def mixtral_config(hf: dict) -> DecoderConfig:
    # Mistral's attention (no biases; a window where the file names one) and experts whose weights are renormalised
    return dataclasses.replace(llama_config(with_defaults(hf, rope_theta=1e6), qkv_bias=False, default_eps=1e-5),
                               sliding_window=hf.get("sliding_window"),
                               experts=_experts(hf, "num_local_experts", True))


def olmoe_config(hf: dict) -> DecoderConfig:
    # OLMo 2's q and k norms over all heads, in a pre-norm block; q, k and v clamped where clip_qkv says
    return dataclasses.replace(llama_config(hf, default_eps=1e-5), qk_norm=True, qk_norm_over_heads=True,
                               out_bias=hf.get("attention_bias", False), clip_qkv=hf.get("clip_qkv"),
                               experts=_experts(hf, "num_experts", hf.get("norm_topk_prob", False)))


def flex_olmo_config(hf: dict) -> DecoderConfig:
    # FlexOlmo: OLMo 2's block (write norms only, q and k normalised over all heads) with OLMoE's experts in the MLP's
    # place, intermediate_size their width
    return dataclasses.replace(olmo2_config(with_defaults(hf, rope_theta=500_000.0)), eps=hf.get("rms_norm_eps", 1e-6),
                               experts=_experts(hf, "num_experts", hf.get("norm_topk_prob", False)))


def every_layer_sparse(hf: dict) -> dict:
    """config.json with the experts' width as the MLP's (the file's intermediate_size is a dense layer's, which
    Qwen3.5-MoE's and Qwen3-Next's files may put among the sparse ones: refused there)."""
    dense = hf.get("mlp_only_layers") or []
    if dense or hf.get("decoder_sparse_step", 1) != 1:
        raise CheckpointError(f"dense MLP layers among the sparse ones (mlp_only_layers={dense}, decoder_sparse_step="
                              f"{hf.get('decoder_sparse_step', 1)}) are not supported: every layer must be sparse")
    return with_fields(hf, intermediate_size=hf["moe_intermediate_size"])


def sparse_layout(hf: dict, experts: Experts, sparse: tuple[bool, ...]) -> tuple[dict, Experts]:
    """(config.json, experts) for a file whose layers `sparse` have experts moe_intermediate_size wide: where every
    layer has them, the experts' width is the MLP's (intermediate_size read as moe_intermediate_size); else the dense
    layers keep intermediate_size and the experts say their width and layers."""
    if not any(sparse):
        raise CheckpointError("config.json puts no layer's experts anywhere (every layer dense: first_k_dense_replace, "
                              "mlp_only_layers or decoder_sparse_step); load it as its dense family, or fix the config")
    if all(sparse):
        return with_fields(hf, intermediate_size=hf["moe_intermediate_size"]), experts
    return hf, dataclasses.replace(experts, width=hf["moe_intermediate_size"], layers=sparse)


def qwen_sparse_layers(hf: dict) -> tuple[bool, ...]:
    """Which layers of a Qwen-MoE file are sparse: those not in mlp_only_layers whose number (from 1) is a multiple
    of decoder_sparse_step, as transformers builds them."""
    dense, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step", 1)
    return tuple(l not in dense and (l + 1) % step == 0 for l in range(hf["num_hidden_layers"]))


def qwen3_moe_config(hf: dict) -> DecoderConfig:
    hf, experts = sparse_layout(hf, _experts(hf, "num_experts", hf.get("norm_topk_prob", False)), qwen_sparse_layers(hf))
    return dataclasses.replace(llama_config(hf), qk_norm=True, experts=experts)


def qwen2_moe_config(hf: dict) -> DecoderConfig:
    # Qwen2's attention (q/k/v biases) and, beside the routed experts, a shared one every token runs
    experts = dataclasses.replace(_experts(hf, "num_experts", hf.get("norm_topk_prob", False)),
                                  shared=hf.get("shared_expert_intermediate_size") or None)
    hf, experts = sparse_layout(hf, experts, qwen_sparse_layers(hf))
    return dataclasses.replace(llama_config(hf, qkv_bias=hf.get("qkv_bias", True)), experts=experts)


# ---- DeepSeek's routing: DeepSeek-V2, DeepSeek-V3, GLM-4.5 ---------------------------------------------------
# transformers' defaults for the fields a config.json may leave out, by model type
DEEPSEEK_DEFAULTS = {
    "glm4_moe": dict(n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=1408,
                     routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True, first_k_dense_replace=1),
    "deepseek_v3": dict(n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
                        routed_scaling_factor=2.5, n_group=8, topk_group=4, norm_topk_prob=True, first_k_dense_replace=3),
    "deepseek_v2": dict(n_routed_experts=64, n_shared_experts=2, moe_intermediate_size=1407, routed_scaling_factor=1.0,
                        topk_method="greedy", first_k_dense_replace=0),
    # GLM-4.7-Flash: V3's routing (its layers' kinds are mlp_layer_types, read by probe.checkpoint_deepseek)
    "glm4_moe_lite": dict(n_routed_experts=64, num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=1536,
                          routed_scaling_factor=1.8, n_group=1, topk_group=1, norm_topk_prob=True,
                          first_k_dense_replace=1),
    # GLM-5 (GLM-MoE-DSA): V3's routing again, three dense layers first unless mlp_layer_types says otherwise
    "glm_moe_dsa": dict(n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
                        routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True,
                        first_k_dense_replace=3),
}


def deepseek_experts(hf: dict, model_type: str) -> Experts:
    """The experts of a DeepSeek-V2, DeepSeek-V3 or GLM-4.5 config.json as transformers builds them, in every layer
    (deepseek_sparse_layers says which are sparse, sparse_layout the dense ones' width). V3 and GLM-4.5: sigmoid
    scores with a selection bias, groups scored by their two best (n_group > 1), renormalised as norm_topk_prob says.
    V2: the softmax, never renormalised (transformers' router ignores norm_topk_prob), groups scored by their best
    where topk_method is "group_limited_greedy". Both times routed_scaling_factor, beside n_shared_experts ungated
    shared experts."""
    hf = with_defaults(hf, **DEEPSEEK_DEFAULTS[model_type])
    if hf.get("num_experts_per_tok") is None:
        raise CheckpointError(f"a {model_type} config.json must say num_experts_per_tok (how many experts each token "
                              "runs)")
    v2 = model_type == "deepseek_v2"
    if v2 and hf["topk_method"] not in ("greedy", "group_limited_greedy"):
        raise CheckpointError(f"topk_method={hf['topk_method']!r} is not supported; supported: 'greedy', "
                              "'group_limited_greedy'")
    grouped = hf["topk_method"] == "group_limited_greedy" if v2 else (hf.get("n_group") or 1) > 1
    shared = (hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"]
    return Experts(n=hf["n_routed_experts"], per_token=hf["num_experts_per_tok"],
                   renormalize=not v2 and bool(hf["norm_topk_prob"]), scoring="softmax" if v2 else "sigmoid",
                   selection_bias=not v2, scaling=float(hf["routed_scaling_factor"]), shared=shared or None,
                   shared_gate=not shared,
                   groups=ExpertGroups(n=hf["n_group"], kept=hf["topk_group"], score="max" if v2 else "top2_sum")
                   if grouped else None)


def deepseek_sparse_layers(hf: dict, model_type: str) -> tuple[bool, ...]:
    """Which layers of a DeepSeek-V2, DeepSeek-V3 or GLM-4.5 file are sparse: all but the first
    first_k_dense_replace, as transformers builds them."""
    first = with_defaults(hf, **DEEPSEEK_DEFAULTS[model_type])["first_k_dense_replace"] or 0
    return tuple(l >= first for l in range(hf["num_hidden_layers"]))


def deepseek_experts_to_hf(cfg: DecoderConfig, model_type: str) -> dict:
    """deepseek_experts' and deepseek_sparse_layers' fields for a config.json (moe_intermediate_size among them), refusing
    experts the format cannot hold."""
    experts, n_layers = cfg.experts, cfg.n_layers
    v2 = model_type == "deepseek_v2"
    groups = experts.groups if experts is not None else None
    sparse = tuple(cfg.layer_sparse(l) for l in range(n_layers))
    first = sparse.index(True) if any(sparse) else n_layers
    width = cfg.expert_width
    if (experts is None or experts.scoring != ("softmax" if v2 else "sigmoid") or experts.selection_bias == v2
            or experts.renormalize and v2 or (experts.shared is not None and (experts.shared_gate or experts.shared % width))
            or (groups is not None and groups.score != ("max" if v2 else "top2_sum"))
            or sparse != tuple(l >= first for l in range(n_layers))):
        raise ValueError(f"a {model_type} checkpoint holds {'softmax' if v2 else 'sigmoid'}-scored experts"
                         f"{'' if v2 else ' with a selection bias'}, ungated shared experts as wide as a whole number "
                         f"of experts, and dense layers first only; this model has experts={experts!r}")
    out = {"n_routed_experts": experts.n, "num_experts_per_tok": experts.per_token, "moe_intermediate_size": width,
           "n_shared_experts": (experts.shared or 0) // width, "routed_scaling_factor": experts.scaling,
           "n_group": 1 if groups is None else groups.n, "topk_group": 1 if groups is None else groups.kept,
           "norm_topk_prob": experts.renormalize, "first_k_dense_replace": first}
    if v2:
        out["topk_method"] = "greedy" if groups is None else "group_limited_greedy"
    return out


def glm4_moe_config(hf: dict) -> DecoderConfig:
    hf = with_defaults(hf, intermediate_size=10944, **DEEPSEEK_DEFAULTS["glm4_moe"])
    hf, experts = sparse_layout(hf, deepseek_experts(hf, "glm4_moe"), deepseek_sparse_layers(hf, "glm4_moe"))
    base = llama_config(hf, qkv_bias=hf.get("attention_bias", False), default_eps=1e-5)
    rope = hf.get("rope_parameters") or {}
    fraction = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    return dataclasses.replace(base, rotary_dim=int(base.d_head * fraction), qk_norm=hf.get("use_qk_norm", False),
                               experts=experts)


def glm4_moe_config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
    require_fields(cfg, "glm4_moe", out_bias=False, mlp_bias=False, qk_norm={False, True}, experts=cfg.experts,
                   positions=Positions.ROTARY)
    moe = deepseek_experts_to_hf(cfg, "glm4_moe")
    # Llama's writer checks the rest (a whole-head rotary and q/k norms are not Llama's: put back below)
    plain = dataclasses.replace(cfg, rotary_dim=cfg.d_head, out_bias=cfg.qkv_bias, qk_norm=False, experts=None)
    out = llama_config_to_hf(plain, tokenizer, "llama")
    out.pop("mlp_bias")
    out["rope_parameters"] = {**out["rope_parameters"], "partial_rotary_factor": cfg.rotary_dim / cfg.d_head}
    out.update(special_token_ids(tokenizer))
    out.update(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], use_qk_norm=cfg.qk_norm,
               num_nextn_predict_layers=0, **moe)  # (probe holds no multi-token-prediction layers)
    return out


# ---- the experts' tensors ------------------------------------------------------------------------------------
def require_routing(experts: Optional[Experts], model_type: str, **wanted) -> None:
    """Refuse experts a format cannot hold: their routing, shared expert, width and layers at Mixtral's (softmax
    scores over every expert, no bias, groups or scaling, a gated shared expert where there is one, every layer
    sparse, d_mlp wide)
    unless `wanted` says otherwise."""
    if experts is None:
        return
    plain = dict(scoring="softmax", selection_bias=False, groups=None, scaling=1.0, shared_gate=True, width=None,
                 layers=None, softmax_over="all")
    wrong = {k: getattr(experts, k) for k, v in {**plain, **wanted}.items() if getattr(experts, k) != v}
    if wrong:
        raise ValueError(f"a {model_type} checkpoint cannot hold these experts: "
                         f"{', '.join(f'{k}={v!r}' for k, v in wrong.items())}")


def moe_config_to_hf(model_type: str) -> Callable[[DecoderConfig, Optional[Tokenizer]], dict]:
    qwen = model_type in ("qwen3_moe", "qwen2_moe")

    def config_to_hf(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> dict:
        if cfg.experts is None or (model_type == "mixtral" and not cfg.experts.renormalize):
            raise ValueError(f"a {model_type} checkpoint holds a mixture of experts"
                             + (" whose weights are renormalised" if model_type == "mixtral" else "")
                             + f"; this model has experts={cfg.experts!r}")
        experts = cfg.experts
        # (Qwen's formats hold dense layers among the sparse ones, and the experts' own width beside them)
        require_routing(experts, model_type, **({"width": experts.width, "layers": experts.layers} if qwen else {}))
        out = llama_config_to_hf(cfg, tokenizer, model_type)
        count = "num_local_experts" if model_type == "mixtral" else "num_experts"
        out.update({count: experts.n, "num_experts_per_tok": experts.per_token})
        if model_type == "mixtral":
            out["sliding_window"] = cfg.sliding_window
        else:
            out["norm_topk_prob"] = experts.renormalize
        if qwen:
            out.update(moe_intermediate_size=cfg.expert_width, decoder_sparse_step=1,
                       mlp_only_layers=[l for l in range(cfg.n_layers) if not cfg.layer_sparse(l)])
        if model_type == "qwen2_moe":
            out.update(shared_expert_intermediate_size=experts.shared or 0, qkv_bias=cfg.qkv_bias)
        elif experts.shared is not None:
            raise ValueError(f"a {model_type} checkpoint has no shared expert; this model has experts={experts!r}")
        return out
    return config_to_hf


def expert_names(cfg: DecoderConfig, model_type: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ours -> (theirs, their shape) for every router, selection-bias and expert tensor of the sparse layers, [out,
    in] as ours, in a `model_type` file (a key of LAYOUTS: DeepSeek-V2's and V3's are "deepseek_v2" /
    "deepseek_v3"); names relative to the file's `model.`. Llama's names do the rest, dense layers' MLPs included."""
    block, projections, shared_name = LAYOUTS[model_type]
    d, w, experts = cfg.d_model, cfg.expert_width, cfg.experts
    table = {}
    for l in filter(cfg.layer_sparse, range(cfg.n_layers)):
        o, t = f"blocks.{l}.mlp", f"layers.{l}.{block}"
        table[f"{o}.W_gate.weight"] = (f"{t}.gate.weight", (experts.n, d))
        if experts.selection_bias:
            table[f"{o}.e_score_correction_bias"] = (f"{t}.gate.e_score_correction_bias", (experts.n,))
        for e in range(experts.n):
            for ours, theirs, shape in zip(PROJECTIONS, projections, ((w, d), (w, d), (d, w))):
                table[f"{o}.experts.{e}.{ours}.weight"] = (f"{t}.experts.{e}.{theirs}.weight", shape)
        if experts.shared is not None:
            s = experts.shared
            if experts.shared_gate:
                table[f"{o}.shared_expert_gate.weight"] = (f"{t}.{shared_name}_gate.weight", (1, d))
            for ours, theirs, shape in zip(SHARED, projections, ((s, d), (s, d), (d, s))):
                table[f"{o}.shared_expert.{ours}.weight"] = (f"{t}.{shared_name}.{theirs}.weight", shape)
    return table


def take_experts(source: Source, cfg: DecoderConfig, model_type: str,
                 names: Optional[dict[str, tuple[str, tuple[int, ...]]]] = None) -> dict[str, torch.Tensor]:
    """The sparse layers' routers, selection biases, experts and shared experts (`names`, a format's own table;
    None: expert_names'), stored one by one or each layer's experts fused (`experts.gate_up_proj` [expert 2*width
    d_model], the gates' rows first, and `experts.down_proj` [expert d_model width]), as probe's tensors."""
    block, (gate, up, down), _ = LAYOUTS[model_type]
    n, d, w = cfg.experts.n, cfg.d_model, cfg.expert_width
    for l in filter(cfg.layer_sparse, range(cfg.n_layers)):
        t = f"layers.{l}.{block}.experts"
        if f"{t}.gate_up_proj" in source.state:
            gate_up, fused_down = source.take(f"{t}.gate_up_proj", (n, 2 * w, d)), source.take(f"{t}.down_proj", (n, d, w))
            for e in range(n):
                source.state.update({f"{t}.{e}.{gate}.weight": gate_up[e, :w], f"{t}.{e}.{up}.weight": gate_up[e, w:],
                                     f"{t}.{e}.{down}.weight": fused_down[e]})
    names = expert_names(cfg, model_type) if names is None else names
    return {ours: source.take(theirs, shape) for ours, (theirs, shape) in names.items()}


PREDICTION_LAYERS = ("num_nextn_predict_layers", "num_mtp_layers", "num_mtp_modules")  # their counts' spellings


def drop_prediction_layers(source: Source, cfg: DecoderConfig, default: int = 0) -> None:
    """Set aside the multi-token-prediction layers a file stores after the last (DeepSeek-V3's, GLM's, MiniMax-M2's),
    as many as config.json says (`default` where it says nothing): transformers builds none, and neither does probe."""
    count = next((source.config[key] for key in PREDICTION_LAYERS if source.config.get(key) is not None), default)
    extra = tuple(f"layers.{l}." for l in range(cfg.n_layers, cfg.n_layers + count))
    for name in [n for n in source.state if extra and n.startswith(extra)]:
        del source.state[name]


def moe_family(model_type: str) -> tuple[Callable, Callable, Callable]:
    """The model type's (config_to_hf, to_probe, to_hf), for its checkpoints.Family."""
    def to_probe(source: Source, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        drop_prediction_layers(source, cfg)
        out = llama_to_probe(source, cfg)  # everything but the experts
        out.update(take_experts(source, cfg, model_type))
        return out

    def to_hf(params: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
        out = llama_to_hf(params, cfg)
        out.update({f"model.{theirs}": params[ours].contiguous()
                    for ours, (theirs, _) in expert_names(cfg, model_type).items()})
        return out

    return CONFIG_WRITERS.get(model_type) or moe_config_to_hf(model_type), to_probe, to_hf


CONFIG_WRITERS = {"glm4_moe": glm4_moe_config_to_hf}  # the formats whose config.json is not Llama's with experts
