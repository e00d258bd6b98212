"""Per-example statistics for patching results: a bootstrap confidence interval of the mean and a sign-flip
permutation p-value, vectorised over many quantities at once (every edge of a graph)."""
from __future__ import annotations

import itertools

import torch

N_RESAMPLES = 1000
EXACT_UP_TO = 10  # at most 2^10 sign patterns: enumerate them all rather than sample


def bootstrap_ci(values: torch.Tensor, level: float = 0.95, n_resamples: int = N_RESAMPLES, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) [...]: percentile bootstrap interval of the mean over examples of `values` [example ...]."""
    values = values.float().cpu()
    n = values.shape[0]
    flat = values.reshape(n, -1)
    if n < 2:
        nan = torch.full(flat.shape[1:], float("nan"))
        return nan.view(values.shape[1:]), nan.view(values.shape[1:])
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, n, (n_resamples, n), generator=gen)
    # resampled means as counts @ values: [resample example] x [example quantity], never [resample example quantity]
    counts = torch.zeros(n_resamples, n).scatter_add_(1, picks, torch.ones(n_resamples, n)) / n
    means = counts @ flat
    tail = (1 - level) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail]), dim=0)
    return low.view(values.shape[1:]), high.view(values.shape[1:])


def sign_flip_p(values: torch.Tensor, n_resamples: int = N_RESAMPLES, seed: int = 0) -> torch.Tensor:
    """[...]: two-sided p-value that the mean over examples of `values` [example ...] is zero, by flipping each
    example's sign (exact over all 2^n patterns for n <= 10, else `n_resamples` random ones plus the observed)."""
    values = values.float().cpu()
    n = values.shape[0]
    flat = values.reshape(n, -1)
    if n < 2:
        return torch.full(values.shape[1:], float("nan"))
    if n <= EXACT_UP_TO:
        signs = torch.tensor(list(itertools.product((1.0, -1.0), repeat=n)))
    else:
        gen = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 2, (n_resamples, n), generator=gen).float() * 2 - 1
        signs = torch.cat([torch.ones(1, n), signs])  # the observed pattern counts once
    observed = flat.mean(0).abs()
    flipped = (signs @ flat / n).abs()
    # a tolerance: the pattern equal to the observed one must count however the sums round
    at_least = (flipped >= observed * (1 - 1e-6) - 1e-12).float().mean(0)
    return at_least.view(values.shape[1:])


def bootstrap_ratio_ci(numerator: torch.Tensor, denominator: torch.Tensor, level: float = 0.95,
                       n_resamples: int = N_RESAMPLES, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) [...]: percentile bootstrap interval of mean(numerator) / mean(denominator), the examples
    [example ...] resampled together (a ratio of means: a per-example ratio explodes where its denominator is small)."""
    numerator, denominator = numerator.float().cpu(), denominator.float().cpu()
    n = numerator.shape[0]
    if n < 2:
        nan = torch.full(numerator.shape[1:], float("nan"))
        return nan, nan.clone()
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, n, (n_resamples, n), generator=gen)
    counts = torch.zeros(n_resamples, n).scatter_add_(1, picks, torch.ones(n_resamples, n)) / n
    ratios = (counts @ numerator.reshape(n, -1)) / (counts @ denominator.reshape(n, -1))
    tail = (1 - level) / 2
    low, high = torch.nanquantile(ratios, torch.tensor([tail, 1 - tail]), dim=0)
    return low.view(numerator.shape[1:]), high.view(numerator.shape[1:])
