"""Elementwise ops that a guarded step applies to every array, in `jax.lax`.

A ``jax.numpy`` function is itself a jitted function, and tracing one call
costs several times what binding the primitive does. The guard applies a
dozen of them to each parameter array (unscaling, the checks, the selects),
which made tracing a 200-array step about 1.3 s of guard on top of the
model's 0.9 s. These helpers bind the primitives directly; their results are
the same ops, and XLA compiles them identically.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_lite._jaxpr import internals as _internals


def cast(x: jax.Array, dtype) -> jax.Array:
  """``x.astype(dtype)``, strongly typed; ``x`` itself when it already is."""
  # `==` rather than np.dtype(): PRNG key dtypes are not NumPy dtypes.
  if x.dtype == dtype and not getattr(x, "weak_type", False):
    return x
  return lax.convert_element_type(x, dtype)


def isfinite(x: jax.Array) -> jax.Array:
  """``jnp.isfinite``: for complex ``x``, both parts finite."""
  if jnp.iscomplexobj(x):
    return lax.bitwise_and(lax.is_finite(lax.real(x)), lax.is_finite(lax.imag(x)))
  return lax.is_finite(x)


def where(pred: jax.Array, a: jax.Array, b: Any) -> jax.Array:
  """``jnp.where(pred, a, b)`` for a scalar or ``a``-shaped ``pred``, ``b`` of
  ``a``'s dtype: an array of ``a``'s shape, a scalar array or a number."""
  if not isinstance(b, jax.Array):
    b = jnp.asarray(b, a.dtype)
  if np.shape(b) != np.shape(a):
    b = broadcast_like(b, a)
  if np.shape(pred) != np.shape(a):
    pred = broadcast_like(pred, a)
  return lax.select(pred, a, b)


def broadcast_like(x: jax.Array, a: jax.Array) -> jax.Array:
  """Scalar ``x`` broadcast to ``a``'s shape, sharded as ``a`` is on a mesh
  with explicit axes (where `lax.select` refuses operands sharded apart)."""
  return lax.broadcast_in_dim(x, np.shape(a), (),
                              out_sharding=_internals.explicit_sharding(jax.typeof(a)))


def add_rounded(p: Any, u: Any) -> jax.Array:
  """``p + u`` in the wider of the two dtypes, rounded once to ``p``'s dtype:
  what ``optax.apply_updates`` computes under standard promotion, whatever
  the promotion mode."""
  if (not (isinstance(p, jax.Array) and isinstance(u, jax.Array)) or p.weak_type
      or u.weak_type or p.dtype == np.bool_):
    # Python numbers, NumPy arrays, weak types, booleans (``lax.add`` has no
    # boolean form; JAX's ``+`` is a logical or): JAX's own promotion.
    with jax.numpy_dtype_promotion("standard"):
      return jnp.asarray(p + u).astype(jnp.asarray(p).dtype)
  wide = _promoted(np.dtype(p.dtype), np.dtype(u.dtype))
  return cast(lax.add(cast(p, wide), cast(u, wide)), p.dtype)


@functools.lru_cache(maxsize=None)
def _promoted(a: np.dtype, b: np.dtype) -> np.dtype:
  """JAX's standard promotion of two dtypes, whatever the configured mode."""
  with jax.numpy_dtype_promotion("standard"):
    return np.dtype(jnp.promote_types(a, b))
