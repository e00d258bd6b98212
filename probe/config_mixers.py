"""The token mixers a config may put in place of (or beside) softmax attention's q/k/v projections: Gated DeltaNet
linear attention (LinearAttention), multi-head latent attention (LatentAttention), Mamba-2 state-space mixers
(StateSpace) and LFM2's gated short convolutions (ShortConv); each frozen and validated, as config_choices' choices."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet token mixers in place of attention in some layers (Qwen3.5, Qwen3-Next; Yang et al. 2024,
    "Gated Delta Networks"): each value head keeps a [d_key_head d_value_head] state that decays at every position and
    is corrected toward the new value along the new key (the delta rule); the queries read it. `layers` says which
    layers have one (the others keep attention). `key_heads` query/key heads of `d_key_head` serve `value_heads` value
    heads of `d_value_head`, each the value_heads // key_heads adjacent ones; q, k and v first pass a causal depthwise
    convolution over `conv_kernel` positions. `beta_scale` multiplies the write strength sigmoid(logit): 2 lets the
    delta rule overshoot, beta in (0, 2), so the state's transition may have negative eigenvalues (OLMo-Hybrid's
    allow_neg_eigval). `norm_eps`: the gated output norm's own eps (OLMo-Hybrid fixes it at FLA's 1e-5); None, the
    model's eps (Qwen3.5's)."""

    layers: tuple[bool, ...]
    key_heads: int
    value_heads: int
    d_key_head: int
    d_value_head: int
    conv_kernel: int = 4
    beta_scale: float = 1.0
    norm_eps: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("key_heads", "value_heads", "d_key_head", "d_value_head", "conv_kernel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LinearAttention.{name} must be a positive int, got {value!r}")
        if isinstance(self.beta_scale, bool) or not isinstance(self.beta_scale, (int, float)) or self.beta_scale <= 0:
            raise ValueError(f"LinearAttention.beta_scale must be a positive number (1: beta in (0, 1); 2: in (0, 2)), "
                             f"got {self.beta_scale!r}")
        if self.norm_eps is not None and not (isinstance(self.norm_eps, (int, float)) and 0 < self.norm_eps < 1):
            raise ValueError(f"LinearAttention.norm_eps must be a small positive float or None (the model's eps), got "
                             f"{self.norm_eps!r}")
        if self.value_heads % self.key_heads:
            raise ValueError(f"LinearAttention(value_heads={self.value_heads}) must be a multiple of key_heads="
                             f"{self.key_heads}: each query/key head serves the same number of value heads")
        layers = tuple(self.layers)
        if not all(isinstance(x, bool) for x in layers) or not any(layers):
            raise ValueError(f"LinearAttention.layers={self.layers!r} must say for each layer True (a linear-attention "
                             "layer) or False (attention), with at least one True (else leave linear_attention None)")
        object.__setattr__(self, "layers", layers)


@dataclass(frozen=True)
class SparseIndexer:
    """DeepSeek Sparse Attention's indexer beside latent attention (GLM-5; DeepSeek-AI 2025, "DeepSeek-V3.2"): each
    query's heads read only the `topk` earlier keys an indexer scores highest (every key while there are no more than
    `topk`). The indexer has `n_heads` heads of `d_head` dimensions: queries from the attention's query latent, one key
    per position from the residual (LayerNorm-ed), the first d_rope dimensions of both rotated as the attention's; a
    key's score is the sum over heads of relu(q . k / sqrt(d_head)) weighted by the head's weight for the query
    (projected from the residual). `shared`: for each layer, True where it runs no indexer of its own and reads the
    keys the nearest earlier layer with one chose (GLM's indexer_types "shared"); empty: every layer has its own."""

    n_heads: int
    d_head: int
    topk: int
    shared: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        for name in ("n_heads", "d_head", "topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SparseIndexer.{name} must be a positive int, got {value!r}")
        shared = tuple(self.shared)
        if not all(isinstance(x, bool) for x in shared) or shared[:1] == (True,):
            raise ValueError(f"SparseIndexer.shared={self.shared!r} must say for each layer True (it reuses an earlier "
                             "layer's choice of keys) or False (it runs its own indexer), the first layer False")
        object.__setattr__(self, "shared", shared)

    def layer_shared(self, layer: int) -> bool:
        """Whether `layer` reads an earlier layer's choice of keys instead of running an indexer."""
        return bool(self.shared) and self.shared[layer]


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024) in place of q/k/v projections: keys and values are
    read from one normalised latent of `kv_rank` per position (shared by every head), queries from one of `q_rank` (None:
    straight from the residual). Each head's query and key are `d_nope` dimensions without positions followed by
    `d_rope` rotated ones; the key's rotated part is one for every head, projected from the residual beside the latent.
    The values are cfg.d_head wide per head (what W_O reads). `deinterleaved`: the rotated pairs, adjacent ones (2i,
    2i + 1), are written back evens first, then odds (DeepSeek-V3's rope_interleave; the scores are those of the
    pairs in place). `mscale`: the scores are also multiplied by its square (YaRN's mscale_all_dim on a long-context
    checkpoint; 1 otherwise). The latents' norms have `latent_eps` (transformers builds them with 1e-6 whatever the
    model's). `indexer`: each query reads only the keys a SparseIndexer chooses (GLM-5's; a dict is converted); None:
    every earlier key."""

    kv_rank: int
    d_nope: int
    d_rope: int
    q_rank: Optional[int] = None
    deinterleaved: bool = False
    mscale: float = 1.0
    latent_eps: float = 1e-6
    indexer: Optional[SparseIndexer] = None

    def __post_init__(self) -> None:
        if isinstance(self.indexer, dict):
            object.__setattr__(self, "indexer", SparseIndexer(**self.indexer))
        if self.indexer is not None and not isinstance(self.indexer, SparseIndexer):
            raise ValueError(f"LatentAttention.indexer must be a SparseIndexer (or its fields as a dict) or None, got "
                             f"{self.indexer!r}")
        for name in ("kv_rank", "d_nope", "d_rope", "q_rank"):
            value = getattr(self, name)
            if (value is not None or name != "q_rank") and (not isinstance(value, int) or isinstance(value, bool)
                                                           or value <= 0):
                raise ValueError(f"LatentAttention.{name} must be a positive int{' or None' * (name == 'q_rank')}, "
                                 f"got {value!r}")
        if self.d_rope % 2:
            raise ValueError(f"LatentAttention.d_rope={self.d_rope} rotates pairs of dimensions: make it even")
        if not isinstance(self.deinterleaved, bool):
            raise ValueError(f"LatentAttention.deinterleaved must be a bool, got {self.deinterleaved!r}")
        for name in ("mscale", "latent_eps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"LatentAttention.{name} must be a positive number, got {value!r}")

    @property
    def d_qk(self) -> int:
        """Each head's query and key width."""
        return self.d_nope + self.d_rope

    def check(self, cfg) -> None:
        """Refuse what latent attention is not built with, naming the setting to change."""
        refused = {"positions": cfg.positions.value != "rotary", "n_kv_heads": cfg.n_kv_heads != cfg.n_heads,
                   "heads_per_layer": cfg.heads_per_layer is not None, "qk_norm": cfg.qk_norm,
                   "sliding_window": cfg.sliding_window is not None, "attn_softcap": cfg.attn_softcap is not None,
                   "attn_sinks": cfg.attn_sinks, "attn_output_gate": cfg.attn_output_gate,
                   "clip_qkv": cfg.clip_qkv is not None, "rotary_layers": cfg.rotary_layers is not None,
                   "linear_attention": cfg.linear_attention is not None, "bidirectional": cfg.bidirectional,
                   "norm_placement": cfg.norm_placement.value != "pre", "attn_only": cfg.attn_only,
                   "rotary_dim": cfg.rotary_dim != self.d_rope, "attn_scale_dim": cfg.attn_scale_dim is not None}
        self._check_indexer(cfg.n_layers)
        names = [name for name, bad in refused.items() if bad]
        if names:
            raise ValueError(f"latent attention is built in causal pre-norm blocks with rotary positions on d_rope="
                             f"{self.d_rope} dimensions, every head its own keys and values and none of: windows, q/k "
                             f"norms, caps, sinks, gates, clamps, NoPE layers, a scale other than d_qk's; these "
                             f"settings differ: {', '.join(names)} (set rotary_dim={self.d_rope}, n_kv_heads=n_heads, "
                             "and the others to their defaults)")

    def _check_indexer(self, n_layers: int) -> None:
        indexer = self.indexer
        if indexer is None:
            return
        if self.q_rank is None:
            raise ValueError("a sparse indexer reads its queries from the attention's query latent: give q_rank, or "
                             "leave indexer None")
        if indexer.d_head < self.d_rope:
            raise ValueError(f"the sparse indexer rotates its first d_rope={self.d_rope} dimensions: its d_head="
                             f"{indexer.d_head} must be at least that")
        if indexer.shared and len(indexer.shared) != n_layers:
            raise ValueError(f"SparseIndexer.shared gives {len(indexer.shared)} layers; the model has n_layers="
                             f"{n_layers}: give each layer True or False (or leave it empty: none shared)")


@dataclass(frozen=True)
class StateSpace:
    """Mamba-2 state-space mixers in place of attention in some layers (IBM's Granite 4.0-H; Dao and Gu 2024): `layers`
    says which (the others keep attention). `n_heads` heads of `d_head` channels each keep a [d_head d_state] state,
    written and read through B and C, which `n_groups` groups of adjacent heads share; the channels first pass a causal
    depthwise convolution over `conv_kernel` positions (with a bias where `conv_bias`); the projections in and out have
    biases where `proj_bias`; each head's step is clamped to [dt_min, dt_max] (the checkpoint's time_step_limit).

    kind "mamba1" is Mamba-1's selective scan instead (probe.selective_scan; Gu and Dao 2023): each of the d_inner
    channels is its own head (n_heads = d_inner, d_head 1, one group) with its own [d_state] decay rates and state; its
    step comes from a rank-`dt_rank` projection; FalconMamba's weightless RMS norms on dt, B and C have eps
    `bcdt_norm_eps` (None: no norms); with `bcdt_norm_weights` each of the three learns a scale (Jamba's dt_layernorm,
    b_layernorm, c_layernorm).

    `inner_norm`: Mamba-2's gated norm, "after_gate" (RMS-normalise y * silu(z)), "before_gate" (normalise y, then
    gate it: Falcon-H1's mamba_norm_before_gate) or None (y * silu(z) alone: Falcon-H1's mamba_rms_norm false).
    `out_bias`: whether out_proj has a bias where that differs from in_proj's (Falcon-H1's projectors_bias); None:
    proj_bias."""

    layers: tuple[bool, ...]
    n_heads: int
    d_head: int
    d_state: int
    n_groups: int = 1
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    dt_min: float = 0.0
    dt_max: float = float("inf")
    kind: Literal["mamba2", "mamba1"] = "mamba2"
    dt_rank: int = 0  # Mamba-1's only
    bcdt_norm_eps: Optional[float] = None  # FalconMamba's and Jamba's only
    bcdt_norm_weights: bool = False  # Jamba's only
    inner_norm: Optional[Literal["after_gate", "before_gate"]] = "after_gate"  # Mamba-2's only
    out_bias: Optional[bool] = None

    def __post_init__(self) -> None:
        self._check_kind()
        if self.inner_norm not in ("after_gate", "before_gate", None) or self.out_bias not in (None, True, False):
            raise ValueError(f"StateSpace.inner_norm={self.inner_norm!r} must be 'after_gate', 'before_gate' or None, "
                             f"and out_bias={self.out_bias!r} a bool or None")
        if self.kind == "mamba1" and (self.inner_norm != "after_gate" or self.out_bias is not None):
            raise ValueError("StateSpace(kind='mamba1') has no gated norm and one bias setting: leave inner_norm and "
                             "out_bias at their defaults")
        for name in ("n_heads", "d_head", "d_state", "n_groups", "conv_kernel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"StateSpace.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_groups:
            raise ValueError(f"StateSpace(n_heads={self.n_heads}) must be a multiple of n_groups={self.n_groups}: each "
                             "group's B and C serve the same number of heads")
        for name in ("conv_bias", "proj_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StateSpace.{name} must be a bool, got {getattr(self, name)!r}")
        if not (isinstance(self.dt_min, (int, float)) and isinstance(self.dt_max, (int, float))
                and 0 <= self.dt_min < self.dt_max):
            raise ValueError(f"StateSpace needs 0 <= dt_min < dt_max, got dt_min={self.dt_min!r}, dt_max={self.dt_max!r}")
        layers = tuple(self.layers)
        if not all(isinstance(x, bool) for x in layers) or not any(layers):
            raise ValueError(f"StateSpace.layers={self.layers!r} must say for each layer True (a state-space layer) or "
                             "False (attention), with at least one True (else leave state_space None)")
        object.__setattr__(self, "layers", layers)

    def _check_kind(self) -> None:
        if self.kind not in ("mamba2", "mamba1"):
            raise ValueError(f"StateSpace.kind={self.kind!r}: give 'mamba2' (Mamba-2's mixer) or 'mamba1' (Mamba-1's)")
        if self.kind == "mamba2":
            if self.dt_rank != 0 or self.bcdt_norm_eps is not None or self.bcdt_norm_weights is not False:
                raise ValueError(f"StateSpace(kind='mamba2') has no low-rank step nor B/C/dt norms; got dt_rank="
                                 f"{self.dt_rank!r}, bcdt_norm_eps={self.bcdt_norm_eps!r}, bcdt_norm_weights="
                                 f"{self.bcdt_norm_weights!r} (leave them 0, None and False, or set kind='mamba1')")
            return
        if not isinstance(self.dt_rank, int) or isinstance(self.dt_rank, bool) or self.dt_rank <= 0:
            raise ValueError(f"StateSpace(kind='mamba1').dt_rank must be a positive int (the step's projection rank), "
                             f"got {self.dt_rank!r}")
        if (self.d_head, self.n_groups, self.dt_min, self.dt_max) != (1, 1, 0.0, float("inf")):
            raise ValueError(f"StateSpace(kind='mamba1') has one channel per head, one group and no step limits; got "
                             f"d_head={self.d_head!r}, n_groups={self.n_groups!r}, dt_min={self.dt_min!r}, dt_max="
                             f"{self.dt_max!r} (set n_heads to the mixer's d_inner and leave the others at defaults)")
        if self.bcdt_norm_eps is not None and not (isinstance(self.bcdt_norm_eps, (int, float))
                                                   and self.bcdt_norm_eps > 0):
            raise ValueError(f"StateSpace.bcdt_norm_eps must be a positive float (FalconMamba's mixer_rms_eps) or None, "
                             f"got {self.bcdt_norm_eps!r}")
        if not isinstance(self.bcdt_norm_weights, bool) or (self.bcdt_norm_weights and self.bcdt_norm_eps is None):
            raise ValueError(f"StateSpace.bcdt_norm_weights={self.bcdt_norm_weights!r} says whether the dt, B and C norms "
                             "learn scales (Jamba's): a bool, True only with their bcdt_norm_eps set")

    @property
    def label(self) -> str:
        """The mixer's name in messages: Mamba-2's, or Mamba-1's (Mamba's)."""
        return "Mamba-2" if self.kind == "mamba2" else "Mamba"

    @property
    def d_inner(self) -> int:
        """The mixer's width: the channels its scan runs over."""
        return self.n_heads * self.d_head

    def check(self, cfg) -> None:
        """Refuse what the state-space layers are not built with, naming the setting to change."""
        if len(self.layers) != cfg.n_layers:
            raise ValueError(f"state_space.layers gives {len(self.layers)} layers; the model has n_layers="
                             f"{cfg.n_layers}: give each layer True or False")
        others = {"linear_attention": cfg.linear_attention is not None,
                  "latent_attention": cfg.latent_attention is not None,
                  "norm_placement": cfg.norm_placement.value != "pre",
                  "bidirectional": cfg.bidirectional, "heads_per_layer": cfg.heads_per_layer is not None}
        names = [name for name, bad in others.items() if bad]
        if names:
            raise ValueError(f"state-space layers are built in causal pre-norm blocks (with an MLP, or without one in "
                             f"an attn_only model: Mamba-2's), beside attention layers with every head; these settings "
                             f"differ: {', '.join(names)} (leave them at their defaults)")


@dataclass(frozen=True)
class ShortConv:
    """LFM2's gated short convolutions in place of attention in some layers (Liquid AI's LFM2, LFM2-MoE): `layers`
    says which (the others keep attention). One projection gives B, C and x, d_model channels each; B * x passes a
    causal depthwise convolution over `conv_kernel` positions (the file's conv_L_cache; no activation), C gates its
    output, and a projection writes it back. `bias`: the two projections and the convolution have biases (the file's
    one conv_bias)."""

    layers: tuple[bool, ...]
    conv_kernel: int = 3
    bias: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.conv_kernel, int) or isinstance(self.conv_kernel, bool) or self.conv_kernel <= 0:
            raise ValueError(f"ShortConv.conv_kernel must be a positive int, got {self.conv_kernel!r}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"ShortConv.bias must be a bool, got {self.bias!r}")
        layers = tuple(self.layers)
        if not all(isinstance(x, bool) for x in layers) or not any(layers):
            raise ValueError(f"ShortConv.layers={self.layers!r} must say for each layer True (a short convolution) or "
                             "False (attention), with at least one True (else leave short_conv None)")
        object.__setattr__(self, "layers", layers)

    @classmethod
    def of(cls, value, cfg) -> "Optional[ShortConv]":
        """DecoderConfig.short_conv as given (a ShortConv, its fields as a dict, or None), checked against `cfg`."""
        spec = cls(**value) if isinstance(value, dict) else value
        if spec is None:
            return None
        if not isinstance(spec, cls):
            raise ValueError(f"short_conv must be a ShortConv (or its fields as a dict), got {value!r}")
        if len(spec.layers) != cfg.n_layers:
            raise ValueError(f"short_conv.layers gives {len(spec.layers)} layers; the model has n_layers={cfg.n_layers}: "
                             "give each layer True or False")
        others = {"linear_attention": cfg.linear_attention is not None, "state_space": cfg.state_space is not None,
                  "latent_attention": cfg.latent_attention is not None,
                  "norm_placement": cfg.norm_placement.value != "pre", "attn_only": cfg.attn_only,
                  "bidirectional": cfg.bidirectional, "heads_per_layer": cfg.heads_per_layer is not None}
        names = [name for name, bad in others.items() if bad]
        if names:
            raise ValueError(f"short-convolution layers are built in causal pre-norm blocks with an MLP, beside attention "
                             f"layers with every head and no other recurrent mixer; these settings differ: "
                             f"{', '.join(names)} (leave them at their defaults)")
        return spec


def parallel_state_space_of(value, cfg) -> Optional[StateSpace]:
    """DecoderConfig.parallel_state_space as given (a StateSpace, its fields as a dict, or None), checked against
    `cfg`: Mamba-2 mixers beside attention in the layers it names (Falcon-H1), in causal pre-norm RMSNorm blocks with
    an MLP and no other mixer."""
    spec = StateSpace(**value) if isinstance(value, dict) else value
    if spec is None:
        return None
    if not isinstance(spec, StateSpace) or spec.kind != "mamba2" or len(spec.layers) != cfg.n_layers:
        raise ValueError(f"parallel_state_space={value!r} must be a Mamba-2 StateSpace (or its fields as a dict) whose "
                         f"layers give each of the n_layers={cfg.n_layers} layers True (a mixer beside attention) or "
                         "False")
    others = {"state_space": cfg.state_space is not None, "linear_attention": cfg.linear_attention is not None,
              "latent_attention": cfg.latent_attention is not None, "norm": cfg.norm.value != "rms",
              "norm_placement": cfg.norm_placement.value != "pre", "attn_only": cfg.attn_only,
              "bidirectional": cfg.bidirectional, "heads_per_layer": cfg.heads_per_layer is not None,
              "short_conv": getattr(cfg, "short_conv", None) is not None}
    names = [name for name, bad in others.items() if bad]
    if names:
        raise ValueError(f"a Mamba-2 mixer beside attention (Falcon-H1's parallel hybrid) is built in causal pre-norm "
                         f"RMSNorm blocks with an MLP and every head, and no other token mixer; these settings differ: "
                         f"{', '.join(names)} (set norm='rms' and leave the others at their defaults)")
    return spec
