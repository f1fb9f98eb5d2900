"""Registration of frozen dataclasses as pytrees, for jmp_lite's state objects.

Why not `jax.tree_util.register_dataclass` or `flax.struct.dataclass`: both
rebuild the object through ``__init__`` on every unflatten, so ``__post_init__``
runs with tracers, abstract values and placeholder objects, and any validation
there would either break tracing or force a device-to-host copy on every step.
Like equinox, jmp_lite validates and converts once, when a user constructs the
object, and unflattens by setting fields directly. The field list comes from
`dataclasses.fields`, so no field can be forgotten (the bug that makes jmp's
`DynamicLossScale` lose ``min_loss_scale`` under ``jit``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax

T = TypeVar("T")


def static_field(**kwargs: Any) -> Any:
  """A dataclass field kept in the treedef (hashable, never traced)."""
  metadata = dict(kwargs.pop("metadata", {}))
  metadata["static"] = True
  return dataclasses.field(metadata=metadata, **kwargs)


def register_state(cls: type[T]) -> type[T]:
  """Registers a frozen dataclass as a pytree with keyed leaves.

  Fields created by `static_field` go to the treedef; all others are leaves.
  """
  fields = [f for f in dataclasses.fields(cls) if f.init]
  data = tuple(f.name for f in fields if not f.metadata.get("static"))
  meta = tuple(f.name for f in fields if f.metadata.get("static"))
  keys = tuple(jax.tree_util.GetAttrKey(name) for name in data)

  def flatten_with_keys(obj):
    children = tuple((k, getattr(obj, n)) for k, n in zip(keys, data))
    return children, tuple(getattr(obj, n) for n in meta)

  def flatten(obj):
    return tuple(getattr(obj, n) for n in data), tuple(getattr(obj, n) for n in meta)

  def unflatten(aux, children):
    obj = object.__new__(cls)
    for name, value in zip(data, children):
      object.__setattr__(obj, name, value)
    for name, value in zip(meta, aux):
      object.__setattr__(obj, name, value)
    return obj

  jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
  return cls


def replace_fields(obj: T, **changes: Any) -> T:
  """`dataclasses.replace` without re-running ``__init__`` (used inside jit)."""
  new = object.__new__(type(obj))
  for f in dataclasses.fields(obj):
    object.__setattr__(new, f.name, changes.pop(f.name, getattr(obj, f.name)))
  if changes:
    raise TypeError(f"{type(obj).__name__} has no fields {sorted(changes)}")
  return new
