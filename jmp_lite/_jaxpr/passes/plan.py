"""Where the instrumented step's probes and fp8 sites go: plans over a jaxpr.

`jmp_lite._jaxpr.passes.instrument` traces a function once and asks `Planner` which
values are probed (telemetry) and which matmuls are fp8 sites, and where
each one's slice of the flat float32 carrier lives. A `Plan` per jaxpr
maps equation indices to `Point`s (a probe or a site) and to `Nested`
plans (the bodies of calls such as ``jit``, and of ``remat``, ``scan``,
``cond`` and ``while`` equations, as `jmp_lite._jaxpr.traverse` gives them, each
with its own region of the carrier). `decode` reads a
vector laid out by a plan back per point; `forward_slots` says which slots
the forward pass fills and which hold maxima; `sites` names the fp8 sites.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional, Sequence

import jax
import numpy as np

from jmp_lite import _dtypes
from jmp_lite import _fp8_numerics
from jmp_lite._jaxpr import fp8_sites as _fp8_sites
from jmp_lite._jaxpr import internals as _internals
from jmp_lite._jaxpr.passes import unseen as _unseen
from jmp_lite._jaxpr import probes as _probes
from jmp_lite._jaxpr import traverse as _traverse

# The bodies telemetry and fp8 enter, by `jmp_lite._jaxpr.traverse` kind. The rest
# (a while loop's condition, custom rules' bodies, shard_map's, an unknown
# primitive's) run as written, and `_unseen` warns where that hides fp8
# matmuls or telemetry marks.
_ENTERED = frozenset({"call", "checkpoint", "scan", "cond", "while"})


@dataclasses.dataclass
class Point:
  offset: int
  path: str
  dtype: str
  thresholds: _probes.Thresholds
  view: Any = None  # the dtype a marked value is held in across a cast (`_probes.tap`)
  # Whether its cotangent is measured as ``view`` holds it too: a model output
  # marked after its cast to a wider output dtype (`_probes.tap`'s ``cast_back``).
  cast_back: bool = False
  recipe: Optional[tuple[str, str]] = None  # an fp8 matmul site's formats
  scaling: str = "delayed"  # an fp8 matmul site's: "delayed" or "current"
  # An fp8 site's, per enclosing scan (outermost first): whether it is one
  # site for all the scan's iterations rather than one per iteration
  # (`_mark_shared`).
  shared: tuple[bool, ...] = ()
  # Whether a gradient reaches the value (an fp8 site: either operand) in
  # the differentiated step (`Planner.plan`); one no gradient reaches is
  # measured on the forward pass only, and stays undifferentiated.
  live: bool = True

  @property
  def width(self) -> int:
    if self.recipe is not None:
      return _fp8_sites.WIDTH
    return _probes.width(len(self.thresholds.tinies))

  def shared_axes(self) -> tuple[int, ...]:
    """The leading (scan) axes of this site's carrier rows it has one state for."""
    return tuple(i for i, one in enumerate(self.shared) if one)

  def state_shape(self, rows: tuple[int, ...]) -> tuple[int, ...]:
    """The leading shape of this site's state, given its carrier rows' ``rows``."""
    return tuple(n for n, one in zip(rows, self.shared) if not one)


@dataclasses.dataclass
class Nested:
  offset: int
  kind: str  # the `jmp_lite._jaxpr.traverse.Region` kind of its bodies
  children: list["Plan"]
  length: int = 1  # scan iterations
  regions: list = dataclasses.field(default_factory=list)  # one per child


@dataclasses.dataclass
class Plan:
  """Where each probe of one jaxpr writes in that jaxpr's carrier."""
  size: int = 0
  points: dict = dataclasses.field(default_factory=dict)  # eqn -> [(out, Point)]
  nested: dict = dataclasses.field(default_factory=dict)  # eqn -> Nested
  # Per output of the jaxpr: whether it is a parameter (`Planner.plan`).
  params_out: tuple = ()


class Planner:
  """Builds plans: which values are probed, and their paths."""

  def __init__(self, mode: Optional[str], what_if,
               fp8: Optional["Fp8Selection"] = None):
    self.mode = mode
    self.what_if = tuple(what_if)
    self.fp8 = fp8

  def point(self, plan, key, path, aval, view=None, live=True, cast_back=False):
    dtype = np.dtype(aval.dtype if view is None else view)
    view = None if dtype == np.dtype(aval.dtype) else dtype
    point = Point(plan.size, path, dtype.name,
                  _probes.thresholds(dtype, self.what_if), view, live=live,
                  cast_back=cast_back and view is not None)
    plan.points.setdefault(key[0], []).append((key[1], point))
    plan.size += point.width

  def plan(self, jaxpr, prefix: str, live: Optional[Sequence[bool]] = None,
           params: Optional[Sequence[bool]] = None) -> Plan:
    """The plan of ``jaxpr``. ``live``: which of its inputs a gradient
    reaches (None: all); a value is live if it is computed from a live one,
    not through ``stop_gradient``. ``params``: which inputs are parameters
    (None: none known); a value is one if it is a parameter whole: recast,
    reshaped, marked or returned by a call (`_mark_shared` reads it)."""
    plan = Plan()
    alive = {v for v, on in zip(jaxpr.invars, live or [True] * len(jaxpr.invars)) if on}
    stored = {v for v, on in zip(jaxpr.invars, params or [False] * len(jaxpr.invars)) if on}
    for i, eqn in enumerate(jaxpr.eqns):
      where = _join(prefix, str(eqn.source_info.name_stack))
      ins = [isinstance(v, _internals.core.Var) and v in alive for v in eqn.invars]
      pins = [isinstance(v, _internals.core.Var) and v in stored for v in eqn.invars]
      out_live = any(ins) and eqn.primitive.name != "stop_gradient"
      if out_live:
        alive.update(eqn.outvars)
      if pins and pins[0] and eqn.primitive.name in _LAYOUT:
        stored.update(eqn.outvars)
      tapped = _probes.tap_info(eqn)
      if tapped is not None:
        # A mark returns its operands (NNX's parameters are marked as read).
        stored.update(o for o, p in zip(eqn.outvars, pins) if p)
        if self.mode == "modules":
          for j, v in enumerate(eqn.outvars):
            path, views, cast_back = tapped
            self.point(plan, (i, j), path, v.aval, views[j], live=out_live,
                       cast_back=cast_back)
        continue
      recipe, site = self.fp8.choose(eqn, where) if self.fp8 else (None, "")
      if recipe is not None:
        point = Point(plan.size, site, "fp8", (), recipe=recipe,
                      scaling=self.fp8.scaling, live=out_live)
        plan.points.setdefault(i, []).append((None, point))
        plan.size += point.width
      regions = _traverse.regions_or_warn(eqn, "telemetry and fp8")
      entered = [r for r in regions if r.kind in _ENTERED]
      if len(entered) < len(regions):
        # Run as written: a while loop's condition (a matmul there is
        # unusual), a custom rule's or shard_map's body.
        _unseen.warn(eqn, where, self.fp8.choose if self.fp8 else None, _join,
                     mode=self.mode, shown=_clean(where),
                     bodies=[r.jaxpr for r in regions if r.kind not in _ENTERED]
                     if entered else None)
      if entered:
        # A loop's carry may come to depend on any operand.
        children = [self.plan(r.jaxpr, where, r.flow(ins, any(ins)), r.flow(pins, False))
                    for r in entered]
        if entered[0].kind in ("call", "checkpoint") and len(entered) == 1:
          # A call returns a parameter it was given whole (a jitted cast).
          stored.update(eqn.outvars[o] for o, p in zip(entered[0].outputs,
                                                       children[0].params_out)
                        if p and o is not None)
        if any(c.size for c in children):
          kind = entered[0].kind
          length = entered[0].length if kind == "scan" else 1
          if kind == "scan":
            _mark_shared(eqn, children[0], pins)
          plan.nested[i] = Nested(plan.size, kind, children, length, entered)
          plan.size += length * sum(c.size for c in children)
        continue
      if self.mode == "ops":
        # Every floating result, a body run as written (a custom_jvp's, such
        # as jax.nn.relu's) at its outputs.
        for j, v in enumerate(eqn.outvars):
          if _dtypes.is_floating(v.aval) and v.aval.size:
            self.point(plan, (i, j), _clean(where), v.aval, live=out_live)
    plan.params_out = tuple(isinstance(v, _internals.core.Var) and v in stored
                            for v in jaxpr.outvars)
    return plan


# Where a scan body's values come from (`_mark_shared`); a layer's: computed
# from a slice of a stack of parameters.
_INVARIANT, _CARRIED, _SCANNED, _LAYER = "invariant", "carried", "scanned", "layer"
# Primitives whose result is their first operand whole, in another layout or
# dtype: a parameter still (the policy's cast). Not a part of it: a lookup
# (``emb[tokens]``) or a slice (``pos[:T]``) scanned over time is a sequence.
_LAYOUT = frozenset({
    "convert_element_type", "reshape", "transpose", "squeeze", "expand_dims",
    "copy", "copy_p", "sharding_constraint", "reduce_precision", "device_put"})
# Primitives that read part of their first operand at indices given by the
# others (``ws[i]`` in a loop body).
_INDEXING = frozenset({"dynamic_slice", "gather"})


def _mark_shared(eqn, child: Plan, params: Sequence[bool] = ()) -> None:
  """Decides, per fp8 site in a ``scan``'s body, one state per iteration or one in all.

  One per iteration where an operand is computed from a slice of a stack of
  parameters (``params``: which of ``eqn``'s operands are parameters), or
  from the scanned inputs with neither operand loop-invariant: a scanned
  stack of layers, each with its own weights (Flax's ``nn.scan`` with
  ``variable_axes={"params": 0}``, its layers' products with an encoder's
  output broadcast into the scan included, or a ``fori_loop`` reading
  ``ws[i]``: an invariant array indexed by the carried counter is a scanned
  input too). One for the whole loop otherwise: a cell scanned over time,
  whose weights are closed over and whose inputs are carried or sliced from
  a sequence, so its state does not depend on the sequence's length.
  """
  region, = _traverse.regions(eqn)
  body = region.jaxpr
  stacked = region.flow(list(params) or [False] * len(eqn.invars), False)
  origins = [frozenset({_CARRIED if carried else _SCANNED if sliced else _INVARIANT}
                       | ({_LAYER} if sliced and param else set()))
             for carried, sliced, param in zip(region.carried, region.sliced, stacked)]
  for point, operands in _site_operands(body, child, origins):
    per_iteration = any(_LAYER in o for o in operands) or (
        any(_SCANNED in o for o in operands)
        and all(o - {_INVARIANT} for o in operands))
    point.shared = (not per_iteration, *point.shared)


def _site_operands(jaxpr, plan: Plan, origins):
  """``(fp8 site, origins of its two operands)`` for each site of ``plan``,
  nested ones too, given the origins of ``jaxpr``'s inputs (a value's are
  the union of its inputs'; a literal has none)."""
  env = {v: frozenset({_INVARIANT}) for v in jaxpr.constvars}
  env.update(zip(jaxpr.invars, origins))
  read = lambda v: frozenset() if isinstance(v, _internals.core.Literal) else env[v]
  for i, eqn in enumerate(jaxpr.eqns):
    ins = [read(v) for v in eqn.invars]
    for _, point in plan.points.get(i, ()):
      if point.recipe is not None:
        yield point, ins[:2]
    nested = plan.nested.get(i)
    if nested is not None:
      for body, child, inner in _body_origins(eqn, ins, nested):
        yield from _site_operands(body, child, inner)
    out = frozenset().union(*ins)
    if eqn.primitive.name in _INDEXING and any(_CARRIED in o for o in ins[1:]):
      out = out | {_SCANNED}  # a slice of a stack by the loop's counter
    for v in eqn.outvars:
      env[v] = out


def _body_origins(eqn, ins, nested: Nested):
  """``(body jaxpr, its plan, origins of its inputs)`` per body of ``eqn``.
  A nested loop's carry may come to depend on anything the loop reads."""
  del eqn
  anything = frozenset().union(*ins)
  return [(r.jaxpr, child, r.flow(ins, anything))
          for r, child in zip(nested.regions, nested.children)]


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
      return _fp8_numerics.RECIPES[self.recipe], path
    if not marks:
      return None, ""
    recipe, _, module = marks[-1][len(_fp8_sites.MARK) + 1:].partition("@")
    if recipe not in _fp8_numerics.RECIPES:
      return None, ""
    return _fp8_numerics.RECIPES[recipe], module.replace(".", "/")


def _join(prefix: str, stack: str) -> str:
  return "/".join(p for p in (prefix, stack) if p)


def collapse(path: str) -> str:
  """A name-stack path with the repeats nested wrappers make collapsed.

  Flax names a module's scope twice (``Dense_0/Dense_0``), and wrap's own
  frame adds ``module`` once more.
  """
  parts = [p for p in path.split("/") if p]
  return "/".join(p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1])


# The frames `jmp_lite.flax.wrap` adds to a Linen model's name stack: the
# wrapper's class (`jmp_lite._linen._LinenWrapper`) and its field ``module``.
WRAPPER_FRAME = "_LinenWrapper/module"


def _clean(path: str) -> str:
  """`collapse`, with wrap's own frame and fp8 marks removed: paths as wrap's rules see them."""
  path = collapse("/".join(p for p in path.split("/")
                           if not p.startswith(_fp8_sites.MARK)))
  prefix = WRAPPER_FRAME
  return path[len(prefix) + 1:] if path.startswith(prefix + "/") else (
      "" if path == prefix else path)


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


def forward_slots(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
  """``(forward, maxima)``: boolean ``[plan.size]`` masks of the slots the
  forward pass fills (the rest come back as the carrier's cotangent) and of
  those holding maxima (the rest hold counts, or scales)."""
  forward = np.zeros(plan.size, bool)
  maxima = np.zeros(plan.size, bool)
  for point, idx in decode(np.arange(plan.size), plan):
    if point.recipe is not None:
      forward[idx[..., :_fp8_sites.ROLES - 1]] = True
      maxima[idx[..., :_fp8_sites.ROLES]] = True
      continue
    half = point.width // 2
    forward[idx[..., :half]] = True
    maxima[idx[..., [0, half]]] = True
  return forward, maxima


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
