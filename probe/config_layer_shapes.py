"""Config choices for layers that differ from one another in shape or share with each other (Gemma 4): full-attention
layers with heads of their own width, later layers that reuse an earlier layer's keys and values, and a small
embedding of each token for every layer. DecoderConfig holds them (global_layers, shared_kv, per_layer_inputs) and
calls check_layer_shapes; LayerFacts (config_layers.py) answers the per-layer questions from them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class GlobalLayers:
    """The full-attention ("global") layers of a model with a sliding window, shaped apart from the windowed ones
    (Gemma 4: global_head_dim, num_global_key_value_heads, attention_k_eq_v). `d_head` is their heads' width (q, k, v
    and W_O's rows), `n_kv_heads` their key/value heads (None: the config's n_kv_heads), and `values_from_keys` makes
    their values the key projection's output, before k's norm and rotary: no value projection of their own."""

    d_head: int
    n_kv_heads: Optional[int] = None
    values_from_keys: bool = False

    def check(self, cfg) -> None:
        if not _positive_int(self.d_head) or not (self.n_kv_heads is None or _positive_int(self.n_kv_heads)):
            raise ValueError(f"global_layers={self!r}: d_head and n_kv_heads must be positive ints (n_kv_heads may be "
                             "None: the config's)")
        if cfg.sliding_window is None:
            raise ValueError("global_layers shapes the full-attention layers apart from the windowed ones: it needs a "
                             "sliding_window (and sliding_layers saying which layers are windowed)")
        kv = self.n_kv_heads or cfg.n_kv_heads
        if cfg.n_heads % kv:
            raise ValueError(f"global_layers.n_kv_heads={kv} must divide n_heads={cfg.n_heads}")
        if not isinstance(self.values_from_keys, bool):
            raise ValueError(f"global_layers.values_from_keys must be a bool, got {self.values_from_keys!r}")


@dataclass(frozen=True)
class SharedKV:
    """The last `layers` layers compute no keys or values: each attends over those of the last earlier layer of its
    own kind (windowed or full) that does, from this pass and the cache (Gemma 4's num_kv_shared_layers). `d_mlp`:
    their MLPs' width where it differs from the config's (Gemma 4's use_double_wide_mlp: twice it); None: d_mlp."""

    layers: int
    d_mlp: Optional[int] = None

    def check(self, cfg) -> None:
        if not _positive_int(self.layers) or self.layers >= cfg.n_layers:
            raise ValueError(f"shared_kv.layers={self.layers!r} must be a positive int below n_layers={cfg.n_layers}: "
                             "some earlier layer must compute the keys and values the later ones reuse")
        if not (self.d_mlp is None or _positive_int(self.d_mlp)):
            raise ValueError(f"shared_kv.d_mlp must be a positive int or None, got {self.d_mlp!r}")
        first = cfg.n_layers - self.layers
        for layer in range(first, cfg.n_layers):
            if cfg.layer_kv_source(layer) is None:
                kind = "windowed" if cfg.layer_window(layer) is not None else "full-attention"
                raise ValueError(f"shared_kv: layer {layer} is {kind}, but no layer before {first} is, so there are "
                                 "no keys and values for it to reuse; share fewer layers")


@dataclass(frozen=True)
class PerLayerInputs:
    """A second, narrow embedding of every token for every layer (Gemma 4's per-layer embeddings, PLE): a table of
    `d_vocab` rows of n_layers * `d` (times sqrt(d)), added to a projection of the scaled token embedding (times
    d_model^-0.5, RMS-normalised over d), the sum times 2^-0.5; layer l reads its [d] slice, gates it by
    act(x W_gate) on the residual, projects it back to d_model, normalises it and adds it to the residual."""

    d: int
    d_vocab: int

    def check(self, cfg) -> None:
        if not (_positive_int(self.d) and _positive_int(self.d_vocab)):
            raise ValueError(f"per_layer_inputs={self!r}: d and d_vocab must be positive ints")


CHOICES = {"global_layers": GlobalLayers, "shared_kv": SharedKV, "per_layer_inputs": PerLayerInputs}


def check_layer_shapes(cfg) -> None:
    """Convert dicts to the choices above and check them against `cfg` (DecoderConfig.__post_init__ calls this)."""
    for field, cls in CHOICES.items():
        value = getattr(cfg, field)
        if isinstance(value, dict):
            object.__setattr__(cfg, field, value := cls(**value))
        if value is not None and not isinstance(value, cls):
            raise ValueError(f"{field} must be a {cls.__name__} (or its fields as a dict), got {value!r}")
    for field in ("value_norm", "layer_scalars"):
        if not isinstance(getattr(cfg, field), bool):
            raise ValueError(f"{field} must be a bool, got {getattr(cfg, field)!r}")
    if cfg.global_layers is not None:
        cfg.global_layers.check(cfg)
    if cfg.shared_kv is not None:
        cfg.shared_kv.check(cfg)
    if cfg.per_layer_inputs is not None:
        cfg.per_layer_inputs.check(cfg)
    if (cfg.global_layers, cfg.shared_kv, cfg.per_layer_inputs) != (None,) * 3 or cfg.layer_scalars:
        if cfg.latent_attention is not None or cfg.heads_per_layer is not None or cfg.attn_only:
            raise ValueError("global_layers, shared_kv, per_layer_inputs and layer_scalars describe Gemma 4's "
                             "attention blocks: they do not combine with latent_attention, heads_per_layer or "
                             "attn_only")
