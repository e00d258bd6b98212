"""Reading a checkpoint's JSON files (config.json, the shard index) strictly: every failure is one line that
names the file and the field, never a traceback from deep inside a family's converter.

`read_json_object` reads a file that must hold a JSON object. `ConfigFields` is config.json's object, read
field by field: a field this module knows (`FIELD_TYPES`) must have its type when it is read, so `"12"` for
`n_layer`, `"false"` for `tie_word_embeddings` or a list for `rope_scaling` is refused by name instead of
being truncated, read as true, or failing as `'list' object has no attribute 'get'`. Unknown fields pass.
"""
from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor and what to do."""


def read_json_object(path: Path, what: str = "a checkpoint directory needs config.json") -> dict:
    """The JSON object in `path`; a CheckpointError naming the file for a missing or unreadable file, bad JSON,
    JSON nested past Python's recursion limit, or JSON that is not an object."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {what}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    except RecursionError:
        raise CheckpointError(f"{path} is nested too deeply to be a configuration file") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {_json_kind(value)}, not an object of fields")
    return value


def _json_kind(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


# the type of every config.json field a family reads; None is accepted only for the NULLABLE ones
SIZE, NUMBER, BOOL, STR, OBJECT, SIZES, STRS = "size", "number", "bool", "str", "object", "sizes", "strs"
FIELD_TYPES = {
    **dict.fromkeys(("n_layer", "n_embd", "n_head", "n_inner", "vocab_size", "n_positions", "num_hidden_layers",
                     "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "max_position_embeddings", "sliding_window", "original_max_position_embeddings", "num_layers",
                     "num_heads", "window_size", "ffn_dim", "word_embed_proj_dim"), SIZE),
    **dict.fromkeys(("layer_norm_epsilon", "rms_norm_eps", "layer_norm_eps", "rope_theta", "rotary_emb_base",
                     "rotary_pct", "partial_rotary_factor", "attn_logit_softcapping", "final_logit_softcapping",
                     "query_pre_attn_scalar", "factor", "low_freq_factor", "high_freq_factor"), NUMBER),
    **dict.fromkeys(("scale_attn_weights", "scale_attn_by_inverse_layer_idx", "tie_word_embeddings",
                     "attention_bias", "mlp_bias", "use_sliding_window", "use_parallel_residual", "do_layer_norm_before",
                     "_remove_final_layer_norm", "layer_norm_elementwise_affine", "enable_bias"), BOOL),
    **dict.fromkeys(("model_type", "activation_function", "afn", "hidden_act", "hidden_activation", "rope_type",
                     "type"), STR),
    **dict.fromkeys(("rope_parameters", "rope_scaling"), OBJECT),
    "heads_per_layer": SIZES, "layer_types": STRS,
}
NULLABLE = {"n_inner", "num_key_value_heads", "head_dim", "sliding_window", "attn_logit_softcapping",
            "final_logit_softcapping", "rope_parameters", "rope_scaling", "layer_types", "heads_per_layer",
            "original_max_position_embeddings", "hidden_act", "hidden_activation", "intermediate_size",
            "word_embed_proj_dim"}
_SAYS = {SIZE: "a positive integer", NUMBER: "a finite number", BOOL: "true or false", STR: "a string",
         OBJECT: "an object", SIZES: "a list of non-negative integers", STRS: "a list of strings"}


class ConfigFields(dict):
    """config.json's fields, each checked against FIELD_TYPES as it is read (by [key] or .get)."""

    def __init__(self, fields: dict, path: Path, prefix: str = ""):
        super().__init__(fields)
        self.path, self.prefix = path, prefix

    def __getitem__(self, key: str):
        return self._checked(key, super().__getitem__(key))

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def _checked(self, key: str, value):
        kind = FIELD_TYPES.get(key)
        if kind is None or (value is None and key in NULLABLE):
            return value
        if kind == OBJECT and isinstance(value, dict):
            return ConfigFields(value, self.path, f"{self.prefix}{key}.")
        if _is(kind, value):
            return value
        got = f"the string {value!r}" if isinstance(value, str) else json.dumps(value)[:60] if _plain(value) else repr(value)[:60]
        hint = " (JSON's true/false, unquoted)" if kind == BOOL and isinstance(value, str) else ""
        raise CheckpointError(f"{self.path}: {self.prefix}{key} must be {_SAYS[kind]}{hint}, got {got}")


def _plain(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError, RecursionError):
        return False


def _is(kind: str, value) -> bool:
    integer = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind == SIZE:
        return integer and value > 0
    if kind == NUMBER:
        return integer or (isinstance(value, float) and math.isfinite(value))
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == STR:
        return isinstance(value, str)
    if kind == SIZES:
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    if kind == STRS:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return False
