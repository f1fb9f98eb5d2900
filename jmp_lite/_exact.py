"""Arithmetic whose result is the same bits on every XLA backend.

Two defaults of XLA:GPU change numbers that the library's guarantees rest on:

* **Excess precision.** With ``--xla_allow_excess_precision=true`` (the
  default) XLA may keep a value that the program rounds to bfloat16 or
  float16 in float32: it removes ``convert`` round trips
  (``f32 -> f16 -> f32``) and computes narrow elementwise ops in float32. A
  finiteness check of ``(p + u).astype(float16)`` then sees the finite
  float32 sum, not the inf the parameter will hold; Kahan summation sees no
  rounding error to compensate. (openxla/xla ``SimplifyFPConversions``,
  xla/hlo/transforms/simplifiers/simplify_fp_conversions.cc at 3e1a45f9,
  folds any chain of float converts; gpu_compiler.cc runs it when the flag is
  set.) XLA keeps a ``reduce-precision`` of a float32 value to fewer bits: the
  algebraic simplifier (algebraic_simplifier.cc at 289dd9a1) removes one only
  where it is a no-op for its own element type, the barrier JAX's remat
  relies on too. So every rounding the library relies on is written as
  `round_to` on a float32 value, and every narrow value a check reads is read
  through `widen`.
* **Division.** XLA:GPU's float32 division is not correctly rounded: on an
  H100, ``1 / 3 / 3`` came out 0.11111112 where IEEE division gives
  0.11111111. `divide` computes the correctly rounded quotient with integer
  arithmetic instead, which every backend computes exactly.

`pow2` and `ldexp` build powers of two from their bits, because ``exp2`` is
approximate on some backends.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _elementwise
from jmp_lite._dtypes import wide_dtype

# Narrow formats with IEEE semantics (an exponent field of all ones is inf or
# NaN), where `reduce_precision` rounds as `convert` does.
_IEEE_NARROW = tuple(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float8_e5m2))
# Finite-only formats (no inf; the all-ones exponent holds finite values, and
# an overflow or an inf converts to NaN), rounded by `reduce_precision` with
# one more exponent bit than they have: the same mantissa, the same ties,
# a range that holds theirs; their own range is then applied (see `round_to`).
# The "fnuz" formats (no negative zero, another bias) are not among them.
_FINITE_NARROW = (np.dtype(jnp.float8_e4m3fn),)


def pow2(e: jax.Array, dtype) -> jax.Array:
  """Exactly ``2**e`` in ``dtype`` for ``e`` in its normal exponent range."""
  info = jnp.finfo(dtype)
  bits = info.nmant + 1  # mantissa bits, with the implicit one
  int_dtype = jnp.int64 if info.bits == 64 else jnp.int32
  biased = (jnp.asarray(e).astype(int_dtype) + (info.maxexp - 1)) << (bits - 1)
  return jax.lax.bitcast_convert_type(biased, dtype)


def ldexp(m: jax.Array, e: jax.Array, dtype) -> jax.Array:
  """``m * 2**e``, saturating to inf or 0 outside ``dtype``'s range.

  Two multiplications by normal powers of two, so that no factor is
  subnormal (XLA flushes subnormals to zero on CPUs and GPUs).
  """
  info = jnp.finfo(dtype)
  e1 = jnp.clip(e, info.minexp, info.maxexp - 1)
  e2 = jnp.clip(e - e1, info.minexp, info.maxexp - 1)
  return jnp.asarray(m).astype(dtype) * pow2(e1, dtype) * pow2(e2, dtype)


def normal_pair(mantissa: jax.Array, exponent: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """Two normal numbers of real ``dtype`` whose product is ``mantissa * 2**exponent``.

  ``2**e1`` with ``e1`` clipped to the normal exponents, and the rest,
  ``mantissa * 2**(exponent - e1)``, normal too unless the product lies
  beyond ``2**(+-2 * maxexp)``. Multiply by the first, then the second: with
  ``mantissa`` at most 1, ``x * 2**e1`` is at least the result, so a normal
  result is never flushed on the way.
  """
  info = jnp.finfo(dtype)
  e1 = jnp.clip(exponent, info.minexp, info.maxexp - 1)
  e2 = jnp.clip(exponent - e1, info.minexp, info.maxexp - 1)
  return pow2(e1, dtype), jnp.asarray(mantissa).astype(dtype) * pow2(e2, dtype)


def reciprocal_factor(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(m, e)`` with ``1 / x = m * 2**e`` and ``m`` in (0.5, 1], for a positive
  normal ``x``: `normal_pair` of them unscales by ``x`` without a subnormal
  factor (``1 / x`` is subnormal for ``x`` above ``2**126`` in float32).

  ``m`` is exact for a power of two. (Not `divide`: XLA copies its scalar
  ops into every fusion that reads the factor, which costs compile time.)
  """
  ms, es = frexp(x)
  return 0.5 / ms, 1 - es


def frexp(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(m, e)`` with ``x = m * 2**e``, ``|m|`` in [0.5, 1); zeros, subnormals
  (which XLA flushes), infinities and NaN give ``(x, 0)`` (subnormals: ``0``).

  float32 from the bits, in a dozen scalar ops: ``jnp.frexp`` takes about
  forty, and XLA copies them into every fusion that reads the result.
  """
  x = jnp.asarray(x)
  if np.dtype(x.dtype) != np.float32:
    m, e = jnp.frexp(x)
    return m, e.astype(jnp.int32)
  bits = jax.lax.bitcast_convert_type(x, jnp.int32)
  field = (bits >> 23) & 0xFF
  normal = (field != 0) & (field != 0xFF)
  # Sign and mantissa kept, exponent field set to 126: a value in [0.5, 1).
  m = jax.lax.bitcast_convert_type((bits & ~0x7F800000) | 0x3F000000, jnp.float32)
  m = jnp.where(normal, m, jnp.where(field == 0, x * 0, x))
  return m, jnp.where(normal, field - 126, 0)


def _zero_or_subnormal(x: jax.Array) -> jax.Array:
  """float32 ``x`` is 0 or subnormal, from its bits (no float compare)."""
  magnitude = jax.lax.bitcast_convert_type(x, jnp.int32) & 0x7FFFFFFF
  return magnitude < 0x00800000


def divide(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a / b`` correctly rounded (to nearest, ties to even), on every backend.

  float32 results below the smallest normal are flushed to 0, as XLA flushes
  them on CPUs and GPUs anyway, and subnormal operands read as 0. Zeros, infinities and NaN divide as IEEE
  says. float64 divides as it is: XLA:GPU's
  float64 division is IEEE.

  The float32 quotient is the long division of the two 24-bit significands
  in int32: 25 quotient bits (24 and a rounding bit) and a sticky remainder.
  """
  a, b = jnp.asarray(a), jnp.asarray(b)
  dtype = jnp.result_type(a, b)
  if np.dtype(dtype) != np.float32:
    return a / b
  # One shape for every op below: the result's.
  a, b = jnp.broadcast_arrays(a.astype(jnp.float32), b.astype(jnp.float32))
  ma, ea = frexp(jnp.abs(a))
  mb, eb = frexp(jnp.abs(b))
  num = (ma * 2.0 ** 24).astype(jnp.int32)  # in [2**23, 2**24), exact
  den = (mb * 2.0 ** 24).astype(jnp.int32)
  den = jnp.where(den > 0, den, 1 << 23)  # special cases are replaced below
  # Normalise so that num / den is in [1, 2): 25 quotient bits, top one set.
  small = num < den
  num = jnp.where(small, num << 1, num)  # < 2**25
  # Restoring long division, one quotient bit at a time: 1 + 24 bits. Only
  # compares, subtractions and shifts, which XLA fuses into one kernel with
  # whatever reads the result. Integer division and remainder are
  # "expensive" ops that XLA will not duplicate into their readers: written
  # with four int32 divisions and a remainder, one division compiled to seven
  # kernels, and on a CPU each distinct kernel costs ~20 ms of compile time.
  # The remainder stays below den < 2**24, so `rem << 1` fits in 25 bits.
  quot, rem = jnp.zeros_like(num), num
  for _ in range(25):
    bit = rem >= den
    quot = (quot << 1) | bit.astype(jnp.int32)
    rem = jnp.where(bit, rem - den, rem) << 1
  mant, round_bit = quot >> 1, quot & 1
  sticky = rem != 0
  up = (round_bit == 1) & (sticky | ((mant & 1) == 1))  # ties to even
  mant = mant + up.astype(jnp.int32)
  # mant <= 2**24 is exact in float32; value = mant * 2**(ea - eb - small - 23).
  exp = ea - eb - small.astype(jnp.int32) - 23
  out = ldexp(mant.astype(jnp.float32), exp, jnp.float32)
  out = jnp.where(out < jnp.finfo(jnp.float32).tiny, 0.0, out)
  negative = jnp.signbit(a) != jnp.signbit(b)
  # IEEE's special cases, spelled out so that no float division is left. A
  # subnormal operand counts as 0, read from the bits: `frexp` gives it no
  # significand, and whether ``b == 0`` holds for one depends on the
  # backend (XLA:CPU flushes it in the compare, XLA:GPU does not): on an
  # H200, 448 / 1e-40 came out as 896, the long division of 448 by 0.
  za, zb = _zero_or_subnormal(a), _zero_or_subnormal(b)
  nan = jnp.isnan(a) | jnp.isnan(b) | (jnp.isinf(a) & jnp.isinf(b)) | (za & zb)
  inf = (jnp.isinf(a) | zb) & ~nan
  zero = (za | jnp.isinf(b)) & ~nan
  out = jnp.where(zero, 0.0, jnp.where(inf, jnp.inf, out))
  out = jnp.where(negative, -out, out)
  return jnp.where(nan, jnp.nan, out)


def round_to(x: jax.Array, dtype) -> jax.Array:
  """float32 ``x`` rounded to the nearest value of ``dtype``, kept in float32.

  What ``x.astype(dtype).astype(float32)`` means (ties to even, overflow to
  inf, NaN kept, the format's subnormals), in a form XLA must keep (see the
  module docstring). ``reduce_precision`` flushes values in the narrow
  format's subnormal range to zero, so there a multiple of the subnormal
  quantum is rounded instead (exact: scaling by powers of two). bfloat16's
  subnormals are float32's, which XLA flushes anyway.

  ``float8_e4m3fn`` has no infinities: it is rounded with one more exponent
  bit (the same mantissa and ties, a wider range), then what its convert
  makes NaN (a rounded magnitude above its maximum of 448, inf, NaN) is NaN.
  Other formats without IEEE infinities ("fnuz") round through ``astype``,
  which XLA may elide.
  """
  dtype = np.dtype(dtype)
  x = jnp.asarray(x)
  finite_only = dtype in _FINITE_NARROW
  if dtype not in _IEEE_NARROW and not finite_only:
    return x.astype(dtype).astype(x.dtype)
  info = jnp.finfo(dtype)
  out = jax.lax.reduce_precision(x, exponent_bits=info.nexp + finite_only,
                                 mantissa_bits=info.nmant)
  tiny32 = float(jnp.finfo(jnp.float32).tiny)
  quantum = float(info.smallest_subnormal)
  if quantum >= tiny32:  # not bfloat16
    e = int(np.log2(quantum))  # a power of two: multiples of it below `tiny` round exactly
    sub = jnp.round(x * pow2(-e, x.dtype)) * pow2(e, x.dtype)  # jnp.round: ties to even
    out = jnp.where(jnp.abs(x) < float(info.smallest_normal), sub, out)
  if finite_only:
    out = jnp.where(jnp.abs(out) <= float(info.max), out, jnp.nan)
  return out


def widen(x: jax.Array) -> jax.Array:
  """``x`` in its wide dtype, holding exactly the values ``x`` holds.

  For a bfloat16, float16, float8_e5m2 or float8_e4m3fn ``x``, the values are rounded to
  ``x``'s format again in float32: a no-op on the values, but it forces the
  rounding where XLA kept a narrow value in float32 (see the module
  docstring). Any other dtype is cast as it is.

  XLA's own use of the same barrier: JAX marks remat'd values with
  ``reduce_precision`` so that ``SimplifyFPConversions`` cannot elide their
  rounding (jax-ml/jax#22244).
  """
  x = x if isinstance(x, jax.Array) else jnp.asarray(x)
  wide = wide_dtype(x.dtype)
  if np.dtype(x.dtype) not in _IEEE_NARROW + _FINITE_NARROW:
    return _elementwise.cast(x, wide)
  return _elementwise.cast(round_to(_elementwise.cast(x, jnp.float32), x.dtype), wide)


def times_zero(x: jax.Array) -> jax.Array:
  """``x * 0``, real: 0 where ``x`` is finite, NaN where it is inf or NaN.

  For complex ``x`` both parts count (NaN survives ``real + imag``). Summed,
  it is NaN exactly when a value is not finite, however large the finite
  values are (a plain sum can overflow). Read through `widen`.
  """
  z = widen(x) * 0
  return jnp.real(z) + jnp.imag(z) if jnp.iscomplexobj(z) else z
