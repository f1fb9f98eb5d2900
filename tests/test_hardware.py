"""jmp_lite.hardware: what the machine has, read from JAX and /proc/cpuinfo."""

import dataclasses
import pathlib

import jax
import pytest

import jmp_lite
from jmp_lite import hardware


def _cpuinfo_flags():
  path = pathlib.Path("/proc/cpuinfo")
  if not path.exists():
    pytest.skip("no /proc/cpuinfo")
  for line in path.read_text().splitlines():
    key, _, value = line.partition(":")
    if key.strip() in ("flags", "Features"):
      return set(value.split())
  pytest.skip("/proc/cpuinfo lists no flags")


def test_describe_matches_jax_and_the_kernel():
  hw = hardware.describe()
  assert hw.platform == jax.default_backend()
  assert hw.device_count == len(jax.devices())
  assert hw.device_kind == jax.devices()[0].device_kind
  flags = _cpuinfo_flags()
  assert set(hw.cpu_flags) == flags & set(hardware.CPU_FLAGS)
  if hw.platform == "cpu":
    has_bf16 = bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    assert hw.bf16_units == has_bf16
    assert ("SLOWER" in hw.advice()) == (not has_bf16)


def test_describe_is_a_frozen_value():
  hw = hardware.describe()
  assert hw == hardware.describe() and hash(hw) == hash(hardware.describe())
  with pytest.raises(dataclasses.FrozenInstanceError):
    hw.platform = "tpu"


def test_lazy_attribute_of_the_package():
  assert jmp_lite.hardware is hardware


@pytest.mark.parametrize("platform, capability, flags, expected", [
    # NVIDIA: V100 (7.0) has float16 tensor cores only; A100 (8.0) adds
    # bfloat16; L4/H100 (8.9/9.0) add fp8.
    ("gpu", "7.0", set(), ("float16",)),
    ("gpu", "7.5", set(), ("float16",)),
    ("gpu", "8.0", set(), ("bfloat16", "float16")),
    ("gpu", "8.6", set(), ("bfloat16", "float16")),
    ("gpu", "8.9", set(), ("float8_e4m3fn", "float8_e5m2", "bfloat16", "float16")),
    ("gpu", "9.0", set(), ("float8_e4m3fn", "float8_e5m2", "bfloat16", "float16")),
    ("gpu", "6.1", set(), ()),
    ("gpu", None, set(), ("bfloat16", "float16")),  # ROCm reports none...
    ("gpu", "gfx90a", set(), ("bfloat16", "float16")),  # ...or its architecture
    ("tpu", None, set(), ("bfloat16",)),
    ("cpu", None, {"avx2", "fma"}, ()),
    ("cpu", None, {"avx2", "avx512f", "avx512_bf16"}, ("bfloat16",)),
    ("cpu", None, {"amx_tile", "amx_bf16", "amx_fp16"}, ("bfloat16", "float16")),
    ("cpu", None, {"asimdhp", "bf16"}, ("bfloat16",)),
])
def test_matrix_dtypes_by_device_class(platform, capability, flags, expected):
  assert hardware._matrix_dtypes(platform, capability, flags) == expected


def _fake(**changes):
  base = hardware.Hardware(
      platform="cpu", device_kind="cpu", device_count=1, cpu_model="Test CPU",
      cpu_flags=("avx2", "fma"), cores=2, compute_capability=None, matrix_dtypes=())
  return dataclasses.replace(base, **changes)


def test_advice_per_class():
  avx2 = _fake()
  assert "AVX2 only" in avx2.headline() and "SLOWER" in avx2.advice()
  assert "emulated" in avx2.advice()
  amx = _fake(cpu_flags=("avx2", "amx_tile", "amx_bf16"), matrix_dtypes=("bfloat16",))
  assert "amx_bf16" in amx.headline() and "native matrix units" in amx.advice()
  v100 = _fake(platform="gpu", device_kind="Tesla V100", compute_capability="7.0",
               matrix_dtypes=("float16",))
  assert "O2-f16" in v100.advice() and "f16: native" in v100.advice()
  h100 = _fake(platform="gpu", device_kind="H100", compute_capability="9.0",
               matrix_dtypes=("float8_e4m3fn", "float8_e5m2", "bfloat16", "float16"))
  assert "fp8: native" in h100.advice() and "GPU: 1 × H100" in h100.headline()


def test_advice_quotes_a_measurement():
  measured = {"float32": 100.0, "bfloat16": 60.0}
  assert "1.67× the time of float32 (slower)" in _fake().advice(measured)
  measured = {"float32": 100.0, "bfloat16": 160.0}
  assert "0.62× the time of float32 (faster)" in _fake().advice(measured)


def test_measure_matmuls():
  measured = hardware.measure_matmuls(("float32", jax.numpy.bfloat16), size=64,
                                      seconds=0.02)
  assert set(measured) == {"float32", "bfloat16"}
  assert all(v > 0 for v in measured.values())
