"""calibrate's pass: every intermediate value of a traced loss, measured and
perturbed (`jmp_lite.calibration`).

`points` lists the floating values of a jaxpr and of the bodies it enters
(which bodies: `jmp_lite._jaxpr.traverse`'s table); `evaluate` runs the jaxpr with
a perturbation added to each live value (differentiating with respect to
it gives the value's cotangent) and returns each value's largest
magnitude.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmp_lite import _dtypes
from jmp_lite._jaxpr import internals as _internals
from jmp_lite._jaxpr.passes import plan as _plan
from jmp_lite._jaxpr import traverse as _traverse


def _scope(eqn, outer: str = "") -> str:
  """The eqn's name-stack path (after ``outer``, its enclosing call's), with
  the repeats nested wrappers make collapsed, and a wrapped Linen model's
  paths as an unwrapped one's: under a root, without wrap's ``module`` frame
  (``_LinenWrapper/Dense_0``, as ``MLP/Dense_0``)."""
  path = _plan.collapse("/".join(
      p for p in (outer, str(eqn.source_info.name_stack)) if p))
  frame = _plan.WRAPPER_FRAME
  if path == frame or path.startswith(frame + "/"):
    path = frame.split("/")[0] + path[len(frame):]
  return path


def _regions(eqn) -> list:
  """The bodies of ``eqn`` calibrate enters (`jmp_lite._jaxpr.traverse`): every
  one but per-device bodies (``shard_map``, ``pmap``: their shapes are a
  device's, measured at their outputs) and a while loop's condition."""
  return [r for r in _traverse.regions_or_warn(eqn, "calibrate")
          if not r.per_device and r.kind not in ("unknown", "while_cond")]


def points(jaxpr, key=(), outer="", lengths=(), dead=(), frozen=False):
  """Every floating value computed in ``jaxpr`` and the bodies it enters:
  ``(key, shape, dtype, scope, live)``, where ``key`` is the path of
  equation indices (and, for an equation with bodies, the body's index
  among `_regions`) and then the output index, and ``shape`` has a leading
  axis per enclosing ``scan``.

  ``live`` is False for a value computed only from ``dead`` inputs (which
  of ``jaxpr``'s are: the batch) or ``stop_gradient`` outputs: no gradient
  reaches it in training, and perturbing it would differentiate what it
  flows into (a teacher's ``while`` loop cannot be). Values inside a body
  autodiff does not differentiate as written (a custom rule's primal body,
  a ``while`` loop) are not live either (``frozen``: the whole jaxpr is
  such a body): measured on the forward pass, their cotangents are the
  rule's business."""
  found = []
  gone = {v for v, d in zip(jaxpr.invars, dead) if d}
  is_dead = lambda v: isinstance(v, _internals.core.Var) and v in gone
  for i, eqn in enumerate(jaxpr.eqns):
    here = key + (i,)
    scope = _scope(eqn, outer)
    name = eqn.primitive.name
    ins = [is_dead(v) for v in eqn.invars]
    out_dead = name == "stop_gradient" or (any(
        isinstance(v, _internals.core.Var) for v in eqn.invars) and all(
            d for v, d in zip(eqn.invars, ins) if isinstance(v, _internals.core.Var)))
    for r, region in enumerate(_regions(eqn)):
      # A carry can come to depend on any operand.
      inner_lengths = lengths + ((region.length,) if region.runs == _traverse.EACH else ())
      found += points(region.jaxpr, here + (r,), scope, inner_lengths,
                      region.flow(ins, out_dead),
                      frozen or not region.differentiated)
    for j, v in enumerate(eqn.outvars):
      if out_dead and isinstance(v, _internals.core.Var):
        gone.add(v)
      if _dtypes.is_floating(v.aval):
        found.append((here + (j,), lengths + tuple(v.aval.shape), v.aval.dtype, scope,
                      not (out_dead or frozen)))
  return found


def evaluate(jaxpr, consts, args, key, perturb):
  """``jaxpr`` on ``args`` with ``perturb[k]`` added to the value at each
  point ``k`` under ``key`` (None: measured, not perturbed); returns the
  outputs and each point's largest ``|value|`` (over the iterations of the
  loops it is in, 0 in a branch not taken)."""
  seen = {}
  index = iter(range(len(jaxpr.eqns)))

  def eval_eqn(eqn, invals):
    here = key + (next(index),)
    regions = _regions(eqn)
    kind = regions[0].kind if regions else None
    if kind in _traverse.RUNS:
      outs, inner = _bodies(eqn, regions, invals, here, perturb)
    elif kind in ("custom_jvp", "custom_vjp"):
      # The rule differentiates; the body, run again on the same values
      # held constant, shows what the forward pass computes inside.
      outs = _internals.bind(eqn, invals)
      _, inner = evaluate(regions[0].jaxpr, regions[0].consts,
                          [jax.lax.stop_gradient(v) for v in invals], here + (0,),
                          _within(perturb, here + (0,)))
    else:
      outs, inner = _internals.bind(eqn, invals), {}
    seen.update(inner)
    single = not eqn.primitive.multiple_results
    outs = [outs] if single else list(outs)
    for j in range(len(outs)):
      k = here + (j,)
      if k in perturb:
        if perturb[k] is not None:
          outs[j] = outs[j] + perturb[k]
        seen[k] = _largest(outs[j])
    return outs[0] if single else outs

  return _internals.eval_jaxpr(jaxpr, consts, args, eval_eqn), seen


def _within(perturb, prefix) -> dict:
  """The points of ``perturb`` inside the body whose path starts with ``prefix``."""
  return {k: v for k, v in perturb.items()
          if len(k) > len(prefix) and k[:len(prefix)] == prefix}


def _largest(x) -> jax.Array:
  """The largest ``|x|`` below its dtype's maximum (float32).

  A value at the dtype's largest magnitude is a fill value, not an
  activation: the ``jnp.finfo(dtype).min`` that attention masks with is
  float32's in this pass and becomes the half dtype's own under the policy.
  """
  if not x.size:
    return jnp.float32(0)
  a = jnp.abs(x)
  return jnp.max(jnp.where(a < jnp.finfo(x.dtype).max, a, 0)).astype(jnp.float32)


def _bodies(eqn, regions, invals, key, perturb):
  """An equation with bodies (`jmp_lite._jaxpr.traverse.run`), each evaluated by
  `evaluate` with the perturbations of its points: a scan's are scanned
  over with ``xs``, a while loop's are none (it is never differentiated).
  Every body reports every point of them all (zeros for a branch not
  taken), each one's largest value over the iterations."""
  names = [k for r in range(len(regions)) for k in _within(perturb, key + (r,))]
  zero = jnp.zeros((), jnp.float32)

  def body(r, args, given):
    mine = {k: given.get(k) for k in _within(perturb, key + (r,))}
    outs, seen = evaluate(regions[r].jaxpr, regions[r].consts, args, key + (r,), mine)
    return outs, {k: seen.get(k, zero) for k in names}

  if regions[0].kind == "while":
    largest = lambda a, b: {k: jnp.maximum(a[k], b[k]) for k in names}
    return _traverse.run(eqn, invals, body, {k: None for k in names}, combine=largest,
                         start={k: zero for k in names})
  outs, seen = _traverse.run(eqn, invals, body, {k: perturb[k] for k in names})
  if regions[0].kind == "scan":
    seen = {k: jnp.max(v) for k, v in seen.items()}
  return outs, seen
