"""Dynamic loss scales that read what precision telemetry measured in the step.

`UnderflowAwareLossScale` grows on measured underflow; `AutomaticLossScale`
is Graphcore's automatic loss scaling, driven by the proportion of
cotangents near the top of the range.


Every dynamic loss scaler in the field reacts only to overflow: it grows
blindly every ``period`` steps and backs off when gradients overflow,
although scaling exists to fight *underflow*. `UnderflowAwareLossScale` is a
`jmp_lite.DynamicLossScale` whose ``adjust`` also takes what precision
telemetry measured in the same step (`jmp_lite.Telemetry`): the fraction of
the non-zero cotangents held in a 16-bit (or narrower) float that were
subnormal or flushed to zero (a loss cotangent that the backward pass's cast
into the model's compute dtype turns into 0 counts: when everything
underflows the share is 1, not 0/0), and the headroom left (the dtype's maximum
over the largest such cotangent). On a finite step where that fraction is
above ``underflow_threshold`` and the headroom exceeds ``factor * margin``,
it grows at once instead of waiting for ``period``: it grows where growing
is both needed and safe. Overflow backs off as before.

`jmp_lite.TrainState.minimize` passes both measures when given a
``telemetry``; hand-written steps pass ``info.precision``'s
``cotangent_underflow`` and ``cotangent_headroom`` to ``adjust`` (or to
`jmp_lite.optax.with_loss_scale`'s update as ``loss_scale_underflow=`` and
``loss_scale_headroom=``). On steps telemetry does not sample they are 0 and
infinity: no underflow growth. With ``accumulate_steps`` the guard combines
the micro-batches' measures (the mean share, the smallest headroom) before
the scale decides.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _struct
from jmp_lite import loss_scale as ls_lib

__all__ = ("AutomaticLossScale", "UnderflowAwareLossScale")


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
  # The measures `adjust` reads: `TrainState.minimize` passes them, and
  # `with_loss_scale.update` takes them as ``loss_scale_<name>=``.
  MEASURES: ClassVar[tuple] = ("underflow", "headroom")

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


@dataclasses.dataclass(frozen=True)
class AutomaticLossScale(ls_lib.DynamicLossScale):
  """Graphcore's automatic loss scaling: a scale steered by the upper bin.

  Graphcore's rule (graphcore/popart ``LossScaleUpdateOpx::grow`` in
  ``willow/src/popx/op/lossscaleupdatex.cpp`` at 6dcca75c, and the
  ``AutomaticLossScalingSettings`` defaults in
  ``willow/include/popart/sessionoptions.hpp`` at 653bb23a): the gradients' magnitudes are
  sorted into two bins, split at 1/16 of the dtype's maximum; every
  ``period`` steps the scale is halved if the upper bin holds more than
  ``threshold`` of all values, and doubled otherwise::

      new_scale = scale / 2  if upper / (upper + lower) > threshold
                  scale * 2  otherwise

  So the scale sits just below where the largest values approach the top
  of the range, whether the gradients are large or tiny, instead of growing
  blindly until an overflow (`jmp_lite.DynamicLossScale`). The proportion is
  `jmp_lite.PrecisionStats.cotangent_upper`: the cotangents of the wrapped
  model's modules held in a 16-bit (or narrower) float, zeros included, an
  inf or NaN counted in the upper bin. (PopART tracks the outputs of the
  backward pass's matmuls and convolutions, and puts float16's edge at
  65535/16; here it is float16's own maximum over 16, 4094.)

  Beyond Graphcore's rule, overflow is still handled as
  `jmp_lite.DynamicLossScale` does: a non-finite step is skipped by the guard
  and backs the scale off by ``factor`` (after ``hysteresis`` overflows),
  and a growth refills the hysteresis. A step telemetry did not sample
  (``Telemetry(every=n)``) keeps the scale. Scales stay within
  ``[min_loss_scale, max_loss_scale]``.

  The fields of `jmp_lite.DynamicLossScale` mean the same here, with
  ``period`` the steps between decisions (PopART's ``updatePeriod``, default 1)
  and ``factor`` the change (2, as PopART's).

  Args:
    threshold: the proportion of values in the upper bin above which the
      scale shrinks (PopART's ``thresholdUpperCountProportion``, default
      1e-7), in ``[0, 1]``.

  Example:
    >>> import jax.numpy as jnp
    >>> import jmp_lite
    >>> ls = jmp_lite.AutomaticLossScale(jnp.float32(1024))
    >>> # One value in 10,000 near the top: above 1e-7, so shrink.
    >>> float(ls.adjust(jnp.bool_(True), upper=1e-4).loss_scale)
    512.0
    >>> float(ls.adjust(jnp.bool_(True), upper=0.0).loss_scale)  # none: grow
    2048.0
  """

  period: jax.Array = 1
  threshold: jax.Array = dataclasses.field(default=1e-7, kw_only=True)
  MEASURES: ClassVar[tuple] = ("upper", "sampled")
  # Without them it would never grow: the guarded step refuses to run.
  MEASURES_REQUIRED: ClassVar[bool] = True

  def __post_init__(self):
    super().__post_init__()
    threshold, t = _struct.as_scalar(self.threshold, jnp.float32, "threshold")
    if t is not None and not 0 <= t <= 1:
      raise ValueError(f"AutomaticLossScale.threshold must be in [0, 1], got "
                       f"{self.threshold!r}")
    object.__setattr__(self, "threshold", threshold)

  def adjust(self, grads_finite: jax.Array, upper: Optional[jax.Array] = None,
             sampled: jax.Array = True) -> "AutomaticLossScale":
    """The next state.

    Args:
      grads_finite: whether this step's gradients were finite.
      upper: the measured proportion of cotangents in the upper bin
        (`jmp_lite.PrecisionStats.cotangent_upper`); None: not measured.
      sampled: whether telemetry measured this step (``PrecisionStats.sampled``).

    A finite step that was not measured keeps the scale and the counter; a
    non-finite one backs off as `jmp_lite.DynamicLossScale` does.
    """
    if upper is not None and np.ndim(upper) != 0:
      raise ValueError(
          "AutomaticLossScale.adjust: upper must be a scalar (one proportion "
          f"for the step), got shape {np.shape(upper)}")
    # Checks the flag, and on a non-finite step is the next state:
    # DynamicLossScale's back-off with hysteresis.
    backed = super().adjust(grads_finite)
    finite = jnp.asarray(grads_finite, jnp.bool_)
    measured = jnp.asarray(sampled, jnp.bool_) & (upper is not None)
    proportion = jnp.asarray(0.0 if upper is None else upper, jnp.float32)
    due = self.counter >= self.period - 1
    decide = measured & due
    shrink = proportion > self.threshold
    scale = self.loss_scale.astype(jnp.float32)
    # DynamicLossScale's growth and back-off, without its hysteresis: a
    # crowded upper bin is not an overflow.
    kept = jnp.where(decide, jnp.where(shrink, self._shrunk(), self._grown()), scale)
    grew = decide & ~shrink
    counter = jnp.where(measured, jnp.where(due, 0, self.counter + 1), self.counter)
    left = jnp.where(grew | self.consecutive_hysteresis, self.hysteresis,
                     self.hysteresis_left)
    return _struct.replace_fields(
        self,
        loss_scale=jnp.where(finite, kept, backed.loss_scale),
        counter=jnp.where(finite, counter, backed.counter),
        hysteresis_left=jnp.where(finite, left, backed.hysteresis_left))


_struct.register_state(UnderflowAwareLossScale)
_struct.register_state(AutomaticLossScale)
