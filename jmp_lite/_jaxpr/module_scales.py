"""Per-module loss scales: each scaled module's backward pass at its own scale.

`jmp_lite.ModuleLossScale` gives chosen modules of a wrapped Linen model a
loss scale of their own. The scale is a property of the *cotangents*: the
loss is scaled by the global scale ``S`` as usual, and inside a scaled
module ``m`` every cotangent is held at ``A_m`` instead. Three identities
with a custom VJP, placed by `jmp_lite.flax.wrap`'s interceptor while
`applied` is active, convert between the two:

* on the module's outputs, the backward pass multiplies the incoming
  cotangent by ``A_m / A_outer`` (``A_outer``: the enclosing scaled
  module's scale, or ``S``);
* on its inputs, by ``A_outer / A_m``: what flows back out of the module is
  at its caller's scale again, so that cotangents summed outside (a
  residual connection, a value two modules read) have one scale. An input
  that is another scaled module's output, read directly, goes back to that
  module's scale instead (``A_producer / A_m``), beside the output's own
  conversion: a chain of blocks passes cotangents from scale to scale;
* on each parameter it reads (in the parameter dtype, before the cast to
  the compute dtype), by ``S / A_m``: every weight gradient leaves at the
  global scale, in float32 for float32 parameters, and the guard unscales
  and checks them as one tree.

All scales are powers of two, so each conversion is exact unless it leaves
the cotangent's range: a weight gradient computed in float16 inside the
module lies in float16's range *at the module's scale*. What stays at the
caller's scale is what crosses module boundaries.

The conversions also measure (the carrier trick of `jmp_lite._jaxpr.probes`: a
float32 input whose cotangent the backward pass fills): per module, one row
for what enters it from outside (its outputs' cotangents before conversion,
and the non-finite count of what a chained module sends back) and one for
what it holds (cotangents converted into it, its inputs' and parameters'
cotangents before conversion out; a non-finite value counted there only
where the module or a conversion into it made it), each
``[one-hot binade of the largest finite |x| (BINS), #non-finite, #non-zero
finite, #below the compute dtype's smallest normal, #elements, #non-finite
sent back by a chained module or submodule]`` (the last in the entering row
only). Every
column adds up over several contributions (a module called twice, a scan
over a module, micro-batches): counts add, and the top non-empty binade of
summed one-hots is the binade of the largest value.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._dtypes import is_floating
from jmp_lite import _exact

# Binades 2^LOW .. 2^(LOW + BINS - 1) (bin i holds LOW + i <= log2|x| < LOW +
# i + 1); larger and smaller maxima are clipped into the end bins.
LOW, BINS = -80, 128
NONFINITE, NONZERO, SUBNORMAL, ELEMENTS = BINS, BINS + 1, BINS + 2, BINS + 3
# In a module's ENTER row: non-finite cotangents a submodule (or a chained
# module) sent back to it; NONFINITE there counts only its caller's.
ARRIVED = BINS + 4
WIDTH = BINS + 5
ENTER, INSIDE = 0, 1  # the rows of a module's carrier


class Carried(NamedTuple):
  """A loss scale with the carriers its step differentiates: what
  `jmp_lite._scaled_grad` passes to the scaled loss function."""
  loss_scale: Any  # a jmp_lite.ModuleLossScale
  carriers: tuple  # per path, float32 [2, WIDTH] zeros


class _Region(NamedTuple):
  index: int
  scale: jax.Array  # A_m


class _Active(threading.local):
  def __init__(self):
    self.scaled = None  # {path: index}, while `applied`
    self.loss_scale = None  # S
    self.scales = None  # [n] A_m
    self.carriers = None
    self.dtypes = None
    self.stack: list[_Region] = []
    # id(output) -> (output, the value before its conversion, its module's
    # region): a scaled module's output that another scaled module reads.
    self.outputs: dict[int, tuple[Any, Any, _Region]] = {}


_active = _Active()
_FIELDS = ("scaled", "loss_scale", "scales", "carriers", "dtypes", "stack", "outputs")


@contextlib.contextmanager
def applied(carried: Carried):
  """Within it, wrapped Linen modules named by ``carried.loss_scale.paths``
  convert their cotangents (see the module docstring)."""
  ls = carried.loss_scale
  saved = tuple(getattr(_active, f) for f in _FIELDS)
  _active.scaled = {p: i for i, p in enumerate(ls.paths)}
  _active.loss_scale = jnp.asarray(ls.loss_scale, jnp.float32)
  _active.scales = jnp.asarray(ls.module_scales, jnp.float32)
  _active.carriers = carried.carriers
  _active.dtypes = tuple(np.dtype(d).name for d in ls.compute_dtypes)
  _active.stack = []
  _active.outputs = {}
  try:
    yield
  finally:
    for f, v in zip(_FIELDS, saved):
      setattr(_active, f, v)


def is_active() -> bool:
  return _active.scaled is not None


@contextlib.contextmanager
def module(path: str):
  """The scaled region of module ``path`` while it runs (nothing if it is
  not scaled). Yields ``(inputs, outputs)``: functions that convert a
  pytree of the module's arguments and of its results."""
  index = None if _active.scaled is None else _active.scaled.get(path)
  if index is None:
    yield None
    return
  outer = _active.stack[-1] if _active.stack else None
  region = _Region(index, _active.scales[index])
  _active.stack.append(region)
  try:
    yield (lambda tree: _inputs(tree, region, outer),
           lambda tree: _outputs(tree, region, outer))
  finally:
    _active.stack.pop()


def _scale(region: Optional[_Region]) -> jax.Array:
  return _active.loss_scale if region is None else region.scale


def _inputs(tree, region: _Region, outer: Optional[_Region]):
  """Arguments of a scaled module: cotangents from its scale back to the
  scale of the value they belong to. An output of another scaled module
  read here directly goes back to that module's scale, its own (so that a
  chain of modules passes cotangents from scale to scale, never through
  the caller's); any other value, to the caller's."""
  def one(x):
    if not _differentiable(x):
      return x
    seen = _active.outputs.get(id(x))
    if seen is not None and seen[0] is x:
      _, raw, producer = seen
      return _convert(raw, producer.scale / region.scale,
                      *_routes(region, producer), _dtypes(region, producer))
    return _convert(x, _scale(outer) / region.scale, *_routes(region, outer),
                    _dtypes(region, outer))
  return jax.tree_util.tree_map(one, tree)


def _outputs(tree, region: _Region, outer: Optional[_Region]):
  """Results of a scaled module: cotangents from the caller's scale to the
  module's."""
  def one(x):
    if not _differentiable(x):
      return x
    out = _convert(x, region.scale / _scale(outer), (_active.carriers[region.index],),
                   (((0, ENTER), "before"), ((0, INSIDE), "after")),
                   _dtypes(outer, region))
    _active.outputs[id(out)] = (out, x, region)
    return out
  return jax.tree_util.tree_map(one, tree)


def param(value: Any) -> Any:
  """A parameter read inside a scaled module: its cotangent goes from the
  module's scale to the global one (as held: float32 for float32
  parameters)."""
  if not _active.stack:
    return value
  region = _active.stack[-1]
  def one(x):
    if not _differentiable(x):
      return x
    return _convert(x, _active.loss_scale / region.scale,
                    (_active.carriers[region.index],), (((0, INSIDE), "before"),),
                    _dtypes(region, None))
  return jax.tree_util.tree_map(one, value)


def _routes(region: _Region, into: Optional[_Region]):
  """``(carriers, routes)`` of a conversion out of ``region``: what left it
  is measured inside it; what arrives at ``into`` (a scaled region), inside
  that one, with a non-finite value that arrived so counted as *entering*
  it (the module it came from overflowed, not ``into``) and one the
  conversion made counted inside it."""
  carriers = [_active.carriers[region.index]]
  routes = [((0, INSIDE), "before")]
  if into is not None:
    carriers.append(_active.carriers[into.index])
    routes += [((1, INSIDE), "after"), ((1, ENTER), "arrived")]
  return tuple(carriers), tuple(routes)


def _dtypes(src: Optional[_Region], dst: Optional[_Region]) -> tuple[str, str]:
  """The compute dtypes whose smallest normals the two sides are measured
  against (float32 at the global scale)."""
  name = lambda r: "float32" if r is None else _active.dtypes[r.index]
  return name(src), name(dst)


def _differentiable(x) -> bool:
  return is_floating(x) and np.size(x) > 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _convert(x, factor, carriers, routes, dtypes):
  """``x``; backward: its cotangent times ``factor``, with measurements.

  ``carriers``: the carriers of the one or two modules it reports to (each
  ``[2, WIDTH]``: a conversion's cotangent touches no other module's).
  ``routes``: ``((carrier, row), what)`` pairs, ``what`` one of ``"before"``
  (the cotangent as it came), ``"after"`` (as converted, its non-finite
  count only what the conversion made non-finite) and ``"arrived"`` (only
  the non-finite count of the cotangent as it came). ``dtypes``: the
  compute dtypes of the two sides.
  """
  del factor, carriers, routes, dtypes
  return x


def _convert_fwd(x, factor, carriers, routes, dtypes):
  del routes, dtypes
  return x, (factor, tuple(jnp.zeros_like(c) for c in carriers))


def _convert_bwd(routes, dtypes, res, g):
  factor, zeros = res
  stats = list(zeros)
  # In float32, then back to the cotangent's dtype: one rounding, which
  # only a value leaving that dtype's range can see.
  wide = _exact.widen(g).astype(jnp.float32)
  out = (wide * factor).astype(g.dtype)
  before = statistics(g, np.dtype(dtypes[0]))
  for (index, row), what in routes:
    if what == "before":
      values = before
    elif what == "after":
      values = statistics(out, np.dtype(dtypes[1]))
      made = jnp.sum(jnp.isfinite(wide) & ~jnp.isfinite(
          _exact.widen(out).astype(jnp.float32)), dtype=jnp.int32)
      values = values.at[NONFINITE].set(made.astype(jnp.float32))
    else:  # "arrived"
      values = jnp.zeros((WIDTH,), jnp.float32).at[ARRIVED].set(before[NONFINITE])
    stats[index] = stats[index].at[row].add(values)
  return out, jnp.zeros_like(factor), tuple(stats)


_convert.defvjp(_convert_fwd, _convert_bwd)


def statistics(x: jax.Array, dtype) -> jax.Array:
  """A row of the carrier (module docstring) for ``x``; ``dtype``'s
  smallest normal is the subnormal threshold."""
  a = jnp.abs(_exact.widen(x)).astype(jnp.float32)
  finite = jnp.isfinite(a)
  a = jnp.where(finite, a, 0.0)
  top = jnp.max(a, initial=0.0)
  _, exponent = jnp.frexp(top)  # top = f * 2**exponent, f in [0.5, 1)
  binade = jnp.clip(exponent - 1 - LOW, 0, BINS - 1)
  onehot = ((jnp.arange(BINS) == binade) & (top > 0)).astype(jnp.float32)
  tiny = float(jnp.finfo(dtype).smallest_normal)
  count = lambda m: jnp.sum(m, dtype=jnp.int32).astype(jnp.float32)
  nonzero = a > 0
  return jnp.concatenate([onehot, jnp.stack([
      count(~finite), count(nonzero), count(nonzero & (a < tiny)),
      jnp.float32(a.size), jnp.float32(0)])])


def top_binade(rows: jax.Array) -> jax.Array:
  """Per row, the binade (log2 floor) of the largest value measured, or
  -inf where nothing non-zero was: ``rows`` ``[..., WIDTH]``."""
  seen = rows[..., :BINS] > 0
  last = BINS - 1 - jnp.argmax(seen[..., ::-1], axis=-1)
  return jnp.where(jnp.any(seen, axis=-1), (LOW + last).astype(jnp.float32),
                   -jnp.inf)
