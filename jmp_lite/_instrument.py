"""Places probes (`jmp_lite._probes`) and fp8 matmul sites (`jmp_lite._fp8_sites`)
in a traced function and reads them back.

`value_and_grad` traces the function once (with `tap` marks active), plans
where each probe's and each fp8 site's carrier lives in one flat float32
vector, evaluates the jaxpr with them in place and differentiates with
respect to that vector too. A probe's slice is zeros and its cotangent the
statistics (`jmp_lite._stats` reads them); an fp8 site's slice holds its
three scales and its cotangent the three maxima. Higher-order equations holding probes are re-bound through the
public API with their share of the carrier:

* ``scan``: the carrier slice becomes one more scanned input, a row per
  iteration, so a scanned stack of layers reports each layer;
* ``checkpoint`` (``remat``) and ``cond``: one more operand (each branch
  its own slice; the branch not taken reports zeros);
* ``jit``: evaluated inline.

Other higher-order equations (``while``, custom derivatives, ``shard_map``
nested inside the function) run as written, and marks inside them report
nothing: ``while`` has no reverse-mode derivative to carry statistics, and a
custom rule's body is not what its derivative computes. `jmp_lite._unseen`
warns when fp8 matmuls or telemetry marks sit there.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _dtypes
from jmp_lite import _fp8_numerics
from jmp_lite import _fp8_sites
from jmp_lite import _internals
from jmp_lite import _probes
from jmp_lite import _replicas
from jmp_lite import _unseen
from jmp_lite import fp8 as fp8_lib
from jmp_lite import policy as policy_lib

_NESTED = ("scan", "remat2", "jit", "pjit", "cond")


@dataclasses.dataclass
class Point:
  offset: int
  path: str
  dtype: str
  thresholds: _probes.Thresholds
  view: Any = None  # the dtype a marked parameter is cast to (`_probes.tap`)
  recipe: Optional[tuple[str, str]] = None  # an fp8 matmul site's formats
  scaling: str = "delayed"  # an fp8 matmul site's: "delayed" or "current"

  @property
  def width(self) -> int:
    if self.recipe is not None:
      return _fp8_sites.WIDTH
    return _probes.width(len(self.thresholds.tinies))


@dataclasses.dataclass
class Nested:
  offset: int
  kind: str
  children: list["Plan"]
  length: int = 1  # scan iterations


@dataclasses.dataclass
class Plan:
  """Where each probe of one jaxpr writes in that jaxpr's carrier."""
  size: int = 0
  points: dict = dataclasses.field(default_factory=dict)  # eqn -> [(out, Point)]
  nested: dict = dataclasses.field(default_factory=dict)  # eqn -> Nested


class _Planner:
  """Builds plans: which values are probed, and their paths."""

  def __init__(self, mode: Optional[str], tap_paths: Sequence[str], what_if,
               fp8: Optional["Fp8Selection"] = None):
    self.mode = mode
    self.tap_paths = tap_paths
    self.what_if = tuple(what_if)
    self.fp8 = fp8

  def point(self, plan, key, path, aval, view=None):
    dtype = np.dtype(aval.dtype if view is None else view)
    view = None if dtype == np.dtype(aval.dtype) else dtype
    point = Point(plan.size, path, dtype.name,
                  _probes.thresholds(dtype, self.what_if), view)
    plan.points.setdefault(key[0], []).append((key[1], point))
    plan.size += point.width

  def plan(self, jaxpr, prefix: str) -> Plan:
    plan = Plan()
    for i, eqn in enumerate(jaxpr.eqns):
      where = _join(prefix, str(eqn.source_info.name_stack))
      k = _probes.tap_index(eqn)
      if k is not None:
        if self.mode == "modules":
          for j, v in enumerate(eqn.outvars):
            path, views = self.tap_paths[k]
            self.point(plan, (i, j), path, v.aval, views[j])
        continue
      recipe, site = self.fp8.choose(eqn, where) if self.fp8 else (None, "")
      if recipe is not None:
        point = Point(plan.size, site, "fp8", (), recipe=recipe,
                      scaling=self.fp8.scaling)
        plan.points.setdefault(i, []).append((None, point))
        plan.size += point.width
      children = self.children(eqn, where)
      if children is not None:
        if any(c.size for c in children):
          length = eqn.params["length"] if eqn.primitive.name == "scan" else 1
          plan.nested[i] = Nested(plan.size, eqn.primitive.name, children, length)
          plan.size += length * sum(c.size for c in children)
        continue
      if _is_higher_order(eqn):
        _unseen.warn(eqn, where, self.fp8.choose if self.fp8 else None, _join,
                     modules=self.mode == "modules", shown=_clean(where))
      if self.mode == "ops" and not _is_higher_order(eqn):
        for j, v in enumerate(eqn.outvars):
          if _dtypes.is_floating(v.aval) and v.aval.size:
            self.point(plan, (i, j), _clean(where), v.aval)
    return plan

  def children(self, eqn, where) -> Optional[list[Plan]]:
    name = eqn.primitive.name
    if name not in _NESTED:
      return None
    if name == "cond":
      return [self.plan(b.jaxpr, where) for b in eqn.params["branches"]]
    body = eqn.params["jaxpr"]
    return [self.plan(getattr(body, "jaxpr", body), where)]


@dataclasses.dataclass(frozen=True)
class Fp8Selection:
  """Which matmuls a step runs in fp8 (`jmp_lite.fp8.Fp8State.select`).

  ``select`` None: those inside wrap's fp8 marks (the innermost mark decides,
  so a module with another policy inside an fp8 module is not fp8). Else a
  regular expression on the matmul's name-scope path, every match with
  ``recipe``.
  """
  select: Optional[str] = None
  recipe: str = "hybrid"
  scaling: str = "delayed"

  def choose(self, eqn, where: str) -> tuple[Optional[tuple[str, str]], str]:
    if eqn.primitive.name not in ("dot_general", "jmp_dot_general"):
      return None, ""
    if not all(_dtypes.is_floating(v.aval) and v.aval.dtype.itemsize > 1
               for v in eqn.invars):
      return None, ""  # integer products, or operands already fp8
    parts = [p for p in where.split("/") if p]
    marks = [p for p in parts if p.startswith(_fp8_sites.MARK)]
    path = _clean(where)
    if self.select is not None:
      if re.fullmatch(self.select, path) is None:
        return None, ""
      return policy_lib.FP8_RECIPES[self.recipe], path
    if not marks:
      return None, ""
    recipe, _, module = marks[-1][len(_fp8_sites.MARK) + 1:].partition("@")
    if recipe not in policy_lib.FP8_RECIPES:
      return None, ""
    return policy_lib.FP8_RECIPES[recipe], module.replace(".", "/")


def _is_higher_order(eqn) -> bool:
  return any(isinstance(getattr(v, "jaxpr", v), _internals.core.Jaxpr)
             or _internals.is_wrapped_fun(v) for v in eqn.params.values())


def _join(prefix: str, stack: str) -> str:
  return "/".join(p for p in (prefix, stack) if p)


def collapse(path: str) -> str:
  """A name-stack path with the repeats nested wrappers make collapsed.

  Flax names a module's scope twice (``Dense_0/Dense_0``), and wrap's own
  frame adds ``module`` once more.
  """
  parts = [p for p in path.split("/") if p]
  return "/".join(p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1])


def _clean(path: str) -> str:
  """`collapse`, with wrap's own frame and fp8 marks removed: paths as wrap's rules see them."""
  path = collapse("/".join(p for p in path.split("/")
                           if not p.startswith(_fp8_sites.MARK)))
  prefix = "_LinenWrapper/module"
  return path[len(prefix) + 1:] if path.startswith(prefix + "/") else (
      "" if path == prefix else path)


def interpret(jaxpr, consts, args, carrier, plan: Plan, gate=None) -> list[Any]:
  """Evaluates ``jaxpr`` with the probes of ``plan`` fed from ``carrier``.

  ``gate``: None (every probe measures) or a float32 scalar (they measure
  where it is positive, `jmp_lite._probes.probe`).
  """
  index = iter(range(len(jaxpr.eqns)))

  def eval_eqn(eqn, invals):
    i = next(index)
    nested = plan.nested.get(i)
    if nested is not None:
      return _nested(eqn, invals, carrier, nested, gate)
    points = plan.points.get(i, ())
    site = next((p for j, p in points if p.recipe is not None), None)
    if site is not None:
      lhs, rhs = invals
      outs = _fp8_sites.matmul(lhs, rhs, carrier[site.offset:site.offset + site.width],
                               eqn.params["dimension_numbers"], eqn.outvars[0].aval.dtype,
                               *(fp8_lib.FORMATS[f] for f in site.recipe),
                               scaling=site.scaling)
    else:
      # A mark is bound as it is: JAX may have moved a cast into its body.
      outs = _internals.bind(eqn, invals)
    points = [(j, p) for j, p in points if p.recipe is None]
    if not points:
      return outs
    outs = list(outs) if eqn.primitive.multiple_results else [outs]
    for j, p in points:
      outs[j] = _probes.probe(outs[j], carrier[p.offset:p.offset + p.width],
                              p.thresholds, gate, p.view)
    return outs if eqn.primitive.multiple_results else outs[0]

  return _internals.eval_jaxpr(jaxpr, consts, args, eval_eqn)


def _nested(eqn, invals, carrier, nested: Nested, gate):
  p = eqn.params
  kind = nested.kind
  sizes = [c.size for c in nested.children]
  region = carrier[nested.offset:nested.offset + nested.length * sum(sizes)]
  if kind == "scan":
    (child,) = nested.children
    body = p["jaxpr"]
    nc, nk = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]

    def step(carry, x):
      xs_i, c_i = x
      outs = interpret(body.jaxpr, body.consts, [*consts, *carry, *xs_i], c_i,
                       child, gate)
      return outs[:nk], outs[nk:]

    carry, ys = jax.lax.scan(
        step, list(init), (list(xs), region.reshape(nested.length, sizes[0])),
        length=nested.length, reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]
  if kind == "remat2":
    (child,) = nested.children
    body = p["jaxpr"]
    fun = lambda c, *a: interpret(body, [], list(a), c, child, gate)
    return jax.checkpoint(fun, prevent_cse=p["prevent_cse"], policy=p["policy"])(
        region, *invals)
  if kind in ("jit", "pjit"):
    (child,) = nested.children
    body = p["jaxpr"]
    return interpret(body.jaxpr, body.consts, list(invals), region, child, gate)
  # cond: each branch reads its own slice of the region.
  starts = np.cumsum([0, *sizes])
  branches = [functools.partial(_branch, b, c, region[s:s + c.size], gate)
              for b, c, s in zip(p["branches"], nested.children, starts)]
  return list(jax.lax.switch(invals[0], branches, *invals[1:]))


def _branch(closed, plan, carrier, gate, *ops):
  return interpret(closed.jaxpr, closed.consts, list(ops), carrier, plan, gate)


def decode(vector: jax.Array, plan: Plan) -> list[tuple[Point, jax.Array]]:
  """Per point, in forward order: ``(point, its slice)``; scans add leading axes."""
  out = []
  items = sorted([(i, -1 if j is None else j, "p", v)
                  for i, ps in plan.points.items() for j, v in ps]
                 + [(i, 0, "n", v) for i, v in plan.nested.items()],
                 key=lambda t: (t[0], t[1]))
  for _, _, kind, item in items:
    if kind == "p":
      out.append((item, vector[..., item.offset:item.offset + item.width]))
      continue
    sizes = [c.size for c in item.children]
    region = vector[..., item.offset:item.offset + item.length * sum(sizes)]
    if item.kind == "scan":
      region = region.reshape(*region.shape[:-1], item.length, sizes[0])
    start = 0
    for child, size in zip(item.children, sizes):
      out += decode(region[..., start:start + size], child)
      start += size
  return out


def _trace(fun, args, kwargs, planner: "_Planner"):
  """``fun`` traced once with marks active: its jaxpr, its plan, how to call it."""
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  traced = [i for i, x in enumerate(leaves)
            if isinstance(x, (jax.Array, np.ndarray, np.generic))]
  out_tree = {}

  def flat_fun(*dynamic):
    full = list(leaves)
    for i, x in zip(traced, dynamic):
      full[i] = x
    a, k = jax.tree_util.tree_unflatten(treedef, full)
    out, out_tree["tree"] = jax.tree_util.tree_flatten(fun(*a, **k))
    return out

  with _probes.tapping() as paths:
    closed = jax.make_jaxpr(flat_fun)(*(leaves[i] for i in traced))
  planner.tap_paths = list(paths)
  return closed, planner.plan(closed.jaxpr, ""), traced, out_tree


def sites(plan: Plan) -> list[tuple[str, Point, np.ndarray]]:
  """The fp8 matmul sites of ``plan``: name, point and carrier indices ``[..., 6]``.

  Named by module path (or name-scope path), with ``#2``, ``#3``... for a
  path's later matmuls, in forward order.
  """
  out, seen = [], set()
  for point, idx in decode(np.arange(plan.size), plan):
    if point.recipe is None:
      continue
    base = point.path or "dot_general"
    name, n = base, 1
    while name in seen:
      n += 1
      name = f"{base}#{n}"
    seen.add(name)
    out.append((name, point, idx))
  return out


def fp8_sites(fun, args, kwargs, fp8: Fp8Selection) -> list[tuple[str, tuple, tuple]]:
  """``(name, leading shape, recipe)`` of each fp8 matmul ``fun(*args)`` makes."""
  _, plan, _, _ = _trace(fun, args, kwargs, _Planner(None, (), (), fp8))
  return [(name, idx.shape[:-1], p.recipe) for name, p, idx in sites(plan)]


def value_and_grad(fun: Callable[..., Any], argnums: tuple[int, ...], *,
                   mode: Optional[str] = None, what_if: Sequence[Any] = (),
                   fp8: Optional[Fp8Selection] = None,
                   allow_int: bool = False) -> Callable[..., Any]:
  """``jax.value_and_grad(fun, argnums, has_aux=True)`` with probes and fp8 sites.

  Returns ``g(gate, fp8_state, *args, **kwargs) -> ((value, aux), grads),
  rows, amax``: ``rows`` the probes' ``(path, dtype, stats)`` in forward
  order (``mode`` None: no probes), ``amax`` each fp8 site's ``[..., 3]``
  absolute maxima, quantised with ``fp8_state``'s scales (``fp8`` None: no
  sites, ``{}``); all computed in the same pass. ``gate`` as `interpret`
  takes it.
  """

  def g(gate, fp8_state, *args, **kwargs):
    closed, plan, traced, out_tree = _trace(fun, args, kwargs,
                                            _Planner(mode, (), what_if, fp8))
    slots = sites(plan)

    def probed(carrier, *args, **kwargs):
      now = jax.tree_util.tree_leaves((args, kwargs))
      outs = interpret(closed.jaxpr, closed.consts, [now[i] for i in traced],
                       carrier, plan, gate)
      value, aux = jax.tree_util.tree_unflatten(out_tree["tree"], outs)
      return value, aux

    shifted = tuple(a + 1 for a in argnums)
    carrier = _carrier(plan, slots, fp8_state)
    (value, aux), grads = jax.value_and_grad(probed, argnums=(0, *shifted),
                                             has_aux=True, allow_int=allow_int)(carrier, *args, **kwargs)
    rows = [(p.path, p.dtype, a) for p, a in decode(grads[0], plan) if p.recipe is None]
    amax = {name: grads[0][idx][..., :_fp8_sites.ROLES] for name, _, idx in slots}
    return ((value, aux), tuple(grads[1:])), rows, amax

  return g


def forward(fun: Callable[..., Any], fp8_state: Any, *args, **kwargs) -> Any:
  """``fun(*args, **kwargs)`` with its fp8 sites run with ``fp8_state``'s scales.

  The sites are chosen as the training step chooses them (the state's
  ``select`` and ``recipe``), and each runs the same forward computation
  (`jmp_lite._fp8_sites.matmul`), so for the same inputs and state the
  output is the training forward's, bitwise. Nothing is measured or
  updated.
  """
  if not isinstance(fp8_state, fp8_lib.Fp8State):
    raise TypeError(f"fp8 must be a jmp_lite.fp8.Fp8State (from jmp_lite.fp8.init), "
                    f"got {type(fp8_state).__name__}")
  selection = Fp8Selection(fp8_state.select, fp8_state.recipe, fp8_state.scaling)
  closed, plan, traced, out_tree = _trace(fun, args, kwargs,
                                          _Planner(None, (), (), selection))
  carrier = _carrier(plan, sites(plan), fp8_state)
  now = jax.tree_util.tree_leaves((args, kwargs))
  outs = interpret(closed.jaxpr, closed.consts, [now[i] for i in traced], carrier, plan)
  return jax.tree_util.tree_unflatten(out_tree["tree"], outs)


def _carrier(plan: Plan, slots, fp8_state) -> jax.Array:
  """The float32 carrier of ``plan``: zeros, and each fp8 site's scales and
  their reciprocals (`jmp_lite._fp8_numerics.site_carrier`)."""
  carrier = jnp.zeros((plan.size,), jnp.float32)
  if slots or fp8_state is not None:
    scales = _check_state(fp8_state, slots)  # every site of the state, and no other
  if slots:
    carrier = carrier.at[np.concatenate([i.ravel() for _, _, i in slots])].set(
        _fp8_numerics.site_carrier([scales[name] for name, _, _ in slots]))
  if _replicas.manual_axes() and _replicas.tracks_varying(_replicas.manual_axes()):
    # Per-device statistics: a carrier varying over every manual axis
    # takes them without the sum a replicated input's gradient gets.
    carrier = jax.lax.pcast(carrier, _replicas.manual_axes(), to="varying")
  return carrier


def _check_state(state, slots) -> dict:
  """The scales of ``state``, checked against the sites the trace found."""
  if not isinstance(state, fp8_lib.Fp8State):
    raise TypeError(f"expected a jmp_lite.fp8.Fp8State, got {type(state).__name__}")
  fp8_lib._same_sites(state.sites, {name: None for name, _, _ in slots})
  for name, point, idx in slots:
    meta = state.sites[name]
    formats = (meta.lhs.dtype, meta.grad.dtype)
    want = tuple(fp8_lib.FORMATS[f] for f in point.recipe)
    if formats != want or meta.lhs.scale.shape != idx.shape[:-1]:
      raise ValueError(
          f"fp8 site {name!r}: the state has formats {[d.name for d in formats]} and "
          f"rows {meta.lhs.scale.shape}, the step {[d.name for d in want]} and "
          f"{idx.shape[:-1]}. Make the state with jmp_lite.fp8.init on this step.")
  return state.scales()
