"""Places probes (`jmp_lite._probes`) in a traced function and reads them back.

`value_and_grad` traces the function once (with `tap` marks active), plans
where each probe's carrier lives in one flat float32 vector, evaluates the
jaxpr with the probes in place and differentiates with respect to that
vector too. Higher-order equations holding probes are re-bound through the
public API with their share of the carrier:

* ``scan``: the carrier slice becomes one more scanned input, a row per
  iteration, so a scanned stack of layers reports each layer;
* ``checkpoint`` (``remat``) and ``cond``: one more operand (each branch
  its own slice; the branch not taken reports zeros);
* ``jit``: evaluated inline.

Other higher-order equations (``while``, custom derivatives, ``shard_map``
nested inside the function) run as written, and marks inside them report
nothing: ``while`` has no reverse-mode derivative to carry statistics, and a
custom rule's body is not what its derivative computes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _dtypes
from jmp_lite import _internals
from jmp_lite import _probes
from jmp_lite import _replicas
from jmp_lite import telemetry as telemetry_lib

_NESTED = ("scan", "remat2", "jit", "pjit", "cond")


@dataclasses.dataclass
class Point:
  offset: int
  path: str
  dtype: str
  tinies: tuple[float, ...]
  view: Any = None  # the dtype a marked parameter is cast to (`_probes.tap`)

  @property
  def width(self) -> int:
    return _probes.width(len(self.tinies))


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

  def __init__(self, mode: str, tap_paths: Sequence[str], what_if):
    self.mode = mode
    self.tap_paths = tap_paths
    self.what_if = tuple(what_if)

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
      children = self.children(eqn, where)
      if children is not None:
        if any(c.size for c in children):
          length = eqn.params["length"] if eqn.primitive.name == "scan" else 1
          plan.nested[i] = Nested(plan.size, eqn.primitive.name, children, length)
          plan.size += length * sum(c.size for c in children)
        continue
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
  """`collapse`, with wrap's own frame removed: paths as wrap's rules see them."""
  path = collapse(path)
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
    # A mark is bound as it is: JAX may have moved a cast into its body.
    outs = _internals.bind(eqn, invals)
    if not points:
      return outs
    outs = list(outs) if eqn.primitive.multiple_results else [outs]
    for j, p in points:
      outs[j] = _probes.probe(outs[j], carrier[p.offset:p.offset + p.width],
                              p.tinies, gate, p.view)
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


def decode(vector: jax.Array, plan: Plan) -> list[tuple[str, str, jax.Array]]:
  """Per probe, in forward order: ``(path, dtype, stats)``; scans add leading axes."""
  out = []
  items = sorted([(i, j, "p", v) for i, ps in plan.points.items() for j, v in ps]
                 + [(i, 0, "n", v) for i, v in plan.nested.items()],
                 key=lambda t: (t[0], t[1]))
  for _, _, kind, item in items:
    if kind == "p":
      out.append((item.path, item.dtype,
                  vector[..., item.offset:item.offset + item.width]))
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


def value_and_grad(fun: Callable[..., Any], argnums: tuple[int, ...], *,
                   mode: str, what_if: Sequence[Any]) -> Callable[..., Any]:
  """``jax.value_and_grad(fun, argnums, has_aux=True)`` plus per-probe statistics.

  Returns ``g(gate, *args, **kwargs) -> ((value, aux), grads), rows`` with
  ``rows`` as `decode` returns them (arrays computed in the same pass);
  ``gate`` as `interpret` takes it.
  """

  def g(gate, *args, **kwargs):
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
    plan = _Planner(mode, list(paths), what_if).plan(closed.jaxpr, "")

    def probed(carrier, *args, **kwargs):
      now = jax.tree_util.tree_leaves((args, kwargs))
      outs = interpret(closed.jaxpr, closed.consts, [now[i] for i in traced],
                       carrier, plan, gate)
      value, aux = jax.tree_util.tree_unflatten(out_tree["tree"], outs)
      return value, aux

    shifted = tuple(a + 1 for a in argnums)
    carrier = jnp.zeros((plan.size,), jnp.float32)
    if _replicas.manual_axes() and _replicas.tracks_varying(_replicas.manual_axes()):
      # Per-device statistics: a carrier varying over every manual axis
      # takes them without the sum a replicated input's gradient gets.
      carrier = jax.lax.pcast(carrier, _replicas.manual_axes(), to="varying")
    (value, aux), grads = jax.value_and_grad(probed, argnums=(0, *shifted),
                                             has_aux=True)(carrier, *args, **kwargs)
    return ((value, aux), tuple(grads[1:])), decode(grads[0], plan)

  return g


# Statistics from the carrier's cotangent ----------------------------------------



def _is_max(width: int) -> np.ndarray:
  """Which of a probe's ``width`` statistics are maxima (the rest are counts)."""
  is_max = np.zeros(width, bool)
  is_max[[0, width // 2]] = True
  return is_max


def _combine(rows: Sequence[tuple[str, str, jax.Array]]) -> dict:
  """Probes of one path (a module called twice, several outputs) merged.

  Maxima by max, counts by sum; probes of one path with different dtypes or
  layer axes are kept apart under ``path#2``, ``path#3``...
  """
  merged: dict[str, tuple[str, jax.Array]] = {}
  for path, dtype, arr in rows:
    key = path
    n = 1
    while key in merged and (merged[key][0] != dtype
                             or merged[key][1].shape != arr.shape):
      n += 1
      key = f"{path}#{n}"
    if key in merged:
      old = merged[key][1]
      arr = jnp.where(_is_max(arr.shape[-1]), jnp.maximum(old, arr), old + arr)
    merged[key] = (dtype, arr)
  return merged


def _reduce(merged: dict, axis_name) -> dict:
  """Maxima and counts over the devices of ``axis_name`` (under shard_map)."""
  if axis_name is None:
    return merged
  out = {}
  for key, (dtype, arr) in merged.items():
    arr = jnp.where(_is_max(arr.shape[-1]), jax.lax.pmax(arr, axis_name),
                    jax.lax.psum(arr, axis_name))
    out[key] = (dtype, arr)
  return out


def build(rows, telemetry: telemetry_lib.Telemetry, axis_name=None,
          sampled=True) -> telemetry_lib.PrecisionStats:
  """`PrecisionStats` from `decode`'s rows."""
  merged = _reduce(_combine(rows), axis_name if _replicas.manual_axes() else None)
  names_of = lambda dtype: [dtype] + [d.name for d in telemetry.what_if]
  modules = {}
  # Over every cotangent held in a 16-bit or narrower float: what an
  # underflow-aware loss scale reads.
  under, nonzero = jnp.float32(0), jnp.float32(0)
  headroom = jnp.float32(jnp.inf)
  for key, (dtype, arr) in merged.items():
    half = arr.shape[-1] // 2

    def side(part, dtype=dtype):
      nonzero = jnp.maximum(part[..., 2], 1.0)
      under = {}
      for i, d in enumerate(names_of(dtype)):
        under.setdefault(d, part[..., _probes.BASE_STATS + i] / nonzero)
      return part[..., 0], part[..., 1].astype(jnp.int32), under

    fmax, fnon, funder = side(arr[..., :half])
    bmax, bnon, bunder = side(arr[..., half:])
    modules[key] = telemetry_lib.ModuleStats(
        forward_max=fmax, forward_nonfinite=fnon, forward_underflow=funder,
        backward_max=bmax, backward_nonfinite=bnon, backward_underflow=bunder,
        dtype=dtype)
    if _dtypes.is_narrow_float(dtype):
      back = arr[..., half:]
      under += jnp.sum(back[..., _probes.BASE_STATS])
      nonzero += jnp.sum(back[..., 2])
      top = jnp.max(back[..., 0])
      headroom = jnp.minimum(headroom, jnp.where(
          top > 0, float(jnp.finfo(dtype).max) / top, jnp.inf))
  return telemetry_lib.PrecisionStats(
      sampled=jnp.asarray(sampled), modules=modules,
      cotangent_underflow=under / jnp.maximum(nonzero, 1.0),
      cotangent_headroom=headroom, order=tuple(modules))


def gate(telemetry: telemetry_lib.Telemetry, step) -> Optional[jax.Array]:
  """None (measure) when every step is measured, else 1.0 on sampled steps."""
  sample = telemetry.sample(step)
  return None if sample is True else jnp.asarray(sample, jnp.float32)
