"""optax transformations: loss scaling that skips a bad step atomically, and
(re-exported from `jmp_lite.rounding`) updates for low-precision parameters.

`with_loss_scale(inner, loss_scale)` wraps any optax optimizer. Its state
holds the loss scale next to the whole inner state, so one ``update`` call
decides, for the whole chain, whether a step happens::

    norm, finite = |g / scale|, isfinite(...)     # two sums, no branch
    if finite:
      g32 = g / scale * min(1, clip_norm / norm)  # float32, fused into the update
      updates, inner_state = inner.update(g32, state, float32 params)
      finite = nothing finite became NaN/inf: updates, params + updates, state
               (for large arrays, checked on a second computation of the
               step from the same inputs: nothing is stored for the check)
    if not finite:
      updates = -0.0; inner_state unchanged
    loss_scale = loss_scale.adjust(gradients finite)

Why one transformation rather than a chain of ``unscale``, ``all_finite``,
``clip_by_global_norm`` and ``apply_if_finite``:

* the chain reads the gradients four times; this reads them at most three
  times (XLA:CPU compiles the norm's two sums as two loops);
* clipping can only see unscaled gradients, so the most common
  mixed-precision bug (clipping scaled gradients) cannot be written;
* a skipped step freezes everything inside ``inner``: schedules, Adam's
  moments and counts, counters. optax's ``apply_if_finite`` freezes only
  what it wraps, and after ``max_consecutive_errors`` it applies the
  non-finite update; this never does, however many steps overflow;
* finite gradients are not enough: Adam's ``eps`` is 0 in float16, a
  float16 parameter plus a finite update can overflow. The optimizer runs in
  float32, and what the step would write is checked before it is kept;
* skipped updates are ``-0.0``, the one value that leaves every parameter
  bitwise unchanged under ``optax.apply_updates`` (``-0.0 + 0.0`` is ``+0.0``
  but ``x + -0.0`` is ``x`` for every ``x``).

Gradient accumulation is built in (``accumulate_steps``) rather than left to
``optax.MultiSteps``: MultiSteps resets its accumulator by multiplying it by
zero, so one overflowing micro-batch leaves NaN in it for every later step
(wrapping `with_loss_scale` in MultiSteps is refused). Here scaled micro-batch
gradients are summed in float32, a micro-batch that would make the sum
non-finite is dropped and marks the step as skipped, the accumulator is reset
with fresh zeros, and the loss scale stays fixed within an accumulation.
"""

from __future__ import annotations

from typing import Any, Optional

import reprlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import _checks
from jmp_lite import _guard_state
from jmp_lite import _keyed
from jmp_lite._guard_state import LossScaleState
from jmp_lite._guard_state import NonFinite
from jmp_lite._guard_state import find_loss_scale_state
from jmp_lite._guard_state import get_loss_scale
from jmp_lite._guard_state import _contains_loss_scale_state
from jmp_lite._guard_state import _no_nonfinite
from jmp_lite import _replicas
from jmp_lite import _scaling
from jmp_lite import _struct
from jmp_lite import _unscale
from jmp_lite import loss_scale as ls_lib
from jmp_lite._fp8_state import Fp8State
from jmp_lite._unscale import apply_updates
from jmp_lite._dtypes import is_inexact
from jmp_lite._dtypes import wide_dtype
from jmp_lite.rounding import KahanState
from jmp_lite.rounding import StochasticRoundState
from jmp_lite.rounding import kahan_summation
from jmp_lite.rounding import stochastic_round
from jmp_lite.rounding import stored_params
from jmp_lite.rounding import with_state_dtype

# Optimizer states are what checkpoints hold: jmp_lite's (the guard's, the
# loss scales') serialise with flax.serialization (a dependency) whether or
# not the caller imported jmp_lite.flax; this imports Flax (about 80 ms).
_struct.register_serialization()

__all__ = (
    "apply_updates",
    "find_loss_scale_state",
    "get_loss_scale",
    "KahanState",
    "kahan_summation",
    "LossScaleState",
    "NonFinite",
    "stochastic_round",
    "StochasticRoundState",
    "with_loss_scale",
    "with_state_dtype",
)

# Defined beside the guard's state logic; documented, pickled and shown as here.
for _public in (LossScaleState, NonFinite, find_loss_scale_state, get_loss_scale):
  _public.__module__ = __name__


def with_loss_scale(
    inner: optax.GradientTransformation,
    loss_scale: ls_lib.LossScale,
    *,
    clip_norm: Optional[float] = None,
    accumulate_steps: int = 1,
    axis_name: ls_lib.AxisName = None,
    fp8: Any = None,
    max_stalled_steps: Optional[int] = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so that it receives unscaled gradients and skips bad steps.

  ``update`` takes the gradients of ``loss_scale.scale(loss)``, scaled by the
  scale found with `get_loss_scale` in the same state. It unscales them into
  float32 (float64 for float64, complex for complex gradients) and runs
  ``inner`` there, on float32 copies of 16-bit parameters, so that moments,
  epsilons and hyperparameters keep float32 precision; ``inner``'s state for
  16-bit parameters is float32 unless ``inner`` asks otherwise (e.g.
  `with_state_dtype`). Updates for 16-bit parameters come out in float32 and
  are rounded once, when applied (``optax.apply_updates`` or `apply_updates`).

  The step is applied only if the gradients are finite and it would make no
  finite value non-finite: not in the updates, the new parameters (``params +
  updates`` in the parameters' dtypes, when ``params`` is passed) nor
  ``inner``'s new state (an inf an optimizer keeps on purpose, such as
  ``reduce_on_plateau``'s initial best value, may stay). Otherwise ``update`` returns ``-0.0`` updates, which leave every parameter
  bitwise unchanged, keeps ``inner``'s state as it was, and records why in
  ``nonfinite``. The loss scale adjusts to whether the *gradients* were
  finite: a step skipped only because the optimizer's arithmetic overflowed
  says nothing about the scale. Put it outermost: everything inside ``inner``
  is frozen on a skipped step. Integer and boolean parameters are shown to
  ``inner`` as None (optax's empty subtree) and get zero updates; an
  optimizer that rejects None leaves (``optax.contrib.galore``) then needs a
  parameter tree without them.

  Args:
    inner: the optimizer to wrap (any optax transformation or chain).
    loss_scale: the initial loss scale (`jmp_lite.DynamicLossScale` to adapt).
    clip_norm: if set, clip the unscaled gradients to this global norm, with
      the norm computed in the same pass as the finiteness check. Correct for
      any finite norm, including norms beyond float32's range; elements below
      2**-63 (about 1e-19) add nothing to it, as in optax, their float32
      squares being flushed to zero.
    accumulate_steps: number of micro-batches whose gradients are summed
      (averaged) into one step. Updates are zero on the other calls. An
      overflow in any micro-batch skips the whole accumulated step; on the
      call it overflows, ``LossScaleState.skipped`` is True (its batch was
      dropped: keep the old BatchNorm statistics). A state restored in the
      middle of a longer accumulation ends it at the next call, averaged
      over the micro-batches it holds. Use this rather than wrapping in
      ``optax.MultiSteps``, which is refused.
    axis_name: under ``shard_map``/``pmap``, the mesh axis (or axes) across
      which replicas must agree to skip: one replica's overflow skips the
      step everywhere. Not needed under ``jax.jit`` with sharded arrays, where
      the check is already global. The norm used for clipping is that of the
      gradients each replica holds (reduce them across devices first).
    fp8: a `jmp_lite.fp8.Fp8State` (from `jmp_lite.fp8.init`) to keep in the
      state; ``update`` then takes the step's fp8 maxima as ``fp8_amax=``
      (what `jmp_lite.TrainState.minimize` passes).
    max_stalled_steps: a step skipped while the gradients were finite (the
      updates, ``params + updates`` or the new state overflowed) says nothing
      about the loss scale, which stays; the same overflow then usually
      repeats on every step. After this many such steps in a row the step
      raises ``FloatingPointError`` (inside the compiled step, through a host
      callback: JAX re-raises it as a ``JaxRuntimeError`` carrying the
      message) naming the arrays that overflow. None (the default): never
      raise; the count is in ``LossScaleState.stalled`` (and
      `jmp_lite.StepInfo.stalled`) either way. Off by default because JAX
      does not keep a program with a host callback in its persistent
      compilation cache.

  Returns:
    A `optax.GradientTransformationExtraArgs` whose state is `LossScaleState`.

  Raises:
    TypeError: if ``inner`` is not an optax transformation, ``loss_scale`` is
      not a loss scale, or ``accumulate_steps`` is not a whole number.
    ValueError: for a non-positive ``clip_norm`` or ``accumulate_steps``; at
      ``init``, if ``inner`` already contains a `with_loss_scale` or the
      result is wrapped in ``optax.MultiSteps``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jmp_lite
    >>> params = {"w": jnp.ones(3)}
    >>> tx = jmp_lite.optax.with_loss_scale(
    ...     optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0 ** 15), clip_norm=1.0)
    >>> opt_state = tx.init(params)
    >>> def loss_fn(params, loss_scale):
    ...   return loss_scale.scale(jnp.sum(params["w"] ** 2))
    >>> scale = jmp_lite.optax.get_loss_scale(opt_state)
    >>> grads = jax.grad(loss_fn)(params, scale)
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> [round(float(x), 4) for x in params["w"]]
    [0.9423, 0.9423, 0.9423]
  """
  return _with_loss_scale(inner, loss_scale, clip_norm=clip_norm,
                          accumulate_steps=accumulate_steps, axis_name=axis_name,
                          check_results=True, fp8=fp8,
                          max_stalled_steps=max_stalled_steps)


def _with_loss_scale(inner, loss_scale, *, clip_norm, accumulate_steps, axis_name,
                     check_results: bool, fp8=None, max_stalled_steps=None):
  """`with_loss_scale`; ``check_results=False`` checks the gradients only.

  The unchecked variant exists so that ``bench/`` can measure what checking
  the updates, new parameters and new state costs; it is not API.
  """
  if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
    raise TypeError(
        f"with_loss_scale: inner must be an optax GradientTransformation, got {inner!r}")
  if not isinstance(loss_scale, (ls_lib.NoOpLossScale, ls_lib.StaticLossScale,
                                 ls_lib.DynamicLossScale)):
    raise TypeError(
        f"with_loss_scale: loss_scale must be a jmp_lite loss scale, got "
        f"{reprlib.repr(loss_scale)} (e.g. jmp_lite.DynamicLossScale(2.0 ** 15))."
        + _checks.loss_scale_hint(loss_scale))
  if clip_norm is not None:
    if isinstance(clip_norm, (str, bool)) or np.ndim(clip_norm) != 0:
      raise TypeError(
          f"with_loss_scale: clip_norm must be a positive number, got {clip_norm!r}")
    if not (np.isfinite(clip_norm) and clip_norm > 0):
      raise ValueError(
          f"with_loss_scale: clip_norm must be > 0 and finite, got {clip_norm!r}")
    clip_norm = float(clip_norm)
  axis_name = _scaling.check_axis_name(axis_name, "with_loss_scale")
  if (isinstance(accumulate_steps, (bool, np.bool_))
      or not isinstance(accumulate_steps, (int, float, np.integer, np.floating))):
    raise TypeError(
        f"with_loss_scale: accumulate_steps must be a whole number >= 1, got "
        f"{accumulate_steps!r}")
  if int(accumulate_steps) != accumulate_steps or accumulate_steps < 1:
    raise ValueError(
        f"with_loss_scale: accumulate_steps must be a whole number >= 1, got "
        f"{accumulate_steps!r}")
  if max_stalled_steps is not None and (
      isinstance(max_stalled_steps, (bool, np.bool_))
      or not isinstance(max_stalled_steps, (int, np.integer)) or max_stalled_steps < 1):
    raise ValueError(
        f"with_loss_scale: max_stalled_steps must be a whole number >= 1 or None, "
        f"got {max_stalled_steps!r}")
  if fp8 is not None and not isinstance(fp8, Fp8State):
    raise TypeError(
        f"with_loss_scale: fp8 must be a jmp_lite.fp8.Fp8State (from "
        f"jmp_lite.fp8.init), got {type(fp8).__name__}")
  # What the transformation is made from: two made alike compare equal
  # (`_keyed`), so that TrainStates created alike have one structure.
  # (``type(inner)``: optax's GradientTransformation and ...ExtraArgs of the
  # same functions compare equal, and differ in what reaches the update.)
  key = (type(inner), inner, clip_norm, accumulate_steps, axis_name, check_results, max_stalled_steps,
         _keyed.value_key(loss_scale), _keyed.value_key(fp8))
  inner = optax.with_extra_args_support(inner)
  k = int(accumulate_steps)

  def init(params):
    params = _unscale.numbers_as_arrays(params)
    _checks.refuse_wrappers_around()
    copies = _unscale.for_inner(params)
    with stored_params(params, copies):
      raw_state = inner.init(copies)
      _checks.inner_blind_to_dtypes(inner.init, params, copies, raw_state)
      inner_state = _unscale.strongly_typed(raw_state)
    if _contains_loss_scale_state(inner_state):
      raise ValueError(
          "with_loss_scale: inner already contains a with_loss_scale (e.g. "
          "TrainState.create was given an already wrapped tx); the loss would "
          "be unscaled twice. Wrap the optimizer once.")
    acc = () if k == 1 else jax.tree.map(
        # zeros_like: sharded as the parameter is (a full-size buffer on
        # one device would hold a whole FSDP model).
        lambda p: jnp.zeros_like(p, wide_dtype(p.dtype)) if is_inexact(p) else
        jnp.zeros_like(p), params)
    return LossScaleState(
        loss_scale=loss_scale,
        inner_state=inner_state,
        skipped=jnp.array(False),
        skipped_steps=jnp.zeros((), jnp.int32),
        grad_norm=jnp.zeros((), _unscale.norm_dtype(params)),
        nonfinite=_no_nonfinite(),
        mini_step=jnp.zeros((), jnp.int32),
        acc_grads=acc,
        acc_finite=jnp.array(True),
        fp8=fp8,
        stalled=jnp.zeros((), jnp.int32),
        acc_measures=None if k == 1 else _guard_state.measures_start(
            getattr(type(loss_scale), "MEASURES", ()), loss_scale),
    )

  def step(grads, state, params, extra_args, scale, earlier_ok, measured=None):
    measured = {} if measured is None else measured
    info = _unscale.norm_and_factor(grads, scale, clip_norm)
    finite = info.finite & earlier_ok
    if axis_name is not None:
      finite = jax.lax.psum((~finite).astype(jnp.int32), axis_name) == 0
    _replicas.check_decision(finite, axis_name, "with_loss_scale")
    like = params if params is not None else grads

    def apply(grads, old_state, params):
      unscaled = _unscale.grads_for_inner(grads, info)
      copies = None if params is None else _unscale.for_inner(params)
      with stored_params(params, copies):
        updates, inner_state = inner.update(unscaled, old_state, copies, **extra_args)
      updates = _unscale.fill_updates(updates, like)
      return updates, _unscale.cast_like(inner_state, old_state)

    # The inner optimizer runs on every step and its results are selected,
    # rather than run inside a `cond`: a conditional around the optimizer
    # keeps XLA from fusing it with the unscaling and the checks (compile
    # time grew with every parameter array, and so did the step's). A skipped
    # step's work is discarded; nothing of it is kept.
    updates, inner_state = apply(grads, state.inner_state, params)
    false = jnp.array(False)
    bad = NonFinite(grads=~finite, updates=false, params=false, opt_state=false)
    if check_results:
      # Large arrays are checked on a second computation of the step
      # (`_checks.COPY_FROM`). Only meaningful where the gradients were
      # finite (else False).
      checked_u, checked_s = _checks.checked_values(
          apply, (grads, state.inner_state, params), updates, inner_state)
      u_bad, p_bad, s_bad = _checks.written_nonfinite(
          checked_u, params, checked_s, state.inner_state, finite)
      bad = bad._replace(updates=u_bad, params=p_bad, opt_state=s_bad)
      applied = ~(bad.grads | bad.updates | bad.params | bad.opt_state)
      if axis_name is not None:
        applied = jax.lax.psum((~applied).astype(jnp.int32), axis_name) == 0
    else:
      applied = finite
    _replicas.check_decision(applied, axis_name, "with_loss_scale")
    stalled = jnp.where(applied | ~finite, 0, state.stalled + 1).astype(jnp.int32)
    if max_stalled_steps is not None:
      _checks.raise_if_stalled(stalled, max_stalled_steps, updates, params,
                               inner_state, state.inner_state)
    updates, inner_state = _checks.select_written(
        applied, updates, params, inner_state, state.inner_state,
        per_element=check_results)
    dtype = state.grad_norm.dtype
    norm = jnp.minimum(info.norm.astype(dtype), jnp.finfo(dtype).max)
    new_scale = _guard_state.adjust(state.loss_scale, finite, measured)
    new_state = state._replace(
        loss_scale=new_scale,
        fp8=_guard_state.fp8_step_end(state.fp8, state.loss_scale, new_scale),
        inner_state=inner_state,
        skipped=~applied,
        skipped_steps=state.skipped_steps + (~applied).astype(jnp.int32),
        stalled=stalled,
        grad_norm=jnp.where(applied, norm, state.grad_norm),
        nonfinite=bad,
    )
    return updates, new_state

  def update(grads, state, params=None, **extra_args):
    if not isinstance(state, LossScaleState):
      raise TypeError(
          "with_loss_scale.update: state must be this transformation's "
          f"LossScaleState (from its init), got {type(state).__name__}.")
    if (state.acc_grads == ()) != (k == 1):
      raise ValueError(
          "with_loss_scale.update: this state was made by a with_loss_scale "
          f"with a different accumulate_steps (this one has {k}).")
    if params is not None:
      params = _unscale.numbers_as_arrays(params)
      _checks.grads_match_params(grads, params)
    if (_checks.is_concrete((grads, state, params))
        and _checks.is_concrete(extra_args, numbers=False)):
      # Called eagerly: each lax.cond of a fresh trace would compile again
      # (seconds per call); one jitted update compiles once per shape.
      return jitted_update(grads, state, params, **extra_args)
    return traced_update(grads, state, params, **extra_args)

  def traced_update(grads, state, params=None, **extra_args):
    # Telemetry's measures for a loss scale that reads them (its MEASURES): this
    # transformation's own extra arguments, not the inner optimizer's.
    measured = _guard_state.pop_measures(extra_args)
    state = state._replace(fp8=_guard_state.observe_fp8(state.fp8, extra_args.pop("fp8_amax", None),
                                        axis_name))
    scale = state.loss_scale.loss_scale.astype(jnp.float32)
    if k == 1:
      return step(grads, state, params, extra_args, scale, jnp.array(True), measured)

    summed = jax.tree.map(
        lambda a, g: a + g.astype(a.dtype) if is_inexact(a) else a, state.acc_grads, grads)
    # Keep only finite sums: an overflowing micro-batch marks the step as
    # skipped instead of leaving NaN in the state until it ends.
    ok = ls_lib.all_finite(summed)
    acc = jax.tree.map(lambda s, a: jnp.where(ok, s, a), summed, state.acc_grads)
    acc_finite = state.acc_finite & ok
    # The loss scale decides on what every micro-batch measured, not the last.
    acc_measures = (None if state.acc_measures is None else
                    _guard_state.combine_measures(state.acc_measures, measured))
    # Micro-batches summed when this call ends a step: k, or more in a state
    # restored from a larger accumulate_steps (ended here, averaged over them).
    count = (state.mini_step + 1).astype(jnp.float32)
    step_measured = (measured if acc_measures is None else
                     _guard_state.finish_measures(acc_measures, measured, count))

    def emit():
      updates, new_state = step(acc, state, params, extra_args, scale * count,
                                acc_finite, step_measured)
      fresh = jax.tree.map(jnp.zeros_like, acc)
      return updates, new_state._replace(
          mini_step=jnp.zeros((), jnp.int32), acc_grads=fresh, acc_finite=jnp.array(True),
          acc_measures=None if acc_measures is None else _guard_state.measures_start(
              tuple(acc_measures), state.loss_scale))

    def wait():
      # ``skipped``: whether this call's batch was dropped (what a BatchNorm
      # step selects its statistics with), not the last completed step's.
      return _guard_state.no_op_updates(emit), state._replace(
          mini_step=state.mini_step + 1, acc_grads=acc, acc_finite=acc_finite,
          acc_measures=acc_measures, skipped=~ok)

    # ``>=``: a restored mini_step past k - 1 ends the accumulation (``==``
    # never matched again: no update ever after, no skip counted).
    return jax.lax.cond(state.mini_step >= k - 1, emit, wait)

  jitted_update = jax.jit(traced_update)
  return optax.GradientTransformationExtraArgs(_keyed.keyed(init, ("init",) + key),
                                               _keyed.keyed(update, ("update",) + key))
