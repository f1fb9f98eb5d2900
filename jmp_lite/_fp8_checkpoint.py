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
    saved = raw["sites"][name]
    parts = {}
    for role in ("lhs", "rhs", "grad"):
      like = getattr(meta, role)
      history = np.asarray(saved[role]["amax_history"])
      if history.shape[:-1] != like.amax_history.shape[:-1]:
        raise ValueError(
            f"{where}.sites[{name!r}].{role}: saved for layers {history.shape[:-1]}, "
            f"the target has {like.amax_history.shape[:-1]}")
      parts[role] = _struct.replace_fields(
          like, amax_history=jnp.asarray(_relay(history, like.amax_history.shape[-1])),
          scale=_leaf(saved[role]["scale"], like.scale, f"{where}.{name}.{role}.scale"))
    sites[name] = MatmulMeta(**parts, observed=_leaf(
        saved["observed"], meta.observed, f"{where}.{name}.observed"))
  return _struct.replace_fields(target, sites=sites,
                                version=jnp.asarray(SCHEMA_VERSION, jnp.int32))
