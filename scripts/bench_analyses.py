"""Benchmark workloads of the analyses: head ablation and attribution patching (5), the logit lens (6),
the FFN trigger scan (7) and head importance (8)."""
from __future__ import annotations

from functools import partial
from pathlib import Path

from probe.cli.bench_harness import PROBE, Case, Context, SkipWorkload, all_of, at_most, no_grad, workload


@workload("ablation", 5, "Single-head ablation of every head; attribution patching of every head",
          "sweep <= 0.6x separate ablated forwards; attribution patching <= 3x one forward",
          floor="separate ablated forwards",
          check=all_of(at_most("probe head_ablation_effects", "separate ablated forwards", 0.6),
                        at_most("probe attribution patching, all heads", "probe forward", 3.0)),
          model="small")
def ablation(ctx: Context) -> list[Case]:
    from probe.analyses import head_ablation_effects, logit_diff_metric, loss_metric, patch

    probe = ctx.probe_model()
    tokens, corrupted = ctx.tokens(seed=0), ctx.tokens(seed=1)
    mask = tokens.new_ones(tokens.shape)
    heads = [(layer, head) for layer in range(probe.cfg.n_layers) for head in range(probe.cfg.n_heads)]
    logit_diff = logit_diff_metric(probe, 5, 9)

    def zero_head(z, hook, head):
        z = z.clone()
        z[:, :, head] = 0.0
        return z

    def separate():  # what the sweep replaces: one full forward per head
        return [loss_metric(probe.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{l}.attn.hook_z", partial(zero_head, head=h))]),
                            tokens, mask) for l, h in heads]

    return [
        Case("separate ablated forwards", PROBE, no_grad(separate),
             note=f"{len(heads)} full forwards, each zeroing one head's hook_z, loss per prompt"),
        Case("probe head_ablation_effects", PROBE, lambda: head_ablation_effects(probe, tokens),
             note="zero ablation, loss metric: reruns layers l.. from the cached residual, heads stacked in the batch"),
        Case("probe forward", PROBE, no_grad(lambda: probe(tokens))),
        Case("probe attribution patching, all heads", PROBE,
             lambda: patch(probe, tokens, corrupted, loss_metric, sites="heads", method="attribution"),
             ratio_to="probe forward", note="clean run_with_cache + corrupted forward and backward"),
        Case("probe attribution patching, all heads, logit difference", PROBE,
             lambda: patch(probe, tokens, corrupted, logit_diff, sites="heads", method="attribution"),
             ratio_to="probe forward", note="a logit difference: two columns of W_U at the last position, from the final residual"),
        Case("the same, logit difference through the full logits", PROBE,
             lambda: patch(probe, tokens, corrupted, lambda *args: logit_diff(*args), sites="heads", method="attribution"),
             ratio_to="probe forward", note="the metric wrapped so it declares no reads: the generic path, full logits"),
    ]


@workload("logit_lens", 6, "Logit lens at every layer and position",
          "<= 1.2x the (layers + 1) unembedding matmuls it cannot avoid", floor="unembedding matmuls",
          check=at_most("probe logit_lens", "unembedding matmuls", 1.2), shape="single")
def logit_lens_workload(ctx: Context) -> list[Case]:
    import torch

    from probe.analyses import logit_lens

    probe = ctx.probe_model()
    tokens = ctx.tokens()
    n_sites = probe.cfg.n_layers + 1
    gen = torch.Generator().manual_seed(2)
    resid = torch.randn(n_sites, ctx.seq, probe.cfg.d_model, generator=gen).to(ctx.device, ctx.torch_dtype)
    return [
        Case("unembedding matmuls", PROBE, no_grad(lambda: probe.unembed(resid)),
             note=f"{n_sites} residuals [pos d_model] times W_U in one batched matmul"),
        Case("probe logit_lens", PROBE, lambda: logit_lens(probe, tokens),
             note="recomputed final norm, top-5, KL to the final layer"),
        Case("probe forward", PROBE, no_grad(lambda: probe(tokens))),
    ]


def corpus(n_chars: int) -> list[str]:
    """Documents to scan: the bundled held-out text when present, else seeded pseudo-English."""
    import random

    from probe import HELDOUT_TEXT

    if Path(HELDOUT_TEXT).is_file():
        text = Path(HELDOUT_TEXT).read_text()[:n_chars]
    else:
        words = "the of and to a in that is was he for it with as his on be at by had not are but from".split()
        rng = random.Random(0)
        text = " ".join(rng.choice(words) for _ in range(n_chars // 3))[:n_chars]
    quarter = max(1, len(text) // 4)
    return [text[i:i + quarter] for i in range(0, len(text), quarter)]


@workload("trigger_scan", 7, "FFN trigger scan over a corpus", "tokens/s >= 0.8x a plain forward's (time <= 1.25x)",
          floor="plain forward over the same windows",
          check=at_most("probe top_triggers", "plain forward over the same windows", 1.25), model="small")
def trigger_scan(ctx: Context) -> list[Case]:
    import torch

    from probe.analyses import top_triggers

    probe = ctx.probe_model()
    if probe.tokenizer is None:
        raise SkipWorkload("needs a model with a tokenizer: the bundled model was not found")
    texts, tok, window, batch_size = corpus(80 * ctx.batch * ctx.seq), probe.tokenizer, probe.cfg.n_ctx, 8
    windows = [[tok.bos_id] + ids[start:start + window - 1]
               for ids in (tok.encode(text, add_special_tokens=False) for text in texts) for start in range(0, len(ids), window - 1)]
    batches = []
    for first in range(0, len(windows), batch_size):
        rows = windows[first:first + batch_size]
        tokens = torch.full((len(rows), max(map(len, rows))), tok.pad_id, dtype=torch.long)
        mask = torch.zeros_like(tokens)
        for i, row in enumerate(rows):
            tokens[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
        batches.append((tokens.to(ctx.device), mask.to(ctx.device)))

    def forward_all():
        # a copy: a view would keep every batch's full logits alive, and the scan keeps none of them
        return [probe(tokens, attention_mask=mask)[:, -1].clone() for tokens, mask in batches]

    n_tokens = sum(map(len, windows))
    return [
        Case("plain forward over the same windows", PROBE, no_grad(forward_all),
             note=f"{n_tokens} tokens in {len(batches)} batches of {batch_size} windows of <= {window} tokens"),
        Case("probe top_triggers", PROBE, lambda: top_triggers(probe, texts, k=25, batch_size=batch_size, progress=False),
             note="every layer and neuron, k=25; includes tokenising the corpus"),
    ]


@workload("importance", 8, "Head importance (Michel et al. 2019): one forward and backward gives every head's score",
          "time per token <= 1.2x one forward + backward", floor="probe forward + backward",
          check=at_most("probe head_importance", "probe forward + backward", 1.2), model="small")
def importance(ctx: Context) -> list[Case]:
    from probe.analyses import head_importance

    probe = ctx.probe_model()
    tokens = ctx.tokens()

    def forward_backward():
        logits = probe(tokens)
        loss = logits[:, :-1].float().log_softmax(-1).gather(-1, tokens[:, 1:, None]).mean()
        loss.backward()
        probe.zero_grad(set_to_none=True)

    return [
        Case("probe forward + backward", PROBE, forward_backward, note="language-model loss, gradients for every parameter"),
        Case("probe head_importance", PROBE, lambda: head_importance(probe, [tokens], progress=False),
             note="head mask on hook_z, per-sequence |dL/dmask|, the same tokens"),
    ]


