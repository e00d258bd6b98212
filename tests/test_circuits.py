"""probe.analyses.circuits: OV/QK matrices sliced by hand from transformers' parameters, copying scores
against the eigenvalues of the full vocabulary-by-vocabulary OV circuit, and heads built to copy."""
from __future__ import annotations

import pytest
import torch

from probe.analyses.circuits import copying_scores, ov_circuit, qk_circuit
from probe import DecoderConfig, HookedDecoder


def test_ov_and_qk_are_transformers_weights_multiplied_by_hand(tiny_model, tiny_hf):
    dm, dh = tiny_model.cfg.d_model, tiny_model.cfg.d_head
    for layer, block in enumerate(tiny_hf.transformer.h):
        c_attn, c_proj = block.attn.c_attn.weight.double(), block.attn.c_proj.weight.double()  # Conv1D: [in, out]
        for head in range(tiny_model.cfg.n_heads):
            cols = slice(head * dh, (head + 1) * dh)
            w_q, w_k, w_v = c_attn[:, cols], c_attn[:, dm:][:, cols], c_attn[:, 2 * dm:][:, cols]
            torch.testing.assert_close(ov_circuit(tiny_model, layer, head).double(), w_v @ c_proj[cols], atol=1e-5, rtol=0)
            torch.testing.assert_close(qk_circuit(tiny_model, layer, head).double(), w_q @ w_k.T, atol=1e-5, rtol=0)


def test_copying_scores_are_those_of_the_full_vocabulary_circuit(tiny_model):
    """The oracle builds W_E W_V W_O W_U [vocab vocab] whole and takes all its eigenvalues."""
    scores = copying_scores(tiny_model, process=False)
    w_e, w_u = tiny_model.W_E.detach().double(), tiny_model.W_U.detach().double()
    for layer in range(tiny_model.cfg.n_layers):
        for head in range(tiny_model.cfg.n_heads):
            full = w_e @ ov_circuit(tiny_model, layer, head).double() @ w_u
            eig = torch.linalg.eigvals(full)
            expected = float(eig.sum().real) / float(eig.abs().sum())
            assert scores.scores[layer, head] == pytest.approx(expected, abs=1e-4)
            assert float(scores.eigenvalues[layer][head].sum().real) == pytest.approx(float(full.trace()), rel=1e-4, abs=1e-6)
    frame = scores.to_frame()
    assert list(frame.columns) == ["layer", "head", "copying_score", "positive_share"]
    assert len(frame) == tiny_model.cfg.n_layers * tiny_model.cfg.n_heads
    assert scores.figure().data[0].z.shape == (tiny_model.cfg.n_layers, tiny_model.cfg.n_heads)
    one = copying_scores(tiny_model, layers=[1], process=False)  # a subset keeps its own layer numbers
    assert torch.equal(one.scores[0], scores.scores[1]) and set(one.to_frame().layer) == {1}
    assert list(one.figure().data[0].y) == ["L1"]


def test_a_head_built_to_copy_scores_one_and_its_negation_minus_one():
    """OV = identity and a tied unembedding: the full circuit is W_E W_E^T, positive semi-definite."""
    cfg = DecoderConfig(n_layers=1, d_model=8, n_heads=1, d_vocab=30, n_ctx=8)
    model = HookedDecoder(cfg)
    with torch.no_grad():
        qkv = model.blocks[0].attn.qkv.weight
        qkv[16:24] = torch.eye(8)  # W_V = I
        for sign, expected in ((1.0, 1.0), (-1.0, -1.0)):
            model.blocks[0].attn.out.weight.copy_(sign * torch.eye(8))
            assert float(copying_scores(model, process=False).scores[0, 0]) == pytest.approx(expected, abs=1e-5)


def test_by_default_the_norms_are_folded_in_first(tiny_model, tmp_path):
    from probe import process_weights
    from test_variants import build

    processed = copying_scores(process_weights(tiny_model), process=False)
    assert torch.equal(copying_scores(tiny_model).scores, processed.scores)
    assert not torch.allclose(copying_scores(tiny_model, process=False).scores, processed.scores)
    build("gpt1", tmp_path)  # post-norm: nothing to fold, the weights as they are
    gpt1 = HookedDecoder.from_pretrained(tmp_path)
    assert torch.equal(copying_scores(gpt1).scores, copying_scores(gpt1, process=False).scores)


def test_grouped_query_heads_use_their_key_value_head(tmp_path):
    from test_variants import build

    hf = build("llama", tmp_path)  # 8 query heads, 2 key/value heads
    model = HookedDecoder.from_pretrained(tmp_path)
    attn, dh = hf.model.layers[1].self_attn, model.cfg.d_head
    for head in (0, 3, 4, 7):
        kv = head // 4
        w_v = attn.v_proj.weight[kv * dh:(kv + 1) * dh].T.double()  # nn.Linear: [out, in]
        w_o = attn.o_proj.weight[:, head * dh:(head + 1) * dh].T.double()
        torch.testing.assert_close(ov_circuit(model, 1, head).double(), w_v @ w_o, atol=1e-5, rtol=0)


def test_bad_heads_and_layers_are_named(tiny_model, monkeypatch):
    from probe.analyses import circuits

    def no_copy(*args, **kwargs):
        raise AssertionError("copied the model before checking the layers")

    monkeypatch.setattr(circuits, "process_weights", no_copy)  # bad layers fail fast, before a model-sized copy
    with pytest.raises(ValueError, match="head=9"):
        ov_circuit(tiny_model, 0, 9)
    with pytest.raises(ValueError, match="layer=5"):
        qk_circuit(tiny_model, 5, 0)
    with pytest.raises(ValueError, match="layers must be"):
        copying_scores(tiny_model, layers=[0, 7])


def dense_composition(writer_ov, reader, kind):
    product = writer_ov @ (reader.T if kind == "k" else reader)
    return float(product.norm() / (writer_ov.norm() * reader.norm()))


def test_composition_scores_equal_the_dense_products(tiny_model, tiny_hf):
    """Oracle: d_model x d_model circuits multiplied out from transformers' own c_attn/c_proj weights (float64)."""
    from probe.analyses import composition_scores

    d, n_heads = tiny_model.cfg.d_model, tiny_model.cfg.n_heads
    dh = d // n_heads
    circuits = {}
    for layer, block in enumerate(tiny_hf.transformer.h):
        # Conv1D: [in out]; detached: the oracle's arithmetic needs no graph (and float() of a graph tensor warns)
        w, w_out = block.attn.c_attn.weight.detach().double(), block.attn.c_proj.weight.detach().double()
        for h in range(n_heads):
            q, k, v = (w[:, part * d + h * dh: part * d + (h + 1) * dh] for part in range(3))
            circuits[layer, h] = dict(ov=v @ w_out[h * dh:(h + 1) * dh], qk=q @ k.T)
    scores = composition_scores(tiny_model, process=False)
    assert scores.q.shape == (2, n_heads, 2, n_heads)
    for (l1, h1), writer in circuits.items():
        for (l2, h2), reader in circuits.items():
            for kind in "qkv":
                got = float(getattr(scores, kind)[l1, h1, l2, h2])
                if l2 <= l1:
                    assert got != got  # NaN: a head cannot read a head of its own or a later layer
                else:
                    expected = dense_composition(writer["ov"], reader["ov" if kind == "v" else "qk"], kind)
                    assert got == pytest.approx(expected, rel=1e-4), (kind, l1, h1, l2, h2)
    frame = scores.to_frame()
    assert len(frame) == n_heads * n_heads and set(frame.columns) >= {"layer", "head", "later_layer", "later_head", "q", "k", "v"}
    assert scores.figure("v").data[0].z.shape == (2 * n_heads, 2 * n_heads)
    with pytest.raises(ValueError, match="kind='o' is not one of: q, k, v"):
        scores.figure("o")


def test_composition_of_a_head_built_to_feed_another(tiny_model):
    """A reader whose keys read exactly the subspace the writer writes K-composes fully (score 1 when both are
    rank one and aligned); turning the reader's keys orthogonal to it drops the score to 0."""
    import copy

    from probe.analyses import composition_scores

    model = copy.deepcopy(tiny_model)
    d = model.cfg.d_model
    dh = d // model.cfg.n_heads
    u, w = torch.zeros(d), torch.zeros(d)
    u[3], w[5] = 1.0, 1.0
    with torch.no_grad():
        qkv, out = model.blocks[0].attn.qkv.weight, model.blocks[0].attn.out.weight  # [(qkv head d_head) d_model]
        value_rows = slice(2 * d, 2 * d + dh)  # head 0's values
        qkv[value_rows] = 0
        qkv[2 * d] = u  # head 0 reads direction u into its first value dimension ...
        out[:, :dh] = 0
        out[:, 0] = w  # ... and writes it along w: OV = u w^T
        qkv1 = model.blocks[1].attn.qkv.weight
        qkv1[:dh] = 0
        qkv1[0] = u  # head 1.0's queries read u
        qkv1[d:d + dh] = 0
        qkv1[d] = w  # and its keys read w, exactly what head 0.0 writes
    scores = composition_scores(model, process=False)
    assert float(scores.k[0, 0, 1, 0]) == pytest.approx(1.0, abs=1e-6)
    assert float(scores.q[0, 0, 1, 0]) == pytest.approx(0.0, abs=1e-6)  # its queries read u, which 0.0 never writes
    with torch.no_grad():
        model.blocks[1].attn.qkv.weight[d] = u  # keys now read u too
    assert float(composition_scores(model, process=False).k[0, 0, 1, 0]) == pytest.approx(0.0, abs=1e-6)


def test_gemma2_heads_write_through_their_write_norm_and_process_without_centring_the_capped_logits(tmp_path):
    """A sandwich block's head writes W_O times ln1_post.w (per dimension) before the residual: the copying score's
    full circuit includes it. Processing folds the norms but leaves the capped logits uncentred."""
    from test_variants import build

    build("gemma2", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    scores = copying_scores(model, process=False)
    w_e, w_u = model.W_E.detach().double(), model.W_U.detach().double()
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        for head in range(attn.n_heads):
            kv = head // (attn.n_heads // attn.n_kv_heads)
            w_v, w_o, w_post = (t.detach().double() for t in (attn.W_V[kv], attn.W_O[head], block.ln1_post.w))
            full = w_e @ w_v @ (w_o * w_post) @ w_u
            eig = torch.linalg.eigvals(full)
            assert scores.scores[layer, head] == pytest.approx(float(eig.sum().real) / float(eig.abs().sum()), abs=1e-4)
    processed = copying_scores(model)  # runs: folding is allowed, centring the capped logits is not attempted
    assert processed.scores.isfinite().all()


def test_qwen3_query_and_key_norm_weights_enter_the_qk_circuit(tmp_path):
    """q_norm(q) = q / scale * w_q per d_head dimension: the bilinear form, up to the two scales, is
    (W_Q diag(w_q)) (W_K diag(w_k))^T. Oracle: transformers' q_proj / k_proj / norm weights multiplied out."""
    from test_variants import build

    hf = build("qwen3", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    attn = hf.model.layers[1].self_attn
    dh = 16
    for head in (0, 5):
        kv = head // 4
        w_q = attn.q_proj.weight[head * dh:(head + 1) * dh].T.double() * attn.q_norm.weight.double()
        w_k = attn.k_proj.weight[kv * dh:(kv + 1) * dh].T.double() * attn.k_norm.weight.double()
        torch.testing.assert_close(qk_circuit(model, 1, head).double(), w_q @ w_k.T, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", ["eap", "eap-ig-inputs", "exact"])
def test_edge_attribution_refuses_a_max_rows_that_is_not_a_positive_int(tiny_model, tiny_hf, method):
    """max_rows=0 or -3 silently ran one batch per forward, and 4.0 failed in a slice ('slice indices must be
    integers'); ablation's max_rows refuses them the same way. A cap below the batch still scores as transformers'
    autograd does."""
    from probe.analyses import logit_diff_metric
    from probe.analyses.edge_attribution import edge_attribution
    from test_edge_attribution import ANSWERS, COUNTERFACTUALS, HFEdges, oracle_scores, prompts

    clean, corrupted = prompts(tiny_model.cfg.d_vocab)
    metric = logit_diff_metric(tiny_model, ANSWERS, COUNTERFACTUALS)
    for bad in (0, -3, 4.0, True, "4"):
        with pytest.raises(ValueError, match=f"max_rows={bad!r} must be a positive int"):
            edge_attribution(tiny_model, clean, corrupted, metric, method=method, ig_steps=2, max_rows=bad)
    if method == "eap":
        ours = edge_attribution(tiny_model, clean, corrupted, metric, max_rows=1)
        oracle = HFEdges(tiny_hf, "gpt2")
        clean_writers, _ = oracle.run(clean, ANSWERS, COUNTERFACTUALS)
        corr_writers, corr_grads = oracle.run(corrupted, ANSWERS, COUNTERFACTUALS)
        expected = oracle_scores(ours.graph, clean_writers - corr_writers, corr_grads)
        torch.testing.assert_close(ours.per_example, expected, atol=1e-4 * float(expected.abs().max()), rtol=0)
