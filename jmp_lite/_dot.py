"""A float32-accumulating ``dot_general`` that every XLA backend can run.

``lax.dot_general(bf16, bf16, preferred_element_type=float32)`` is the fast,
accurate way to multiply half-precision matrices (bf16 matrix units accumulate
in float32), but XLA's CPU runtime rejects some batched layouts of it
("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"), e.g.
attention's ``einsum("bqhd,bkhd->bhqk")``, whose batch dimensions are not
leading. `dot_general_f32` puts the operands in the canonical
``[batch, rows, contract] x [batch, contract, cols]`` layout first, which all
backends accept and which is the layout XLA would transpose to anyway.
"""

from __future__ import annotations

import math

import jax
from jax import lax
import jax.numpy as jnp


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
  (lc, rc), (lb, rb) = dimension_numbers
  if not lb:  # Unbatched dots run as written on every backend.
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=jnp.float32)
  lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
  rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
  lhs = jnp.transpose(lhs, (*lb, *lf, *lc))
  rhs = jnp.transpose(rhs, (*rb, *rc, *rf))
  nb, nf = len(lb), len(lf)
  batch, rows, contract = lhs.shape[:nb], lhs.shape[nb:nb + nf], lhs.shape[nb + nf:]
  cols = rhs.shape[nb + len(rc):]
  out = lax.dot_general(
      lhs.reshape(math.prod(batch), math.prod(rows), math.prod(contract)),
      rhs.reshape(math.prod(batch), math.prod(contract), math.prod(cols)),
      (((2,), (1,)), ((0,), (0,))), precision=precision,
      preferred_element_type=jnp.float32)
  return out.reshape(*batch, *rows, *cols)
