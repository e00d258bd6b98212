"""What assigning to a frozen DecoderConfig does: the few assignments transformer-lens code makes (its use_* switches,
n_ctx, default_prepend_bos, a device before building) are taken; everything else is refused, naming the way."""
from __future__ import annotations

import dataclasses
from typing import Any

# transformer-lens's use_* switches: code turns them on by assigning to model.cfg, and the model follows
SWITCHES = ("use_attn_result", "use_split_qkv_input", "use_attn_in", "use_hook_mlp_in", "ungroup_grouped_query_attention")


def assign(self, name: str, value: Any) -> None:
    # transformer-lens code turns its switches on by assigning to model.cfg (EAP's setup: model.cfg.use_split_qkv_input
    # = True, ...), narrows n_ctx, turns default_prepend_bos off, and names a device on a config before building from
    # it. Those are the only assignments taken: a model's own config passes a switch or n_ctx to the model, which
    # records it; a config no model owns records a switch for the model built from it. Everything else describes the
    # architecture and stays frozen.
    owner = self.__dict__.get("_owner")
    model = owner() if owner is not None else None
    if name in SWITCHES and model is not None:
        getattr(model, f"set_{name}")(value)
        return
    if name == "n_ctx" and model is not None:  # EAP-IG narrows it around a to_tokens(truncate=True) call
        model.limit_context(value)
        return
    if name in SWITCHES or name == "default_prepend_bos" or (name == "device" and model is None):
        # TL code turns BOS off for a whole analysis by `model.cfg.default_prepend_bos = False`; text is read by it
        # at each call
        object.__setattr__(self, name, str(value) if name == "device" else bool(value))
        return
    fix = ("move the model with model.to(device), which updates model.cfg.device" if name == "device" else
           "build a changed copy with dataclasses.replace(cfg, ...) and a model from it"
           + (" (a model's own config takes n_ctx: model.cfg.n_ctx = n)" if name == "n_ctx" else ""))
    raise dataclasses.FrozenInstanceError(f"DecoderConfig is frozen: cannot assign {name}={value!r}; {fix}")


def state_without_owner(self) -> dict[str, Any]:
    # the owning model is a weak reference (it cannot be pickled, and a copy of the config belongs to no model yet)
    return {k: v for k, v in self.__dict__.items() if k != "_owner"}
