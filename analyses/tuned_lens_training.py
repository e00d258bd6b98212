"""Training a tuned lens: residuals collected over held-out text, and the KL of each site's decoding to the
model's final distribution minimised per translator."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence, Union

import torch
from einops import rearrange
from torch import nn

from probe.analyses.lens_sites import model_lens_sites
from probe.analyses.tuned_lens import TunedLens
from probe import HELDOUT_TEXT, HookedDecoder


def heldout_split(fraction: float = 0.8) -> tuple[str, str]:
    """The bundled held-out text cut at a line break: (training part, evaluation part)."""
    if not HELDOUT_TEXT.is_file():
        raise FileNotFoundError(f"{HELDOUT_TEXT} is missing; pass your own text")
    text = HELDOUT_TEXT.read_text(encoding="utf-8")
    cut = text.rfind("\n", 0, int(len(text) * fraction))
    cut = int(len(text) * fraction) if cut <= 0 else cut
    return text[:cut], text[cut:]


def lens_windows(model: HookedDecoder, text: str, max_tokens: int, n_ctx: Optional[int]) -> list[torch.Tensor]:
    """Batches of BOS + (n-1) tokens covering the text's first max_tokens tokens: full windows, then the tail."""
    if model.tokenizer is None:
        raise ValueError("training or comparing lenses on text needs a model with a tokenizer")
    if n_ctx is not None and not (isinstance(n_ctx, int) and n_ctx >= 2):
        raise ValueError(f"n_ctx={n_ctx!r}: a window holds BOS plus at least one token, so give an int >= 2 (or None "
                         f"for the model's n_ctx={model.cfg.n_ctx})")
    ids = torch.tensor(model.tokenizer.encode(text, add_special_tokens=False)[:max_tokens], dtype=torch.long)
    if len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} tokens; the lens needs at least 2")
    n = min(n_ctx or model.cfg.n_ctx, model.cfg.n_ctx)
    bos = model.tokenizer.bos_id
    step = n if bos is None else n - 1  # without a BOS (GPT-1's vocabulary has none) a window is text alone
    full = len(ids) // step
    batches = [ids[: full * step].view(full, step)] if full else []
    tail = ids[full * step:]
    if len(tail):
        batches.append(tail[None])
    if bos is not None:
        batches = [torch.cat([torch.full((len(rows), 1), bos), rows], dim=1) for rows in batches]
    return [b.to(model.device) for b in batches]


@torch.no_grad()
def collect_residuals(model: HookedDecoder, text: str, sites: list[str], max_tokens: int, n_ctx: Optional[int],
                       batch_size: int = 8, desc: Optional[str] = None) -> torch.Tensor:
    """[token layer d_model] residuals at `sites` for every text token (not the BOS, whose residual is fixed).
    With `desc`, a progress bar of that name (stderr) over the forwards."""
    out = []
    # the windows first: they refuse a model without a tokenizer, which bos_id would fail on with an AttributeError
    chunks = [chunk for rows in lens_windows(model, text, max_tokens, n_ctx) for chunk in rows.split(batch_size)]
    first = 0 if model.tokenizer.bos_id is None else 1
    for chunk in progress_bar(chunks, desc, unit="batch"):
        _, cache = model.run_with_cache(chunk, names=sites)
        stacked = torch.stack([cache[s][:, first:] for s in sites], dim=2)  # [batch pos layer d_model]
        out.append(rearrange(stacked, "batch pos layer d_model -> (batch pos) layer d_model").float())
    return torch.cat(out)


def progress_bar(items: Sequence, desc: Optional[str], **kwargs):
    """`items` under a tqdm bar named `desc` (with its total), or as they are when `desc` is None."""
    if desc is None:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, total=len(items), **kwargs)


def lens_kl(model: HookedDecoder, resid: torch.Tensor, lens: Optional[TunedLens], sites: Sequence[str]) -> torch.Tensor:
    """[token layer]: KL(final || lens at each site) for residuals [token layer d_model] whose last layer is the final one."""
    early = resid[:, :-1, None]  # the lens takes [batch layer pos d_model]: tokens as the batch, one position each
    if lens is not None:
        early = lens(early, sites[:-1])
    resid = torch.cat([early[:, :, 0], resid[:, -1:]], dim=1)
    # detached, float copies of the model's weights: only the lens learns, and the model's .grad stays untouched
    normed = call_detached(model.ln_final, resid)
    logprobs = call_detached(model.unembed, normed).log_softmax(-1)  # [token layer vocab]
    final = logprobs[:, -1:]
    return (final.exp() * (final - logprobs)).sum(-1)


def call_detached(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    params = {name: p.detach().float() for name, p in module.named_parameters()}
    return torch.func.functional_call(module, params, (x,))


def train_tuned_lens(
    model: HookedDecoder,
    text: Optional[str] = None,
    *,
    include_mid: bool = False,
    steps: int = 150,
    batch_tokens: int = 256,
    lr: float = 2e-3,
    weight_decay: float = 1e-3,
    seed: int = 0,
    max_tokens: int = 16384,
    n_ctx: Optional[int] = None,
    progress: Union[bool, Callable[[int, float], None]] = False,
) -> TunedLens:
    """Fit one affine translator per site by minimising the mean KL(final || lens) over the text's tokens.

    `text` defaults to the training part of the bundled held-out text (`heldout_split()[0]`); the
    model is run once with no gradient and only the translators are optimised (Adam), on random
    batches of `batch_tokens` tokens drawn with `seed`. The model is not modified. `progress=True`
    shows progress bars (stderr) for reading the residuals and for training; a callable is instead
    called as `progress(step, loss)` after every step.
    """
    for name, value in (("steps", steps), ("batch_tokens", batch_tokens)):
        if not (isinstance(value, int) and value >= 1):  # 0 would leave the lens untrained and its KL NaN
            raise ValueError(f"{name}={value!r} must be a positive int")
    if text is None:
        text, source = heldout_split()[0], "probe.HELDOUT_TEXT (training part, heldout_split()[0])"
    else:
        source = "user text"
    sites = model_lens_sites(model, include_mid)
    bars = progress is True
    resid = collect_residuals(model, text, sites, max_tokens, n_ctx, desc="tuned lens: residuals" if bars else None)
    lens = TunedLens.for_model(model, include_mid)
    lens.float()
    gen = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.Adam(lens.parameters(), lr=lr, weight_decay=weight_decay)
    loss = torch.tensor(float("nan"))
    with torch.enable_grad():
        for step in progress_bar(range(steps), "tuned lens: training" if bars else None, unit="step"):
            index = torch.randint(0, resid.shape[0], (min(batch_tokens, resid.shape[0]),), generator=gen)
            loss = lens_kl(model, resid[index.to(resid.device)], lens, sites)[:, :-1].mean()
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            if callable(progress):
                progress(step, loss.item())
    lens.config = dataclasses.replace(lens.config, training=dict(text=source, tokens=int(resid.shape[0]), steps=steps, batch_tokens=batch_tokens,
                                     lr=lr, weight_decay=weight_decay, seed=seed, final_train_kl=round(float(loss.detach()), 6)))
    lens.requires_grad_(False)
    return lens
