"""PNGs for the README's pruning and memories sections, from the bundled model (kaleido 0.2.1)."""
import json, os
from pathlib import Path
import plotly, torch
from probe import DEFAULT_MODEL, HookedDecoder
from analyses import memory_lookup, prune_by_importance, token_batches

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
curve = prune_by_importance(model, windows[:12], windows[12:], step=0.1, seeds=(0, 1, 2), progress=False)
png(curve.figure(), "pruning_curve", width=1000, height=450)
print(curve.to_frame().head())
