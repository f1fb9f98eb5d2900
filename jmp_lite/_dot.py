"""Float32-accumulating ``dot_general`` in a layout every XLA backend can run.

``lax.dot_general(bf16, bf16, preferred_element_type=float32)`` is the fast,
accurate way to multiply half-precision matrices (bf16 matrix units accumulate
in float32), but XLA's CPU runtime rejects some batched layouts of it at run
time ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"),
e.g. attention's backward einsums, whose batch dimensions are not leading.
`canonicalize` transposes the operands to ``[batch, free, contract] x [batch,
contract, free]`` (or ``x [batch, free, contract]``), which all backends accept
and which XLA:CPU's bf16 kernels need: the result is the same array
(``dot_general`` orders its output batch, lhs free, rhs free whatever the
operand layouts). On CPU the transposed operands are also copied into
row-major order, which the fast bf16 kernels need (see `_materialize`). Used by
`jmp_lite.flax` and `jmp_lite.autocast`.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np


def canonicalize(lhs, rhs, dimension_numbers):
  """Returns ``(lhs, rhs, dimension_numbers)`` in a layout every backend runs.

  ``lhs`` becomes ``[batch, free, contract]``; ``rhs`` stays as it is if it is
  already ``[batch, contract, free]`` or ``[batch, free, contract]`` (both
  are native matrix-unit layouts: ``x @ w`` and ``g @ w.T``), and becomes
  ``[batch, contract, free]`` otherwise.
  """
  (lc, rc), (lb, rb) = dimension_numbers
  lf = [d for d in range(np.ndim(lhs)) if d not in lc and d not in lb]
  rf = [d for d in range(np.ndim(rhs)) if d not in rc and d not in rb]
  nb, nf, nc, nrf = len(lb), len(lf), len(lc), len(rf)
  l_perm = (*lb, *lf, *lc)
  r_nn, r_nt = (*rb, *rc, *rf), (*rb, *rf, *rc)
  identity = tuple(range(np.ndim(rhs)))
  if r_nt == identity and r_nn != identity:
    r_perm, r_contract = r_nt, tuple(range(nb + nrf, nb + nrf + nc))
  else:
    r_perm, r_contract = r_nn, tuple(range(nb, nb + nc))
  dims = ((tuple(range(nb + nf, nb + nf + nc)), r_contract),
          (tuple(range(nb)), tuple(range(nb))))
  if dims == ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))):
    return lhs, rhs, dimension_numbers
  if l_perm != tuple(range(len(l_perm))):
    lhs = _materialize(lax.transpose(lhs, l_perm))
  if r_perm != identity:
    rhs = _materialize(lax.transpose(rhs, r_perm))
  return lhs, rhs, dims


def _materialize(x):
  """``x`` copied into row-major order, on CPU.

  XLA folds a transpose into the dot's operand layout, and XLA:CPU runs a
  bf16 dot whose operand is not row-major (a weight gradient ``x.T @ g``) as
  a float32 dot: the fast kernels only take row-major operands. Flattening
  behind an optimization barrier forces the copy, which costs one pass over
  the operand and buys the bf16 kernel. Other backends take transposed
  operands natively, so there the transpose is left to XLA.
  """
  if jax.default_backend() != "cpu" or _is_sharded(x):
    return x
  return lax.optimization_barrier(x.reshape(-1)).reshape(x.shape)


def _is_sharded(x) -> bool:
  """Whether ``x``'s type carries a sharding (explicit mesh axes).

  Flattening a sharded array needs an output sharding, and the copy would be
  per shard anyway; such operands are left to XLA's partitioner.
  """
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  return bool(spec) and any(s is not None for s in spec)


def dot_general_f32(lhs: jax.Array, rhs: jax.Array, dimension_numbers,
                    precision=None, out_sharding=None) -> jax.Array:
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
                         preferred_element_type=jnp.float32,
                         out_sharding=out_sharding)


def dot_general_cotangents(ct, lhs, rhs, dimension_numbers):
  """Cotangents of ``dot_general(lhs, rhs)``, each from one float32-accumulating dot.

  JAX's transpose rule computes the ``rhs`` cotangent as a dot with the
  operands swapped and then transposes the float32 result (for ``x @ w``:
  ``(g.T @ x).T``), which on CPU costs a copy of every weight gradient and
  pushes a transposed layout into the optimizer. Here each cotangent is one
  dot whose output is already in its operand's dimension order (``x.T @ g``
  and ``g @ w.T`` for ``x @ w``).

  Returns:
    ``(d_lhs, d_rhs)`` in float32.
  """
  (lc, rc), (lb, rb) = dimension_numbers
  lf = [d for d in range(np.ndim(lhs)) if d not in lc and d not in lb]
  rf = [d for d in range(np.ndim(rhs)) if d not in rc and d not in rb]
  nb, nlf = len(lb), len(lf)
  ct_b = tuple(range(nb))
  ct_lf = tuple(range(nb, nb + nlf))
  ct_rf = tuple(range(nb + nlf, np.ndim(ct)))

  # d_lhs: ct . rhs over rhs's free dims -> [batch, lhs free, rc (sorted)].
  sorted_rc = sorted(rc)
  where = {}
  for i, d in enumerate(lb):
    where[d] = i
  for k, d in enumerate(lf):
    where[d] = nb + k
  for d_l, d_r in zip(lc, rc):
    where[d_l] = nb + nlf + sorted_rc.index(d_r)
  d_lhs = dot_general_f32(ct, rhs, ((ct_rf, tuple(rf)), (ct_b, tuple(rb))),
                          out_sharding=_sharding_at(lhs, where))
  perm = tuple(where[d] for d in range(np.ndim(lhs)))
  if perm != tuple(range(len(perm))):
    d_lhs = lax.transpose(d_lhs, perm)

  # d_rhs: lhs . ct over lhs's free dims -> [batch, lc (sorted), rhs free].
  sorted_lc = sorted(lc)
  where = {}
  for i, d in enumerate(rb):
    where[d] = i
  for d_l, d_r in zip(lc, rc):
    where[d_r] = nb + sorted_lc.index(d_l)
  for k, d in enumerate(rf):
    where[d] = nb + len(lc) + k
  d_rhs = dot_general_f32(lhs, ct, ((tuple(lf), ct_lf), (tuple(lb), ct_b)),
                          out_sharding=_sharding_at(rhs, where))
  perm = tuple(where[d] for d in range(np.ndim(rhs)))
  if perm != tuple(range(len(perm))):
    d_rhs = lax.transpose(d_rhs, perm)
  return d_lhs, d_rhs


def _sharding_at(operand, where):
  """The sharding of ``operand``'s cotangent as the dot produces it, or None.

  Under explicit mesh axes a dot that contracts a sharded dimension (a weight
  gradient contracts the sharded batch) must be told its output's sharding:
  the operand's own, with dimension ``d`` at position ``where[d]``.
  """
  sharding = getattr(jax.typeof(operand), "sharding", None)
  spec = getattr(sharding, "spec", None)
  mesh = getattr(sharding, "mesh", None)
  if spec is None or mesh is None or getattr(mesh, "empty", True):
    return None
  spec = tuple(spec) + (None,) * (np.ndim(operand) - len(spec))
  out = [None] * np.ndim(operand)
  for d, pos in where.items():
    out[pos] = spec[d]
  return sharding.update(spec=jax.sharding.PartitionSpec(*out))
