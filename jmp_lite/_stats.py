"""Telemetry's statistics from the rows `jmp_lite._jaxpr.passes.instrument` decodes.

Each probe's row holds forward then backward statistics (`jmp_lite._jaxpr.probes`):
maxima and counts, merged per path, reduced across devices and read into
`jmp_lite.telemetry.PrecisionStats`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _dtypes
from jmp_lite._jaxpr import probes as _probes
from jmp_lite import _replicas
from jmp_lite import telemetry as telemetry_lib


def _is_max(width: int) -> np.ndarray:
  """Which of a probe's ``width`` statistics are maxima (the rest are counts)."""
  is_max = np.zeros(width, bool)
  is_max[[0, width // 2]] = True
  return is_max


def _combine(rows: Sequence[tuple[str, str, jax.Array]]) -> dict:
  """Probes of one path (a module called twice, several outputs) merged.

  Maxima by max, counts by sum; probes of one path with different dtypes or
  layer axes are kept apart under ``path#2``, ``path#3``...
  """
  merged: dict[str, tuple[str, jax.Array]] = {}
  for path, dtype, arr in rows:
    key = path
    n = 1
    while key in merged and (merged[key][0] != dtype
                             or merged[key][1].shape != arr.shape):
      n += 1
      key = f"{path}#{n}"
    if key in merged:
      old = merged[key][1]
      arr = jnp.where(_is_max(arr.shape[-1]), jnp.maximum(old, arr), old + arr)
    merged[key] = (dtype, arr)
  return merged


def _reduce(merged: dict, axis_name) -> dict:
  """Maxima and counts over the devices of ``axis_name`` (under shard_map)."""
  if axis_name is None:
    return merged
  out = {}
  for key, (dtype, arr) in merged.items():
    arr = jnp.where(_is_max(arr.shape[-1]), jax.lax.pmax(arr, axis_name),
                    jax.lax.psum(arr, axis_name))
    out[key] = (dtype, arr)
  return out


def build(rows, telemetry: telemetry_lib.Telemetry, axis_name=None,
          sampled=True) -> telemetry_lib.PrecisionStats:
  """`PrecisionStats` from `decode`'s rows."""
  merged = _reduce(_combine(rows), axis_name if _replicas.manual_axes() else None)
  names_of = lambda dtype: [dtype] + [d.name for d in telemetry.what_if]
  modules = {}
  # Over every cotangent held in a 16-bit or narrower float: what an
  # underflow-aware loss scale reads.
  under, nonzero = jnp.float32(0), jnp.float32(0)
  upper, count = jnp.float32(0), jnp.float32(0)
  headroom = jnp.float32(jnp.inf)
  for key, (dtype, arr) in merged.items():
    half = arr.shape[-1] // 2

    def side(part, dtype=dtype):
      nonzero = jnp.maximum(part[..., 2], 1.0)
      under = {}
      for i, d in enumerate(names_of(dtype)):
        under.setdefault(d, part[..., _probes.BASE_STATS + i] / nonzero)
      return part[..., 0], part[..., 1].astype(jnp.int32), under

    fmax, fnon, funder = side(arr[..., :half])
    bmax, bnon, bunder = side(arr[..., half:])
    modules[key] = telemetry_lib.ModuleStats(
        forward_max=fmax, forward_nonfinite=fnon, forward_underflow=funder,
        backward_max=bmax, backward_nonfinite=bnon, backward_underflow=bunder,
        dtype=dtype)
    if _dtypes.is_narrow_float(dtype):
      back = arr[..., half:]
      under += jnp.sum(back[..., _probes.BASE_STATS])
      nonzero += jnp.sum(back[..., 2])
      upper += jnp.sum(back[..., _probes.UPPER])
      count += jnp.sum(back[..., _probes.COUNT])
      top = jnp.max(back[..., 0])
      headroom = jnp.minimum(headroom, jnp.where(
          top > 0, float(jnp.finfo(dtype).max) / top, jnp.inf))
  return telemetry_lib.PrecisionStats(
      sampled=jnp.asarray(sampled), modules=modules,
      cotangent_underflow=under / jnp.maximum(nonzero, 1.0),
      cotangent_headroom=headroom,
      cotangent_upper=upper / jnp.maximum(count, 1.0), order=tuple(modules))


def gate(telemetry: telemetry_lib.Telemetry, step) -> Optional[jax.Array]:
  """None (measure) when every step is measured, else 1.0 on sampled steps."""
  sample = telemetry.sample(step)
  return None if sample is True else jnp.asarray(sample, jnp.float32)
