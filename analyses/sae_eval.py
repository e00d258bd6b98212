"""How good a dictionary is on a corpus: the numbers SAELens's evals report.

Over windows of the corpus cut as the training store cuts them (BOS + context_size - 1 tokens of the
document stream), with y the activation the dictionary writes (x itself for an SAE, the MLP's output
for a transcoder) and y_hat its output:

- explained_variance = 1 - sum ||y - y_hat||^2 / sum ||y - mean(y)||^2, the mean over every eval token;
- mse = sum_d (y - y_hat)^2, mean over tokens (the training loss's convention);
- l0: mean active features per token; dead_fraction: features that never fire; dense_fraction: features
  firing on more than `dense_threshold` of the tokens;
- CE loss recovered = (zero - spliced) / (zero - clean), from the next-token losses of the clean model, the
  model with the dictionary spliced in (no error term) and the model with the written activation zeroed:
  `analyses.sae_loss_recovered` for an SAE; for a transcoder the same three forwards, zeroing its output point.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import pandas as pd
import torch

from probe.analyses.ablation import loss_metric
from probe.analyses.architecture import refuse_bidirectional
from probe.analyses.corpus import Corpus, iter_documents
from probe.analyses.features import check_sae, sae_loss_recovered
from probe import HookedDecoder, SparseAutoencoder, spliced
from probe.analyses.common import TableDisplay


@dataclass
class SAEEval(TableDisplay):
    hook_name: str
    hook_name_out: Optional[str]
    n_tokens: int
    explained_variance: float
    mse: float
    l0: float
    dead_fraction: float
    dense_fraction: float
    clean_loss: float
    spliced_loss: float
    zero_ablated_loss: float

    @property
    def ce_loss_recovered(self) -> float:
        return (self.zero_ablated_loss - self.spliced_loss) / (self.zero_ablated_loss - self.clean_loss)

    def to_dict(self) -> dict:
        return {**asdict(self), "ce_loss_recovered": self.ce_loss_recovered}

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame([self.to_dict()])


def eval_windows(model: HookedDecoder, corpus: Corpus, max_tokens: int, context_size: Optional[int] = None) -> torch.Tensor:
    """[window context_size] token ids: BOS + the next context_size - 1 tokens of the document stream (each
    document preceded by BOS), as `probe.activation_store.ActivationStore` cuts them, up to max_tokens."""
    tokenizer = model.tokenizer
    if tokenizer is None or tokenizer.bos_id is None:
        raise ValueError("sae_eval cuts the corpus into windows that start with BOS: the model needs a tokenizer with one")
    context_size = model.cfg.n_ctx if context_size is None else context_size
    if not 2 <= context_size <= model.cfg.n_ctx:
        raise ValueError(f"context_size={context_size} must be in [2, n_ctx={model.cfg.n_ctx}]")
    body, pending, windows = context_size - 1, [], []
    for _, text in iter_documents(corpus):
        pending += [tokenizer.bos_id] + tokenizer.encode(text, add_special_tokens=False)
        while len(pending) >= body and len(windows) * context_size < max_tokens:
            windows.append([tokenizer.bos_id] + pending[:body])
            pending = pending[body:]
        if len(windows) * context_size >= max_tokens:
            break
    if not windows:
        raise ValueError(f"the corpus is shorter than one window of {context_size} tokens")
    return torch.tensor(windows)


@torch.no_grad()
def sae_eval(model: HookedDecoder, sae: SparseAutoencoder, corpus: Corpus = None, *, max_tokens: int = 16384,
             context_size: Optional[int] = None, batch_prompts: int = 8, dense_threshold: float = 0.1) -> SAEEval:
    """The dictionary's numbers on `corpus` (default: the bundled held-out text), over its first max_tokens."""
    check_sae(model, sae)
    refuse_bidirectional(model, "sae_eval", "every position already sees the token after it and the next-token "
                         "loss the CE score compares measures nothing the model computes",
                         "read the reconstruction numbers from sae_features (fvu, l0) and feature_scan (density) on "
                         "your own inputs")
    read, written = sae.cfg.hook_name, sae.cfg.hook_name_out if sae.cfg.is_transcoder else sae.cfg.hook_name
    if sae.cfg.is_transcoder:
        model.hook_point(written)
    windows = eval_windows(model, corpus, max_tokens, context_size)
    d_sae = sae.cfg.d_sae
    fired = torch.zeros(d_sae, dtype=torch.long)
    sse = y_sum = y_sq = active = 0.0
    n = 0
    losses = {"clean": [], "spliced": [], "zero": []}
    for start in range(0, len(windows), batch_prompts):
        tokens = windows[start:start + batch_prompts].to(model.device)
        _, cache = model.run_with_cache(tokens, names=sorted({read, written}))
        x = cache[read].to(sae.W_enc.device)
        y = cache[written].to(sae.W_enc.device).flatten(2).double()
        features = sae.encode(x)
        y_hat = sae(x).flatten(2).double()
        sse += float((y - y_hat).pow(2).sum())
        y_sum = y_sum + y.sum((0, 1))
        y_sq += float(y.pow(2).sum())
        on = features.flatten(0, 1) > 0
        active += float(on.sum())
        fired += on.sum(0).cpu()
        n += tokens.numel()
        if sae.cfg.is_transcoder:
            mask = torch.ones_like(tokens, dtype=torch.bool)
            losses["clean"].append(loss_metric(model(tokens), tokens, mask))
            with spliced(model, sae):
                losses["spliced"].append(loss_metric(model(tokens), tokens, mask))
            zeroed = model.run_with_hooks(tokens, fwd_hooks=[(written, lambda a, hook: torch.zeros_like(a))])
            losses["zero"].append(loss_metric(zeroed, tokens, mask))
        else:
            recovered = sae_loss_recovered(model, sae, tokens)
            for key, value in (("clean", recovered.clean), ("spliced", recovered.spliced), ("zero", recovered.zero_ablated)):
                losses[key].append(value)
    total = y_sq - float(y_sum.pow(2).sum()) / n  # sum ||y - mean||^2, from the running sums
    mean = {key: float(torch.cat(value).double().mean()) for key, value in losses.items()}
    return SAEEval(hook_name=read, hook_name_out=sae.cfg.hook_name_out, n_tokens=n, explained_variance=1 - sse / total,
                   mse=sse / n, l0=active / n, dead_fraction=float((fired == 0).double().mean()),
                   dense_fraction=float((fired > dense_threshold * n).double().mean()),
                   clean_loss=mean["clean"], spliced_loss=mean["spliced"], zero_ablated_loss=mean["zero"])
