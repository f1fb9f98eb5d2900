"""Registration of frozen dataclasses as pytrees, for jmp_lite's state objects,
and the conversion and checks of their constructor arguments.

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
import sys
import warnings
from typing import Any, Optional, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._jaxpr import internals as _internals

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

  _SERIALIZABLE[cls] = data
  if "flax.serialization" in sys.modules:
    register_serialization()
  return cls


# State classes and their leaf fields, for `register_serialization`.
_SERIALIZABLE: dict[type, tuple[str, ...]] = {}


def register_serialization() -> None:
  """Registers the state classes with `flax.serialization` (``to_bytes``,
  ``to_state_dict``), as a `flax.struct.dataclass` is: the leaf fields by
  name; static ones come from the target a checkpoint is restored into.

  Called once Flax is loaded (by `jmp_lite.flax` and `jmp_lite.training`, or
  by `register_state` if it already was): importing jmp_lite alone does not
  import Flax.
  """
  from flax import serialization  # pylint: disable=g-import-not-at-top
  for cls, data in _SERIALIZABLE.items():
    if serialization.is_serializable(cls):
      continue

    def to_state_dict(obj, data=data):
      return {n: serialization.to_state_dict(getattr(obj, n)) for n in data}

    def from_state_dict(target, state, data=data, cls=cls):
      missing = [n for n in data if n not in state]
      # Unknown fields too, as flax.struct refuses them: a checkpoint of
      # another state (a DynamicLossScale's restored into a NoOpLossScale)
      # would otherwise lose them without a word.
      unknown = sorted(set(state) - set(data))
      if missing or unknown:
        raise ValueError(
            f"Restoring a {cls.__name__} at {serialization.current_path() or '.'}: "
            "the checkpoint "
            + "; ".join(([f"has no fields {missing}"] if missing else [])
                        + ([f"has fields the target lacks {unknown}"] if unknown else []))
            + f" (it has {sorted(state)}, the target {list(data)}). Restore into "
            "the state the checkpoint was made from (the same loss scale and "
            "options).")
      return replace_fields(target, **{
          n: serialization.from_state_dict(getattr(target, n), state[n], name=n)
          for n in data})

    serialization.register_serialization_state(cls, to_state_dict, from_state_dict)


def replace_fields(obj: T, **changes: Any) -> T:
  """`dataclasses.replace` without re-running ``__init__`` (used inside jit)."""
  new = object.__new__(type(obj))
  for f in dataclasses.fields(obj):
    object.__setattr__(new, f.name, changes.pop(f.name, getattr(obj, f.name)))
  if changes:
    raise TypeError(f"{type(obj).__name__} has no fields {sorted(changes)}")
  return new


# Converting and checking constructor arguments, once.


def as_scalar(value: Any, dtype, name: str, *, warn_non_floating: bool = False):
  """Converts a constructor argument to a scalar array of ``dtype``.

  Returns the array and, when the value is known on the host, its value as a
  Python number (None under tracing).
  """
  if value is None or isinstance(value, (str, bytes)) or not (
      hasattr(value, "dtype") or isinstance(value, (int, float, np.number))):
    raise TypeError(f"{name} must be a number or a scalar array, got {value!r}")
  value_dtype = getattr(value, "dtype", None)
  if value_dtype is None:
    try:
      value_dtype = jax.eval_shape(lambda: value).dtype
    except OverflowError as e:  # A Python int beyond int32/int64.
      raise ValueError(f"{name} is out of range: {value!r}") from e
  if warn_non_floating and not jnp.issubdtype(value_dtype, jnp.floating):
    warnings.warn(f"Expected floating type for {name}, got {value_dtype}")
  shape = np.shape(value)
  if shape != ():
    raise ValueError(f"{name} must be a scalar, got shape {shape}: {value!r}")
  if _internals.is_tracer(value):
    return value.astype(dtype), None
  host = np.asarray(value)
  if jnp.issubdtype(dtype, jnp.integer):
    if not (np.isfinite(host) and float(host) == int(host)):
      raise ValueError(f"{name} must be a whole number, got {value!r}")
    info = np.iinfo(dtype)
    if not info.min <= int(host) <= info.max:
      raise ValueError(f"{name} must fit in {np.dtype(dtype).name}, got {value!r}")
    return jnp.asarray(int(host), dtype), int(host)
  # Check the value that is stored: 1e39 is finite in Python but not in float32.
  with np.errstate(over="ignore", under="ignore"):
    stored = host.astype(dtype)
  if (np.isfinite(host) and not np.isfinite(stored)) or (host != 0 and stored == 0):
    raise ValueError(
        f"{name}={value!r} is not representable in {np.dtype(dtype).name} "
        f"(it becomes {stored}).")
  return jnp.asarray(stored, dtype), float(stored)


def check_positive_finite(value: Optional[float], name: str, *, allow_zero=False,
                          normal=False):
  """Raises ValueError unless ``value`` is finite and positive (or zero).

  With ``normal``, also unless a nonzero value is at least float32's smallest
  normal: XLA flushes subnormal float32 to zero on CPUs and GPUs, so a
  subnormal loss scale zeroes every gradient and no step is ever skipped.
  """
  if value is None:
    return
  ok = np.isfinite(value) and (value >= 0 if allow_zero else value > 0)
  if not ok:
    bound = ">= 0" if allow_zero else "> 0"
    raise ValueError(f"{name} must be finite and {bound}, got {value!r}")
  tiny = float(np.finfo(np.float32).tiny)
  if normal and value != 0 and value < tiny:
    raise ValueError(
        f"{name}={value!r} is below float32's smallest normal number ({tiny:.8g}): "
        "XLA flushes it to zero, and every scaled gradient with it.")
