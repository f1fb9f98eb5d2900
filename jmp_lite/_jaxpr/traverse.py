"""How to enter each higher-order primitive: the one table every jaxpr pass reads.

A pass over a traced step meets equations that hold other jaxprs: calls
(``jit``, ``checkpoint``), loops (``scan``, ``while``), branches (``cond``),
custom derivative rules (``custom_jvp``, ``custom_vjp``) and per-device
bodies (``shard_map``, ``pmap``). Each pass used to carry its own idea of
where those jaxprs sit in the parameters, which operand feeds which of
their inputs and which of their outputs are the equation's, and each had
its own gaps. `regions` answers once, for every pass, as a list of
`Region`: the jaxpr, where its inputs come from, where its outputs go, how
often it runs and whether it is what autodiff differentiates.

A primitive that holds a jaxpr and is not in the table is never skipped in
silence: `regions` raises `UnknownPrimitiveError` (for a caller that must
not go on) and `regions_or_warn`, which every pass uses, warns and returns
its jaxprs as opaque regions (a pass runs the equation as written); `warn_not_entered`
is what a pass calls for a primitive it has no rule for, known or not.

`run` evaluates an equation whose bodies a measuring pass evaluates itself
(calibrate's perturbations, telemetry's probes and fp8's sites), threading
the pass's own state through calls, checkpoints, scans, branches and while
loops: the one place that knows how each of them runs.

Parameter names by primitive, as of the JAX versions this library supports
(0.9 to 0.11; read in jax/_src/{pjit,ad_checkpoint,custom_derivatives,
shard_map}.py and jax/_src/lax/control_flow/{loops,conditionals}.py); the
scan's operand split is `jmp_lite._jaxpr.internals.scan_split`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Optional, Sequence

import jax

from jmp_lite._jaxpr import internals as _internals

core = _internals.core


class UnknownPrimitiveError(NotImplementedError):
  """A primitive holding jaxprs that no pass knows how to enter."""


class BodyNotEnteredWarning(UserWarning):
  """A pass ran a body as written: it does not know, or has no rule for,
  the primitive holding it."""


# How a region runs, relative to its equation.
ONCE = "once"  # a call: the body runs once per run of the equation
EACH = "each"  # a scan body: once per iteration, ``length`` times
WHILE = "while"  # a while loop's body or condition: a number of times known at run time
ONE_OF = "one_of"  # a branch: at most once, chosen by the first operand


@dataclasses.dataclass(frozen=True)
class Region:
  """One jaxpr an equation runs, and how it is wired to the equation.

  Attributes:
    kind: what holds it, for reports and rules: ``"call"`` (jit, closed_call),
      ``"checkpoint"``, ``"scan"``, ``"while"``, ``"while_cond"``, ``"cond"``,
      ``"custom_jvp"``, ``"custom_vjp"``, ``"shard_map"``, ``"pmap"``, or
      ``"unknown"``.
    label: the path segment a report shows for it (``"scan"``,
      ``"cond.branch1"``); None for a transparent call (``jit``).
    jaxpr: the open jaxpr.
    consts: its constants (a closed jaxpr's; ``()`` for an open one).
    inputs: per input of ``jaxpr``, the index of the equation operand it
      receives (every input receives one).
    carried: per input of ``jaxpr``, whether it is a loop carry: on later
      iterations it holds what the body computed, so it may depend on any
      operand of the equation.
    outputs: per output of ``jaxpr``, the index of the equation result it
      becomes, or None (a scan's carry is its result only on the last
      iteration, still mapped; a while loop's condition has no result).
    sliced: per input, whether it receives one slice of its operand per
      iteration (a scan's ``xs``; the operand has a leading axis of
      ``length``). Empty: none.
    stacked: per output, whether the equation's result stacks it over the
      iterations (a scan's ``ys``). Empty: none.
    runs: `ONCE`, `EACH` (``length`` times), `WHILE` or `ONE_OF`.
    length: a scan's trip count; 1 for a call; None where it is dynamic.
    differentiated: whether autodiff differentiates this jaxpr as written.
      False for a custom rule's primal body (the rule differentiates) and
      for a ``while`` loop (it has no reverse-mode derivative).
    per_device: whether it runs on per-device shards (``shard_map``,
      ``pmap``): its shapes are a device's, and it may hold collectives
      over mesh axes only bound inside the equation.
  """

  kind: str
  label: Optional[str]
  jaxpr: Any
  consts: Sequence[Any]
  inputs: tuple[int, ...]
  carried: tuple[bool, ...]
  outputs: tuple[Optional[int], ...]
  runs: str = ONCE
  sliced: tuple[bool, ...] = ()
  stacked: tuple[bool, ...] = ()
  length: Optional[int] = 1
  differentiated: bool = True
  per_device: bool = False

  def flow(self, operands: Sequence[Any], anything: Any) -> list:
    """Per input of the jaxpr, the operand's value (``operands`` indexed as
    the equation's), or ``anything`` for a loop carry."""
    return [anything if c else operands[i] for i, c in zip(self.inputs, self.carried)]


def _open(body) -> tuple[Any, Sequence[Any]]:
  """``(jaxpr, consts)`` of a closed or open jaxpr."""
  if isinstance(body, core.ClosedJaxpr):
    return body.jaxpr, body.consts
  return body, ()


def _call(kind, label, body, **kw) -> Region:
  """A body that takes the equation's operands and gives its results, 1:1."""
  jaxpr, consts = _open(body)
  n_in = len(jaxpr.invars)
  return Region(kind, label, jaxpr, consts, tuple(range(n_in)), (False,) * n_in,
                tuple(range(len(jaxpr.outvars))), **kw)


def _scan(eqn) -> list[Region]:
  p = eqn.params
  jaxpr, consts = _open(p["jaxpr"])
  n_consts, n_carry = _internals.scan_split(p)
  n_in = len(jaxpr.invars)
  carried = tuple(n_consts <= k < n_consts + n_carry for k in range(n_in))
  n_out = len(jaxpr.outvars)
  return [Region("scan", "scan", jaxpr, consts, tuple(range(n_in)), carried,
                 tuple(range(n_out)), runs=EACH, length=int(p["length"]),
                 sliced=tuple(k >= n_consts + n_carry for k in range(n_in)),
                 stacked=tuple(j >= n_carry for j in range(n_out)))]


def _while(eqn) -> list[Region]:
  p = eqn.params
  nc, nb = int(p["cond_nconsts"]), int(p["body_nconsts"])
  cond, cond_consts = _open(p["cond_jaxpr"])
  body, body_consts = _open(p["body_jaxpr"])
  n_carry = len(body.outvars)
  carry = tuple(range(nc + nb, nc + nb + n_carry))
  return [
      Region("while_cond", "while.cond", cond, cond_consts, tuple(range(nc)) + carry,
             (False,) * nc + (True,) * n_carry, (None,), runs=WHILE, length=None,
             differentiated=False),
      Region("while", "while.body", body, body_consts, tuple(range(nc, nc + nb)) + carry,
             (False,) * nb + (True,) * n_carry, tuple(range(n_carry)), runs=WHILE,
             length=None, differentiated=False),
  ]


def _cond(eqn) -> list[Region]:
  out = []
  for i, branch in enumerate(eqn.params["branches"]):
    jaxpr, consts = _open(branch)
    n = len(jaxpr.invars)
    out.append(Region("cond", f"cond.branch{i}", jaxpr, consts, tuple(range(1, n + 1)),
                      (False,) * n, tuple(range(len(jaxpr.outvars))), runs=ONE_OF))
  return out


def _simple(kind: str, label: Optional[str], param: str, **kw) -> Callable:
  def regions(eqn):
    return [_call(kind, label, eqn.params[param], **kw)]
  return regions


# Primitive name -> its regions. custom_jvp_call and custom_vjp_call hold
# their primal body as ``call_jaxpr``: what runs forward, not what
# differentiates (``jvp_jaxpr_fun``, ``fwd_jaxpr_thunk`` and ``bwd`` do,
# functions reached through `_internals`' thunk names).
_TABLE: dict[str, Callable[[Any], list[Region]]] = {
    "jit": _simple("call", None, "jaxpr"),
    "pjit": _simple("call", None, "jaxpr"),
    "call": _simple("call", None, "call_jaxpr"),
    "closed_call": _simple("call", None, "call_jaxpr"),
    "core_call": _simple("call", None, "call_jaxpr"),
    "remat2": _simple("checkpoint", "checkpoint", "jaxpr"),
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "custom_jvp_call": _simple("custom_jvp", "custom_jvp", "call_jaxpr",
                               differentiated=False),
    "custom_vjp_call": _simple("custom_vjp", "custom_vjp", "call_jaxpr",
                               differentiated=False),
    # custom_vjp(optimize_remat=True): the rule's forward pass, outputs and
    # residuals, as one jaxpr (jax/_src/custom_derivatives.py, remat_opt_p).
    "remat_opt": _simple("custom_vjp", "custom_vjp", "fwd_jaxpr", differentiated=False),
    "shard_map": _simple("shard_map", "shard_map", "jaxpr", per_device=True),
    # jax.experimental.custom_partitioning: ``call`` is the function's
    # meaning on one device; the partitioner may lower another per shard
    # (jax/_src/custom_partitioning.py, ``_custom_partitioning_impl``).
    "custom_partitioning": _simple("custom_partitioning", "custom_partitioning", "call",
                                   differentiated=False),
    "xla_pmap": _simple("pmap", "pmap", "call_jaxpr", per_device=True),
}

KNOWN = frozenset(_TABLE)


def held_jaxprs(eqn) -> list[tuple[str, Any]]:
  """``(parameter name, jaxpr or closed jaxpr)`` for every jaxpr in ``eqn``'s params."""
  found = []
  for key, value in eqn.params.items():
    for item in (value if isinstance(value, (tuple, list)) else (value,)):
      if isinstance(item, (core.Jaxpr, core.ClosedJaxpr)):
        found.append((key, item))
  return found


_HIGHER_ORDER: dict[str, bool] = {}


def _runs_bodies(eqn, held) -> bool:
  """Whether ``eqn`` runs the jaxprs it holds as bodies, rather than as
  scalar combiners (``scatter-add``'s ``update_jaxpr``, ``reduce``'s
  ``computation``): JAX gives the former's primitives the rules only
  higher-order primitives need (`jmp_lite._jaxpr.internals.higher_order_
  primitives`; a primitive is registered when its module loads, before any
  equation binds it, so the answer per name is kept), and a body that no
  rule registers still takes the equation's operands as they are."""
  name = eqn.primitive.name
  if name not in _HIGHER_ORDER:
    _HIGHER_ORDER[name] = (name in _internals.KNOWN_HIGHER_ORDER
                           or name in _internals.higher_order_primitives())
  if _HIGHER_ORDER[name]:
    return True
  shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
  return any(shapes == [tuple(getattr(v.aval, "shape", ())) for v in _open(b)[0].invars]
             and any(shapes) for _, b in held)


def regions(eqn) -> list[Region]:
  """The jaxprs ``eqn`` runs, wired to it (``[]`` for a first-order primitive).

  Raises:
    UnknownPrimitiveError: if ``eqn``'s primitive holds a jaxpr and is not
      in the table.
  """
  rule = _TABLE.get(eqn.primitive.name)
  if rule is not None:
    return rule(eqn)
  held = held_jaxprs(eqn)
  if not held or not _runs_bodies(eqn, held):
    return []  # first-order, or a combiner (scatter-add's update_jaxpr)
  raise UnknownPrimitiveError(
      f"jmp_lite does not know how to enter the higher-order primitive "
      f"{eqn.primitive.name!r} (its parameters {[k for k, _ in held]} hold jaxprs); "
      "see jmp_lite/_jaxpr/traverse.py")


def regions_or_warn(eqn, what: str) -> list[Region]:
  """`regions`, or, for an unknown primitive, a warning naming ``what`` (the
  pass) and its jaxprs as opaque ``"unknown"`` regions that a pass reports
  but does not rewrite or measure."""
  try:
    return regions(eqn)
  except UnknownPrimitiveError as e:
    warnings.warn(f"{what}: {e}; it runs as written.", BodyNotEnteredWarning,
                  stacklevel=3)
  out = []
  for key, body in held_jaxprs(eqn):
    jaxpr, consts = _open(body)
    n = len(jaxpr.invars)
    out.append(Region("unknown", f"{eqn.primitive.name}.{key}", jaxpr, consts,
                      tuple(range(n)), (True,) * n, (None,) * len(jaxpr.outvars),
                      length=None, differentiated=False))
  return out


def warn_not_entered(eqn, what: str) -> None:
  """Warns that the pass ``what`` runs ``eqn``'s bodies as written, if it
  holds any (nothing for a first-order primitive or a combiner)."""
  name = eqn.primitive.name
  if name not in _TABLE:
    regions_or_warn(eqn, what)  # warns for an unknown one
  elif _TABLE[name](eqn):
    warnings.warn(f"{what} has no rule for the bodies of {name!r}; they run as written.",
                  BodyNotEnteredWarning, stacklevel=3)


# The kinds `run` evaluates: every body of these runs as JAX would run it.
RUNS = frozenset({"call", "checkpoint", "scan", "cond", "while"})


def run(eqn, invals, body: Callable, state: Any, *, combine: Callable = None,
        start: Any = None) -> tuple[list, Any]:
  """Evaluates ``eqn``, a call, checkpoint, scan, cond or while (`RUNS`),
  with its bodies evaluated by the pass: ``body(r, args, state) -> (outs,
  out)`` for the ``r``-th entered region (a while loop's condition is not
  one: it runs as written), threading the pass's ``state`` and ``out``:

  * call, checkpoint: one ``body`` call on ``state``; a checkpoint keeps its
    ``policy`` and ``prevent_cse`` (the body runs under `jax.checkpoint`);
  * scan: ``state`` has a leading axis of the scan's length, sliced per
    iteration as ``xs`` are; the ``out``s come back stacked like ``ys``;
  * cond: the branch taken gets ``state``; every branch's ``out`` must have
    one structure;
  * while: every iteration gets ``state``; the ``out``s are folded by
    ``combine(so_far, out)`` from ``start``.

  Returns ``(the equation's outputs, out)``.
  """
  every = _TABLE[eqn.primitive.name](eqn)
  regions = [r for r in every if r.kind != "while_cond"]
  kind = regions[0].kind
  p = eqn.params
  invals = list(invals)
  if kind == "call":
    outs, out = body(0, invals, state)
    return list(outs), out
  if kind == "checkpoint":
    fun = lambda st, *args: body(0, list(args), st)
    outs, out = jax.checkpoint(fun, prevent_cse=p["prevent_cse"], policy=p["policy"])(
        state, *invals)
    return list(outs), out
  if kind == "scan":
    (r,) = regions
    n_carry = sum(r.carried)
    fixed = [(v, c, s) for v, c, s in zip((invals[i] for i in r.inputs), r.carried, r.sliced)]
    init = [v for v, c, _ in fixed if c]
    xs = [v for v, _, s in fixed if s]

    def step(carry, x):
      xs_now, st = x
      now_c, now_x = iter(carry), iter(xs_now)
      args = [next(now_c) if c else next(now_x) if s else v for v, c, s in fixed]
      outs, out = body(0, args, st)
      return list(outs[:n_carry]), (list(outs[n_carry:]), out)

    carry, (ys, out) = jax.lax.scan(step, init, (xs, state), length=r.length,
                                    reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys], out
  if kind == "cond":
    def branch(i, ops, st):
      return body(i, [ops[k - 1] for k in regions[i].inputs], st)
    outs, out = jax.lax.switch(invals[0], [functools.partial(branch, i)
                                           for i in range(len(regions))],
                               invals[1:], state)
    return list(outs), out
  if kind == "while":
    cond, (r,) = every[0], regions
    cond_consts = [invals[i] for i, c in zip(cond.inputs, cond.carried) if not c]
    body_consts = [invals[i] for i, c in zip(r.inputs, r.carried) if not c]
    init = [invals[i] for i, c in zip(r.inputs, r.carried) if c]

    def keep_going(loop):
      carry, _ = loop
      return _internals.eval_jaxpr(cond.jaxpr, cond.consts, [*cond_consts, *carry],
                                   _internals.bind)[0]

    def step(loop):
      carry, so_far = loop
      outs, out = body(0, [*body_consts, *carry], state)
      return list(outs), combine(so_far, out)

    carry, out = jax.lax.while_loop(keep_going, step, (init, start))
    return list(carry), out
  raise ValueError(f"_traverse.run: {eqn.primitive.name!r} is not one of {sorted(RUNS)}")
