"""Renders the attention/ablation/patching figures of README.md and docs/analyses.md:
python docs/figures/heads.py [checkpoint_dir] [out_dir] (default: the bundled model, docs/images).
PNGs need kaleido 0.2.1 (plotly's own write_image wants kaleido>=1 and Chrome)."""
import json
import os
import sys
from pathlib import Path

import plotly
import torch

from probe.analyses import (attention_patterns, compare_patching, head_ablation_effects, head_scores, logit_diff_metric,
                      patch, token_batches)
from probe import DEFAULT_MODEL, HookedDecoder

path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL
out = Path(sys.argv[2] if len(sys.argv) > 2 else Path(__file__).resolve().parent.parent / "images")
out.mkdir(parents=True, exist_ok=True)
model = HookedDecoder.from_pretrained(path).eval()


def save(fig, name):
    fig.write_html(out / f"{name}.html", include_plotlyjs="cdn")
    from kaleido.scopes.plotly import PlotlyScope

    js = os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js")
    png = PlotlyScope(plotlyjs=js).transform(json.loads(fig.to_json()), format="png",
                                             width=fig.layout.width or 800, height=fig.layout.height or 500)
    (out / f"{name}.png").write_bytes(png)


induction = head_scores(model, "induction")
print("induction:\n", induction.top(3), "\nprevious token:\n", head_scores(model, "previous_token").top(3))
save(induction.figure(), "induction_scores")

prompt = "ROMEO: But soft, what light through yonder window breaks? ROMEO: But soft, what light"
patterns = attention_patterns(model, prompt)
best = induction.top(1).iloc[0]
save(patterns.figure(layer=int(best.layer), head=int(best["head"])), "induction_head_pattern")
save(patterns.figure(), "all_heads")

# 24 windows of 128 held-out tokens: one window's ranking of heads is noisy (in one, head 0.3 came out on top)
tokens = torch.cat(token_batches(model, None, seq_len=min(128, model.cfg.n_ctx), max_windows=24))
effects = head_ablation_effects(model, tokens)
print("ablation:\n", effects.to_frame().nlargest(3, "effect"))
save(effects.figure(), "ablation_loss")

# induction-style patching: corrupt the earlier " light", measure the logit of " light" over " sun" at the end
clean = model.to_tokens("ROMEO: But soft, what light through yonder window breaks? ROMEO: But soft, what")
strings = model.to_str_tokens(clean[0])
corrupted = clean.clone()
corrupted[0, strings.index(" light")] = model.tokenizer.encode(" sun")[0]
metric = logit_diff_metric(model, " light", " sun")
exact = patch(model, clean, corrupted, metric, sites="heads")
estimate = patch(model, clean, corrupted, metric, sites="heads", method="attribution")
print(f"logit diff clean {exact.clean:.3f} corrupted {exact.corrupted:.3f}")
save(exact.figure(), "patching_heads")
save(compare_patching(exact, estimate), "attribution_vs_exact")
save(patch(model, clean, corrupted, metric, sites="resid_pre").figure(), "patching_resid")
