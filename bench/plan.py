"""The run's plan: which hardware class, what it can buy, how long it will take.

Before any section runs, `bench/run.py` uses this module to

* choose the plan: the default backend's platform ("cpu", "gpu", "tpu"), or
  the one forced by ``--assume-platform`` (with ``--dry-run``), and whether
  that hardware has bf16 matrix units (which decides the targets that apply);
* time a probe matmul per dtype (`jmp_lite.hardware.measure_matmuls`) and
  say what bf16, f16 and fp8 can buy here (`Hardware.advice`);
* estimate the run's duration: the wall times of the selected sections
  measured on a reference machine (`REFERENCE`), scaled by the ratio of the
  reference's probe float32 GFLOP/s to this machine's. Compilation and
  memory-bound sections do not scale with GFLOP/s exactly, and the load of a
  shared machine moves everything (the probe is a snapshot of it): the
  estimate is rough, within a factor of 2. There is no reference for GPUs
  yet: a GPU run says so and records its own durations.

To refresh `REFERENCE`: run ``python bench/run.py``, ``--quick`` and
``--dry-run`` on the reference machine and copy, for each, the "Durations"
table of the report (``sections.*.seconds`` in the JSON) with the run's probe
float32 figure (``meta.probe.gflops.float32``), and the time outside the
sections (``meta.wall_seconds - meta.seconds``), here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jmp_lite.hardware

from bench import harness

# Wall time (s) of each section on the reference machine, by size, each with
# the probe's float32 GFLOP/s measured at the start of the run it comes from
# (a size's sections may come from several runs), and the time outside the
# sections (interpreter start, imports, probe, report). Measured while other
# jobs kept the load average at 3-9 on the 2 cores. `compile_time`'s come from
# a 2-core EPYC of the same kind with avx512_bf16 (load average 4 for the full
# run; the full `guard` and `compile_time` from the same at load 2.5, after the
# guard's norm lost its branch); compilation and `guard` (memory-bound) do not
# scale with the probe's GFLOP/s, so their estimates are rougher still.
REFERENCE = {
    "machine": "a shared 2-core AVX2 EPYC",
    "platform": "cpu",
    "runs": {
        "full": {"startup_s": (5.7, 31.6), "seconds": {
            "all_finite": (140.0, 82.1), "matmul": (50.0, 82.1),
            "steps": (192.0, 82.1), "fused_clip": (92.0, 82.1),
            "guard": (111.6, 197.7), "compiles": (53.7, 31.6),
            "compile_time": (294.3, 197.7),
            "memory": (29.7, 31.6), "imports": (72.2, 31.6),
            "telemetry": (412.3, 80.9), "fp8": (38.5, 82.2)}},
        "quick": {"startup_s": (2.2, 58.9), "seconds": {
            "all_finite": (8.5, 58.9), "matmul": (4.9, 58.9),
            "steps": (60.7, 58.9), "fused_clip": (18.3, 58.9),
            "guard": (36.7, 58.9), "compiles": (13.9, 58.9),
            "compile_time": (108.7, 106.1),
            "memory": (18.1, 58.9), "imports": (13.0, 58.9),
            "telemetry": (60.0, 58.9), "fp8": (20.0, 82.1)}},
        "dry": {"startup_s": (4.1, 62.8), "seconds": {
            "all_finite": (4.0, 62.8), "matmul": (3.9, 62.8),
            "steps": (58.0, 62.8), "fused_clip": (3.0, 62.8),
            "guard": (10.0, 62.8), "compiles": (11.0, 62.8),
            "compile_time": (20.8, 106.3),
            "memory": (20.0, 62.8), "imports": (6.5, 62.8),
            "telemetry": (97.0, 80.9), "fp8": (15.1, 60.5)}},
    },
}

# Probe matmul edge by the platform that actually runs it (large enough to be
# compute-bound there, small enough to take a fraction of a second).
_PROBE_SIZE = {"cpu": 512, "gpu": 4096, "tpu": 4096}
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the run is planned for.

  Attributes:
    platform: "cpu", "gpu" or "tpu": sizes, variants and targets follow it.
    assumed: forced with ``--assume-platform`` rather than detected.
    bf16_units: the plan's hardware class has bf16 matrix units.
    device_platform: the platform that actually runs the sections.
    dry_run: tiny sizes, one round.
  """

  platform: str
  assumed: bool
  bf16_units: bool
  device_platform: str
  dry_run: bool

  def describe(self, scale: str) -> str:
    """One sentence; ``scale`` is "full", "quick" or "dry"."""
    how = ("forced with --assume-platform" if self.assumed else "detected")
    units = ("with bf16 matrix units: the bf16 speed targets apply"
             if self.bf16_units else
             "no bf16 matrix units: bf16 speed targets are reported as not "
             "applicable, memory, compilation and overhead targets apply")
    extra = []
    if self.platform == "gpu":
      extra.append("float32 baselines with and without TF32")
    if self.dry_run:
      extra.append(f"a dry run: tiny sizes and one round on the "
                   f"{self.device_platform.upper()} at hand, compiled with "
                   "jax_disable_most_optimizations, proving the code paths, "
                   "not measuring")
    return (f"{self.platform.upper()} ({how}), {units}"
            + "".join(f"; {e}" for e in extra)
            + ("" if self.dry_run else f"; {scale} sizes") + ".")


def make_plan(hw: jmp_lite.hardware.Hardware, assume: Optional[str],
              dry_run: bool) -> Plan:
  """The plan for ``hw``, or for the ``assume``d platform."""
  platform = assume or hw.platform
  assumed = platform != hw.platform
  if not assumed:
    bf16 = hw.bf16_units
  elif platform == "cpu":  # this host's CPU, from its flags
    bf16 = any(f in hw.cpu_flags for f in _BF16_FLAGS)
  else:  # a GPU plan is made for the GPUs mixed precision targets (≥ sm80)
    bf16 = True
  return Plan(platform=platform, assumed=assumed, bf16_units=bf16,
              device_platform=hw.platform, dry_run=dry_run)


def context(plan: Plan, *, quick: bool, repeats: Optional[int],
            seed: int) -> harness.Context:
  if plan.dry_run:
    return harness.Context(quick=quick, repeats=repeats or 1, min_sample_s=0.0,
                           seed=seed, dry_run=True, platform=plan.platform,
                           assumed=plan.assumed, bf16_units=plan.bf16_units,
                           warmup=1)
  return harness.Context(
      quick=quick, repeats=repeats or (5 if quick else 10),
      min_sample_s=0.005 if quick else 0.02, seed=seed, platform=plan.platform,
      assumed=plan.assumed, bf16_units=plan.bf16_units)


def probe(hw: jmp_lite.hardware.Hardware, dry_run: bool) -> dict:
  """GFLOP/s of one matmul per dtype on the device at hand."""
  dtypes = ["float32", "bfloat16"]
  if "float16" in hw.matrix_dtypes:
    dtypes.append("float16")
  size = _PROBE_SIZE.get(hw.platform, 512)
  gflops = jmp_lite.hardware.measure_matmuls(
      dtypes, size=size, seconds=0.05 if dry_run else 0.1)
  return {"size": size, "gflops": gflops}


def estimate(sections: Sequence[str], ctx: harness.Context, plan: Plan,
             measured: dict) -> dict:
  """Seconds per section, their total and a sentence saying how rough."""
  scale = ctx.size_key
  ref = REFERENCE["runs"].get(scale)
  if plan.device_platform != REFERENCE["platform"] or ref is None:
    return {"total": None, "sections": {}, "text": (
        f"no reference durations for {scale} sizes on "
        f"{plan.device_platform.upper()} yet (they were measured on "
        f"{REFERENCE['machine']}); this run's section wall times, in the "
        "report, can be recorded in bench/plan.py.")}
  probe_now = max(measured["gflops"]["float32"], 1e-6)

  def scaled(entry):  # (seconds, probe GFLOP/s then) -> seconds now
    seconds, probe_then = entry
    return seconds * probe_then / probe_now

  # A section without a reference (a new one) counts as the slowest one.
  default = max(ref["seconds"].values(), key=scaled)
  per = {s: scaled(ref["seconds"].get(s, default)) for s in sections}
  total = sum(per.values()) + scaled(ref["startup_s"])
  minutes = (f"{total / 60:.1f} min" if total >= 90 else f"{total:.0f} s")
  return {"total": total, "sections": per, "probe_f32_gflops": probe_now,
          "text": (
              f"about {minutes} expected (rough, within a factor of 2: wall "
              f"times measured on {REFERENCE['machine']}, scaled by its probe "
              f"float32 GFLOP/s over this machine's, {probe_now:.0f}; other "
              "processes' load moves both).")}
