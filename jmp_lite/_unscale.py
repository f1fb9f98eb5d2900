"""Numerics of `jmp_lite.optax.with_loss_scale`: one pass over scaled gradients,
and what its inner optimizer sees.

From the gradients of the scaled loss it derives, with two sums over them
and no conditional branch: whether they are finite, the global norm of the
*unscaled* gradients, and the factor that unscales and clips them. The factor
is kept as ``mantissa * 2**exponent`` and applied as two multiplications by
normal numbers, because its value can be subnormal (a loss scale of 2**127,
or clipping gradients of 1e38 to norm 1), and XLA flushes subnormals to zero
on CPUs and GPUs: a subnormal factor would silently zero the update.

Leaves that take part: floating and complex arrays of 16 bits or more. fp8
leaves (quantisation metadata stored beside parameters) are checked for
finiteness but neither unscaled, clipped nor counted in the norm; integer,
boolean and float0 leaves pass through.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_lite import _elementwise
from jmp_lite import _exact
from jmp_lite import _reduce
from jmp_lite import loss_scale as ls_lib
from jmp_lite._dtypes import is_floating
from jmp_lite._dtypes import is_inexact
from jmp_lite._dtypes import is_low_bit_float
from jmp_lite._dtypes import wide_dtype


def is_scaled(x: Any) -> bool:
  """Whether a gradient leaf carries the loss scale (and is unscaled, clipped, normed).

  Complex dtypes are never low-bit (`is_low_bit_float` is False for them).
  """
  return is_inexact(x) and not is_low_bit_float(x.dtype)


def real_wide_dtype(dtype) -> np.dtype:
  """float32 or float64: the real dtype that arithmetic on ``dtype`` happens in."""
  wide = wide_dtype(dtype)  # a NumPy dtype: float32/64 or complex64/128
  return np.dtype(np.float64 if wide in (np.float64, np.complex128) else np.float32)


def norm_dtype(tree: Any) -> np.dtype:
  """float64 if any scaled leaf of ``tree`` computes in float64, else float32."""
  wides = {real_wide_dtype(x.dtype) for x in jax.tree.leaves(tree) if is_scaled(x)}
  return np.dtype(np.float64 if np.dtype(np.float64) in wides else np.float32)


class Factor(NamedTuple):
  """A positive scalar ``mantissa * 2**exponent`` that may be outside the normal range."""

  mantissa: jax.Array
  exponent: jax.Array  # int32


def _normal_pair(factor: Factor, dtype) -> tuple[jax.Array, jax.Array]:
  return _exact.normal_pair(factor.mantissa, factor.exponent, dtype)


def _abs2(g: jax.Array, dtype, pair=None) -> jax.Array:
  """``|g * a * b|**2`` elementwise in real ``dtype`` (both parts of complex ``g``)."""
  x = _exact.widen(g)
  parts = (lax.real(x), lax.imag(x)) if jnp.iscomplexobj(x) else (x,)
  out = None
  for p in parts:
    p = _elementwise.cast(p, dtype)
    if pair is not None:
      p = lax.mul(lax.mul(p, pair[0]), pair[1])
    out = lax.mul(p, p) if out is None else lax.add(out, lax.mul(p, p))
  return out


class NormInfo(NamedTuple):
  finite: jax.Array  # bool: every leaf finite
  norm: jax.Array  # unscaled global norm (inf if beyond the dtype's range)
  unscale: Factor  # 1 / loss_scale
  clip: Factor  # the unscale factor times min(1, clip_norm / norm)
  clip_pair: tuple  # `clip` as two normal numbers of the norm's dtype


def _downscale(dtype) -> int:
  """``k`` such that ``sum((x * 2**-k)**2)`` stays finite for any finite ``x``.

  Each square is at most ``2**(2 * (maxexp - k))``: ``2**80`` for float32
  (``k = 88``), ``2**976`` for float64, so a sum of fewer than ``2**48``
  elements cannot overflow.
  """
  return jnp.finfo(dtype).maxexp // 2 + 24


def norm_and_factor(grads: Any, loss_scale: jax.Array, clip_norm) -> NormInfo:
  """Finiteness, unscaled global norm and unscale(-and-clip) factor of ``grads``.

  Two sums per group of same-shape arrays, and no conditional branch:

  * ``sum((g / scale)**2)``, the norm's square wherever it is finite;
  * ``sum((g / scale * 2**-k)**2)`` (`_downscale`), which is finite exactly
    when every unscaled gradient is finite: it decides finiteness, and gives
    the norm where the first sum overflows (finite gradients beyond the square
    root of the largest float). Squares it flushes to zero are below
    ``2**-126`` each, and the norm's square is above ``2**-48`` there, so the
    norm is exact to the dtype's rounding for fewer than ``2**48`` elements.

  With a loss scale of 1 or more, the second sum is finite exactly when every
  scaled gradient is. Below 1, unscaling can take finite gradients beyond the
  dtype's range: gradients whose unscaled norm exceeds ``2**(maxexp / 2 + k)``
  (``2**152`` in float32) count as an overflow, as no optimizer could use
  them; below that their norm is inf and clipping still works.

  XLA:CPU compiles the two sums as two loops, each reading the gradients.
  Before, the common case read them once and a rare branch (a `cond`) read
  them three more times to tell overflow from non-finite values; XLA compiles
  a branch whether or not it runs, and that branch was most of the guard's
  compile time. The gradients-only step got faster all the same (the bench's
  ``guard`` section: 1,296 to 782 ms on 1 GiB in 100 arrays).
  """
  leaves = [g for g in jax.tree.leaves(grads) if is_scaled(g)]
  low = [g for g in jax.tree.leaves(grads) if is_inexact(g) and not is_scaled(g)]
  dtype = norm_dtype(grads)
  scale = loss_scale.astype(dtype)
  ms, es = _exact.frexp(scale)
  unscale = Factor(*_exact.reciprocal_factor(scale))
  if not leaves:
    finite = ls_lib.all_finite(low)
    zero = jnp.zeros((), dtype)
    return NormInfo(finite, zero, unscale, unscale, _normal_pair(unscale, dtype))
  k = _downscale(dtype)

  def pairs(unscale):
    """The unscale factor as two pairs of normal numbers. Fenced
    (`_reduce.fenced`): XLA would copy their scalar ops into every per-array
    computation that reads them (three kernels more at 24 arrays, each about
    10-20 ms of XLA:CPU compile time).

    1/scale is subnormal for scales above 2**126: unscale in two steps. The
    downscaled pair is computed from the scale. An earlier form squared
    ``g * 2**-82`` written as a literal, and XLA's algebraic simplifier made
    it ``g * g * (c * c)``, where ``c * c`` is 0. With a scale that is a
    compile-time constant (`NoOpLossScale`) the pair is constant too; XLA:CPU
    keeps ``(g * c) * (g * c)`` then (tests/test_optax.py, huge gradients
    under NoOpLossScale, holds it to that)."""
    return (_normal_pair(unscale, dtype),
            _normal_pair(Factor(unscale.mantissa, unscale.exponent - k), dtype))

  inv, inv_down = _reduce.fenced(pairs, unscale)
  # One reduction per distinct shape (`_reduce`), not one per leaf.
  fast = _reduce.partials(leaves, lambda g: _abs2(g, dtype, inv), lax.add, _reduce.total)
  down = _reduce.partials(leaves, lambda g: _abs2(g, dtype, inv_down), lax.add,
                          _reduce.total)
  low_finite = ls_lib.all_finite(low) if low else jnp.array(True)

  def finish(parts) -> NormInfo:
    """The norm and the factors from the partial sums; fenced, so that the
    scalars are computed once: XLA would fuse (and so duplicate) their few
    dozen scalar ops into every per-leaf computation that reads them."""
    fast, down, low_finite = parts
    sq, sq_down = sum(fast[1:], fast[0]), sum(down[1:], down[0])
    finite = jnp.isfinite(sq_down) & low_finite
    in_range = jnp.isfinite(sq)
    root = jnp.sqrt(jnp.where(in_range, sq, sq_down))
    # The unscaled norm is root * 2**et.
    et = jnp.where(in_range, 0, k).astype(jnp.int32)
    r_m, r_e = _exact.frexp(root)
    norm = _exact.ldexp(r_m, r_e + et, dtype)
    if clip_norm is None:
      clip = unscale
    else:
      # unscale * clip_norm / norm = (c / root) * 2**-et / scale.
      q_m, q_e = _exact.frexp(jnp.asarray(clip_norm, dtype) / jnp.where(root > 0, root, 1))
      active = finite & (norm > clip_norm)
      # q_m / ms is in (0.5, 2): halved, at most 1 (see `_exact.normal_pair`).
      clip = Factor(jnp.where(active, 0.5 * q_m / ms, unscale.mantissa),
                    jnp.where(active, q_e - es - et + 1, unscale.exponent))
    return NormInfo(finite, norm, unscale, clip, _normal_pair(clip, dtype))

  return _reduce.fenced(finish, (fast, down, low_finite))


# What the inner optimizer of `with_loss_scale` sees.


def for_inner(tree: Any) -> Any:
  """What the inner optimizer sees of params: 16-bit floats as float32 copies.

  Integer and boolean leaves become None (an empty subtree to optax), since no
  optimizer can update them.
  """
  def one(x):
    if not is_inexact(x):
      return None
    if is_floating(x) and jnp.finfo(x.dtype).bits == 16:
      return x.astype(jnp.float32)
    return x
  return jax.tree.map(one, tree)


def grads_for_inner(grads: Any, info: NormInfo) -> Any:
  """Unscaled (and clipped) gradients in float32/float64/complex; None for non-floats."""
  pairs = {np.dtype(info.clip_pair[0].dtype): info.clip_pair}

  def one(g):
    if not is_inexact(g):
      return None
    if not is_scaled(g):
      return g
    real = real_wide_dtype(g.dtype)
    if real not in pairs:  # float32 leaves beside float64 ones
      pairs[real] = _normal_pair(info.clip, real)
    a, b = pairs[real]
    wide = wide_dtype(g.dtype)
    return lax.mul(lax.mul(_exact.widen(g), _elementwise.cast(a, wide)),
                   _elementwise.cast(b, wide))
  return jax.tree.map(one, grads)


def fill_updates(updates: Any, like: Any) -> Any:
  """The inner's updates with zeros where ``like`` has integer or boolean leaves."""
  def one(u, x):
    if x is None or is_inexact(x):
      return u if x is not None else None
    if x.dtype == jax.dtypes.float0:  # no params given: a float0 gradient
      return x
    return jnp.zeros(np.shape(x), x.dtype)
  return jax.tree.map(one, updates, like, is_leaf=lambda u: u is None)


def numbers_as_arrays(tree: Any) -> Any:
  """``tree`` with Python numbers and NumPy arrays as the `jax.Array`s a step
  writes back for them (``optax.apply_updates`` makes ``1.5`` a float32
  array): float32, complex64, int32 and bool, strongly typed."""
  def one(x):
    if isinstance(x, (bool, np.ndarray, np.generic)):
      return jnp.asarray(x)
    if isinstance(x, (int, float, complex)):
      kind = jnp.int32 if isinstance(x, int) else (
          jnp.float32 if isinstance(x, float) else jnp.complex64)
      return jnp.asarray(x, kind)
    return x
  return jax.tree.map(one, tree)


def strongly_typed(tree: Any) -> Any:
  """``tree`` with weakly typed leaves (from Python scalars) made strongly typed.

  What a step writes into the state is strongly typed (`cast_like`); a state
  that started weakly typed would change type after the first step and
  compile the step a second time.
  """
  def one(x):
    if getattr(x, "weak_type", False) and (
        is_inexact(x) or jnp.issubdtype(x.dtype, jnp.integer)):
      return jax.lax.convert_element_type(x, x.dtype)
    return x
  return jax.tree.map(one, tree)


def cast_like(new: Any, old: Any) -> Any:
  """``new`` in ``old``'s dtypes: a state must keep its types across a step."""
  return jax.tree.map(lambda n, o: _elementwise.cast(jnp.asarray(n), jnp.asarray(o).dtype),
                      new, old)


def apply_updates(params: Any, updates: Any) -> Any:
  """``optax.apply_updates``, independent of the dtype promotion mode.

  Each new parameter is ``p + u`` computed in the wider of the two dtypes and
  rounded once to ``p``'s dtype: what ``optax.apply_updates`` computes under
  JAX's standard promotion. It also works under
  ``jax_numpy_dtype_promotion="strict"``, where ``optax.apply_updates``
  rejects a float32 update for a bfloat16 parameter. A None update (an
  Equinox model's, for a leaf that is not an array) leaves its parameter as
  it is, as ``eqx.apply_updates`` does; ``eqx.apply_updates`` itself
  computes ``p + u`` and so makes a bfloat16 parameter float32.
  """
  # A None update leaves its parameter as it is: an Equinox model's
  # updates are None where the model holds functions or other non-arrays
  # (`eqx.apply_updates` does the same).
  return jax.tree.map(
      lambda p, u: p if p is None or u is None else _elementwise.add_rounded(p, u),
      params, updates, is_leaf=lambda x: x is None)
