"""probe report: the main job. Every analysis on one prompt, in one self-contained HTML report, plus CSVs.

Sections: the model, its next-token prediction, the logit lens, direct logit attribution, attention
patterns, head detectors, head ablation, activation patching (with --corrupted), FFN memories and
head importance; with --sae, a section per sparse autoencoder. The page embeds plotly.js once, so it
opens offline.

examples:
  probe report                                        # the bundled model on a default prompt
  probe report --prompt "JULIET. O Romeo, Romeo, wherefore art thou" --out runs/report
  probe report --prompt "Romeo, Romeo, Romeo," --corrupted "Juliet, Juliet, Juliet," --answer " Romeo" --counterfactual " Juliet"
"""
from __future__ import annotations

import argparse
import html
import sys
import time
from pathlib import Path


from probe.cli.common import CommandError, Output, check_prompt, command, default_out, load_model, load_sae, log, model_label, token_id, check_contrast

DEFAULT_PROMPT = ("ROMEO.\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
                  "ROMEO.\nBut soft, what light through yonder")

STYLE = """
body { font-family: system-ui, sans-serif; margin: 0; color: #222; }
nav { position: fixed; top: 0; left: 0; width: 230px; height: 100vh; overflow-y: auto; background: #f4f4f6; padding: 1em; box-sizing: border-box; }
nav a { display: block; color: #334; text-decoration: none; margin: .3em 0; }
main { margin-left: 250px; padding: 1em 2em; max-width: 1400px; }
section { margin-bottom: 3em; }
.figure { overflow-x: auto; }
table { border-collapse: collapse; font-size: 13px; margin: .5em 0; }
td, th { border: 1px solid #ddd; padding: 2px 6px; text-align: right; }
th { background: #f0f0f0; }
pre { background: #f7f7f7; padding: .6em; white-space: pre-wrap; }
.note { color: #666; font-size: 13px; }
"""


SKIPPABLE = ("memories", "importance")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt (default: a Shakespeare line, repeated so induction shows)")
    parser.add_argument("--answer", default=None, help="token to attribute (default: the model's prediction)")
    parser.add_argument("--counterfactual", default=None, help="token to contrast with (default: the model's second choice)")
    parser.add_argument("--corrupted", default=None, help="a corrupted prompt of the same length, for activation patching")
    parser.add_argument("--skip", nargs="*", default=[], choices=SKIPPABLE, help="slow sections to leave out: " + ", ".join(SKIPPABLE))
    parser.add_argument("--sae", nargs="+", default=[], metavar="DIR",
                        help="sparse autoencoders (SAELens directories, or `bundled` for the bundled model's shipped "
                             "residual SAE) for this model: a section each")


class Report:
    def __init__(self, title: str):
        self.title = title
        self.sections: list[tuple[str, str, list[str]]] = []

    def section(self, anchor: str, heading: str) -> list[str]:
        parts: list[str] = []
        self.sections.append((anchor, heading, parts))
        return parts

    def render(self) -> str:
        from plotly.offline import get_plotlyjs

        nav = "".join(f'<a href="#{a}">{html.escape(h)}</a>' for a, h, _ in self.sections)
        body = "".join(f'<section id="{a}"><h2>{html.escape(h)}</h2>{"".join(parts)}</section>' for a, h, parts in self.sections)
        return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(self.title)}</title>"
                f"<style>{STYLE}</style><script>{get_plotlyjs()}</script></head>"
                f"<body><nav><b>Contents</b>{nav}</nav><main><h1>{html.escape(self.title)}</h1>{body}</main></body></html>")


def figure_html(fig) -> str:
    return '<div class="figure">' + fig.to_html(full_html=False, include_plotlyjs=False) + "</div>"


def set_fields(cfg, config):
    """The config table's rows worth reading: the shape, then every field not at DecoderConfig's default (a new
    family's distinctive fields come late in a long list, and a cut at a row count hid them)."""
    import dataclasses

    # (architecture fields only: the loaded model's name and path are not, and the page names no local path)
    defaults = {f.name: f.default for f in dataclasses.fields(cfg) if f.compare}
    shape = {"n_layers", "d_model", "n_heads", "d_vocab", "n_ctx", "d_head", "d_mlp", "n_kv_heads"}
    keep = [name in shape or str(value) != str(getattr(defaults[name], "value", defaults[name]))
            for name, value in zip(config["field"], config["value"]) if name in defaults or name in shape]
    config = config[config["field"].isin(defaults)]
    return config[keep]


def table_html(frame, rows: int = 15) -> str:
    return frame.head(rows).to_html(index=False, escape=True, float_format=lambda v: f"{v:.4g}", border=0)


def note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def shown_path(given: str) -> str:
    """A model or SAE as the report names it: never an absolute local path (a report is shared; the reader's
    disk is not the writer's). The bundled model by name, another absolute path by its last part."""
    from probe.bundled import DEFAULT_MODEL

    if given == DEFAULT_MODEL:
        return f"the bundled model ({Path(given).name})"
    return f"…/{Path(given).name}" if Path(given).is_absolute() else given


def run(args: argparse.Namespace) -> int:
    import torch

    import probe.analyses as A
    from probe.analyses.ablation import loss_metric
    from probe.analyses.common import token_strings
    from probe.analyses.labels import shown_token

    started = time.perf_counter()
    out = Output(default_out(args, "report"), args.force)
    model = load_model(args)
    check_prompt(model, args.prompt)
    tokens, mask = model.to_tokens(args.prompt, return_attention_mask=True)
    if tokens.shape[1] < 2:  # the loss and the lens need a token after BOS; fail before any section writes
        raise CommandError("--prompt is empty; give at least one token of text")
    corrupted = None
    if args.corrupted:  # checked before any analysis runs, so a mistake costs no time
        check_prompt(model, args.corrupted)
        corrupted = model.to_tokens(args.corrupted)
        if corrupted.shape != tokens.shape:
            raise CommandError(f"--corrupted is {corrupted.shape[1]} tokens but --prompt is {tokens.shape[1]}; they must be equal")
        if torch.equal(corrupted, tokens):  # patching would fail only after every other section had run and written
            raise CommandError("--corrupted is the same tokens as --prompt; patching needs them to differ")
    with torch.no_grad():
        logits = model(tokens)
    probs = logits[0, -1].float().softmax(-1)
    top = probs.topk(10)
    def strings(ids):  # partial UTF-8 characters as <0xE2>, not U+FFFD
        return token_strings(model, ids)

    answer = token_id(model, args.answer, "--answer") if args.answer else int(top.indices[0])
    if args.counterfactual:
        counterfactual = token_id(model, args.counterfactual, "--counterfactual")
    else:  # the model's best guess other than the answer (which may itself be the top guess)
        counterfactual = next(int(t) for t in top.indices if int(t) != answer)
    check_contrast(model, answer, counterfactual)
    saes = [load_sae(model, directory) for directory in args.sae]  # before any section: a bad directory costs nothing
    report = Report(f"probe report: {Path(model_label(args)).name}")
    timings = {}

    def timed(name):
        class Timer:
            def __enter__(self):
                self.t = time.perf_counter()
                log(args, f"{name}...")

            def __exit__(self, *exc):
                timings[name] = time.perf_counter() - self.t

        return Timer()

    with timed("model"):
        import pandas as pd

        from probe.cli.anatomy import anatomy_tables

        config, ledger, summary, _ = anatomy_tables(model, None)
        part = report.section("model", "The model")
        shown = shown_path(str(args.model)) + (f"@{args.revision}" if getattr(args, "revision", None) else "")
        part += [f"<pre>{html.escape(shown)}</pre>", table_html(summary, 20), table_html(set_fields(model.cfg, config), 60)]
        out.write_csv("ledger.csv", ledger)
        prompt_part = report.section("prompt", "Prompt and prediction")
        prediction = pd.DataFrame({"token": strings(top.indices.tolist()), "id": top.indices.tolist(), "probability": top.values.tolist()})
        prompt_part += [f"<pre>{html.escape(args.prompt)}</pre>",
                        note(f"{tokens.shape[1]} tokens; loss {float(loss_metric(logits, tokens, mask)[0]):.3f} nats/token. "
                             f"Attributions below use answer {strings([answer])[0]!r} vs {strings([counterfactual])[0]!r}."),
                        table_html(prediction.assign(token=[shown_token(t) for t in prediction["token"]]))]  # ␣ for spaces
        out.write_csv("prediction.csv", prediction)

    with timed("logit lens"):
        lens = A.logit_lens(model, tokens, target=answer)
        part = report.section("lens", "Logit lens")
        part += [note("What the residual stream after each layer decodes to through the final norm and unembedding."),
                 figure_html(lens.figure()), figure_html(lens.figure(kind="target"))]
        out.write_csv("logit_lens.csv", lens.to_frame())

    if model.cfg.shared_blocks is not None:  # (Zamba2's shared blocks write into their mixers' inputs)
        report.section("attribution", "Direct logit attribution").append(note(
            "Not run: direct logit attribution takes the residual stream for the sum of its writers' outputs, and this "
            "model's shared transformer blocks (Zamba2's) write into their layer's Mamba-2 mixer's input, not into "
            "the residual stream; the logit lens above and the patching below cover its layers."))
    elif model.cfg.prediction_head is not None:  # (ModernBERT decoder's dense, activation and LayerNorm before W_U)
        report.section("attribution", "Direct logit attribution").append(note(
            "Not run: direct logit attribution splits the logits into each writer's share through W_U, and this "
            "model's final norm feeds a prediction head (a dense layer, an activation and a LayerNorm) before W_U, so "
            "its logits are no linear function of the residual stream; the logit lens above (through the head) and "
            "the patching below cover its layers and heads."))
    else:
        with timed("attribution"):
            dla = A.direct_logit_attribution(model, tokens, answer, counterfactual)
            part = report.section("attribution", "Direct logit attribution")
            part += [note("Each component's direct contribution to the logit difference, final-norm scale frozen; rows sum to the model's own value."),
                     figure_html(dla.figure("bar")), figure_html(dla.figure("heads")), figure_html(dla.figure("accumulated"))]
            out.write_csv("attribution.csv", dla.to_frame())

    # a hybrid's linear-attention layers (Qwen3.5) have no heads: the analyses of every layer's heads say so instead
    from probe.analyses.architecture import headless_layers
    from probe.analyses.edge_attribution import circuit_refusal

    linear, kind = headless_layers(model)  # (and NemotronH's MLP-only layers)
    headless = ("Not run: {} reads every layer's attention heads, and layers " + str(linear) + " of this hybrid model are "
                f"{kind} layers, which have none; the analyses by layer cover them.")
    if len(linear) < model.cfg.n_layers:
        attention_sections(model, tokens, report, out, timed)  # (a hybrid's: the layers that attend)
    else:  # (Mamba-2's own models: no layer attends)
        for key, title in (("attention", "Attention patterns"), ("attention-view", "Attention, token by token")):
            report.section(key, title).append(note(headless.format("attention patterns")))
    if linear:
        for key, title, what in (("detectors", "Head detectors", "each head detector"),
                                 ("ablation", "Head ablation", "head ablation")):
            report.section(key, title).append(note(headless.format(what)))
    else:
        head_sections(model, tokens, args, report, out, timed)

    part = report.section("patching", "Activation patching")
    if corrupted is not None:
        with timed("patching"):
            metric = A.logit_diff_metric(model, answer, counterfactual)
            sites = "resid_pre" if linear else "heads"  # (a hybrid's residual stream, position by position)
            exact = A.patch(model, tokens, corrupted, metric, sites)
            estimate = A.patch(model, tokens, corrupted, metric, sites, method="attribution")
            part += [figure_html(exact.figure()), figure_html(A.compare_patching(exact, estimate))]
            out.write_csv("patching.csv", exact.to_frame())
        part = report.section("circuit", "Circuit (edge attribution, EAP-IG)")
        refusal = circuit_refusal(model)  # (the analyses' own reasons: latent attention, Gemma 4, Falcon-H1, ...)
        if refusal is not None:
            part += [note(f"Not run. {refusal[0].upper()}{refusal[1:].rstrip('.')}.")]
        else:
            with timed("circuit"):
                scores = A.edge_attribution(model, tokens, corrupted, metric, method="eap-ig-inputs")
                circuit = scores.circuit(n_edges=min(50, scores.graph.n_edges))
                kept = A.faithfulness(model, circuit, tokens, corrupted, metric)
                curve = A.faithfulness_curve(model, scores, tokens, corrupted, metric, n_random=2)
                part += [note(f"The {circuit.n_edges} edges that matter most for the logit difference keep "
                              f"{kept.value:.1%} of it (clean {kept.clean:.3f}, corrupted {kept.ablated:.3f}); "
                              f"probe circuit draws more."),
                         figure_html(circuit.figure()), figure_html(curve.figure())]
                out.write_csv("edges.csv", scores.to_frame())
                out.write_csv("faithfulness.csv", curve.to_frame())
    else:
        part += [note("Not run: activation patching needs a corrupted prompt. Rerun with --corrupted \"...\" (a prompt of "
                      f"the same length, {tokens.shape[1]} tokens with BOS) to patch this prompt's activations into it, "
                      "e.g. the prompt with one name changed.")]

    # FFN neurons to read: one MLP per layer, all of one width (Gemma 4's last layers may be twice as wide)
    widths = {model.cfg.layer_d_mlp(layer) for layer in range(model.cfg.n_layers)}
    ffn = not (model.cfg.attn_only or model.cfg.experts is not None or len(widths) > 1 or model.cfg.rwkv is not None)
    if model.cfg.experts is not None:
        with timed("routing"):
            routing = A.expert_routing(model, tokens)
            part = report.section("routing", "Expert routing")
            experts = model.cfg.experts
            scores = "softmax" if experts.scoring == "softmax" else "sigmoid scores"
            part += [note(f"Each token runs through {experts.per_token} of each "
                          f"{'' if experts.layers is None else 'sparse '}layer's {experts.n} experts, chosen by the "
                          f"router's {scores}."), figure_html(routing.figure())]
            out.write_csv("routing.csv", routing.to_frame())
    if "memories" not in args.skip and not ffn:
        part = report.section("memories", "FFN memories")
        part += [note("Not run: FFN memories read each layer's one MLP, and this model's " + (
            "MLPs are RWKV channel mixes, which gate each value vector's write channel by channel by a receptance of "
            "the shifted input." if model.cfg.rwkv is not None else
            ("blocks have none (attention or state-space mixers only)." if model.cfg.shared_blocks is None else
             "layers have none of their own (their shared blocks' MLPs write into the mixers' inputs).")
            if model.cfg.attn_only else
            ("MLPs are" if model.cfg.experts.layers is None else "sparse layers' MLPs are") +
            " mixtures of experts, whose neurons see only the tokens routed to them: the routing is above."
            if model.cfg.experts is not None else f"MLPs differ in width between layers ({sorted(widths)} neurons)."))]
    elif "memories" not in args.skip and model.cfg.prediction_head is not None:
        report.section("memories", "FFN memories").append(note(
            "Not run: FFN memories read each value vector's tokens through W_U (v W_U), and this model's prediction "
            "head (a dense layer, an activation and a LayerNorm before W_U) makes the logits no linear function of "
            "what a value writes."))
    elif "memories" not in args.skip:
        with timed("memories"):
            lookup = A.memory_lookup(model, tokens, k=8)
            part = report.section("memories", "FFN memories")
            part += [note("The FFN memories firing at the last position, by the size of their sub-update."), figure_html(lookup.figure())]
            out.write_csv("memories.csv", lookup.to_frame())

    if "importance" not in args.skip and linear:
        report.section("importance", "Head importance").append(note(headless.format("head importance")))
    elif "importance" not in args.skip:
        with timed("importance"):
            importance = A.head_importance(model, max_windows=8, progress=False)
            part = report.section("importance", "Head importance")
            part += [note("Michel et al. (2019): mean |dL/dξ| of each head's mask on held-out text, normalised per layer."),
                     figure_html(importance.figure())]
            out.write_csv("importance.csv", importance.to_frame())

    for index, sae in enumerate(saes):
        with timed(f"sae {index}"):
            found = A.sae_features(model, sae, tokens, k=min(8, sae.cfg.d_sae))
            active = [f for f in found.top_ids[0, -1].tolist() if f >= 0]
            loss = A.sae_loss_recovered(model, sae, tokens)
            part = report.section(f"sae{index}", f"Sparse autoencoder at {sae.cfg.hook_name}")  # render escapes
            part += [note(f"{shown_path(args.sae[index])}: d_sae {sae.cfg.d_sae}, {sae.cfg.architecture}. At the last "
                          f"position L0 {int(found.l0[0, -1])}, reconstruction error {float(found.fvu[0, -1]):.3g} (FVU); "
                          f"loss clean {float(loss.clean[0]):.3f}, with the SAE {float(loss.spliced[0]):.3f}, hook zeroed "
                          f"{float(loss.zero_ablated[0]):.3f}: {float(loss.recovered[0]):.2f} of the loss recovered."),
                     figure_html(found.figure(max_features=40))]
            if active:
                logits = A.feature_logits(model, sae, active, k=min(8, model.cfg.d_vocab_out))
                part += [note("The tokens the last position's top features write (decoder rows through the final norm and W_U)."),
                         figure_html(logits.figure())]
                out.write_csv(f"sae{index}_feature_logits.csv", logits.to_frame())
            out.write_csv(f"sae{index}_features.csv", found.to_frame())

    timing = pd.DataFrame({"section": list(timings), "seconds": list(timings.values())})
    report.section("timing", "Timing").extend([table_html(timing, 50)])
    out.write_text("report.html", report.render())
    out.report(args)
    log(args, f"report done in {time.perf_counter() - started:.1f} s: open {out.path('report.html')}")
    return 0



def attention_sections(model, tokens, report, out, timed) -> None:
    """Attention patterns, as figures and token by token (a hybrid model's: its attention layers')."""
    import probe.analyses as A

    with timed("attention"):
        patterns = A.attention_patterns(model, tokens)
        part = report.section("attention", "Attention patterns")
        part += [figure_html(patterns.figure())]
        out.write_csv("patterns.csv", patterns.to_frame())
        part = report.section("attention-view", "Attention, token by token")  # interactive: no plotly, no network
        part += [A.AttentionView.from_patterns(patterns).to_html(title="Pick a layer and a head; hover a token")]


def head_sections(model, tokens, args, report, out, timed) -> None:
    """The analyses of every layer's attention heads: detectors and single-head ablation."""
    import probe.analyses as A

    with timed("head detectors"):
        part = report.section("detectors", "Head detectors")
        for kind in ("previous_token", "induction", "duplicate_token", "first_token"):
            scores = A.head_scores(model, kind, n_samples=16, seed=args.seed)
            part += [figure_html(scores.figure())]
            out.write_csv(f"heads_{kind}.csv", scores.to_frame())
            best = scores.top(1).iloc[0]
            part += [note(f"strongest {kind.replace('_', '-')} head: {best['label']} ({best['score']:.2f})")]

    with timed("ablation"):
        effects = A.head_ablation_effects(model, tokens)
        part = report.section("ablation", "Head ablation")
        part += [note("The change in the prompt's loss when each head alone is zero-ablated."), figure_html(effects.figure())]
        out.write_csv("ablation.csv", effects.to_frame())


build_parser, main = command(__doc__, "probe report", add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
