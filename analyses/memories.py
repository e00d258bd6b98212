"""FFN layers as key-value memories (Geva et al. 2021, 2022).

An FFN layer computes `FF(x) = sum_i m_i(x) v_i + b_out`: the key k_i is the i-th column of W_in,
the coefficient m_i(x) = act(x . k_i + b_in_i) is `blocks.{l}.mlp.hook_post`, and the value v_i is
the i-th row of W_out. Each term m_i v_i is a sub-update of the residual stream. In a SoLU-LN MLP
(transformer-lens's act_fn="solu_ln") m_i is a LayerNorm over every neuron's SoLU output, so it depends on
all the keys, not on k_i alone; hook_post is still what W_out reads, so everything here stays exact.

- `value_tokens`: which tokens each value promotes and suppresses (v_i W_U).
- `memory_lookup`: the memories that fire at one position of one prompt, ranked by |m_i| ||v_i||.
- `top_triggers`: every chosen neuron's top-k activating prefixes over a corpus, streamed; with
  `sae=`, the same scan of a sparse autoencoder's features at its hook point.
- `agreement`: Geva's statistic, how often a value's top token is the next token after its triggers.

Each lives in a module of its own (`analyses.memory_values`, `memory_firing`, `trigger_scan` with
`trigger_scanner` and `trigger_results`, `memory_agreement`; layer and neuron choices in
`memory_units`); this module gathers their public names, the scan's benchmark and its command line.

`python -m probe.analyses.memories` (or `torchrun --nproc_per_node N -m probe.analyses.memories`) scans a corpus
from the command line (`--sae DIR` for an SAE's features) and writes the result as safetensors.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch

from probe.analyses.corpus import Corpus, iter_documents
from probe.analyses.memory_agreement import Agreement, agreement, require_mlp
from probe.analyses.memory_firing import MemoryLookup, memory_lookup, sub_updates
from probe.analyses.memory_units import Layers, layer_list, neuron_tensor
from probe.analyses.memory_values import ValueTokens, value_tokens
from probe.analyses.trigger_results import EMPTY_DOC, MLP_SOURCE, PAD, TopTriggers, merge
from probe.analyses.trigger_scan import SCAN_COUNT_LIMIT, distributed, scan_windows, top_triggers
from probe.analyses.trigger_scanner import Scanner
from probe import HookedDecoder, SparseAutoencoder

__all__ = ["Agreement", "Corpus", "EMPTY_DOC", "Layers", "MLP_SOURCE", "MemoryLookup", "PAD", "SCAN_COUNT_LIMIT", "TopTriggers",
           "ValueTokens", "agreement", "benchmark", "iter_documents", "layer_list", "main", "memory_lookup", "merge",
           "neuron_tensor", "require_mlp", "sub_updates", "top_triggers", "value_tokens"]


# ---- benchmark and command line ------------------------------------------------------------------
@torch.no_grad()
def benchmark(model: HookedDecoder, texts: Corpus = None, layers: Layers = None, k: int = 25,
              batch_size: int = 8, repeats: int = 1) -> dict[str, float]:
    """Tokens/s of top_triggers against a plain forward pass over the same windows (issue: >= 0.8x)."""
    import time

    layer_ids = layer_list(model, layers, "the trigger-scan benchmark")  # before reading the corpus
    tokenizer = model._require_tokenizer()
    window = model.cfg.n_ctx
    items = list(scan_windows(model, texts, window, True, (0, 0), 0, 1))
    n_tokens = sum(len(w[3]) for w in items)
    batches = [items[i:i + batch_size] for i in range(0, len(items), batch_size)]
    scanner = Scanner(model, layer_ids, torch.arange(model.cfg.d_mlp), k, 24)
    token_batches = [scanner.set_batch([(d, s, ids, n) for d, _, s, ids, n in b], tokenizer.bos_id,
                                       tokenizer.pad_id, window) for b in batches]

    def sync():
        if model.device.type == "cuda":
            torch.cuda.synchronize()

    model(token_batches[0])  # warm-up
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        for tokens in token_batches:
            model(tokens)
    sync()
    forward = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(repeats):
        top_triggers(model, [t for _, t in iter_documents(texts)], layers, k=k, batch_size=batch_size, progress=False)
    sync()
    scan = time.perf_counter() - start
    return dict(tokens=n_tokens * repeats, forward_tokens_per_s=n_tokens * repeats / forward,
                scan_tokens_per_s=n_tokens * repeats / scan, ratio=forward / scan)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m probe.analyses.memories",
                                     description="Scan a corpus for each FFN neuron's top-k triggers (torchrun-aware).")
    parser.add_argument("--model", default=None, help="checkpoint directory or hub name (default: the bundled model)")
    parser.add_argument("--revision", default=None, help="a hub branch, tag or commit of --model (e.g. a Pythia step)")
    parser.add_argument("--corpus", default=None,
                        help="a text file or a folder of .txt files (default: the bundled held-out text)")
    parser.add_argument("--layers", type=int, nargs="*", default=None)
    parser.add_argument("--neurons", type=int, nargs="*", default=None, help="neuron ids (with --sae: feature ids)")
    parser.add_argument("--sae", default=None,
                        help="an SAE directory (SAELens format): scan its features at its hook point instead of neurons")
    parser.add_argument("-k", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", required=True, help="output .safetensors path (written by rank 0)")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    if args.sae is not None and args.layers:
        parser.error("--layers does not apply to --sae: the SAE's hook point fixes the layer")

    from probe import DEFAULT_MODEL

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        backend = "nccl" if args.device and args.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend)
        if backend == "nccl":
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(args.device)
    try:
        model = HookedDecoder.from_pretrained(args.model or DEFAULT_MODEL, device=args.device, revision=args.revision).eval()
        sae = None if args.sae is None else SparseAutoencoder.from_pretrained(args.sae, device=model.device)
        result = top_triggers(model, args.corpus, args.layers or None, args.neurons or None, k=args.k,
                              batch_size=args.batch_size, window=args.window, save_path=args.out,
                              overwrite=args.overwrite, sae=sae)
        if not distributed() or distributed().get_rank() == 0:
            print(f"scanned {result.n_tokens} tokens; wrote {args.out}")
        if distributed():
            # every rank waits for the others (rank 0 may still be writing) before tearing the group
            # down: gloo can abort a process whose peer closes its connections mid-exchange. Only on
            # success: after an error the ranks' collectives no longer match, and torchrun stops them.
            distributed().barrier()
    finally:
        if distributed():
            distributed().destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
