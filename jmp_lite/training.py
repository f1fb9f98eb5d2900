"""Training helpers: MindSpore-style `value_and_grad` and a mixed-precision `TrainState`.

Two ways to write a step, from the same pieces:

* by hand, as MindSpore and PyTorch's GradScaler do: `value_and_grad` scales
  the loss, differentiates, unscales and checks finiteness; the caller adjusts
  the loss scale and selects the update;
* with optax: `TrainState` keeps the loss scale in its optimizer state (via
  `jmp_lite.optax.with_loss_scale`) and `TrainState.minimize` is the whole
  step.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import _guard_state
from jmp_lite import _dtypes
from jmp_lite import _replicas
from jmp_lite import _scaling
from jmp_lite import _scaled_grad
from jmp_lite import _struct
from jmp_lite import _unscale
from jmp_lite._value_and_grad import _check_telemetry
from jmp_lite._value_and_grad import _selection
from jmp_lite._value_and_grad import value_and_grad
from jmp_lite import distributed
from jmp_lite import loss_scale as ls_lib
from jmp_lite import optax as jo
from jmp_lite.policy import Policy, get_policy
from jmp_lite import telemetry as telemetry_lib

# Flax is loaded: jmp_lite's states serialise with flax.serialization too.
_struct.register_serialization()

__all__ = (
    "value_and_grad",
    "StepInfo",
    "TrainState",
)

def _narrow_params(apply_fn, params) -> tuple[Any, list]:
  """The narrowest ``param_dtype`` of the wrapped model whose ``apply`` is
  ``apply_fn`` (`jmp_lite.flax.wrap`; None for another function): its
  policy's and its rules' (a rule may store some modules' parameters in
  bf16), and ``(path, dtype)`` of the parameters narrower than it. Nothing
  where the modules' own dtype fields win (``module_dtypes=True``)."""
  rules = getattr(getattr(apply_fn, "__self__", None), "rules", None)
  policy = getattr(rules, "policy", None)
  if not isinstance(policy, Policy) or getattr(rules, "module_dtypes", False):
    return None, []
  policies = [policy, *(p for _, p in rules.classes), *(entry[-1] for entry in rules.paths),
              rules.norm]
  want = min((np.dtype(p.param_dtype) for p in policies if isinstance(p, Policy)),
             key=lambda d: d.itemsize)
  return want, [(jax.tree_util.keystr(path), np.dtype(leaf.dtype))
                for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
                if _dtypes.is_floating(leaf) and np.dtype(leaf.dtype).itemsize < want.itemsize]


def _warn_narrow_params(apply_fn, params) -> None:
  """Warns when the parameters are narrower than the ``param_dtype`` of the
  wrapped model whose ``apply`` is ``apply_fn`` (`jmp_lite.flax.wrap`): a
  bf16 checkpoint given to a ``p=f32`` model trains bf16 masters, the
  README's pure-bf16 row, with nothing said. (With ``policy=``, `create`
  casts them itself; `TrainState.minimize` then refuses them.)"""
  want, narrow = _narrow_params(apply_fn, params)
  if narrow:
    warnings.warn(
        f"TrainState.create: {len(narrow)} parameter(s) are narrower than the "
        f"wrapped model's param_dtype {want}, e.g. params{narrow[0][0]} is "
        f"{narrow[0][1]}: they would be trained as {narrow[0][1]} masters. Cast "
        f"them (policy.cast_to_param(params)), pass policy=, or make them with "
        "the wrapped model's init.", UserWarning, stacklevel=3)


def _check_param_dtypes(params: Any, policy: Optional[Policy], apply_fn=None) -> None:
  """Raises if a parameter left the policy's param dtype since `TrainState.create`.

  ``create`` casts them; one that differs now was replaced or restored (from
  a checkpoint, into the wrong target) in another dtype, and would otherwise
  train silently with bf16 master weights. Without ``policy``, the wrapped
  model's (``apply_fn``'s) ``param_dtype`` is the reference: parameters
  narrower than it are refused (`TrainState.create` warned of them).
  """
  if policy is None:
    want, narrow = _narrow_params(apply_fn, params)
    if narrow:
      path, dtype = narrow[0]
      raise TypeError(
          f"TrainState.minimize: parameter {path or '(root)'} is {dtype.name}, "
          f"narrower than the wrapped model's param_dtype {want.name} "
          f"({len(narrow)} such parameter(s)): they would be trained as "
          f"{dtype.name} master weights. A checkpoint restored into a target "
          "of another dtype does this; restore into jax.eval_shape of "
          "TrainState.create(...), or cast them (policy.cast_to_param).")
    return
  expected = jax.eval_shape(policy.cast_to_param, params)
  for (path, leaf), want in zip(jax.tree_util.tree_leaves_with_path(params),
                                jax.tree_util.tree_leaves(expected)):
    if hasattr(leaf, "dtype") and jnp.dtype(leaf.dtype) != want.dtype:
      raise TypeError(
          f"TrainState.minimize: parameter {jax.tree_util.keystr(path) or '(root)'} "
          f"is {jnp.dtype(leaf.dtype).name}{list(jnp.shape(leaf))}, but the "
          f"policy keeps parameters in {jnp.dtype(want.dtype).name}: it was "
          "replaced, or restored from a checkpoint into a target, in another "
          "dtype. Restore into jax.eval_shape of TrainState.create(...).")


class StepInfo(NamedTuple):
  """What `TrainState.minimize` reports about the step it took.

  With ``accumulate_steps=k``, a call that only accumulates its micro-batch
  took no step: its ``skipped`` is False (summed over calls, ``skipped``
  counts what ``skipped_steps`` counts), and ``grad_norm``, ``nonfinite``
  and ``stalled`` are those of the last completed step. ``dropped`` is set
  on every call: on one that only accumulates, whether its micro-batch
  overflowed and was left out of the sum; on one that ends a step, whether
  the step was skipped. Selecting with it keeps nothing non-finite that the
  forward pass wrote
  (``jmp_lite.select_tree(info.dropped, old_batch_stats, new_batch_stats)``);
  the statistics of healthy micro-batches of a skipped step stay.
  """

  # unscaled; with ``axis_name``, averaged over it (every replica the same,
  # as the other fields are), ``aux`` being each replica's own
  loss: jax.Array
  aux: Any
  skipped: jax.Array  # bool: this call completed a step, and skipped it
  loss_scale: jax.Array  # the scale this step's loss was scaled with
  grad_norm: jax.Array  # global norm of the unscaled gradients
  nonfinite: jo.NonFinite  # why the step was skipped, if it was
  # per-module precision statistics (`TrainState.minimize(telemetry=...)`)
  precision: Optional[telemetry_lib.PrecisionStats] = None
  # consecutive steps skipped with finite gradients (`LossScaleState.stalled`)
  stalled: Optional[jax.Array] = None
  # bool: this call's batch was not used (`LossScaleState.skipped`)
  dropped: Optional[jax.Array] = None


class TrainState(flax.struct.PyTreeNode):
  """A Flax-style train state whose optimizer carries the loss scale.

  Compatible with ``flax.training.train_state.TrainState`` conventions
  (``step``, ``apply_fn``, ``params``, ``tx``, ``opt_state``, ``create``,
  ``apply_gradients``); ``tx`` is wrapped in `jmp_lite.optax.with_loss_scale`
  by `create`, so the loss scale, skip counters and the optimizer checkpoint
  together. ``step`` counts calls (batches consumed), skipped ones included;
  the optimizer's own counters count applied steps.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jmp_lite
    >>> state = jmp_lite.TrainState.create(
    ...     apply_fn=lambda p, x: x @ p["w"], params={"w": jnp.ones((3, 1))},
    ...     tx=optax.sgd(0.1), loss_scale=jmp_lite.DynamicLossScale(2.0 ** 15),
    ...     policy="p=f32,c=bf16,o=f32")
    >>> @jax.jit
    ... def train_step(state, x, y):
    ...   def loss_fn(params):  # params arrive in bfloat16
    ...     pred = state.apply_fn(params, state.policy.cast_to_compute(x))
    ...     pred = state.policy.cast_to_output(pred)[:, 0]
    ...     return jnp.mean((pred - y) ** 2)
    ...   return state.minimize(loss_fn)
    >>> state, info = train_step(state, jnp.ones((4, 3)), jnp.zeros(4))
    >>> int(state.step), bool(info.skipped), state.params["w"].dtype.name
    (1, False, 'float32')
  """

  step: jax.Array
  apply_fn: Callable[..., Any] = flax.struct.field(pytree_node=False)
  params: Any = flax.struct.field(pytree_node=True)
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
  opt_state: optax.OptState = flax.struct.field(pytree_node=True)
  policy: Optional[Policy] = flax.struct.field(pytree_node=False, default=None)
  axis_name: ls_lib.AxisName = flax.struct.field(pytree_node=False, default=None)

  @classmethod
  def create(cls, *, apply_fn, params, tx, loss_scale=None, policy=None,
             clip_norm=None, accumulate_steps=1, axis_name=None, fp8=None,
             max_stalled_steps=None, **kwargs) -> "TrainState":
    """Creates a state: params cast to the policy's param dtype, ``tx`` wrapped.

    Args:
      apply_fn: the model's apply function (kept for the user's loss function).
      params: the parameters.
      tx: the optimizer.
      loss_scale: initial loss scale (default `jmp_lite.NoOpLossScale`).
      policy: optional policy; ``minimize`` casts params to its compute dtype.
      clip_norm: passed to `jmp_lite.optax.with_loss_scale`.
      accumulate_steps: passed to `jmp_lite.optax.with_loss_scale`.
      axis_name: for ``minimize`` under ``shard_map``: the data-parallel mesh
        axis (or axes). Gradients are then averaged across it in the policy's
        ``reduce_dtype`` (float32 by default) and replicas agree on a skip.
      fp8: a `jmp_lite.fp8.Fp8State` (`jmp_lite.fp8.init` on the loss
        function ``minimize`` will be given): ``minimize`` then runs those
        matmuls in fp8 with delayed scaling, the metadata kept beside the
        loss scale (`jmp_lite.optax.LossScaleState.fp8`).
      max_stalled_steps: passed to `jmp_lite.optax.with_loss_scale` (a step
        raises after this many consecutive steps skipped with finite
        gradients; None: never).
      **kwargs: further fields of a subclass.
    """
    policy = get_policy(policy) if policy is not None else None
    # Python numbers and weakly typed arrays become strongly typed arrays:
    # what a step writes back, so the state's types do not change after the
    # first step (which would compile it twice).
    params = _unscale.strongly_typed(_unscale.numbers_as_arrays(params))
    if policy is not None:
      params = policy.cast_to_param(params)
    else:
      _warn_narrow_params(apply_fn, params)
    if loss_scale is None:
      loss_scale = ls_lib.NoOpLossScale()
    axis_name = _scaling.check_axis_name(axis_name, "TrainState.create")
    tx = jo.with_loss_scale(tx, loss_scale, clip_norm=clip_norm,
                            accumulate_steps=accumulate_steps, axis_name=axis_name,
                            fp8=fp8, max_stalled_steps=max_stalled_steps)
    return cls(step=jnp.zeros((), jnp.int32), apply_fn=apply_fn, params=params,
               tx=tx, opt_state=tx.init(params), policy=policy,
               axis_name=axis_name, **kwargs)

  @property
  def loss_scale(self) -> ls_lib.LossScale:
    """The loss scale to scale the next loss with."""
    return jo.get_loss_scale(self.opt_state)

  @property
  def loss_scale_state(self) -> jo.LossScaleState:
    return jo.find_loss_scale_state(self.opt_state)

  def apply_gradients(self, *, grads, scaled: Optional[bool] = None,
                      **kwargs) -> "TrainState":
    """Applies the gradients of ``self.loss_scale.scale(loss)`` (still scaled).

    Unscaling, the finiteness check, clipping and skipping happen in ``tx``.
    Under a loss scale other than `jmp_lite.NoOpLossScale`, say so with
    ``scaled=True``: the gradients of an unscaled loss (Flax's
    ``apply_gradients(grads=jax.grad(loss)(params))``) would be divided by
    the scale, steps 2**15 times too small with nothing to show it.
    `minimize` scales, differentiates and applies in one call.

    Raises:
      TypeError: under a loss scale, if ``scaled`` is not True.
    """
    if not isinstance(self.loss_scale, ls_lib.NoOpLossScale) and scaled is not True:
      raise TypeError(
          f"TrainState.apply_gradients: this state scales the loss "
          f"({type(self.loss_scale).__name__}), and these gradients are divided "
          "by its scale. Pass gradients of state.loss_scale.scale(loss) with "
          "scaled=True, or let state.minimize(loss_fn, *args) scale, "
          "differentiate and apply (gradients of the plain loss would make "
          f"steps loss-scale times too small). Got scaled={scaled!r}.")
    return self._apply(grads, {}, **kwargs)

  def _apply(self, grads, extra_args: dict, **kwargs) -> "TrainState":
    """`apply_gradients`, with extra arguments for ``tx.update``."""
    updates, opt_state = self.tx.update(grads, self.opt_state, self.params,
                                        **extra_args)
    return self.replace(step=self.step + 1,
                        params=jo.apply_updates(self.params, updates),
                        opt_state=opt_state, **kwargs)

  def minimize(self, loss_fn: Callable[..., Any], *args, has_aux: bool = False,
               telemetry: Optional[telemetry_lib.Telemetry] = None,
               **kwargs) -> tuple["TrainState", StepInfo]:
    """One whole step: scaled loss, gradients, skip-or-update, scale adjust.

    Args:
      loss_fn: called as ``loss_fn(params, *args, **kwargs)``; returns a
        scalar loss, or ``(loss, aux)`` with ``has_aux=True``.
      *args: further arguments of ``loss_fn`` (not differentiated).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      telemetry: a `jmp_lite.Telemetry`: ``info.precision`` is then this
        step's `jmp_lite.PrecisionStats` (zeros on steps ``telemetry.every``
        skips, counted by ``self.step``), reduced over ``axis_name``.
      **kwargs: keyword arguments of ``loss_fn``.

    The optimizer's ``update`` is given the loss as ``value=`` (averaged over
    ``axis_name``; with ``accumulate_steps``, the last micro-batch's), which
    optimizers that read it take (``optax.contrib.reduce_on_plateau``,
    ``optax.polyak_sgd``) and others ignore.

    Returns:
      The new state and a `StepInfo`.
    """
    if not callable(loss_fn):
      raise TypeError(
          "TrainState.minimize: loss_fn must be a function of the parameters, "
          "called as loss_fn(params, *args, **kwargs), got "
          f"{type(loss_fn).__name__} (pass the function, not its value: "
          "state.minimize(loss_fn, x, y)).")
    telemetry = _check_telemetry(telemetry, "TrainState.minimize")
    params = self.params
    _check_param_dtypes(params, self.policy, self.apply_fn)
    _replicas.check_replicated_params(params, self.axis_name, "TrainState.minimize")
    if self.axis_name is not None:
      # Per-device gradients, so that JAX does not sum them itself in the
      # compute dtype; reduce_gradients averages them in reduce_dtype.
      params = distributed.mark_varying(params, self.axis_name)
    fp8 = self.loss_scale_state.fp8
    if fp8 is not None:  # in step with the loss scale whoever set it
      fp8 = fp8.follow_loss_scale(self.loss_scale.loss_scale)
    # Integer leaves (step counters, masks kept with the parameters) get
    # float0 gradients and zero updates, as the guard gives them.
    vg = _scaled_grad.scaled_value_and_grad(loss_fn, 0, has_aux, self.policy, telemetry,
                                self.axis_name, _selection(fp8), allow_int=True)
    measured = {}
    if getattr(type(self.loss_scale), "MEASURES", ()) == ("modules",):
      # A loss scale per module: its own pass, which measures the modules.
      if telemetry is not None or fp8 is not None:
        raise ValueError(
            "TrainState.minimize: a ModuleLossScale cannot be combined with "
            "telemetry or fp8 in the same step yet; use a DynamicLossScale, "
            "UnderflowAwareLossScale or AutomaticLossScale with them.")
      value, grads, modules = _scaled_grad.module_scaled_value_and_grad(
          loss_fn, 0, has_aux, self.policy, allow_int=True)(
              self.loss_scale, params, *args, **kwargs)
      if self.axis_name is not None:
        # Every column adds up across replicas (counts, one-hot maxima).
        modules = jax.lax.psum(modules, self.axis_name)
      measured[_guard_state.MEASURE_PREFIX + "modules"] = modules
      stats = None
    elif telemetry is None and fp8 is None:
      value, grads = vg(self.loss_scale, params, *args, **kwargs)
      stats = None
    else:
      value, grads, stats, amax = vg(self.step, fp8, self.loss_scale, params, *args,
                                     **kwargs)
      if fp8 is not None:
        measured["fp8_amax"] = amax
    if self.axis_name is not None:
      grads = distributed.reduce_gradients(grads, self.axis_name, policy=self.policy)
    loss, aux = value if has_aux else (value, None)
    used_scale = self.loss_scale.loss_scale
    reads = getattr(type(self.loss_scale), "MEASURES", ())
    if stats is not None and reads and "modules" not in reads:
      # What this step measured of its half-precision cotangents (zero
      # underflow on steps telemetry does not sample), for the loss scale.
      offered = dict(
          underflow=jnp.where(stats.sampled, stats.cotangent_underflow, 0.0),
          headroom=stats.cotangent_headroom, upper=stats.cotangent_upper,
          sampled=stats.sampled)
      measured.update({_guard_state.MEASURE_PREFIX + n: offered[n] for n in reads})
    # The loss, for optimizers whose update reads it (``value=``:
    # optax.contrib.reduce_on_plateau, polyak_sgd), the same on every replica.
    measured["value"] = loss if self.axis_name is None else jax.lax.pmean(
        loss, self.axis_name)
    new = self._apply(grads, measured)
    info = new.loss_scale_state
    # A call that only accumulated (mini_step counts on) skipped nothing.
    skipped = info.skipped & (info.mini_step == 0)
    return new, StepInfo(loss=measured["value"], aux=aux, skipped=skipped,
                         loss_scale=used_scale, grad_norm=info.grad_norm,
                         nonfinite=info.nonfinite, precision=stats,
                         stalled=info.stalled, dropped=info.skipped)
