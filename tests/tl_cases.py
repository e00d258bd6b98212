"""HookedTransformer 3.9's outputs for models built from its config (the `tl_caches` oracle: random weights, logits,
a cache of everything, and the same after processing), and the checks that a probe model built from the same config
gives them: shared by the tests of the features TL configs switch on (SoLU, ALiBi, mixtures of experts)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from probe import HookedDecoder, HookedTransformerConfig
from probe.processing import process_weights
from probe.tl_state_dict import TL_BUFFERS, TL_UNWRITTEN
from test_sae_training import oracle

TL_DEFAULTS = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)


def part(out: dict, prefix: str) -> dict:
    return {key.removeprefix(prefix): t for key, t in out.items() if key.startswith(prefix)}


def hooked_transformer_outputs(tmp: Path, cases: dict[str, dict], tokens: torch.Tensor,
                               processed: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(every case's outputs under "CASE/", {case: TL's n_params}), one oracle process for all; the cases named in
    `processed` also processed with TL's defaults."""
    save_file({"tokens": tokens}, str(tmp / "tokens.safetensors"))
    request = {name: {"config": settings, "process": TL_DEFAULTS if name in processed else None}
               for name, settings in cases.items()}
    printed = oracle("tl_caches", json.dumps(request), tmp / "tokens.safetensors", tmp / "out.safetensors")
    return load_file(str(tmp / "out.safetensors")), json.loads(printed.splitlines()[-1])


def assert_same_cache(model: HookedDecoder, tokens: torch.Tensor, theirs: dict, logits: torch.Tensor,
                      probe_only: tuple[str, ...] = (), flattened: tuple[str, ...] = ()) -> None:
    """The model's logits and a cache of everything are HookedTransformer's, point for point; `probe_only`: the
    endings of points TL 3.9 does not have (TL 4's, such as attn.hook_q_normed); `flattened`: of those TL holds with
    leading dimensions merged (per-head q/k norms' [batch*pos*head d_head]), read in probe's shape."""
    with torch.no_grad():
        ours_logits, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(ours_logits, logits, atol=1e-4, rtol=1e-4)
    names = {name for name in cache.keys() if not name.endswith(probe_only)}
    ours_only, theirs_only = names - set(theirs), set(theirs) - names
    assert not ours_only and not theirs_only, f"cached only by probe: {sorted(ours_only)}; only by TL: {sorted(theirs_only)}"
    for name, activation in theirs.items():
        if name.endswith(flattened):
            activation = activation.reshape(cache[name].shape)
        torch.testing.assert_close(cache[name], activation, atol=1e-4, rtol=1e-4, msg=name)


def assert_processed_as_hooked_transformer(settings: dict, out: dict, tokens: torch.Tensor,
                                           unread: Optional[str] = None, own: Optional[dict] = None,
                                           probe_only: tuple[str, ...] = (), flattened: tuple[str, ...] = ()) -> None:
    """load_and_process_state_dict with TL's defaults gives TL's processed weights and activations, and so does
    probe's own process_weights (with `own`'s settings, default TL's) from the unprocessed model. `unread`: a weight
    TL holds and never reads (an ALiBi model's position table), zeros here, left out of the comparison."""
    model = HookedDecoder(HookedTransformerConfig(**settings)).eval()
    model.load_and_process_state_dict(part(out, "state."), **TL_DEFAULTS)
    theirs, ours = part(out, "processed."), model.state_dict()
    assert set(ours) == {key for key in theirs if key.rsplit(".", 1)[-1] not in TL_UNWRITTEN}
    if unread is not None:
        assert not ours.pop(unread).any()
    for key in (key for key in ours if key.rsplit(".", 1)[-1] not in TL_BUFFERS):  # TL fills its mask as it runs
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=1e-5, msg=key)
    assert_same_cache(model, tokens, part(out, "processed_cache."), out["processed_logits"], probe_only, flattened)
    unprocessed = HookedDecoder(HookedTransformerConfig(**settings)).eval()
    unprocessed.load_state_dict(part(out, "state."), strict=True)
    processed = process_weights(unprocessed, **(TL_DEFAULTS if own is None else own)).state_dict()
    assert set(processed) == set(ours) | ({unread} if unread is not None else set())
    for key in ours:
        torch.testing.assert_close(processed[key], ours[key], atol=1e-5, rtol=1e-5, msg=key)
