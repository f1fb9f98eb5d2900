"""MindSpore-style `jmp_lite.value_and_grad`: scale the loss, differentiate,
unscale, check finiteness, in one call (the by-hand half of
`jmp_lite.training`, whose `TrainState.minimize` builds on the same pieces)."""

from __future__ import annotations

import functools
import reprlib
from typing import Any, Callable, Optional, Sequence, Union

import jax

from jmp_lite import _checks
from jmp_lite._jaxpr.passes import plan as _plan
from jmp_lite import _replicas
from jmp_lite import _scaling
from jmp_lite import _scaled_grad
from jmp_lite.fp8 import Fp8State
from jmp_lite import loss_scale as ls_lib
from jmp_lite.policy import Policy, get_policy
from jmp_lite import telemetry as telemetry_lib

ArgNums = Union[int, Sequence[int]]


def value_and_grad(
    fun: Callable[..., Any],
    *,
    argnums: ArgNums = 0,
    has_aux: bool = False,
    policy: Optional[Union[Policy, str]] = None,
    axis_name: ls_lib.AxisName = None,
    telemetry: Optional[telemetry_lib.Telemetry] = None,
    allow_int: bool = False,
) -> Callable[..., tuple[Any, ...]]:
  """Like `jax.value_and_grad`, with loss scaling and a finiteness flag.

  Returns a function with ``fun``'s arguments plus a keyword-only
  ``loss_scale`` (default `jmp_lite.NoOpLossScale`), returning
  ``(value, grads, grads_finite)``: ``value`` is ``fun``'s unscaled output,
  ``grads`` the unscaled gradients in the dtype of the differentiated
  arguments, ``grads_finite`` a scalar bool. The loss is scaled with the
  scale passed in, and the gradients are unscaled with that same scale.

  With ``policy``, the differentiated arguments are cast to its compute dtype
  before ``fun`` sees them and the loss is returned in float32. A half
  compute dtype runs ``fun`` under the precision engine, as
  `jmp_lite.flax.wrap` does: its matmuls and their gradients accumulate in
  float32, and under ``jit`` with a sharded batch the gradients are reduced
  across devices in the policy's ``reduce_dtype``. A policy with
  an ``autocast_dtype`` (``"O1"``) runs the whole differentiated step under
  `jmp_lite.autocast`: matmuls of the forward and backward pass in that dtype
  with float32 accumulation, fragile ops in float32.

  A complete jitted step, MindSpore's ``value_and_grad`` + ``all_finite`` +
  ``DynamicLossScaler`` flow::

    @jax.jit
    def train_step(params, opt_state, loss_scale, batch):
      loss, grads, finite = jmp_lite.value_and_grad(loss_fn, policy=policy)(
          params, batch, loss_scale=loss_scale)
      loss_scale = loss_scale.adjust(finite)
      updates, new_opt_state = tx.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      params, opt_state = jmp_lite.select_tree(
          finite, (new_params, new_opt_state), (params, opt_state))
      return params, opt_state, loss_scale, loss

  Args:
    fun: the loss function; returns a scalar, or ``(scalar, aux)``.
    argnums: which positional arguments to differentiate.
    has_aux: whether ``fun`` returns ``(loss, aux)``.
    policy: a `jmp_lite.Policy` or policy string.
    axis_name: under ``shard_map``/``pmap``, the mesh axis (or axes) over which
      the finiteness flag is reduced, so that every replica agrees.
    telemetry: a `jmp_lite.Telemetry`: the function then also returns a
      `jmp_lite.PrecisionStats` of the same pass, ``(value, grads,
      grads_finite, stats)``, and takes a keyword-only ``telemetry_step``
      (the step number, for ``Telemetry.every``; default: measure).
    allow_int: as in `jax.value_and_grad`: integer and boolean leaves among
      the differentiated arguments (an Equinox model partitioned with
      ``eqx.is_array``) get ``float0`` gradients instead of an error.

  The returned function also takes a keyword-only ``fp8``, a
  `jmp_lite.fp8.Fp8State` (from `jmp_lite.fp8.init` on ``fun``): its matmuls
  then run in fp8 with its scales, and the state with this pass's maxima
  recorded is returned last. Its gradient histories follow ``loss_scale``:
  a call under another loss scale than the state's last first multiplies
  them by the ratio (`jmp_lite.fp8.Fp8State.follow_loss_scale`), so
  ``loss_scale.adjust`` between calls needs nothing more.

  With a `jmp_lite.ModuleLossScale` as ``loss_scale`` (a wrapped Linen model
  inside ``fun``), each scaled module's backward pass runs at its own scale
  and the function returns ``(value, grads, grads_finite, modules)``: pass
  ``modules``, what the modules measured (summed over ``axis_name``), to
  ``loss_scale.adjust(grads_finite, modules)``.

  Raises:
    TypeError: (when called) if ``fun`` does not return a floating scalar.
    ValueError: (when called) inside ``shard_map(check_vma=False)`` or
      ``pmap``, if ``axis_name`` leaves out one of their axes: the flag could
      differ between devices and nothing would show it.

  Example:
    >>> import jax.numpy as jnp
    >>> import jmp_lite
    >>> f = lambda w: jnp.sum(w ** 2)
    >>> loss, grads, finite = jmp_lite.value_and_grad(f, policy="p=f32,c=bf16")(
    ...     jnp.ones(2), loss_scale=jmp_lite.StaticLossScale(1024.0))
    >>> float(loss), grads.tolist(), bool(finite), loss.dtype.name, grads.dtype.name
    (2.0, [2.0, 2.0], True, 'float32', 'float32')
  """
  if policy is not None:
    policy = get_policy(policy)
  axis_name = _scaling.check_axis_name(axis_name, "value_and_grad")

  telemetry = _check_telemetry(telemetry, "value_and_grad")
  scaled_vg = _scaled_grad.scaled_value_and_grad(fun, argnums, has_aux, policy, telemetry,
                                     axis_name, allow_int=allow_int)

  def wrapped(*args, loss_scale: ls_lib.LossScale = ls_lib.NoOpLossScale(),
              fp8: Optional[Fp8State] = None, **kwargs):
    if not isinstance(loss_scale, (ls_lib.NoOpLossScale, ls_lib.StaticLossScale,
                                   ls_lib.DynamicLossScale)):
      raise TypeError(
          "value_and_grad: loss_scale must be a jmp_lite loss scale, e.g. "
          f"jmp_lite.StaticLossScale({reprlib.repr(loss_scale)}), got "
          f"{reprlib.repr(loss_scale)}." + _checks.loss_scale_hint(loss_scale))
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if nums and max(nums) >= len(args):
      # Checked here: past this point the loss scale is a positional
      # argument too, and JAX's own message would count it.
      raise TypeError(
          f"value_and_grad: differentiating with respect to argnums={argnums} "
          f"requires at least {max(nums) + 1} positional arguments, but got only "
          f"{len(args)}.")
    step = kwargs.pop("telemetry_step", None) if telemetry is not None else None
    modules = None
    if getattr(type(loss_scale), "MEASURES", ()) == ("modules",):
      # A loss scale per module: its own pass, which measures the modules.
      if telemetry is not None or fp8 is not None:
        raise ValueError(
            "value_and_grad: a ModuleLossScale cannot be combined with telemetry "
            "or fp8 in the same step yet.")
      value, grads, modules = _scaled_grad.module_scaled_value_and_grad(
          fun, argnums, has_aux, policy, allow_int)(loss_scale, *args, **kwargs)
      if axis_name is not None:
        modules = jax.lax.psum(modules, axis_name)
    elif fp8 is not None:
      vg = _scaled_grad.scaled_value_and_grad(fun, argnums, has_aux, policy, telemetry, axis_name,
                                  _selection(fp8), allow_int=allow_int)
      fp8 = fp8.follow_loss_scale(loss_scale.loss_scale)
      value, grads, stats, amax = vg(step, fp8, loss_scale, *args, **kwargs)
      fp8 = fp8.observe(amax).commit()
    elif telemetry is not None:
      value, grads, stats, _ = scaled_vg(step, None, loss_scale, *args, **kwargs)
    else:
      value, grads = scaled_vg(loss_scale, *args, **kwargs)
    # Gradients in their parameters' dtypes, as jax.grad gives them (`unscale`
    # returns float32 for 16-bit leaves; one rounding either way).
    grads = jax.tree.map(lambda u, g: u.astype(g.dtype) if hasattr(g, "dtype") else u,
                         loss_scale.unscale(grads), grads)
    finite = ls_lib.all_finite(grads, axis_name=axis_name)
    # With check_vma=True a per-device flag is typed so: adjust refuses it,
    # and shard_map refuses it as a replicated output. Unchecked, nothing
    # would stop it from making the replicas diverge.
    _replicas.check_decision(finite, axis_name, "value_and_grad", tracked=False)
    out = (value, grads, finite)
    if modules is not None:
      out += (modules,)
    if telemetry is not None:
      out += (stats,)
    if fp8 is not None:
      out += (fp8,)
    return out

  return functools.wraps(fun)(wrapped)


def _selection(fp8) -> Optional[_plan.Fp8Selection]:
  """Which matmuls an `jmp_lite.fp8.Fp8State` says are fp8 (None: no state)."""
  if fp8 is None:
    return None
  if not isinstance(fp8, Fp8State):
    raise TypeError(f"fp8 must be a jmp_lite.fp8.Fp8State (from jmp_lite.fp8.init), "
                    f"got {type(fp8).__name__}")
  return _plan.Fp8Selection(fp8.select, fp8.recipe, fp8.scaling)


def _check_telemetry(telemetry, where: str):
  if telemetry is not None and not isinstance(telemetry, telemetry_lib.Telemetry):
    raise TypeError(
        f"{where}: telemetry must be a jmp_lite.Telemetry (or None), got "
        f"{telemetry!r}.")
  return telemetry
