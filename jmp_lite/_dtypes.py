"""Dtype predicates shared by policies, loss scales and the optimizer guard."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DTypeLike = Any


def is_floating(x: Any) -> bool:
  """Whether ``x`` is an array (NumPy, JAX or a tracer) with a floating dtype."""
  return hasattr(x, "dtype") and bool(jnp.issubdtype(x.dtype, jnp.floating))


def is_inexact(x: Any) -> bool:
  """Whether ``x`` is an array with a floating or complex dtype.

  What finiteness checks and loss-scale arithmetic cover; `is_floating` (real
  only) is what policies cast.
  """
  return hasattr(x, "dtype") and bool(jnp.issubdtype(x.dtype, jnp.inexact))


def wide_dtype(dtype: DTypeLike) -> np.dtype:
  """float32, or float64 for float64: where scaling and update arithmetic happens.

  Complex dtypes widen to complex64 (complex128 for complex128), so that no
  arithmetic drops an imaginary part. NumPy float64 without x64 counts as
  float32, what ``jnp.asarray`` makes of it (asking for float64 explicitly
  there warns).
  """
  canonical = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
  if jnp.issubdtype(canonical, jnp.complexfloating):
    return np.dtype(np.complex128 if canonical == np.complex128 else np.complex64)
  return np.dtype(np.float64 if canonical == np.float64 else np.float32)


def is_low_bit_float(dtype: DTypeLike) -> bool:
  """Whether ``dtype`` is a floating format of 8 bits or fewer (fp8, fp4...)."""
  dt = np.dtype(dtype)
  return bool(jnp.issubdtype(dt, jnp.floating)) and jnp.finfo(dt).bits <= 8


def is_narrow_float(dtype: DTypeLike) -> bool:
  """Whether ``dtype`` is a 16-bit or narrower float (bf16, f16, fp8...):
  what the engine makes accumulate in float32."""
  dtype = np.dtype(dtype)
  return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize <= 2
