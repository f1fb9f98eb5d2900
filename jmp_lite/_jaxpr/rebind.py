"""Binding a higher-order equation again, with its bodies rewritten.

`jmp_lite._jaxpr.traverse` says where each higher-order primitive keeps its
jaxprs and how they are wired, for passes that read a program or evaluate it
as written. A pass that *rewrites* the bodies (autocast changes their
dtypes inside) must also bind the equation again, and there each primitive
has its own rules: a rewritten body is traced anew, and constants the trace
captures become extra leading inputs, which a ``scan`` or ``custom_jvp``
counts in ``num_consts``, a ``while`` loop in ``cond_nconsts`` and
``body_nconsts``, a ``cond`` passes to every branch, a ``custom_vjp`` also
asks of its forward rule's thunk, and a ``checkpoint`` takes as operands.
This module is the one place that knows them.

A pass gives `rebind` the equation, its operands and ``body``: for a
closed jaxpr of the equation, a Python function that computes what that
jaxpr computes, rewritten. It must return values of the jaxpr's output
types, except for the bodies of calls and checkpoints (`FREE_TYPED`), whose
types may change: a call is inlined, and a checkpoint's body is traced at
its operands' types. A pass that edits a call's body equation by equation,
without tracing it (`jmp_lite._jaxpr.passes.sink`), gives it back with
`with_body`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from jmp_lite._jaxpr import internals as _internals

core = _internals.core

# The primitives whose bodies may return other types than they were traced
# with (the others are bound with their own output types).
FREE_TYPED = frozenset({"jit", "pjit", "closed_call", "remat2"})

Body = Callable[[Any], Callable[..., list]]


def trace(fn: Callable[..., list], avals) -> tuple[Any, list]:
  """Traces ``fn`` at ``avals``: a const-free ClosedJaxpr and its hoisted
  constants, which become its leading inputs."""
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
           for a in avals]
  closed = jax.make_jaxpr(fn)(*specs)
  if not closed.consts:
    return closed, []
  return core.ClosedJaxpr(_internals.constvars_to_invars(closed), ()), list(closed.consts)


# Calls whose body `with_body` replaces: their one body is ``params["jaxpr"]``.
CALLS = frozenset({"jit", "pjit"})


def with_body(eqn, jaxpr, consts, invars, outvars):
  """Call ``eqn`` (`CALLS`) with ``jaxpr``, closed over ``consts``, as its
  body, reading ``invars`` and writing ``outvars``: a structural edit, with
  no tracing (the body's types are the caller's to keep consistent)."""
  if eqn.primitive.name not in CALLS:
    raise ValueError(f"with_body: {eqn.primitive.name} is not a call ({sorted(CALLS)})")
  return _internals.replace_eqn(
      _internals.rewire(eqn, invars, outvars), eqn.primitive,
      dict(eqn.params, jaxpr=_internals.closed(jaxpr, consts)))


def _rewritten(closed, body: Body) -> tuple[Any, list]:
  return trace(body(closed), closed.in_avals)


def _inline(eqn, vals, body):
  return list(body(eqn.params["jaxpr" if "jaxpr" in eqn.params else "call_jaxpr"])(*vals))


def _checkpoint(eqn, vals, body):
  new, consts = trace(body(core.ClosedJaxpr(eqn.params["jaxpr"], ())),
                      [jax.typeof(x) for x in vals])
  return _internals.bind(eqn, [*consts, *vals], dict(eqn.params, jaxpr=new.jaxpr))


def _leading_consts(key: str):
  """A primitive whose body ``params[key]`` takes ``num_consts`` constants
  first (``scan``, ``custom_jvp_call``): hoisted constants join them."""
  def handler(eqn, vals, body):
    new, consts = _rewritten(eqn.params[key], body)
    params = _internals.with_more_consts(
        eqn.primitive.name, {**eqn.params, key: new}, len(consts))
    return _internals.bind(eqn, [*consts, *vals], params)
  return handler


def _while(eqn, vals, body):
  p = eqn.params
  cond, cond_consts = _rewritten(p["cond_jaxpr"], body)
  loop, body_consts = _rewritten(p["body_jaxpr"], body)
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  vals = [*cond_consts, *vals[:cn], *body_consts, *vals[cn:]]
  return _internals.bind(eqn, vals, dict(
      p, cond_jaxpr=cond, body_jaxpr=loop, cond_nconsts=cn + len(cond_consts),
      body_nconsts=bn + len(body_consts)))


def _cond(eqn, vals, body):
  rewritten = [_rewritten(b, body) for b in eqn.params["branches"]]
  extra = [c for _, consts in rewritten for c in consts]
  branches = [new for new, _ in rewritten]
  if extra:
    # Every branch takes the same operands: each gets all the constants.
    branches, start = [], 0
    for new, consts in rewritten:
      def fn(*args, new=new, lo=start, hi=start + len(consts)):
        return core.jaxpr_as_fun(new)(*args[lo:hi], *args[len(extra):])
      closed, more = trace(fn, [jax.typeof(c) for c in extra]
                           + list(new.in_avals[len(consts):]))
      assert not more, "constants of a branch were hoisted already"
      branches.append(closed)
      start += len(consts)
  return _internals.bind(eqn, [vals[0], *extra, *vals[1:]],
                         dict(eqn.params, branches=tuple(branches)))


def _custom_vjp(eqn, vals, body):
  new, consts = _rewritten(eqn.params["call_jaxpr"], body)
  thunk = eqn.params["fwd_jaxpr_thunk"]

  def fwd_jaxpr_thunk(*zeros):
    jaxpr, fwd_consts = thunk.call_wrapped(*zeros)
    fwd, hoisted = _rewritten(core.ClosedJaxpr(jaxpr, fwd_consts), body)
    return _internals.invars_to_constvars(fwd.jaxpr, len(hoisted)), hoisted

  params = _internals.with_more_consts(
      eqn.primitive.name,
      dict(eqn.params, call_jaxpr=new,
           fwd_jaxpr_thunk=_internals.wrap_fun(fwd_jaxpr_thunk, thunk)),
      len(consts))
  return _internals.bind(eqn, [*consts, *vals], params)


def _shard_map(eqn, vals, body):
  """The body per shard, through the public `jax.shard_map`."""
  return _internals.shard_map_call(eqn, body(core.ClosedJaxpr(eqn.params["jaxpr"], ())),
                                   vals)


_RULES = {
    "jit": _inline,
    "pjit": _inline,
    "closed_call": _inline,
    "remat2": _checkpoint,
    "scan": _leading_consts("jaxpr"),
    "while": _while,
    "cond": _cond,
    "custom_jvp_call": _leading_consts("call_jaxpr"),
    "custom_vjp_call": _custom_vjp,
    "shard_map": _shard_map,
}

PRIMITIVES = frozenset(_RULES)


def rebind(eqn, vals, body: Body) -> list:
  """``eqn``'s results on ``vals``, each of its jaxprs replaced by ``body``.

  Args:
    eqn: an equation whose primitive is in `PRIMITIVES`.
    vals: its operands, in the types it was traced with (any types for a
      call's or a checkpoint's, `FREE_TYPED`).
    body: for a closed jaxpr of the equation, a function computing its
      rewritten outputs (see the module docstring for their types).
  """
  return _RULES[eqn.primitive.name](eqn, list(vals), body)
