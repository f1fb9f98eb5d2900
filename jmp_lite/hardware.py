"""What mixed precision can buy on the machine at hand.

Whether bfloat16 makes a step faster depends on the hardware more than on the
model: a CPU with bfloat16 dot-product instructions (x86 ``avx512_bf16`` or
AMX) runs a bf16 × bf16 → f32 matmul 1.3–2.0× faster than float32, while an
AVX2-only CPU converts the operands and runs it in float32, 1.4–1.8× *slower*.
On such a CPU mixed precision still halves the bytes of activations and
parameters, but not the time. GPUs and TPUs have 16-bit matrix units; float16
on a CPU is emulated.

`describe` reads this from JAX's devices and the CPU's flags, without running
anything; `measure_matmuls` times one matmul per dtype to replace the rule of
thumb with a number for this machine.

Example:
  >>> import jmp_lite.hardware
  >>> hw = jmp_lite.hardware.describe()
  >>> hw.platform in ("cpu", "gpu", "tpu")
  True
  >>> isinstance(hw.advice(), str)
  True
"""

from __future__ import annotations

import dataclasses
import os
import platform as _platform
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ("CPU_FLAGS", "Hardware", "describe", "measure_matmuls")

# CPU flags that decide what 16-bit (and 8-bit) arithmetic a CPU has, as
# /proc/cpuinfo spells them (x86 "flags", Arm "Features").
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile",
             "amx_bf16", "amx_fp16", "bf16", "asimdhp", "sve", "sme")


@dataclasses.dataclass(frozen=True)
class Hardware:
  """The default backend's devices and, on CPUs, the relevant ISA flags.

  Attributes:
    platform: JAX's platform of the default backend: "cpu", "gpu" or "tpu".
    device_kind: the first device's `device_kind`.
    device_count: devices of the default backend visible to this process.
    cpu_model: the host CPU's model name (empty if it cannot be read).
    cpu_flags: those of `CPU_FLAGS` the host CPU has.
    cores: CPU cores this process may use.
    compute_capability: a CUDA GPU's compute capability ("8.0"), else None.
    matrix_dtypes: the narrow float dtypes the devices multiply natively
      (with float32 accumulation), fastest first; empty if none.
  """
  platform: str
  device_kind: str
  device_count: int
  cpu_model: str
  cpu_flags: tuple[str, ...]
  cores: int
  compute_capability: Optional[str]
  matrix_dtypes: tuple[str, ...]

  @property
  def bf16_units(self) -> bool:
    """Whether bfloat16 matmuls can run faster than float32 here."""
    return "bfloat16" in self.matrix_dtypes

  def headline(self) -> str:
    """One line: the device, and the CPU with its 16-bit instructions."""
    if self.platform == "cpu":
      units = " ".join(f for f in self.cpu_flags if f in ("avx512_bf16", "amx_bf16",
                                                          "amx_fp16", "avx512_fp16", "bf16"))
      isa = units or ("AVX2 only (no avx512_bf16, no AMX)" if "avx2" in self.cpu_flags
                      else "no 16-bit matrix instructions")
      return f"CPU: {self.cpu_model or 'unknown model'}, {self.cores} cores, {isa}"
    cc = f", compute capability {self.compute_capability}" if self.compute_capability else ""
    return f"{self.platform.upper()}: {self.device_count} × {self.device_kind}{cc}"

  def advice(self, measured: Optional[dict] = None) -> str:
    """What bf16, f16 and fp8 can buy here, in a few lines of plain text.

    Args:
      measured: optional `measure_matmuls` result; its ratios are quoted.
    """
    lines = [self.headline()]
    ratio = _ratio(measured, "bfloat16")
    if self.bf16_units:
      lines.append("bf16: native matrix units; bf16 compute should speed up "
                   "matmul-bound steps and halves activation memory.")
    elif self.platform == "cpu":
      lines.append("bf16: no bf16 matrix units; XLA converts bf16 matmuls to "
                   "float32, so bf16 steps are expected to be SLOWER than f32 "
                   "here. Mixed precision still halves activation and "
                   "parameter memory; for speed, use a CPU with avx512_bf16/AMX "
                   "or a GPU/TPU.")
    else:
      lines.append("bf16: not native on this device; prefer float16 with loss "
                   "scaling (policy 'O2-f16').")
    if ratio is not None:
      verdict = ("faster" if ratio < 0.9 else "slower" if ratio > 1.1
                 else "no faster")
      lines.append(f"      measured here: a bf16 matmul (f32 accumulation) takes "
                   f"{ratio:.2f}× the time of float32 ({verdict}).")
    if "float16" in self.matrix_dtypes:
      lines.append("f16: native; needs dynamic loss scaling (narrow range).")
    else:
      lines.append("f16: emulated here (slow); f16 runs check loss scaling, "
                   "not speed.")
    if any(d.startswith("float8") for d in self.matrix_dtypes):
      lines.append("fp8: native matrix units (twice the bf16 rate).")
    else:
      lines.append("fp8: no fp8 matrix units here; fp8 policies are emulated "
                   "(XLA multiplies the fp8 values in float32): they check "
                   "accuracy, not speed.")
    return "\n".join(lines)


def _ratio(measured: Optional[dict], dtype: str) -> Optional[float]:
  if not measured or dtype not in measured or "float32" not in measured:
    return None
  return measured["float32"] / measured[dtype]  # GFLOP/s: time ratio inverts


def _cpu_info() -> tuple[str, set[str]]:
  model, flags = "", set()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "Hardware") and not model:
          model = value.strip()
        elif key in ("flags", "Features") and not flags:
          flags = set(value.split())
  except OSError:  # not Linux: report what the standard library knows
    model = _platform.processor()
  return model, flags


def _matrix_dtypes(platform: str, capability: Optional[str],
                   flags: set[str]) -> tuple[str, ...]:
  if platform == "tpu":
    return ("bfloat16",)
  if platform == "gpu":
    major, _, minor = (capability or "").partition(".")
    if not (major.isdigit() and (minor or "0").isdigit()):
      # ROCm reports no capability or an architecture name ("gfx90a"): MI100
      # and newer have bf16 and f16 units.
      return ("bfloat16", "float16")
    version = (int(major), int(minor or 0))
    if version >= (8, 9):  # Ada, Hopper, Blackwell: fp8 tensor cores
      return ("float8_e4m3fn", "float8_e5m2", "bfloat16", "float16")
    if version >= (8, 0):
      return ("bfloat16", "float16")
    if version >= (7, 0):
      return ("float16",)
    return ()
  dtypes = []
  if flags & {"avx512_bf16", "amx_bf16", "bf16"}:
    dtypes.append("bfloat16")
  if flags & {"amx_fp16", "avx512_fp16"}:
    dtypes.append("float16")
  return tuple(dtypes)


def describe() -> Hardware:
  """Describes the default backend and the host CPU. Runs no computation."""
  devices = jax.devices()
  device = devices[0]
  capability = getattr(device, "compute_capability", None)
  capability = str(capability) if capability not in (None, "") else None
  model, flags = _cpu_info()
  cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
           else os.cpu_count() or 1)
  return Hardware(
      platform=device.platform, device_kind=device.device_kind,
      device_count=len(devices), cpu_model=model,
      cpu_flags=tuple(f for f in CPU_FLAGS if f in flags), cores=cores,
      compute_capability=capability,
      matrix_dtypes=_matrix_dtypes(device.platform, capability, flags))


def measure_matmuls(dtypes: Sequence[str] = ("float32", "bfloat16"),
                    size: int = 512, seconds: float = 0.2) -> dict[str, float]:
  """Times an (size × size) @ (size × size) matmul per dtype on the default device.

  Each dtype's operands are of that dtype and the product accumulates and is
  returned in float32 (`preferred_element_type`), as mixed-precision layers
  compute it. The dtypes are sampled in interleaved rounds (so a machine whose
  load drifts slows them alike) and each figure is the best sample, after a
  warm-up; one call costs about ``seconds`` plus one compile per dtype.

  Returns:
    GFLOP/s per dtype name.
  """
  names = [str(np.dtype(jnp.dtype(d))) for d in dtypes]
  dot = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
  operand = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
  operands = {n: operand.astype(n) for n in names}
  for x in operands.values():
    jax.block_until_ready(dot(x, x))
  rounds = 7
  sample = seconds / (rounds * len(names))
  best = {n: float("inf") for n in names}
  for r in range(rounds):
    for n in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
      x, calls, start = operands[n], 0, time.perf_counter()
      while True:
        jax.block_until_ready(dot(x, x))
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= sample:
          break
      best[n] = min(best[n], elapsed / calls)
  return {n: 2 * size ** 3 / best[n] / 1e9 for n in names}
