"""SAE feature analyses and `probe sae`: every number against float64 arithmetic on the weights, or the model
run with hand-written hooks (what it reads at the SAE's hook point, what it computes on a given activation)."""
from __future__ import annotations

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from probe.analyses import feature_logits, sae_features, sae_loss_recovered
from probe.analyses.features import feature_inputs
from probe.analyses.labels import token_texts
from probe.analyses.common import escape_token
from probe import DecoderConfig, HookedDecoder, Norm, NormPlacement, SAEConfig, SparseAutoencoder
from test_cli import run_cli
from test_sae import D_SAE, by_hand, random_sae, random_transcoder
from test_sae import randomised as randomised_sae

HOOK = "blocks.0.hook_resid_post"
PROMPTS = ["To be, or not to be, that is the question", "The <b>quick</b> & brown"]  # unequal: the second is padded


def captured(model, tokens, hook, mask=None):
    """The activation at `hook`, kept by a hand-written hook."""
    seen = {}

    def keep(x, hook):
        seen["x"] = x.detach().clone()

    with torch.no_grad():
        model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=[(hook, keep)])
    return seen["x"]


def cross_entropy(logits, tokens, mask):
    """[batch] float64: mean -log p(next token) over each prompt's positions whose next token is real."""
    losses = []
    for b in range(tokens.shape[0]):
        terms = [-logits[b, t].double().log_softmax(-1)[tokens[b, t + 1]]
                 for t in range(tokens.shape[1] - 1) if mask[b, t] and mask[b, t + 1]]
        losses.append(torch.stack(terms).mean())
    return torch.stack(losses)


# ---- sae_features --------------------------------------------------------------------------------
@pytest.mark.parametrize("architecture, hook, k", [
    ("standard", HOOK, 10),
    ("jumprelu", "blocks.1.attn.hook_z", 7),  # reads the heads flattened
    ("topk", "blocks.1.hook_resid_pre", 20),  # 12 active: the top 20 ends in -1s
])
def test_sae_features_match_the_formulas_at_every_real_position(tiny_model, architecture, hook, k):
    sae = random_sae(architecture, hook=hook, seed=7)
    tokens, mask = tiny_model.to_tokens(PROMPTS, return_attention_mask=True)
    mask = mask.bool()
    x = captured(tiny_model, tokens, hook, mask.long()).flatten(2).double()  # [batch pos d_in]
    features, reconstruction = by_hand(sae, x)
    l0 = (features > 0).sum(-1)
    fvu = (x - reconstruction).pow(2).sum(-1) / (x - x.mean(-1, keepdim=True)).pow(2).sum(-1)
    best = features.sort(-1, descending=True).values[..., :k]

    got = sae_features(tiny_model, sae, PROMPTS, k=k)
    assert torch.equal(got.tokens, tokens) and torch.equal(got.mask, mask)
    assert torch.equal(got.l0, torch.where(mask, l0, 0))
    torch.testing.assert_close(got.fvu[mask].double(), fvu[mask], rtol=1e-5, atol=0)
    assert bool(got.fvu[~mask].isnan().all())
    expected_top = torch.where(mask[..., None], best, 0.0)
    torch.testing.assert_close(got.top_activations.double(), expected_top, atol=1e-5, rtol=0)
    listed = got.top_ids >= 0
    assert torch.equal(listed, expected_top > 0)  # -1 exactly past the active features, and at padding
    at_ids = features.gather(-1, got.top_ids.clamp(min=0))  # each listed id really has the listed activation
    torch.testing.assert_close(at_ids[listed], got.top_activations[listed].double(), atol=1e-5, rtol=0)
    assert torch.equal(got.feature_ids, got.top_ids[listed].unique())
    torch.testing.assert_close(got.feature_activations.double(),
                               features[..., got.feature_ids] * mask[..., None], atol=1e-5, rtol=0)
    if architecture == "topk":
        assert int(listed.sum(-1).max()) == 12
    else:
        assert bool((l0[mask] > k).all())  # the top k is a real choice

    frame = got.to_frame()
    assert list(frame.columns) == ["prompt", "position", "token", "rank", "feature", "activation", "l0", "fvu"]
    assert len(frame) == int(listed.sum())  # every real position has an active feature here; padding has no rows
    assert set(zip(frame.prompt, frame.position)) == {tuple(bp) for bp in mask.nonzero().tolist()}
    raw = [tiny_model.tokenizer.token_strings(row.tolist()) for row in tokens]
    assert frame.token.tolist() == [raw[b][p] for b, p in zip(frame.prompt, frame.position)]
    row = frame.iloc[-1]
    assert row.feature == int(got.top_ids[row.prompt, row.position, row["rank"] - 1])  # ranks from 1
    assert row.l0 == int(l0[row.prompt, row.position])


def test_an_sae_narrower_than_the_default_k_lists_every_feature(tiny_model):
    """k defaulted to 10, which an SAE of 6 features refused: the default lists all 6, ranked as the formulas rank
    them; an explicit k past d_sae is still refused, naming the fix."""
    sae = randomised_sae(SparseAutoencoder(SAEConfig(d_in=64, d_sae=6, hook_name=HOOK)), 9, lambda name: 0.3, 0.0)
    tokens = tiny_model.to_tokens(PROMPTS[0])
    features, _ = by_hand(sae, captured(tiny_model, tokens, HOOK).double())
    got = sae_features(tiny_model, sae, tokens)
    assert got.top_ids.shape[-1] == 6
    best = features.sort(-1, descending=True).values
    torch.testing.assert_close(got.top_activations.double(), best.clamp(min=0), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"k=7 must be an integer in \[1, d_sae=6\]: there are only 6; pass k=6 or "
                                         r"less, or leave k unset for min\(10, d_sae\)"):
        sae_features(tiny_model, sae, tokens, k=7)


def test_sae_features_of_a_padded_prompt_are_those_of_the_prompt_alone(tiny_model):
    sae = random_sae(seed=8)
    alone = tiny_model.to_tokens(PROMPTS[1])[0]
    longer = tiny_model.to_tokens(PROMPTS[0])[0]
    pad = len(longer) - len(alone)
    left = torch.stack([longer, torch.cat([torch.zeros(pad, dtype=torch.long), alone])])  # left padding, ids 0
    mask = torch.stack([torch.ones(len(longer)), torch.cat([torch.zeros(pad), torch.ones(len(alone))])]).bool()
    single = sae_features(tiny_model, sae, alone, k=5)
    padded = sae_features(tiny_model, sae, left, k=5, attention_mask=mask)
    assert torch.equal(padded.top_ids[1, pad:], single.top_ids[0]) and bool((padded.top_ids[1, :pad] == -1).all())
    torch.testing.assert_close(padded.top_activations[1, pad:], single.top_activations[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(padded.fvu[1, pad:], single.fvu[0], rtol=1e-5, atol=0)
    assert torch.equal(padded.l0[1, pad:], single.l0[0]) and bool((padded.l0[1, :pad] == 0).all())
    frame = padded.to_frame()
    assert sorted(frame[frame.prompt == 1].position.unique()) == list(range(pad, len(longer)))


def test_a_position_with_no_active_feature_keeps_one_empty_row(tiny_model, tokens):
    sae = random_sae(seed=9)
    with torch.no_grad():
        sae.b_enc.fill_(-1e3)  # nothing fires anywhere
    got = sae_features(tiny_model, sae, tokens, k=3)
    frame = got.to_frame()
    assert len(frame) == tokens.numel() and frame.feature.isna().all() and (frame.l0 == 0).all()
    assert bool((got.top_ids == -1).all()) and got.feature_ids.numel() == 0
    assert frame.fvu.to_numpy() == pytest.approx(got.fvu.flatten().numpy())  # x_hat = b_dec: fvu is still defined
    assert float(got.fvu.min()) > 0


def test_the_features_figure_shows_one_prompts_positions_escaped(tiny_model):
    sae = random_sae(seed=10)
    got = sae_features(tiny_model, sae, PROMPTS, k=4)
    fig = got.figure(prompt=1)
    heat = fig.data[0]
    real = got.mask[1].nonzero().flatten().tolist()
    raw = [got.token_strings[1][p] for p in real]
    assert any("<" in s or "&" in s for s in raw)  # the test sees markup
    assert list(heat.y) == [f"{escape_token(s)} ({p})" for s, p in zip(raw, real)]
    assert not any("<" in label or "& " in label for label in heat.y)
    ids = got.top_ids[1, real]
    expected = sorted(set(ids[ids >= 0].tolist()))
    assert sorted(int(x[1:]) for x in heat.x) == expected  # only this prompt's features, every one of them
    column = list(heat.x).index(f"F{expected[0]}")
    where = got.feature_ids.tolist().index(expected[0])
    assert [row[column] for row in heat.z] == pytest.approx(got.feature_activations[1, real, where].tolist())
    assert len(got.figure(prompt=1, max_features=3).data[0].x) == 3
    with pytest.raises(ValueError, match="outside the batch of 2"):
        got.figure(prompt=2)
    with pytest.raises(ValueError, match="max_features=0 must be a positive integer"):
        got.figure(max_features=0)


# ---- feature_logits ------------------------------------------------------------------------------
def checkpoint_reading(tiny_dir, hook):
    """[d_in vocab] float64 from the saved GPT-2 weights: what a unit direction at `hook` adds to the logits
    through the final LayerNorm's centring and weight, for a fixed scale."""
    w = {k: v.double() for k, v in load_file(str(tiny_dir / "model.safetensors")).items()}
    into_residual = {HOOK: torch.eye(64, dtype=torch.float64),
                     "blocks.1.attn.hook_z": w["transformer.h.1.attn.c_proj.weight"],  # Conv1D: [in out]
                     "blocks.1.mlp.hook_post": w["transformer.h.1.mlp.c_proj.weight"]}[hook]
    centred = into_residual - into_residual.mean(-1, keepdim=True)
    return centred * w["transformer.ln_f.weight"] @ w["transformer.wte.weight"].T


def assert_top_tokens(got, oracle, k):
    """`got` lists each feature's k largest and smallest of oracle [feature vocab] with their values."""
    torch.testing.assert_close(got.top_logits.double(), oracle.topk(k, -1).values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.bottom_logits.double(), oracle.topk(k, -1, largest=False).values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(oracle.gather(-1, got.top_ids), got.top_logits.double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(oracle.gather(-1, got.bottom_ids), got.bottom_logits.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hook, d_in", [(HOOK, 64), ("blocks.1.attn.hook_z", 64), ("blocks.1.mlp.hook_post", 256)])
def test_feature_logits_read_the_decoder_rows_through_the_final_norm(tiny_model, tiny_dir, hook, d_in):
    sae = random_sae(hook=hook, d_in=d_in, seed=11)
    features = [5, 0, 95]
    oracle = sae.W_dec.detach().double()[features] @ checkpoint_reading(tiny_dir, hook)
    got = feature_logits(tiny_model, sae, features, k=6)
    assert got.features.tolist() == features
    assert_top_tokens(got, oracle, 6)
    strings = lambda ids: token_texts(tiny_model.tokenizer, ids)  # noqa: E731 (a partial UTF-8 character as <0xE2>)
    assert got.token_strings == [strings(got.top_ids[i].tolist() + got.bottom_ids[i].tolist()) for i in range(3)]
    frame = got.to_frame()
    assert list(frame.columns) == ["feature", "direction", "rank", "token_id", "token", "logit"] and len(frame) == 36
    promoted = frame[(frame.feature == 95) & (frame.direction == "promoted")]
    assert promoted.token_id.tolist() == got.top_ids[2].tolist()
    assert promoted.logit.to_numpy() == pytest.approx(oracle[2].topk(6).values.numpy(), abs=1e-5)
    fig = got.figure()
    assert [list(row) for row in fig.data[1].text] == [[escape_token(s) for s in got.token_strings[i][6:]] for i in range(3)]


def small_model(**config):
    torch.manual_seed(0)
    model = HookedDecoder(DecoderConfig(n_layers=1, d_model=32, n_heads=2, d_vocab=50, n_ctx=16, **config)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".w"):  # norms start at one: random weights make the test see them
                param.copy_(1 + 0.3 * torch.randn(param.shape))
    return model


@pytest.mark.parametrize("config", [dict(final_norm=False), dict(norm=Norm.RMS),
                                    dict(norm=Norm.RMS, norm_placement=NormPlacement.SANDWICH)])
def test_feature_logits_follow_the_final_norm_the_model_has(config):
    """No final norm: W_dec W_U; RMSNorm: times its weight, not centred; a sandwich block's hook_z: through
    W_O and ln1_post's weight too."""
    model = small_model(**config)
    hook = "blocks.0.attn.hook_z" if "norm_placement" in config else "blocks.0.hook_resid_mid"
    sae = random_sae(hook=hook, d_in=32, seed=12)
    directions = sae.W_dec.detach().double()[[1, 2]]
    if hook.endswith("hook_z"):
        directions = directions @ model.blocks[0].attn.out.weight.detach().double().T * model.blocks[0].ln1_post.w.double()
    if model.cfg.final_norm:
        directions = directions * model.ln_final.w.detach().double()
    oracle = directions @ model.embed.W_E.detach().double().T  # tied embeddings
    assert_top_tokens(feature_logits(model, sae, [1, 2], k=4), oracle, 4)


# ---- transcoders: features read at the input, rows judged where they are written ------------------
def transcoder_by_hand(sae, x):
    """Features and prediction [... d_out] in float64 from the parameters (the skip path x W_skip^T included)."""
    features, prediction = by_hand(sae, x)  # apply_b_dec_to_input=False: x as it is
    return features, prediction + (x.double() @ sae.W_skip.double().T if sae.cfg.skip else 0)


@pytest.mark.parametrize("skip, architecture", [(False, "standard"), (True, "topk")])
def test_a_transcoders_analyses_read_its_input_and_judge_what_it_writes(tiny_model, tiny_dir, tokens, skip, architecture):
    sae = random_transcoder(layer=1, skip=skip, architecture=architecture, seed=5)
    read, written = sae.cfg.hook_name, sae.cfg.hook_name_out
    x, y = captured(tiny_model, tokens, read).double(), captured(tiny_model, tokens, written).double()
    features, prediction = transcoder_by_hand(sae, x)

    got = sae_features(tiny_model, sae, tokens, k=6)
    assert got.hook_name == read and got.hook_name_out == written
    assert torch.equal(got.l0, (features > 0).sum(-1))
    fvu = (y - prediction).pow(2).sum(-1) / (y - y.mean(-1, keepdim=True)).pow(2).sum(-1)
    torch.testing.assert_close(got.fvu.double(), fvu, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.top_activations.double(), features.sort(-1, descending=True).values[..., :6],
                               atol=1e-5, rtol=0)
    assert "transcoder features at blocks.1.ln2.hook_normalized (writing blocks.1.hook_mlp_out)" in got.figure().layout.title.text

    ids = [4, 0, 77]  # the decoder rows write the MLP's output, a residual-stream write: the final norm, then W_U
    logits = feature_logits(tiny_model, sae, ids, k=5)
    assert_top_tokens(logits, sae.W_dec.detach().double()[ids] @ checkpoint_reading(tiny_dir, HOOK), 5)
    assert logits.hook_name_out == written and "written at blocks.1.hook_mlp_out" in logits.figure().layout.title.text

    # the input view: the token embeddings (GPT-2's wte) centred, as ln2 centres, against the encoder columns
    wte = load_file(str(tiny_dir / "model.safetensors"))["transformer.wte.weight"].double()
    scores = sae.W_enc.detach().double()[:, ids].T @ (wte - wte.mean(-1, keepdim=True)).T  # [feature vocab]
    inputs = feature_inputs(tiny_model, sae, ids, k=5)
    assert_top_tokens(inputs, scores, 5)
    frame = inputs.to_frame()
    assert list(frame.columns) == ["feature", "direction", "rank", "token_id", "token", "score"]
    assert set(frame.direction) == {"excites", "inhibits"} and len(frame) == 30

    mask = torch.ones_like(tokens)
    with torch.no_grad():
        clean = cross_entropy(tiny_model(tokens), tokens, mask)
        spliced = cross_entropy(tiny_model.run_with_hooks(tokens, fwd_hooks=[(written, lambda a, hook: prediction.float())]),
                                tokens, mask)
        zero = cross_entropy(tiny_model.run_with_hooks(tokens, fwd_hooks=[(written, lambda a, hook: torch.zeros_like(a))]),
                             tokens, mask)
    loss = sae_loss_recovered(tiny_model, sae, tokens)  # zeroing the MLP's output, not its input
    for value, expected in ((loss.clean, clean), (loss.spliced, spliced), (loss.zero_ablated, zero)):
        torch.testing.assert_close(value.double(), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("config, hook", [({}, "blocks.0.hook_resid_post"),
                                          (dict(norm=Norm.RMS, scale_embed=True), "blocks.0.ln2.hook_normalized")])
def test_feature_inputs_read_the_embeddings_along_the_direct_path(config, hook):
    """On the residual stream the embeddings as they are; at an RMSNorm's output not centred; times Gemma's scale."""
    model = small_model(**config)
    sae = random_sae(hook=hook, d_in=32, seed=3)
    embedded = model.embed.W_E.detach().double() * (32 ** 0.5 if config.get("scale_embed") else 1.0)
    scores = sae.W_enc.detach().double()[:, [2, 9]].T @ embedded.T
    assert_top_tokens(feature_inputs(model, sae, [2, 9], k=4), scores, 4)


def test_feature_inputs_refuse_a_point_the_embeddings_do_not_reach_directly(tiny_model):
    for hook, d_in in (("blocks.0.attn.hook_z", 64), ("blocks.0.hook_mlp_out", 64), ("blocks.0.mlp.hook_post", 256)):
        with pytest.raises(ValueError, match=f"{hook!r} is not on it"):
            feature_inputs(tiny_model, random_sae(hook=hook, d_in=d_in), [1])


def test_a_transcoder_whose_output_point_does_not_fit_is_refused(tiny_model):
    base = dict(d_in=64, d_sae=8, hook_name="blocks.0.ln2.hook_normalized", apply_b_dec_to_input=False)
    for out, d_out, error, match in (("blocks.7.hook_mlp_out", 64, KeyError, "the SAE writes 'blocks.7.hook_mlp_out', a "
                                      "hook point this model lacks"),
                                     ("blocks.0.hook_mlp_out", 32, ValueError, "the SAE writes 32 dimensions, but the "
                                      "activation at 'blocks.0.hook_mlp_out' has 64")):
        sae = SparseAutoencoder(SAEConfig(**base, hook_name_out=out, d_out=d_out))
        with pytest.raises(error, match=match):
            sae_features(tiny_model, sae, "To be")


def test_probe_sae_on_a_transcoder_names_both_points(tiny_dir, tiny_model, tmp_path, capsys):
    sae = random_transcoder(layer=0, skip=True, architecture="jumprelu", seed=8)
    directory = sae.save_pretrained(tmp_path / "tc")
    code, shown, err = run_cli(capsys, "sae", "--model", str(tiny_dir), "--sae", str(directory), "--prompt",
                               "To be, or not", "--k", "3", "--out", str(tmp_path / "out"))
    assert code == 0, err
    assert "transcoder at blocks.0.ln2.hook_normalized -> blocks.0.hook_mlp_out" in shown
    written = pd.read_csv(tmp_path / "out" / "features.csv")
    expected = sae_features(tiny_model, sae, "To be, or not", k=3).to_frame()
    assert written.feature.tolist() == expected.feature.tolist()
    assert written.fvu.to_numpy() == pytest.approx(expected.fvu.to_numpy(), rel=1e-5)


# ---- sae_loss_recovered --------------------------------------------------------------------------
@pytest.mark.parametrize("padded", [False, True])
def test_loss_recovered_matches_the_model_run_on_hand_made_activations(tiny_model, tokens, padded):
    sae = random_sae(seed=13)
    if padded:
        tokens, mask = tiny_model.to_tokens(PROMPTS, return_attention_mask=True)
    else:
        mask = torch.ones_like(tokens)
    x = captured(tiny_model, tokens, HOOK, mask)
    _, reconstruction = by_hand(sae, x)
    with torch.no_grad():
        clean = cross_entropy(tiny_model(tokens, attention_mask=mask), tokens, mask)
        spliced = cross_entropy(tiny_model.run_with_hooks(tokens, attention_mask=mask,
                                                          fwd_hooks=[(HOOK, lambda a, hook: reconstruction.float())]),
                                tokens, mask)
        zero = cross_entropy(tiny_model.run_with_hooks(tokens, attention_mask=mask,
                                                       fwd_hooks=[(HOOK, lambda a, hook: torch.zeros_like(a))]),
                             tokens, mask)
    got = sae_loss_recovered(tiny_model, sae, PROMPTS if padded else tokens)
    for value, expected in ((got.clean, clean), (got.spliced, spliced), (got.zero_ablated, zero)):
        torch.testing.assert_close(value.double(), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(got.recovered.double(), (zero - spliced) / (zero - clean), atol=1e-3, rtol=1e-3)
    assert bool(((spliced - clean).abs() > 1e-3).all()) and bool(((zero - clean).abs() > 1e-3).all())
    frame = got.to_frame()
    assert frame.recovered.to_numpy() == pytest.approx(got.recovered.numpy())
    assert frame.clean_loss.to_numpy() == pytest.approx(clean.numpy(), abs=1e-4)


def test_an_sae_that_reconstructs_exactly_recovers_all_the_loss(tiny_model, tokens):
    """W_enc = W_dec = I and b_dec = -1000: x_hat = relu(x + 1000) - 1000, which is x wherever x > -1000."""
    sae = SparseAutoencoder(SAEConfig(d_in=64, d_sae=64, hook_name=HOOK))
    with torch.no_grad():
        sae.W_enc.copy_(torch.eye(64))
        sae.W_dec.copy_(torch.eye(64))
        sae.b_dec.fill_(-1e3)
    got = sae_loss_recovered(tiny_model, sae, tokens)
    torch.testing.assert_close(got.spliced, got.clean, atol=1e-4, rtol=0)
    torch.testing.assert_close(got.recovered, torch.ones(3), atol=1e-3, rtol=0)
    torch.testing.assert_close(sae_features(tiny_model, sae, tokens, k=1).fvu, torch.zeros(3, 17), atol=1e-6, rtol=0)


# ---- bad inputs ----------------------------------------------------------------------------------
def test_bad_saes_and_arguments_get_clear_errors(tiny_model, tokens):
    lacking = random_sae(hook="blocks.5.hook_resid_post")
    for call in (lambda: sae_features(tiny_model, lacking, tokens), lambda: feature_logits(tiny_model, lacking, 1),
                 lambda: sae_loss_recovered(tiny_model, lacking, tokens)):
        with pytest.raises(KeyError, match=r"the SAE reads 'blocks.5.hook_resid_post', a hook point this model lacks"):
            call()
    narrow = random_sae(d_in=32)
    message = "reads 32 dimensions, but the activation at 'blocks.0.hook_resid_post' has 64"
    for call in (lambda: sae_features(tiny_model, narrow, tokens), lambda: feature_logits(tiny_model, narrow, 1),
                 lambda: sae_loss_recovered(tiny_model, narrow, tokens)):
        with pytest.raises(ValueError, match=message):
            call()
    sae = random_sae()
    for k in (0, D_SAE + 1, True, 2.0):
        with pytest.raises(ValueError, match=rf"k={k!r} must be an integer in \[1, d_sae=96\]"):
            sae_features(tiny_model, sae, tokens, k=k)
    with pytest.raises(ValueError, match=r"k=321 must be an integer in \[1, d_vocab_out=320\]"):
        feature_logits(tiny_model, sae, 1, k=321)
    for features, error, match in ((96, ValueError, r"feature 96 is outside the SAE's features \[0, d_sae=96\)"),
                                   ([3, -1], ValueError, "feature -1 is outside"), ([], ValueError, "empty"),
                                   ([3, 3], ValueError, "twice"), (torch.tensor([1.0]), TypeError, "integer feature ids"),
                                   ([2.5], TypeError, "2.5 is not a feature id"), (True, TypeError, "True")):
        with pytest.raises(error, match=match):
            feature_logits(tiny_model, sae, features)
    with pytest.raises(ValueError, match="'blocks.0.attn.hook_q' is not one"):
        feature_logits(tiny_model, random_sae(hook="blocks.0.attn.hook_q", d_in=16), 1)
    with pytest.raises(ValueError, match=r"one activation vector per position"):  # hook_q: one vector per head
        sae_features(tiny_model, random_sae(hook="blocks.0.attn.hook_q", d_in=16), tokens)
    with pytest.raises(TypeError, match="probe.SparseAutoencoder"):
        sae_features(tiny_model, "sae/dir", tokens)
    with pytest.raises(ValueError, match="attention_mask is built for you"):
        sae_features(tiny_model, sae, "text", attention_mask=torch.ones(1, 2))


# ---- probe sae -----------------------------------------------------------------------------------
def test_probe_sae_writes_what_the_analyses_compute(tiny_dir, tiny_model, tmp_path, capsys):
    sae = random_sae(seed=14)
    directory = sae.save_pretrained(tmp_path / "sae")
    prompt, out = "To be, or not <b>", tmp_path / "out"
    code, shown, err = run_cli(capsys, "sae", "--model", str(tiny_dir), "--sae", str(directory), "--prompt", prompt,
                               "--k", "4", "--out", str(out))
    assert code == 0, err
    found = sae_features(tiny_model, sae, prompt, k=4)
    written = pd.read_csv(out / "features.csv", keep_default_na=False)
    expected = found.to_frame()
    assert written.token.tolist() == expected.token.tolist()
    for column in ("prompt", "position", "rank", "feature", "l0"):
        assert written[column].tolist() == expected[column].tolist(), column
    assert written.activation.to_numpy() == pytest.approx(expected.activation.to_numpy())
    top = found.top_ids[0, -1].tolist()
    logits = pd.read_csv(out / "feature_logits.csv", keep_default_na=False)
    assert logits.feature.unique().tolist() == top  # default: the top features at the last position
    assert logits.token_id.tolist() == feature_logits(tiny_model, sae, top, k=4).to_frame().token_id.tolist()
    loss = pd.read_csv(out / "loss.csv")
    recovered = sae_loss_recovered(tiny_model, sae, prompt)
    assert loss.recovered.to_numpy() == pytest.approx(recovered.recovered.numpy(), abs=1e-6)
    html = (out / "features.html").read_text()
    marked = [(p, s) for p, s in enumerate(found.token_strings[0]) if "<" in s or ">" in s]
    assert marked and all(f'"{escape_token(s)} ({p})"' in html and f'"{s} ({p})"' not in html for p, s in marked)
    assert (out / "feature_logits.html").is_file()
    assert f"F{top[0]}" in shown and f"loss recovered {float(recovered.recovered[0]):.4f}" in shown

    code, _, err = run_cli(capsys, "sae", "--model", str(tiny_dir), "--sae", str(directory), "--prompt", prompt,
                           "--features", "3", "17", "--position", "2", "--out", str(out), "--force")
    assert code == 0, err
    assert pd.read_csv(out / "feature_logits.csv").feature.unique().tolist() == [3, 17]


@pytest.mark.parametrize("args, message", [
    (["--sae", "{tmp}/nowhere"], "cannot load --sae {tmp}/nowhere: {tmp}/nowhere/cfg.json is missing"),
    (["--sae", "{lacking}"], "the SAE reads 'blocks.5.hook_resid_post', a hook point this model lacks"),
    (["--sae", "{narrow}"], "the SAE reads 32 dimensions"),
    (["--sae", "{sae}", "--features", "96"], "--features: feature 96 is outside"),
    (["--sae", "{sae}", "--k", "0"], "--k 0 must be in [1, 96]"),
    (["--sae", "{sae}", "--position", "40"], "--position 40 is outside the prompt's"),
])
def test_probe_sae_errors_are_one_line(tiny_dir, tmp_path, capsys, args, message):
    paths = dict(tmp=tmp_path, sae=random_sae().save_pretrained(tmp_path / "sae"),
                 lacking=random_sae(hook="blocks.5.hook_resid_post").save_pretrained(tmp_path / "lacking"),
                 narrow=random_sae(d_in=32).save_pretrained(tmp_path / "narrow"))
    args = [a.format(**paths) for a in args]
    code, _, err = run_cli(capsys, "sae", "--model", str(tiny_dir), "--prompt", "To be", "--out", str(tmp_path / "o"), *args)
    assert code == 2 and message.format(**paths) in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o" / "features.csv").exists()


def test_analyses_refuse_to_run_while_their_sae_is_spliced_in(tiny_model):
    """Inside the block the hook point holds the SAE's own output: features of a reconstruction."""
    from test_sae import random_sae

    from probe.analyses import feature_logits, sae_features, sae_loss_recovered
    from probe import spliced

    sae = random_sae()
    with spliced(tiny_model, sae):
        for call in (lambda: sae_features(tiny_model, sae, "To be, or not"),
                     lambda: sae_loss_recovered(tiny_model, sae, "To be, or not"),
                     lambda: feature_logits(tiny_model, sae, [1])):
            with pytest.raises(ValueError, match="spliced into the model at 'blocks.0.hook_resid_post' right now"):
                call()


# ---- top_triggers over SAE features --------------------------------------------------------------
SAE_CORPUS = [
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 2,  # several windows
    "To be, or not to be, that is the question.",
    "<script>alert('x')</script> & other <b>markup</b> should stay text.",
    "When in the course of human events it becomes necessary for one people to dissolve the bands.",
]
SCANNED = ("activations", "docs", "positions", "contexts", "next_tokens")


def brute_force_sae_triggers(model, sae, docs, features, k, window, context):
    """Each feature's top k over every token of every window, by (activation desc, document, position):
    each window run alone (BOS first, no padding) with run_with_cache at the SAE's hook, the features
    encoded by hand in float64 (`by_hand`)."""
    tokenizer, hook, per_window = model.tokenizer, sae.cfg.hook_name, window - 1
    found = {f: [] for f in features}
    for d, text in enumerate(docs):
        ids = tokenizer.encode(text, add_special_tokens=False)
        for start in range(0, len(ids), per_window):
            chunk = ids[start:start + per_window]
            with torch.no_grad():
                _, cache = model.run_with_cache(torch.tensor([[tokenizer.bos_id] + chunk]), names=hook)
            x = cache[hook][0, 1:].flatten(1)  # BOS dropped; hook_z's heads flattened, as the SAE reads them
            # each distinct activation encoded once: a matrix product may round a row by where it sits, and
            # equal activations (hook_embed: a token wherever it occurs) must tie exactly, broken by (doc, pos)
            distinct, which = x.unique(dim=0, return_inverse=True)
            columns = by_hand(sae, distinct)[0][which][:, features].T.tolist()  # [feature pos]
            for f, column in zip(features, columns):
                for p, value in enumerate(column):
                    pos = start + p
                    found[f].append((value, d, pos, ids[max(start, pos - context + 1):pos + 1],
                                     ids[pos + 1] if pos + 1 < len(ids) else -1))
    return {f: sorted(rows, key=lambda e: (-e[0], e[1], e[2]))[:k] for f, rows in found.items()}


def assert_same_scan(got, expected):
    for name in SCANNED:
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert (got.n_tokens, got.n_docs, got.source, got.layers) == \
        (expected.n_tokens, expected.n_docs, expected.source, expected.layers)


@pytest.mark.parametrize("architecture, hook, layer, features, window", [
    ("standard", HOOK, 0, None, None),  # every feature, one window per document
    ("jumprelu", "blocks.1.attn.hook_z", 1, [50, 3, 17, 88], 12),  # the heads flattened; windows cut documents
    ("topk", "blocks.1.hook_resid_pre", 1, [0, 5, 9, 40, 95], None),  # 12 of 96 active: ties at 0 broken by (doc, pos)
    ("standard", "hook_embed", -1, [1, 2, 60], 16),  # before the blocks: the forward stops at once
    ("standard", "ln_final.hook_normalized", -1, [7, 30], None),  # after the blocks: the whole forward
])
def test_sae_triggers_equal_brute_force(tiny_model, architecture, hook, layer, features, window):
    from probe.analyses import top_triggers

    sae = random_sae(architecture, hook=hook, seed=21)
    k, context = 7, 5
    result = top_triggers(tiny_model, SAE_CORPUS, neurons=features, k=k, batch_size=3, window=window,
                          context=context, progress=False, sae=sae)
    features = list(range(D_SAE)) if features is None else features
    expected = brute_force_sae_triggers(tiny_model, sae, SAE_CORPUS, features, k, window or tiny_model.cfg.n_ctx,
                                        context)
    assert result.source == hook and result.layers == [layer] and result.unit == "feature"
    assert result.neurons.tolist() == features and result.activations.shape == (1, len(features), k)
    for fi, feature in enumerate(features):
        rows = expected[feature]
        assert list(zip(result.docs[0, fi].tolist(), result.positions[0, fi].tolist())) == \
            [(e[1], e[2]) for e in rows], feature
        torch.testing.assert_close(result.activations[0, fi].double(), torch.tensor([e[0] for e in rows],
                                   dtype=torch.float64), atol=1e-5, rtol=0)
        assert result.next_tokens[0, fi].tolist() == [e[4] for e in rows]
        assert result.contexts[0, fi].tolist() == [[-1] * (context - len(e[3])) + e[3] for e in rows]
    n_tokens = sum(len(tiny_model.tokenizer.encode(t, add_special_tokens=False)) for t in SAE_CORPUS)
    assert result.complete and result.n_tokens == n_tokens and result.n_docs == len(SAE_CORPUS)
    if architecture == "topk":
        assert (result.activations == 0).sum() > 5  # there were ties to break


def test_sae_scan_stops_after_the_hook_block(tiny_model):
    """The forward ends with the SAE's block: later blocks never run."""
    from probe.analyses import top_triggers

    ran = []
    with tiny_model.hooks([("blocks.1.hook_resid_pre", lambda x, hook: ran.append(1))]):
        top_triggers(tiny_model, SAE_CORPUS[:2], neurons=[1], k=2, progress=False, sae=random_sae())
        assert not ran
        top_triggers(tiny_model, SAE_CORPUS[:2], neurons=[1], k=2, progress=False,
                     sae=random_sae(hook="blocks.1.hook_resid_post"))
        assert ran
    ran.clear()
    with tiny_model.hooks([("blocks.0.hook_resid_pre", lambda x, hook: ran.append(1))]):
        for hook in ("hook_embed", "hook_pos_embed"):  # outside the blocks: no block runs at all
            top_triggers(tiny_model, SAE_CORPUS[:2], neurons=[1], k=2, progress=False, sae=random_sae(hook=hook))
        assert not ran


@pytest.mark.parametrize("stop", ["doc 2", "forward 2"])
def test_sae_scan_interrupt_then_resume_equals_one_scan(tiny_model, tmp_path, stop):
    """Ctrl-C between documents, or inside a forward (at the SAE's own hook point): the partial result,
    saved and loaded, resumes to the one-scan result; an MLP scan is no resume= for an SAE scan."""
    from test_memories import interrupting

    from probe.analyses import top_triggers
    from probe.analyses.memories import TopTriggers

    sae = random_sae("jumprelu", hook="blocks.1.hook_resid_post", seed=4)
    args = dict(neurons=[2, 11, 64], k=4, batch_size=2, progress=False, sae=sae)
    full = top_triggers(tiny_model, SAE_CORPUS, **args)
    corpus, interrupt = interrupting(SAE_CORPUS, stop)

    path = tmp_path / "partial.safetensors"
    with tiny_model.hooks([(sae.cfg.hook_name, interrupt)]):
        partial = top_triggers(tiny_model, corpus(), save_path=path, **args)
    assert not partial.complete and 0 < partial.n_tokens < full.n_tokens
    loaded = TopTriggers.load(path)
    assert loaded.source == sae.cfg.hook_name and loaded.layers == [1]
    resumed = top_triggers(tiny_model, SAE_CORPUS, resume=loaded, **args)
    assert resumed.complete
    assert_same_scan(resumed, full)
    mlp = top_triggers(tiny_model, corpus(), layers=[1], neurons=[2, 11, 64], k=4, progress=False)
    with pytest.raises(ValueError, match="resume= is a scan of 'mlp', this one of 'blocks.1.hook_resid_post'"):
        top_triggers(tiny_model, SAE_CORPUS, resume=mlp, **args)
    with pytest.raises(ValueError, match="resume= is a scan of 'blocks.1.hook_resid_post', this one of 'mlp'"):
        top_triggers(tiny_model, SAE_CORPUS, layers=[1], neurons=[2, 11, 64], k=4, progress=False, resume=partial)


def test_sae_scan_shards_merge_to_one_scan_and_save_round_trips(tiny_model, tmp_path):
    from probe.analyses import merge, top_triggers
    from probe.analyses.memories import TopTriggers

    sae = random_sae("topk", hook="blocks.0.hook_mlp_out", seed=5)
    args = dict(neurons=[4, 8, 15, 16, 23, 42], k=6, batch_size=2, progress=False, sae=sae)
    whole = top_triggers(tiny_model, SAE_CORPUS, **args)
    shards = [top_triggers(tiny_model, SAE_CORPUS, shard=(r, 2), **args) for r in (1, 0)]
    merged = merge(shards)
    assert_same_scan(merged, whole)

    path = whole.save(tmp_path / "sae.safetensors")
    loaded = TopTriggers.load(path)
    assert_same_scan(loaded, whole)
    assert torch.equal(loaded.neurons, whole.neurons) and loaded.doc_names == whole.doc_names

    mlp = top_triggers(tiny_model, SAE_CORPUS, layers=[0], neurons=[4, 8, 15, 16, 23, 42], k=6, progress=False)
    with pytest.raises(ValueError, match="merge takes results of one source; got 'mlp' and 'blocks.0.hook_mlp_out'"):
        merge([mlp, whole])
    other = top_triggers(tiny_model, SAE_CORPUS, **{**args, "sae": random_sae("topk", hook="blocks.1.hook_mlp_out")})
    with pytest.raises(ValueError, match="one source"):
        merge([whole, other])


def test_a_file_saved_without_a_source_loads_as_an_mlp_scan(tiny_model, tmp_path):
    """Files written before SAE scans existed have no `source` in their metadata."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from probe.analyses import top_triggers
    from probe.analyses.memories import TopTriggers

    scan = top_triggers(tiny_model, SAE_CORPUS[:2], layers=[1], neurons=[3, 9], k=3, progress=False)
    path = scan.save(tmp_path / "new.safetensors")
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["top_triggers"])
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    assert meta.pop("source") == "mlp"
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata={"top_triggers": json.dumps(meta)})
    old = TopTriggers.load(tmp_path / "old.safetensors")
    assert old.source == "mlp" and old.unit == "neuron"
    assert_same_scan(old, scan)
    assert list(old.to_frame().columns[:3]) == ["layer", "neuron", "rank"]


def test_sae_scan_frame_and_figure_say_feature(tiny_model):
    from probe.analyses import top_triggers

    sae = random_sae(seed=9)
    result = top_triggers(tiny_model, SAE_CORPUS, neurons=[6, 70], k=40, context=12, progress=False, sae=sae)
    frame = result.to_frame(tiny_model)
    assert list(frame.columns[:3]) == ["layer", "feature", "rank"] and "neuron" not in frame.columns
    assert len(frame) == 2 * 40 and set(frame.feature) == {6, 70} and set(frame.layer) == {0}
    assert {"prefix", "trigger_token", "next_token"} <= set(frame.columns)
    fig = result.figure(tiny_model, 0, 70)
    assert fig.layout.title.text == f"Top triggers of feature 70 of the SAE at {HOOK}"
    assert "neuron" not in fig.layout.title.text and "mlp" not in fig.layout.yaxis.title.text
    hover = " ".join(fig.data[0].hovertext) + " ".join(fig.data[0].x)
    assert "&lt;" in hover and "<script" not in hover and "<b>" not in hover  # corpus markup arrives as text
    with pytest.raises(ValueError, match="feature 5 was not scanned"):
        result.index(0, 5)


def test_sae_scan_errors(tiny_model):
    from probe.analyses import agreement, top_triggers
    from probe import spliced

    sae = random_sae()
    run = lambda **kw: top_triggers(tiny_model, SAE_CORPUS[:1], progress=False, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"layers=\[0\]: an SAE scan reads the features at the SAE's hook point "
                                         r"'blocks.0.hook_resid_post'; leave layers=None"):
        run(layers=[0], sae=sae)
    with pytest.raises(ValueError, match=r"feature 96 is outside the SAE's features \[0, d_sae=96\)"):
        run(neurons=[1, 96], sae=sae)
    with pytest.raises(ValueError, match="features lists a feature twice"):
        run(neurons=[1, 1], sae=sae)
    with pytest.raises(TypeError, match="sae must be a probe.SparseAutoencoder"):
        run(sae="path/to/sae")
    with pytest.raises(KeyError, match="a hook point this model lacks"):  # hooks.UnknownNameError
        run(sae=random_sae(hook="blocks.5.hook_resid_post"))
    with pytest.raises(ValueError, match="the SAE reads 32 dimensions"):
        run(sae=random_sae(d_in=32))
    with spliced(tiny_model, sae):
        with pytest.raises(ValueError, match="spliced into the model at 'blocks.0.hook_resid_post' right now"):
            run(sae=sae)
    scan = run(neurons=[1, 2], k=2, sae=sae)
    with pytest.raises(ValueError, match="agreement reads FFN value vectors .* the SAE at 'blocks.0.hook_resid_post'"):
        agreement(tiny_model, scan)


def test_probe_sae_triggers_writes_what_top_triggers_finds(tiny_dir, tiny_model, tmp_path, capsys, monkeypatch):
    from probe.analyses import corpus, top_triggers

    sae = random_sae(seed=14)
    directory = sae.save_pretrained(tmp_path / "sae")
    text = tmp_path / "plays.txt"
    text.write_text(" ".join(SAE_CORPUS), encoding="utf-8")
    base = ["sae", "--model", str(tiny_dir), "--sae", str(directory), "--prompt", "To be, or not", "--k", "4", "--quiet"]
    code, shown, err = run_cli(capsys, *base, "--features", "3", "17", "--triggers", "--corpus", str(text),
                               "--out", str(tmp_path / "out"))
    assert code == 0, err
    expected = top_triggers(tiny_model, text, neurons=[3, 17], k=4, progress=False, sae=sae).to_frame(tiny_model)
    written = pd.read_csv(tmp_path / "out" / "triggers.csv", keep_default_na=False)
    assert list(written.columns) == list(expected.columns) and written.columns[1] == "feature"
    for column in ("layer", "feature", "rank", "doc", "position", "next_token_id", "doc_name", "prefix",
                   "trigger_token", "next_token"):
        assert written[column].tolist() == expected[column].tolist(), column
    assert written.activation.to_numpy() == pytest.approx(expected.activation.to_numpy())
    page = (tmp_path / "out" / "triggers.html").read_text()
    for feature in (3, 17):  # one page, a panel per feature
        assert f"Top triggers of feature {feature} of the SAE at {HOOK}" in page
    assert "top triggers over" in shown and "F17" in shown
    assert (tmp_path / "out" / "features.csv").is_file()  # the command's other outputs as before

    # no --features: the top --k features at --position; no --corpus: the bundled held-out text
    monkeypatch.setattr(corpus, "HELDOUT_TEXT", text)
    code, _, err = run_cli(capsys, *base, "--triggers", "--out", str(tmp_path / "default"))
    assert code == 0, err
    top = sae_features(tiny_model, sae, "To be, or not", k=4).top_ids[0, -1].tolist()
    written = pd.read_csv(tmp_path / "default" / "triggers.csv", keep_default_na=False)
    assert written.feature.unique().tolist() == top and set(written.doc_name) == {"plays.txt"}
    page = (tmp_path / "default" / "triggers.html").read_text()
    assert all(f"Top triggers of feature {f} of" in page for f in top)

    code, _, err = run_cli(capsys, *base, "--corpus", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o"))
    assert code == 2 and f"--corpus {tmp_path / 'nowhere'} does not exist" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o" / "features.csv").exists()  # refused before any work


@pytest.mark.slow
def test_torchrun_sae_scan_equals_one_process(tiny_model, tiny_dir, tmp_path):
    """Two gloo ranks of `python -m probe.analyses.memories --sae` merge to the single-process scan, source kept."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from probe.analyses import top_triggers
    from probe.analyses.memories import TopTriggers

    repo = Path(__file__).resolve().parents[1]
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, text in enumerate(SAE_CORPUS):
        (folder / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    sae = random_sae("jumprelu", hook="blocks.1.attn.hook_z", seed=3)
    directory = sae.save_pretrained(tmp_path / "sae")
    out = tmp_path / "merged.safetensors"
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "probe.analyses.memories", "--model", str(tiny_dir), "--corpus", str(folder), "--sae", str(directory),
           "--neurons", "0", "3", "40", "90", "-k", "6", "--batch-size", "2", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = TopTriggers.load(out)
    single = top_triggers(tiny_model, folder, neurons=[0, 3, 40, 90], k=6, batch_size=2, progress=False, sae=sae)
    assert_same_scan(merged, single)
    assert merged.doc_names == single.doc_names and merged.source == "blocks.1.attn.hook_z"


def test_probe_sae_triggers_interrupted_keeps_a_partial_file(tiny_dir, tmp_path, capsys, monkeypatch):
    """Ctrl-C during the scan: what was folded goes to triggers.partial.csv, exit 130, no triggers.csv."""
    from probe import analyses
    from probe.analyses.memories import top_triggers

    def interrupted(model, texts, **kwargs):
        def corpus():  # the first two documents, then Ctrl-C
            yield from SAE_CORPUS[:2]
            raise KeyboardInterrupt
        return top_triggers(model, corpus(), **{**kwargs, "batch_size": 1})  # each window folded as it comes

    monkeypatch.setattr(analyses, "top_triggers", interrupted)
    directory = random_sae(seed=14).save_pretrained(tmp_path / "sae")
    code, _, err = run_cli(capsys, "sae", "--model", str(tiny_dir), "--sae", str(directory), "--prompt", "To be",
                           "--features", "3", "--triggers", "--quiet", "--out", str(tmp_path / "out"))
    assert code == 130 and "interrupted: the scan covered" in err and "2 documents complete" in err
    partial = pd.read_csv(tmp_path / "out" / "triggers.partial.csv")
    assert set(partial.doc) <= {0, 1} and len(partial) == 10 and partial.feature.unique().tolist() == [3]
    assert not (tmp_path / "out" / "triggers.csv").exists()


def test_memory_report_refuses_an_sae_scan(tiny_model, tmp_path):
    """Its cards read FFN value vectors, which an SAE scan's features do not have."""
    from test_sae import random_sae

    from probe.analyses import memory_report, top_triggers

    triggers = top_triggers(tiny_model, ["To be, or not to be, that is the question."], neurons=[1, 2], k=2,
                            progress=False, sae=random_sae())
    with pytest.raises(ValueError, match="memory_report"):
        memory_report(tiny_model, triggers, tmp_path / "cards.html")
    assert not (tmp_path / "cards.html").exists()


def test_sae_scans_of_two_saes_at_one_hook_never_mix(tiny_model, tmp_path):
    """Gemma Scope ships several SAEs per hook point: resume= and merge refuse a scan of another SAE there."""
    from test_sae import random_sae

    from probe.analyses import merge, top_triggers

    first, second = random_sae(seed=11), random_sae(seed=12)
    assert first.digest() != second.digest() and first.digest() == random_sae(seed=11).digest()
    args = dict(neurons=[1, 2], k=2, progress=False)
    half = top_triggers(tiny_model, SAE_CORPUS, sae=first, shard=(0, 2), **args)
    other = top_triggers(tiny_model, SAE_CORPUS, sae=second, shard=(1, 2), **args)
    with pytest.raises(ValueError, match="two different SAEs at one hook point"):
        merge([half, other])
    import dataclasses

    with pytest.raises(ValueError, match="another SAE at the same hook point"):
        top_triggers(tiny_model, SAE_CORPUS, sae=second, resume=dataclasses.replace(half, complete=False), **args)
    half.save(tmp_path / "half.safetensors")
    from probe.analyses.memories import TopTriggers

    assert TopTriggers.load(tmp_path / "half.safetensors").sae_digest == first.digest()


def test_a_scan_computes_only_the_features_it_keeps(tiny_model):
    """A standard or JumpReLU feature needs its own encoder column only: the scan's activations equal the whole
    encode's columns, for a subset, in the order asked."""
    from test_sae import random_sae

    for architecture in ("standard", "jumprelu", "topk"):
        sae = random_sae(architecture, seed=13)
        x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
        ids = torch.tensor([40, 3, 17])
        with torch.no_grad():
            torch.testing.assert_close(sae.feature_activations(x, ids), sae.encode(x)[..., ids], atol=1e-6, rtol=0)


def test_probe_sae_triggers_checks_its_corpus_and_settings_before_writing_anything(tiny_dir, tmp_path, capsys):
    sae = random_sae(seed=15)
    directory = sae.save_pretrained(tmp_path / "sae")
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    (tmp_path / "nodocs").mkdir()
    base = ["sae", "--model", str(tiny_dir), "--sae", str(directory), "--prompt", "To be, or not", "--quiet"]
    for extra, message in ((["--corpus", str(tmp_path / "empty.txt")], "is empty"),
                           (["--corpus", str(tmp_path / "nodocs")], "holds no .txt files"),
                           (["--triggers", "--window", "1"], "--window 1 must be in [2, n_ctx=48]"),
                           (["--triggers", "--batch-size", "0"], "--batch-size 0 must be at least 1")):
        out = tmp_path / f"out{len(message)}"
        code, _, err = run_cli(capsys, *base, *extra, "--out", str(out))
        assert code == 2 and message in err, err
        assert not out.exists() or not any(out.iterdir())  # nothing written before the refusal


def test_an_sae_of_the_wrong_width_and_a_bad_batch_size_are_refused_before_any_work(tiny_model, tmp_path, capsys):
    from test_cli import run_cli

    from probe.analyses import top_triggers

    narrow = random_sae(d_in=32)
    with pytest.raises(ValueError, match="reads 32 dimensions, but the activation at 'blocks.0.hook_resid_post' has 64"):
        sae_features(tiny_model, narrow, "To be")
    with pytest.raises(ValueError, match="one activation vector per position, but 'blocks.0.attn.hook_pattern' is not"):
        sae_features(tiny_model, random_sae(hook="blocks.0.attn.hook_pattern", d_in=4), "To be")
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=f"batch_size={bad!r} must be a positive integer"):
            top_triggers(tiny_model, ["To be, or not"], neurons=[1], k=2, batch_size=bad, progress=False, sae=random_sae())


def test_probe_sae_bundled_is_the_shipped_residual_sae_of_the_bundled_model(tmp_path, capsys):
    from probe import DEFAULT_MODEL, HookedDecoder, SparseAutoencoder
    from probe.sae import BUNDLED_SAES

    model = HookedDecoder.from_pretrained(DEFAULT_MODEL)
    sae = SparseAutoencoder.from_pretrained(BUNDLED_SAES / "resid-post-1")
    prompt, out = "ROMEO. But soft, what light", tmp_path / "out"
    code, _, err = run_cli(capsys, "sae", "--sae", "bundled", "--prompt", prompt, "--k", "3", "--out", str(out))
    assert code == 0, err
    written = pd.read_csv(out / "features.csv", keep_default_na=False)
    expected = sae_features(model, sae, prompt, k=3).to_frame()
    assert written.feature.tolist() == expected.feature.tolist()
    code, _, err = run_cli(capsys, "sae", "--sae", "no-such-dictionary", "--prompt", prompt, "--out", str(tmp_path / "o"))
    assert code == 2 and "cannot load --sae no-such-dictionary" in err
