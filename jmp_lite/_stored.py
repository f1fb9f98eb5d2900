"""The parameters as stored, for the rounding transforms inside an optimizer
that runs on copies of them (`jmp_lite.optax.with_loss_scale`,
`jmp_lite.optax.with_state_dtype`)."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, NamedTuple, Optional

import jax
import numpy as np


# `jmp_lite.optax.with_loss_scale` runs its inner optimizer on float32 copies
# of half-precision parameters, so that moments, hyperparameters and weight
# decay are computed in float32. The rounding transforms (`jmp_lite.rounding`)
# must still see the parameters as stored: they round onto the stored dtype.
# The wrapper puts the stored parameters here while it traces
# ``inner.init``/``inner.update`` (a trace-time Python value, like JAX's own
# configuration contexts), with each copy known by its identity: a transform
# given part of them (``optax.masked``, ``optax.multi_transform``; the copies
# without the integer leaves no optimizer updates) finds each one's stored
# parameter.
class _Stored(NamedTuple):
  tree: Any  # the stored parameters
  by_copy: dict  # id(a copy) -> the stored leaf it copies
  alive: list  # the copies, kept alive while their ids are keys


_STORED_PARAMS: contextvars.ContextVar[Optional[_Stored]] = contextvars.ContextVar(
    "jmp_lite_stored_params", default=None)


@contextlib.contextmanager
def stored_params(params: Any, copies: Any = None) -> Iterator[None]:
  """While active, the rounding transforms round onto ``params``' dtypes.

  Args:
    params: the parameters as stored.
    copies: what the optimizer inside is given instead (float32 copies of
      ``params``, None for leaves it cannot update), leaf for leaf; a
      rounding transform given any of them rounds onto the leaf of
      ``params`` it copies. Nested, a copy of a copy is known as the
      outermost stored leaf.
  """
  outer = _STORED_PARAMS.get()
  by_copy = dict(outer.by_copy) if outer is not None else {}
  alive = list(outer.alive) if outer is not None else []
  if copies is not None:
    def note(copy, stored):
      if copy is not None:
        by_copy[id(copy)] = by_copy.get(id(stored), stored)
        alive.append(copy)
    jax.tree.map(note, copies, params, is_leaf=lambda x: x is None)
  tree = outer.tree if outer is not None and copies is not None else params
  token = _STORED_PARAMS.set(_Stored(tree, by_copy, alive))
  try:
    yield
  finally:
    _STORED_PARAMS.reset(token)


def params_as_stored(params: Any, name: str) -> Any:
  """``params``, with each copy (`stored_params`) replaced by what it copies."""
  if params is None:
    raise ValueError(f"{name} needs params: call update(updates, state, params).")
  stored = _STORED_PARAMS.get()
  if stored is None:
    return params
  leaves, treedef = jax.tree.flatten(params)
  if leaves and all(id(x) in stored.by_copy for x in leaves):
    return treedef.unflatten([stored.by_copy[id(x)] for x in leaves])
  # Copies a transform rebuilt (new arrays of the same values): the stored
  # tree, where it is the same tree of the same shapes.
  same = jax.tree.structure(stored.tree) == treedef and all(
      np.shape(a) == np.shape(b) for a, b in zip(jax.tree.leaves(stored.tree), leaves))
  if same:
    return stored.tree
  return treedef.unflatten([stored.by_copy.get(id(x), x) for x in leaves])
