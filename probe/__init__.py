"""probe: a hookable decoder-only transformer for mechanistic interpretability."""
from probe.bundled import DEFAULT_MODEL, HELDOUT_TEXT
from probe.config import Activation, DecoderConfig
from probe.model import Block, HookedDecoder
from probe.tokenizer import Tokenizer

__all__ = ["DEFAULT_MODEL", "HELDOUT_TEXT", "Activation", "Block", "DecoderConfig", "HookedDecoder", "Tokenizer"]
