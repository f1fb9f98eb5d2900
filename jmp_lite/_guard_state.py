"""The state `jmp_lite.optax.with_loss_scale` keeps, how its fields move that are
not the step's arithmetic (the loss scale, telemetry's measures, the fp8
metadata, a skipped call's updates), and finding it in any optax state."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jmp_lite import _checks
from jmp_lite import loss_scale as ls_lib


class NonFinite(NamedTuple):
  """Which part of the last step was not finite: one bool scalar each.

  ``grads`` covers the gradients (and, with accumulation, any micro-batch of
  the step or their sum); the others are checked only when the gradients were
  finite, and are False otherwise.
  """

  grads: jax.Array
  updates: jax.Array
  params: jax.Array  # params + updates, in the parameters' dtypes
  opt_state: jax.Array  # the inner optimizer's new state


def _no_nonfinite() -> NonFinite:
  false = jnp.array(False)
  return NonFinite(false, false, false, false)


class LossScaleState(NamedTuple):
  """State of `with_loss_scale`.

  Attributes:
    loss_scale: the loss scale to scale the next loss with.
    inner_state: the wrapped optimizer's state (frozen on skipped steps).
    skipped: bool, whether the last call's gradients were discarded: the
      step it completed was skipped, or (with ``accumulate_steps``, on a call
      that only accumulates) its micro-batch overflowed and was dropped.
    skipped_steps: int32, how many steps were skipped so far.
    grad_norm: global norm of the last applied step's unscaled gradients,
      before clipping (float32; float64 when a gradient is float64). A
      skipped step leaves it unchanged, and a norm beyond the dtype's range is
      stored as its largest value, so it is always finite.
    nonfinite: `NonFinite`, why the last completed step was skipped.
    mini_step: int32, micro-batches accumulated so far in this step.
    acc_grads: float32 sum of scaled micro-batch gradients (``()`` when
      ``accumulate_steps == 1``); only finite sums are kept.
    acc_finite: bool, whether every micro-batch of this step was finite.
    stalled: int32, consecutive steps skipped although the gradients were
      finite (what the step would write overflowed). Any other step resets
      it; ``with_loss_scale(max_stalled_steps=)`` bounds it.
    fp8: the `jmp_lite.fp8.Fp8State` of the step's fp8 matmuls, or None.
      Metadata beside the loss scale, never a gradient: the maxima the step
      observed (``update``'s ``fp8_amax``) are max-reduced over micro-batches
      and replicas and recorded once per step, skipped or not, and the
      gradient histories follow the loss scale when it changes.
    acc_measures: with ``accumulate_steps > 1`` and a loss scale that reads
      telemetry (its ``MEASURES``), what the micro-batches of this step
      measured so far, combined as `combine_measures` says; else None.
  """

  loss_scale: ls_lib.LossScale
  inner_state: optax.OptState
  skipped: jax.Array
  skipped_steps: jax.Array
  grad_norm: jax.Array
  nonfinite: NonFinite
  mini_step: jax.Array
  acc_grads: Any
  acc_finite: jax.Array
  fp8: Any = None
  stalled: Any = None
  acc_measures: Any = None


# What `with_loss_scale.update` takes for a loss scale that reads telemetry:
# ``loss_scale_<name>=`` extra arguments, one per name its ``MEASURES`` lists.
MEASURE_PREFIX = "loss_scale_"


def adjust(loss_scale, finite, measured):
  """``loss_scale.adjust(finite)``, with telemetry's measures where it reads them."""
  names = getattr(type(loss_scale), "MEASURES", ())
  given = {n: measured[n] for n in names if measured.get(n) is not None}
  if getattr(type(loss_scale), "MEASURES_REQUIRED", False) and len(given) < len(names):
    missing = [f"{MEASURE_PREFIX}{n}=" for n in names if n not in given]
    if names == ("modules",):
      raise ValueError(
          f"{type(loss_scale).__name__} steers by what the step's modules measured, "
          f"and this step gave it no {MEASURE_PREFIX}modules=: use "
          "TrainState.minimize, or pass with_loss_scale's update the modules "
          "that jmp_lite.value_and_grad(...) returns with this loss scale.")
    raise ValueError(
        f"{type(loss_scale).__name__} steers by what telemetry measures, and this "
        f"step gave it no {', '.join(missing)}: use TrainState.minimize(..., "
        "telemetry=jmp_lite.Telemetry()), or pass them to with_loss_scale's update "
        "from the step's PrecisionStats (cotangent_upper, sampled).")
  if not given:
    return loss_scale.adjust(finite)
  return loss_scale.adjust(finite, **given)


def observe_fp8(fp8, amax, axis_name):
  """This micro-batch's fp8 maxima max-reduced into the state."""
  if (fp8 is None) != (amax is None):
    raise ValueError(
        "with_loss_scale.update: " + (
            "the state has fp8 metadata (fp8=), so update needs the step's "
            "fp8 maxima as fp8_amax= (TrainState.minimize passes them)"
            if amax is None else
            "fp8_amax= was given but the state has no fp8 metadata (pass fp8= "
            "to with_loss_scale or TrainState.create)"))
  if fp8 is None:
    return None
  if axis_name is not None:
    amax = jax.tree.map(lambda a: jax.lax.pmax(a, axis_name), amax)
  return fp8.observe(amax)


def fp8_step_end(fp8, old_scale, new_scale):
  """The step's maxima (measured under ``old_scale``) recorded, and the
  gradient histories moved to ``new_scale``."""
  if fp8 is None:
    return None
  return (fp8.follow_loss_scale(old_scale.loss_scale).commit()
          .follow_loss_scale(new_scale.loss_scale))


def no_op_updates(update_fn) -> Any:
  """``-0.0`` in the shapes and dtypes of the updates ``update_fn()`` returns.

  ``x + -0.0`` is ``x`` for every ``x`` (``+0.0`` would turn ``-0.0`` params
  into ``+0.0``), so these updates leave params bitwise unchanged.
  """
  shapes = jax.eval_shape(update_fn)[0]
  return jax.tree.map(lambda s: jnp.full_like(s, -0.0), shapes)


def pop_measures(extra_args: dict) -> dict:
  """The ``loss_scale_<name>=`` measures, removed from ``extra_args`` (this
  transformation's own arguments, not the inner optimizer's)."""
  return {k[len(MEASURE_PREFIX):]: extra_args.pop(k)
          for k in list(extra_args) if k.startswith(MEASURE_PREFIX)}


# How a step's micro-batches combine each telemetry measure a loss scale
# reads: shares are averaged (every micro-batch has the same shapes, so the
# upper bin's share averages exactly; the underflow share is the mean of
# the micro-batches' shares), the headroom is the smallest, and a step is
# sampled if any micro-batch was (they share the step number).
# A `jmp_lite.ModuleLossScale`'s measurements add up (counts, one-hot maxima).
_COMBINE = {"underflow": "mean", "upper": "mean", "headroom": "min", "sampled": "any",
            "modules": "sum"}
_START = {"mean": 0.0, "min": float("inf"), "any": False, "sum": 0.0}


def measures_start(names, loss_scale=None) -> Optional[dict]:
  """The empty combination of the measures ``names`` (None if there are
  none); a summed measure has ``loss_scale.measure_shape()``."""
  if not names:
    return None
  unknown = [n for n in names if n not in _COMBINE]
  if unknown:
    raise ValueError(f"with_loss_scale: no rule to combine micro-batches' measures {unknown}")
  out = {}
  for n in names:
    rule = _COMBINE[n]
    shape = loss_scale.measure_shape() if rule == "sum" else ()
    out[n] = jnp.full(shape, _START[rule], jnp.bool_ if rule == "any" else jnp.float32)
  return out


def combine_measures(acc: dict, measured: dict) -> dict:
  """``acc`` with one more micro-batch's ``measured`` folded in (sums for means)."""
  out = dict(acc)
  for name, value in measured.items():
    if name not in out or value is None:
      continue
    rule = _COMBINE[name]
    if rule in ("mean", "sum"):
      out[name] = out[name] + jnp.asarray(value, jnp.float32)
    elif rule == "min":
      out[name] = jnp.minimum(out[name], jnp.asarray(value, jnp.float32))
    else:
      out[name] = out[name] | jnp.asarray(value, jnp.bool_)
  return out


def finish_measures(acc: dict, given: dict, k) -> dict:
  """The step's measures from ``k`` micro-batches' combination (the names
  some micro-batch gave, ``given``); ``k`` may be traced."""
  return {n: v / k if _COMBINE[n] == "mean" else v
          for n, v in acc.items() if given.get(n) is not None}


def _contains_loss_scale_state(tree: Any) -> bool:
  return any(isinstance(x, LossScaleState) for x in jax.tree_util.tree_leaves(
      tree, is_leaf=lambda x: isinstance(x, LossScaleState)))


def find_loss_scale_state(opt_state: Any) -> LossScaleState:
  """Returns the one `LossScaleState` inside ``opt_state`` (nested anywhere).

  Raises:
    ValueError: if there is none, or more than one.
  """
  def search(tree):
    found = [s for s in jax.tree_util.tree_leaves(
        tree, is_leaf=lambda x: isinstance(x, LossScaleState))
             if isinstance(s, LossScaleState)]
    # A state nested inside another (built by hand) must count too.
    return found + [n for s in found for n in search(s.inner_state)]

  found = search(opt_state)
  if _checks.multisteps_around(opt_state, lambda x: isinstance(x, LossScaleState)):
    raise ValueError(
        "with_loss_scale inside optax.MultiSteps: MultiSteps keeps a NaN from "
        "one overflowing micro-batch in its accumulator for good, and every "
        "later step is skipped. Use with_loss_scale(..., accumulate_steps=k) "
        "instead.")
  if len(found) != 1:
    raise ValueError(
        f"Expected exactly one jmp_lite.optax.with_loss_scale state in opt_state, "
        f"found {len(found)} in {jax.tree_util.tree_structure(opt_state)}.")
  _warn_if_chained_after(opt_state)
  # `nnx.Optimizer` holds each array of its optax state in a Variable
  # (`OptArray`, a pytree node): read as the arrays an optax state holds, so
  # that ``.skipped`` is a flag `jmp_lite.select_tree` and `lax.cond` take.
  # A Variable holding None (the moment of an integer Param, which the inner
  # optimizer sees as None) has no leaves and stays as it is.
  wrapped = lambda x: hasattr(x, "__jax_array__") and not isinstance(x, jax.Array)
  return jax.tree.map(lambda x: jnp.asarray(x) if wrapped(x) and jax.tree.leaves(x) else x,
                      found[0], is_leaf=wrapped)


def _warn_if_chained_after(opt_state: Any) -> None:
  """Warns when ``with_loss_scale`` is not first in an ``optax.chain`` (whose
  state is a plain tuple): the transformations before it receive the
  scaled gradients (``optax.chain(optax.clip_by_global_norm(1.0),
  with_loss_scale(...))`` clips the gradients times 2**15, then unscales:
  steps 2**15 times too small)."""
  if type(opt_state) is not tuple:  # pylint: disable=unidiomatic-typecheck
    return
  has = lambda tree: any(isinstance(x, LossScaleState) for x in jax.tree_util.tree_leaves(
      tree, is_leaf=lambda x: isinstance(x, LossScaleState)))
  position = next((i for i, part in enumerate(opt_state) if has(part)), 0)
  if position > 0:
    warnings.warn(
        f"with_loss_scale is chained after {position} other transformation(s): "
        "they receive the scaled gradients (a clip by global norm would clip "
        "them loss-scale times too much). Put it first (outermost): give the "
        "others to it as its inner optimizer, and clip with clip_norm=.",
        UserWarning, stacklevel=3)


def get_loss_scale(opt_state: Any) -> ls_lib.LossScale:
  """Returns the loss scale to scale the next loss with, from any ``opt_state``.

  Finds the state of `with_loss_scale` wherever it sits (inside
  ``optax.chain``, ``optax.inject_hyperparams``, ``optax.masked`` ...).
  """
  return find_loss_scale_state(opt_state).loss_scale
