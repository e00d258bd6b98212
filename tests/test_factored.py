"""probe.FactoredMatrix, model.OV / model.QK, composition scores and unembedding directions, against transformer-lens.

Three oracles: (1) usage cases written in transformer-lens's idiom (how its demos and ARENA 1.2 use model.OV,
model.QK and FactoredMatrix), each a function of `model` alone, run on the bundled model and on TL's
TransformerBridge over the same directory (tl_oracle.bridge: compatibility mode, the checkpoint's own weights);
(2) our FactoredMatrix against TL's on random tensors, method by method; (3) OV/QK and composition scores on
grouped-query checkpoints against the bridge.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import probe
from probe import FactoredMatrix, HookedDecoder

from tl_oracle import assert_same, bridge


@pytest.fixture(scope="module")
def tl_factored():
    return pytest.importorskip("transformer_lens").FactoredMatrix


@pytest.fixture(scope="module")
def their_model():
    pytest.importorskip("transformer_lens")
    return bridge(probe.DEFAULT_MODEL)


# ---- (1) transformer-lens's idiom, on probe and on TL ---------------------------------------------------------------
def full_ov_eigenvalues(model):
    eigenvalues = (model.W_E @ model.OV @ model.W_U).eigenvalues  # [layer head d_head] complex
    return eigenvalues.real, eigenvalues.imag


def copying_scores(model):  # ARENA 1.2's positive-eigenvalue score of each head's full OV circuit
    eigenvalues = (model.W_E @ model.OV @ model.W_U).eigenvalues
    return (eigenvalues.sum(dim=-1) / eigenvalues.abs().sum(dim=-1)).real


def full_ov_of_one_head(model):
    full = model.W_E @ model.OV[1, 4] @ model.W_U  # [vocab vocab], kept factored
    return full.shape, full.mdim, full.get_corner(5), full.norm()


def svd_of_a_head(model):
    U, S, V = model.OV[1, 4].svd()
    return U, S, V


def top_singular_directions(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TL's Vh, kept for old code, warns that it is V
        return model.OV[2, 0].U[:, 0], model.OV[2, 0].S[:3], model.OV[2, 0].Vh[:, 0]


def make_even(model):
    even = model.QK[3, 1].make_even()
    return even.A, even.B, even.AB


def tl_factored_on_weights(model):  # transformer-lens's own class, given the model's weight tensors
    from transformer_lens import FactoredMatrix as TLFactoredMatrix

    ov = TLFactoredMatrix(model.W_E @ model.W_V[0, 3], model.W_O[0, 3] @ model.W_U)
    qk = TLFactoredMatrix(model.W_Q[2, 1], model.W_K[2, 1].T)
    return ov.eigenvalues.real, ov.S, qk.AB, (qk @ model.W_E[:7].T).AB


def tl_composition_utility(model):  # TL's utils.composition_scores, given the model's factored matrices
    from transformer_lens.utilities import composition_scores

    return composition_scores(model.OV[0], model.QK[1], broadcast_dims=True)


def tl_matrix_corner(model):
    from transformer_lens.utilities.matrix import get_matrix_corner

    return get_matrix_corner(model.OV[1, 2], 4)


def logit_difference_directions(model):
    answers = torch.tensor([[5, 9], [13, 2], [40, 41]])  # [batch (correct, wrong)]
    directions = model.tokens_to_residual_directions(answers)  # [batch 2 d_model]
    return directions[:, 0] - directions[:, 1]


CASES = {
    "OV shape": lambda model: (tuple(model.OV.shape), model.OV.ldim, model.OV.mdim, model.OV.rdim, model.OV.ndim),
    "QK shape": lambda model: (tuple(model.QK.shape), model.QK.mdim),
    "OV[1, 4].AB": lambda model: model.OV[1, 4].AB,
    "QK[2, 3].AB": lambda model: model.QK[2, 3].AB,
    "OV[3] (a layer)": lambda model: model.OV[3].AB,
    "OV[:, 2] (a head in every layer)": lambda model: model.OV[:, 2].AB,
    "OV[-1, -1]": lambda model: model.OV[-1, -1].AB,
    "OV rows and columns": lambda model: model.OV[0, 1, :5, 10:20].AB,
    "OV integer row keeps its dim": lambda model: model.OV[0, 1, 3].AB,
    "QK integer row and column": lambda model: model.QK[1, 0, -1, 7].AB,
    "OV[..., :4, :4]": lambda model: model.OV[..., :4, :4].AB,
    "OV[0, 0, None]": lambda model: model.OV[0, 0, None].shape,
    "W_E @ OV[0, 5]": lambda model: (model.W_E @ model.OV[0, 5]).AB,
    "full OV of one head": full_ov_of_one_head,
    "full OV eigenvalues": full_ov_eigenvalues,
    "copying scores": copying_scores,
    "QK eigenvalues": lambda model: (lambda ev: (ev.real, ev.imag))(model.QK[1, 2].eigenvalues),
    "OV svd": svd_of_a_head,
    "top singular directions": top_singular_directions,
    "OV.S of every head": lambda model: model.OV.S,
    "OV norm": lambda model: model.OV.norm(),
    "QK norm": lambda model: model.QK.norm(),
    "OV[1, 1].T": lambda model: model.OV[1, 1].T.AB,
    "OV[1, 1].BA": lambda model: model.OV[1, 1].BA,
    "make_even": make_even,
    "collapse_l and collapse_r": lambda model: (model.OV[2, 5].collapse_l(), model.QK[2, 5].collapse_r()),
    "OV @ QK": lambda model: (model.OV[0, 2] @ model.QK[1, 4]).norm(),
    "OV * scalar": lambda model: ((model.OV[0, 0] * 2.5).AB, (3 * model.QK[1, 1]).AB),
    "OV @ a vector": lambda model: model.OV[1, 2] @ model.W_U[:, 7],
    "a vector @ QK": lambda model: model.W_E[11] @ model.QK[1, 3],
    "OV.unsqueeze": lambda model: model.OV[0].unsqueeze(0).shape,
    "Q-composition, layer 0 into later layers": lambda model: model.all_composition_scores("Q")[0, :, 1:],
    "K-composition, all": lambda model: model.all_composition_scores("K")[:],
    "V-composition, all": lambda model: model.all_composition_scores("V")[:],
    "head labels": lambda model: list(model.all_head_labels),
    "residual direction of a string": lambda model: model.tokens_to_residual_directions(" the"),
    "residual direction of an id": lambda model: model.tokens_to_residual_directions(42),
    "residual directions of a 1-D tensor": lambda model: model.tokens_to_residual_directions(torch.tensor([5, 9, 13])),
    "residual direction of a one-element tensor": lambda model: model.tokens_to_residual_directions(torch.tensor([7])),
    "logit difference directions": logit_difference_directions,
    "TL FactoredMatrix on the weights": tl_factored_on_weights,
    "TL composition_scores on model.OV": tl_composition_utility,
    "TL get_matrix_corner on model.OV": tl_matrix_corner,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformer_lens_idiom_gives_transformer_lens_numbers(case, bundled_model, their_model):
    ours, theirs = CASES[case](bundled_model), CASES[case](their_model)
    assert_same(ours, theirs, atol=1e-4, what=case)


def test_head_labels_are_a_property_and_a_method(bundled_model):
    """The bridge has a property, HookedTransformer a method: both spellings run."""
    labels = bundled_model.all_head_labels
    assert labels == bundled_model.all_head_labels() and labels[:2] == ["L0H0", "L0H1"]
    assert len(labels) == bundled_model.cfg.n_layers * bundled_model.cfg.n_heads


def test_circuits_are_factored_and_carry_gradients(bundled_model):
    ov = bundled_model.OV
    assert isinstance(ov, FactoredMatrix) and ov.mdim == bundled_model.cfg.d_head
    ov[0, 0].norm().backward()
    assert bundled_model.blocks[0].attn.qkv.weight.grad is not None
    bundled_model.zero_grad(set_to_none=True)


def test_composition_scores_match_analyses_where_the_definitions_agree(bundled_model):
    """GPT-2 has no norm weights inside a head, so analyses.composition_scores (Gram matrices, NaN below the
    diagonal) and the model's (TL's SVD route, 0 there) measure the same thing."""
    from probe.analyses import composition_scores

    theirs = composition_scores(bundled_model, process=False)
    for mode in "QKV":
        ours = bundled_model.all_composition_scores(mode)
        reference = getattr(theirs, mode.lower())
        later = ~reference.isnan()
        torch.testing.assert_close(ours[later], reference[later], atol=1e-4, rtol=0)
        assert (ours[~later] == 0).all()


# ---- (2) our FactoredMatrix against transformer-lens's, on random tensors ------------------------------------------
def random_pair(a_shape, b_shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(a_shape, generator=gen), torch.randn(b_shape, generator=gen)


SHAPES = {
    "broadcast leading dims": ((2, 1, 5, 3), (4, 3, 6)),
    "square, low rank": ((3, 6, 2), (3, 2, 6)),
    "wide middle": ((5, 7), (7, 4)),
    "square, full rank": ((2, 4, 4), (2, 4, 4)),
}


def same_factored(ours, theirs, what=""):
    assert isinstance(ours, FactoredMatrix), f"{what}: got {type(ours).__name__}"
    assert tuple(ours.shape) == tuple(theirs.shape), what
    assert_same(ours.A, theirs.A, 1e-5, f"{what}.A")  # the same factors: the same grouping of the product was chosen
    assert_same(ours.B, theirs.B, 1e-5, f"{what}.B")


@pytest.mark.parametrize("shapes", sorted(SHAPES))
def test_every_method_matches_transformer_lens(shapes, tl_factored):
    A, B = random_pair(*SHAPES[shapes])
    ours, theirs = FactoredMatrix(A, B), tl_factored(A, B)
    same_factored(ours, theirs, "construction")
    assert (ours.ldim, ours.mdim, ours.rdim, ours.ndim) == (theirs.ldim, theirs.mdim, theirs.rdim, theirs.ndim)
    assert_same(ours.AB, theirs.AB, 1e-5, "AB")
    same_factored(ours.T, theirs.T, "T")
    assert_same(ours.pair, theirs.pair, 1e-5, "pair")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        their_vh = theirs.Vh
    assert_same(ours.svd(), theirs.svd(), 1e-4, "svd")
    assert_same((ours.U, ours.S, ours.V, ours.Vh), (theirs.U, theirs.S, theirs.V, their_vh), 1e-4, "U S V Vh")
    assert_same(ours.norm(), theirs.norm(), 1e-4, "norm")
    assert_same(ours.norm(), ours.AB.norm(dim=(-2, -1)), 1e-4, "norm against the dense product")
    assert_same(ours.get_corner(2), theirs.get_corner(2), 1e-5, "get_corner")
    assert_same(ours.get_corner(), theirs.get_corner(), 1e-5, "get_corner(3)")
    assert_same(ours.collapse_l(), theirs.collapse_l(), 1e-4, "collapse_l")
    assert_same(ours.collapse_r(), theirs.collapse_r(), 1e-4, "collapse_r")
    same_factored(ours.make_even(), theirs.make_even(), "make_even")
    same_factored(ours.unsqueeze(0), theirs.unsqueeze(0), "unsqueeze(0)")
    for scalar in (2, 0.5, torch.tensor(3.0), torch.tensor([1.5])):
        same_factored(ours * scalar, theirs * scalar, f"* {scalar}")
        same_factored(scalar * ours, scalar * theirs, f"{scalar} *")
    if ours.ldim == ours.rdim:
        assert_same(ours.BA, theirs.BA, 1e-5, "BA")
        assert_same(ours.eigenvalues.real, theirs.eigenvalues.real, 1e-4, "eigenvalues.real")
        assert_same(ours.eigenvalues.imag, theirs.eigenvalues.imag, 1e-4, "eigenvalues.imag")
    assert repr(ours) == repr(theirs) and str(ours) == str(theirs)  # what `print(model.OV)` shows in TL's demos


@pytest.mark.parametrize("shapes", sorted(SHAPES))
def test_products_match_transformer_lens(shapes, tl_factored):
    A, B = random_pair(*SHAPES[shapes])
    ours, theirs = FactoredMatrix(A, B), tl_factored(A, B)
    gen = torch.Generator().manual_seed(1)
    l, r = ours.ldim, ours.rdim
    for n in (1, 2, r + ours.mdim):  # narrower and wider than mdim: both groupings
        right, left = torch.randn(r, n, generator=gen), torch.randn(n, l, generator=gen)
        same_factored(ours @ right, theirs @ right, f"@ [{r} {n}]")
        same_factored(left @ ours, left @ theirs, f"[{n} {l}] @")
    batched = torch.randn(3, *ours.shape[:-2], r, 2, generator=gen)
    same_factored(ours @ batched, theirs @ batched, "@ batched")
    vector_r, vector_l = torch.randn(r, generator=gen), torch.randn(l, generator=gen)
    assert_same(ours @ vector_r, theirs @ vector_r, 1e-5, "@ vector")
    assert_same(vector_l @ ours, vector_l @ theirs, 1e-5, "vector @")
    C, D = random_pair((r, 3), (3, l), seed=2)
    same_factored(ours @ FactoredMatrix(C, D), theirs @ tl_factored(C, D), "@ FactoredMatrix")
    same_factored(ours @ tl_factored(C, D), theirs @ tl_factored(C, D), "@ transformer-lens's FactoredMatrix")
    assert_same((ours @ FactoredMatrix(C, D)).AB, ours.AB @ C @ D, 1e-4, "against the dense product")


INDICES = {
    "int": 0, "negative int": -1, "two ints": (1, 2), "slice": (slice(None), slice(1, 3)),
    "ellipsis then row": (Ellipsis, 0, slice(None)), "ellipsis then column": (Ellipsis, 3),
    "row int": (0, 0, 2), "row -1": (0, 0, -1), "row slice, column int": (0, 0, slice(1, 4), 2),
    "row and column -1": (Ellipsis, -1, -1), "rows and columns sliced": (1, slice(None), slice(0, 3), slice(2, 5)),
    "leading None": None, "None before rows": (0, 0, None), "None between rows and columns": (0, 0, slice(None), None),
    "None after columns": (0, 0, slice(None), slice(None), None), "None, ellipsis": (Ellipsis, None, slice(None), slice(None)),
    "two Nones in the matrix": (0, 1, None, slice(None), None),
    "tensor of ints": torch.tensor([0, 1]), "list then int": ([0, 1], 0), "0-d tensor": torch.tensor(1),
    "0-d tensor as row": (0, 0, torch.tensor(2)), "boolean mask": torch.tensor([True, False]),
    "tensor of rows": (0, 1, torch.tensor([0, 3, 4])),
}


@pytest.mark.parametrize("index", sorted(INDICES))
def test_indexing_matches_transformer_lens(index, tl_factored):
    A, B = random_pair((2, 3, 5, 4), (2, 3, 4, 6))
    ours, theirs = FactoredMatrix(A, B)[INDICES[index]], tl_factored(A, B)[INDICES[index]]
    same_factored(ours, theirs, index)
    assert_same(ours.AB, theirs.AB, 1e-5, index)


def test_integer_rows_and_columns_keep_their_dimension():
    """Unlike a tensor's: AB[0, 0, 2] would be a row vector; the factored matrix stays [1 rdim] (TL's rule)."""
    A, B = random_pair((2, 3, 5, 4), (2, 3, 4, 6))
    fm = FactoredMatrix(A, B)
    torch.testing.assert_close(fm[0, 0, 2].AB, (A @ B)[0, 0, 2:3])
    torch.testing.assert_close(fm[1, 2, -1, -1].AB, (A @ B)[1, 2, -1:, -1:])


def test_half_precision_decompositions_run_in_float32():
    A, B = random_pair((6, 3), (3, 6))
    fm = FactoredMatrix(A.bfloat16(), B.bfloat16())
    assert fm.S.dtype == torch.float32 and fm.eigenvalues.dtype == torch.complex64
    torch.testing.assert_close(fm.norm(), fm.AB.float().norm(), atol=1e-2, rtol=1e-2)


# ---- (3) grouped-query checkpoints against the bridge ------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "gemma2"])
def test_grouped_query_circuits_match_transformer_lens(kind, tmp_path):
    """Each key/value head repeated for the query heads it serves; Qwen3's q/k norm weights and Gemma 2's write
    norm left out, as the bridge leaves them."""
    pytest.importorskip("transformer_lens")
    from test_variants import build

    build(kind, tmp_path)
    ours = HookedDecoder.from_pretrained(tmp_path).eval()
    theirs = bridge(str(tmp_path))
    assert ours.cfg.n_kv_heads < ours.cfg.n_heads
    for name in ("OV", "QK"):
        assert_same(getattr(ours, name).AB, getattr(theirs, name).AB, 1e-4, name)
        assert_same(getattr(ours, name).S, getattr(theirs, name).S, 1e-4, f"{name}.S")
    for mode in "QKV":
        assert_same(ours.all_composition_scores(mode), theirs.all_composition_scores(mode)[:], 1e-4, mode)
    group = ours.cfg.n_heads // ours.cfg.n_kv_heads
    last = ours.cfg.n_heads - 1
    torch.testing.assert_close(ours.OV[1, last].AB, ours.W_V[1, last // group] @ ours.W_O[1, last])
    torch.testing.assert_close(ours.QK[1, last].AB, ours.W_Q[1, last] @ ours.W_K[1, last // group].T)


# ---- bad input -------------------------------------------------------------------------------------------------
def test_bad_factors_and_operands_are_named():
    A, B = random_pair((5, 3), (3, 4))
    fm = FactoredMatrix(A, B)
    cases = [
        (lambda: FactoredMatrix(A, A), ValueError, r"inner dimension: A's last \(3\) must equal B's second-to-last \(5\)"),
        (lambda: FactoredMatrix(torch.zeros(2, 5, 3), torch.zeros(3, 3, 4)), ValueError, "do not broadcast"),
        (lambda: FactoredMatrix(torch.zeros(5), B), ValueError, r"at least 2 dimensions.*v\[:, None\]"),
        (lambda: FactoredMatrix(A.numpy(), B), TypeError, "A must be a tensor"),
        (lambda: FactoredMatrix(A.double(), B), TypeError, r"B.to\(A.dtype\)"),
        (lambda: fm @ torch.zeros(5, 2), ValueError, r"rows \(5\) must equal rdim \(4\)"),
        (lambda: fm @ torch.zeros(3), ValueError, r"length \(3\) must equal rdim \(4\)"),
        (lambda: torch.zeros(2, 4) @ fm, ValueError, r"last dimension \(4\) must equal ldim \(5\)"),
        (lambda: fm * torch.ones(2), ValueError, "only a scalar scales it; for a matrix product use @"),
        (lambda: fm.BA, ValueError, r"square matrix \(ldim == rdim\)"),
        (lambda: fm.eigenvalues, ValueError, "square matrix"),
        (lambda: fm[0, 0, 0], IndexError, "too many indices"),
        (lambda: fm[..., ...], IndexError, "only one ellipsis"),
        (lambda: FactoredMatrix(A[None], B[None]).unsqueeze(2), ValueError, r"k in \[0, 1\] or \[-4, -3\]"),
        (lambda: FactoredMatrix(A[None], B[None])[torch.ones(1, 5, dtype=torch.bool)], IndexError,
         "reaches past the leading dimensions"),
    ]
    for make, error, message in cases:
        with pytest.raises(error, match=message):
            make()
    with pytest.raises(TypeError):
        fm * "2"


def test_bad_circuit_inputs_are_named(bundled_model):
    model = bundled_model
    with pytest.raises(ValueError, match="mode='q' is not one of 'Q', 'K', 'V'"):
        model.all_composition_scores("q")
    with pytest.raises(TypeError, match=r"for a list of ids pass torch.tensor\(ids\)"):
        model.tokens_to_residual_directions([3, 4])
    with pytest.raises(TypeError, match="integer tensor"):
        model.tokens_to_residual_directions(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"token id 99999 is outside the vocabulary \[0, 4096\)"):
        model.tokens_to_residual_directions(99999)
    with pytest.raises(ValueError, match="empty tensor"):
        model.tokens_to_residual_directions(torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="not one; choose a string that is a single token"):
        model.tokens_to_residual_directions(" the quick brown fox")


def test_transformer_lens_stays_optional():
    """probe.factored and the circuit views import nothing from transformer-lens."""
    import subprocess
    import sys

    code = "import sys, probe; probe.FactoredMatrix; assert 'transformer_lens' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
