"""The typed choices a DecoderConfig is built from: the MLP's activation, the kind and placement of the norms, the
positions, how long-context checkpoints rescale their rotary frequencies, a mixture of experts, and linear-attention
layers."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, Optional


class Activation(enum.Enum):
    """The MLP non-linearity (values are the names Hugging Face configs use, or transformer-lens's where no Hugging
    Face format has it)."""

    GELU_TANH = "gelu_new"  # GPT-2's tanh approximation
    GELU = "gelu"  # exact, erf-based (GPT-1)
    RELU = "relu"
    SILU = "silu"  # with gated_mlp: SwiGLU (Llama, Qwen2)
    SOLU = "solu"  # x * softmax(x) over d_mlp (Elhage et al. 2022, "Softmax Linear Units")
    # SoLU, then a LayerNorm over d_mlp inside the MLP (mlp.ln), which W_out reads: the paper's MLP, Neel Nanda's
    # solu-* models; transformer-lens's act_fn="solu_ln"
    SOLU_LN = "solu_ln"
    # xIELU (Huang et al. 2024): alpha_p x^2 + beta x above 0, alpha_n (expm1(min(x, eps)) - x) + beta x below, with
    # alpha_p and alpha_n learned per MLP (mlp.act_fn's parameters): Apertus
    XIELU = "xielu"
    RELU2 = "relu2"  # relu(x)^2, ungated: Arcee's AFM (So et al. 2021, "Primer")

    @property
    def learned(self) -> bool:
        """Whether the activation holds parameters of its own (one set per MLP)."""
        return self is Activation.XIELU

    @property
    def normed(self) -> bool:
        """Whether the MLP normalises its activations before W_out (mlp.ln): hook_post is then not act(hook_pre)."""
        return self is Activation.SOLU_LN


# transformer-lens's act_fn names (Hugging Face's too) for each activation: three name the one tanh GELU
ACTIVATION_SPELLINGS = {"gelu_new": Activation.GELU_TANH, "gelu_fast": Activation.GELU_TANH,
                        "gelu_pytorch_tanh": Activation.GELU_TANH, "gelu": Activation.GELU, "relu": Activation.RELU,
                        "silu": Activation.SILU, "solu": Activation.SOLU, "solu_ln": Activation.SOLU_LN,
                        "xielu": Activation.XIELU, "relu2": Activation.RELU2}


class Norm(enum.Enum):
    LAYER = "layer"  # subtract the mean, divide by the std, then w * x + b
    RMS = "rms"  # divide by the root mean square, then w * x (Llama)
    RMS_FLOAT32 = "rms_float32"  # the same, w kept and applied in float32, rounded once (Gemma; w = 1 + the stored offset)
    NONE = "none"  # no normalisation at all (transformer-lens's normalization_type=None: toy models, grokking)


class NormPlacement(enum.Enum):
    """Where the norms sit, which decides how the two sublayers meet the residual stream."""

    PRE = "pre"  # x + F(norm(x)): GPT-2, Llama
    POST = "post"  # norm(x + F(x)): the 2017 original, GPT-1
    PARALLEL = "parallel"  # x + attn(norm1(x)) + mlp(norm2(x)): both read the same residual (GPT-NeoX, Pythia)
    SANDWICH = "sandwich"  # x + norm1_post(attn(norm1(x))), then the same for the MLP: each write normalised (Gemma 2)


class Positions(enum.Enum):
    LEARNED = "learned"  # a learned vector per position, added to the embedding (GPT-2, GPT-1)
    SINUSOIDAL = "sinusoidal"  # fixed sinusoids added to the embedding (Vaswani et al. 2017)
    ROTARY = "rotary"  # q and k rotated by position inside every attention layer (Llama)
    # a learned vector per position added to every attention layer's query and key inputs (after ln1), never to the
    # residual stream or the values (Press et al. 2021; transformer-lens's attn-only toy models, ARENA's induction model)
    SHORTFORMER = "shortformer"
    # no position vectors: each head adds -slope * (query position - key position) to its scores, its slope from a
    # geometric series over the heads (Press et al. 2022, "Train Short, Test Long"; Bloom)
    ALIBI = "alibi"


@dataclass(frozen=True)
class RotaryScaling:
    """How a long-context checkpoint rescales its rotary frequencies (transformers' `rope_type`).

    "linear": every frequency divided by `factor` (positions interpolated). "llama3" (Llama 3.1,
    3.2): frequencies whose wavelength exceeds original_n_ctx / low_freq_factor divided by `factor`,
    those shorter than original_n_ctx / high_freq_factor kept, and the ones between blended linearly
    in original_n_ctx / wavelength. "yarn" (Peng et al. 2023): dimensions that turn fewer than
    beta_slow times in original_n_ctx positions divided by `factor`, those turning more than beta_fast
    times kept, a linear ramp in dimension between (its ends rounded outwards with `truncate`), and q
    and k's rotated dimensions multiplied by attention_factor. "proportional" (Gemma 4's full-attention
    layers): only the first `rotated_fraction` of the pairs turn, at the frequencies they have among all
    of the head's pairs, the rest standing still; every frequency divided by `factor`. "longrope" (Phi-3's
    128k models, Phi-3.5, Phi-4-mini, PhiMoE; transformers' "longrope", older files' "su"): pair i's frequency
    divided by short_factor[i] while a forward's positions stay within original_n_ctx, by long_factor[i] at
    every position once any reaches past it (the whole call switches, as transformers' does), and q and k's
    rotated dimensions multiplied by attention_factor (long_attention_factor in the long regime where it is
    given: PhiMoE's short_mscale / long_mscale); `factor` is kept for the file and changes nothing.
    """

    kind: Literal["linear", "llama3", "yarn", "proportional", "longrope"]
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_n_ctx: Optional[int] = None  # llama3, yarn and longrope: the context length of pretraining
    beta_fast: float = 32.0  # yarn only
    beta_slow: float = 1.0  # yarn only
    attention_factor: float = 1.0  # yarn and longrope: what the rotated dimensions are multiplied by
    truncate: bool = True  # yarn only
    rotated_fraction: float = 1.0  # proportional only: the share of the pairs that turn
    short_factor: tuple[float, ...] = ()  # longrope only: each pair's divisor within original_n_ctx
    long_factor: tuple[float, ...] = ()  # longrope only: each pair's divisor past it
    long_attention_factor: Optional[float] = None  # longrope only: attention_factor past it; None: the same

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3", "yarn", "proportional", "longrope"):
            raise ValueError(f"rotary scaling kind={self.kind!r} is not supported; choose one of: 'linear', 'llama3', "
                             "'yarn', 'proportional', 'longrope'")
        for name in ("short_factor", "long_factor"):  # (a list from JSON or to_dict becomes a hashable tuple)
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.kind == "longrope":
            self._check_longrope()
        elif self.short_factor or self.long_factor or self.long_attention_factor is not None:
            raise ValueError(f"short_factor, long_factor and long_attention_factor are longrope's; {self.kind} "
                             "rotary scaling takes none of them")
        if not (isinstance(self.rotated_fraction, (int, float)) and 0 <= self.rotated_fraction <= 1):
            raise ValueError(f"rotary scaling rotated_fraction must be in [0, 1], got {self.rotated_fraction!r}")
        if not (isinstance(self.factor, (int, float)) and self.factor > 0):
            raise ValueError(f"rotary scaling factor must be a positive number, got {self.factor!r}")
        if self.kind in ("llama3", "yarn", "longrope"):
            if not (isinstance(self.original_n_ctx, int) and self.original_n_ctx > 0):
                raise ValueError(f"{self.kind} rotary scaling needs original_n_ctx, a positive int, got "
                                 f"{self.original_n_ctx!r}")
        if self.kind == "llama3":
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ValueError(f"llama3 rotary scaling needs 0 < low_freq_factor < high_freq_factor, got "
                                 f"{self.low_freq_factor!r} and {self.high_freq_factor!r}")

    def _check_longrope(self) -> None:
        pairs = len(self.short_factor)
        if not pairs or len(self.long_factor) != pairs or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0
                for f in self.short_factor + self.long_factor):
            raise ValueError(f"longrope rotary scaling needs short_factor and long_factor, one positive number per "
                             f"rotated pair each, got {len(self.short_factor)} and {len(self.long_factor)} entries")
        for name in ("attention_factor", "long_attention_factor"):
            value = getattr(self, name)
            if not (value is None and name == "long_attention_factor") and not (
                    isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"longrope rotary scaling {name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert non-linearity, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate,
    limit), in place of act(gate) * up (transformers' swiglu_alpha and swiglu_limit)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        for name in ("alpha", "limit"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"ClampedSwiGLU.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class ExpertGroups:
    """Group-limited routing (DeepSeek-V2's "group_limited_greedy", DeepSeek-V3's and GLM-4.5's n_group / topk_group):
    the experts split into `n` groups of adjacent ones, each group scored from its experts' choice scores, and only
    the experts of the `kept` best groups may be chosen. `score`: "top2_sum", the sum of the group's two largest choice
    scores (DeepSeek-V3, GLM-4.5), or "max", its largest (DeepSeek-V2)."""

    n: int
    kept: int
    score: Literal["top2_sum", "max"] = "top2_sum"

    def __post_init__(self) -> None:
        for name in ("n", "kept"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ExpertGroups.{name} must be a positive int, got {value!r}")
        if self.kept > self.n:
            raise ValueError(f"ExpertGroups(kept={self.kept}) keeps more groups than there are (n={self.n})")
        if self.score not in ("top2_sum", "max"):
            raise ValueError(f"ExpertGroups.score={self.score!r} is not supported; choose 'top2_sum' (DeepSeek-V3) or "
                             "'max' (DeepSeek-V2)")


@dataclass(frozen=True)
class Experts:
    """A sparse mixture of gated MLPs in place of a layer's MLP (Mixtral, OLMoE; transformer-lens's num_experts,
    experts_per_token, norm_topk_prob): a router scores the `n` experts for each token, the `per_token` with the
    largest scores run, and their outputs are summed with those scores as weights (divided first by their sum when
    `renormalize`: Mixtral always, OLMoE as its config says; then times `scaling`, DeepSeek's routed_scaling_factor).

    `scoring`: "softmax" over every expert's router logit (Mixtral), or "sigmoid" of each (DeepSeek-V3, GLM-4.5).
    `selection_bias`: a learned per-expert bias (the file's e_score_correction_bias) added to the scores for the
    choice alone, never to the weights (DeepSeek-V3's auxiliary-loss-free balancing). `groups`: the choice limited to
    the best groups of experts (ExpertGroups); None: any expert. `softmax_over`: "all" (the scores above, then the
    choice) or "chosen" (the choice by logit, then the softmax over the chosen ones' logits: GPT-OSS; their weights
    then sum to 1, so nothing is renormalised, biased, grouped or scaled) or "sparsemixer" (PhiMoE's inference
    routing, Liu et al. 2024: the two largest logits chosen, each weighted by the softmax over the experts whose
    logits lie within a relative 2 * `sparsemixer_eps` of it, the first's among all, the second's among all but the
    first; nothing renormalised, biased, grouped or scaled). `clamped_glu`: the experts' non-linearity is
    GPT-OSS's (ClampedSwiGLU); None: the model's activation, act(gate) * up.

    `shared`: the width of an expert every token runs (None: none), its output weighed by a sigmoid gate of its own
    when `shared_gate` (Qwen1.5-MoE, Qwen2-MoE), added as it is otherwise (DeepSeek, GLM-4.5: n_shared_experts times
    the experts' width). `width`: each routed expert's width; None: the config's d_mlp. `layers`: which layers have
    the experts (the others a dense gated MLP of d_mlp: DeepSeek's first_k_dense_replace, Qwen-MoE's mlp_only_layers);
    None: every layer. `renormalize_min`: the renormalising sum clamped below at this (ERNIE 4.5's moe_norm_min; None:
    the sum plus `renormalize_eps`: 1e-20, LFM2-MoE's 1e-6). `routed_bias` False: no biases on the router or routed experts whatever mlp_bias says.
    `gated` False: every expert, the shared one too, is a plain MLP, W_out(act(W_in x)) (NemotronH's relu^2 experts,
    with gated_mlp False). `latent`: the routed experts read and write a projection of the residual this wide
    (NemotronH's moe_latent_size: fc1_latent_proj before them, fc2_latent_proj after their weighted sum); None: the
    residual itself. `scale_inputs`: each chosen expert reads its input times its weight and writes as it is (Llama 4:
    expert(w x), not w expert(x))."""

    n: int
    per_token: int
    renormalize: bool = False
    shared: Optional[int] = None
    softmax_over: Literal["all", "chosen", "sparsemixer"] = "all"
    clamped_glu: Optional[ClampedSwiGLU] = None
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    selection_bias: bool = False
    groups: Optional[ExpertGroups] = None
    scaling: float = 1.0
    shared_gate: bool = True
    width: Optional[int] = None
    layers: Optional[tuple[bool, ...]] = None
    renormalize_min: Optional[float] = None
    routed_bias: bool = True
    renormalize_eps: float = 1e-20
    gated: bool = True
    latent: Optional[int] = None
    scale_inputs: bool = False
    sparsemixer_eps: float = 0.01  # softmax_over="sparsemixer" only: PhiMoE's router_jitter_noise
    # the router's logits, in float32, soft-capped to cap * tanh(logits / cap) before scoring (Laguna's
    # moe_router_logit_softcapping); None: as they are
    router_softcap: Optional[float] = None
    output_bias: bool = False  # a [d_model] bias added to the routed experts' weighted sum (JetMoE's mlp.bias)

    def __post_init__(self) -> None:
        for name in ("n", "per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Experts.{name} must be a positive int, got {value!r}")
        if self.per_token > self.n:
            raise ValueError(f"Experts(per_token={self.per_token}) picks more experts than there are (n={self.n})")
        for name in ("renormalize", "selection_bias", "shared_gate", "routed_bias", "gated", "scale_inputs",
                     "output_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Experts.{name} must be a bool, got {getattr(self, name)!r}")
        for name, what in (("shared", "the shared expert's width"), ("width", "each routed expert's width"),
                           ("latent", "the routed experts' input and output width")):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"Experts.{name} must be a positive int ({what}) or None, got {value!r}")
        if not self.shared_gate and self.shared is None:
            raise ValueError("Experts(shared_gate=False) says how a shared expert is added, but shared=None: give the "
                             "shared expert's width, or leave shared_gate True")
        if self.softmax_over not in ("all", "chosen", "sparsemixer"):
            raise ValueError(f"Experts.softmax_over={self.softmax_over!r} is not supported; choose 'all', 'chosen' or "
                             "'sparsemixer'")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"Experts.scoring={self.scoring!r} is not supported; choose 'softmax' or 'sigmoid'")
        if not (isinstance(self.scaling, (int, float)) and not isinstance(self.scaling, bool) and self.scaling > 0):
            raise ValueError(f"Experts.scaling must be a positive number (the routed experts' weights are multiplied "
                             f"by it), got {self.scaling!r}")
        self._check_groups()
        floor = self.renormalize_min
        if floor is not None and not (type(floor) in (int, float) and floor > 0 and self.renormalize):
            raise ValueError(f"Experts.renormalize_min={floor!r} clamps the renormalising sum: give a positive number "
                             "with renormalize=True, or leave it None")
        eps = self.renormalize_eps
        if not (type(eps) in (int, float) and eps > 0 and (eps == 1e-20 or (self.renormalize and floor is None))):
            raise ValueError(f"Experts.renormalize_eps={eps!r} is added to the renormalising sum: give a positive number "
                             "with renormalize=True and no renormalize_min, or leave it 1e-20")
        self._check_sparsemixer()
        if self.output_bias and self.latent is not None:
            raise ValueError("Experts.output_bias adds a bias to the experts' sum in the residual's width; latent "
                             "experts write through fc2_latent_proj, whose own bias is mlp_bias: leave it False")
        cap = self.router_softcap
        if cap is not None and not (type(cap) in (int, float) and cap > 0 and self.softmax_over == "all"):
            raise ValueError(f"Experts.router_softcap={cap!r} caps the logits the experts are scored from: give a "
                             "positive number with softmax_over='all', or leave it None")
        if self.softmax_over in ("chosen", "sparsemixer"):
            chosen = {"renormalize": self.renormalize, "scoring": self.scoring != "softmax",
                      "selection_bias": self.selection_bias, "groups": self.groups is not None,
                      "scaling": self.scaling != 1}
            if any(chosen.values()):
                raise ValueError(f"Experts(softmax_over={self.softmax_over!r}) chooses by logit and weighs by softmax; "
                                 f"leave these at their defaults: {', '.join(k for k, v in chosen.items() if v)}")
        if isinstance(self.clamped_glu, dict):
            object.__setattr__(self, "clamped_glu", ClampedSwiGLU(**self.clamped_glu))
        if self.clamped_glu is not None and not isinstance(self.clamped_glu, ClampedSwiGLU):
            raise ValueError(f"Experts.clamped_glu must be a ClampedSwiGLU (or its fields as a dict) or None, got "
                             f"{self.clamped_glu!r}")
        if self.layers is not None:
            layers = tuple(self.layers)
            if not all(isinstance(x, bool) for x in layers) or not any(layers):
                raise ValueError(f"Experts.layers={self.layers!r} must say for each layer True (experts) or False (a "
                                 "dense MLP), with at least one True (else leave experts None)")
            object.__setattr__(self, "layers", None if all(layers) else layers)  # one spelling of "every layer"

    def _check_sparsemixer(self) -> None:
        eps = self.sparsemixer_eps
        if not (type(eps) in (int, float) and eps >= 0):
            raise ValueError(f"Experts.sparsemixer_eps must be a number >= 0, got {eps!r}")
        if self.softmax_over == "sparsemixer" and self.per_token != 2:
            raise ValueError(f"Experts(softmax_over='sparsemixer') chooses two experts per token (PhiMoE's routing "
                             f"has no other count); got per_token={self.per_token}")
        if self.softmax_over != "sparsemixer" and eps != 0.01:
            raise ValueError("Experts.sparsemixer_eps is the sparsemixer routing's: set softmax_over='sparsemixer', "
                             "or leave it 0.01")

    def _check_groups(self) -> None:
        if isinstance(self.groups, dict):
            object.__setattr__(self, "groups", ExpertGroups(**self.groups))
        groups = self.groups
        if groups is None:
            return
        if not isinstance(groups, ExpertGroups):
            raise ValueError(f"Experts.groups must be an ExpertGroups (or its fields as a dict) or None, got {groups!r}")
        if self.n % groups.n:
            raise ValueError(f"Experts(n={self.n}) cannot split into ExpertGroups(n={groups.n}) equal groups: choose a "
                             "group count that divides the experts")
        size = self.n // groups.n
        if groups.kept * size < self.per_token:
            raise ValueError(f"ExpertGroups(kept={groups.kept}) of {size} experts each leave fewer than per_token="
                             f"{self.per_token} to choose from: keep more groups")
        if groups.score == "top2_sum" and size < 2:
            raise ValueError(f"ExpertGroups(score='top2_sum') sums each group's two best scores, but its groups hold "
                             f"{size} expert: use score='max' or fewer groups")
