"""Checkpoints of fp8 state: restoring across history lengths and schema versions."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _struct
from jmp_lite._fp8_state import SCHEMA_VERSION, Fp8State, MatmulMeta


def restore(raw: Any, target: Any, strict: bool = True) -> Any:
  """`jmp_lite.fp8.restore`."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(
      target, is_leaf=lambda x: isinstance(x, Fp8State))
  out, taken = [], []
  for path, leaf in leaves:
    node = _lookup(raw, path)
    where = jax.tree_util.keystr(path) or "<root>"
    taken.append(tuple(str(_name(key)) for key in path))
    out.append(_migrate(node, leaf, where) if isinstance(leaf, Fp8State)
               else _leaf(node, leaf, where))
  if strict:
    _refuse_extras(raw, set(taken))
  return jax.tree_util.tree_unflatten(treedef, out)


def _name(key):
  return (key.key if isinstance(key, jax.tree_util.DictKey) else
          key.name if isinstance(key, jax.tree_util.GetAttrKey) else
          key.idx if isinstance(key, jax.tree_util.SequenceKey) else key.key)


def _refuse_extras(raw, taken: set) -> None:
  """Raises if ``raw`` holds a value at a path ``target`` has no leaf for
  (nor an `Fp8State` above it): a DynamicLossScale restored into a target
  of NoOpLossScale, an optimizer state of more parts. Dropping it in
  silence resumed float16 training unscaled, as msgpack and orbax refuse."""
  extras = []

  def walk(node, path):
    if path in taken:  # a target leaf or fp8 state: read, with all below it
      return
    if isinstance(node, dict):
      for key, value in node.items():
        walk(value, (*path, str(key)))
    elif isinstance(node, (list, tuple)):
      for i, value in enumerate(node):
        walk(value, (*path, str(i)))
    elif node is not None:
      extras.append("".join(f"[{p!r}]" for p in path) or "<root>")

  walk(raw, ())
  if extras:
    raise ValueError(
        f"the checkpoint holds {len(extras)} value(s) the target has no place "
        f"for, e.g. at {extras[0]}: restore into the state the checkpoint was "
        "saved from (the same loss scale and optimizer), as jax.eval_shape of "
        "its TrainState.create(...)")


def _lookup(raw, path):
  node = raw
  for i, key in enumerate(path):
    name = _name(key)
    try:
      node = node[name] if not isinstance(node, dict) or name in node else node[str(name)]
    except (KeyError, IndexError, TypeError):
      raise ValueError(f"the checkpoint has nothing at "
                       f"{jax.tree_util.keystr(path[:i + 1])}") from None
  return node


def _array(value):
  """``value`` as a NumPy array, or a `jax.Array` as it is where it spans
  other processes' devices (NumPy cannot read those)."""
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    return value
  return np.asarray(value)


def _scalar(value):
  """A scalar's value, also of an array replicated over other processes' devices."""
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    value = value.addressable_data(0)
  return np.asarray(value)


def _concrete(sharding):
  """``sharding`` on devices: a target made by ``jax.eval_shape`` under
  ``jax.set_mesh`` names an abstract mesh, placed on the concrete mesh set
  now (None, JAX's default placement, with none set)."""
  mesh = getattr(sharding, "mesh", None)
  if isinstance(mesh, jax.sharding.AbstractMesh):
    get_mesh = getattr(jax.sharding, "get_mesh", None)  # JAX 0.7 onwards
    now = get_mesh() if get_mesh is not None else None
    if getattr(now, "empty", True) or now.axis_names != mesh.axis_names:
      return None
    return jax.sharding.NamedSharding(now, sharding.spec)
  return sharding


def _placed(value, like):
  """``value`` in ``like``'s dtype, on ``like``'s sharding where it has one
  (a target of the new mesh's layout), else where JAX puts it."""
  sharding = _concrete(getattr(like, "sharding", None))
  value = value.astype(like.dtype) if isinstance(value, jax.Array) else np.asarray(
      value, like.dtype)
  if sharding is None or sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0]):
    # JAX's default placement, uncommitted as a fresh state's arrays are: a
    # committed copy would compile a step compiled for the target again.
    return jnp.asarray(value)
  return jax.device_put(value, sharding)


def _leaf(value, like, where):
  value = _array(value)
  if np.shape(value) != tuple(like.shape):
    raise ValueError(f"checkpoint leaf {where} has shape {np.shape(value)}, the target "
                     f"{tuple(like.shape)}")
  return _placed(value, like)


def _entry(node, key, where):
  """``node[key]``, or a ValueError naming ``where``."""
  try:
    return node[key]
  except (KeyError, IndexError, TypeError):
    raise ValueError(f"the checkpoint has nothing at {where}") from None


def _relay(history, length: int):
  """A history re-laid to ``length``: newest first, then from the end backwards."""
  xp = jnp if isinstance(history, jax.Array) else np
  history = history.astype(np.float32)
  newest_first = xp.concatenate([history[..., :1], history[..., :0:-1]], axis=-1)
  keep = newest_first[..., :length]
  pad = xp.zeros((*history.shape[:-1], length - keep.shape[-1]), np.float32)
  seq = xp.concatenate([keep, pad], axis=-1)
  return xp.concatenate([seq[..., :1], seq[..., :0:-1]], axis=-1)


def _migrate(raw, target: Fp8State, where: str) -> Fp8State:
  if not isinstance(raw, dict) or "version" not in raw or "sites" not in raw:
    raise ValueError(f"{where}: the checkpoint holds no jmp_lite fp8 state here")
  version = int(_scalar(raw["version"]))
  if version > SCHEMA_VERSION:
    raise ValueError(f"{where}: fp8 schema version {version} is newer than this "
                     f"jmp_lite's ({SCHEMA_VERSION}); upgrade jmp_lite")
  if set(raw["sites"]) != set(target.sites):
    raise ValueError(
        f"{where}: the checkpoint's fp8 sites {sorted(raw['sites'])} are not the "
        f"target's {sorted(target.sites)}")
  sites = {}
  for name, meta in target.sites.items():
    at = f"{where}.sites[{name!r}]"
    saved = _entry(raw["sites"], name, at)
    parts = {}
    for role in ("lhs", "rhs", "grad"):
      like = getattr(meta, role)
      tensor = _entry(saved, role, f"{at}.{role}")
      history = _array(_entry(tensor, "amax_history", f"{at}.{role}.amax_history"))
      if history.shape[:-1] != like.amax_history.shape[:-1]:
        raise ValueError(
            f"{at}.{role}: saved for layers {history.shape[:-1]}, "
            f"the target has {like.amax_history.shape[:-1]}")
      length = like.amax_history.shape[-1]
      scale = _leaf(_entry(tensor, "scale", f"{at}.{role}.scale"), like.scale,
                    f"{at}.{role}.scale")
      part = _struct.replace_fields(
          like, amax_history=_placed(_relay(history, length), like.amax_history), scale=scale)
      if history.shape[-1] != length:
        # The saved scale came from entries a shorter history no longer
        # holds: the one the kept entries ask for (`DelayedScaling.next_scale`).
        part = _struct.replace_fields(part, scale=part.next_scale())
      parts[role] = part
    sites[name] = MatmulMeta(**parts, observed=_leaf(
        _entry(saved, "observed", f"{at}.observed"), meta.observed, f"{at}.observed"))
  # Version 1 did not record the loss scale its gradient histories were
  # measured under: 0, "take the next step's as it is" (what version 1 did).
  grad_loss_scale = (_leaf(_entry(raw, "grad_loss_scale", f"{where}.grad_loss_scale"),
                           target.grad_loss_scale, f"{where}.grad_loss_scale")
                     if version >= 2 else
                     _placed(np.zeros((), np.float32), target.grad_loss_scale))
  return _struct.replace_fields(target, sites=sites, grad_loss_scale=grad_loss_scale,
                                version=_placed(np.asarray(SCHEMA_VERSION, np.int32),
                                                target.version))
