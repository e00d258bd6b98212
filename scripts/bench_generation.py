"""Benchmark workload 9: KV-cache generation, plain and steered, against transformers' generate."""
from __future__ import annotations

import json

from probe.cli.bench_harness import HF, PROBE, Case, Context, all_of, at_most, no_grad, workload


@workload("generation", 9, "Greedy generation of 256 tokens with the KV cache",
          "probe tokens/s >= 0.9x transformers' generate with its cache (time <= 1.11x); steered >= 0.95x unsteered "
          "(time <= 1.053x)", floor="transformers generate, cache",
          check=all_of(at_most("probe generate, cache", "transformers generate, cache", 1 / 0.9),
                        at_most("probe generate, cache, steered", "probe generate, cache", 1 / 0.95)),
          shape="single")
def generation(ctx: Context) -> list[Case]:
    import torch

    from probe.analyses import steer

    probe, hf = ctx.probe_model(), ctx.hf_model()
    direction = torch.randn(probe.cfg.d_model, generator=torch.Generator().manual_seed(3)).to(ctx.device, ctx.torch_dtype)
    steering = steer(probe, direction, 4.0, layers=[probe.cfg.n_layers // 2])
    # 256 new tokens on a GPU, as the issue asks; 64 on a CPU, where the uncached baseline alone
    # (a full forward per step) would take many minutes per run at GPT-2-small size
    wanted = 256 if ctx.device.startswith("cuda") else 64
    new = min(wanted, json.loads((ctx.path / "config.json").read_text())["n_positions"] - 16)
    prompt = ctx.tokens(batch=1, seq=16)
    mask = prompt.new_ones(prompt.shape)
    return [
        Case("transformers generate, cache", HF, no_grad(lambda: hf.generate(
            prompt, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)),
             note=f"{new} new tokens after a 16-token prompt, batch 1"),
        Case("probe generate, cache", PROBE, lambda: probe.generate(prompt, max_new_tokens=new, stop_at_eos=False)),
        Case("probe generate, no cache", PROBE,
             lambda: probe.generate(prompt, max_new_tokens=new, use_cache=False, stop_at_eos=False),
             ratio_to="probe generate, cache", note="every step reruns the whole sequence: the speed-up the cache buys"),
        Case("probe generate, cache, steered", PROBE,
             lambda: probe.generate(prompt, max_new_tokens=new, stop_at_eos=False, steering=steering),
             ratio_to="probe generate, cache", note="a steering vector added at one layer's resid_pre on every pass"),
    ]


