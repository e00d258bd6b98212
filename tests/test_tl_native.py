"""transformer-lens 4's toy-model line, `HookedDecoder.boot_native(TransformerBridgeConfig(...))` for
`TransformerBridge.boot_native(...)` (probe/tl_native.py). The oracle: TL 4's own native model, built from the same
config in this process, as TL 4's Realtime_Training_Telemetry_Demo builds and trains it."""
from __future__ import annotations

import warnings

import pytest
import torch

from probe import HookedDecoder

SMALL = dict(n_layers=2, d_model=32, d_head=8, n_heads=4, d_vocab=50, n_ctx=16)
CASES = {
    "demo": dict(n_layers=2, d_model=64, d_head=32, n_heads=2, d_mlp=256, d_vocab=64, n_ctx=32, act_fn="gelu",
                 normalization_type="LN", seed=42),  # the telemetry demo's config
    "unseeded-relu": dict(SMALL, act_fn="relu"),  # drawn from torch's global stream, after building's own draws
    "gated-rms-gqa": dict(SMALL, n_key_value_heads=2, act_fn="silu", gated_mlp=True, normalization_type="RMS",
                          final_rms=True, seed=3),
    "attn-only-lnpre": dict(SMALL, attn_only=True, normalization_type="LNPre", act_fn="gelu", seed=5),
    "xavier-gelu-new": dict(SMALL, n_layers=1, act_fn="gelu_new", init_mode="xavier_normal", seed=7),
    "not-initialised": dict(SMALL, n_layers=1, act_fn="gelu", init_weights=False),  # torch's module defaults
    "soft-caps-solu-ln": dict(SMALL, n_layers=1, act_fn="solu_ln", attn_scores_soft_cap=5.0,
                              output_logits_soft_cap=3.0, attn_scale=4.0, seed=9),
    # rotary: adjacent pairs (no position table drawn), on part of each head
    "rotary-partial-gated-rms": dict(SMALL, act_fn="silu", gated_mlp=True, normalization_type="RMS",
                                     positional_embedding_type="rotary", rotary_dim=4, rotary_base=100, seed=11),
    "rotary-unseeded": dict(SMALL, act_fn="gelu", positional_embedding_type="rotary"),
}


def both(settings: dict):
    """(TL 4's model, probe's, the next 6 draws of torch's global stream after each), built under the same seed."""
    from transformer_lens import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    built = []
    for boot in (TransformerBridge.boot_native, HookedDecoder.boot_native):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = boot(TransformerBridgeConfig(**settings))
        built.append((model, torch.randint(0, 1000, (6,))))
    (theirs, their_next), (ours, our_next) = built
    return theirs, ours, their_next, our_next


def tokens(settings: dict, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, settings["d_vocab"], (3, 12), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", sorted(CASES))
def test_boot_native_builds_tl_4s_model_with_its_initial_weights(case):
    settings = CASES[case]
    theirs, ours, their_next, our_next = both(settings)
    assert torch.equal(our_next, their_next)  # the random tokens a notebook draws next are TL's
    assert ours.training == theirs.training
    their_params, our_params = theirs.get_params(), ours.get_params()
    for name, value in their_params.items():
        if name in our_params:
            assert torch.equal(our_params[name].detach(), value.detach()), name
        else:  # an attention-only model's MLP, which TL 4 lists as zeros
            assert ".mlp." in name and not value.any(), name
    toks = tokens(settings)
    with torch.no_grad():
        torch.testing.assert_close(ours(toks), theirs(toks), atol=1e-5, rtol=0)


def test_the_telemetry_demos_training_loop_runs_as_on_tl_4():
    """Realtime_Training_Telemetry_Demo's loop at a few steps: AdamW on `model.parameters()`, a cached loss every
    other step with the bridge's pattern names read from the cache, a plain loss otherwise."""
    settings = CASES["demo"]
    runs = []
    for model in both(settings)[:2]:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
        losses, coherence = [], []
        half = tokens(settings)[:, :settings["n_ctx"] // 2]
        batch = torch.cat([half, half], dim=1)  # one repeated batch: its loss must fall
        for step in range(6):
            if step % 2 == 0:
                loss, cache = model.run_with_cache(batch, return_type="loss")
                patterns = torch.stack([cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(2)])
                coherence.append((patterns * (patterns + 1e-9).log()).sum(-1).mean())
            else:
                loss = model(batch, return_type="loss")
            losses.append(loss.item())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        runs.append((torch.tensor(losses), torch.stack(coherence).detach()))
    (their_losses, their_coherence), (our_losses, our_coherence) = runs
    torch.testing.assert_close(our_losses, their_losses, atol=1e-5, rtol=0)
    torch.testing.assert_close(our_coherence, their_coherence, atol=1e-5, rtol=0)
    assert their_losses[-1] < their_losses[0]  # it trained


def test_tl_4s_own_training_loop_trains_it_as_tl_4s_model():
    """transformer_lens.tools.training.train (its TrainConfig: AdamW with weight decay, clipping, warm-up) on
    `{"tokens": ...}` rows: the trained models' losses agree."""
    from transformer_lens.tools.training import TrainConfig, train

    settings = CASES["demo"]
    rows = torch.randint(0, settings["d_vocab"], (24, 16), generator=torch.Generator().manual_seed(3))
    dataset = [{"tokens": row} for row in rows]
    config = TrainConfig(num_epochs=2, batch_size=8, lr=1e-2, seed=1, device="cpu", print_every=None,
                         optimizer_name="AdamW", weight_decay=0.01, max_grad_norm=1.0, warmup_steps=2)
    losses = []
    for model in both(settings)[:2]:
        trained = train(model, config, dataset).eval()
        with torch.no_grad():
            losses.append(trained(rows, return_type="loss"))
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=0)
    untrained = both(settings)[1]
    with torch.no_grad():
        assert untrained(rows, return_type="loss") > losses[1] + 0.1  # it trained


def test_what_tl_4s_native_model_cannot_be_is_refused_by_name():
    with pytest.raises(ValueError, match="boot_native\\(positional_embedding_type='alibi'\\) is not supported"):
        HookedDecoder.boot_native(dict(SMALL, act_fn="gelu", positional_embedding_type="alibi"))
    with pytest.raises(ValueError, match="boot_native with rope_scaling=.*dynamic.* is not supported here"):
        HookedDecoder.boot_native(dict(SMALL, act_fn="gelu", positional_embedding_type="rotary",
                                       rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ValueError, match="boot_native\\(init_mode='muP'\\)"):
        HookedDecoder.boot_native(dict(SMALL, act_fn="gelu", init_mode="muP"))
