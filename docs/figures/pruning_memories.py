"""PNGs for the README's pruning and memories sections, from the bundled model (kaleido 0.2.1)."""
import json, os
from pathlib import Path
import plotly, torch
from probe import DEFAULT_MODEL, HookedDecoder
from probe.analyses import memory_lookup, prune_by_importance, token_batches

out = Path(__file__).resolve().parent.parent / "images"
model = HookedDecoder.from_pretrained(DEFAULT_MODEL).eval()

def png(fig, name, width=900, height=500):
    from kaleido.scopes.plotly import PlotlyScope
    js = os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js")
    (out / f"{name}.png").write_bytes(PlotlyScope(plotlyjs=js).transform(json.loads(fig.to_json()), format="png", width=width, height=height))

lookup = memory_lookup(model, "KING.\nWhat news, my lord?\n\nMESSENGER.\nMy lord, the", k=6, layer=[2, 3])
png(lookup.figure(), "memory_lookup", height=650)
print(lookup.to_frame().head(6).to_string())
windows = torch.cat(token_batches(model, None, seq_len=128, max_windows=24))
# 5 random seeds: the recipe docs/analyses.md states for its table, so the figure and the table agree
curve = prune_by_importance(model, windows[:12], windows[12:], step=0.1, seeds=(0, 1, 2, 3, 4), progress=False)
png(curve.figure(), "pruning_curve", width=1000, height=450)
# the rows of docs/analyses.md's pruning table, as markdown
for step, n in enumerate(curve.n_pruned.tolist()):
    rand = curve.random_loss[:, step]
    print(f"| {n}/{curve.n_heads} ({n / curve.n_heads:.0%}) | {curve.loss[step]:.3f} | {curve.accuracy[step]:.3f} | "
          f"{rand.mean():.3f} ({rand.min():.3f}-{rand.max():.3f}) | {curve.random_accuracy[:, step].mean():.3f} | "
          f"{curve.ablation_loss[step]:.3f} | {curve.ablation_accuracy[step]:.3f} |")
print("importance order, heads masked per step:", [(int(n), heads) for n, heads in zip(curve.n_pruned, curve.pruned)])
print("single-head ablation order:", curve.orders["single-head ablation"])
