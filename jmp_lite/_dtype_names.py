"""The names of dtypes: the spellings a policy string accepts, and the half
dtypes jmp's ``half`` and the hardware prefer.

Re-exported by `jmp_lite.policy`, whose grammar parses them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DTypeLike = Any


class _DtypeTable(Mapping):
  """A read-only mapping keyed by dtype, that accepts any spelling of a dtype.

  ``jnp.float32``, ``np.float32`` and ``np.dtype("float32")`` hash differently;
  keys are normalised so all three find the same entry.
  """

  def __init__(self, table):
    self._table = {np.dtype(k): v for k, v in table.items()}

  def __getitem__(self, key):
    try:
      return self._table[np.dtype(key)]
    except TypeError:
      raise KeyError(key) from None

  def __iter__(self):
    return iter(self._table)

  def __len__(self):
    return len(self._table)


# The first name of each dtype is what `str(policy)` prints.
dtype_to_names = _DtypeTable({
    jnp.bfloat16: ("bf16", "bfloat16"),
    jnp.float16: ("f16", "float16"),
    jnp.float32: ("f32", "float32", "full"),
    jnp.float64: ("f64", "float64"),
    jnp.float8_e4m3fn: ("f8e4m3", "float8_e4m3fn", "fp8_e4m3", "e4m3"),
    jnp.float8_e5m2: ("f8e5m2", "float8_e5m2", "fp8_e5m2", "e5m2"),
})

name_to_dtype = {name: dtype for dtype, names in dtype_to_names.items()
                 for name in names}


def dtype_name(dtype: DTypeLike) -> str:
  """The short name `get_policy` parses back to ``dtype``."""
  dt = np.dtype(dtype)
  return dtype_to_names[dt][0] if dt in dtype_to_names else dt.name


def half_dtype() -> Any:
  """Returns jmp's half precision dtype: bfloat16 on TPU, float16 elsewhere.

  Kept for compatibility with jmp, so it returns the same object jmp does
  (``jnp.float16`` or ``jnp.bfloat16``), which jmp's README calls:
  ``jmp.half_dtype()(2 ** 15)``. `preferred_half_dtype` is the better default
  on current hardware.
  """
  on_tpu = jax.local_devices()[0].platform == "tpu"
  return jnp.bfloat16 if on_tpu else jnp.float16


def preferred_half_dtype() -> np.dtype:
  """The 16-bit float that is fastest and safest on the default backend.

  bfloat16 on TPUs, on CPUs (where float16 arithmetic is emulated, while
  bfloat16 has native matrix units on recent x86 and ARM cores) and on GPUs of
  compute capability 8.0 or newer; float16 on older GPUs, which lack bfloat16
  arithmetic. Unlike float16, bfloat16 has float32's range, so it needs no loss
  scaling.
  """
  device = jax.local_devices()[0]
  if device.platform == "gpu":
    capability = getattr(device, "compute_capability", None)
    try:
      major = int(str(capability).split(".")[0])
    except ValueError:
      major = 8  # ROCm and unknown devices: bfloat16 is supported.
    if major < 8:
      return np.dtype(jnp.float16)
  return np.dtype(jnp.bfloat16)


def parse_dtype(value: str) -> np.dtype:
  """Parses a string representing a dtype into a dtype object.

  Accepts the names in `dtype_to_names`, ``"half"`` (jmp's `half_dtype`) and
  any NumPy floating dtype name, case-insensitively.

  Raises:
    ValueError: naming the unknown value and the accepted ones.
  """
  value = value.strip().lower()
  if value == "half":
    return np.dtype(half_dtype())
  if value in name_to_dtype:
    return np.dtype(name_to_dtype[value])
  if value in _AMBIGUOUS:
    # NumPy reads "float" as float64; a policy author who writes it usually
    # means float32. jmp rejects it too.
    raise ValueError(
        f"Ambiguous dtype '{value}': write 'float32' (f32) or 'float64' (f64).")
  try:
    dt = np.dtype(jnp.dtype(value))
  except (TypeError, ValueError, SyntaxError):  # numpy raises SyntaxError for ",".
    dt = None
  if dt is not None and jnp.issubdtype(dt, jnp.floating):
    return dt.newbyteorder("=")
  if dt is not None:
    raise ValueError(
        f"dtype '{value}' is {dt.name}, not a floating dtype: a policy's dtypes "
        f"are floating, one of {sorted(name_to_dtype)}.")
  raise ValueError(
      f"Unknown dtype '{value}': expected 'full', 'half' or one of "
      f"{sorted(name_to_dtype)} (e.g. 'f32' for 'float32', 'bf16' for "
      "'bfloat16').")


_AMBIGUOUS = ("float",)
