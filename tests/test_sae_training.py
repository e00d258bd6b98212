"""Training dictionaries: every loss term and gradient against the formulas written out in float64, SAELens itself
(in its own virtualenv, scripts/saelens_oracle.sh) on the same weights and batch, recovery of known sparse
features, a trained SAE against the mean baseline on held-out activations, and resuming bit for bit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from probe import SAEConfig, SparseAutoencoder
from probe.activation_store import ActivationStore
from probe.sae_training import TrainingConfig, TrainingSAE, resample_dead, train_on_store, train_sae

from ddp_worker import CONFIGS as DDP_CONFIGS, D as DDP_D, SplitStore, config as ddp_config
from oracle_process import SAELENS_PYTHON, oracle
from test_sae import randomised

needs_saelens = pytest.mark.skipif(not SAELENS_PYTHON.exists(), reason=f"no SAELens virtualenv at {SAELENS_PYTHON.parent.parent}: "
                                   "create it with `bash scripts/saelens_oracle.sh` (or set PROBE_SAELENS_VENV)")
TEXTS = ["To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 6,
         "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 8,
         "When in the course of human events it becomes necessary for one people to dissolve the bands. " * 5]


def training_sae(architecture, d_in=16, d_out=None, d_sae=40, seed=0, **extra):
    k = {"topk": 5, "batchtopk": 5}.get(architecture)
    cfg = TrainingConfig(hook_name="blocks.0.hook_resid_post", d_sae=d_sae, training_tokens=64, batch_tokens=32,
                         architecture=architecture, k=k, **extra)
    sae = TrainingSAE(cfg, d_in, d_out or d_in, torch.Generator().manual_seed(seed)).double()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # away from the initialisation, so every term is seen
        for name, p in sae.named_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        if sae.threshold is not None:
            sae.threshold.copy_(0.2 + 0.1 * torch.rand(d_sae, generator=gen, dtype=torch.float64))
    return sae


def by_hand(sae, x, y, coefficient):
    """Every loss term written out from the parameters (float64)."""
    cfg = sae.cfg
    W_enc, b_enc, W_dec, b_dec = sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec
    norms = W_dec.norm(dim=1)
    pre = (x - (0 if cfg.hook_name_out else b_dec)) @ W_enc + b_enc
    terms = {}
    if cfg.architecture in ("topk", "batchtopk"):
        pre = pre * norms
        if cfg.architecture == "topk":
            kth = pre.sort(-1, descending=True).values[:, cfg.k - 1:cfg.k]
            f = torch.where(pre >= kth, pre, 0).clamp(min=0)
        else:
            flat = pre.clamp(min=0).flatten()
            kth = flat.sort(descending=True).values[cfg.k * x.shape[0] - 1]
            f = torch.where(pre.clamp(min=0) >= kth, pre.clamp(min=0), 0)
        y_hat = (f / norms) @ W_dec + b_dec
        dead = sae.dead_mask()
        if dead.any():
            k_aux = x.shape[1] // 2
            scale = min(int(dead.sum()) / k_aux, 1.0)
            masked = torch.where(dead, pre, -torch.inf)
            kth_dead = masked.sort(-1, descending=True).values[:, min(k_aux, int(dead.sum())) - 1:][:, :1]
            aux_acts = torch.where(masked >= kth_dead, pre, 0)
            e_hat = (aux_acts / norms) @ W_dec
            terms["auxk"] = cfg.aux_coefficient * scale * (e_hat - (y - y_hat)).pow(2).sum(-1).mean()
        else:
            terms["auxk"] = torch.tensor(0.0, dtype=x.dtype)
    elif cfg.architecture == "jumprelu":
        f = torch.where(pre > sae.threshold, pre, 0)
        y_hat = f @ W_dec + b_dec
        terms["l0"] = coefficient * (pre > sae.threshold).double().sum(-1).mean()
    else:
        f = pre.clamp(min=0)
        y_hat = f @ W_dec + b_dec
        terms["l1"] = coefficient * (f * norms).sum(-1).mean()
    if sae.W_skip is not None:
        y_hat = y_hat + x @ sae.W_skip.T
    terms["mse"] = (y_hat - y).pow(2).sum(-1).mean()
    return terms, f


@pytest.mark.parametrize("architecture, transcoder, skip", [
    ("standard", False, False), ("topk", False, False), ("batchtopk", False, False), ("jumprelu", False, False),
    ("topk", True, False), ("standard", True, True), ("jumprelu", True, True),
])
@pytest.mark.parametrize("n_dead", [0, 7])
def test_every_loss_term_follows_the_formulas(architecture, transcoder, skip, n_dead):
    out = dict(hook_name_out="blocks.0.hook_mlp_out", skip=skip) if transcoder else {}
    sae = training_sae(architecture, d_out=12 if transcoder else None, **out)
    sae.steps_since_fired[:n_dead] = sae.cfg.dead_feature_window + 1
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(32, 16, generator=gen, dtype=torch.float64)
    y = torch.randn(32, 12, generator=gen, dtype=torch.float64) if transcoder else x
    got = sae.losses(x, y, coefficient=0.7)
    expected, features = by_hand(sae, x, y, 0.7)
    torch.testing.assert_close(got["features"], features, atol=1e-10, rtol=0)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-9, rtol=1e-9, msg=name)
    torch.testing.assert_close(got["loss"], sum(expected.values()), atol=1e-9, rtol=1e-9)
    if architecture in ("topk", "batchtopk") and n_dead:
        assert float(expected["auxk"].detach()) > 0
    if architecture == "topk":
        assert bool(((features > 0).sum(-1) == 5).all())  # exactly k: random pre-activations' top 5 are positive


@pytest.mark.parametrize("architecture", ["standard", "topk"])
def test_the_gradient_of_the_loss_is_its_finite_difference(architecture):
    """Autograd of the whole loss against central differences of the loss itself, entry by entry (float64); the
    losses are smooth away from ReLU kinks and top-k ties, which a step of 1e-6 does not cross. (AuxK's residual
    is detached, as SAELens's, so its gradient is no finite difference: the SAELens test checks it.)"""
    sae = training_sae(architecture)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    sae.losses(x, x, 0.7)["loss"].backward()
    gen = torch.Generator().manual_seed(3)
    for name, param in sae.named_parameters():
        for index in torch.randint(0, param.numel(), (4,), generator=gen).tolist():
            flat = param.data.view(-1)
            original = float(flat[index])
            with torch.no_grad():
                flat[index] = original + 1e-6
                up = float(sae.losses(x, x, 0.7)["loss"])
                flat[index] = original - 1e-6
                down = float(sae.losses(x, x, 0.7)["loss"])
                flat[index] = original
            assert float(param.grad.view(-1)[index]) == pytest.approx((up - down) / 2e-6, abs=1e-5, rel=1e-4), (name, index)


def test_jumprelu_straight_through_gradients_are_the_rectangle_kernel():
    """d L0 / d t_f = -c/bw * mean_b rect((pre - t_f)/bw); through the reconstruction, d f/d t_f = -t_f/bw rect(...),
    and d f/d pre = 1[pre > t] (the exact derivative, checked against a finite difference)."""
    sae = training_sae("jumprelu", jumprelu_bandwidth=0.5)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    bw, c = 0.5, 0.7
    terms = sae.losses(x, x, c)
    (grad_l0,) = torch.autograd.grad(terms["l0"], sae.threshold, retain_graph=True)
    pre = ((x - sae.b_dec) @ sae.W_enc + sae.b_enc).detach()
    t = sae.threshold.detach()
    rect = (((pre - t) / bw).abs() < 0.5).double()
    torch.testing.assert_close(grad_l0, -c / bw * rect.sum(0) / x.shape[0], atol=1e-12, rtol=0)
    assert float(rect.sum()) > 0

    (grad_mse,) = torch.autograd.grad(terms["mse"], sae.threshold, retain_graph=True)
    features = terms["features"]
    (d_features,) = torch.autograd.grad(terms["mse"], features, retain_graph=True)
    torch.testing.assert_close(grad_mse, (-(t / bw) * rect * d_features).sum(0), atol=1e-10, rtol=0)

    def mse_of_pre(pre_):  # the mse as a function of pre-activations, through the forward's exact gate
        f = pre_ * (pre_ > t)
        return (f @ sae.W_dec.detach() + sae.b_dec.detach() - x).pow(2).sum(-1).mean()

    p = pre.clone().requires_grad_()
    from probe.sae_training import JumpReLU
    f = JumpReLU.apply(p, t, bw)
    (auto,) = torch.autograd.grad((f @ sae.W_dec.detach() + sae.b_dec.detach() - x).pow(2).sum(-1).mean(), p)
    i, j = (((pre - t).abs() > 1e-3) & (pre > t)).nonzero()[0].tolist()
    bump = torch.zeros_like(pre)
    bump[i, j] = 1e-6
    numeric = (mse_of_pre(pre + bump) - mse_of_pre(pre - bump)) / 2e-6
    torch.testing.assert_close(auto[i, j], numeric, atol=1e-6, rtol=1e-5)


# ---- training on synthetic data ------------------------------------------------------------------
class SyntheticStore:
    """Activations that are sparse sums of known unit directions: 3 of 48 features on per token."""

    def __init__(self, directions, batch_tokens, seed=0):
        self.directions, self.batch_tokens = directions, batch_tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.store_device = torch.device("cpu")

    def next_batch(self):
        n = self.directions.shape[0]
        on = torch.rand(self.batch_tokens, n, generator=self.generator).argsort(-1)[:, :3]
        coefficients = torch.zeros(self.batch_tokens, n).scatter(-1, on, 1 + torch.rand(self.batch_tokens, 3, generator=self.generator))
        return (coefficients @ self.directions,)

    def state_dict(self):
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])


def ground_truth(n=48, d=24, seed=0):
    d_ = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
    return d_ / d_.norm(dim=1, keepdim=True)


def test_training_recovers_known_sparse_features():
    truth = ground_truth()
    cfg = TrainingConfig(hook_name="blocks.0.hook_resid_post", d_sae=96, training_tokens=512 * 400, batch_tokens=512,
                         architecture="topk", k=3, lr=3e-3, lr_decay_steps=80, seed=1)
    result = train_on_store(SyntheticStore(truth, 512), cfg, 24, 24, progress=False)
    decoder = result.sae.W_dec.detach()
    best = (truth @ (decoder / decoder.norm(dim=1, keepdim=True)).T).max(dim=1).values  # each truth's closest feature
    assert float((best > 0.9).float().mean()) >= 0.9, best
    x = SyntheticStore(truth, 2048, seed=99).next_batch()[0]  # held out
    with torch.no_grad():
        reconstruction = result.sae(x)
    explained = 1 - (reconstruction - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum()
    assert float(explained) > 0.9


def test_batchtopk_is_saved_as_jumprelu_with_its_running_threshold():
    truth = ground_truth()
    cfg = TrainingConfig(hook_name="blocks.0.hook_resid_post", d_sae=96, training_tokens=512 * 60, batch_tokens=512,
                         architecture="batchtopk", k=3, lr=3e-3, seed=2,
                         topk_threshold_lr=0.1)  # the moving average settles within these 60 steps
    store = SyntheticStore(truth, 512)
    result = train_on_store(store, cfg, 24, 24, progress=False)
    assert result.sae.cfg.architecture == "jumprelu"
    threshold = result.sae.threshold.detach()
    assert float(threshold.min()) == float(threshold.max()) > 0  # one threshold for every feature
    with torch.no_grad():
        l0 = (result.sae.encode(store.next_batch()[0]) > 0).sum(-1).float().mean()
    # the threshold is the smallest activation a batch kept, so at least about k stay on; not all 96
    assert 2 < float(l0) < 12


# ---- resampling dead features (standard) ----------------------------------------------------------
def test_resampling_sets_the_rows_anthropics_formula_gives():
    sae = training_sae("standard", d_in=16, hook_name_out=None)
    optimizer = torch.optim.Adam(sae.parameters(), lr=1e-3)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    sae.losses(x, x, 0.7)["loss"].backward()
    optimizer.step()  # Adam has moments to reset
    dead = torch.tensor([3, 11, 12, 30])
    sae.steps_since_fired[dead] = sae.cfg.dead_feature_window + 1
    before = {n: p.detach().clone() for n, p in sae.named_parameters()}
    moments = {n: {k: v.clone() for k, v in optimizer.state[p].items()} for n, p in sae.named_parameters()}
    revived, rows = resample_dead(sae, optimizer, x, x, torch.Generator().manual_seed(11))
    assert revived.tolist() == dead.tolist()

    # by hand: loss per row, probabilities proportional to its square, a draw per dead feature
    f = ((x - before["b_dec"]) @ before["W_enc"] + before["b_enc"]).clamp(min=0)
    loss = (f @ before["W_dec"] + before["b_dec"] - x).pow(2).sum(-1)
    expected_rows = torch.multinomial(loss.pow(2), 4, replacement=True, generator=torch.Generator().manual_seed(11))
    assert rows.tolist() == expected_rows.tolist()
    alive = torch.ones(40, dtype=torch.bool)
    alive[dead] = False
    scale = 0.2 * before["W_enc"][:, alive].norm(dim=0).mean()
    for feature, row in zip(dead.tolist(), expected_rows.tolist()):
        centred = x[row] - before["b_dec"]
        torch.testing.assert_close(sae.W_dec[feature], centred / centred.norm(), atol=1e-12, rtol=0)
        torch.testing.assert_close(sae.W_enc[:, feature], centred / centred.norm() * scale, atol=1e-12, rtol=0)
        assert float(sae.b_enc[feature].detach()) == 0.0
    for name, p in sae.named_parameters():  # the alive features and everything else: untouched
        keep = (alive,) if name in ("W_dec", "b_enc") else (slice(None), alive) if name == "W_enc" else (slice(None),)
        assert torch.equal(p.detach()[keep], before[name][keep]), name
        for key in ("exp_avg", "exp_avg_sq"):
            state = optimizer.state[p][key]
            assert torch.equal(state[keep], moments[name][key][keep]), (name, key)
            if name != "b_dec":
                gone = (dead,) if name != "W_enc" else (slice(None), dead)
                assert float(state[gone].abs().max()) == 0.0 and float(moments[name][key][gone].abs().max()) > 0
    assert int(sae.steps_since_fired[dead].max()) == 0


def test_resampling_revives_dead_features():
    """A strong L1 kills most features; resampling every 10 steps brings them back (features that fire on
    held-out data), where the same run without it keeps them dead."""
    truth = ground_truth()
    held_out = SyntheticStore(truth, 2048, seed=99).next_batch()[0]
    alive, dead = {}, {}
    for every in (None, 10):
        cfg = TrainingConfig(hook_name="blocks.0.hook_resid_post", d_sae=96, training_tokens=256 * 40, batch_tokens=256,
                             architecture="standard", l1_coefficient=3.0, lr=3e-2, dead_feature_window=3,
                             resample_every_steps=every, seed=1)
        result = train_on_store(SyntheticStore(truth, 256), cfg, 24, 24, progress=False)
        with torch.no_grad():
            alive[every] = float((result.sae.encode(held_out) > 0).any(0).float().mean())
        dead[every] = result.history[-1]["dead"]
    assert dead[None] > 0.5 and alive[None] < 0.5  # the setting kills features
    assert alive[10] > alive[None] + 0.15 and dead[10] < dead[None] - 0.3, (alive, dead)
    with pytest.raises(ValueError, match="standard.*AuxK"):
        TrainingConfig(hook_name="blocks.0.hook_resid_post", d_sae=8, training_tokens=64, batch_tokens=32,
                       architecture="topk", k=2, resample_every_steps=10)


# ---- torchrun: data parallel -------------------------------------------------------------------
@pytest.mark.slow
def test_two_processes_under_torchrun_take_the_steps_of_one_reading_whole_batches(tmp_path, capsys):
    """tests/ddp_worker.py under `torchrun --nproc-per-node 2` (gloo): each process reads half of every batch,
    is interrupted, resumes from rank 0's checkpoint; one process reading whole batches is the oracle."""
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(Path(__file__).with_name("ddp_worker.py")), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in DDP_CONFIGS:
        cfg = ddp_config(name)
        single = train_on_store(SplitStore(cfg.batch_tokens), cfg, DDP_D, DDP_D, progress=False)
        parallel = SparseAutoencoder.from_pretrained(tmp_path / name)
        for (key, a), (_, b) in zip(single.sae.named_parameters(), parallel.named_parameters()):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4, msg=f"{name} {key}")
        assert max(row["dead"] for row in single.history) > 0.1  # AuxK and resampling had dead features to read
        checkpoint = tmp_path / name / "checkpoints" / str(3 * cfg.batch_tokens)
        assert json.loads((checkpoint / "trainer.json").read_text())["processes"] == 2
        assert {"store.rank0.t", "store.rank1.t"} <= set(load_file(str(checkpoint / "trainer_state.safetensors")))
    assert "resampled 3 dead features" in capsys.readouterr().out and "resampled 3 dead features" in done.stdout


# ---- on a model --------------------------------------------------------------------------------
def windows_by_hand(tokenizer, texts, context_size: int, n: int) -> torch.Tensor:
    """The store's first n windows, cut by hand: the documents as one stream, each after a BOS; a window is the
    stream's next context_size - 1 tokens after a BOS of its own, or, where a document begins, that document's BOS
    and the context_size - 1 tokens after it."""
    bos, stream = tokenizer.bos_id, []
    for text in texts:
        stream += [bos] + tokenizer.encode(text, add_special_tokens=False)
    windows, at = [], 0
    while len(windows) < n:
        if stream[at] == bos:
            windows.append(stream[at:at + context_size])
            at += context_size
        else:
            windows.append([bos] + stream[at:at + context_size - 1])
            at += context_size - 1
    return torch.tensor(windows)


def test_a_window_cut_where_a_document_begins_starts_with_its_bos_alone(tiny_model):
    """Documents of 15 tokens in windows of 16: each window is one document after its BOS. A BOS was prepended to
    every window, the document's own included (BOS BOS, and each later window shifted by one)."""
    tokenizer = tiny_model.tokenizer
    texts = []
    for start in ("To be, or not", "The quick brown fox", "When in the course"):
        text = start
        while len(tokenizer.encode(text, add_special_tokens=False)) < 15:
            text += " and"
        assert len(tokenizer.encode(text, add_special_tokens=False)) == 15
        texts.append(text)
    store = ActivationStore(tiny_model, texts, ["hook_embed", "hook_pos_embed"], batch_tokens=24, buffer_tokens=48,
                            context_size=16, batch_prompts=3)
    store.next_batch()
    embed, pos_embed = store.buffer  # every row the store read, rows aligned across the two points
    token = (embed[:, None] - tiny_model.embed.W_E[None]).abs().amax(-1).argmin(-1)
    position = (pos_embed[:, None] - tiny_model.pos_embed.W_pos[None]).abs().amax(-1).argmin(-1)
    bos = tokenizer.bos_id
    assert not bool(((token == bos) & (position == 1)).any())
    expected = torch.tensor([[bos] + tokenizer.encode(t, add_special_tokens=False) for t in texts])
    assert torch.equal(windows_by_hand(tokenizer, texts, 16, 3), expected)
    rows = sorted(zip(position.tolist(), token.tolist()))
    assert rows == sorted((p, t) for window in expected.tolist() for p, t in enumerate(window))


def test_the_store_serves_the_models_activations_shuffled_and_reproducibly(tiny_model):
    hook = "blocks.0.hook_resid_post"
    store = ActivationStore(tiny_model, TEXTS, hook, batch_tokens=32, buffer_tokens=96, context_size=16, batch_prompts=4)
    assert store.stop_at_layer == 1
    batches = [store.next_batch()[0] for _ in range(4)]
    # every row is the model's activation at some position of the windows the store cut
    windows = windows_by_hand(tiny_model.tokenizer, TEXTS, 16, store.windows_read)
    _, cache = tiny_model.run_with_cache(windows, names=hook)
    every = cache[hook].reshape(-1, 64)
    for batch in batches:
        distance = (batch[:, None] - every[None]).abs().amax(-1).min(dim=1).values  # to the nearest activation
        assert float(distance.max()) < 1e-5
    assert not torch.equal(batches[0], every[:32])  # shuffled
    again = ActivationStore(tiny_model, TEXTS, hook, batch_tokens=32, buffer_tokens=96, context_size=16, batch_prompts=4)
    assert all(torch.equal(a, again.next_batch()[0]) for a in batches)
    with pytest.raises(TypeError, match="iterator"):
        ActivationStore(tiny_model, iter(TEXTS), hook)
    with pytest.raises(ValueError, match="at least two batches"):
        ActivationStore(tiny_model, TEXTS, hook, batch_tokens=64, buffer_tokens=96)


def test_a_shard_of_the_store_reads_every_nth_window(tiny_model):
    """Under torchrun process r of n reads windows r, r + n, ...: shard (1, 2)'s rows are the model's activations
    on the odd windows of the stream (by hand), and never the even windows' non-BOS positions."""
    hook = "blocks.0.hook_resid_post"
    store = ActivationStore(tiny_model, TEXTS, hook, batch_tokens=32, buffer_tokens=64, context_size=16, batch_prompts=2,
                            shard=(1, 2))
    rows = torch.cat([store.next_batch()[0] for _ in range(2)])
    windows = windows_by_hand(tiny_model.tokenizer, TEXTS, 16, 2 * store.windows_read)
    _, cache = tiny_model.run_with_cache(windows, names=hook)
    odd, even = cache[hook][1::2, 1:].reshape(-1, 64), cache[hook][0::2, 1:].reshape(-1, 64)
    not_bos = (rows - cache[hook][0, 0]).abs().amax(-1) > 1e-5
    assert int(not_bos.sum()) > 16
    to_odd = (rows[not_bos, None] - odd[None]).abs().amax(-1).min(dim=1).values
    to_even = (rows[not_bos, None] - even[None]).abs().amax(-1).min(dim=1).values
    assert float(to_odd.max()) < 1e-5 and float(to_even.min()) > 1e-3
    with pytest.raises(ValueError, match="shard"):
        ActivationStore(tiny_model, TEXTS, hook, batch_tokens=32, buffer_tokens=64, shard=(2, 2))


def small_cfg(**extra):
    settings = dict(hook_name="blocks.0.hook_resid_post", d_sae=128, architecture="topk", k=8, training_tokens=256 * 6,
                    batch_tokens=256, buffer_tokens=1024, context_size=32, batch_prompts=4, lr=3e-3, lr_decay_steps=2,
                    checkpoint_every_tokens=256 * 3)
    settings.update(extra)
    return TrainingConfig(**settings)


@pytest.mark.parametrize("extra", [{}, dict(hook_name="blocks.1.ln2.hook_normalized", hook_name_out="blocks.1.hook_mlp_out",
                                            architecture="jumprelu", k=None, skip=True, l0_coefficient=0.01)])
def test_resuming_from_a_checkpoint_is_bit_identical_to_an_uninterrupted_run(tiny_model, tmp_path, extra):
    cfg = small_cfg(**extra)
    whole = train_sae(tiny_model, TEXTS, cfg, out=tmp_path / "whole", progress=False)
    interrupted = train_sae(tiny_model, TEXTS, cfg, out=tmp_path / "run", progress=False, stop_after_steps=4)
    assert interrupted.steps == 4 and not (tmp_path / "run" / "cfg.json").exists()
    checkpoint = tmp_path / "run" / "checkpoints" / str(4 * 256)
    assert sorted(p.name for p in checkpoint.iterdir()) == ["cfg.json", "sae_weights.safetensors", "trainer.json",
                                                           "trainer_state.safetensors"]
    resumed = train_sae(tiny_model, TEXTS, cfg, out=tmp_path / "run", progress=False, resume=checkpoint)
    for (name, a), (_, b) in zip(whole.sae.named_parameters(), resumed.sae.named_parameters()):
        assert torch.equal(a, b), name
    loaded = SparseAutoencoder.from_pretrained(tmp_path / "run")
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), whole.sae.parameters()))
    assert (tmp_path / "whole" / "checkpoints" / str(3 * 256) / "trainer.json").is_file()
    with pytest.raises(ValueError, match="other settings.*lr"):
        train_sae(tiny_model, TEXTS, small_cfg(**{**extra, "lr": 1e-3}), out=tmp_path / "run2", progress=False,
                  resume=checkpoint)


def test_a_checkpoint_whose_store_cut_windows_by_the_old_rule_is_refused(tiny_model, tmp_path):
    """A state written before windows kept a document's BOS alone (no window_rule) would resume onto other windows
    than the run it continues, silently; it is refused, naming the rule. The current state resumes the stream."""
    cfg = small_cfg()
    train_sae(tiny_model, TEXTS, cfg, out=tmp_path / "run", progress=False, stop_after_steps=4)
    checkpoint = tmp_path / "run" / "checkpoints" / str(4 * 256)
    state = load_file(str(checkpoint / "trainer_state.safetensors"))
    assert int(state["store.window_rule"][0]) == 2
    old = {k: v for k, v in state.items() if k != "store.window_rule"}
    save_file(old, str(checkpoint / "trainer_state.safetensors"))
    with pytest.raises(ValueError, match="rule 1 .* rule 2.*afresh"):
        train_sae(tiny_model, TEXTS, cfg, out=tmp_path / "run", progress=False, resume=checkpoint)
    assert not (tmp_path / "run" / "cfg.json").exists()

    store = ActivationStore(tiny_model, TEXTS, "hook_embed", batch_tokens=32, buffer_tokens=64, context_size=16,
                            batch_prompts=2)
    store.next_batch()
    saved = store.state_dict()
    expected = store.next_batch()[0]
    resumed = ActivationStore(tiny_model, TEXTS, "hook_embed", batch_tokens=32, buffer_tokens=64, context_size=16,
                              batch_prompts=2)
    resumed.load_state_dict(saved)
    assert torch.equal(resumed.next_batch()[0], expected)
    with pytest.raises(ValueError, match="rule 3"):
        resumed.load_state_dict({**saved, "window_rule": torch.tensor([3])})


def test_a_trained_sae_beats_the_mean_on_held_out_activations(tiny_model):
    hook = "blocks.1.hook_resid_post"
    cfg = small_cfg(hook_name=hook, training_tokens=256 * 60, lr_decay_steps=20, checkpoint_every_tokens=None, k=16)
    result = train_sae(tiny_model, TEXTS[:2], cfg, progress=False)
    held_out = "Numbers 0123456789 and punctuation appear too, and the question is whether the dog sleeps."
    _, cache = tiny_model.run_with_cache(held_out, names=hook)
    x = cache[hook][0].double()
    with torch.no_grad():
        reconstruction = result.sae(x.float()).double()
        l0 = (result.sae.encode(x.float()) > 0).sum(-1)
    total = (x - x.mean(0)).pow(2).sum()  # the mean's error: explained variance 0
    explained = 1 - (reconstruction - x).pow(2).sum() / total
    assert float(explained) > 0.5, float(explained)
    assert bool((l0 == 16).all())  # TopK: exactly k


# ---- SAELens itself ----------------------------------------------------------------------------
def random_inference(architecture, transcoder=False, skip=False, seed=0):
    cfg = SAEConfig(d_in=24, d_sae=40, hook_name="blocks.0.ln2.hook_normalized" if transcoder else "blocks.0.hook_resid_post",
                    architecture=architecture, k=6 if architecture == "topk" else None,
                    apply_b_dec_to_input=not transcoder, hook_name_out="blocks.0.hook_mlp_out" if transcoder else None,
                    d_out=20 if transcoder else None, skip=skip)
    return randomised(SparseAutoencoder(cfg), seed, lambda name: 0.3, threshold=0.3)


@needs_saelens
def test_saelens_loads_what_probe_saves_and_computes_the_same(tmp_path):
    cases = [("standard", False, False, "StandardSAE"), ("topk", False, False, "TopKSAE"),
             ("jumprelu", False, False, "JumpReLUSAE"), ("standard", True, False, "Transcoder"),
             ("standard", True, True, "SkipTranscoder"), ("jumprelu", True, False, "JumpReLUTranscoder"),
             ("jumprelu", True, True, "JumpReLUSkipTranscoder")]
    x = torch.randn(50, 24, generator=torch.Generator().manual_seed(1))
    save_file({"x": x}, str(tmp_path / "x.safetensors"))
    for i, (architecture, transcoder, skip, saelens_class) in enumerate(cases):
        sae = random_inference(architecture, transcoder, skip, seed=i)
        sae.save_pretrained(tmp_path / f"sae{i}")
        assert oracle("encode", tmp_path / f"sae{i}", tmp_path / "x.safetensors", tmp_path / f"out{i}.safetensors") \
            .splitlines()[-1] == saelens_class
        theirs = load_file(str(tmp_path / f"out{i}.safetensors"))
        with torch.no_grad():
            torch.testing.assert_close(sae.encode(x), theirs["features"], atol=1e-5, rtol=0)
            torch.testing.assert_close(sae(x), theirs["output"], atol=1e-5, rtol=0)
        assert float((theirs["features"] > 0).float().mean()) > 0.05


@needs_saelens
@pytest.mark.parametrize("architecture", ["standard", "topk", "batchtopk", "jumprelu"])
def test_the_training_loss_and_its_gradient_are_saelens(architecture, tmp_path):
    sae = training_sae(architecture, d_in=16)
    dead = torch.zeros(40, dtype=torch.bool)
    dead[:9] = True
    sae.steps_since_fired[dead] = sae.cfg.dead_feature_window + 1
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ours = sae.losses(x, x, coefficient=0.7)
    ours["loss"].backward()
    settings = {"d_in": 16, "d_sae": 40}
    settings.update({"standard": {"l1_coefficient": 0.7, "coefficients": {"l1": 0.7}},
                     "topk": {"k": 5, "aux_loss_coefficient": 1.0}, "batchtopk": {"k": 5, "aux_loss_coefficient": 1.0},
                     "jumprelu": {"l0_coefficient": 0.7, "jumprelu_bandwidth": 0.05, "coefficients": {"l0": 0.7}}}[architecture])
    state = {n: p.detach().contiguous() for n, p in sae.named_parameters()}
    save_file(state, str(tmp_path / "state.safetensors"))
    save_file({"x": x, "dead_mask": dead.to(torch.uint8)}, str(tmp_path / "in.safetensors"))
    oracle("loss", architecture, json.dumps(settings), tmp_path / "state.safetensors", tmp_path / "in.safetensors",
           tmp_path / "out.safetensors")
    theirs = load_file(str(tmp_path / "out.safetensors"))
    names = {"mse": "mse_loss", "l1": "l1_loss", "l0": "l0_loss", "auxk": "auxiliary_reconstruction_loss"}
    for ours_name, their_name in names.items():
        if ours_name in ours:
            torch.testing.assert_close(ours[ours_name].detach(), theirs[their_name], atol=1e-9, rtol=1e-9, msg=ours_name)
    torch.testing.assert_close(ours["loss"].detach(), theirs["loss"], atol=1e-9, rtol=1e-9)
    for name, p in sae.named_parameters():
        # SAELens keeps a JumpReLU threshold in float32 whatever the SAE's dtype: its gradient is float32's
        tolerance = dict(atol=1e-5, rtol=1e-5) if name == "threshold" else dict(atol=1e-9, rtol=1e-7)
        torch.testing.assert_close(p.grad, theirs[f"grad.{name}"].to(p.grad.dtype), **tolerance, msg=name)


def test_probe_train_sae_writes_a_dictionary_probe_sae_can_load(tiny_dir, tmp_path, capsys):
    from probe.cli.cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(TEXTS))
    out = tmp_path / "sae"
    argv = ["train_sae", "--model", str(tiny_dir), "--hook", "blocks.0.hook_resid_post", "--arch", "topk", "--k", "4",
            "--d-sae", "32", "--tokens", "1k", "--batch-tokens", "256", "--buffer-tokens", "1024", "--context-size", "32",
            "--corpus", str(corpus), "--out", str(out), "--quiet"]
    assert main(argv) == 0
    assert "trained topk d_sae=32 on blocks.0.hook_resid_post: 768 tokens" in capsys.readouterr().out
    sae = SparseAutoencoder.from_pretrained(out)
    assert sae.cfg.k == 4 and json.loads((out / "training.json").read_text())["config"]["training_tokens"] == 1000
    assert main(argv) == 2 and "already holds a dictionary" in capsys.readouterr().err


# ---- the schedules and one training step, by hand and against SAELens -------------------------------
def test_training_steps_are_adam_on_the_loss_with_saelens_schedules_by_hand():
    """Three steps of train_on_store against the same steps taken by hand: the loss written out (by_hand), clipping
    at 1 and torch.optim.Adam, with SAELens 6's schedules: the learning rate warms up as (step + 1) / warm
    (`LinearLR(start_factor=1/warm)`), the L1 coefficient as step / warm (`CoefficientScheduler` starts at 0.0 and
    steps after each training step)."""
    truth = ground_truth()
    cfg = TrainingConfig(hook_name="blocks.0.hook_resid_post", d_sae=32, training_tokens=64 * 3, batch_tokens=64,
                         architecture="standard", l1_coefficient=0.5, coefficient_warm_up_steps=2, lr=1e-2,
                         lr_warm_up_steps=2, seed=3)
    ours = train_on_store(SyntheticStore(truth, 64), cfg, 24, 24, progress=False)
    store = SyntheticStore(truth, 64)
    batches = [store.next_batch()[0] for _ in range(3)]
    sae = TrainingSAE(cfg, 24, 24, torch.Generator().manual_seed(cfg.seed))  # the same initial weights
    with torch.no_grad():
        sae.b_dec.copy_(batches[0].mean(0))
    optimizer = torch.optim.Adam(sae.parameters(), lr=cfg.lr, betas=cfg.adam_betas)
    for step, x in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / 2)
        terms, _ = by_hand(sae, x, x, 0.5 * min(1.0, step / 2))
        optimizer.zero_grad()
        sum(terms.values()).backward()
        torch.nn.utils.clip_grad_norm_(sae.parameters(), 1.0)
        optimizer.step()
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        torch.testing.assert_close(getattr(ours.sae, name), getattr(sae, name).detach(), atol=1e-6, rtol=0, msg=name)


@needs_saelens
def test_the_lr_and_coefficient_schedules_are_saelens():
    theirs = json.loads(oracle("schedules", 12).splitlines()[-1])
    from probe.training_config import coefficient_at, lr_factor
    cfg = TrainingConfig(hook_name="blocks.0.hook_resid_post", d_sae=8, training_tokens=12 * 32, batch_tokens=32,
                         architecture="standard", lr=0.1, lr_warm_up_steps=3, lr_decay_steps=4, l1_coefficient=0.7,
                         coefficient_warm_up_steps=5)
    assert [0.1 * lr_factor(cfg, s) for s in range(12)] == pytest.approx(theirs["lr"], abs=1e-12)
    assert [coefficient_at(cfg, s) for s in range(12)] == pytest.approx(theirs["coefficient"], abs=1e-12)


@pytest.mark.parametrize("bad, named", [
    (dict(lr_warm_up_steps=-2), "lr_warm_up_steps"), (dict(lr_decay_steps=-3), "lr_decay_steps"),
    (dict(coefficient_warm_up_steps=-1), "coefficient_warm_up_steps"), (dict(l1_coefficient=-1.0), "l1_coefficient"),
    (dict(architecture="jumprelu", l0_coefficient=-0.1), "l0_coefficient"),
    (dict(architecture="topk", k=4, aux_coefficient=-1.0), "aux_coefficient"),
    (dict(max_grad_norm=-1.0), "max_grad_norm"), (dict(architecture="jumprelu", jumprelu_bandwidth=0.0), "jumprelu_bandwidth"),
    (dict(architecture="batchtopk", k=4, topk_threshold_lr=0.0), "topk_threshold_lr"),
    (dict(architecture="batchtopk", k=4, topk_threshold_lr=1.5), "topk_threshold_lr"),
    (dict(decoder_init_norm=0.0), "decoder_init_norm"),
])
def test_bad_settings_are_refused_naming_the_setting(bad, named):
    """Each of these trains silently wrong otherwise: a negative warm-up or decay makes the learning rate or the
    coefficient negative (gradient ascent), a negative max_grad_norm flips every gradient in clip_grad_norm_, a
    zero bandwidth divides by zero in the backward, a zero threshold rate keeps BatchTopK's threshold at 0."""
    base = dict(hook_name="blocks.0.hook_resid_post", d_sae=32, training_tokens=64 * 10, batch_tokens=64, architecture="standard")
    with pytest.raises(ValueError, match=named):
        TrainingConfig(**{**base, **bad})


def test_replacing_a_final_dictionary_never_leaves_a_cfg_describing_other_weights(tmp_path, monkeypatch):
    """save_final with overwrite: were it interrupted between its two renames, the directory must not hold the old
    cfg.json beside the new weights (a cfg.json is the promise that its weights are there)."""
    from probe.training_checkpoints import save_final

    cfg = TrainingConfig(hook_name="blocks.0.hook_resid_post", d_sae=16, training_tokens=64, batch_tokens=32,
                         architecture="standard")
    old = SparseAutoencoder(SAEConfig(d_in=12, d_sae=8, hook_name=cfg.hook_name, architecture="topk", k=2))
    new = SparseAutoencoder(SAEConfig(d_in=12, d_sae=16, hook_name=cfg.hook_name, architecture="standard"))
    out = tmp_path / "out"
    old.save_pretrained(out)
    original = Path.replace

    def interrupted(self, target):
        if Path(target).name == "cfg.json":
            raise KeyboardInterrupt  # as if the process were killed between the renames
        return original(self, target)

    monkeypatch.setattr(Path, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_final(out, new, cfg, [{}], overwrite=True)
    monkeypatch.setattr(Path, "replace", original)
    weights = load_file(str(out / "sae_weights.safetensors"))
    if (out / "cfg.json").exists():
        described = json.loads((out / "cfg.json").read_text())
        assert described["d_sae"] == weights["W_enc"].shape[1], (described["d_sae"], weights["W_enc"].shape)
