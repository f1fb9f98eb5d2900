"""A dynamic loss scale that also grows when half-precision cotangents underflow.

Every dynamic loss scaler in the field reacts only to overflow: it grows
blindly every ``period`` steps and backs off when gradients overflow,
although scaling exists to fight *underflow*. `UnderflowAwareLossScale` is a
`jmp_lite.DynamicLossScale` whose ``adjust`` also takes what precision
telemetry measured in the same step (`jmp_lite.Telemetry`): the fraction of
the non-zero cotangents held in a 16-bit (or narrower) float that were
subnormal or flushed to zero, and the headroom left (the dtype's maximum
over the largest such cotangent). On a finite step where that fraction is
above ``underflow_threshold`` and the headroom exceeds ``factor * margin``,
it grows at once instead of waiting for ``period``: it grows where growing
is both needed and safe. Overflow backs off as before.

`jmp_lite.TrainState.minimize` passes both measures when given a
``telemetry``; hand-written steps pass ``info.precision``'s
``cotangent_underflow`` and ``cotangent_headroom`` to ``adjust``. On steps
telemetry does not sample they are 0 and infinity: no underflow growth.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _struct
from jmp_lite import loss_scale as ls_lib

__all__ = ("UnderflowAwareLossScale",)


@dataclasses.dataclass(frozen=True)
class UnderflowAwareLossScale(ls_lib.DynamicLossScale):
  """`jmp_lite.DynamicLossScale` that also grows on measured underflow.

  The fields of `jmp_lite.DynamicLossScale` (``loss_scale``, ``counter``,
  ``period``, ``factor``, ``min_loss_scale``, ``max_loss_scale``,
  ``hysteresis``, ``hysteresis_left``, ``consecutive_hysteresis``) mean the
  same here.

  Args:
    underflow_threshold: the fraction of non-zero half-precision cotangents
      below the smallest normal above which a finite step grows the scale
      (in ``[0, 1)``; default 0.01).
    margin: headroom factor kept after growing (>= 1; default 8, as
      `jmp_lite.calibrate`): growth by ``factor`` needs the largest
      cotangent below the dtype's maximum over ``factor * margin``.
    underflow_period: finite steps since the last change (growth or
      back-off) before underflow may grow the scale (>= 1; default 50).
      Cotangents vary from batch to batch by more than ``margin``: without
      it, a scale grown up to the margin overflows again within steps.

  Example:
    >>> import jax.numpy as jnp
    >>> import jmp_lite
    >>> ls = jmp_lite.UnderflowAwareLossScale(jnp.float32(256), period=2000,
    ...                                       underflow_period=1)
    >>> # 30% of the cotangents underflowed, the largest is 1/1000 of the range:
    >>> float(ls.adjust(jnp.bool_(True), underflow=0.3, headroom=1000.0).loss_scale)
    512.0
    >>> # ... but only 8x headroom is left: growing would risk an overflow.
    >>> float(ls.adjust(jnp.bool_(True), underflow=0.3, headroom=8.0).loss_scale)
    256.0
  """

  underflow_threshold: jax.Array = dataclasses.field(default=0.01, kw_only=True)
  margin: jax.Array = dataclasses.field(default=8.0, kw_only=True)
  underflow_period: jax.Array = dataclasses.field(default=50, kw_only=True)

  def __post_init__(self):
    super().__post_init__()
    name = "UnderflowAwareLossScale"
    threshold, t = _struct.as_scalar(self.underflow_threshold, jnp.float32,
                                     "underflow_threshold")
    if t is not None and not 0 <= t < 1:
      raise ValueError(f"{name}.underflow_threshold must be in [0, 1), got "
                       f"{self.underflow_threshold!r}")
    margin, m = _struct.as_scalar(self.margin, jnp.float32, "margin")
    if m is not None and not (np.isfinite(m) and m >= 1):
      raise ValueError(f"{name}.margin must be finite and >= 1, got {self.margin!r}")
    period, p = _struct.as_scalar(self.underflow_period, jnp.int32, "underflow_period")
    if p is not None and p < 1:
      raise ValueError(f"{name}.underflow_period must be >= 1, got "
                       f"{self.underflow_period!r}")
    object.__setattr__(self, "underflow_threshold", threshold)
    object.__setattr__(self, "margin", margin)
    object.__setattr__(self, "underflow_period", period)

  def adjust(self, grads_finite: jax.Array, underflow: Optional[jax.Array] = None,
             headroom: Optional[jax.Array] = None) -> "UnderflowAwareLossScale":
    """The next state: `DynamicLossScale.adjust`, plus growth on underflow.

    Args:
      grads_finite: whether this step's gradients were finite.
      underflow: the measured fraction of non-zero half-precision cotangents
        below the smallest normal (None: not measured, no such growth).
      headroom: the dtype's maximum over the largest of them (None: not
        measured, no such growth).
    """
    for name, value in (("underflow", underflow), ("headroom", headroom)):
      if value is not None and np.ndim(value) != 0:
        # A vector would broadcast the scale into a vector too.
        raise ValueError(
            f"UnderflowAwareLossScale.adjust: {name} must be a scalar (one "
            f"measure for the step), got shape {np.shape(value)}; reduce it "
            "first (max for underflow and the largest cotangent).")
    new = super().adjust(grads_finite)
    if underflow is None or headroom is None:
      return new
    finite = jnp.asarray(grads_finite, jnp.bool_)
    scale = new.loss_scale
    grown = jnp.minimum(scale * self.factor, self.max_loss_scale)
    # The step already grew (period reached): growing twice would use up
    # the headroom that was measured at the old scale.
    grew = new.loss_scale > self.loss_scale
    boost = (finite & ~grew & (self.counter >= self.underflow_period - 1)
             & (jnp.asarray(underflow, jnp.float32) > self.underflow_threshold)
             & (jnp.asarray(headroom, jnp.float32) >= self.factor * self.margin))
    # A growth, like the period's, refills the overflows hysteresis forgives.
    return _struct.replace_fields(
        new, loss_scale=jnp.where(boost, grown, scale),
        counter=jnp.where(boost, 0, new.counter),
        hysteresis_left=jnp.where(boost, self.hysteresis, new.hysteresis_left))


_struct.register_state(UnderflowAwareLossScale)
