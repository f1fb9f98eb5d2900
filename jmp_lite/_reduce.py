"""Reductions over many arrays in few XLA ops: one per shape and up to 8 arrays.

A guarded step reduces every gradient, parameter and optimizer-state array
(the norm, the finiteness checks). One reduce op per array and per check made
its HLO grow by about 16 reductions per parameter array, and its compile time
7-10x the plain step's. Here arrays of the same shape are first combined
element by element (``a + b``, ``max(a, b)``, ``a | b``), which XLA fuses into
the reduction's loop (no temporary array, each element read once as before),
and reduced together, up to `GROUP` arrays at a time: with more, XLA:CPU runs
the fused loop slower than separate ones and compiles it slower too (64 M
parameters in 100 arrays, guarded Adam step: 232 ms with all arrays of a shape
in one reduction, 193 ms in groups of 8, 185 ms one by one; compile 2.9 s in
groups of 8 against 3.6 s in one and 8.9 s one by one).

The order in which elements are added differs from a per-array reduction, so
sums may differ in the last bits (XLA promises no reduction order either);
maxima, any/all and finiteness are exact.

The partial results of the groups are combined inside a `cond` (`_fenced`).
A scalar computed outside one is fused by XLA into every computation that
reads it: a skip decision combined from 50 partial results and read by 400
per-array selects was computed 400 times, and the program grew with the
square of the arrays (``all_finite`` + ``select_tree`` over 400 arrays of
64x64 and 64: 1.8 s to compile, 0.9 s fenced; the same pattern written by
hand, one partial result per array, 23 s).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_lite import _elementwise


# At most this many arrays in one reduction: XLA:CPU runs a fused loop over
# many more inputs slower than separate loops (measured on the bench's guard
# section), while the count of reductions, which drives compile time, falls
# by this factor.
GROUP = 8


def partials(items, elementwise: Callable, combine: Callable, reduce: Callable,
             shape_of: Callable = np.shape) -> list:
  """``reduce(elementwise(item))`` over groups of same-shape ``items``: one op each.

  The partial results, one scalar per group, for a caller that combines them
  with others inside one `fenced` computation.
  """
  by_shape: dict[tuple, list] = {}
  for item in items:
    by_shape.setdefault(tuple(shape_of(item)), []).append(item)
  groups = [part for group in by_shape.values() for part in _balanced(group)]
  return [reduce(functools.reduce(combine, map(elementwise, group))) for group in groups]


def _balanced(group: list) -> list:
  """``group`` in the fewest parts of at most `GROUP`, their sizes differing
  by at most one: parts of one size compile to one kernel (12 arrays as 6 + 6
  are one, as 8 + 4 two)."""
  parts = -(-len(group) // GROUP)
  size, extra = divmod(len(group), parts)
  bounds = np.cumsum([0] + [size + (i < extra) for i in range(parts)])
  return [group[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _reduce(items, elementwise: Callable, combine: Callable, reduce: Callable, empty,
            shape_of: Callable = np.shape):
  """``reduce`` of ``elementwise(item)`` over ``items``: one ``reduce`` per shape."""
  parts = partials(items, elementwise, combine, reduce, shape_of)
  if not parts:
    return empty
  # Scalars: combined as scalars, not stacked and reduced (one op fewer).
  return _fenced(lambda ps: functools.reduce(combine, ps), parts)


# Fewer partial results than this are combined in the open: a fence costs a
# conditional and its branches, more than the few ops XLA would duplicate.
FENCE_FROM = 4


def _fenced(fn: Callable, parts: list):
  """``fn(parts)``, fenced if there are `FENCE_FROM` partial results or more."""
  if len(parts) < FENCE_FROM:
    return fn(parts)
  return fenced(fn, parts)


def fenced(fn: Callable, operand: Any):
  """``fn(operand)``, computed once: inside a `cond` whose branches are both ``fn``.

  XLA does not fuse across a conditional, so consumers read the result
  instead of recomputing it. The predicate is read from the data (any value
  would do, both branches being the same) because XLA removes a conditional
  whose predicate is a constant, and one whose branches only pass their
  operand through.
  """
  first = jnp.asarray(jax.tree.leaves(operand)[0])
  return jax.lax.cond(first != jnp.zeros((), first.dtype), fn, fn, operand)


# Whole-array reductions and the element-by-element ops that combine a group,
# as primitives: ``jnp.sum`` and friends are jitted functions, several times
# dearer to trace, and a guarded step calls them for every array.


def total(x: jax.Array) -> jax.Array:
  """The sum of every element of ``x`` (0 for an empty ``x``)."""
  return lax.reduce(x, np.zeros((), x.dtype), lax.add, tuple(range(np.ndim(x))))


def largest(x: jax.Array) -> jax.Array:
  """The largest element of ``x``: ``-inf`` for an empty float ``x``, the
  smallest value for an integer one (a parameter with a 0 dimension has none)."""
  # jnp.issubdtype: NumPy's does not know bfloat16 and the fp8 types are floats.
  low = -np.inf if jnp.issubdtype(x.dtype, jnp.floating) else np.iinfo(x.dtype).min
  return lax.reduce(x, np.array(low, x.dtype), lax.max, tuple(range(np.ndim(x))))


def anywhere(x: jax.Array) -> jax.Array:
  """Whether any element of boolean ``x`` is True."""
  return lax.reduce(x, np.array(False), lax.bitwise_or, tuple(range(np.ndim(x))))


def sum_of(leaves: Sequence[Any], elementwise: Callable, dtype) -> jax.Array:
  """``sum(elementwise(x))`` over every element of every leaf, in ``dtype``."""
  return _reduce(leaves, lambda x: _elementwise.cast(elementwise(x), dtype), lax.add,
                 total, jnp.zeros((), dtype))


