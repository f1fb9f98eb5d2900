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
import operator
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


# At most this many arrays in one reduction: XLA:CPU runs a fused loop over
# many more inputs slower than separate loops (measured on the bench's guard
# section), while the count of reductions, which drives compile time, falls
# by this factor.
GROUP = 8


def _reduce(items, elementwise: Callable, combine: Callable, reduce: Callable, empty,
            shape_of: Callable = np.shape):
  """``reduce`` of ``elementwise(item)`` over ``items``: one ``reduce`` per shape."""
  by_shape: dict[tuple, list] = {}
  for item in items:
    by_shape.setdefault(tuple(shape_of(item)), []).append(item)
  groups = [group[i:i + GROUP] for group in by_shape.values()
            for i in range(0, len(group), GROUP)]
  parts = [reduce(functools.reduce(combine, map(elementwise, group)))
           for group in groups]
  if not parts:
    return empty
  # Scalars: combined as scalars, not stacked and reduced (one op fewer).
  return _fenced(lambda ps: functools.reduce(combine, ps), parts)


# Fewer partial results than this are combined in the open: a fence costs a
# conditional and its branches, more than the few ops XLA would duplicate.
FENCE_FROM = 4


def _fenced(fn: Callable, parts: list):
  """``fn(parts)``, computed once: inside a `cond` whose branches are both ``fn``.

  XLA does not fuse across a conditional, so consumers read the result
  instead of recomputing it. The predicate is read from the data (any value
  would do, both branches being the same) because XLA removes a conditional
  whose predicate is a constant, and one whose branches only pass their
  operand through.
  """
  if len(parts) < FENCE_FROM:
    return fn(parts)
  first = jnp.asarray(jax.tree.leaves(parts[0])[0])
  return jax.lax.cond(first != jnp.zeros((), first.dtype), fn, fn, parts)


def sum_of(leaves: Sequence[Any], elementwise: Callable, dtype) -> jax.Array:
  """``sum(elementwise(x))`` over every element of every leaf, in ``dtype``."""
  return _reduce(leaves, lambda x: elementwise(x).astype(dtype), operator.add,
                 jnp.sum, jnp.zeros((), dtype))


def max_of(leaves: Sequence[Any], elementwise: Callable, dtype) -> jax.Array:
  """``max(elementwise(x))`` over every element of every leaf (``-inf`` if none)."""
  # `initial`: a zero-size leaf (a parameter with a 0 dimension) has no max.
  return _reduce(leaves, lambda x: elementwise(x).astype(dtype), jnp.maximum,
                 lambda x: jnp.max(x, initial=-jnp.inf), jnp.full((), -jnp.inf, dtype))


def any_of_pairs(pairs: Sequence[tuple[Any, Any]], elementwise: Callable) -> jax.Array:
  """Whether ``elementwise(a, b)`` holds anywhere, for same-shape pairs ``(a, b)``."""
  return _reduce(pairs, lambda p: elementwise(*p), operator.or_, jnp.any,
                 jnp.array(False), shape_of=lambda p: np.shape(p[0]))

