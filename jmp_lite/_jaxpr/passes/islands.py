"""Wide islands: float32 stretches of a narrow computation, recomputed backward.

A mixed policy runs norms (and whatever else its rules keep wide) in float32
on narrow activations: convert up, elementwise ops and reductions, convert
down. Differentiated as written, such a stretch keeps several full-size
float32 intermediates for the backward pass (a LayerNorm: its upcast input,
the centred input, the broadcast ``scale * rsqrt(var)``), more bytes than the
narrow activations around it. Fused norm kernels (PyTorch's, Apex's) keep only
their narrow input and per-row statistics. The engine gets the same effect
without a kernel: each stretch becomes a ``jax.checkpoint``, so the backward
pass keeps the stretch's inputs and recomputes the rest, elementwise work that
XLA fuses into the backward's own loops.

An island starts at a narrow-to-wide ``convert_element_type`` and grows, in
program order, by every cheap first-order equation (`_CHEAP`) that reads one of
its wide values and otherwise reads only values defined before any equation
outside the island reads from it. That rule keeps the rewritten jaxpr in
order: the island becomes one equation placed before its first outside reader
(or after its last member), and everything it reads is defined by then.
Islands of linear equations only keep nothing anyway and are left alone.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend as jex
import numpy as np

from jmp_lite import _dtypes
from jmp_lite._jaxpr import internals as _internals

# Linear first-order primitives: autodiff keeps nothing of them.
_LINEAR = frozenset({
    "convert_element_type", "reshape", "broadcast_in_dim", "transpose",
    "squeeze", "expand_dims", "reduce_sum", "add", "sub", "neg", "copy",
    "reduce_precision"})
# First-order primitives whose work XLA fuses: recomputing them in the
# backward pass costs a pass over memory, not a matmul.
_CHEAP = _LINEAR | frozenset({
    "mul", "div", "max", "min", "abs", "sign", "square", "sqrt", "rsqrt",
    "cbrt", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "erf",
    "pow", "integer_pow", "sin", "cos", "select_n", "clamp", "reduce_max",
    "reduce_min", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    "is_finite"})


def _is_wide(aval) -> bool:
  dtype = getattr(aval, "dtype", None)
  return (dtype is not None and jax.dtypes.issubdtype(dtype, np.floating)
          and np.dtype(dtype).itemsize >= 4)


def _is_upcast(eqn) -> bool:
  return (eqn.primitive.name == "convert_element_type"
          and _dtypes.is_narrow_float(eqn.invars[0].aval.dtype)
          and _is_wide(eqn.outvars[0].aval))


def _linear(eqn) -> bool:
  """Whether autodiff keeps nothing of ``eqn`` for the backward pass."""
  name, literal = eqn.primitive.name, jex.core.Literal
  if name == "mul":  # by a constant
    return any(isinstance(v, literal) for v in eqn.invars)
  if name == "div":  # by a constant
    return isinstance(eqn.invars[1], literal)
  return name in _LINEAR


def _plain(aval) -> bool:
  """No manual axes (shard_map bodies) and no explicit mesh in the type.

  A re-traced island would lose them; such jaxprs keep their equations.
  """
  if getattr(aval, "vma", None):
    return False
  mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
  return mesh is None or getattr(mesh, "empty", True)


def isolate(eqns: list[Any], outvars: list[Any]) -> list[Any]:
  """``eqns`` with each wide island replaced by one ``jax.checkpoint``."""
  literal = jex.core.Literal
  if not all(_plain(v.aval) for e in eqns for v in (*e.invars, *e.outvars)
             if not isinstance(v, literal)):
    return eqns
  pos: dict[Any, int] = {}  # var -> the equation defining it
  made_in: dict[Any, int] = {}  # var made in an island -> the island
  wide: set[Any] = set()  # the wide ones, which an island grows from
  islands: list[_Island] = []
  for i, e in enumerate(eqns):
    ins = [v for v in e.invars if not isinstance(v, literal)]
    sources = {made_in[v] for v in ins if v in made_in}
    member = None
    if e.primitive.name in _CHEAP and not e.effects:
      if len(sources) == 1 and any(v in wide for v in ins):
        k, = sources
        # Everything else it reads is defined before the island's first
        # reader outside: the island can sit before that reader.
        if all(v in made_in or pos.get(v, -1) < islands[k].first_reader
               for v in ins):
          member = k
      elif not sources and _is_upcast(e):
        member = len(islands)
        islands.append(_Island())
    if member is None:
      for k in sources:
        islands[k].first_reader = min(islands[k].first_reader, i)
    else:
      islands[member].members.append(i)
      for v in e.outvars:
        made_in[v] = member
        if _is_wide(v.aval):
          wide.add(v)
    for v in e.outvars:
      pos[v] = i
  placed: dict[int, list[Any]] = {}
  gone: set[int] = set()
  for island in islands:
    members = island.members
    if all(_linear(eqns[i]) for i in members):
      continue
    eqn = _checkpoint([eqns[i] for i in members], set(members), eqns, outvars)
    if eqn is not None:
      gone.update(members)
      at = min(island.first_reader, members[-1] + 1)
      placed.setdefault(at, []).append(eqn)
  if not gone:
    return eqns
  out = []
  for i in range(len(eqns) + 1):
    out += placed.get(i, [])
    if i < len(eqns) and i not in gone:
      out.append(eqns[i])
  return out


class _Island:
  """Positions of an island's equations; the first outside reader of it."""

  def __init__(self):
    self.members: list[int] = []
    self.first_reader = float("inf")


def _checkpoint(members, positions, eqns, outvars):
  """One ``remat2`` equation computing ``members``, or None if it cannot."""
  literal = jex.core.Literal
  made = {v for e in members for v in e.outvars}
  ins: list[Any] = []
  for e in members:
    for v in e.invars:
      if not isinstance(v, literal) and v not in made and v not in ins:
        ins.append(v)
  used = {v for i, e in enumerate(eqns) if i not in positions
          for v in e.invars if not isinstance(v, literal)}
  used |= {v for v in outvars if not isinstance(v, literal)}
  outs = [v for e in members for v in e.outvars if v in used]
  if not outs:
    return None

  def island(*args):
    env = dict(zip(ins, args))
    for e in members:
      vals = [v.val if isinstance(v, literal) else env[v] for v in e.invars]
      with _internals.eqn_context(e):
        out = _internals.bind(e, vals)
      env.update(zip(e.outvars, out if e.primitive.multiple_results else [out]))
    return [env[v] for v in outs]

  specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                weak_type=v.aval.weak_type) for v in ins]
  traced = jax.make_jaxpr(jax.checkpoint(island, prevent_cse=True))(*specs)
  if len(traced.jaxpr.eqns) != 1:
    return None
  (eqn,) = traced.jaxpr.eqns
  # The re-traced island must have exactly the original types and wiring.
  if (traced.consts or list(eqn.outvars) != list(traced.jaxpr.outvars)
      or list(eqn.invars) != list(traced.jaxpr.invars)
      or [v.aval for v in eqn.outvars] != [v.aval for v in outs]):
    return None
  return _internals.rewire(eqn, ins, outs)
