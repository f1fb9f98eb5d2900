"""Facts about the machine for the bench: hardware, versions, memory, load."""

from __future__ import annotations

import os
import platform
from typing import Any, Optional

import jax

# What is absent matters as much as what is there ("AVX2 only"): the flags of
# jmp_lite.hardware.CPU_FLAGS for the host's architecture.
_X86_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile",
              "amx_bf16", "amx_fp16")
_ARM_FLAGS = ("bf16", "asimdhp", "sve", "sme")


def hardware_info(hw: Any = None) -> dict:
  """`jmp_lite.hardware.describe()` (device, CPU, bf16 units), plus versions,
  memory, the load average and XLA flags."""
  import jmp_lite.hardware

  hw = hw or jmp_lite.hardware.describe()
  flags = set(hw.cpu_flags)
  arch = _ARM_FLAGS if flags & set(_ARM_FLAGS) and not flags & set(_X86_FLAGS) else _X86_FLAGS
  try:
    import jaxlib
    jaxlib_version = jaxlib.__version__
  except Exception:  # pragma: no cover
    jaxlib_version = "unknown"
  versions = {"python": platform.python_version(), "jax": jax.__version__,
              "jaxlib": jaxlib_version}
  for mod in ("flax", "optax", "jmp", "jmp_lite", "numpy"):
    try:
      versions[mod] = __import__(mod).__version__
    except Exception:
      versions[mod] = "not installed"
  limit = device_memory_limit()
  return {
      "headline": hw.headline(),
      "cpu_model": hw.cpu_model or platform.processor() or "unknown",
      "cores": os.cpu_count(),
      "usable_cores": hw.cores,
      "cpu_flags": " ".join(hw.cpu_flags) or "unknown",
      "missing_flags": " ".join(f for f in arch if flags and f not in flags),
      "memory_gib": _memory_gib(),
      "platform": platform.platform(),
      "backend": hw.platform,
      "devices": f"{hw.device_count} × {hw.device_kind}",
      "compute_capability": hw.compute_capability,
      "matrix_dtypes": list(hw.matrix_dtypes),
      "bf16_units": hw.bf16_units,
      "device_memory_gib": round(limit / 2**30, 1) if limit else None,
      "versions": versions,
      "loadavg_at_start": loadavg(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


def device_memory_stats() -> Optional[dict]:
  """The default device's allocator statistics (GPUs, TPUs); None on CPUs."""
  try:
    return jax.devices()[0].memory_stats() or None
  except Exception:  # not implemented by this backend
    return None


def device_memory_limit() -> Optional[int]:
  """Bytes the default device's allocator may hand out, if it says."""
  stats = device_memory_stats()
  return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def memory_limit() -> Optional[int]:
  """Bytes the default device can use: its allocator's limit on GPUs and TPUs,
  the host's available memory (MemAvailable) on CPUs; None if unknown."""
  limit = device_memory_limit()
  if limit:
    return limit
  return _mem_available() if jax.default_backend() == "cpu" else None


def bounded_bytes(wanted: int, fraction: float) -> int:
  """``wanted``, at most ``fraction`` of `memory_limit` when that is known."""
  limit = memory_limit()
  return min(wanted, int(limit * fraction)) if limit else wanted


def peak_device_memory() -> Optional[int]:
  """The allocator's high-water mark so far (GPUs, TPUs), else None."""
  stats = device_memory_stats()
  return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def _memory_gib() -> Optional[float]:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemTotal:"):
          return round(int(line.split()[1]) / 2**20, 1)
  except OSError:
    pass
  return None


def _mem_available() -> Optional[int]:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def loadavg() -> str:
  try:
    with open("/proc/loadavg") as f:
      return " ".join(f.read().split()[:3])
  except OSError:
    return "unknown"
