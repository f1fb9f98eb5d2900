"""The differentiated step behind `jmp_lite.value_and_grad` and `TrainState.minimize`.

``loss_scale.scale(loss)`` differentiated under the policy (the precision
engine, or autocast for O1), with telemetry's probes and fp8 sites when asked
for: one function, shared by the MindSpore-style `value_and_grad` and the
optax-style `TrainState.minimize`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jmp_lite import _dtypes
from jmp_lite._jaxpr import module_scales as _module_scales
from jmp_lite._jaxpr.passes import engine as _engine
from jmp_lite._jaxpr.passes import instrument as _instrument
from jmp_lite import _replicas
from jmp_lite import _stats
from jmp_lite import autocasting
from jmp_lite import loss_scale as ls_lib
from jmp_lite.policy import get_policy


def _check_loss(loss: Any) -> None:
  shape = getattr(loss, "shape", None)
  dtype = getattr(loss, "dtype", None)
  if shape != () or not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        "The loss function must return a floating-point scalar (or (scalar, "
        f"aux) with has_aux=True), got {type(loss).__name__} with shape={shape} "
        f"dtype={dtype}. Reduce it with jnp.mean or jnp.sum.")


def _scaled_fun(fun, nums, has_aux, policy):
  """``scaled(loss_scale, *args) -> (scaled loss, (loss, aux))``, what is differentiated."""
  def scaled(loss_scale, *args, **kwargs):
    if policy is not None:
      args = tuple(policy.cast_to_compute(a) if i in nums or i - len(args) in nums
                   else a for i, a in enumerate(args))
    if isinstance(loss_scale, _module_scales.Carried):
      # Per-module loss scales: the wrapped model's modules convert their
      # cotangents while it runs; the loss is scaled by the global scale.
      with _module_scales.applied(loss_scale):
        out = fun(*args, **kwargs)
      loss_scale = loss_scale.loss_scale
    else:
      out = fun(*args, **kwargs)
    if has_aux:
      if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            f"With has_aux=True the loss function must return (loss, aux), got {out!r}")
      loss, aux = out
    else:
      loss, aux = out, None
    _check_loss(loss)
    if policy is not None:
      loss = loss.astype(jnp.float32)
    return loss_scale.scale(loss), (loss, aux)

  if policy is not None and policy.autocast_dtype is None and (
      _dtypes.is_narrow_float(policy.compute_dtype)):
    # Forward rewritten, differentiated outside: the backward's matmuls are
    # the engine's transposes.
    scaled = _engine.accumulate(scaled, reduce_dtype=policy.reduce_dtype)
  return scaled


def fp8_sites(fun, args, kwargs, *, argnums, has_aux, policy, selection):
  """``(name, leading shape, recipe)`` of the fp8 matmuls the step would make."""
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  policy = get_policy(policy) if policy is not None else None
  scaled = _scaled_fun(fun, nums, has_aux, policy)
  # The loss scale comes first, so argument i is argument i + 1 of `scaled`.
  shifted = tuple(i + 1 if i >= 0 else i for i in nums)
  return _instrument.fp8_sites(scaled, (ls_lib.NoOpLossScale(), *args), kwargs,
                               selection, params=shifted)


def module_scaled_value_and_grad(fun, argnums, has_aux, policy, allow_int=False):
  """``f(loss_scale, *args)`` returning ``(value, grads, measured)`` for a
  `jmp_lite.ModuleLossScale`: the gradients of ``loss_scale.scale(loss)``
  with each scaled module's backward pass at its own scale, and what the
  modules measured (``[len(paths), 2, WIDTH]``, `jmp_lite._jaxpr.module_scales`),
  in the same pass: the gradient with respect to the carriers."""
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  scaled = _scaled_fun(fun, nums, has_aux, policy)
  shifted = tuple(i + 2 if i >= 0 else i for i in nums)

  def with_carriers(carriers, loss_scale, *args, **kwargs):
    return scaled(_module_scales.Carried(loss_scale, carriers), *args, **kwargs)

  vg = jax.value_and_grad(with_carriers, argnums=(0, *shifted), has_aux=True,
                          allow_int=allow_int)
  if policy is not None and policy.autocast_dtype is not None:
    vg = autocasting.autocast(vg, policy)

  def run(loss_scale, *args, **kwargs):
    n, *row = loss_scale.measure_shape()
    carriers = tuple(jnp.zeros(row, jnp.float32) for _ in range(n))
    axes = _replicas.manual_axes()
    if axes and _replicas.tracks_varying(axes):
      # Under shard_map: per-device measurements, which the caller sums over
      # its axis (as telemetry's carrier, `jmp_lite._jaxpr.passes.instrument`).
      carriers = tuple(jax.lax.pcast(c, axes, to="varying") for c in carriers)
    (_, (loss, aux)), grads = vg(carriers, loss_scale, *args, **kwargs)
    measured = (jnp.stack(grads[0]) if grads[0] else
                jnp.zeros(loss_scale.measure_shape(), jnp.float32))
    grads = grads[1:]
    return (((loss, aux) if has_aux else loss),
            grads[0] if isinstance(argnums, int) else grads, measured)

  return run


def scaled_value_and_grad(fun, argnums, has_aux, policy, telemetry=None,
                           axis_name=None, fp8=None, allow_int=False):
  """``f(loss_scale, *args)`` returning ``(value, grads of loss_scale.scale(loss))``.

  With ``telemetry`` or ``fp8`` (a `jmp_lite._jaxpr.passes.plan.Fp8Selection`),
  ``f(step, fp8_state, loss_scale, *args)`` returning ``(value, grads,
  stats, amax)``: ``stats`` a `jmp_lite.telemetry.PrecisionStats` of the
  same pass on the steps ``telemetry`` samples (reduced over ``axis_name``
  under ``shard_map``), zeros on the others (None without telemetry);
  ``amax`` each fp8 site's absolute maxima (max-reduced over ``axis_name``),
  its matmuls quantised with ``fp8_state``'s scales.

  With a policy, the differentiated arguments are cast to its compute dtype,
  and the differentiated step runs under the precision engine (or autocast,
  for O1): every narrow matmul of the forward and backward pass accumulates
  in float32, and a weight gradient whose contraction XLA's partitioner
  splits across devices (``jit`` with a sharded batch) is reduced in the
  policy's ``reduce_dtype`` rather than in the compute dtype.
  """
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  scaled = _scaled_fun(fun, nums, has_aux, policy)
  # The loss scale comes first, so argument i is argument i + 1 of `scaled`.
  shifted = tuple(i + 1 if i >= 0 else i for i in nums)
  vg = jax.value_and_grad(
      scaled, argnums=shifted[0] if isinstance(argnums, int) else shifted,
      has_aux=True, allow_int=allow_int)
  instrumented = telemetry is not None or fp8 is not None
  if instrumented:
    probed = _instrument.value_and_grad(
        scaled, shifted, mode=None if telemetry is None else telemetry.mode,
        what_if=() if telemetry is None else telemetry.what_if, fp8=fp8,
        allow_int=allow_int)

    def measured_vg(gate, fp8_state, *args, **kwargs):
      (value, grads), rows, amax = probed(gate, fp8_state, *args, **kwargs)
      stats = None if telemetry is None else _stats.build(
          rows, telemetry, axis_name, sampled=True if gate is None else gate > 0)
      if axis_name is not None and _replicas.manual_axes():
        # Delayed scaling reads the largest value any device saw.
        amax = jax.tree.map(lambda a: jax.lax.pmax(a, axis_name), amax)
      return value, grads[0] if isinstance(argnums, int) else grads, stats, amax

  else:
    measured_vg = None
  if policy is not None and policy.autocast_dtype is not None:
    # O1: op lists over the whole differentiated step, so that the backward
    # matmuls run in the autocast dtype too.
    vg = autocasting.autocast(vg, policy)
    if measured_vg is not None:
      measured_vg = autocasting.autocast(measured_vg, policy)

  def run(loss_scale, *args, **kwargs):
    (_, (loss, aux)), grads = vg(loss_scale, *args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads

  if not instrumented:
    return run

  def run_measured(step, fp8_state, loss_scale, *args, **kwargs):
    # Sampling gates the probes' reductions, not the step: a `cond` around
    # the whole forward and backward pass keeps XLA:CPU from optimising
    # its convolutions (15x slower steps, measured on digits' CNN).
    gate = None if telemetry is None else _stats.gate(telemetry, step)
    (_, (loss, aux)), grads, stats, amax = measured_vg(gate, fp8_state, loss_scale,
                                                       *args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads, stats, amax

  return run_measured
