"""optax transformations: loss scaling that skips a bad step atomically, and
(re-exported from `jmp_lite.rounding`) updates for low-precision parameters.

`with_loss_scale(inner, loss_scale)` wraps any optax optimizer. Its state
holds the loss scale next to the whole inner state, so one ``update`` call
decides, for the whole chain, whether a step happens::

    sumsq  = sum((g * inv_scale) ** 2)            # one pass over the gradients
    finite = isfinite(sumsq) or all_finite(g)     # exact check only if sumsq is not
    norm   = sqrt(sumsq)
    if finite:
      clip = min(1, clip_norm / norm)             # optional
      updates, inner_state = inner.update(g * (inv_scale * clip), ...)
    else:
      updates = -0.0; inner_state unchanged       # second pass, fused
    loss_scale = loss_scale.adjust(finite)

Why one transformation rather than a chain of ``unscale``, ``all_finite``,
``clip_by_global_norm`` and ``apply_if_finite``:

* the chain reads the gradients four times; this reads them twice;
* clipping can only see unscaled gradients, so the most common
  mixed-precision bug (clipping scaled gradients) cannot be written;
* a skipped step freezes everything inside ``inner``: schedules, Adam's
  moments and counts, ``MultiSteps`` counters. optax's ``apply_if_finite``
  freezes only what it wraps, and after ``max_consecutive_errors`` it applies
  the non-finite update; this never does, however many steps overflow;
* skipped updates are ``-0.0``, the one value that leaves every parameter
  bitwise unchanged under ``optax.apply_updates`` (``-0.0 + 0.0`` is ``+0.0``
  but ``x + -0.0`` is ``x`` for every ``x``).

Gradient accumulation is built in (``accumulate_steps``) rather than left to
``optax.MultiSteps``: MultiSteps resets its accumulator by multiplying it by
zero, so one overflowing micro-batch leaves NaN in it for every later step.
Here scaled micro-batch gradients are summed in float32, the accumulator is
reset with fresh zeros, and an overflow in any micro-batch skips the whole
accumulated step; the loss scale stays fixed within an accumulation.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import loss_scale as ls_lib
from jmp_lite.policy import is_floating
from jmp_lite.policy import wide_dtype
from jmp_lite.rounding import KahanState
from jmp_lite.rounding import StochasticRoundState
from jmp_lite.rounding import kahan_summation
from jmp_lite.rounding import stochastic_round
from jmp_lite.rounding import with_state_dtype

__all__ = (
    "find_loss_scale_state",
    "get_loss_scale",
    "KahanState",
    "kahan_summation",
    "LossScaleState",
    "stochastic_round",
    "StochasticRoundState",
    "with_loss_scale",
    "with_state_dtype",
)


class LossScaleState(NamedTuple):
  """State of `with_loss_scale`.

  Attributes:
    loss_scale: the loss scale to scale the next loss with.
    inner_state: the wrapped optimizer's state (frozen on skipped steps).
    skipped: bool, whether the last completed step was skipped.
    skipped_steps: int32, how many steps were skipped so far.
    grad_norm: float32, global norm of the last applied step's unscaled
      gradients, before clipping (a skipped step leaves it unchanged, so no
      non-finite value ever enters the optimizer state).
    mini_step: int32, micro-batches accumulated so far in this step.
    acc_grads: float32 sum of scaled micro-batch gradients (``()`` when
      ``accumulate_steps == 1``).
  """

  loss_scale: ls_lib.LossScale
  inner_state: optax.OptState
  skipped: jax.Array
  skipped_steps: jax.Array
  grad_norm: jax.Array
  mini_step: jax.Array
  acc_grads: Any


def _global_norm_and_finite(grads: Any, inv_scale: jax.Array):
  """Unscaled global norm and finiteness of ``grads``, from one pass in the common case."""
  leaves = [g for g in jax.tree_util.tree_leaves(grads) if is_floating(g)]
  if not leaves:
    return jnp.zeros((), jnp.float32), jnp.array(True)

  def sumsq(scale):
    parts = [jnp.sum(jnp.square(g.astype(jnp.float32) * scale)) for g in leaves]
    return jnp.sum(jnp.stack(parts))

  sq = sumsq(inv_scale)

  def slow():
    # The squares overflowed float32: either an element is not finite, or the
    # norm is beyond float32's square root. Tell the two apart exactly, and
    # rescale by the largest magnitude to get a finite norm in the second case.
    finite = ls_lib.all_finite(leaves)
    top = jnp.max(jnp.stack([jnp.max(jnp.abs(g.astype(jnp.float32))) for g in leaves]))
    top = jnp.where(finite & (top > 0), top, 1.0)
    norm = jnp.sqrt(sumsq(1 / top)) * (top * inv_scale)
    return jnp.where(finite, norm, jnp.nan), finite

  # The true branch returns `finite` (True), not a constant, so that both
  # branches have the same varying manual axes under `shard_map`.
  finite = jnp.isfinite(sq)
  return jax.lax.cond(finite, lambda: (jnp.sqrt(sq), finite), slow)


def _no_op_updates(update_fn) -> Any:
  """``-0.0`` in the shapes and dtypes of the updates ``update_fn()`` returns.

  ``x + -0.0`` is ``x`` for every ``x`` (``+0.0`` would turn ``-0.0`` params
  into ``+0.0``), so these updates leave params bitwise unchanged.
  """
  shapes, _ = jax.eval_shape(update_fn)
  return jax.tree.map(lambda s: jnp.full_like(s, -0.0), shapes)


def _check_grads_match_params(grads: Any, params: Any) -> None:
  """Raises ValueError naming the first gradient whose shape differs from its parameter's."""
  g_leaves, g_def = jax.tree_util.tree_flatten_with_path(grads)
  p_leaves, p_def = jax.tree_util.tree_flatten_with_path(params)
  if g_def != p_def:
    keystr = jax.tree_util.keystr
    g_paths = {keystr(k) for k, _ in g_leaves}
    p_paths = {keystr(k) for k, _ in p_leaves}
    raise ValueError(
        "with_loss_scale.update: the gradients and the parameters differ in "
        f"structure: parameters without a gradient {sorted(p_paths - g_paths)}, "
        f"gradients without a parameter {sorted(g_paths - p_paths)}.\n"
        f"  grads:  {g_def}\n  params: {p_def}")
  p_leaves = [p for _, p in p_leaves]
  for (path, g), p in zip(g_leaves, p_leaves):
    if np.shape(g) != np.shape(p):
      raise ValueError(
          f"with_loss_scale.update: gradient {jax.tree_util.keystr(path)} has shape "
          f"{np.shape(g)} but its parameter has shape {np.shape(p)}.")


def with_loss_scale(
    inner: optax.GradientTransformation,
    loss_scale: ls_lib.LossScale,
    *,
    clip_norm: Optional[float] = None,
    accumulate_steps: int = 1,
    axis_name: ls_lib.AxisName = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so that it receives unscaled gradients and skips bad steps.

  ``update`` takes the gradients of ``loss_scale.scale(loss)``, scaled by the
  scale found with `get_loss_scale` in the same state; on a step whose
  gradients are not finite it returns ``-0.0`` updates and leaves ``inner``'s
  state unchanged, then adjusts the scale. Put it outermost: everything inside
  ``inner`` is frozen on a skipped step.

  Args:
    inner: the optimizer to wrap (any optax transformation or chain).
    loss_scale: the initial loss scale (`jmp_lite.DynamicLossScale` to adapt).
    clip_norm: if set, clip the unscaled gradients to this global norm, with
      the norm computed in the same pass as the finiteness check.
    accumulate_steps: number of micro-batches whose gradients are summed
      (averaged) into one step. Updates are zero on the other calls.
    axis_name: under ``shard_map``/``pmap``, the mesh axis (or axes) across
      which replicas must agree to skip: one replica's overflow skips the
      step everywhere. Not needed under ``jax.jit`` with sharded arrays, where
      the check is already global. The norm used for clipping is that of the
      gradients each replica holds (reduce them across devices first).

  Returns:
    A `optax.GradientTransformationExtraArgs` whose state is `LossScaleState`.

  Raises:
    TypeError: if ``loss_scale`` is not a loss scale.
    ValueError: for a non-positive ``clip_norm`` or ``accumulate_steps``.

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
  if not isinstance(loss_scale, (ls_lib.NoOpLossScale, ls_lib.StaticLossScale,
                                 ls_lib.DynamicLossScale)):
    raise TypeError(
        f"with_loss_scale: loss_scale must be a jmp_lite loss scale, got {loss_scale!r}")
  if clip_norm is not None:
    if isinstance(clip_norm, (str, bool)) or np.ndim(clip_norm) != 0:
      raise TypeError(
          f"with_loss_scale: clip_norm must be a positive number, got {clip_norm!r}")
    if not (np.isfinite(clip_norm) and clip_norm > 0):
      raise ValueError(
          f"with_loss_scale: clip_norm must be > 0 and finite, got {clip_norm!r}")
  axis_name = ls_lib.check_axis_name(axis_name, "with_loss_scale")
  if int(accumulate_steps) != accumulate_steps or accumulate_steps < 1:
    raise ValueError(
        f"with_loss_scale: accumulate_steps must be a whole number >= 1, got "
        f"{accumulate_steps!r}")
  inner = optax.with_extra_args_support(inner)
  k = int(accumulate_steps)

  def init(params):
    acc = () if k == 1 else jax.tree.map(
        lambda p: jnp.zeros(jnp.shape(p), wide_dtype(p.dtype)), params)
    return LossScaleState(
        loss_scale=loss_scale,
        inner_state=inner.init(params),
        skipped=jnp.array(False),
        skipped_steps=jnp.zeros((), jnp.int32),
        grad_norm=jnp.zeros((), jnp.float32),
        mini_step=jnp.zeros((), jnp.int32),
        acc_grads=acc,
    )

  def step(grads, state, params, inv_scale, extra_args):
    norm, finite = _global_norm_and_finite(grads, inv_scale)
    if axis_name is not None:
      finite = jax.lax.psum((~finite).astype(jnp.int32), axis_name) == 0
    factor = inv_scale
    if clip_norm is not None:
      factor = inv_scale * jnp.minimum(1.0, clip_norm / jnp.where(finite, norm, 1.0))
    like = params if params is not None else grads

    def unscale(g, p):
      wide = wide_dtype(g.dtype)
      return (g.astype(wide) * factor.astype(wide)).astype(p.dtype)

    def apply():
      unscaled = jax.tree.map(unscale, grads, like)
      return inner.update(unscaled, state.inner_state, params, **extra_args)

    def skip():
      return _no_op_updates(apply), state.inner_state

    updates, inner_state = jax.lax.cond(finite, apply, skip)
    new_state = state._replace(
        loss_scale=state.loss_scale.adjust(finite),
        inner_state=inner_state,
        skipped=~finite,
        skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
        grad_norm=jnp.where(finite, norm, state.grad_norm).astype(jnp.float32),
    )
    return updates, new_state

  def update(grads, state, params=None, **extra_args):
    if params is not None:
      _check_grads_match_params(grads, params)
    inv_scale = 1 / state.loss_scale.loss_scale.astype(jnp.float32)
    if k == 1:
      return step(grads, state, params, inv_scale, extra_args)

    acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), state.acc_grads, grads)

    def emit():
      updates, new_state = step(acc, state, params, inv_scale / k, extra_args)
      fresh = jax.tree.map(jnp.zeros_like, acc)
      return updates, new_state._replace(mini_step=jnp.zeros((), jnp.int32),
                                         acc_grads=fresh)

    def wait():
      return _no_op_updates(emit), state._replace(
          mini_step=state.mini_step + 1, acc_grads=acc)

    return jax.lax.cond(state.mini_step == k - 1, emit, wait)

  return optax.GradientTransformationExtraArgs(init, update)


def find_loss_scale_state(opt_state: Any) -> LossScaleState:
  """Returns the one `LossScaleState` inside ``opt_state`` (nested anywhere).

  Raises:
    ValueError: if there is none, or more than one.
  """
  found = [s for s in jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(x, LossScaleState))
           if isinstance(s, LossScaleState)]
  if len(found) != 1:
    raise ValueError(
        f"Expected exactly one jmp_lite.optax.with_loss_scale state in opt_state, "
        f"found {len(found)} in {jax.tree_util.tree_structure(opt_state)}.")
  return found[0]


def get_loss_scale(opt_state: Any) -> ls_lib.LossScale:
  """Returns the loss scale to scale the next loss with, from any ``opt_state``.

  Finds the state of `with_loss_scale` wherever it sits (inside
  ``optax.chain``, ``optax.inject_hyperparams``, ``optax.MultiSteps`` ...).
  """
  return find_loss_scale_state(opt_state).loss_scale
