"""FactoredMatrix: a matrix kept as the product of two factors, A [... ldim mdim] @ B [... mdim rdim].

A head's OV circuit W_V W_O is [d_model d_model] but has rank d_head; kept as its two factors it costs
d_model * d_head per head, and its SVD, eigenvalues and Frobenius norm come from d_head-sized problems.
The semantics are transformer-lens's `FactoredMatrix` (written here, so transformer-lens stays optional):
the same products, the same SVD route (so the same signs of U and V), the same indexing rules. Leading
dimensions ([layer head ...]) broadcast between A and B.
"""
from __future__ import annotations

import numbers
from functools import cached_property
from typing import Any, Union

import torch

Scalar = Union[int, float, torch.Tensor]


def _for_linalg(x: torch.Tensor) -> torch.Tensor:
    # torch.linalg's SVD and eig have no 16-bit kernels
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _as_int(item: Any):
    """A plain int for an integer index (Python, NumPy or a 0-d integer tensor), else None."""
    if isinstance(item, numbers.Integral):
        return int(item)
    if isinstance(item, torch.Tensor) and item.dim() == 0 and not (item.is_floating_point() or item.is_complex()) \
            and item.dtype != torch.bool:
        return int(item)
    return None


def _keep_dim(item: Any) -> Any:
    """An integer row or column index as a one-long slice: the result stays a matrix."""
    value = _as_int(item)
    if value is None:
        return item
    return slice(value, value + 1 if value != -1 else None)  # slice(-1, 0) would be empty


def _dims_consumed(item: Any) -> int:
    """How many dimensions of the indexed tensor `item` uses up, as torch's indexing counts them."""
    if item is None or item is Ellipsis:
        return 0
    if isinstance(item, (list, tuple)):
        item = torch.as_tensor(item)
        return item.dim() if item.dtype == torch.bool else 1
    dtype = getattr(item, "dtype", None)
    if isinstance(item, torch.Tensor) and dtype in (torch.bool, torch.uint8):
        return item.dim()  # a mask uses up one dimension per dimension of its own
    if dtype is not None and str(dtype) in ("bool", "uint8") and hasattr(item, "ndim"):  # a NumPy mask
        return item.ndim
    return 1


def _factors(other: Any):
    """(A, B) of a factored matrix, ours or transformer-lens's; None for anything else."""
    if isinstance(other, FactoredMatrix):
        return other.A, other.B
    pair = getattr(other, "pair", None)
    if not isinstance(other, torch.Tensor) and isinstance(pair, tuple) and len(pair) == 2:
        return pair
    return None


class FactoredMatrix:
    """The matrix A @ B [... ldim rdim], never formed unless asked for (`.AB`).

    `fm @ x` and `x @ fm` with a matrix give a FactoredMatrix (the cheaper grouping is chosen), with a vector
    a tensor; `fm[layer, head]` indexes the leading dimensions, and rows and columns too (an integer row or
    column keeps its dimension, as in transformer-lens). `.svd()` (cached), `.eigenvalues` and `.norm()`
    cost only mdim-sized decompositions on top of the factors' own."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor):
        for name, factor, dims in (("A", A, "[... ldim mdim]"), ("B", B, "[... mdim rdim]")):
            if not isinstance(factor, torch.Tensor):
                raise TypeError(f"FactoredMatrix's {name} must be a tensor {dims}, got {type(factor).__name__}")
            if factor.dim() < 2:
                raise ValueError(f"FactoredMatrix's {name} must have at least 2 dimensions {dims}, got shape "
                                 f"{tuple(factor.shape)}; a vector v is a matrix as v[:, None] or v[None, :]")
        if A.shape[-1] != B.shape[-2]:
            raise ValueError(f"A {tuple(A.shape)} and B {tuple(B.shape)} do not share an inner dimension: A's last "
                             f"({A.shape[-1]}) must equal B's second-to-last ({B.shape[-2]})")
        try:
            leading = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        except RuntimeError:
            raise ValueError(f"the leading dimensions of A {tuple(A.shape)} and B {tuple(B.shape)} do not broadcast: "
                             "each pair must be equal or one of them 1") from None
        if A.dtype != B.dtype:
            raise TypeError(f"A is {A.dtype} and B is {B.dtype}: give both one dtype, e.g. B.to(A.dtype)")
        # both factors get the full leading shape, so indexing a leading dimension indexes both alike
        self.A = A.broadcast_to(leading + A.shape[-2:])
        self.B = B.broadcast_to(leading + B.shape[-2:])

    # ---- shape ------------------------------------------------------------------------------------------
    @property
    def ldim(self) -> int:
        return self.A.shape[-2]

    @property
    def mdim(self) -> int:
        return self.A.shape[-1]

    @property
    def rdim(self) -> int:
        return self.B.shape[-1]

    @property
    def shape(self) -> torch.Size:  # [... ldim rdim], the shape of AB
        return self.A.shape[:-2] + (self.ldim, self.rdim)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.A, self.B

    def __repr__(self) -> str:  # transformer-lens's words, which its demos print
        return f"FactoredMatrix: Shape({self.shape}), Hidden Dim({self.mdim})"

    # ---- products ---------------------------------------------------------------------------------------
    @property
    def AB(self) -> torch.Tensor:  # [... ldim rdim]: the whole matrix, possibly large
        return self.A @ self.B

    @property
    def BA(self) -> torch.Tensor:  # [... mdim mdim]: has AB's non-zero eigenvalues
        if self.ldim != self.rdim:
            raise ValueError(f"BA needs a square matrix (ldim == rdim), this one is {tuple(self.shape)}")
        return self.B @ self.A

    @property
    def T(self) -> "FactoredMatrix":
        return FactoredMatrix(self.B.mT, self.A.mT)

    def __matmul__(self, other: Any):
        factors = _factors(other)
        if factors is not None:
            return (self @ factors[0]) @ factors[1]
        if not isinstance(other, torch.Tensor):
            return NotImplemented
        if other.dim() == 0:
            raise ValueError("FactoredMatrix @ a 0-d tensor: to scale, use *")
        rows = other.shape[-2] if other.dim() >= 2 else other.shape[0]
        if rows != self.rdim:
            raise ValueError(f"FactoredMatrix {tuple(self.shape)} @ tensor {tuple(other.shape)}: the tensor's "
                             f"{'length' if other.dim() == 1 else 'rows'} ({rows}) must equal rdim ({self.rdim})")
        if other.dim() == 1:  # a vector: the product is a vector too, [... ldim]
            return (self.A @ (self.B @ other[:, None]))[..., 0]
        # keep the narrower of the two inner dimensions as the new mdim
        if self.rdim > self.mdim:
            return FactoredMatrix(self.A, self.B @ other)
        return FactoredMatrix(self.AB, other)

    def __rmatmul__(self, other: Any):
        if not isinstance(other, torch.Tensor):
            return NotImplemented
        if other.dim() == 0:
            raise ValueError("a 0-d tensor @ FactoredMatrix: to scale, use *")
        if other.shape[-1] != self.ldim:
            raise ValueError(f"tensor {tuple(other.shape)} @ FactoredMatrix {tuple(self.shape)}: the tensor's last "
                             f"dimension ({other.shape[-1]}) must equal ldim ({self.ldim})")
        if other.dim() == 1:  # [... rdim]
            return ((other[None, :] @ self.A) @ self.B)[..., 0, :]
        if self.ldim > self.mdim:
            return FactoredMatrix(other @ self.A, self.B)
        return FactoredMatrix(other, self.AB)

    def __mul__(self, scalar: Scalar) -> "FactoredMatrix":
        if isinstance(scalar, torch.Tensor):
            if scalar.numel() != 1:
                raise ValueError(f"FactoredMatrix * a tensor of shape {tuple(scalar.shape)}: only a scalar scales it; "
                                 "for a matrix product use @")
        elif not isinstance(scalar, numbers.Number) or isinstance(scalar, complex):
            return NotImplemented
        return FactoredMatrix(self.A * scalar, self.B)

    __rmul__ = __mul__

    # ---- decompositions ---------------------------------------------------------------------------------
    @cached_property
    def _svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        A, B = _for_linalg(self.A), _for_linalg(self.B)
        u_a, s_a, vh_a = torch.linalg.svd(A, full_matrices=False)
        u_b, s_b, vh_b = torch.linalg.svd(B, full_matrices=False)
        # AB = u_a (diag(s_a) vh_a u_b diag(s_b)) vh_b, and the core is at most mdim x mdim: decompose it instead
        core = s_a[..., :, None] * (vh_a @ u_b) * s_b[..., None, :]
        u_core, s, vh_core = torch.linalg.svd(core, full_matrices=False)
        return u_a @ u_core, s, vh_b.mT @ vh_core.mT

    def svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(U [... ldim k], S [... k], V [... rdim k]) with AB = U diag(S) V^T, k = min(ldim, mdim, rdim).
        V, not V^T, as transformer-lens returns it."""
        return self._svd

    @property
    def U(self) -> torch.Tensor:  # [... ldim k]
        return self._svd[0]

    @property
    def S(self) -> torch.Tensor:  # [... k], descending
        return self._svd[1]

    @property
    def V(self) -> torch.Tensor:  # [... rdim k]
        return self._svd[2]

    @property
    def Vh(self) -> torch.Tensor:
        """[... rdim k]: the same V as `.V` (not its transpose), as transformer-lens's `Vh` has always been, so
        code written for it gets its numbers. For the conjugate transpose take `.V.mT`."""
        return self._svd[2]

    @property
    def eigenvalues(self) -> torch.Tensor:
        """[... mdim] complex: the eigenvalues of BA, which are AB's non-zero ones (BAv = kv gives AB(Av) = k(Av))."""
        # on the CPU: an mdim-sized problem gains nothing from a GPU, and CUDA's eig needs MAGMA or a recent
        # cuSOLVER, which not every PyTorch build has
        ba = _for_linalg(self.BA)
        return torch.linalg.eigvals(ba.cpu()).to(ba.device)

    def norm(self) -> torch.Tensor:
        """[...]: the Frobenius norm, sqrt(sum S^2), without forming AB."""
        return self.S.pow(2).sum(-1).sqrt()

    def make_even(self) -> "FactoredMatrix":
        """The same matrix as (U sqrt(S)) (sqrt(S) V^T): both factors carry half of each singular value."""
        root = self.S.sqrt()
        return FactoredMatrix(self.U * root[..., None, :], root[..., :, None] * self.V.mT)

    def collapse_l(self) -> torch.Tensor:
        """[... k rdim]: S V^T, the matrix with its left orthonormal factor U dropped (norms are unchanged)."""
        return self.S[..., :, None] * self.V.mT

    def collapse_r(self) -> torch.Tensor:
        """[... ldim k]: U S, the matrix with its right orthonormal factor V^T dropped."""
        return self.U * self.S[..., None, :]

    def get_corner(self, k: int = 3) -> torch.Tensor:
        """The top-left k x ... x k corner of AB, to look at, forming only those entries."""
        corner = self.A[..., :k, :] @ self.B[..., :, :k]
        return corner[tuple(slice(k) for _ in range(corner.dim()))]

    def unsqueeze(self, k: int) -> "FactoredMatrix":
        """A new leading dimension of size 1 at `k` (counted in AB's dimensions, as Tensor.unsqueeze counts)."""
        n_leading = self.ndim - 2
        if not (0 <= k <= n_leading or -(self.ndim + 1) <= k <= -3):
            raise ValueError(f"unsqueeze({k}) would split the matrix's own two dimensions; a FactoredMatrix of shape "
                             f"{tuple(self.shape)} takes k in [0, {n_leading}] or [{-(self.ndim + 1)}, -3]")
        return FactoredMatrix(self.A.unsqueeze(k), self.B.unsqueeze(k))

    # ---- indexing ---------------------------------------------------------------------------------------
    def __getitem__(self, index: Any) -> "FactoredMatrix":
        """Index as AB would be, without forming it: `fm[layer, head]`, slices, `...`, `None`, rows and columns.
        An integer row or column index keeps its (now one-long) dimension, so the result is still a matrix."""
        items = list(index) if isinstance(index, tuple) else [index]
        if sum(item is Ellipsis for item in items) > 1:
            raise IndexError("an index can hold only one ellipsis (...)")
        if Ellipsis in items:
            at = next(i for i, item in enumerate(items) if item is Ellipsis)
            rest = self.ndim - sum(_dims_consumed(item) for item in items)
            items[at:at + 1] = [slice(None)] * max(rest, 0)
        n_leading = self.ndim - 2
        leading, matrix, new_axes, used = [], [], [], 0  # new_axes: how many of row/column precede each None
        for item in items:
            if used < n_leading:
                leading.append(item)
                used += _dims_consumed(item)
                if used > n_leading:
                    raise IndexError(f"index item {item!r} reaches past the leading dimensions "
                                     f"{tuple(self.shape[:-2])} into the matrix's rows: index rows and columns "
                                     "separately")
            elif item is None:
                new_axes.append(len(matrix))
            else:
                matrix.append(item)
        if len(matrix) > 2:
            raise IndexError(f"too many indices ({len(items)}) for a FactoredMatrix of shape {tuple(self.shape)}")
        rows = [_keep_dim(matrix[0])] if matrix else []
        columns = [slice(None), _keep_dim(matrix[1])] if len(matrix) == 2 else []
        result = FactoredMatrix(self.A[tuple(leading + rows)], self.B[tuple(leading + columns)])
        for slot in new_axes:
            a, b = result.A, result.B
            if slot == 0:  # before the rows: a new leading dimension
                result = FactoredMatrix(a.unsqueeze(-3), b.unsqueeze(-3))
            elif slot == 1:  # between rows and columns: the rows become a leading dimension, the new one the rows
                result = FactoredMatrix(a.unsqueeze(-2), b.unsqueeze(-3))
            else:  # after the columns: rows and columns both lead, and each entry is a 1 x 1 matrix
                result = FactoredMatrix(b.mT.unsqueeze(-3), a.unsqueeze(-1))
        return result
