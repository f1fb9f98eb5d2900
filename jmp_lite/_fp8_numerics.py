"""fp8 arithmetic: quantisation, its reciprocals and the delayed scales.

Everything here is float32 arithmetic that gives the same bits on every XLA
backend (`jmp_lite._exact`): the quantisation factor is the correctly
rounded reciprocal of the scale, multiplication is IEEE everywhere, and the
scales a history asks for come from correctly rounded divisions. Public
through `jmp_lite.fp8`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _exact

# The formats of the "hybrid" recipe: e4m3 (more precision) for forward
# values, e5m2 (more range) for gradients.
FORMATS = {"e4m3": np.dtype(jnp.float8_e4m3fn), "e5m2": np.dtype(jnp.float8_e5m2)}


def _format(dtype: Any) -> np.dtype:
  if isinstance(dtype, str) and dtype in FORMATS:
    return FORMATS[dtype]
  try:
    dt = np.dtype(dtype)
  except TypeError as e:
    kind = ValueError if isinstance(dtype, str) else TypeError
    raise kind(f"not an fp8 format: {dtype!r}; use one of {sorted(FORMATS)}") from e
  if dt not in FORMATS.values():
    raise ValueError(f"not an fp8 format: {dtype!r}; use one of {sorted(FORMATS)} "
                     f"({', '.join(d.name for d in FORMATS.values())})")
  return dt


# A scale (and so its reciprocal) stays a normal float32: a scale of 0 or inf
# would turn every value into NaN, and a subnormal one is flushed to 0 by
# XLA on CPUs and GPUs. Transformer Engine clamps an infinite quantisation
# factor to float32's largest value (compute_scale_from_amax,
# transformer_engine/common/recipe/recipe_common.cuh at 01c24fe), whose
# reciprocal is subnormal; 2**126 keeps both normal.
_LIMIT = np.float32(2.0 ** 126)


def _check_compute_dtype(compute_dtype: Any) -> None:
  if compute_dtype is not None and not jnp.issubdtype(np.dtype(compute_dtype), jnp.floating):
    raise TypeError(f"compute_dtype must be a floating dtype, got {compute_dtype!r}")


def reciprocal(scale: jax.Array) -> jax.Array:
  """``1 / scale`` in float32, correctly rounded on every backend.

  ``scale`` is clamped to ``[2**-126, 2**126]`` first, so the factor a
  tensor is multiplied by to quantise it is always finite and normal.
  """
  scale = jnp.clip(jnp.asarray(scale, jnp.float32), 1 / _LIMIT, _LIMIT)
  # The barrier keeps XLA from copying the division's few hundred scalar
  # operations into every fusion that reads the factor.
  return jax.lax.optimization_barrier(_exact.divide(jnp.ones_like(scale), scale))


def site_carrier(scales: list) -> jax.Array:
  """The flat ``[scales, reciprocals]`` rows of a step's fp8 matmuls.

  ``scales``: each site's float32 ``[..., 3]`` (`MatmulMeta.scales`). Every
  site's row becomes ``[..., 6]``: the three scales, clamped as `reciprocal`
  clamps them, then their reciprocals, all computed in one division.
  """
  flat = jnp.concatenate([jnp.asarray(s, jnp.float32).ravel() for s in scales])
  flat = jnp.clip(flat, 1 / _LIMIT, _LIMIT)
  factors = reciprocal(flat)
  rows = [jnp.concatenate([a, b], axis=-1) for a, b in zip(
      _split_like(flat, scales), _split_like(factors, scales))]
  return jnp.concatenate([r.ravel() for r in rows])


def current_scaling(amax: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
  """``(factor, scale)`` of Transformer Engine's current scaling for ``amax``.

  ``factor = max / amax`` (correctly rounded: TE divides with ``__fdiv_rn``),
  1 where ``amax`` is 0 or not finite, clamped to ``[2**-126, 2**126]``
  (TE replaces an infinite factor by the input type's largest value; see
  ``_LIMIT``), and ``scale = 1 / factor``, the dequantisation scale
  (compute_scale_from_amax, transformer_engine/common/recipe/
  recipe_common.cuh at 01c24fe; ``Float8CurrentScaling`` has no margin).
  """
  amax = jnp.asarray(amax, jnp.float32)
  top = jnp.full_like(amax, jnp.finfo(_format(dtype)).max)
  factor = jnp.clip(_exact.divide(top, amax), 1 / _LIMIT, _LIMIT)
  factor = jnp.where((amax > 0.0) & jnp.isfinite(amax), factor, 1.0)
  return factor, _exact.divide(jnp.ones_like(factor), factor)


def _split_like(flat: jax.Array, parts: list) -> list:
  sizes = np.cumsum([int(np.prod(np.shape(p))) for p in parts])[:-1]
  return [a.reshape(np.shape(p)) for a, p in zip(jnp.split(flat, sizes), parts)]


def quantize(x: jax.Array, dtype: Any, scale: jax.Array,
             compute_dtype: Any = None) -> jax.Array:
  """``x / scale``, saturated to the format's range, in fp8 ``dtype``.

  Computed in float32 whatever ``x``'s dtype, with one rounding onto the
  format: ``x`` read exactly, times the correctly rounded `reciprocal` of
  ``scale`` (Transformer Engine's arithmetic: it multiplies by its
  ``scale``, our ``1 / scale``), then clipped and converted. So bfloat16,
  float16 and float32 inputs holding the same values quantise to the same
  fp8 values, and a float16 input cannot overflow on the way (Flax's
  ``fp8_ops.quantize`` divides in the compute dtype, where ``1 / scale``
  overflows float16 once the scale is below ``1 / 65504``). Both
  multiplication and the reciprocal are exact IEEE operations on every XLA
  backend, so a GPU quantises to the bits the CPU emulation does.

  Non-finite values stay non-finite, so that an overflow upstream still
  reaches the finiteness check.

  Args:
    x: the values.
    dtype: an fp8 format (``"e4m3"``, ``"e5m2"`` or the dtype).
    scale: the dequantisation scale (float32; a scalar, or one per leading
      row of ``x``'s broadcast). Clamped to ``[2**-126, 2**126]``.
    compute_dtype: accepted for Flax's signature; the arithmetic is float32
      for every compute dtype.
  """
  dtype = _format(dtype)
  _check_compute_dtype(compute_dtype)
  return quantize_by(x, dtype, reciprocal(scale))


def quantize_by(x: jax.Array, dtype: Any, factor: jax.Array) -> jax.Array:
  """`quantize` with the factor ``1 / scale`` given (`reciprocal` of the scale).

  For callers that quantise several tensors with scales known together: one
  `reciprocal` of all of them costs what one of a scalar does.
  """
  dtype = _format(dtype)
  x32 = _exact.widen(jnp.asarray(x)).astype(jnp.float32)
  scaled = x32 * factor
  top = np.float32(jnp.finfo(dtype).max)
  # Finite values saturate; inf and NaN stay non-finite (inf, or NaN in
  # e4m3fn, which has no inf). Flax's fp8_ops clips them too, which turns an
  # overflowed (scaled) gradient into a finite one: the finiteness check
  # then passes, the step applies garbage and the loss scale never backs off.
  return jnp.where(jnp.isfinite(x32), jnp.clip(scaled, -top, top), scaled).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
  """``q * scale`` computed in float32 and rounded once to ``dtype``."""
  scale = jnp.clip(jnp.asarray(scale, jnp.float32), 1 / _LIMIT, _LIMIT)
  return (q.astype(jnp.float32) * scale).astype(dtype)


def qdq(x: jax.Array, dtype: Any, scale: jax.Array) -> jax.Array:
  """``x`` quantised to ``dtype`` and read back, in ``x``'s dtype."""
  return dequantize(quantize(x, dtype, scale), scale, x.dtype)


def _next_scales(metas: list) -> list:
  """`DelayedScaling.next_scale` of each of ``metas``, in one computation.

  The exact divisions are integer arithmetic of a few dozen operations:
  done once on the concatenated amaxes of every tensor of a step, not once
  per tensor, so that their cost in the compiled program does not grow with
  the number of fp8 matmuls.
  """
  chosen = [(jnp.max(m.amax_history, axis=-1) if m.algorithm == "max"
             else m.amax_history[..., 0]) for m in metas]
  amax = jnp.concatenate([a.ravel() for a in chosen])
  scale = jnp.concatenate([m.scale.astype(jnp.float32).ravel() for m in metas])
  top = np.concatenate([np.full(a.size, jnp.finfo(m.dtype).max, np.float32)
                        for m, a in zip(metas, chosen)])
  headroom = np.concatenate([np.full(a.size, 2.0 ** -m.margin, np.float32)
                             for m, a in zip(metas, chosen)])
  sf = jnp.clip(_exact.divide(jnp.asarray(top), amax) * headroom, 1 / _LIMIT, _LIMIT)
  new = _exact.divide(jnp.ones_like(sf), sf)
  # Kept as it is where the history has no answer: Flax computes 1 / (1 / s)
  # there, which is s for every scale a power-of-two loss-scale change or
  # the formula above can produce.
  out = jnp.where((amax > 0.0) & jnp.isfinite(amax), new, scale)
  return _split_like(out, chosen)
