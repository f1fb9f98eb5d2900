"""fp8 quantisation with delayed scaling: per-tensor metadata as a typed pytree.

A tensor is quantised to an fp8 format as ``q = clip(x / scale, ±max)`` cast
to the format, and read back as ``q * scale`` (Flax's ``fp8_ops`` and
Transformer Engine use the same convention, with TE's ``scale`` being our
``1 / scale``). *Delayed* scaling chooses ``scale`` from a history of the
tensor's absolute maxima in earlier steps, so the quantisation does not wait
for this step's maximum: `DelayedScaling.qdq` computes the new scale from the
history, quantises with it, and records this step's maximum, in one pass.

This module is the first part of fp8 training (issue 18): the quantisation
and the per-tensor state. It is checked bitwise against Flax's own
``flax.linen.fp8_ops`` (``tests/test_fp8.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _struct

__all__ = ("DelayedScaling", "FORMATS", "quantize", "dequantize")

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


def quantize(x: jax.Array, dtype: Any, scale: jax.Array,
             compute_dtype: Any = None) -> jax.Array:
  """``x / scale``, saturated to the format's range, in fp8 ``dtype``.

  Args:
    x: the values.
    dtype: an fp8 format (``"e4m3"``, ``"e5m2"`` or the dtype).
    scale: the dequantisation scale (a scalar).
    compute_dtype: the dtype of the division and clipping (default ``x``'s).
  """
  dtype = _format(dtype)
  compute_dtype = x.dtype if compute_dtype is None else np.dtype(compute_dtype)
  top = jnp.asarray(jnp.finfo(dtype).max, compute_dtype)
  scaled = x.astype(compute_dtype) / scale.astype(compute_dtype)
  return jnp.clip(scaled, -top, top).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
  """``q * scale`` in ``dtype``."""
  return q.astype(dtype) * scale.astype(dtype)


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
    if isinstance(history_length, bool) or not isinstance(history_length, int) \
        or history_length < 1:
      raise ValueError(f"history_length must be an int >= 1, got {history_length!r}")
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
      raise ValueError(f"margin must be an int >= 0, got {margin!r}")
    if algorithm not in _ALGORITHMS:
      raise ValueError(f"algorithm must be one of {_ALGORITHMS}, got {algorithm!r}")
    return cls(amax_history=jnp.zeros((history_length,), jnp.float32),
               scale=jnp.ones((), jnp.float32), dtype=_format(dtype),
               margin=margin, algorithm=algorithm)

  def next_scale(self) -> jax.Array:
    """The scale the history asks for; the current one where it has no answer.

    ``max / amax / 2**margin`` inverted, kept as it is while the chosen amax
    is zero (nothing seen yet) or not finite (Flax's ``compute_scale``, TE's
    ``update_fp8_metas``).
    """
    amax = (jnp.max(self.amax_history) if self.algorithm == "max"
            else self.amax_history[0])
    top = jnp.float32(jnp.finfo(self.dtype).max)
    inverse = 1.0 / self.scale
    sf = (top / amax) / (2.0 ** self.margin)
    sf = jnp.where(amax > 0.0, sf, inverse)
    sf = jnp.where(jnp.isfinite(amax), sf, inverse)
    return 1.0 / sf

  def qdq(self, x: jax.Array, compute_dtype: Any = None) -> tuple[jax.Array, "DelayedScaling"]:
    """``x`` quantised with the delayed scale and read back, and the new state.

    The scale comes from the history of earlier steps; this step's amax
    joins the history for the next ones.
    """
    scale = self.next_scale()
    y = dequantize(quantize(x, self.dtype, scale, compute_dtype), scale, x.dtype)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    history = jnp.roll(self.amax_history, -1).at[0].set(amax)
    return y, _struct.replace_fields(self, amax_history=history, scale=scale)


_struct.register_state(DelayedScaling)
