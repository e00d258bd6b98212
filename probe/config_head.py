"""The prediction head's choices (probe.prediction_head builds it): a field of DecoderConfig, kept here so that
probe.config stays a list of fields."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from probe.config_choices import Activation


@dataclass(frozen=True, kw_only=True)
class PredictionHead:
    """The head's choices: its dense layer's activation (classifier_activation, by its Hugging Face name, so the
    config's dict stays JSON) and bias (classifier_bias); its LayerNorm has the model's eps and learns w and b (b
    zero where the format has none)."""

    activation: str = Activation.GELU.value
    bias: bool = False

    @property
    def act(self) -> Activation:
        return Activation(self.activation)

    @classmethod
    def of(cls, value) -> Optional["PredictionHead"]:
        """`value` (a PredictionHead, its fields as a dict, or None), checked."""
        if value is None:
            return None
        head = cls(**value) if isinstance(value, dict) else value
        if not isinstance(head, cls):
            raise ValueError(f"prediction_head must be a PredictionHead (or its fields as a dict), got {value!r}")
        if isinstance(head.activation, Activation):
            object.__setattr__(head, "activation", head.activation.value)
        plain = [a.value for a in Activation if not (a.learned or a.normed or a is Activation.SOLU)]
        if head.activation not in plain or not isinstance(head.bias, bool):
            raise ValueError(f"prediction_head={head!r}: its activation must be one of {plain} (a function of each "
                             "value alone) and its bias a bool")
        return head
