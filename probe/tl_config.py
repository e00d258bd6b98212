"""transformer-lens's `HookedTransformerConfig(...)`, for building a model from scratch as TL code does:

    cfg = HookedTransformerConfig(n_layers=2, d_model=128, d_head=32, n_ctx=64, d_vocab=100, act_fn="gelu")
    model = HookedDecoder(cfg)                     # TL: HookedTransformer(cfg)
    model.load_state_dict(torch.load(path, weights_only=True))   # a HookedTransformer's saved weights

It takes TL's keywords, with TL's defaults, and returns probe's `DecoderConfig`. A HookedTransformer always has
q/k/v, output, MLP and unembedding biases and untied embeddings, so the config has them too: its state dict then loads
strictly (probe.tl_state_dict). `seed=` seeds torch's, numpy's and random's generators as TL's config does, and
the model draws its initial weights as HookedTransformer's "gpt2" init does (`transformer_lens_init`): the same
weights, and the generator left where TL's leaves it (TL's other init modes get probe's normal draw). What probe's
decoder does not have is refused by name, with what to use instead.
"""
from __future__ import annotations

import dataclasses

import math
import random
from typing import Any, Optional, Union

import torch

from probe.config_choices import ClampedSwiGLU
from probe.config import SWITCHES, DecoderConfig, Experts, Norm, NormPlacement, Positions, RotaryScaling
from probe.config_choices import ACTIVATION_SPELLINGS
from probe.tl_config_fields import ABSENT_FEATURES

NORMS = {"LN": Norm.LAYER, "RMS": Norm.RMS, "LNPre": Norm.LAYER, "RMSPre": Norm.RMS, None: Norm.NONE}
POSITIONS = {"standard": Positions.LEARNED, "rotary": Positions.ROTARY, "shortformer": Positions.SHORTFORMER,
             "alibi": Positions.ALIBI}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}

# TL settings with nothing to build in probe: accepted at these values only
ONLY = {**ABSENT_FEATURES, "n_devices": 1, "default_padding_side": "right"}
WHY = {"attention_dir": "probe's attention is 'causal' or 'bidirectional'",
       "attn_only": "attention-only blocks are pre-norm: x + attn(ln1(x)); leave parallel_attn_mlp and "
                    "use_normalization_before_and_after False",
       "normalization_type": "probe's norms are 'LN', 'LNPre', 'RMS', 'RMSPre' and None",
       "positional_embedding_type": "probe's positions are 'standard' (learned), 'shortformer', 'rotary' and 'alibi'",
       "act_fn": f"probe's activations are {sorted(ACTIVATION_SPELLINGS)}",
       "final_rms": "probe's final norm is the kind of the others: final_rms goes with normalization_type='RMS'",
       "rotary_scaling_factor": "linear scaling goes without use_NTK_by_parts_rope",
       "default_padding_side": "probe's config holds no tokenizer: give the side with the tokenizer, "
                               "model.set_tokenizer(tokenizer, default_padding_side='left')"}
# TL settings that only describe where a checkpoint came from, or that probe computes (or draws) itself; and two
# a HookedTransformer never reads (TL 4's bridge sets them)
IGNORED = {"from_checkpoint", "checkpoint_index", "checkpoint_label_type", "checkpoint_value", "init_mode", "n_params",
           "tokenizer_prepends_bos", "uses_rms_norm", "layer_norm_folding"}
KNOWN = {"n_layers", "d_model", "n_ctx", "d_head", "n_heads", "d_mlp", "d_vocab", "d_vocab_out", "act_fn", "eps", "normalization_type",
         "positional_embedding_type", "final_rms", "parallel_attn_mlp", "use_normalization_before_and_after", "seed",
         "use_local_attn", "window_size", "attn_types", "initializer_range", "dtype", "n_key_value_heads", "gated_mlp",
         "rotary_base", "rotary_dim", "use_NTK_by_parts_rope", "NTK_by_parts_factor", "NTK_by_parts_low_freq_factor",
         "NTK_by_parts_high_freq_factor", "NTK_original_ctx_len", "use_attn_scale", "attn_scale",
         "attn_scores_soft_cap", "output_logits_soft_cap", "use_qk_norm", "tie_word_embeddings", "model_name",
         "original_architecture", "device", "default_prepend_bos", "use_attn_result", "use_split_qkv_input",
         "init_weights",
         "use_attn_in", "use_hook_mlp_in", "ungroup_grouped_query_attention", "attn_only", "tokenizer_name",
         "attention_dir", "use_hook_tokens", "scale_attn_by_inverse_layer_idx", "rotary_scaling_factor",
         "rotary_base_local", "rotary_adjacent_pairs", "use_yarn_rope", "yarn_factor", "yarn_attention_factor",
         "yarn_beta_fast", "yarn_beta_slow", "yarn_original_max_position_embeddings", "yarn_truncate",
         "yarn_global_attn_only", "post_embedding_ln", "num_experts", "experts_per_token", "norm_topk_prob", "clip_qkv",
         "use_attention_sinks"}


def _config_fields() -> set[str]:
    """The fields `DecoderConfig.to_dict()` writes: a set of keywords holding them all is such a dict (no
    transformer-lens call names probe's own fields, `activation`, `norm_placement`, ...)."""
    return {f.name for f in dataclasses.fields(DecoderConfig) if f.compare}


class _BuildsDecoderConfigs(type):
    """Calling the class builds a DecoderConfig, and every DecoderConfig is an instance of it."""

    def __call__(cls, **settings: Any) -> DecoderConfig:
        return decoder_config_from_tl(**settings)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, DecoderConfig)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, DecoderConfig)


class HookedTransformerConfig(metaclass=_BuildsDecoderConfigs):
    """transformer-lens's config class, for its code: `HookedTransformerConfig(**keywords)` builds probe's
    DecoderConfig (see decoder_config_from_tl), and `isinstance(model.cfg, HookedTransformerConfig)` holds, as TL code
    checks it (EAP-IG's `Graph.from_model` takes a model, a config or a dict by that test)."""

    @classmethod
    def from_dict(cls, config_dict: dict) -> DecoderConfig:
        return decoder_config_from_tl(**config_dict)

    @classmethod
    def unwrap(cls, config: Union[dict, DecoderConfig]) -> DecoderConfig:
        """A dict built into a config, a config as it is (TL's helper for functions that take either)."""
        return cls.from_dict(config) if isinstance(config, dict) else config


def decoder_config_from_tl(**settings: Any) -> DecoderConfig:
    """A DecoderConfig from transformer-lens's HookedTransformerConfig keywords (see the module docstring), or from
    every field of a DecoderConfig's `to_dict()`: TL code rebuilds a model's config as
    `HookedTransformerConfig(**model.cfg.to_dict())`, and a probe config's dict holds probe's own fields."""
    s = dict(settings)
    if _config_fields() <= set(s):
        return DecoderConfig.from_dict(s)
    for name in ("n_layers", "d_model", "n_ctx", "d_head"):
        if name not in s:
            raise TypeError(f"HookedTransformerConfig needs {name} (transformer-lens requires it too)")
    for name, allowed in ONLY.items():
        if name in s and s[name] != allowed:
            why = WHY.get(name, "probe's decoder does not build it")
            raise ValueError(f"HookedTransformerConfig({name}={s[name]!r}) is not supported: {why}")
    known = set(ONLY) | IGNORED | KNOWN
    unknown = sorted(set(s) - known)
    if unknown:
        raise TypeError(f"HookedTransformerConfig got unknown keywords {unknown}; transformer-lens's keywords that "
                        f"probe builds are {sorted(KNOWN)}")
    d_vocab = s.get("d_vocab", -1)
    if d_vocab == -1:
        if s.get("tokenizer_name") is None:
            raise ValueError("HookedTransformerConfig needs d_vocab, or tokenizer_name to read it from (as "
                             "transformer-lens does)")
        d_vocab = _vocab_size(s["tokenizer_name"])
    d_model, d_head = s["d_model"], s["d_head"]
    n_heads = s.get("n_heads", -1)
    if n_heads == -1:
        if d_model % d_head:
            raise ValueError(f"n_heads defaults to d_model // d_head, but d_model={d_model} is not a multiple of "
                             f"d_head={d_head}: give n_heads")
        n_heads = d_model // d_head
    act_fn = s.get("act_fn", "relu" if s.get("attn_only") else None)  # no MLP to use it: TL's value, unused
    if s.get("attn_only") and act_fn not in ACTIVATION_SPELLINGS:
        act_fn = "relu"  # whatever an attention-only model's file names that probe lacks: nothing applies it
    if act_fn not in ACTIVATION_SPELLINGS:
        raise ValueError(f"HookedTransformerConfig(act_fn={act_fn!r}) is not supported: {WHY['act_fn']}")
    norm = _choice(s, "normalization_type", "LN", NORMS)
    positions = _choice(s, "positional_embedding_type", "standard", POSITIONS)
    if s.get("final_rms", False) and norm is not Norm.RMS:
        raise ValueError(f"HookedTransformerConfig(final_rms=True) with normalization_type={s.get('normalization_type')!r}"
                         f" is not supported: {WHY['final_rms']}")
    if s.get("original_architecture") in ("Olmo2ForCausalLM", "Olmo3ForCausalLM"):
        # TL 3.9 builds these blocks by their architecture's name (norms after the sublayers, named ln1 / ln2)
        raise ValueError(f"HookedTransformerConfig(original_architecture={s['original_architecture']!r}) is not "
                         "supported: its blocks normalise each write alone, which TL decides by that name; load the "
                         "checkpoint with from_pretrained (OLMo 2: ln1_post / ln2_post, transformer-lens 4's names)")
    if positions is Positions.ALIBI and n_heads & (n_heads - 1):
        raise ValueError(f"HookedTransformerConfig(positional_embedding_type='alibi') with n_heads={n_heads} is not "
                         "supported: transformer-lens's slopes, 2^(-8(h+1)/n_heads), differ from Bloom's (which probe "
                         "builds) unless n_heads is a power of two; use 2^k heads")
    experts = _experts(s)
    placement = NormPlacement.PRE
    if s.get("parallel_attn_mlp", False):
        placement = NormPlacement.PARALLEL
    if s.get("use_normalization_before_and_after", False):
        placement = NormPlacement.SANDWICH
    attention_dir = s.get("attention_dir", "causal")
    if attention_dir not in ("causal", "bidirectional"):
        raise ValueError(f"HookedTransformerConfig(attention_dir={attention_dir!r}) is not supported: {WHY['attention_dir']}")
    attn_only = s.get("attn_only", False)
    if attn_only is True and placement is not NormPlacement.PRE:
        raise ValueError(f"HookedTransformerConfig(attn_only=True) with {placement.value} blocks is not supported: "
                         f"{WHY['attn_only']}")
    if s.get("seed") is not None:
        _seed_everywhere(s["seed"])
    window = s.get("window_size") if s.get("use_local_attn", False) else None
    attn_types = s.get("attn_types")
    init = s.get("initializer_range", -1.0)
    dtype = s.get("dtype", torch.float32)
    return DecoderConfig(
        n_layers=s["n_layers"], d_model=d_model, n_heads=n_heads, d_vocab=d_vocab, n_ctx=s["n_ctx"], d_head=d_head,
        d_vocab_out=None if s.get("d_vocab_out", -1) == -1 else s["d_vocab_out"],
        d_mlp=s.get("d_mlp"), n_kv_heads=s.get("n_key_value_heads"), eps=s.get("eps", 1e-5),
        activation=ACTIVATION_SPELLINGS[act_fn], act_fn_name=act_fn if act_fn != ACTIVATION_SPELLINGS[act_fn].value else None,
        gated_mlp=s.get("gated_mlp", False) or experts is not None, experts=experts, norm=norm, norm_placement=placement,
        attn_only=attn_only, bidirectional=attention_dir == "bidirectional", use_hook_tokens=s.get("use_hook_tokens", False),
        norm_weights=not str(s.get("normalization_type", "LN")).endswith("Pre"), final_norm=norm is not Norm.NONE,
        positions=positions, embed_norm=bool(s.get("post_embedding_ln", False)), rotary_base=float(s.get("rotary_base", 10000)), rotary_dim=s.get("rotary_dim") if positions is Positions.ROTARY else None,
        rotary_scaling=_rotary_scaling(s), sliding_rotary_base=_sliding_rotary_base(s, positions, window),
        rotary_adjacent_pairs=bool(s.get("rotary_adjacent_pairs", False)) and positions is Positions.ROTARY,
        sliding_window=window,
        sliding_layers=tuple(t == "local" for t in attn_types) if window is not None and attn_types else None,
        attn_scale_dim=_scale_dim(s), attn_softcap=_cap(s.get("attn_scores_soft_cap", -1.0)),
        logit_softcap=_cap(s.get("output_logits_soft_cap", -1.0)), qk_norm=s.get("use_qk_norm", False),
        attn_scale_by_layer=s.get("scale_attn_by_inverse_layer_idx", False), clip_qkv=s.get("clip_qkv"),
        attn_sinks=bool(s.get("use_attention_sinks", False)),
        # TL's experts have no biases, but for GPT-OSS's (and its router's)
        qkv_bias=True, out_bias=True, mlp_bias=experts is None or experts.clamped_glu is not None, unembed_bias=True,
        tied_embeddings=s.get("tie_word_embeddings", False),
        init_std=init if init > 0 else 0.8 / math.sqrt(d_model),  # TL's default for a negative initializer_range
        model_name=s.get("model_name", "custom"), original_architecture=s.get("original_architecture"),
        tokenizer_source=s.get("tokenizer_name"),
        device=str(s.get("device") or "cpu"), dtype=DTYPES.get(dtype, dtype),
        default_prepend_bos=s.get("default_prepend_bos", True), seed=s.get("seed"),
        transformer_lens_init=s.get("init_mode", "gpt2") == "gpt2",  # TL's other init modes: probe's normal draw
        init_weights=bool(s.get("init_weights", True)),
        **{name: s.get(name, False) for name in SWITCHES})


def _experts(s: dict) -> Optional[Experts]:
    """TL's MoE settings (its experts are gated MLPs whatever gated_mlp says), both or neither; GPT-OSS's experts
    (biased, chosen by logit, a clamped GLU with TL's fixed constants), which TL builds by the architecture's name."""
    n, per_token = s.get("num_experts"), s.get("experts_per_token")
    if (n is None) != (per_token is None):
        raise ValueError(f"HookedTransformerConfig(num_experts={n!r}, experts_per_token={per_token!r}): a mixture of "
                         "experts needs both (transformer-lens requires them together too)")
    if n is not None and s.get("original_architecture") == "GptOssForCausalLM":
        return Experts(n=n, per_token=per_token, softmax_over="chosen", clamped_glu=ClampedSwiGLU())
    return None if n is None else Experts(n=n, per_token=per_token, renormalize=bool(s.get("norm_topk_prob", False)))


def decoder_config(cfg: Any) -> DecoderConfig:
    """What `HookedDecoder(cfg)` builds from: a DecoderConfig as it is, or what TL code hands HookedTransformer(cfg):
    a dict of HookedTransformerConfig's keywords (read as above), or transformer-lens's own HookedTransformerConfig
    (its to_dict(); its seed already drew when it was made, as TL's draws, so it does not draw again here)."""
    if isinstance(cfg, DecoderConfig):
        return cfg
    if isinstance(cfg, dict):
        return HookedTransformerConfig(**cfg)
    if type(cfg).__name__ == "HookedTransformerConfig" and callable(getattr(cfg, "to_dict", None)):
        fields = cfg.to_dict()
        seed = fields.pop("seed", None)
        return dataclasses.replace(HookedTransformerConfig(**fields), seed=seed)
    raise TypeError(f"HookedDecoder(cfg) takes a DecoderConfig, transformer-lens's HookedTransformerConfig or a dict "
                    f"of its keywords, got {type(cfg).__name__}")


def _vocab_size(tokenizer_name: str) -> int:
    """d_vocab as transformer-lens reads it from a tokenizer: its largest id + 1."""
    from probe.loading import load_tokenizer

    return max(load_tokenizer(tokenizer_name).vocab.values()) + 1


def _choice(s: dict, name: str, default: str, table: dict):
    value = s.get(name, default)
    if value not in table:
        raise ValueError(f"HookedTransformerConfig({name}={value!r}) is not supported: {WHY[name]}")
    return table[value]


def _scale_dim(s: dict) -> Optional[float]:
    """What q.k is divided by the square root of: TL's attn_scale is that root (-1: sqrt(d_head))."""
    if not s.get("use_attn_scale", True):
        return 1.0
    scale = s.get("attn_scale", -1.0)
    # TL's resolved default, sqrt(d_head), squares back to d_head only up to rounding: it is the default all the same
    return None if scale == -1.0 or math.isclose(float(scale) ** 2, s["d_head"], rel_tol=1e-9) else float(scale) ** 2


def _sliding_rotary_base(s: dict, positions: Positions, window: Optional[int]) -> Optional[float]:
    """TL's local layers rotate by rotary_base_local (else rotary_base) and never take the linear rescaling."""
    if positions is not Positions.ROTARY or window is None:
        return None
    base = s.get("rotary_base_local")
    yarn, global_only = s.get("use_yarn_rope", False), s.get("yarn_global_attn_only", False)
    local_unscaled = s.get("rotary_scaling_factor", 1.0) != 1.0 or (yarn and global_only)
    if base is not None and yarn and not global_only:
        raise ValueError("HookedTransformerConfig(use_yarn_rope=True) rescaling local layers that rotate by their own "
                         "rotary_base_local is not supported: probe's local layers with their own base rotate unscaled "
                         "(yarn_global_attn_only=True)")
    if base is None and local_unscaled:  # the global base, unscaled: what TL's local layers take
        base = s.get("rotary_base", 10000)
    return None if base is None else float(base)


def _cap(value: float) -> Optional[float]:
    return None if value is None or value < 0 else float(value)


def _rotary_scaling(s: dict) -> Optional[RotaryScaling]:
    """TL's NTK-by-parts rope (Llama 3.1) is transformers' "llama3" rope scaling; its rotary_scaling_factor the
    "linear" one, which TL applies to global layers only (see _sliding_rotary_base)."""
    linear = s.get("rotary_scaling_factor", 1.0)
    if linear != 1.0:
        if s.get("use_NTK_by_parts_rope", False):
            raise ValueError(f"HookedTransformerConfig(rotary_scaling_factor={linear!r}) is not supported here: "
                             f"{WHY['rotary_scaling_factor']}")
        return RotaryScaling(kind="linear", factor=linear)
    if s.get("use_yarn_rope", False):
        if s.get("use_NTK_by_parts_rope", False):
            raise ValueError("HookedTransformerConfig(use_yarn_rope=True) with use_NTK_by_parts_rope is not supported: "
                             "one rotary rescaling per model")
        return RotaryScaling(kind="yarn", factor=s.get("yarn_factor", 1.0), beta_fast=s.get("yarn_beta_fast", 32.0),
                             beta_slow=s.get("yarn_beta_slow", 1.0), attention_factor=s.get("yarn_attention_factor", 1.0),
                             original_n_ctx=s.get("yarn_original_max_position_embeddings", 4096),
                             truncate=bool(s.get("yarn_truncate", True)))
    if not s.get("use_NTK_by_parts_rope", False):
        return None
    return RotaryScaling(kind="llama3", factor=s.get("NTK_by_parts_factor", 8.0),
                         low_freq_factor=s.get("NTK_by_parts_low_freq_factor", 1.0),
                         high_freq_factor=s.get("NTK_by_parts_high_freq_factor", 4.0),
                         original_n_ctx=s.get("NTK_original_ctx_len", 8192))


def _seed_everywhere(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:  # numpy is a dependency, but seeding it is only a courtesy
        pass
