"""DecoderConfig: the frozen, validated description of a decoder's shape and components."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Optional


class Activation(enum.Enum):
    """The MLP non-linearity (the names Hugging Face configs use for them)."""

    GELU_TANH = "gelu_new"  # GPT-2's tanh approximation
    GELU = "gelu"  # exact, erf-based
    RELU = "relu"


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    n_layers: int
    d_model: int
    n_heads: int
    d_vocab: int
    n_ctx: int
    d_head: Optional[int] = None  # None: d_model // n_heads
    d_mlp: Optional[int] = None  # None: 4 * d_model
    eps: float = 1e-5  # LayerNorm epsilon
    activation: Activation = Activation.GELU_TANH
    tied_embeddings: bool = True  # unembedding = embedding transposed, as in GPT-2
    init_std: float = 0.02  # weight init for models trained from scratch

    def __post_init__(self) -> None:
        for field in ("n_layers", "d_model", "n_heads", "d_vocab", "n_ctx"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if self.d_head is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "change one of them or set d_head explicitly"
                )
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        if self.d_mlp is None:
            object.__setattr__(self, "d_mlp", 4 * self.d_model)
        for field in ("d_head", "d_mlp"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if not isinstance(self.activation, Activation):
            try:
                object.__setattr__(self, "activation", Activation(self.activation))
            except ValueError:
                valid = ", ".join(a.value for a in Activation)
                raise ValueError(f"activation={self.activation!r} is not supported; choose one of: {valid}") from None
        if not (isinstance(self.eps, (int, float)) and 0 < self.eps < 1):
            raise ValueError(f"eps must be a small positive float, got {self.eps!r}")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["activation"] = self.activation.value
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DecoderConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown DecoderConfig fields: {', '.join(unknown)}; valid fields: {', '.join(sorted(known))}")
        return cls(**values)
