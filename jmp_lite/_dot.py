"""Float32-accumulating ``dot_general`` in a layout every XLA backend can run.

``lax.dot_general(bf16, bf16, preferred_element_type=float32)`` is the fast,
accurate way to multiply half-precision matrices (bf16 matrix units accumulate
in float32), but XLA's CPU runtime rejects some batched layouts of it at run
time ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"),
e.g. attention's backward einsums, whose batch dimensions are not leading.
`canonicalize` transposes the operands to ``[batch, free, contract] x [batch,
contract, free]``, which all backends accept: the result is the same array
(``dot_general`` orders its output batch, lhs free, rhs free whatever the
operand layouts) and XLA folds the transposes. Used by `jmp_lite.flax` and
`jmp_lite.autocast`.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np


def canonicalize(lhs, rhs, dimension_numbers):
  """Returns ``(lhs, rhs, dimension_numbers)`` in the canonical layout."""
  (lc, rc), (lb, rb) = dimension_numbers
  lf = [d for d in range(np.ndim(lhs)) if d not in lc and d not in lb]
  rf = [d for d in range(np.ndim(rhs)) if d not in rc and d not in rb]
  l_perm, r_perm = (*lb, *lf, *lc), (*rb, *rc, *rf)
  nb, nf, nc = len(lb), len(lf), len(lc)
  dims = ((tuple(range(nb + nf, nb + nf + nc)), tuple(range(nb, nb + nc))),
          (tuple(range(nb)), tuple(range(nb))))
  if dims == ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))):
    return lhs, rhs, dimension_numbers
  if l_perm != tuple(range(len(l_perm))):
    lhs = lax.transpose(lhs, l_perm)
  if r_perm != tuple(range(len(r_perm))):
    rhs = lax.transpose(rhs, r_perm)
  return lhs, rhs, dims


def dot_general_f32(lhs: jax.Array, rhs: jax.Array, dimension_numbers,
                    precision=None) -> jax.Array:
  """``lax.dot_general`` with ``preferred_element_type=float32``, canonicalised.

  Example:
    >>> import jax.numpy as jnp
    >>> q = jnp.ones((2, 5, 4, 8), jnp.bfloat16)  # batch, query, heads, depth
    >>> k = jnp.ones((2, 7, 4, 8), jnp.bfloat16)
    >>> dot_general_f32(q, k, (((3,), (3,)), ((0, 2), (0, 2)))).shape
    (2, 4, 5, 7)
  """
  lhs, rhs, dims = canonicalize(lhs, rhs, dimension_numbers)
  return lax.dot_general(lhs, rhs, dims, precision=precision,
                         preferred_element_type=jnp.float32)
