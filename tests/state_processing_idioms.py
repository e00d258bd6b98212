"""transformer-lens's state-dict processing methods as TL code calls them, run on HookedTransformer by the oracle
(tests/saelens_oracle.py: state_steps) and on probe by tests/test_tl_state_processing.py: ARENA's monthly
algorithmic problems' loading cell (centre the writers and the unembedding, then fold the norms and the value
biases, then `load_state_dict(..., strict=False)` into a freshly built model) and each step alone."""
from __future__ import annotations

import torch

STEPS = ("center_writing_weights", "center_unembed", "fold_layer_norm", "fold_value_biases",
         "refactor_factored_attn_matrices")


def state_processing_idioms(model, state: dict, tokens: torch.Tensor, steps=STEPS, fold_options=None) -> dict:
    """{STEP.KEY: that step alone on `state`}, {arena.KEY: the dict ARENA's cell loads}, arena_logits (the model after
    that load) and {input.KEY: `state` afterwards} (each step returns a new dict, leaving its input as it was)."""
    fold_options = fold_options or {}
    out = {}
    for step in steps:
        options = fold_options if step == "fold_layer_norm" else {}
        out.update({f"{step}.{key}": t for key, t in getattr(model, step)(state, **options).items()})
    state_dict = state
    for step in (s for s in STEPS[:4] if s in steps):  # ARENA's order: centring before folding
        options = fold_options if step == "fold_layer_norm" else {}
        state_dict = getattr(model, step)(state_dict, **options)
    out.update({f"arena.{key}": t for key, t in state_dict.items()})
    model.load_state_dict(state_dict, strict=False)
    with torch.no_grad():
        out["arena_logits"] = model(tokens)
    out.update({f"input.{key}": t for key, t in state.items()})
    return {key: t.detach().clone().contiguous() for key, t in out.items()}
