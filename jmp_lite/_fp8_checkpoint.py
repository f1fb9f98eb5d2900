"""Checkpoints of fp8 state: restoring across history lengths and schema versions."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _struct
from jmp_lite._fp8_state import SCHEMA_VERSION, Fp8State, MatmulMeta


def restore(raw: Any, target: Any) -> Any:
  """`jmp_lite.fp8.restore`."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(
      target, is_leaf=lambda x: isinstance(x, Fp8State))
  out = []
  for path, leaf in leaves:
    node = _lookup(raw, path)
    where = jax.tree_util.keystr(path) or "<root>"
    out.append(_migrate(node, leaf, where) if isinstance(leaf, Fp8State)
               else _leaf(node, leaf, where))
  return jax.tree_util.tree_unflatten(treedef, out)


def _lookup(raw, path):
  node = raw
  for i, key in enumerate(path):
    name = (key.key if isinstance(key, jax.tree_util.DictKey) else
            key.name if isinstance(key, jax.tree_util.GetAttrKey) else
            key.idx if isinstance(key, jax.tree_util.SequenceKey) else key.key)
    try:
      node = node[name] if not isinstance(node, dict) or name in node else node[str(name)]
    except (KeyError, IndexError, TypeError):
      raise ValueError(f"the checkpoint has nothing at "
                       f"{jax.tree_util.keystr(path[:i + 1])}") from None
  return node


def _leaf(value, like, where):
  value = np.asarray(value)
  if value.shape != tuple(like.shape):
    raise ValueError(f"checkpoint leaf {where} has shape {value.shape}, the target "
                     f"{tuple(like.shape)}")
  return jnp.asarray(value, like.dtype)


def _entry(node, key, where):
  """``node[key]``, or a ValueError naming ``where``."""
  try:
    return node[key]
  except (KeyError, IndexError, TypeError):
    raise ValueError(f"the checkpoint has nothing at {where}") from None


def _relay(history, length: int) -> np.ndarray:
  """A history re-laid to ``length``: newest first, then from the end backwards."""
  history = np.asarray(history, np.float32)
  newest_first = np.concatenate([history[..., :1], history[..., :0:-1]], axis=-1)
  keep = newest_first[..., :length]
  pad = np.zeros((*history.shape[:-1], length - keep.shape[-1]), np.float32)
  seq = np.concatenate([keep, pad], axis=-1)
  return np.concatenate([seq[..., :1], seq[..., :0:-1]], axis=-1)


def _migrate(raw, target: Fp8State, where: str) -> Fp8State:
  if not isinstance(raw, dict) or "version" not in raw or "sites" not in raw:
    raise ValueError(f"{where}: the checkpoint holds no jmp_lite fp8 state here")
  version = int(np.asarray(raw["version"]))
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
      history = np.asarray(_entry(tensor, "amax_history", f"{at}.{role}.amax_history"))
      if history.shape[:-1] != like.amax_history.shape[:-1]:
        raise ValueError(
            f"{at}.{role}: saved for layers {history.shape[:-1]}, "
            f"the target has {like.amax_history.shape[:-1]}")
      length = like.amax_history.shape[-1]
      scale = _leaf(_entry(tensor, "scale", f"{at}.{role}.scale"), like.scale,
                    f"{at}.{role}.scale")
      part = _struct.replace_fields(like, amax_history=jnp.asarray(_relay(history, length)),
                                    scale=scale)
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
                     jnp.zeros((), jnp.float32))
  return _struct.replace_fields(target, sites=sites, grad_loss_scale=grad_loss_scale,
                                version=jnp.asarray(SCHEMA_VERSION, jnp.int32))
