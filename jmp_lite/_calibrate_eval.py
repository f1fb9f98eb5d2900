"""calibrate's pass: every intermediate value of a traced loss, measured and
perturbed (`jmp_lite.calibration`).

`points` lists the floating values of a jaxpr and of the bodies it enters
(which bodies: `jmp_lite._traverse`'s table); `evaluate` runs the jaxpr with
a perturbation added to each live value (differentiating with respect to
it gives the value's cotangent) and returns each value's largest
magnitude.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmp_lite import _dtypes
from jmp_lite import _internals
from jmp_lite import _plan
from jmp_lite import _traverse


def _scope(eqn, outer: str = "") -> str:
  """The eqn's name-stack path (after ``outer``, its enclosing call's), with
  the repeats nested wrappers make collapsed."""
  return _plan.collapse("/".join(
      p for p in (outer, str(eqn.source_info.name_stack)) if p))


def _regions(eqn) -> list:
  """The bodies of ``eqn`` calibrate enters (`jmp_lite._traverse`): every
  one but per-device bodies (``shard_map``, ``pmap``: their shapes are a
  device's, measured at their outputs) and a while loop's condition."""
  return [r for r in _traverse.regions_or_warn(eqn, "calibrate")
          if not r.per_device and r.kind not in ("unknown", "while_cond")]


def points(jaxpr, key=(), outer="", lengths=(), dead=()):
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
  a ``while`` loop) are not live either: measured on the forward pass,
  their cotangents are the rule's business."""
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
      body_dead = (region.flow(ins, out_dead) if region.differentiated
                   else [True] * len(region.jaxpr.invars))
      inner_lengths = lengths + ((region.length,) if region.runs == _traverse.EACH else ())
      found += points(region.jaxpr, here + (r,), scope, inner_lengths, body_dead)
    for j, v in enumerate(eqn.outvars):
      if out_dead and isinstance(v, _internals.core.Var):
        gone.add(v)
      if _dtypes.is_floating(v.aval):
        found.append((here + (j,), lengths + tuple(v.aval.shape), v.aval.dtype, scope,
                      not out_dead))
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
    if kind in ("call", "checkpoint"):
      outs, inner = evaluate(regions[0].jaxpr, regions[0].consts, invals, here + (0,),
                              perturb)
    elif kind == "scan":
      outs, inner = _scan(eqn, regions[0], invals, here, perturb)
    elif kind == "cond":
      outs, inner = _cond(regions, invals, here, perturb)
    elif kind == "while":
      outs, inner = _while(eqn, regions[0], invals, here, perturb)
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


def _scan(eqn, region, invals, key, perturb):
  """A ``scan`` equation, its body evaluated by `evaluate` per iteration
  (the perturbations of its points are scanned over with ``xs``)."""
  p = eqn.params
  n_consts, n_carry = _internals.scan_split(p)
  consts, init, xs = invals[:n_consts], invals[n_consts:n_consts + n_carry], \
      invals[n_consts + n_carry:]
  inner = list(_within(perturb, key + (0,)))
  scanned = [k for k in inner if perturb[k] is not None]

  def step(carry, x):
    x_now, p_now = x
    now = {k: None for k in inner}
    now.update(zip(scanned, p_now))
    outs, seen = evaluate(region.jaxpr, region.consts, [*consts, *carry, *x_now],
                           key + (0,), now)
    return outs[:n_carry], (outs[n_carry:], seen)

  carry, (ys, seen) = jax.lax.scan(step, list(init), (list(xs), [perturb[k] for k in scanned]),
                                   length=p["length"], reverse=p["reverse"],
                                   unroll=p["unroll"])
  return [*carry, *ys], {k: jnp.max(v) for k, v in seen.items()}


def _cond(regions, invals, key, perturb):
  """A ``cond`` equation, each branch evaluated by `evaluate`: the points
  of every branch are outputs of each (zero where another branch holds
  them), so the one taken reports its values and its perturbations'
  gradients, and the others report zeros."""
  every = [_within(perturb, key + (r,)) for r in range(len(regions))]
  names = [k for points in every for k in points]

  def branch(r):
    def run(ops, given):
      now = {k: given[k] for k in every[r]}
      outs, seen = evaluate(regions[r].jaxpr, regions[r].consts,
                             [ops[i - 1] for i in regions[r].inputs], key + (r,), now)
      return outs, [seen.get(k, jnp.float32(0)) for k in names]
    return run

  outs, seen = jax.lax.switch(invals[0], [branch(r) for r in range(len(regions))],
                              list(invals[1:]), {k: perturb[k] for k in names})
  return list(outs), dict(zip(names, seen))


def _while(eqn, body, invals, key, perturb):
  """A ``while`` equation, its body evaluated by `evaluate` on each
  iteration (never differentiated: its points are measured, not
  perturbed), each point's largest value over the iterations kept."""
  p = eqn.params
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cond_consts, body_consts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
  inner = list(_within(perturb, key + (0,)))  # the body is the first region
  cond = p["cond_jaxpr"]

  def keep_going(state):
    carry, _ = state
    return _internals.eval_jaxpr(cond.jaxpr, cond.consts, [*cond_consts, *carry],
                                 _internals.bind)[0]

  def step(state):
    carry, most = state
    outs, seen = evaluate(body.jaxpr, body.consts, [*body_consts, *carry], key + (0,),
                           {k: None for k in inner})
    return list(outs), [jnp.maximum(m, seen[k]) for m, k in zip(most, inner)]

  carry, most = jax.lax.while_loop(keep_going, step,
                                   (list(init), [jnp.float32(0)] * len(inner)))
  return carry, dict(zip(inner, most))
