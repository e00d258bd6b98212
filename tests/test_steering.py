"""Steering against independent oracles: transformers' hidden states and forward hooks, a full re-forward with
the additions written by hand, and uncached generation."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from probe.analyses import SteeringVector, loglik_metric, steer, steering_sweep, steering_vector, target_logprob_metric
from probe.analyses.ablation import loss_metric
from probe.analyses.pruning import token_batches
from probe import HookedDecoder, SAEConfig, SparseAutoencoder, act_name

from test_variants import build

POSITIVE = ["To be, or not to be", "The quick brown fox jumps", "When in the course of human"]
NEGATIVE = ["that is the question", "over the lazy dog, and", "events it becomes necessary for one"]


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):  # rotary positions, grouped-query attention, no tokenizer
    directory = tmp_path_factory.mktemp("llama-steer")
    hf = build("llama", directory)
    return hf, HookedDecoder.from_pretrained(directory).eval()


def pair_of(which, tiny_hf, tiny_model, request):
    return (tiny_hf, tiny_model) if which == "gpt2" else request.getfixturevalue("llama_pair")


def direction_for(model, layer, seed=0, scale=1.0):
    """A random direction as long as the residual stream at `layer` typically is (times `scale`), so a steer is
    strong enough to change generations without drowning everything."""
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 8), generator=torch.Generator().manual_seed(seed))
    _, cache = model.run_with_cache(tokens, names=[act_name("resid_pre", layer)])
    typical = cache[act_name("resid_pre", layer)].norm(dim=-1).mean()
    direction = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(seed + 1))
    return direction / direction.norm() * typical * scale


def no_hooks_left(model):
    return not any(model.hook_point(n).active for n in model.hook_names) and not model._forward_pre_hooks


# ---- the vector ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("position", ["last", "mean"])
@pytest.mark.parametrize("layer", [0, 1])
def test_vector_is_the_mean_difference_of_transformers_hidden_states(tiny_model, tiny_hf, position, layer):
    vector = steering_vector(tiny_model, POSITIVE, NEGATIVE, layer=layer, position=position, batch_size=2)

    def activation(text):  # alone, unpadded: hidden_states[l] is what enters block l
        tokens = tiny_model.to_tokens(text)
        with torch.no_grad():
            hidden = tiny_hf(tokens, output_hidden_states=True).hidden_states[layer][0]
        return hidden[-1] if position == "last" else hidden[1:].mean(0)  # "mean" leaves BOS out

    expected = torch.stack([activation(p) - activation(n) for p, n in zip(POSITIVE, NEGATIVE)])
    torch.testing.assert_close(vector.differences, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(vector.direction, expected.mean(0), atol=1e-5, rtol=0)
    assert vector.norm == pytest.approx(float(expected.mean(0).norm()), abs=1e-5)
    spread = (expected - expected.mean(0)).norm(dim=-1).pow(2).mean().sqrt()
    assert vector.spread == pytest.approx(float(spread), abs=1e-5)
    frame = vector.to_frame()
    assert list(frame.columns) == ["pair", "norm", "cosine", "projection"] and len(frame) == 3
    assert frame.cosine.between(-1, 1).all() and len(vector.figure().data) == 1


def test_vector_at_resid_post_matches_the_next_hidden_state(tiny_model, tiny_hf):
    vector = steering_vector(tiny_model, POSITIVE[:1], NEGATIVE[:1], layer=0, site="resid_post")
    with torch.no_grad():
        states = [tiny_hf(tiny_model.to_tokens(t), output_hidden_states=True).hidden_states[1][0, -1]
                  for t in (POSITIVE[0], NEGATIVE[0])]
    torch.testing.assert_close(vector.direction, states[0] - states[1], atol=1e-5, rtol=0)


# ---- a steered forward against transformers ---------------------------------------------------------------
def hf_logits_with_added(hf, blocks, tokens, added: dict[int, torch.Tensor]) -> torch.Tensor:
    """transformers' logits with added[l] summed into the hidden state entering block l, by a torch hook."""
    def add(module, args, kwargs, vec):
        if args:
            return (args[0] + vec, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] + vec}

    handles = [blocks[l].register_forward_pre_hook(lambda m, a, k, vec=vec: add(m, a, k, vec), with_kwargs=True)
               for l, vec in added.items()]
    try:
        with torch.no_grad():
            return hf(tokens).logits
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("which", ["gpt2", "llama"])
@pytest.mark.parametrize("layers", [[1], [0, 1]])
def test_steered_forward_equals_transformers_with_a_forward_hook(which, layers, tiny_model, tiny_hf, request):
    hf, model = pair_of(which, tiny_hf, tiny_model, request)
    blocks = hf.transformer.h if which == "gpt2" else hf.model.layers
    direction = direction_for(model, 1)
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 9), generator=torch.Generator().manual_seed(3))
    with steer(model, direction, 1.5, layers=layers), torch.no_grad():
        ours = model(tokens)
    expected = hf_logits_with_added(hf, blocks, tokens, {l: 1.5 * direction for l in layers})
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        assert (ours - hf(tokens).logits).abs().max() > 1e-2  # the steer did something
    assert no_hooks_left(model)


# ---- generation -------------------------------------------------------------------------------------------
def reforward_hook(delta, positions, prompt_length):
    """The addition written by hand for a full forward over the whole sequence so far."""
    def add(x, hook):
        cols = torch.arange(x.shape[1])
        chosen = {"all": cols >= 0, "prompt": cols < prompt_length, "generated": cols >= prompt_length}[positions]
        return x + chosen[None, :, None].to(x.dtype) * delta
    return add


@pytest.mark.parametrize("positions", ["all", "prompt", "generated"])
@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_cached_steered_generation_equals_a_full_reforward_at_every_step(which, positions, tiny_model, tiny_hf, request):
    model = pair_of(which, tiny_hf, tiny_model, request)[1]
    layer, n_new = 1, 6
    direction = direction_for(model, layer, scale=2.0)
    tokens = torch.randint(1, model.cfg.d_vocab, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0  # the second prompt is left-padded
    steering = steer(model, direction, 1.0, layers=layer, positions=positions)
    with steering.applied(model):
        out, caches = model.generate(tokens, n_new, attention_mask=mask, cache_names=["ln_final.hook_normalized"])
    plain = model.generate(tokens, n_new, attention_mask=mask)
    assert out.tolist() != plain.tolist()  # the steer changed what was generated
    full_mask = torch.cat([mask, torch.ones(2, n_new, dtype=mask.dtype)], dim=1)
    hook = reforward_hook(direction, positions, tokens.shape[1])
    for step, cache in enumerate(caches):  # pass `step` predicts token tokens.shape[1] + step
        n = tokens.shape[1] + step
        with torch.no_grad():
            logits, full = model.run_with_cache(out[:, :n], attention_mask=full_mask[:, :n], names=["ln_final.hook_normalized"],
                                                fwd_hooks=[(act_name("resid_pre", layer), hook)])
        torch.testing.assert_close(cache["ln_final.hook_normalized"][:, -1], full["ln_final.hook_normalized"][:, -1],
                                   atol=1e-4, rtol=0)
        assert out[:, n].tolist() == logits[:, -1].argmax(-1).tolist()
    assert no_hooks_left(model)


@pytest.mark.parametrize("positions", ["all", "prompt", "generated"])
@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_cached_and_uncached_steered_generation_agree_token_for_token(which, positions, tiny_model, tiny_hf, request):
    model = pair_of(which, tiny_hf, tiny_model, request)[1]
    steering = steer(model, direction_for(model, 0, scale=2.0), 1.0, layers=[0, 1], positions=positions)
    prompt = torch.randint(0, model.cfg.d_vocab, (3, 5), generator=torch.Generator().manual_seed(6))
    with steering.applied(model):
        cached = model.generate(prompt, 10)
    with steering.applied(model):
        uncached = model.generate(prompt, 10, use_cache=False)
    assert cached.tolist() == uncached.tolist()
    with steering:  # the object itself as the block: the same thing
        assert model.generate(prompt, 10).tolist() == cached.tolist()


def test_generate_takes_steering(tiny_model):
    steering = steer(tiny_model, direction_for(tiny_model, 1, scale=2.0), 1.0, layers=1, positions="generated")
    prompt = torch.randint(0, tiny_model.cfg.d_vocab, (2, 5), generator=torch.Generator().manual_seed(8))
    with steering.applied(tiny_model):
        expected = tiny_model.generate(prompt, 8)
    assert tiny_model.generate(prompt, 8, steering=steering).tolist() == expected.tolist()
    assert tiny_model.generate(prompt, 8, steering=steering, use_cache=False).tolist() == expected.tolist()
    assert torch.equal(tiny_model.generate(prompt, 8), tiny_model.generate(prompt, 8, steering=None))
    assert no_hooks_left(tiny_model)


# ---- off, errors, composition -----------------------------------------------------------------------------
def test_steering_off_is_bit_identical_and_leaves_nothing_attached(tiny_model, tokens):
    with torch.no_grad():
        before = tiny_model(tokens)
        steering = steer(tiny_model, direction_for(tiny_model, 1), 0.0, layers=1)
        with steering:
            assert no_hooks_left(tiny_model)  # coefficient 0 attaches nothing
            zero = tiny_model(tokens)
        with pytest.raises(RuntimeError, match="inside"):
            with steer(tiny_model, direction_for(tiny_model, 1), 2.0, layers=[0, 1], positions="prompt"):
                assert not no_hooks_left(tiny_model)
                raise RuntimeError("inside the block")
        assert no_hooks_left(tiny_model)  # removed on the way out, error and all
        after = tiny_model(tokens)
    assert torch.equal(before, zero) and torch.equal(before, after)


def test_hooks_and_steering_compose(tiny_model, tokens):
    name = act_name("resid_pre", 1)
    a, b = direction_for(tiny_model, 1, seed=0), direction_for(tiny_model, 1, seed=7)
    _, clean = tiny_model.run_with_cache(tokens, names=[name])
    with steer(tiny_model, a, 2.0, layers=1):
        logits, cache = tiny_model.run_with_cache(tokens, names=[name])  # a hook attached inside sees the steer
        with steer(tiny_model, b, -1.0, layers=1), torch.no_grad():  # nested steers add up
            both = tiny_model(tokens)
    torch.testing.assert_close(cache[name], clean[name] + 2.0 * a, atol=1e-6, rtol=0)
    with torch.no_grad():
        by_hand = tiny_model.run_with_hooks(tokens, fwd_hooks=[(name, lambda x, hook: x + 2.0 * a - b)])
    torch.testing.assert_close(both, by_hand, atol=1e-5, rtol=0)
    seen = []
    with steer(tiny_model, a, 2.0, layers=1):  # a generation's own fwd_hooks run after the steer, on every pass
        tiny_model.generate(tokens[:1], 3, fwd_hooks=[(name, lambda x, hook: seen.append(x[0, -1].clone()))])
    torch.testing.assert_close(seen[0], clean[name][0, -1] + 2.0 * a, atol=1e-6, rtol=0)
    assert len(seen) == 3 and no_hooks_left(tiny_model)


def test_sae_feature_steers_by_its_decoder_row(tiny_model, tokens):
    sae = SparseAutoencoder(SAEConfig(d_in=64, d_sae=32, hook_name="blocks.1.hook_resid_mid"))
    with torch.no_grad():
        sae.W_dec.copy_(torch.randn(32, 64, generator=torch.Generator().manual_seed(2)))
        by_hand = tiny_model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_mid", lambda x, hook: x + 3.0 * sae.W_dec[5])])
        with steer(tiny_model, feature=(sae, 5), coefficient=3.0):
            ours = tiny_model(tokens)
        with steer(tiny_model, (sae, 5), 3.0):  # positional (sae, index) too
            positional = tiny_model(tokens)
    torch.testing.assert_close(ours, by_hand, atol=1e-5, rtol=0)
    assert torch.equal(ours, positional) and (ours - tiny_model(tokens)).abs().max() > 1e-2
    with pytest.raises(ValueError, match="d_sae=32"):
        steer(tiny_model, feature=(sae, 32))
    on_z = SparseAutoencoder(SAEConfig(d_in=64, d_sae=8, hook_name="blocks.0.attn.hook_z"))
    with pytest.raises(ValueError, match="residual-width"):
        steer(tiny_model, feature=(on_z, 0))


@pytest.mark.parametrize("call, message", [
    (lambda m: steering_vector(m, POSITIVE, NEGATIVE[:2], layer=0), "3 positive prompts but 2 negative"),
    (lambda m: steering_vector(m, POSITIVE, NEGATIVE, layer=2), r"layer=2 must be an int in \[0, n_layers=2\)"),
    (lambda m: steering_vector(m, POSITIVE, NEGATIVE, layer=0, site="hook_z"), "cannot be steered"),
    (lambda m: steering_vector(m, POSITIVE, NEGATIVE, layer=0, position="first"), "'last' or 'mean'"),
    (lambda m: steer(m, torch.zeros(64)), "pass layers="),
    (lambda m: steer(m, torch.zeros(32), layers=0), "d_model=32"),
    (lambda m: steer(m, torch.zeros(64), float("nan"), layers=0), "finite"),
    (lambda m: steer(m, torch.zeros(64), layers=[0, 0]), "twice"),
    (lambda m: steer(m, torch.zeros(64), layers=0, positions="new"), "all, prompt, generated"),
    (lambda m: steer(m), "exactly one"),
    (lambda m: steer(m, (None, 0), feature=(None, 0)), "once"),
])
def test_bad_input_is_a_clear_error(tiny_model, call, message):
    with pytest.raises(ValueError, match=message):
        call(tiny_model)


# ---- files ------------------------------------------------------------------------------------------------
def test_save_and_load_round_trip_and_refusals(tiny_model, tmp_path):
    vector = steering_vector(tiny_model, POSITIVE, NEGATIVE, layer=1, model_name="tiny")
    tensors, sidecar = vector.save(tmp_path / "v.safetensors")
    assert (tensors, sidecar) == (tmp_path / "v.safetensors", tmp_path / "v.json")
    meta = json.loads(sidecar.read_text())
    assert (meta["model_name"], meta["layer"], meta["site"], meta["d_model"]) == ("tiny", 1, "resid_pre", 64)
    assert tensors.read_bytes()[8:9] == b"{"  # a safetensors header (8-byte length, then JSON), not a pickle
    loaded = SteeringVector.load(tensors, tiny_model)
    assert torch.equal(loaded.direction, vector.direction) and torch.equal(loaded.differences, vector.differences)
    assert (loaded.layer, loaded.site, loaded.position, loaded.model_name) == (1, "resid_pre", "last", "tiny")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        vector.save(tensors)
    vector.save(tensors, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.json", "v.safetensors"]  # no temporary files left
    with pytest.raises(ValueError, match=".safetensors"):
        vector.save(tmp_path / "v.pt")

    narrow = SteeringVector(direction=torch.ones(32), layer=0)
    narrow.save(tmp_path / "narrow.safetensors")
    with pytest.raises(ValueError, match="d_model=32.*d_model=64"):
        SteeringVector.load(tmp_path / "narrow.safetensors", tiny_model)
    (tmp_path / "narrow.json").write_text(json.dumps({**json.loads((tmp_path / "narrow.json").read_text()), "d_model": 64}))
    with pytest.raises(ValueError, match="do not belong together"):
        SteeringVector.load(tmp_path / "narrow.safetensors")
    (tmp_path / "narrow.json").unlink()
    with pytest.raises(FileNotFoundError, match="narrow.json is missing"):
        SteeringVector.load(tmp_path / "narrow.safetensors")


# ---- the sweep --------------------------------------------------------------------------------------------
def test_sweep_matches_metric_and_heldout_loss_computed_by_hand(tiny_model):
    direction = direction_for(tiny_model, 1)
    heldout = " ".join(POSITIVE + NEGATIVE) * 3
    sweep = steering_sweep(tiny_model, direction, POSITIVE, [-1.0, 0.5, 2.0], layers=1, versus=NEGATIVE,
                           heldout=heldout, heldout_windows=2, progress=False)
    windows = torch.cat(token_batches(tiny_model, heldout, max_windows=2))
    name = act_name("resid_pre", 1)
    for i, c in enumerate([-1.0, 0.5, 2.0]):
        hooks = [(name, lambda x, hook: x + c * direction)]
        with tiny_model.hooks(hooks), torch.no_grad():
            pos, neg = (tiny_model.to_tokens(t, return_attention_mask=True) for t in (POSITIVE, NEGATIVE))
            metric = [loglik_metric(tiny_model(t, attention_mask=m), t, m).mean() for t, m in (pos, neg)]
            loss = loss_metric(tiny_model(windows), windows, torch.ones_like(windows)).mean()
        assert float(sweep.metric[i]) == pytest.approx(float(metric[0] - metric[1]), abs=1e-4)
        assert float(sweep.heldout_loss[i]) == pytest.approx(float(loss), abs=1e-4)
    with torch.no_grad():  # the unsteered baseline, by hand
        pos, neg = (tiny_model.to_tokens(t, return_attention_mask=True) for t in (POSITIVE, NEGATIVE))
        clean = [loglik_metric(tiny_model(t, attention_mask=m), t, m).mean() for t, m in (pos, neg)]
        clean_loss = loss_metric(tiny_model(windows), windows, torch.ones_like(windows)).mean()
    assert sweep.baseline_metric == pytest.approx(float(clean[0] - clean[1]), abs=1e-4)
    assert sweep.baseline_loss == pytest.approx(float(clean_loss), abs=1e-4)
    frame = sweep.to_frame()
    assert list(frame.columns) == ["coefficient", "metric", "metric_prompts", "metric_versus", "metric_change",
                                   "heldout_loss", "loss_change"]
    assert frame.coefficient.tolist() == [-1.0, 0.5, 2.0]
    figure = sweep.figure()
    assert len(figure.data) == 2 and "L1 resid_pre" in figure.layout.title.text


def test_fluency_limits_and_target_metric(tiny_model):
    sweep = steering_sweep(tiny_model, direction_for(tiny_model, 0, scale=3.0), ["To be, or not"], [-4, -1, 1, 4],
                           target_logprob_metric(tiny_model, [" to", " be"]), layers=0, heldout=" ".join(POSITIVE) * 4,
                           heldout_windows=1, progress=False)
    limits = sweep.fluency_limits(tolerance=0.0)
    over = {c: float(l) > sweep.baseline_loss for c, l in zip(sweep.coefficients.tolist(), sweep.heldout_loss)}
    assert limits["positive"] == min([c for c, bad in over.items() if bad and c > 0], default=None)
    assert limits["negative"] == max([c for c, bad in over.items() if bad and c < 0], default=None)
    assert sweep.fluency_limits(tolerance=1e9) == {"positive": None, "negative": None}
    with torch.no_grad():
        logits = tiny_model(tiny_model.to_tokens("To be, or not"))
    ids = [tiny_model.to_single_token(" to"), tiny_model.to_single_token(" be")]
    expected = logits[0, -1].log_softmax(-1)[ids].exp().sum().log()
    assert sweep.baseline_metric == pytest.approx(float(expected), abs=1e-5)


# ---- the bundled model, the command line, the docs --------------------------------------------------------
LOVE = ["I love thee, sweet, with all my heart.", "O gentle love, my dear, my joy!", "Thy kiss is sweet, my love, my dear.",
        "My heart is thine; I love thee dearly.", "Sweet love, come kiss me, gentle heart."]
HATE = ["I hate thee, villain, with all my heart.", "O bloody war, my death, my grave!", "Thy sword is sharp, thou villain, die.",
        "My blade is drawn; I hate thee deadly.", "Foul traitor, come and fight, base slave."]
LOVE_WORDS = re.compile(r"\b(love|loves|loving|lov'd|sweet|kiss|heart|dear|joy|gentle)\b", re.I)


@pytest.mark.slow
def test_a_contrastive_steer_shifts_the_bundled_model(bundled_model):
    """The docs' love - hate example: sampled continuations use love words several times as often, and the sweep
    shows the held-out loss climbing with the coefficient."""
    model = bundled_model
    vector = steering_vector(model, LOVE, HATE, layer=2)
    prompts = ["KING HENRY.\nNow, my lords,", "What news?", "I went to the market and"]

    def love_rate(coefficient):
        found = words = 0
        for prompt in prompts:
            tokens = model.to_tokens(prompt).repeat(16, 1)
            with steer(model, vector, coefficient).applied(model):
                out = model.generate(tokens, 30, temperature=1.0, seed=0)
            for row in out:
                text = model.tokenizer.decode(row[tokens.shape[1]:].tolist())
                found, words = found + len(LOVE_WORDS.findall(text)), words + len(text.split())
        return found / words

    assert love_rate(2.0) > 4 * love_rate(0.0)
    sweep = steering_sweep(model, vector, LOVE, [0.5, 1.0, 4.0], versus=HATE, heldout_windows=2, progress=False)
    assert bool((sweep.heldout_loss.diff() > 0).all()) and float(sweep.heldout_loss[-1]) > sweep.baseline_loss + 1
    assert sweep.fluency_limits()["positive"] in (0.5, 1.0) and float(sweep.metric[0]) > sweep.baseline_metric


def test_cli_writes_vector_generations_and_sweep(tiny_dir, tiny_model, tmp_path, capsys):
    from probe.cli import cli

    (tmp_path / "pos.txt").write_text("\n".join(POSITIVE) + "\n")
    (tmp_path / "neg.txt").write_text("\n".join(NEGATIVE) + "\n")
    out = tmp_path / "out"
    code = cli.main(["steer", "--model", str(tiny_dir), "--positive", str(tmp_path / "pos.txt"), "--negative",
                     str(tmp_path / "neg.txt"), "--layer", "1", "--coefficient", "4", "--prompt", "<script>alert('x')",
                     "--max-new-tokens", "5", "--heldout-windows", "1", "--out", str(out), "--quiet"])
    assert code == 0, capsys.readouterr().err
    written = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))  # not the run's own record
    assert written == ["generations.csv", "generations.html", "index.html", "plotly.min.js", "sweep.csv", "sweep.html",
                       "vector.json", "vector.safetensors", "vector_pairs.csv"]
    vector = SteeringVector.load(out / "vector.safetensors", tiny_model)
    torch.testing.assert_close(vector.direction, steering_vector(tiny_model, POSITIVE, NEGATIVE, layer=1).direction)
    page = (out / "generations.html").read_text()
    assert "<script>alert" not in page and "&lt;script&gt;alert" in page
    import pandas as pd

    frame = pd.read_csv(out / "generations.csv")
    assert frame.coefficient.tolist() == [0.0, 4.0]
    assert frame.completion[0] == tiny_model.to_string(tiny_model.generate(tiny_model.to_tokens("<script>alert('x')"), 5)[0, -5:])
    code = cli.main(["steer", "--model", str(tiny_dir), "--positive", str(tmp_path / "pos.txt"), "--negative",
                     str(tmp_path / "pos.txt").replace("pos", "missing"), "--layer", "1", "--prompt", "x",
                     "--out", str(tmp_path / "o2")])
    assert code == 2 and "missing.txt does not exist" in capsys.readouterr().err


def test_docs_example_runs():
    doc = Path(__file__).resolve().parent.parent / "docs" / "steering.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(encoding="utf-8"), flags=re.S)
    assert blocks
    exec(compile(blocks[0], str(doc), "exec"), {})


# ---- review: defects found against oracles ---------------------------------------------------------------
def greedy_by_reforward(model, prompt, n_new, hooks):
    """Greedy tokens from full re-forwards with `hooks` written by hand: the oracle for a steered generation."""
    out = prompt
    for _ in range(n_new):
        with torch.no_grad():
            logits = model.run_with_hooks(out, fwd_hooks=hooks)
        out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out


@pytest.mark.parametrize("positions", ["prompt", "generated"])
def test_another_threads_forward_does_not_move_the_steered_positions(tiny_model, positions):
    """A plain forward on the shared model from another thread, between a steered pass's start and its steered
    layer, must neither see the steer nor change which positions the steered pass steers."""
    import threading

    model, layer, n_new = tiny_model, 1, 6
    direction = direction_for(model, layer, scale=2.0)
    prompt = torch.randint(1, model.cfg.d_vocab, (2, 5), generator=torch.Generator().manual_seed(11))
    other = torch.randint(1, model.cfg.d_vocab, (1, 4), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        other_clean = model(other)
    seen = []

    def interleave(x, hook):  # runs in each steered pass after it began, before block `layer`
        thread = threading.Thread(target=lambda: seen.append(model(other).detach()))
        thread.start()
        thread.join()

    expected = greedy_by_reforward(model, prompt, n_new, [(act_name("resid_pre", layer),
                                                           reforward_hook(direction, positions, prompt.shape[1]))])
    steering = steer(model, direction, 1.0, layers=layer, positions=positions)
    out = model.generate(prompt, n_new, steering=steering, fwd_hooks=[("hook_embed", interleave)])
    assert out.tolist() == expected.tolist()
    assert len(seen) == n_new and all(torch.equal(s, other_clean) for s in seen)  # the other thread is unsteered
    assert no_hooks_left(model)


def test_target_logprob_counts_each_target_once(tiny_model):
    """log p(targets) is the log of the targets' total probability: a token named twice (as text and as its id,
    or twice) is still one token, not twice its probability."""
    prompt = tiny_model.to_tokens("To be, or not")
    to = tiny_model.to_single_token(" to")
    with torch.no_grad():
        logits = tiny_model(prompt)
    by_hand = logits[0, -1].log_softmax(-1)[to]
    for targets in ([" to", " to"], [" to", to]):
        metric = target_logprob_metric(tiny_model, targets)
        value = metric(logits, prompt, torch.ones_like(prompt, dtype=torch.bool))
        assert float(value[0]) == pytest.approx(float(by_hand), abs=1e-5)


def steer_cli(tiny_dir, tmp_path, *extra, prompts=("To be",)):
    from probe.cli import cli

    (tmp_path / "pos.txt").write_text("\n".join(POSITIVE) + "\n")
    (tmp_path / "neg.txt").write_text("\n".join(NEGATIVE) + "\n")
    argv = ["steer", "--model", str(tiny_dir), "--positive", str(tmp_path / "pos.txt"), "--negative",
            str(tmp_path / "neg.txt"), "--layer", "1", "--max-new-tokens", "4", "--heldout-windows", "1", "--quiet"]
    for prompt in prompts:
        argv += ["--prompt", prompt]
    return cli.main(argv + list(extra))


def page_table(out):
    """[header cells, then each row's cells] of generations.html."""
    page = (out / "generations.html").read_text()
    rows = re.findall(r"<tr>(.*?)</tr>", page, flags=re.S)
    return [re.findall(r"<t[hd]>", row) for row in rows]


def test_cli_generations_page_has_one_column_per_run(tiny_dir, tiny_model, tmp_path, capsys, coefficient="0"):
    """The page's columns are the runs, unsteered first: with --coefficient 0 both runs are coefficient 0, and
    the header must still have a column for each of a row's cells."""
    out = tmp_path / "out"
    assert steer_cli(tiny_dir, tmp_path, "--coefficient", coefficient, "--out", str(out)) == 0, capsys.readouterr().err
    header, *rows = page_table(out)
    assert len(header) == 3 and all(len(row) == 3 for row in rows) and len(rows) == 1  # sample, unsteered, steered
    page = (out / "generations.html").read_text()
    assert page.index("unsteered") < page.index(f"steered x{float(coefficient):g}")
    plain = tiny_model.to_string(tiny_model.generate(tiny_model.to_tokens("To be"), 4)[0, -4:])
    first = re.findall(r"<b>(.*?)</b>", page, flags=re.S)[0]  # the first cell is the unsteered continuation
    import html as html_module

    assert html_module.unescape(first) == plain


def test_cli_refuses_a_prompt_given_twice(tiny_dir, tmp_path, capsys):
    """Two identical --prompt values merged into one row of four cells under two headers; now a clear error."""
    out = tmp_path / "out"
    code = steer_cli(tiny_dir, tmp_path, "--coefficient", "2", "--out", str(out), prompts=("To be", "The", "To be"))
    err = capsys.readouterr().err
    assert code == 2 and "--prompt 'To be' is given twice" in err and "Traceback" not in err
    assert not (out / "generations.html").exists()


@pytest.mark.parametrize("extra, message", [
    (["--coefficients", "1", "nan"], "--coefficients"),
    (["--coefficients", "inf"], "--coefficients"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--site", "mlp_out"], "--site"),
    (["--position", "mean"], "--position"),
])
def test_cli_bad_flags_are_named_before_any_work(tiny_dir, tiny_model, tmp_path, capsys, extra, message):
    saved = tmp_path / "v.safetensors"
    steering_vector(tiny_model, POSITIVE, NEGATIVE, layer=1).save(saved)
    from probe.cli import cli

    out = tmp_path / "out"
    argv = ["steer", "--model", str(tiny_dir), "--prompt", "To be", "--target", " to", "--max-new-tokens", "3",
            "--heldout-windows", "1", "--out", str(out), "--quiet", *extra]
    if extra[0] in ("--site", "--position"):  # a loaded vector has its own site and position
        argv += ["--vector", str(saved)]
    else:
        (tmp_path / "pos.txt").write_text("\n".join(POSITIVE) + "\n")
        (tmp_path / "neg.txt").write_text("\n".join(NEGATIVE) + "\n")
        argv += ["--positive", str(tmp_path / "pos.txt"), "--negative", str(tmp_path / "neg.txt"), "--layer", "1"]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and f"error: {message}" in err and "Traceback" not in err, err
    assert not (out / "generations.csv").exists()


def test_load_names_a_sidecar_missing_its_layer(tiny_model, tmp_path):
    """A sidecar without "layer" raised a bare KeyError('layer'), which `probe steer --vector` printed as
    'error: layer'; it is a ValueError naming the file and the key."""
    SteeringVector(direction=torch.ones(64), layer=0).save(tmp_path / "v.safetensors")
    meta = json.loads((tmp_path / "v.json").read_text())
    del meta["layer"]
    (tmp_path / "v.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"v\.json lacks layer"):
        SteeringVector.load(tmp_path / "v.safetensors", tiny_model)


@pytest.mark.parametrize("fail_at", [1, 2])  # the tensors' rename, or the sidecar's
def test_an_interrupted_replacement_never_pairs_a_sidecar_with_other_tensors(tiny_model, tmp_path, monkeypatch, fail_at):
    """Replacing a saved vector with one of another layer, interrupted at either rename, leaves files that load as
    one whole vector (the old or the new) or are refused: never the new layer on the old direction or the reverse."""
    import os

    from probe import io

    old = steering_vector(tiny_model, POSITIVE, NEGATIVE, layer=0, model_name="tiny")
    new = steering_vector(tiny_model, POSITIVE, NEGATIVE, layer=1, model_name="tiny")
    assert not torch.allclose(old.direction, new.direction)
    path = tmp_path / "v.safetensors"
    old.save(path)
    renames, rename = [], os.replace

    def interrupted(src, dst):
        renames.append(dst)
        if len(renames) == fail_at:
            raise KeyboardInterrupt  # as if the process were stopped there
        return rename(src, dst)

    monkeypatch.setattr(io.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        new.save(path, overwrite=True)
    monkeypatch.undo()
    assert len(renames) == fail_at
    try:
        loaded = SteeringVector.load(path, tiny_model)
    except FileNotFoundError:
        return  # a half-replaced vector is refused as incomplete
    assert any(loaded.layer == v.layer and torch.equal(loaded.direction, v.direction) for v in (old, new))
