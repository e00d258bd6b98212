"""Head importance and head pruning (Michel, Levy & Neubig 2019, "Are Sixteen Heads Really Better than One?").

- `head_importance`: I_h = E_x |dL(x)/dxi_h|, the sensitivity of the loss to a gate xi_h that scales
  head h's output (`hook_z`), at xi = 1 (or at a given mask). The absolute value is taken per
  example (per sequence), as in the paper: the gate gets a batch dimension, and since an example's
  loss depends only on its own row of gates, one backward pass of the summed loss gives every
  example's gradient for every head at once.
- `prune_by_importance`: the iterative curve: mask the least important fraction of the remaining
  heads, re-estimate importance with the mask in place, evaluate; with random-order and
  single-head-ablation-order baselines on the same schedule.
- `prune_heads`: structural pruning; a new, smaller model whose outputs equal the original's with
  those heads zero-ablated. `save_pruned` / `load_pruned` keep its head map (see below) on disk.

Head indices. A structurally pruned model numbers each layer's remaining heads 0..k-1. `prune_heads`
takes heads by their index in the ORIGINAL (unpruned) model and records, on the model it returns,
`head_map`: per layer, the original index of each remaining head (`head_map[layer][i]` is the
original index of the pruned model's head i), so a pruned model can be pruned again with original
indices. The analyses (`head_importance`, `prune_by_importance`) work on any model and use its
current indices; `original_heads(model, heads)` translates them.

The parts live in modules of their own: the data (`analyses.pruning_data`), the gate, importance and
evaluation under masks (`analyses.pruning_importance`), the iterative curve (`analyses.pruning_curve`) and
structural pruning (`analyses.pruning_structural`); this module gathers their public names.
"""
from __future__ import annotations

from probe.analyses.pruning_curve import METHOD_ABLATION, METHOD_IMPORTANCE, METHOD_RANDOM, PruningCurve, prune_by_importance, pruning_schedule
from probe.analyses.pruning_data import PruningData, token_batches
from probe.analyses.pruning_importance import LOGIT_BUDGET, HeadImportance, Metric, evaluate_masks, head_importance, present_heads
from probe.analyses.pruning_structural import HEAD_MAP_FILE, HeadMap, attach_head_map, head_map_of, load_pruned, original_heads, prune_heads, save_pruned

__all__ = ["HEAD_MAP_FILE", "HeadImportance", "HeadMap", "LOGIT_BUDGET", "METHOD_ABLATION", "METHOD_IMPORTANCE", "METHOD_RANDOM",
           "Metric", "PruningCurve", "PruningData", "attach_head_map", "evaluate_masks", "head_importance", "head_map_of",
           "load_pruned", "original_heads", "present_heads", "prune_by_importance", "prune_heads", "pruning_schedule",
           "save_pruned", "token_batches"]
