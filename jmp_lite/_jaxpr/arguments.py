"""A function's arguments as traced values and the rest.

Every pass traces a function on the array leaves of its arguments only: the
other leaves (a Flax module, an Equinox model's functions, flags, names)
reach it as they are. `split` and `refill` are the two halves; `outputs`
and `rejoin` do the same for what the function returns.
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


def _static_output(x, where: str):
  """``x``, an output leaf that is not an array, returned as it is: a function
  (an Equinox model's activation) or a constant. Anything else could hold a
  traced value and leak it, and is refused as `jax.jit` refuses it."""
  if x is None or callable(x) or isinstance(x, (bool, int, float, complex, str, bytes)):
    return x
  raise TypeError(
      f"{where} returned a value of type {type(x).__name__}, which is not a "
      "valid JAX type: return arrays, pytrees of them, functions and Python "
      "constants (register a class that holds arrays as a pytree).")


def outputs(out: Any, where: str) -> tuple[list, dict, Any]:
  """``(arrays, static, treedef)`` of a function's output ``out``: its array
  leaves, what a traced function returns, and the others by leaf index
  (functions and constants; anything else is a TypeError naming ``where``)."""
  leaves, treedef = jax.tree_util.tree_flatten(out)
  static = {i: _static_output(x, where) for i, x in enumerate(leaves)
            if not isinstance(x, (*ARRAYS, np.generic))}
  return [x for i, x in enumerate(leaves) if i not in static], static, treedef


def rejoin(treedef, static: dict, arrays) -> Any:
  """The output `outputs` split, with ``arrays`` in its array leaves' places."""
  arrays = iter(arrays)
  return jax.tree_util.tree_unflatten(treedef, [
      static[i] if i in static else next(arrays) for i in range(treedef.num_leaves)])
