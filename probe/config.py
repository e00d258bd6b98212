"""DecoderConfig: the frozen, validated description of a decoder's shape and components.

Every architectural choice is a typed field; the model picks small components from it at
construction time, so the forward pass itself has no architecture branches.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Optional

from probe.config_choices import (ACTIVATION_SPELLINGS, Activation, ExpertGroups, Experts, Norm, NormPlacement, Positions,
                                  RotaryScaling)
from probe.config_mixers import LatentAttention, LinearAttention, ShortConv, SparseIndexer, StateSpace
from probe.config_mixers import parallel_state_space_of
from probe.config_rg_lru import RGLRU
from probe.config_shared_block import SharedBlocks
from probe.config_rwkv import Rwkv
from probe.config_chunked import ChunkedAttention
from probe.config_gate import OutputGate
from probe.config_moa import MixtureOfAttention
from probe.config_head import PredictionHead
from probe.config_layers import LayerFacts
from probe.config_layer_shapes import GlobalLayers, PerLayerInputs, SharedKV, check_layer_shapes
from probe.config_assignment import SWITCHES, assign, state_without_owner
from probe.config_rotary import check_rotary
from probe.tl_config_fields import HookedTransformerConfigFields

# the choices live in probe.config_choices and probe.config_mixers and are imported from here as before
__all__ = ["Activation", "DecoderConfig", "ExpertGroups", "Experts", "LatentAttention", "LinearAttention", "Norm", "NormPlacement",
           "Positions", "RotaryScaling", "ChunkedAttention", "GlobalLayers", "PerLayerInputs", "SharedKV", "SharedBlocks", "ShortConv",
           "SparseIndexer", "StateSpace", "OutputGate"]


def _enum(cls, value, field):
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        valid = ", ".join(repr(v.value) for v in cls)
        raise ValueError(f"{field}={value!r} is not supported; choose one of: {valid}") from None


@dataclass(frozen=True, kw_only=True)
# the mixins: TL's fields beyond the ones below (tl_config_fields), each layer's heads, window, mixer, MLP (config_layers)
class DecoderConfig(HookedTransformerConfigFields, LayerFacts):
    n_layers: int
    d_model: int
    n_heads: int
    d_vocab: int
    n_ctx: int  # the longest sequence (learned positions need a row per position)
    d_vocab_out: Optional[int] = None  # the logits' size; None: d_vocab (a toy model may predict fewer tokens than it reads)
    d_head: Optional[int] = None  # None: d_model // n_heads
    d_mlp: Optional[int] = None  # None: 4 * d_model
    n_kv_heads: Optional[int] = None  # None: n_heads (multi-head); fewer: grouped-query; 1: multi-query
    heads_per_layer: Optional[tuple[int, ...]] = None  # after structural pruning: each layer's remaining heads
    eps: float = 1e-5  # norm epsilon
    final_eps: Optional[float] = None  # the final norm's, where it differs (JetMoE's); None: eps
    activation: Activation = Activation.GELU_TANH  # SOLU_LN: SoLU, then a LayerNorm over d_mlp inside the MLP (mlp.ln)
    gated_mlp: bool = False  # act(gate(x)) * up(x) -> down: SwiGLU with SILU (not with SOLU_LN)
    experts: Optional[Experts] = None  # gated MLPs in place of each MLP (Mixtral), or some (.layers); a dict is converted
    norm: Norm = Norm.LAYER
    norm_placement: NormPlacement = NormPlacement.PRE
    attn_only: bool = False  # blocks without an MLP: y = x + attn(ln1(x)) (toy models; pre-norm only)
    bidirectional: bool = False  # every query sees every (real) key, later ones too: an encoder or classifier toy model
    use_hook_tokens: bool = False  # a hook_tokens point on the token ids [batch pos] entering the model (TL's switch)
    # False: ln1, ln2 and ln_final learn no w (and b), as transformer-lens's LNPre / RMSPre and what fold_ln leaves;
    # a sandwich block's post norms and the q/k norms keep theirs
    norm_weights: bool = True
    final_norm: bool = True
    positions: Positions = Positions.LEARNED
    embed_norm: bool | Norm = False  # a norm after the embedding: True a learned LayerNorm (Bloom), a Norm a weightless one (NanoChat)
    rotary_base: float = 10000.0
    rotary_dim: Optional[int] = None  # None: d_head; fewer: only each head's first rotary_dim dimensions rotate (Pythia: d_head / 4)
    rotary_scaling: Optional[RotaryScaling] = None  # long-context frequency rescaling (Llama 3.1+); a dict is converted
    # True: dimension 2i rotates with 2i + 1 (GPT-J; TL's name); False: i with i + rotary_dim / 2 (Llama, GPT-NeoX)
    rotary_adjacent_pairs: bool = False
    rotary_clockwise: bool = False  # each pair turns by -angle (NanoChat's rotate_half: Llama's sines negated)
    rotary_layers: Optional[tuple[bool, ...]] = None  # which layers rotate q and k (SmolLM3: three in four); None: all
    # the windowed layers' own rotary base, with no rotary_scaling (Gemma 3's local layers; TL's rotary_base_local,
    # whose linear rescaling skips the local layers); None: every layer rotates by rotary_base and rotary_scaling
    sliding_rotary_base: Optional[float] = None
    sliding_rotary_dim: Optional[int] = None  # the windowed layers' own rotary_dim (Laguna's rotate whole heads); None: rotary_dim
    sliding_window: Optional[int] = None  # each query sees at most this many keys, itself included (Mistral); None: all earlier ones
    sliding_layers: Optional[tuple[bool, ...]] = None  # which layers use sliding_window (Gemma 2: every other); None: all
    attn_scale_dim: Optional[float] = None  # q.k is divided by sqrt(attn_scale_dim); None: d_head (Gemma 2: query_pre_attn_scalar)
    # layer l's q.k also divided by l + 1 (GPT-2's scale_attn_by_inverse_layer_idx: Stanford CRFM's GPT-2 runs)
    attn_scale_by_layer: bool = False
    attn_softcap: Optional[float] = None  # scores -> cap * tanh(scores / cap) before the mask (Gemma 2: 50)
    # each head's softmax has one more logit, learned, that no value follows: a head can attend to nothing, and its
    # pattern's rows sum to less than 1 (GPT-OSS; transformer-lens's use_attention_sinks, attn.sinks)
    attn_sinks: bool = False
    # each head's z times sigmoid(x W_gate) before W_O: the gate's weights are the query projection's second half
    # (Qwen3.5, Qwen3-Next's gated attention, Qiu et al. 2025)
    attn_output_gate: bool = False
    output_gate: Optional[OutputGate] = None  # how that gate acts (Laguna's softplus, per head); None: a sigmoid per channel
    # Gated DeltaNet layers in place of attention in some layers (Qwen3.5, Qwen3-Next); a dict is converted
    linear_attention: Optional[LinearAttention] = None
    # multi-head latent attention in every layer (DeepSeek-V2/V3): d_head is the values' width; a dict is converted
    latent_attention: Optional[LatentAttention] = None
    # Mamba-2 state-space layers in place of attention in some layers (Granite 4.0-H); a dict is converted
    state_space: Optional[StateSpace] = None
    parallel_state_space: Optional[StateSpace] = None  # Mamba-2 mixers beside attention, writes summed (Falcon-H1)
    sublayers: Optional[tuple[str, ...]] = None  # each layer's one sublayer, "mixer"/"attn"/"mlp" (NemotronH); None: both
    short_conv: Optional[ShortConv] = None  # LFM2's gated short convolutions in place of attention in some layers
    mixture_of_attention: Optional[MixtureOfAttention] = None  # JetMoE's routed attention experts in every layer
    rg_lru: Optional[RGLRU] = None  # Griffin's recurrent blocks in place of attention in some layers (RecurrentGemma)
    shared_blocks: Optional[SharedBlocks] = None  # Zamba2's transformer blocks shared by layers, before their mixers
    chunked_attention: Optional[ChunkedAttention] = None  # Llama 4's chunked rope layers, q/k norm, NoPE temperature
    rwkv: Optional[Rwkv] = None  # RWKV-4: every layer a time mix and a channel mix (probe.rwkv); a dict is converted
    # Gemma 4: full-attention layers' own head shape, later layers reusing earlier ones' keys and values, a per-layer
    # embedding of each token, values RMS-normalised per head, and each block's output times a learned scalar
    global_layers: Optional[GlobalLayers] = None
    shared_kv: Optional[SharedKV] = None
    per_layer_inputs: Optional[PerLayerInputs] = None
    value_norm: bool = False
    sub_norms: bool = False  # an RMSNorm before each output projection: all heads' z before W_O, d_mlp before W_out (BitNet)
    layer_scalars: bool = False
    clip_qkv: Optional[float] = None  # q, k and v clamped to [-clip, clip] after their norms (OLMo-7B-0424, OLMoE, MPT)
    logit_softcap: Optional[float] = None  # logits -> cap * tanh(logits / cap) (Gemma 2: 30)
    scale_embed: bool = False  # token embeddings times sqrt(d_model) (Gemma)
    qk_norm: bool = False  # each head's q and k normalised over d_head (the model's norm kind) before rotary (Qwen3)
    qk_norm_over_heads: bool = False  # with qk_norm: q and k normalised over all heads together (OLMo 2)
    qk_norm_after_rope: bool = False  # with qk_norm: q and k normalised after rotary, not before (HunYuan; TL 4's name)
    # False: a sandwich block's sublayers read the residual itself and only their writes are normalised (OLMo 2);
    # ln1 and ln2 are then identities (their scale 1, as a model without norms has)
    input_norms: bool = True
    qkv_bias: bool = True
    out_bias: bool = True  # attention output projection bias
    mlp_bias: bool = True
    tied_embeddings: bool = True  # unembedding = embedding transposed, as in GPT-2
    unembed_bias: bool = False  # a bias on the logits (none of the supported checkpoints; a processed model's folded norm bias)
    prediction_head: Optional[PredictionHead] = None  # dense, act, LayerNorm between ln_final and W_U (ModernBERT); a dict is converted
    first_ln1: bool = True  # False: layer 0's attention reads the residual itself, its ln1 an identity (ModernBERT)
    init_std: float = 0.02  # weight init for models trained from scratch
    # Which loaded model this describes, not its architecture: kept off comparisons and (but for TL's switches) off
    # to_dict. The model sets them (transformer-lens code reads model.cfg.device and model.cfg.model_name).
    model_name: Optional[str] = dataclasses.field(default=None, compare=False)
    original_architecture: Optional[str] = dataclasses.field(default=None, compare=False)  # config.json's, "GPT2LMHeadModel"
    # a tokenizer (directory, short name or hub repository) that a model built from this config without one loads,
    # as TL's HookedTransformer(cfg) loads cfg.tokenizer_name's; None for a loaded checkpoint, which has its own
    tokenizer_source: Optional[str] = dataclasses.field(default=None, compare=False)
    device: str = dataclasses.field(default="cpu", compare=False)
    dtype: Any = dataclasses.field(default=None, compare=False)  # the weights' torch.dtype
    default_prepend_bos: bool = dataclasses.field(default=True, compare=False)
    # transformer-lens's use_* switches as the model's set_use_* last set them (code reads model.cfg.use_attn_result)
    use_attn_result: bool = dataclasses.field(default=False, compare=False)
    use_split_qkv_input: bool = dataclasses.field(default=False, compare=False)
    use_attn_in: bool = dataclasses.field(default=False, compare=False)
    use_hook_mlp_in: bool = dataclasses.field(default=False, compare=False)
    # TL's switch to compute (and hook) keys and values once per query head on a grouped-query model
    ungroup_grouped_query_attention: bool = dataclasses.field(default=False, compare=False)
    # what transformer-lens records of how the model was built or loaded, read back as TL code reads it
    seed: Optional[int] = dataclasses.field(default=None, compare=False)  # HookedTransformerConfig(seed=)'s
    # HookedTransformerConfig's models draw their initial weights as HookedTransformer does (its "gpt2" init_mode): the
    # same weights under one seed, and torch's generator left where TL leaves it for the draws that follow
    transformer_lens_init: bool = dataclasses.field(default=False, compare=False)
    # HookedTransformerConfig(init_weights=False)'s: the model draws nothing (torch's generator stays where it was, as
    # TL's does), its weights zeros and its norms' ones until a state dict is loaded
    init_weights: bool = dataclasses.field(default=True, compare=False)
    # TL's name for the activation where it has several for one function ("gelu_fast", "gelu_pytorch_tanh": the
    # tanh GELU); None: the activation's own name. model.cfg.act_fn reads it
    act_fn_name: Optional[str] = dataclasses.field(default=None, compare=False)
    # whether the model's tokenizer, called on text, puts a token first by itself (a Llama tokenizer.json does,
    # GPT-2's does not); None without a tokenizer. The model sets it, as TL's set_tokenizer does
    tokenizer_prepends_bos: Optional[bool] = dataclasses.field(default=None, compare=False)
    # from_pretrained(checkpoint_value=step): the training step loaded and its index among TL's list of them
    checkpoint_value: Optional[int] = dataclasses.field(default=None, compare=False)
    checkpoint_index: Optional[int] = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        def positive(field):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")

        for field in ("n_layers", "d_model", "n_heads", "d_vocab", "n_ctx"):
            positive(field)
        if self.d_head is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "change one of them or set d_head explicitly"
                )
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        if self.d_mlp is None:
            object.__setattr__(self, "d_mlp", 4 * self.d_model)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.d_vocab_out is None:
            object.__setattr__(self, "d_vocab_out", self.d_vocab)
        for field in ("d_head", "d_mlp", "n_kv_heads", "d_vocab_out"):
            positive(field)
        if self.tied_embeddings and self.d_vocab_out != self.d_vocab:
            raise ValueError(f"tied embeddings share one [vocab d_model] table, so d_vocab_out={self.d_vocab_out} must "
                             f"equal d_vocab={self.d_vocab}; set tied_embeddings=False")
        if self.sliding_window is not None:
            positive("sliding_window")
        if self.sliding_layers is not None:
            layers = tuple(self.sliding_layers)
            if self.sliding_window is None or len(layers) != self.n_layers or not all(isinstance(x, bool) for x in layers):
                raise ValueError(f"sliding_layers={self.sliding_layers!r} must give each of the n_layers={self.n_layers} "
                                 f"layers True (windowed) or False, with sliding_window set (got {self.sliding_window!r})")
            # one spelling per model, so configs compare equal after a round trip: every layer windowed is what
            # None says, and no layer windowed is no window
            object.__setattr__(self, "sliding_layers", None if all(layers) or not any(layers) else layers)
            if not any(layers):
                object.__setattr__(self, "sliding_window", None)
        for field in ("attn_scale_dim", "attn_softcap", "logit_softcap", "clip_qkv"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"{field} must be a positive number or None, got {value!r}")
        if self.attn_scale_dim == self.d_head:  # the default, spelled one way
            object.__setattr__(self, "attn_scale_dim", None)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}; "
                "each key/value head must serve the same number of query heads"
            )
        if self.heads_per_layer is not None:
            heads = tuple(self.heads_per_layer)
            if len(heads) != self.n_layers or not all(isinstance(h, int) and 0 <= h <= self.n_heads for h in heads):
                raise ValueError(
                    f"heads_per_layer={self.heads_per_layer!r} must give each of the n_layers={self.n_layers} layers "
                    f"a head count between 0 and n_heads={self.n_heads}"
                )
            if self.n_kv_heads != self.n_heads and any(h % self.n_kv_heads for h in heads):  # (Laguna's layers)
                raise ValueError(f"heads_per_layer={heads!r} with n_kv_heads={self.n_kv_heads} keys and values per layer: "
                                 "each layer's heads must be a multiple of them (or n_kv_heads == n_heads: pruned heads)")
            object.__setattr__(self, "heads_per_layer", heads)
        object.__setattr__(self, "activation", _enum(Activation, self.activation, "activation"))
        if self.act_fn_name is not None and ACTIVATION_SPELLINGS.get(self.act_fn_name) is not self.activation:
            names = sorted(n for n, a in ACTIVATION_SPELLINGS.items() if a is self.activation)
            raise ValueError(f"act_fn_name={self.act_fn_name!r} does not name activation={self.activation.value!r}; "
                             f"its names are {names}: use one, or leave act_fn_name None")
        if self.gated_mlp and self.activation.normed:
            raise ValueError(f"activation={self.activation.value!r} normalises a plain MLP's activations before W_out; "
                             "a gated MLP with it is not built: set gated_mlp=False, or activation='solu' (no norm)")
        if isinstance(self.experts, dict):
            object.__setattr__(self, "experts", Experts(**self.experts))
        if self.experts is not None and not (isinstance(self.experts, Experts) and self.gated_mlp == self.experts.gated
                                             and not self.attn_only):
            raise ValueError(f"experts={self.experts!r}: a mixture of experts is an Experts (or its fields as a dict) "
                             "of gated MLPs in place of the MLP: set gated_mlp=True (and attn_only=False); ungated "
                             "experts (Experts(gated=False)) go with gated_mlp=False")
        if self.experts is not None and self.activation.learned:
            raise ValueError(f"activation={self.activation.value!r} learns parameters per MLP, which probe's experts do "
                             "not hold (they share one activation): use another activation with experts")
        if self.experts is not None and self.experts.layers is not None and len(self.experts.layers) != self.n_layers:
            raise ValueError(f"experts.layers={self.experts.layers!r} must give each of the n_layers={self.n_layers} "
                             "layers True (experts) or False (a dense MLP)")
        object.__setattr__(self, "norm", _enum(Norm, self.norm, "norm"))
        object.__setattr__(self, "norm_placement", _enum(NormPlacement, self.norm_placement, "norm_placement"))
        object.__setattr__(self, "positions", _enum(Positions, self.positions, "positions"))
        if isinstance(self.latent_attention, dict):
            object.__setattr__(self, "latent_attention", LatentAttention(**self.latent_attention))
        latent = self.latent_attention
        if latent is not None and not isinstance(latent, LatentAttention):
            raise ValueError(f"latent_attention must be a LatentAttention (or its fields as a dict), got {latent!r}")
        check_rotary(self)
        if (self.qk_norm_over_heads or self.qk_norm_after_rope) and not self.qk_norm:
            raise ValueError("qk_norm_over_heads and qk_norm_after_rope say how q and k are normalised: they need "
                             "qk_norm=True")
        if not self.input_norms and self.norm_placement is not NormPlacement.SANDWICH:
            raise ValueError("input_norms=False leaves a sandwich block only its write norms; it needs "
                             "norm_placement='sandwich'")
        if not isinstance(self.embed_norm, bool):  # (to_dict writes a Norm's value)
            object.__setattr__(self, "embed_norm", _enum(Norm, self.embed_norm, "embed_norm"))
        if self.embed_norm and self.scale_embed:
            raise ValueError("scale_embed with embed_norm: the LayerNorm after the embedding undoes a scale before it; "
                             "set scale_embed=False")
        if self.positions is Positions.ALIBI and self.heads_per_layer is not None:
            raise ValueError("heads_per_layer (pruned heads) with positions=alibi: each head's slope follows its index "
                             "among all n_heads, which a pruned layer no longer has; prune a model with other positions")
        for field in ("attn_only", "bidirectional", "use_hook_tokens", "attn_scale_by_layer", "rotary_adjacent_pairs",
                      "qk_norm_over_heads", "input_norms", "attn_sinks", "attn_output_gate",
                      "qk_norm_after_rope", "first_ln1", "sub_norms"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} must be a bool, got {getattr(self, field)!r}")
        if self.bidirectional and self.sliding_window is not None:
            raise ValueError("a sliding window counts keys back from each query, which bidirectional attention does "
                             "not have: set sliding_window=None or bidirectional=False")
        if isinstance(self.linear_attention, dict):
            object.__setattr__(self, "linear_attention", LinearAttention(**self.linear_attention))
        if self.linear_attention is not None:
            linear = self.linear_attention
            if not isinstance(linear, LinearAttention) or len(linear.layers) != self.n_layers:
                raise ValueError(f"linear_attention={linear!r} must be a LinearAttention (or its fields as a dict) "
                                 f"whose layers give each of the n_layers={self.n_layers} layers True or False")
            # (the linear layers' blocks are pre-norm whatever the attention layers' are: OLMo-Hybrid's are sandwiches)
            if (self.norm_placement not in (NormPlacement.PRE, NormPlacement.SANDWICH) or self.attn_only
                    or self.bidirectional or self.heads_per_layer is not None):
                raise ValueError("linear-attention layers are built in causal pre-norm blocks with an MLP and every "
                                 "head: set norm_placement='pre' (or 'sandwich', for the attention layers alone), "
                                 "attn_only=False, bidirectional=False, heads_per_layer=None")
        if latent is not None:
            latent.check(self)
        if isinstance(self.state_space, dict):
            object.__setattr__(self, "state_space", StateSpace(**self.state_space))
        if self.state_space is not None:
            if not isinstance(self.state_space, StateSpace):
                raise ValueError(f"state_space must be a StateSpace (or its fields as a dict), got {self.state_space!r}")
            self.state_space.check(self)
        self.check_sublayers()
        check_layer_shapes(self)
        object.__setattr__(self, "short_conv", ShortConv.of(self.short_conv, self))  # (a dict converted; checked)
        object.__setattr__(self, "rg_lru", RGLRU.of(self.rg_lru, self))
        object.__setattr__(self, "parallel_state_space", parallel_state_space_of(self.parallel_state_space, self))
        object.__setattr__(self, "shared_blocks", SharedBlocks.of(self.shared_blocks, self))  # (a dict converted)
        object.__setattr__(self, "chunked_attention", ChunkedAttention.of(self.chunked_attention, self))
        object.__setattr__(self, "rwkv", Rwkv.of(self.rwkv, self))  # (a dict converted; checked)
        object.__setattr__(self, "output_gate", OutputGate.of(self.output_gate, self))
        object.__setattr__(self, "mixture_of_attention", MixtureOfAttention.of(self.mixture_of_attention, self))
        object.__setattr__(self, "prediction_head", PredictionHead.of(self.prediction_head))
        if self.attn_only and self.norm_placement is not NormPlacement.PRE:
            raise ValueError(f"attn_only blocks are pre-norm, x + attn(ln1(x)); got norm_placement="
                             f"{self.norm_placement.value!r}: use norm_placement='pre'")
        for name in ("eps", "final_eps") if self.final_eps is not None else ("eps",):
            if not (isinstance(getattr(self, name), (int, float)) and 0 < getattr(self, name) < 1):
                raise ValueError(f"{name} must be a small positive float, got {getattr(self, name)!r}")
    # ---- facts derived from the fields (transformer-lens's names for them: tl_config_fields) -----------
    @property
    def mlp_norm_learned(self) -> bool:
        """Whether a SoLU-LN MLP's LayerNorm over d_mlp (mlp.ln) learns w and b: beside learned LayerNorms only, as
        transformer-lens builds it (a LayerNorm with normalization_type "LN", an LNPre otherwise); never in an
        attention-only model, whose config may still name "solu_ln" (Neel Nanda's attn-only checkpoints do)."""
        return self.activation.normed and self.norm is Norm.LAYER and self.norm_weights and not self.attn_only

    @property
    def positions_in_residual(self) -> bool:
        """Whether a position embedding is added to the residual stream (learned, sinusoidal): rotary positions act
        inside attention, and shortformer ones join only each layer's queries' and keys' inputs."""
        return self.positions in (Positions.LEARNED, Positions.SINUSOIDAL)

    def to_dict(self) -> dict[str, Any]:
        """The architecture's fields and transformer-lens's use_* switches, whose presence TL code tests (ACDC turns
        hook_mlp_in on only where `"use_hook_mlp_in" in model.cfg.to_dict()`), plus what TL code reads by TL's names
        (`TL_READ`: circuit-tracer 0.5 builds its graph's config from them), which `from_dict` passes over."""
        instance = {f.name for f in dataclasses.fields(self) if not f.compare} - set(SWITCHES)
        out = {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in dataclasses.asdict(self).items() if k not in instance}
        for field in TUPLE_FIELDS:
            if out[field] is not None:
                out[field] = list(out[field])
        dtype = "float32" if self.dtype is None else str(self.dtype).removeprefix("torch.")  # a name: the dict stays JSON
        return {**out, **{name: getattr(self, name) for name in TL_READ if name != "dtype"}, "dtype": dtype}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DecoderConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in values.items() if k not in TL_READ}  # to_dict's readings, not settings
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown DecoderConfig fields: {', '.join(unknown)}; valid fields: {', '.join(sorted(known))}")
        values = dict(values)
        for field in TUPLE_FIELDS:
            if values.get(field) is not None:
                values[field] = tuple(values[field])
        return cls(**values)


# per-layer fields: lists in to_dict()'s JSON, tuples in the config
TUPLE_FIELDS = ("heads_per_layer", "sliding_layers", "rotary_layers", "sublayers")
# what to_dict() also lists under transformer-lens's names, for TL code that reads a config's dict by them
TL_READ = ("n_key_value_heads", "tokenizer_name", "model_name", "original_architecture", "dtype")

DecoderConfig.__setattr__ = assign  # the generated __init__ sets fields through object.__setattr__
DecoderConfig.__getstate__ = state_without_owner
