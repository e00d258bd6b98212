"""Benchmark workload 12: TransformerLens-style calls on probe and on transformer-lens itself."""
from __future__ import annotations

from probe.cli.bench_harness import PROBE, TL, Case, Context, all_of, at_most, no_grad, workload


@workload("tl_surface", 12, "TransformerLens-style code on probe: the same calls on both libraries",
          "each TL-style path on probe <= 1.1x probe's own equivalent, and <= transformer-lens's time",
          floor="probe run_with_cache, one prompt",
          check=all_of(at_most("probe run_with_cache(remove_batch_dim=True)", "probe run_with_cache, one prompt", 1.1),
                        at_most("probe run_with_cache(remove_batch_dim=True)", "transformer-lens run_with_cache(remove_batch_dim=True)", 1.0),
                        at_most("probe cache.accumulated_resid(apply_ln=True)", "transformer-lens cache.accumulated_resid(apply_ln=True)", 1.0),
                        at_most("probe patching.get_act_patch_resid_pre", "transformer-lens patching.get_act_patch_resid_pre", 1.0)),
          model="small", shape="small")
def tl_surface(ctx: Context) -> list[Case]:
    import torch

    probe, tl = ctx.probe_model(), ctx.tl_model()
    if tl is not None:
        tl.enable_compatibility_mode(no_processing=True)
    one = ctx.tokens(batch=1)
    clean, corrupted = ctx.tokens(batch=1, seq=min(ctx.seq, 16)), ctx.tokens(seed=1, batch=1, seq=min(ctx.seq, 16))
    caches = {}

    def metric(logits):
        return logits[0, -1, 0] - logits[0, -1, 1]

    def stack(model, library):
        if library not in caches:
            with torch.no_grad():
                caches[library] = model.run_with_cache(one)[1]
        return lambda: caches[library].accumulated_resid(apply_ln=True, pos_slice=-1)

    def resid_pre_patching(model):
        from transformer_lens import patching

        with torch.no_grad():
            clean_cache = model.run_with_cache(clean)[1]
        return lambda: patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric)

    cases = [
        Case("probe run_with_cache, one prompt", PROBE, no_grad(lambda: probe.run_with_cache(one))),
        Case("probe run_with_cache(remove_batch_dim=True)", PROBE,
             no_grad(lambda: probe.run_with_cache(one, remove_batch_dim=True))),
        Case("transformer-lens run_with_cache(remove_batch_dim=True)", TL,
             no_grad(lambda: tl.run_with_cache(one, remove_batch_dim=True)), ratio_to="probe run_with_cache(remove_batch_dim=True)"),
        Case("probe cache.accumulated_resid(apply_ln=True)", PROBE, no_grad(stack(probe, PROBE)),
             ratio_to="transformer-lens cache.accumulated_resid(apply_ln=True)", note="every layer, last position"),
        Case("transformer-lens cache.accumulated_resid(apply_ln=True)", TL, no_grad(stack(tl, TL)) if tl else None),
        Case("probe patching.get_act_patch_resid_pre", PROBE, no_grad(resid_pre_patching(probe)) if tl else None,
             ratio_to="transformer-lens patching.get_act_patch_resid_pre",
             note="transformer-lens's own function given a probe model: one forward per layer and position"),
        Case("transformer-lens patching.get_act_patch_resid_pre", TL, no_grad(resid_pre_patching(tl)) if tl else None),
    ]
    return [case for case in cases if case.run is not None]


