"""Benchmark workloads of the plain forward and caching: probe vs transformers and transformer-lens
(workloads 1-4), a structurally pruned forward (10), loading (11), a hybrid linear-attention model (18),
launch-bound 1 x 16 shapes (21, 22) and compiled forwards (23)."""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable, Optional

from probe.cli.bench_harness import (HF, LAUNCH_SHAPE, PROBE, TL, Case, Context, all_of, at_most, is_resid, mib, no_grad,
                                     workload)


@workload("forward", 1, "Forward, no hooks", "probe <= 1.05x transformers", floor="transformers forward",
          check=at_most("probe forward", "transformers forward", 1.05))
def forward(ctx: Context) -> list[Case]:
    probe, hf, tl = ctx.probe_model(), ctx.hf_model(), ctx.tl_model()
    tokens = ctx.tokens()
    pattern_hook = [(lambda name: name.endswith("hook_pattern"), lambda pattern, hook: None)]
    return [
        Case("transformers forward", HF, no_grad(lambda: hf(tokens, use_cache=False).logits),
             note="GPT2LMHeadModel, sdpa attention, use_cache=False"),
        Case("probe forward", PROBE, no_grad(lambda: probe(tokens))),
        Case("transformer-lens forward", TL, no_grad(lambda: tl(tokens)), note="TransformerBridge.boot_transformers"),
        Case("probe forward, pattern hooked", PROBE, no_grad(lambda: probe.run_with_hooks(tokens, fwd_hooks=pattern_hook)),
             note="a no-op hook on every hook_pattern: the explicit-attention path instead of the fused kernel"),
    ]


@workload("cache_all", 2, "run_with_cache of every hook",
          "time <= transformer-lens; memory the cache holds <= 0.5x transformer-lens's",
          floor="transformer-lens run_with_cache",
          check=all_of(
              at_most("probe run_with_cache", "transformer-lens run_with_cache", 1.0),
              lambda rows: extra_memory_check(rows)))
def cache_all(ctx: Context) -> list[Case]:
    import torch

    probe, tl = ctx.probe_model(), ctx.tl_model()
    tokens = ctx.tokens()
    cases = [
        Case("probe forward", PROBE, no_grad(lambda: probe(tokens)), timed=False,
             note="memory baseline for the cache's extra memory"),
        Case("probe run_with_cache", PROBE, no_grad(lambda: probe.run_with_cache(tokens, max_cache_bytes=math.inf)),
             note="names=None: every hook except the opt-in per-head hook_result; no size limit (a 16 x 1024 "
                  "GPT-2-small cache is ~29 GiB, over the default 8 GiB refusal)"),
        Case("transformer-lens forward", TL, no_grad(lambda: tl(tokens)), timed=False,
             note="memory baseline for the cache's extra memory"),
        Case("transformer-lens run_with_cache", TL, no_grad(lambda: tl.run_with_cache(tokens))),
    ]
    if ctx.dtype == "float32":
        cases.insert(2, Case("probe run_with_cache, bfloat16 storage", PROBE,
                             no_grad(lambda: probe.run_with_cache(tokens, dtype=torch.bfloat16, max_cache_bytes=math.inf)),
                             note="the model runs in float32; the cache is stored in bfloat16"))
    return cases


def extra_memory_check(rows: dict[str, dict]) -> list[dict]:
    """The cache's memory: the bytes of the distinct storages it holds beyond the returned logits
    (exact, and what stays allocated while it is kept; see `cache_stats`). The rise of the peak above
    the same library's forward is reported beside it, but depends on what the allocator reuses
    (transformer-lens's forward peak is higher, so less of its cache shows as a rise), so the verdict
    is on the bytes held."""

    def peak_rise(library: str, label: str) -> Optional[float]:
        cache, plain = rows.get(label, {}), rows.get(f"{library} forward", {})
        if cache.get("peak_extra_bytes") is None or plain.get("peak_extra_bytes") is None:
            return None
        return cache["peak_extra_bytes"] - plain["peak_extra_bytes"]

    tl_label = f"{TL} run_with_cache"
    theirs = rows.get(tl_label, {}).get("cache_bytes")
    verdicts = []
    for label in (f"{PROBE} run_with_cache", f"{PROBE} run_with_cache, bfloat16 storage"):
        if label not in rows:
            continue
        ours = rows[label].get("cache_bytes")
        ratio = ours / theirs if ours is not None and theirs else None
        verdicts.append(dict(measure=f"cache memory held: {label} / {tl_label}", ratio=ratio, limit=0.5,
                             met=None if ratio is None else ratio <= 0.5,
                             detail=f"{mib(ours)} vs {mib(theirs)}; peak rise above the forward "
                                    f"{mib(peak_rise(PROBE, label))} vs {mib(peak_rise(TL, tl_label))}"))
    return verdicts


@workload("cache_resid", 3, "run_with_cache of the residual stream only", "probe <= 1.05x probe's plain forward",
          floor="probe forward", check=at_most("probe run_with_cache, residual stream", "probe forward", 1.05))
def cache_resid(ctx: Context) -> list[Case]:
    probe, hf = ctx.probe_model(), ctx.hf_model()
    tokens = ctx.tokens()
    return [
        Case("probe forward", PROBE, no_grad(lambda: probe(tokens))),
        Case("probe run_with_cache, residual stream", PROBE, no_grad(lambda: probe.run_with_cache(tokens, names=is_resid)),
             note="hook_resid_pre, hook_resid_mid, hook_resid_post of every block"),
        Case("transformers forward", HF, no_grad(lambda: hf(tokens, use_cache=False).logits)),
        Case("transformers output_hidden_states", HF,
             no_grad(lambda: hf(tokens, use_cache=False, output_hidden_states=True)),
             ratio_to="transformers forward", note="the residual entering each block, and the final norm's output"),
    ]


@workload("small_cache", 4, "Small model, run_with_cache of everything vs a plain forward",
          "probe <= 1.5x its plain forward (transformer-lens pays about 2.3x on a 2-layer model)",
          floor="probe forward", check=at_most("probe run_with_cache", "probe forward", 1.5), model="small", shape="small")
def small_cache(ctx: Context) -> list[Case]:
    probe, tl, hf = ctx.probe_model(), ctx.tl_model(), ctx.hf_model()
    tokens = ctx.tokens()
    return [
        Case("probe forward", PROBE, no_grad(lambda: probe(tokens))),
        Case("probe run_with_cache", PROBE, no_grad(lambda: probe.run_with_cache(tokens))),
        Case("transformer-lens forward", TL, no_grad(lambda: tl(tokens))),
        Case("transformer-lens run_with_cache", TL, no_grad(lambda: tl.run_with_cache(tokens)),
             ratio_to="transformer-lens forward"),
        Case("transformers forward", HF, no_grad(lambda: hf(tokens, use_cache=False).logits)),
    ]


@workload("pruned_forward", 10, "Forward of a structurally pruned model: 25/50/75% of every layer's heads removed",
          "report: what pruning buys (half the heads pruned should not be slower)", floor="probe forward, unpruned",
          check=at_most("probe forward, 50% of heads pruned", "probe forward, unpruned", 1.0))
def pruned_forward(ctx: Context) -> list[Case]:
    from probe.analyses import prune_heads

    probe, tokens = ctx.probe_model(), ctx.tokens()
    cfg = probe.cfg
    cases = [Case("probe forward, unpruned", PROBE, no_grad(lambda: probe(tokens)))]
    for fraction in (0.25, 0.5, 0.75):
        k = round(fraction * cfg.n_heads)  # speed depends only on how many heads remain, not which
        pruned = prune_heads(probe, [(l, h) for l in range(cfg.n_layers) for h in range(k)]).eval()
        # labelled with the fraction actually removed: with 6 heads a layer, "25%" is 2 of 6
        cases.append(Case(f"probe forward, {k / cfg.n_heads:.0%} of heads pruned", PROBE, no_grad(lambda m=pruned: m(tokens))))
    return cases


def first_forward(model_fn: Callable[[], Any], ctx: Context, hf: bool) -> Callable[[], Any]:
    """Load, then run one token: a lazily (memory-mapped) loaded model pays for reading its weights here."""
    import torch

    token = ctx.tokens(batch=1, seq=1)

    def run():
        model = model_fn()
        with torch.no_grad():
            model(token, use_cache=False) if hf else model(token)
        return model

    return run



@workload("load", 11, "Loading a checkpoint directory", "probe <= 1.2x transformers' from_pretrained",
          floor="transformers from_pretrained",
          check=all_of(at_most("probe from_pretrained", "transformers from_pretrained", 1.2),
                        at_most("probe from_pretrained + one-token forward",
                                 "transformers from_pretrained + one-token forward", 1.2)))
def load(ctx: Context) -> list[Case]:
    both = "transformers from_pretrained + one-token forward"
    ctx.tl_bridge()  # loading happens only when timed: find out now whether transformer-lens imports
    return [
        Case("transformers from_pretrained", HF, ctx.hf_model),
        Case("probe from_pretrained", PROBE, ctx.probe_model),
        Case("transformer-lens boot_transformers", TL, ctx.tl_model),  # dropped if tl_bridge() found none
        Case(both, HF, first_forward(ctx.hf_model, ctx, hf=True), ratio_to=both,
             note="includes touching every weight once"),
        Case("probe from_pretrained + one-token forward", PROBE, first_forward(ctx.probe_model, ctx, hf=False), ratio_to=both),
    ]



# ---- launch-bound shapes: what Python and kernel launches cost around a forward -------------------------------
LAUNCH_BATCH, LAUNCH_SEQ = LAUNCH_SHAPE
ONE_HOOK = "blocks.0.hook_resid_post"


def launch_cases(ctx: Context) -> list[Case]:
    probe = ctx.probe_model()
    tokens = ctx.tokens()
    one_hook = [(ONE_HOOK, lambda resid, hook: None)]
    return [
        Case("probe forward", PROBE, no_grad(lambda: probe(tokens))),
        Case("probe run_with_hooks, one hook", PROBE, no_grad(lambda: probe.run_with_hooks(tokens, fwd_hooks=one_hook)),
             note=f"a no-op hook on {ONE_HOOK}: what a call scope and one hook cost"),
        Case("probe run_with_cache, residual stream", PROBE, no_grad(lambda: probe.run_with_cache(tokens, names=is_resid))),
        Case("probe run_with_cache", PROBE, no_grad(lambda: probe.run_with_cache(tokens)),
             note="every hook but the opt-in ones: the norms' and attention's explicit paths run"),
    ]


LAUNCH_CHECK = all_of(at_most("probe run_with_hooks, one hook", "probe forward", 1.05),
                      at_most("probe run_with_cache", "probe forward", 1.5))


@workload("launch_small", 21, f"Launch-bound: the bundled model at {LAUNCH_BATCH} x {LAUNCH_SEQ} tokens, hooks and caches "
          "vs the plain forward", "one hook <= 1.05x the forward; run_with_cache of everything <= 1.5x",
          floor="probe forward", check=LAUNCH_CHECK, model="small", shape="launch")
def launch_small(ctx: Context) -> list[Case]:
    return launch_cases(ctx)


@workload("launch_main", 22, f"Launch-bound: the main (GPT-2-small) shape at {LAUNCH_BATCH} x {LAUNCH_SEQ} tokens, hooks "
          "and caches vs the plain forward", "one hook <= 1.05x the forward; run_with_cache of everything <= 1.5x",
          floor="probe forward", check=LAUNCH_CHECK, shape="launch")
def launch_main(ctx: Context) -> list[Case]:
    return launch_cases(ctx)


# set to 1 to run workload 23's "compiled" cases eagerly (the suite checks the workload's shape, not torch.compile)
EAGER_ONLY = "PROBE_BENCH_EAGER_ONLY"


@workload("compiled", 23, f"torch.compile of the bundled model's forward and run_with_cache at {LAUNCH_BATCH} x "
          f"{LAUNCH_SEQ} tokens (CUDA graphs on CUDA)",
          "report: compiled vs eager (compile time excluded, in the notes); compiled run_with_cache <= 1.5x the eager "
          "forward", floor="probe forward", check=at_most("probe run_with_cache, compiled", "probe forward", 1.5),
          model="small", shape="launch")
def compiled(ctx: Context) -> list[Case]:
    import torch

    from probe.compiled import compile_forwards

    probe = ctx.probe_model()
    tokens = ctx.tokens()
    mode = "reduce-overhead" if ctx.device.startswith("cuda") else None  # CUDA graphs where there are any
    if os.environ.get(EAGER_ONLY) == "1":
        fast, how = probe, f"run eagerly ({EAGER_ONLY}=1)"
    else:
        fast = compile_forwards(probe, mode=mode)
        with torch.no_grad():
            started = time.perf_counter()
            fast(tokens)  # compiles; the second call below checks it needs no second compile
            compile_s = time.perf_counter() - started
            started = time.perf_counter()
            fast.run_with_cache(tokens)
            cache_compile_s = time.perf_counter() - started
        how = (f"torch.compile(mode={mode!r}); compile + first call {compile_s:.1f} s (forward), "
               f"{cache_compile_s:.1f} s (run_with_cache), excluded from the times")
    return [
        Case("probe forward", PROBE, no_grad(lambda: probe(tokens)), note="eager"),
        Case("probe forward, compiled", PROBE, no_grad(lambda: fast(tokens)), note=how),
        Case("probe run_with_cache", PROBE, no_grad(lambda: probe.run_with_cache(tokens)), note="eager"),
        Case("probe run_with_cache, compiled", PROBE, no_grad(lambda: fast.run_with_cache(tokens)), note=how),
    ]


@workload("hybrid_forward", 18, "Forward of a hybrid linear-attention model (Qwen3.5's layers at the main shape's width "
          "and depth)", "probe <= 1.1x transformers", floor="transformers forward",
          check=at_most("probe forward", "transformers forward", 1.1))
def hybrid_forward(ctx: Context) -> list[Case]:
    import transformers

    main = json.loads((ctx.path / "config.json").read_text())
    d_model, heads = main["n_embd"], main["n_head"]
    config = transformers.Qwen3_5TextConfig(
        vocab_size=main["vocab_size"], hidden_size=d_model, intermediate_size=4 * d_model,
        num_hidden_layers=max(4, main["n_layer"]), num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        head_dim=d_model // heads, linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads,
        linear_key_head_dim=d_model // heads, linear_value_head_dim=d_model // heads,
        max_position_embeddings=max(ctx.seq, main["n_positions"]))
    hf, probe = random_pair(ctx, transformers.Qwen3_5ForCausalLM, config)
    tokens = ctx.tokens()
    return [
        Case("transformers forward", HF, no_grad(lambda: hf(tokens, use_cache=False).logits),
             note="Qwen3_5ForCausalLM: three Gated DeltaNet layers in four (its chunked torch recurrence; no "
                  "flash-linear-attention kernels installed), gated attention in the fourth"),
        Case("probe forward", PROBE, no_grad(lambda: probe(tokens)), note="gated_delta_rule by chunks of 64"),
    ]


@workload("state_space_forward", 19, "Forward of a Mamba-2 model (every layer a state-space mixer, at the main shape's "
          "width and depth)", "probe <= 1.1x transformers", floor="transformers forward",
          check=at_most("probe forward", "transformers forward", 1.1))
def state_space_forward(ctx: Context) -> list[Case]:
    import transformers

    main = json.loads((ctx.path / "config.json").read_text())
    d_model = main["n_embd"]
    config = transformers.Mamba2Config(vocab_size=main["vocab_size"], hidden_size=d_model,
                                       num_hidden_layers=main["n_layer"], num_heads=2 * d_model // 64, head_dim=64,
                                       state_size=128, n_groups=1, expand=2)
    hf, probe = random_pair(ctx, transformers.Mamba2ForCausalLM, config)
    tokens = ctx.tokens()
    return [
        Case("transformers forward", HF, no_grad(lambda: hf(tokens, use_cache=False).logits),
             note="Mamba2ForCausalLM (mamba2-130m's layout at this width: 64-wide heads, a 128-wide state, one group; "
                  "its chunked torch scan, no mamba_ssm kernels installed)"),
        Case("probe forward", PROBE, no_grad(lambda: probe(tokens)), note="state_space_scan by chunks of 64"),
    ]


def random_pair(ctx: Context, causal_lm: type, config) -> tuple:
    """(transformers' model, probe's) of one randomly initialised checkpoint of `config`, saved once and loaded by both
    on the run's device and dtype: the pair a forward-against-transformers workload times."""
    import tempfile
    from pathlib import Path

    import torch

    from probe import HookedDecoder
    from probe.cli.bench_harness import hf_dtype_kwarg

    directory = Path(tempfile.mkdtemp(prefix="probe-bench-"))
    torch.manual_seed(0)
    causal_lm(config).save_pretrained(directory)
    hf = causal_lm.from_pretrained(directory, **hf_dtype_kwarg(ctx.torch_dtype)).to(ctx.device).eval()
    return hf, HookedDecoder.from_pretrained(directory, device=ctx.device, dtype=ctx.torch_dtype).eval()
