"""The op lists of `jmp_lite.autocast`: which primitives run in which dtype.

See `jmp_lite.autocasting` for the rules and for the lists they mirror
(PyTorch's CUDA autocast reference and MindSpore's built-in lists).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any, Union

import jax.extend as jex
from jax import lax

__all__ = ("DEFAULT_WHITE_LIST", "DEFAULT_BLACK_LIST", "MIN_REDUCTION_SIZE",
           "primitive_name")

_core = jex.core

DEFAULT_WHITE_LIST: frozenset[str] = frozenset({
    "dot_general", "conv_general_dilated"})

DEFAULT_BLACK_LIST: frozenset[str] = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "pow", "integer_pow", "square",
    "rsqrt", "logistic",
    "erf_inv", "acos", "asin", "cosh", "sinh", "tan",
    "reduce_sum", "reduce_prod", "reduce_max", "reduce_window_sum",
    "cumsum", "cumprod", "cumlogsumexp",
    "psum", "psum_invariant", "reduce_scatter",
    # Linear algebra and FFTs: no half-precision kernels (LAPACK, cuSOLVER,
    # XLA's FFT), so a half operand fails to compile. torch's CPU autocast
    # keeps its linalg_* and fft_* ops in float32 too.
    "cholesky", "cholesky_update", "eig", "eigh", "fft", "hessenberg",
    "householder_product", "lu", "ormqr", "qr", "schur", "svd",
    "symmetric_product", "triangular_solve", "tridiagonal", "tridiagonal_solve",
    # Complex values exist in complex64 and up: their parts are float32.
    "complex", "conj",
    # Gamma sampling (gamma, beta, dirichlet, t): rejection sampling whose
    # draws and derivative change in half precision.
    "random_gamma"})

MIN_REDUCTION_SIZE = 16

# lax wrappers whose name is not their primitive's.
_LAX_ALIASES = {
    "conv": "conv_general_dilated",
    "conv_with_general_padding": "conv_general_dilated",
    "conv_transpose": "conv_general_dilated",
    "dot": "dot_general",
    "batch_matmul": "dot_general",
    "psum_scatter": "reduce_scatter",
}

PrimitiveLike = Union[str, "jex.core.Primitive", Callable[..., Any]]


def _known_primitive_names() -> frozenset[str]:
  names = {p.name for p in vars(_core.primitives).values()
           if isinstance(p, _core.Primitive)}
  return frozenset(names | {"psum_invariant", "reduce_scatter", "pjit",
                            "closed_call", "custom_jvp_call",
                            "custom_vjp_call", "remat2"})


def primitive_name(op: PrimitiveLike) -> str:
  """The jaxpr primitive name of ``op``: a name, a `Primitive` or a lax function.

  Args:
    op: ``"exp"``, ``jax.extend.core.primitives.exp_p`` or ``jax.lax.exp``.
      Wrappers such as ``jax.lax.conv`` and ``jax.lax.dot`` map to the
      primitive they bind (``conv_general_dilated``, ``dot_general``).

  Returns:
    The name as it appears in ``jax.make_jaxpr`` output.

  Raises:
    ValueError: for an unknown name or a function that is not in ``jax.lax``.

  Example:
    >>> from jax import lax
    >>> primitive_name(lax.exp), primitive_name(lax.conv), primitive_name("tanh")
    ('exp', 'conv_general_dilated', 'tanh')
  """
  known = _known_primitive_names()
  if isinstance(op, _core.Primitive):
    return op.name
  if isinstance(op, str):
    if op in known:
      return op
    close = difflib.get_close_matches(op, sorted(known), n=3)
    raise ValueError(
        f"Unknown primitive name {op!r}; close matches: {close}. Names are"
        " those printed by jax.make_jaxpr (e.g. 'dot_general', 'reduce_sum').")
  name = getattr(op, "__name__", None)
  if callable(op) and name and getattr(lax, name, None) is op:
    name = _LAX_ALIASES.get(name, name)
    if name in known:
      return name
  raise ValueError(
      f"Cannot map {op!r} to a jaxpr primitive: pass a jax.lax function that"
      " binds a single primitive (jax.lax.exp), a Primitive, or the name"
      " printed by jax.make_jaxpr (e.g. 'dot_general').")
