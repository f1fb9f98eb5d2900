"""Telemetry's statistics from the probes `jmp_lite._jaxpr.passes.instrument` places.

Each probe's slots in the measured vector hold forward then backward
statistics (`jmp_lite._jaxpr.probes`): maxima and counts. They are read in
one gather, merged per path, reduced across devices and turned into
`jmp_lite.telemetry.PrecisionStats`, all as operations on one matrix with a
row per module (and layer): XLA:CPU compiles each small operation into a
kernel of its own, and a slice, a convert and a division per module and
statistic were most of a telemetry step's compile time (a Hugging Face
BERT: 870 of its 1,560 kernels).
"""

from __future__ import annotations

from typing import Optional

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


def _merge(probes) -> dict[str, tuple[str, tuple, list[np.ndarray]]]:
  """Probes of one path (a module called twice, several outputs) together:
  key -> ``(dtype, slots' shape, [each probe's slots])``, in forward order.
  Probes of one path with different dtypes or layer axes are kept apart
  under ``path#2``, ``path#3``..."""
  merged: dict[str, tuple[str, tuple, list[np.ndarray]]] = {}
  for path, dtype, idx in probes:
    key, n = path, 1
    while key in merged and (merged[key][0] != dtype or merged[key][1] != idx.shape):
      n += 1
      key = f"{path}#{n}"
    merged.setdefault(key, (dtype, idx.shape, []))[2].append(idx)
  return merged


def build(rows, telemetry: telemetry_lib.Telemetry, axis_name=None,
          sampled=True) -> telemetry_lib.PrecisionStats:
  """`PrecisionStats` from `instrument.value_and_grad`'s ``(measured, probes)``."""
  measured, probes = rows
  width = _probes.width(1 + len(telemetry.what_if))
  half = width // 2
  merged = _merge(probes)
  src, seg, layout, narrow, tops = [], [], [], [], []
  n = 0
  for key, (dtype, shape, slots) in merged.items():
    layers = int(np.prod(shape[:-1], dtype=int))
    for idx in slots:
      src.append(idx.reshape(layers, width))
      seg.append(np.arange(n, n + layers))
    # Underflow per dtype name: the held dtype's, then each what-if one's
    # (a what-if equal to the held dtype is the same column).
    names = {}
    for i, name in enumerate([dtype] + [d.name for d in telemetry.what_if]):
      names.setdefault(name, i)
    layout.append((key, dtype, tuple(shape[:-1]), tuple(names.items())))
    is_narrow = _dtypes.is_narrow_float(dtype)
    narrow += [is_narrow] * layers
    tops += [float(jnp.finfo(dtype).max) if is_narrow else 1.0] * layers
    n += layers
  if n == 0:
    m = jnp.zeros((0, width), jnp.float32)
  else:
    src, seg = np.concatenate(src), np.concatenate(seg)
    m = measured[src]
    if len(seg) > n:  # a path measured more than once: maxima by max, counts by sum
      m = jnp.where(_is_max(width),
                    jax.ops.segment_max(m, seg, num_segments=n),
                    jax.ops.segment_sum(m, seg, num_segments=n))
  if axis_name is not None and _replicas.manual_axes():
    # Maxima and counts over the devices of ``axis_name`` (under shard_map).
    m = jnp.where(_is_max(width), jax.lax.pmax(m, axis_name), jax.lax.psum(m, axis_name))

  def side(part):  # max, non-finite count, then underflow fractions
    nonzero = jnp.maximum(part[:, 2:3], 1.0)
    return jnp.concatenate([part[:, :2], part[:, _probes.BASE_STATS:] / nonzero], axis=1)

  packed = jnp.stack([side(m[:, :half]), side(m[:, half:])], axis=1)
  # Over every cotangent held in a 16-bit or narrower float: what an
  # underflow-aware loss scale reads.
  narrow = np.asarray(narrow, bool)
  back = jnp.where(narrow[:, None], m[:, half:], 0.0)
  total = lambda column: jnp.sum(back[:, column])
  top = back[:, 0]
  headroom = jnp.min(jnp.where(narrow & (top > 0),
                               np.asarray(tops, np.float32) / jnp.where(top > 0, top, 1),
                               jnp.inf), initial=jnp.inf)
  return telemetry_lib.PrecisionStats(
      sampled=jnp.asarray(sampled), rows=packed,
      cotangent_underflow=total(_probes.BASE_STATS) / jnp.maximum(total(2), 1.0),
      cotangent_headroom=headroom,
      cotangent_upper=total(_probes.UPPER) / jnp.maximum(total(_probes.COUNT), 1.0),
      layout=tuple(layout))


def gate(telemetry: telemetry_lib.Telemetry, step) -> Optional[jax.Array]:
  """None (measure) when every step is measured, else 1.0 on sampled steps."""
  sample = telemetry.sample(step)
  return None if sample is True else jnp.asarray(sample, jnp.float32)
