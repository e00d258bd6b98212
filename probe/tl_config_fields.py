"""transformer-lens's HookedTransformerConfig fields, read off a DecoderConfig (a mixin of it).

TL code reads any of its config's fields on `model.cfg`: `cfg.act_fn`, `cfg.normalization_type`, `cfg.n_devices`,
`cfg.tokenizer_prepends_bos`, `cfg.use_NTK_by_parts_rope`, ... Each reads what a HookedTransformer of the same model
reads: probe's value where probe has the feature under TL's name for it (NTK-by-parts rope is its llama3 rotary
scaling, tied embeddings its `tied_embeddings`, `num_experts` its `experts.n`), and TL's default for a model without
it where probe has no such feature (quantisation, several devices, encoder-decoder models).
tests/test_tl_config_fields.py holds every field TL 3.9 has, the list taken from TL, to HookedTransformer's values.
"""
from __future__ import annotations

from typing import Optional

import torch

from probe.config_choices import Norm, NormPlacement, Positions, RotaryScaling


class HookedTransformerConfigFields:
    """Properties only: the fields they read (norm, rotary_scaling, ...) are DecoderConfig's."""

    norm: Norm
    norm_placement: NormPlacement
    rotary_scaling: Optional[RotaryScaling]
    rotary_base: float
    sliding_rotary_base: Optional[float]
    tied_embeddings: bool
    checkpoint_value: Optional[int]
    n_layers: int
    d_head: int
    sliding_window: Optional[int]
    logit_softcap: Optional[float]
    attn_softcap: Optional[float]
    attn_scale_dim: Optional[float]
    qk_norm: bool
    init_std: float
    attn_scale_by_layer: bool

    # ---- what probe builds, under TL's names ----------------------------------------------------------------
    @property
    def act_fn(self) -> str:
        return self.act_fn_name or self.activation.value

    @property
    def normalization_type(self) -> Optional[str]:  # None: no norms, as TL says
        if self.norm is Norm.NONE:
            return None
        return ("LN" if self.norm is Norm.LAYER else "RMS") + ("" if self.norm_weights else "Pre")

    @property
    def positional_embedding_type(self) -> str:
        return {Positions.LEARNED: "standard", Positions.SINUSOIDAL: "sinusoidal", Positions.ROTARY: "rotary",
                Positions.SHORTFORMER: "shortformer", Positions.ALIBI: "alibi"}[self.positions]

    @property
    def post_embedding_ln(self) -> bool:  # (TL's is a learned LayerNorm: NanoChat's weightless RMSNorm is not one)
        return self.embed_norm is True

    @property
    def use_attention_sinks(self) -> bool:
        return self.attn_sinks

    @property
    def n_key_value_heads(self) -> Optional[int]:
        return None if self.n_kv_heads == self.n_heads else self.n_kv_heads  # TL: None for plain multi-head

    @property
    def parallel_attn_mlp(self) -> bool:
        return self.norm_placement is NormPlacement.PARALLEL

    @property
    def final_rms(self) -> bool:
        return self.final_norm and self.norm not in (Norm.LAYER, Norm.NONE) and self.norm_weights  # TL: an RMSNorm with weights

    @property
    def attention_dir(self) -> str:
        return "bidirectional" if self.bidirectional else "causal"

    @property
    def tokenizer_name(self) -> Optional[str]:
        if self.tokenizer_source is not None:
            return self.tokenizer_source
        # a loaded checkpoint's own tokenizer.json is what probe reads; TL's "custom" names a model built from a
        # config, which has no tokenizer unless the config names one
        return None if self.model_name == "custom" else self.model_name

    @property
    def n_params(self) -> int:
        """Weights in the attention and MLP sublayers (transformer-lens's count: no embeddings, norms or biases)."""
        dense = 0 if self.attn_only else self.d_model * self.d_mlp * (3 if self.gated_mlp else 2)
        # TL counts every expert and the router's weights (a shared expert, which TL has none of, is left out)
        sparse = 0 if self.experts is None else (3 * self.d_model * self.expert_width + self.d_model) * self.experts.n
        per_layer = sum(self.d_model * self.d_head * (2 * self.layer_heads(l) + 2 * self.layer_kv_heads(l))
                        + (sparse if self.layer_sparse(l) else dense) for l in range(self.n_layers))
        return per_layer

    @property
    def use_local_attn(self) -> bool:
        return self.sliding_window is not None

    @property
    def window_size(self) -> Optional[int]:
        return self.sliding_window

    @property
    def attn_types(self) -> Optional[list[str]]:  # each layer's: "local" (windowed) or "global"; None without a window
        if self.sliding_window is None:
            return None
        return ["local" if self.layer_window(layer) is not None else "global" for layer in range(self.n_layers)]

    @property
    def output_logits_soft_cap(self) -> float:
        return -1.0 if self.logit_softcap is None else float(self.logit_softcap)  # TL: -1 for no cap

    @property
    def attn_scores_soft_cap(self) -> float:
        return -1.0 if self.attn_softcap is None else float(self.attn_softcap)

    @property
    def use_normalization_before_and_after(self) -> bool:
        return self.norm_placement is NormPlacement.SANDWICH

    @property
    def use_qk_norm(self) -> bool:
        return self.qk_norm

    @property
    def use_attn_scale(self) -> bool:  # TL's use_attn_scale=False (GPT-Neo) is a divisor of 1
        return self.attn_scale_dim != 1.0

    @property
    def attn_scale(self) -> float:  # what q.k is divided by
        return float(self.d_head if self.attn_scale_dim is None else self.attn_scale_dim) ** 0.5

    @property
    def initializer_range(self) -> float:
        return self.init_std

    @property
    def scale_attn_by_inverse_layer_idx(self) -> bool:
        return self.attn_scale_by_layer

    @property
    def uses_rms_norm(self) -> bool:
        # TL 4's bridge sets it for RMSNorm models; a HookedTransformer never sets it (its normalization_type says it)
        return self.norm in (Norm.RMS, Norm.RMS_FLOAT32)

    @property
    def tie_word_embeddings(self) -> bool:
        return self.tied_embeddings

    @property
    def use_NTK_by_parts_rope(self) -> bool:  # noqa: N802: TL's name
        return self._llama3 is not None

    @property
    def NTK_by_parts_factor(self) -> float:  # noqa: N802
        return 8.0 if self._llama3 is None else float(self._llama3.factor)

    @property
    def NTK_by_parts_low_freq_factor(self) -> float:  # noqa: N802
        return 1.0 if self._llama3 is None else float(self._llama3.low_freq_factor)

    @property
    def NTK_by_parts_high_freq_factor(self) -> float:  # noqa: N802
        return 4.0 if self._llama3 is None else float(self._llama3.high_freq_factor)

    @property
    def NTK_original_ctx_len(self) -> int:  # noqa: N802
        return 8192 if self._llama3 is None else self._llama3.original_n_ctx

    @property
    def rotary_base_local(self) -> Optional[float]:
        """TL's local layers' rotary base; None where they rotate as the global layers do, bar TL's linear rescaling,
        which skips them (probe's sliding_rotary_base equal to rotary_base)."""
        base = self.sliding_rotary_base
        return None if base is None or (base == self.rotary_base and self.rotary_scaling is not None) else base

    @property
    def rotary_scaling_factor(self) -> float:
        """TL's linear rope scaling (every frequency divided by it); 1.0 for none."""
        linear = self.rotary_scaling is not None and self.rotary_scaling.kind == "linear"
        return float(self.rotary_scaling.factor) if linear else 1.0

    @property
    def use_yarn_rope(self) -> bool:
        return self._yarn is not None

    @property
    def yarn_global_attn_only(self) -> bool:  # the windowed layers rotate unscaled (see sliding_rotary_base)
        return self._yarn is not None and self.sliding_rotary_base is not None

    @property
    def _yarn(self) -> Optional[RotaryScaling]:
        scaling = self.rotary_scaling
        return scaling if scaling is not None and scaling.kind == "yarn" else None

    @property
    def _llama3(self) -> Optional[RotaryScaling]:
        scaling = self.rotary_scaling
        return scaling if scaling is not None and scaling.kind == "llama3" else None

    @property
    def num_experts(self) -> Optional[int]:
        return None if self.experts is None else self.experts.n

    @property
    def experts_per_token(self) -> Optional[int]:
        return None if self.experts is None else self.experts.per_token

    @property
    def norm_topk_prob(self) -> bool:
        return self.experts is not None and self.experts.renormalize

    # ---- where the model came from ---------------------------------------------------------------------------
    @property
    def from_checkpoint(self) -> bool:
        """Whether from_pretrained loaded a training checkpoint (`checkpoint_value=`, Pythia's or Stanford CRFM's)."""
        return self.checkpoint_value is not None

    @property
    def checkpoint_label_type(self) -> Optional[str]:
        return "step" if self.from_checkpoint else None  # Pythia's and Stanford CRFM's are labelled by step

    @property
    def init_mode(self) -> str:
        return "gpt2"  # probe initialises every model as GPT-2 does: a normal draw of std initializer_range

    @property
    def layer_norm_folding(self) -> bool:
        return False  # TL 4's switch for its bridge's norm forward; a folded model's normalization_type says "LNPre"

    @property
    def n_devices(self) -> int:
        return 1  # device_map= places blocks itself; TL's pipeline split over n_devices is not how probe does it

    # ---- TL's config methods ----------------------------------------------------------------------------------
    def is_layer_norm_activation(self) -> bool:
        """Whether the MLP normalises its activations (SoLU-LN: act_fn "solu_ln")."""
        return self.act_fn.endswith("_ln")

    def set_seed_everywhere(self, seed: int) -> None:
        """torch's, numpy's and Python's generators seeded with `seed`, as TL's config seeds them."""
        import random

        import numpy

        torch.manual_seed(seed)
        random.seed(seed)
        numpy.random.seed(seed)


# TL 3.9's fields for features probe does not build (quantisation, remote code, T5's relative
# attention): the value a HookedTransformer without them reads, which `model.cfg` reads too and `HookedTransformerConfig(...)` takes them at (probe/tl_config.py)
ABSENT_FEATURES = {
    "use_logn_attn": False, "train_seq_length": None,
    "use_dynamic_ntk_rope": False,
    "trust_remote_code": False, "load_in_4bit": False, "quantization_method": None,
    "relative_attention_max_distance": None, "relative_attention_num_buckets": None, "decoder_start_token_id": None,
}
# TL's YaRN settings: the "yarn" rotary scaling's fields, or TL's defaults for a model without one
YARN_FIELDS = {"yarn_factor": ("factor", 1.0), "yarn_attention_factor": ("attention_factor", 1.0),
               "yarn_beta_fast": ("beta_fast", 32.0), "yarn_beta_slow": ("beta_slow", 1.0),
               "yarn_original_max_position_embeddings": ("original_n_ctx", 4096), "yarn_truncate": ("truncate", True)}
for _name, (_field, _default) in YARN_FIELDS.items():
    setattr(HookedTransformerConfigFields, _name,
            property(lambda self, field=_field, default=_default: default if self._yarn is None
                     else getattr(self._yarn, field)))
for _name, _value in ABSENT_FEATURES.items():
    setattr(HookedTransformerConfigFields, _name, property(lambda self, value=_value: value))
