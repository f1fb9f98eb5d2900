"""Functions that compare equal when they were made from equal arguments.

A transformation that `jmp_lite.optax.with_loss_scale` builds is a pair of
closures, and closures compare by identity. `jmp_lite.TrainState` keeps its
``tx`` in the treedef (as Flax's ``TrainState`` does), so two states created
alike (``TrainState.create`` called twice with the same optimizer and loss
scale) had different structures: a jitted step compiled again for the second,
and shardings taken from one state did not fit the other. Flax's own
``TrainState`` given the same ``tx`` object compares equal.

`keyed` gives a function an equality by what it was made from. `value_key`
makes that comparable from arrays: their dtypes, shapes and a digest of
their bytes, when they are concrete. A traced array (a state created inside ``jax.eval_shape`` or
``jit``) has no value to compare, and its function equals no other.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Hashable

import jax
import numpy as np


class _Keyed:
  """``fn``, equal to another `_Keyed` of an equal ``key``."""

  __slots__ = ("fn", "key", "__wrapped__", "__weakref__")  # jax.jit keeps a weakref

  def __init__(self, fn: Callable, key: Hashable):
    self.fn = fn
    self.key = key
    self.__wrapped__ = fn  # what inspect.signature and friends read

  def __call__(self, *args, **kwargs):
    return self.fn(*args, **kwargs)

  def __eq__(self, other) -> bool:
    return type(other) is _Keyed and self.key == other.key

  def __hash__(self) -> int:
    return hash(self.key)

  def __repr__(self) -> str:
    return repr(self.fn)


def keyed(fn: Callable, key: Hashable) -> Callable:
  """``fn``, compared (and hashed) by ``key`` instead of by identity; by
  identity still if ``key`` cannot be hashed (a user's object in it)."""
  try:
    hash(key)
  except TypeError:
    key = object()
  return _Keyed(fn, key)


def value_key(tree: Any) -> Hashable:
  """A hashable key equal for trees of equal structure and values.

  Arrays count by dtype, shape and a 128-bit digest of their bytes; other
  leaves (Python numbers, strings, None) as they are. A tree holding a tracer gets a key of its own:
  equal to nothing else.
  """
  leaves, treedef = jax.tree.flatten(tree)
  parts = []
  for leaf in leaves:
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
      try:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
          return object()  # no value here to compare (on other hosts)
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
          leaf = jax.random.key_data(leaf)
        array = np.asarray(leaf)
      except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return object()  # traced: no value to compare
      # A digest, not the bytes: jit compares the keys of equal functions on
      # every call, and an fp8 state holds megabytes of histories.
      digest = hashlib.blake2b(array.tobytes(), digest_size=16).digest()
      parts.append((str(array.dtype), array.shape, digest))
    else:
      try:
        hash(leaf)
      except TypeError:
        return object()
      parts.append((type(leaf), leaf))
  return treedef, tuple(parts)
