"""fp8 arithmetic: quantisation, its reciprocals and the delayed scales.

Everything here is float32 arithmetic that gives the same bits on every XLA
backend (`jmp_lite._exact`): the quantisation factor is the correctly
rounded reciprocal of the scale, multiplication is IEEE everywhere, and the
scales a history asks for come from correctly rounded divisions. Public
through `jmp_lite.fp8`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _exact
from jmp_lite import _struct

# fp8 recipes: the formats of a matmul's operands and of its gradient
# (`jmp_lite.policy.FP8_RECIPES`).
RECIPES = {"hybrid": ("e4m3", "e5m2"), "e4m3": ("e4m3", "e4m3")}
# The formats of the "hybrid" recipe: e4m3 (more precision) for forward
# values, e5m2 (more range) for gradients.
FORMATS = {"e4m3": np.dtype(jnp.float8_e4m3fn), "e5m2": np.dtype(jnp.float8_e5m2)}
_ALGORITHMS = ("max", "most_recent")


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
  # The barrier makes the factors a value of their own: without it XLA
  # compiled a plain function's fp8 inference forward 1 ulp away from its
  # training forward (tests/test_fp8_inference.py), which must be bitwise.
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


def _has_answer(amax: jax.Array) -> jax.Array:
  """``amax > 0`` and finite, a subnormal amax included: read from the bits,
  since XLA:CPU compares a subnormal as 0 in some computations and not in
  others (eager and jitted updates gave different scales for 1e-40)."""
  return (jax.lax.bitcast_convert_type(amax, jnp.int32) > 0) & jnp.isfinite(amax)


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
  factor = jnp.where(_has_answer(amax), factor, 1.0)
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
  scaled = jnp.where(jnp.isfinite(x32), jnp.clip(scaled, -top, top), scaled)
  # Rounded explicitly before the convert: XLA:GPU removes a convert round
  # trip (f32 -> fp8 -> f32) wherever the fp8 value is read back in float32
  # (`dequantize`, an fp8 product it computes in a wider type), and on an
  # H200 `qdq` then returned its input unquantised. The convert of a value
  # already in the format is exact, so eliding it changes nothing.
  return _exact.round_to(scaled, dtype).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
  """``q * scale`` computed in float32 and rounded once to ``dtype``."""
  scale = jnp.clip(jnp.asarray(scale, jnp.float32), 1 / _LIMIT, _LIMIT)
  return (q.astype(jnp.float32) * scale).astype(dtype)


def qdq(x: jax.Array, dtype: Any, scale: jax.Array) -> jax.Array:
  """``x`` quantised to ``dtype`` and read back, in ``x``'s dtype."""
  return dequantize(quantize(x, dtype, scale), scale, x.dtype)


def _max_bits(history: jax.Array) -> jax.Array:
  """The largest entry of each history (last axis), read from the bits.

  Entries are maxima of absolute values (>= 0, and +inf at most), whose
  float32 order is their bit patterns' integer order. A float ``max``
  reduction flushes a subnormal to 0 on XLA:CPU, so a history of 1e-40
  gave the scale it keeps for "nothing seen" while a length-1 history
  (no reduction) gave 2**-126.
  """
  bits = jax.lax.bitcast_convert_type(history.astype(jnp.float32), jnp.int32)
  return jax.lax.bitcast_convert_type(jnp.max(bits, axis=-1), jnp.float32)


def _next_scales(metas: list) -> list:
  """`DelayedScaling.next_scale` of each of ``metas``, in one computation.

  The exact divisions are integer arithmetic of a few dozen operations:
  done once on the concatenated amaxes of every tensor of a step, not once
  per tensor, so that their cost in the compiled program does not grow with
  the number of fp8 matmuls.
  """
  chosen = [(_max_bits(m.amax_history) if m.algorithm == "max"
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
  out = jnp.where(_has_answer(amax), new, scale)
  return _split_like(out, chosen)


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
  """One tensor's fp8 metadata: its amax history and its scale.

  Args:
    amax_history: float32 ``[history_length]``, most recent first (then the
      older ones from the end backwards, as Flax and TE roll it).
    scale: float32 scalar, the dequantisation scale.
    dtype: the fp8 format (static).
    margin: the new scale leaves ``2 ** margin`` of headroom (static).
    algorithm: ``"max"`` (the history's maximum, the field's default) or
      ``"most_recent"`` (static).

  Example:
    >>> import jax.numpy as jnp
    >>> import jmp_lite.fp8 as fp8
    >>> meta = fp8.DelayedScaling.create("e4m3", history_length=4)
    >>> y, meta = meta.qdq(jnp.array([1.0, -896.0]))  # scale 1: saturates at 448
    >>> y.tolist(), meta.amax_history.tolist()
    ([1.0, -448.0], [896.0, 0.0, 0.0, 0.0])
    >>> y, meta = meta.qdq(jnp.array([1.0, -896.0]))  # scale from history: 896 / 448
    >>> y.tolist(), float(meta.scale)
    ([1.0, -896.0], 2.0)
  """

  amax_history: jax.Array
  scale: jax.Array
  dtype: np.dtype = _struct.static_field(default=FORMATS["e4m3"])
  margin: int = _struct.static_field(default=0)
  algorithm: str = _struct.static_field(default="max")

  @classmethod
  def create(cls, dtype: Any = "e4m3", *, history_length: int = 1024,
             margin: int = 0, algorithm: str = "max") -> "DelayedScaling":
    """Fresh metadata: an all-zero history and a scale of 1.

    Raises:
      ValueError: for an unknown format or algorithm, a history length < 1,
        or a negative margin.
    """
    history_length = _count(history_length, "history_length", 1)
    margin = _count(margin, "margin", 0)
    if algorithm not in _ALGORITHMS:
      raise ValueError(f"algorithm must be one of {_ALGORITHMS}, got {algorithm!r}")
    return cls(amax_history=jnp.zeros((history_length,), jnp.float32),
               scale=jnp.ones((), jnp.float32), dtype=_format(dtype),
               margin=margin, algorithm=algorithm)

  def next_scale(self) -> jax.Array:
    """The scale the history asks for; the current one where it has no answer.

    ``1 / ((max / amax) / 2**margin)``, kept as it is while the chosen amax
    is zero (nothing seen yet) or not finite (Flax's ``compute_scale``, TE's
    ``update_fp8_metas``). Both divisions are correctly rounded on every
    backend (TE divides with ``__fdiv_rn`` for the same reason), and the
    factor is clamped to ``[2**-126, 2**126]``: an amax of 1e-36 gives a
    factor float32 cannot hold, where Flax's scale becomes 0 and every
    quantised value NaN.
    """
    return _next_scales([self])[0]

  def qdq(self, x: jax.Array, compute_dtype: Any = None) -> tuple[jax.Array, "DelayedScaling"]:
    """``x`` quantised with the delayed scale and read back, and the new state.

    The scale comes from the history of earlier steps; this step's amax
    joins the history for the next ones (a non-finite one as 0, as `update`
    records it: Flax's ``quantize_dequantize_update`` records it and keeps
    its scale while it stays in the history). ``compute_dtype`` is accepted for
    Flax's signature: quantisation is float32 arithmetic (`quantize`).
    """
    scale = self.next_scale()
    _check_compute_dtype(compute_dtype)
    y = qdq(x, self.dtype, scale)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    amax = jnp.where(jnp.isfinite(amax), amax, 0.0)  # as `update` records it
    return y, _struct.replace_fields(self, amax_history=_roll_in(self.amax_history, amax),
                                     scale=scale)

  def update(self, amax: jax.Array) -> "DelayedScaling":
    """``amax`` (this step's absolute maximum) recorded, and the next scale.

    The scale the next step quantises with is `next_scale` of the history
    that includes ``amax``: the scale `qdq` would use on the next step.
    A non-finite ``amax`` (an overflowing step's gradient) is recorded as 0,
    "nothing seen": under the ``"max"`` algorithm Flax and Transformer
    Engine keep an inf for ``history_length`` steps and freeze the scale that
    long.
    """
    return _update_all([self], [amax])[0]


def _count(value, name: str, least: int) -> int:
  """``value`` as a Python int (NumPy integers too), at least ``least``."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
      or value < least:
    raise ValueError(f"{name} must be an int >= {least}, got {value!r} "
                     f"({type(value).__name__})")
  return int(value)


def _update_all(metas: list, amaxes: list) -> list:
  """`DelayedScaling.update` of each meta with its amax, the scales together."""
  rolled = []
  for meta, amax in zip(metas, amaxes):
    amax = jnp.asarray(amax, jnp.float32)
    amax = jnp.where(jnp.isfinite(amax), amax, 0.0)
    rolled.append(_struct.replace_fields(
        meta, amax_history=_roll_in(meta.amax_history, amax)))
  return [_struct.replace_fields(m, scale=s) for m, s in zip(rolled, _next_scales(rolled))]


def _roll_in(history: jax.Array, amax: jax.Array) -> jax.Array:
  """Flax's ``compute_amax_history`` along the last axis (leading axes: layers)."""
  return jnp.roll(history, -1, axis=-1).at[..., 0].set(amax)


_struct.register_state(DelayedScaling)
