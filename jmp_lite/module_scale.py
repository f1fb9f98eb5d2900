"""A loss scale per module: `ModuleLossScale`.

One loss scale cannot serve a model whose modules' gradients lie far apart:
the scale that keeps the largest weight gradients below float16's maximum
leaves the smallest ones subnormal or flushed to zero. Adaptive loss
scaling (Zhao, Zhang, Fang, Luk and Chiang, "Adaptive Loss Scaling for
Mixed Precision Training", 2019, arXiv:1910.12385) gives each layer a scale
of its own, computed from the statistics of its gradients. `ModuleLossScale`
does this for the modules of a model wrapped by `jmp_lite.flax.wrap`
(Linen): each chosen module's backward pass runs at its own scale, its
weight gradients come back at the global one, and the guard still decides
for the whole step (see `jmp_lite._jaxpr.module_scales` for the mechanism).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _exact
from jmp_lite._jaxpr import module_scales as ms
from jmp_lite import _struct
from jmp_lite import loss_scale as ls_lib

__all__ = ("ModuleLossScale",)

# Module scales stay within float32's normal range with room for the
# quotients the conversions take (global over module scale).
_LIMIT = 2.0 ** 60


@dataclasses.dataclass(frozen=True)
class ModuleLossScale(ls_lib.DynamicLossScale):
  """A `jmp_lite.DynamicLossScale` plus a scale for each chosen module.

  The fields of `jmp_lite.DynamicLossScale` are the *global* scale: the loss
  is scaled by it, the gradients are unscaled by it, and it backs off and
  grows as there (for overflows outside the scaled modules). Each module of
  ``paths`` has its own scale ``module_scales[i]``: its backward pass holds
  cotangents at that scale, and its weight gradients leave it at the global
  one. After each step a module's scale moves (Zhao et al.'s adaptive loss
  scaling, with a dynamic scaler's back-off):

  * its own overflow (a non-finite cotangent inside the module while what
    entered it was finite; where its submodules sent non-finite ones back
    and no module made them, the overflow is the module's own code's,
    between its submodules): divided by ``factor``, the global scale kept;
  * a finite step: to the largest power of two that puts the largest
    cotangent measured inside the module (its weight gradients, and its
    inputs' cotangents) at most ``1 / margin`` of the compute dtype's
    maximum; growth is at most ``factor`` per step, a shrink is immediate;
  * a step that overflowed elsewhere: kept.

  Make it with `create` (which finds the modules) and use it as the loss
  scale of `jmp_lite.TrainState` (`TrainState.minimize` runs the step and
  passes the measurements), or of `jmp_lite.value_and_grad` (which returns
  the measurements for `adjust`). The step is skipped, atomically, whenever
  any gradient is non-finite, as with any loss scale.

  Which modules: by default every module the model calls (not the model
  itself) that computes in a dtype with float16's range or narrower (not
  bfloat16, whose range is float32's); nested modules each get their own.
  A module's output that another scaled module reads directly passes its
  cotangent from one scale to the other (a chain of blocks); a value that
  passes through the code around the modules (an activation the caller
  applies, a residual sum) is held at that code's scale, the enclosing
  module's or the global one. So scaling rescues what modules compute
  (weight gradients, and cotangents inside and between chained modules),
  not what the model's own code between modules holds.

  Not supported yet: Flax NNX models (`create` refuses them), and telemetry
  or fp8 in the same step (`TrainState.minimize` refuses). Parameters held
  in float16 leave their module at the global scale in float16, where the
  global scale's range applies again.

  Args:
    paths: the scaled modules' paths (static), as `jmp_lite.flax.policy_map`
      names them.
    module_scales: float32 ``[len(paths)]``, each module's scale (powers of
      two; default: the global scale).
    compute_dtypes: each module's compute dtype name (static).
    margin: headroom kept below the compute dtype's maximum (>= 1; default 8).
  """

  paths: tuple = _struct.static_field(default=(), kw_only=True)
  compute_dtypes: tuple = _struct.static_field(default=(), kw_only=True)
  module_scales: Optional[jax.Array] = dataclasses.field(default=None, kw_only=True)
  margin: jax.Array = dataclasses.field(default=32.0, kw_only=True)
  ceilings: Optional[jax.Array] = dataclasses.field(default=None, kw_only=True)
  module_counters: Optional[jax.Array] = dataclasses.field(default=None, kw_only=True)
  MEASURES: ClassVar[tuple] = ("modules",)
  MEASURES_REQUIRED: ClassVar[bool] = True

  def __post_init__(self):
    super().__post_init__()
    name = "ModuleLossScale"
    paths = tuple(self.paths)
    if not all(isinstance(p, str) for p in paths) or len(set(paths)) != len(paths):
      raise ValueError(f"{name}.paths must be distinct module paths (str), got {paths!r}")
    dtypes = tuple(np.dtype(d).name for d in self.compute_dtypes)
    if len(dtypes) != len(paths):
      raise ValueError(f"{name}: {len(paths)} paths but {len(dtypes)} compute_dtypes")
    for p, d in zip(paths, dtypes):
      if not jnp.issubdtype(np.dtype(d), jnp.floating):
        raise ValueError(f"{name}: module {p!r} has compute dtype {d}, not a float")
    margin, m = _struct.as_scalar(self.margin, jnp.float32, "margin")
    if m is not None and not (np.isfinite(m) and m >= 1):
      raise ValueError(f"{name}.margin must be finite and >= 1, got {self.margin!r}")
    scales = self.module_scales
    if scales is None:
      scales = jnp.full((len(paths),), self.loss_scale, jnp.float32)
    scales = jnp.asarray(scales, jnp.float32)
    if scales.shape != (len(paths),):
      raise ValueError(f"{name}.module_scales must have shape ({len(paths)},), one per "
                       f"path, got {scales.shape}")
    n = len(paths)
    ceilings = (jnp.full((n,), _LIMIT, jnp.float32) if self.ceilings is None
                else jnp.asarray(self.ceilings, jnp.float32))
    counters = (jnp.zeros((n,), jnp.int32) if self.module_counters is None
                else jnp.asarray(self.module_counters, jnp.int32))
    for field, value in (("ceilings", ceilings), ("module_counters", counters)):
      if value.shape != (n,):
        raise ValueError(f"{name}.{field} must have shape ({n},), got {value.shape}")
    object.__setattr__(self, "ceilings", ceilings)
    object.__setattr__(self, "module_counters", counters)
    _check_powers_of_two(name, loss_scale=self.loss_scale, factor=self.factor,
                         min_loss_scale=self.min_loss_scale, module_scales=scales)
    object.__setattr__(self, "paths", paths)
    object.__setattr__(self, "compute_dtypes", dtypes)
    object.__setattr__(self, "margin", margin)
    object.__setattr__(self, "module_scales", scales)

  @classmethod
  def create(cls, wrapped, *args, loss_scale: Any = 2.0 ** 15,
             paths: Optional[Sequence[str]] = None, rngs=None,
             **kwargs) -> "ModuleLossScale":
    """A `ModuleLossScale` for the modules of ``wrapped`` called on ``args``.

    Args:
      wrapped: a Linen model returned by `jmp_lite.flax.wrap`.
      *args: example inputs (shapes and dtypes only, as
        `jmp_lite.flax.policy_map` takes them).
      loss_scale: the initial global scale.
      paths: the modules to scale (default: see the class docstring). Each
        must be a module the model calls.
      rngs: ``init`` RNGs, as for `jmp_lite.flax.policy_map`.
      **kwargs: the other fields of `ModuleLossScale` and
        `jmp_lite.DynamicLossScale` (``period``, ``factor``, ``margin``...);
        keyword arguments of the model go in ``model_kwargs``.

    Example:
      >>> import jax.numpy as jnp
      >>> import flax.linen as nn
      >>> import jmp_lite, jmp_lite.flax
      >>> class MLP(nn.Module):
      ...   @nn.compact
      ...   def __call__(self, x):
      ...     h = nn.relu(nn.Dense(8)(x))
      ...     return nn.Dense(2)(h)
      >>> model = jmp_lite.flax.wrap(MLP(), "p=f32,c=f16,o=f32")
      >>> ls = jmp_lite.ModuleLossScale.create(model, jnp.ones((1, 3)))
      >>> ls.paths, ls.compute_dtypes
      (('Dense_0', 'Dense_1'), ('float16', 'float16'))
    """
    from jmp_lite import flax as jflax  # pylint: disable=g-import-not-at-top
    if not isinstance(wrapped, jflax._LinenWrapper):  # pylint: disable=protected-access
      raise TypeError(
          "ModuleLossScale.create expects a Linen model returned by "
          f"jmp_lite.flax.wrap, got {type(wrapped).__name__}. (Flax NNX models "
          "are not supported yet.)")
    model_kwargs = kwargs.pop("model_kwargs", {})
    policies = jflax.policy_map(wrapped, *args, rngs=rngs, **model_kwargs)
    if paths is None:
      chosen = [p for p, pol in policies.items()
                if p and _narrow_range(pol.compute_dtype)]
      if not chosen:
        raise ValueError(
            "ModuleLossScale.create: no module of this model computes in float16 "
            "or narrower (compute dtypes: "
            f"{sorted({np.dtype(p.compute_dtype).name for p in policies.values()})}); "
            "bfloat16 has float32's range and needs no loss scale per module. "
            "Pass paths=[...] to scale chosen modules anyway.")
    else:
      if isinstance(paths, str):
        raise TypeError(f"paths must be a sequence of module paths, got {paths!r}")
      chosen = list(paths)
      unknown = [p for p in chosen if p not in policies or not p]
      if unknown:
        raise ValueError(
            f"ModuleLossScale.create: {unknown!r} are not modules the model calls "
            f"(the model itself, '', cannot be one); it calls {sorted(policies)!r}")
    return cls(loss_scale, paths=tuple(chosen),
               compute_dtypes=tuple(np.dtype(policies[p].compute_dtype).name
                                    for p in chosen), **kwargs)

  def adjust(self, grads_finite: jax.Array,
             modules: Optional[jax.Array] = None) -> "ModuleLossScale":
    """The next state.

    Args:
      grads_finite: whether this step's gradients were finite.
      modules: what the step measured, float32 ``[len(paths), 2,
        WIDTH]`` (`TrainState.minimize` passes it); None: the module scales
        are kept.
    """
    new = super().adjust(grads_finite)
    if modules is None:
      return new
    modules = jnp.asarray(modules, jnp.float32)
    want = (len(self.paths), 2, ms.WIDTH)
    if modules.shape != want:
      raise ValueError(
          f"ModuleLossScale.adjust: modules must have shape {want} (one row pair per "
          f"scaled module), got {modules.shape}")
    finite = jnp.asarray(grads_finite, jnp.bool_)
    from_caller = modules[:, ms.ENTER, ms.NONFINITE] > 0
    sent_back = modules[:, ms.ENTER, ms.ARRIVED] > 0
    inside = modules[:, ms.INSIDE, ms.NONFINITE] > 0
    own = inside & ~from_caller & ~sent_back
    # No module made it by that rule: a module whose caller sent it finite
    # cotangents but whose submodule sent non-finite ones back made them in
    # its own code between its submodules (the submodule passed on what it
    # was sent). Without this, such a module's scale never moved and every
    # step was skipped while the global scale fell.
    own = jnp.where(jnp.any(own), own, inside & ~from_caller)
    ran = modules[:, ms.INSIDE, ms.ELEMENTS] > 0
    # An overflow that started inside a scaled module is that module's: its
    # scale backs off, the global one is kept as it was.
    explained = ~finite & jnp.any(own)
    keep = lambda n, o: jnp.where(explained, o, n)
    new = _struct.replace_fields(
        new, loss_scale=keep(new.loss_scale, self.loss_scale),
        counter=keep(new.counter, self.counter),
        hysteresis_left=keep(new.hysteresis_left, self.hysteresis_left))
    scales = self.module_scales
    top = ms.top_binade(modules[:, ms.INSIDE])
    limit = jnp.asarray([math.floor(math.log2(float(jnp.finfo(d).max))) for d in
                         self.compute_dtypes], jnp.float32) - jnp.log2(self.margin)
    # The largest measured value is below 2**(top + 1): moved to at most
    # max / margin. Nothing measured non-zero (all zero, or all flushed at
    # this scale): no evidence either way, kept. (Growing blindly there ran
    # scales up to where the first non-zero gradient overflowed.)
    steps = jnp.floor(limit - top - 1)
    steps = jnp.where(jnp.isfinite(steps), steps, 0.0)
    target = scales * jnp.exp2(jnp.clip(steps, -126, 126))
    # A module that overflowed stays below the scale it overflowed at until
    # `period` finite steps have passed (then the ceiling rises by `factor`),
    # as a dynamic loss scale does: a gradient spike larger than the margin
    # costs one skipped step per period, not one every few steps.
    counters = jnp.where(own, 0, jnp.where(finite & ran, self.module_counters + 1,
                                           self.module_counters))
    lift = counters >= self.period
    ceilings = jnp.where(lift, jnp.minimum(self.ceilings * self.factor, _LIMIT),
                         self.ceilings)
    counters = jnp.where(lift, 0, counters)
    grown = jnp.minimum(jnp.minimum(target, scales * self.factor), ceilings)
    # Its own overflow: by `factor`, or further where the values that stayed
    # finite say so (they sit near the top of the range: one skipped step
    # instead of one per binade).
    backed = jnp.minimum(_exact.divide(scales, self.factor), target)
    scales = jnp.where(own, backed, jnp.where(finite & ran, grown, scales))
    scales = jnp.clip(scales, 1 / _LIMIT, _LIMIT)
    ceilings = jnp.where(own, scales, ceilings)
    return _struct.replace_fields(new, module_scales=scales, ceilings=ceilings,
                                  module_counters=counters.astype(jnp.int32))

  def measure_shape(self) -> tuple[int, ...]:
    """The shape of the ``modules`` measurement `adjust` takes."""
    return (len(self.paths), 2, ms.WIDTH)


def _check_powers_of_two(name: str, **values) -> None:
  """Refuses values known on the host that are not powers of two: the
  conversions multiply cotangents by quotients of the scales, which are
  exact only between powers of two (a factor of 3 would round every
  cotangent of every scaled module)."""
  for field, value in values.items():
    try:
      host = np.asarray(value, np.float64)
    except (TypeError, jax.errors.TracerArrayConversionError):
      continue  # traced: made by adjust from powers of two
    mantissa, _ = np.frexp(host)
    if np.any(mantissa != 0.5):
      raise ValueError(f"{name}.{field} must hold powers of two, got {value!r}")


def _narrow_range(dtype) -> bool:
  """Whether ``dtype`` is a float with less than float32's range (float16,
  the fp8 formats), where a loss scale matters."""
  dtype = np.dtype(dtype)
  return (jnp.issubdtype(dtype, jnp.floating)
          and jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp)


_struct.register_state(ModuleLossScale)
