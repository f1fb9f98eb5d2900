"""A function's arguments as traced values and the rest.

Every pass traces a function on the array leaves of its arguments only: the
other leaves (a Flax module, an Equinox model's functions, flags, names)
reach it as they are. `split` and `refill` are the two halves.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

# What the passes trace. (`jax.make_jaxpr` would also take NumPy and Python
# scalars, which most pass as static values: their traces differ by value.)
ARRAYS = (jax.Array, np.ndarray)


def split(args: Sequence[Any], kwargs: dict, values: tuple = ARRAYS):
  """``(leaves, treedef, traced)`` of ``(args, kwargs)``: ``traced`` the
  indices of the leaves of a type in ``values``."""
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  return leaves, treedef, tuple(i for i, x in enumerate(leaves) if isinstance(x, values))


def refill(leaves: Sequence[Any], traced: Sequence[int], treedef, values) -> tuple:
  """``(args, kwargs)`` with ``leaves[i]`` replaced by ``values``, in the order
  of ``traced``."""
  full = list(leaves)
  for i, x in zip(traced, values):
    full[i] = x
  return jax.tree_util.tree_unflatten(treedef, full)
