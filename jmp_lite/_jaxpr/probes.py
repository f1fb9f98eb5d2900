"""Probes: forward and backward statistics of chosen values.

A probe is an identity with a custom VJP, ``probe(x, c) = (x, forward
statistics of x)``, where ``c`` is a small float32 vector (the *carrier*).
The forward statistics are an output of the forward pass, so a value no
gradient reaches (behind ``stop_gradient``: a teacher, a target network) is
measured too. The backward pass returns the cotangent of ``x`` unchanged and,
as the cotangent of ``c``, zeros where the forward statistics go followed by
the same statistics of ``x``'s cotangent. Differentiating a function with
respect to its carriers therefore returns, in the same pass and with no host
callback, what every probed value and its cotangent looked like: inside
``jit``, ``scan`` (one carrier row per iteration), ``checkpoint``, ``cond``
and ``while`` (forward statistics only: it has no reverse-mode derivative),
where side outputs cannot escape unless each level returns them
(`jmp_lite._jaxpr.passes.instrument` does).

Which values are probed: module outputs marked by `tap` (what
`jmp_lite.flax.wrap` does while a probe trace is active), or, in ``"ops"``
mode, every floating output of every equation.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._dtypes import is_floating
from jmp_lite import _exact
from jmp_lite import _replicas

TAP_PREFIX = "jmp_lite_tap_"
# Per measured value: largest finite |x|, non-finite count, non-zero finite
# count, the count in the upper bin (|x| at or above `UPPER_BIN_EDGE` of the
# dtype's maximum, or not finite), the count of elements, then per dtype the
# count of non-zero values below its smallest normal (subnormal there, or
# flushed to zero).
BASE_STATS = 5
UPPER, COUNT = 3, 4  # the columns of the upper bin and of the elements
# Graphcore's automatic loss scaling puts one histogram bin edge at this
# fraction of the dtype's maximum (PopART's AutomaticLossScalingSettings
# binEdgeLocation default, 0.0625): `jmp_lite.AutomaticLossScale` reads the
# proportion of cotangents above it.
UPPER_BIN_EDGE = 2.0 ** -4


class Thresholds(NamedTuple):
  """A probed value's thresholds (static: part of the probe's definition)."""
  upper: float  # the upper bin's edge: `UPPER_BIN_EDGE` of the dtype's maximum
  tinies: tuple[float, ...]  # smallest normals: the dtype's, then each what-if's


def width(n_dtypes: int) -> int:
  """Carrier entries per probed value: forward then backward statistics."""
  return 2 * (BASE_STATS + n_dtypes)


class _Taps(threading.local):
  def __init__(self):
    self.active = False


_taps = _Taps()


@contextlib.contextmanager
def tapping():
  """Within it, `tap` marks values (a probe trace); outside, `tap` is a no-op.

  Each mark's name says what it marks (`tap_info`).
  """
  saved = _taps.active
  _taps.active = True
  try:
    yield
  finally:
    _taps.active = saved


def tapping_active() -> bool:
  """Whether `tap` marks values here (inside `tapping`)."""
  return _taps.active


def tap(tree: Any, path: str, view=None, cast_back: bool = False) -> Any:
  """Marks ``tree``'s floating leaves as the value of ``path`` in a probe trace.

  The mark is a ``jit`` of the identity whose name encodes ``path`` (and the
  dtypes below; `tap_info` reads them): every
  rewrite of jmp_lite (the precision engine, autocast) and of JAX keeps it
  as it is, and the probe pass finds it. Outside a probe trace, and for
  non-floating leaves, nothing happens.

  ``view``: the dtype the value is held in on the other side of a cast, one
  for all leaves or a list with one per leaf of ``tree`` (None: no cast). A
  parameter is marked before its cast to the compute dtype: its forward
  statistics are those of the cast value, counting as underflow what the
  cast flushes to zero (`statistics`); its cotangent is measured as it is
  (the cast's transpose widens it). With ``cast_back``, a model's output
  marked after its cast from the compute dtype to a wider output dtype: its
  cotangent is measured as the backward pass casts it back to ``view``, what
  that cast flushes counted.
  """
  if not _taps.active:
    return tree
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  where = [i for i, x in enumerate(leaves) if is_floating(x)]
  if not where:
    return tree
  # Each value's dtype as marked: `jmp_lite._jaxpr.passes.sink` may widen the mark's
  # operands later (moving a downcast past it), and the statistics stay in
  # this dtype.
  views = (list(view) if isinstance(view, (list, tuple))
           else [view] * len(leaves))
  if len(views) != len(leaves):
    raise ValueError(f"tap({path!r}): {len(views)} view dtypes for "
                     f"{len(leaves)} leaves")
  info = (path, tuple(np.dtype(leaves[i].dtype if views[i] is None
                               else views[i]).name for i in where), bool(cast_back))

  def identity(*xs):
    return xs

  # The mark says what it marks: a trace that JAX's or the engine's cache
  # serves again in a later probe trace is read the same.
  identity.__name__ = TAP_PREFIX + json.dumps(info).encode().hex()
  marked = jax.jit(identity)(*(leaves[i] for i in where))
  for i, x in zip(where, marked):
    leaves[i] = x
  return jax.tree_util.tree_unflatten(treedef, leaves)


def tap_info(eqn) -> Optional[tuple[str, tuple[str, ...], bool]]:
  """``(path, dtype of each marked value, cast_back)`` of a ``jit`` equation
  `tap` made, else None."""
  if eqn.primitive.name not in ("jit", "pjit"):
    return None
  name = str(eqn.params.get("name", ""))
  if not name.startswith(TAP_PREFIX):
    return None
  path, dtypes, cast_back = json.loads(bytes.fromhex(name[len(TAP_PREFIX):]))
  return path, tuple(dtypes), cast_back


def thresholds(dtype, what_if: Sequence[Any]) -> Thresholds:
  """The upper bin's edge in ``dtype``, and the smallest normals of ``dtype``
  itself and of each ``what_if`` dtype."""
  return Thresholds(
      upper=float(jnp.finfo(dtype).max) * UPPER_BIN_EDGE,
      tinies=tuple(float(jnp.finfo(d).smallest_normal) for d in (dtype, *what_if)))


def statistics(x: jax.Array, th: Thresholds, view=None) -> jax.Array:
  """``[max finite |x|, #non-finite, #non-zero finite, #upper bin, #elements,
  #below each tiny]``.

  Of ``x`` as ``view`` holds it, if given (``x`` cast to it). A value the
  cast flushes to zero counts as non-zero and below ``view``'s tiny: it is
  the total underflow a loss scale exists to prevent, which the cast value
  alone cannot tell from a zero. Against a what-if dtype's tiny it counts by
  its magnitude before the cast. (A cast to a wider ``view`` flushes
  nothing.)
  """
  # Statistics are never differentiated (and a variadic reduce has no JVP).
  x = jax.lax.stop_gradient(x)
  flushed = None
  if view is not None:
    wide = jnp.abs(_exact.widen(x))
    x = x.astype(view)
    # (inf and NaN stay themselves in the cast: never flushed.)
    flushed = (wide > 0) & (_exact.widen(x) == 0)
  # `_exact.widen`: the values of x's own dtype (an overflow is inf, a
  # flushed value 0) even where XLA:GPU keeps a narrow x in float32.
  a = jnp.abs(_exact.widen(x)).astype(jnp.float32)
  finite = jnp.isfinite(a)
  a = jnp.where(finite, a, 0.0)
  nonzero = a > 0
  # Compared with each tiny: the magnitude as held, or, where the cast
  # flushed it, as it was before (a what-if dtype may hold it as a normal).
  magnitude = a
  if flushed is not None:
    nonzero = nonzero | flushed
    magnitude = jnp.where(flushed, wide.astype(jnp.float32), a)
  # One reduction over x for every statistic (a variadic reduce), in the
  # order they are returned (the element count too, as a sum of ones):
  # XLA:CPU compiles each reduction, and each small operation after it, into
  # a kernel of its own, and a telemetry step has two statistics vectors per
  # probed value. One pass also reads x once.
  flags = [~finite, nonzero, ~finite | (a >= th.upper), jnp.ones(a.shape, bool)]
  flags += [nonzero & (magnitude < t) for t in th.tinies]
  operands = (a, *(m.astype(jnp.int32) for m in flags))
  init = (jnp.float32(0), *(jnp.int32(0) for _ in flags))
  combine = lambda x, y: (jnp.maximum(x[0], y[0]),
                          *(u + v for u, v in zip(x[1:], y[1:])))
  reduced = jax.lax.reduce(operands, init, combine, tuple(range(a.ndim)))
  # The counts stacked as integers, then converted: converted one by one,
  # each was a kernel of its own.
  counts = jnp.stack(reduced[1:]).astype(jnp.float32)
  return jnp.concatenate([reduced[0][None], counts])


def probe(x: jax.Array, carrier: jax.Array, th: Thresholds,
          gate: Optional[jax.Array] = None, view=None,
          cast_back: bool = False) -> tuple[jax.Array, jax.Array]:
  """``(x, its forward statistics)``, with its cotangent's in ``carrier``'s cotangent.

  The forward statistics fill the first half of the carrier's slice (the
  cotangent has zeros there), the cotangent's the second half.

  With ``gate`` (a float32 scalar), only where ``gate > 0``: otherwise zeros,
  and the reductions are skipped (a ``cond`` around each, so that the rest
  of the step stays outside any conditional).

  Under ``shard_map`` the carrier varies over every manual axis (see
  `_instrument`): per-device statistics are typed so before they are
  returned. ``view``, ``cast_back``: see `tap`.
  """
  axes = tuple(sorted(_replicas.varying_axes(carrier)))
  gated = gate is not None
  stats = forward(x, carrier, th, gate, view)
  back = np.dtype(view) if cast_back and view is not None else None
  return (_probe(x, carrier, gate if gated else jnp.float32(1), th, axes, gated,
                 back), stats)


def forward(x: jax.Array, carrier: jax.Array, th: Thresholds,
            gate: Optional[jax.Array] = None, view=None) -> jax.Array:
  """The forward statistics of `probe`, alone: for a value no gradient
  reaches, measured without making it (and what it flows into) differentiated.
  Typed varying like ``carrier`` under ``shard_map``."""
  axes = tuple(sorted(_replicas.varying_axes(carrier)))
  gated = gate is not None
  stats = _measure(x, gate if gated else jnp.float32(1), th, view, gated)
  return _varying(jax.lax.stop_gradient(stats), axes)


def _varying(stats, axes):
  """``stats`` typed as varying over ``axes`` (what the carrier is)."""
  missing = tuple(a for a in axes if a not in _replicas.varying_axes(stats))
  return jax.lax.pcast(stats, missing, to="varying") if missing else stats


def _measure(x, gate, th, view, gated):
  if not gated:
    return statistics(x, th, view)

  def skip(v):
    zeros = jnp.zeros(BASE_STATS + len(th.tinies), jnp.float32)
    return _varying(zeros, tuple(sorted(_replicas.varying_axes(v))))

  return jax.lax.cond(gate > 0, lambda v: statistics(v, th, view), skip, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _probe(x, carrier, gate, th, axes, gated, view):
  del carrier, gate, th, axes, gated, view
  return x


def _probe_fwd(x, carrier, gate, th, axes, gated, view):
  del carrier, th, axes, gated, view
  return x, gate


def _probe_bwd(th, axes, gated, view, gate, g):
  # With a ``view`` (`tap`'s ``cast_back``), the cotangent as the backward
  # pass casts it back to the compute dtype, what that cast flushes counted.
  backward = _measure(g, gate, th, view, gated)
  stats = jnp.concatenate([jnp.zeros_like(backward), backward])
  return g, _varying(stats, axes), jnp.zeros_like(gate)


_probe.defvjp(_probe_fwd, _probe_bwd)
