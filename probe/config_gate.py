"""How an attention output gate acts (DecoderConfig.output_gate, beside attn_output_gate): which function of the gate's
logits multiplies each head's z, and whether one logit serves a whole head or each of its channels has its own.

Qwen3.5's and AFMoE's gates are a sigmoid per channel (the default, output_gate None); Laguna's a softplus, computed
in float32, per head (`gating` true or "per-head") or per channel ("per-element")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class OutputGate:
    activation: Literal["sigmoid", "softplus"] = "sigmoid"  # what multiplies z: sigmoid (in z's dtype) or softplus (float32)
    per_head: bool = False  # True: one logit per head, broadcast over d_head (hook_q_gate [batch pos head 1])

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"OutputGate.activation={self.activation!r} is not supported; choose one of "
                             f"{', '.join(map(repr, ACTIVATIONS))}")
        if not isinstance(self.per_head, bool):
            raise ValueError(f"OutputGate.per_head must be a bool, got {self.per_head!r}")

    def width(self, d_head: int) -> int:
        """The gate's logits per head: 1, or d_head."""
        return 1 if self.per_head else d_head

    @classmethod
    def of(cls, value, cfg) -> Optional["OutputGate"]:
        """`value` (an OutputGate, its fields as a dict, or None) checked against `cfg`: it needs attn_output_gate,
        and the sigmoid per channel, which None already says, is spelled None (configs compare equal after saving)."""
        if isinstance(value, dict):
            value = cls(**value)
        if value is None:
            return None
        if not isinstance(value, cls):
            raise ValueError(f"output_gate must be an OutputGate (or its fields as a dict) or None, got {value!r}")
        if not cfg.attn_output_gate:
            raise ValueError(f"output_gate={value!r} says how the attention output gate acts: set attn_output_gate=True "
                             "(or leave output_gate None)")
        return None if value == cls() else value


def sigmoid_gate(logits: torch.Tensor) -> torch.Tensor:
    return logits.sigmoid()


def softplus_gate(logits: torch.Tensor) -> torch.Tensor:
    # (float32, as transformers' Laguna: softplus of large logits is their value, which half precision would round)
    return F.softplus(logits.float()).to(logits.dtype)


ACTIVATIONS = {"sigmoid": sigmoid_gate, "softplus": softplus_gate}


def output_gate_of(cfg) -> OutputGate:
    """cfg's output gate, the default (a sigmoid per channel) where it leaves output_gate None."""
    return cfg.output_gate or OutputGate()
