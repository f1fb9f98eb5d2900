"""The benchmark runs on every plan: `bench/run.py --dry-run` for the CPU plan
and, forced with ``--assume-platform gpu``, for the GPU plan (its sizes, its
TF32 baseline and its targets), both on the CPU at hand.

The first dry run takes about a minute (compilation, mostly); the second
shares its persistent compilation cache (only the TF32 baseline's programs
are new), which cuts it to about 20 s. Everything in the bench still runs:
tracing, lowering, executing; only XLA's compile of an identical program is
skipped.
"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `bench` is a package at the repository root
  sys.path.insert(0, ROOT)

from bench import harness  # noqa: E402
from bench import machine  # noqa: E402
from bench import models  # noqa: E402
from bench import plan as plan_lib  # noqa: E402

# The heavy tier (the bench's dry run, section by section): `pytest -m slow`.
pytestmark = pytest.mark.slow

SECTIONS = ("all_finite", "matmul", "steps", "fused_clip", "guard", "compiles",
            "compile_time", "memory", "imports", "fp8")
ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\s*\d", re.IGNORECASE)
TF32_ROW = "| f32, TF32 allowed |"


def _start(out_dir, cache_dir, *flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             JAX_COMPILATION_CACHE_DIR=str(cache_dir),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  env.pop("XLA_FLAGS", None)  # e.g. a forced device count from another test
  return subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "bench", "run.py"), "--dry-run",
       "--out", str(out_dir), "--name", "report", *flags],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)


def _finish(proc, out_dir):
  try:
    stdout, stderr = proc.communicate(timeout=900)
  except subprocess.TimeoutExpired:
    proc.kill()
    stdout, stderr = proc.communicate()
  assert proc.returncode == 0, (
      f"bench/run.py {' '.join(proc.args[2:])} exited {proc.returncode}:\n"
      f"{stderr[-4000:]}")
  with open(os.path.join(out_dir, "report.md")) as f:
    md = f.read()
  with open(os.path.join(out_dir, "report.json")) as f:
    js = f.read()
  return md, json.loads(js), js, stderr


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
  """Both plans' dry runs, one after the other, sharing a compilation cache."""
  cache = tmp_path_factory.mktemp("jax-cache")
  flags = {"cpu": (), "gpu": ("--assume-platform", "gpu")}
  out = {}
  for plan, extra in flags.items():
    out_dir = tmp_path_factory.mktemp(f"dry-{plan}")
    out[plan] = _finish(_start(out_dir, cache, *extra), out_dir)
  return out


def _check_common(md, data, text, stderr, platform):
  meta = data["meta"]
  assert meta["plan"]["platform"] == platform
  assert meta["plan"]["dry_run"]
  for name in SECTIONS:
    assert name in meta["sections"]
    assert f"(`{name}`," in md, f"section {name} missing from the report"
    assert f"| `{name}` |" in md, f"section {name} missing from Durations"
    section = data["sections"][name]
    assert section["error"] is None, section["error"]
    assert section["seconds"] > 0
  # Targets name what they measure, not an issue number.
  for where, s in (("markdown", md), ("json", text)):
    assert not ISSUE_NUMBER.search(s), (where, ISSUE_NUMBER.search(s).group())
  # The notice comes before any section, on stderr and in the report.
  assert "What mixed precision can buy here" in md
  assert "bf16:" in md and "Duration:" in md
  first_section = stderr.index("[all_finite]")
  assert stderr.index("bf16:") < first_section
  assert stderr.index("Duration:") < first_section
  targets = [t for s in data["sections"].values() for t in s["targets"]]
  assert targets
  for t in targets:
    assert t["applies_to"]
    assert t["status"] in ("not applicable here", "not judged (dry run)"), t
  imports = data["sections"]["imports"]["targets"]
  assert imports[0]["value"] == 0, "import jmp_lite loaded flax or optax"
  return targets


def test_dry_runs_cpu_and_gpu_plans(dry_runs):
  import jmp_lite.hardware

  md, data, text, stderr = dry_runs["cpu"]
  targets = _check_common(md, data, text, stderr, "cpu")
  assert TF32_ROW not in md
  bf16_here = jmp_lite.hardware.describe().bf16_units
  bf16_targets = [t for t in targets if t["applies_to"] == harness.BF16_UNITS.name]
  assert bf16_targets
  for t in bf16_targets:
    assert t["applicable"] == bf16_here
  if not bf16_here:
    assert "not applicable here (no bf16 units): measured" in md

  md, data, text, stderr = dry_runs["gpu"]
  targets = _check_common(md, data, text, stderr, "gpu")
  plan = data["meta"]["plan"]
  assert plan["assumed"] and plan["bf16_units"] and plan["tf32_baseline"]
  # The TF32 baseline: a row in every workload's step table, traced with
  # TF32 allowed (its compiled float32 dots carry precision "high").
  assert md.count(TF32_ROW) == len(models.WORKLOADS)
  for line in md.splitlines():
    if line.startswith(TF32_ROW):
      assert "f32·f32→f32 (high)" in line, line
    if line.startswith("| f32 |"):
      assert "f32·f32→f32 (highest)" in line, line
  assert "vs f32 with TF32" in md and "f32 TF32 ms" in md
  # GPU hardware class: the bf16 speed targets apply.
  assert all(t["applicable"] for t in targets)


def test_assume_platform_needs_dry_run():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "bench", "run.py"),
       "--assume-platform", "gpu", "--only", "imports"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  assert "needs --dry-run" in proc.stderr


# In-process checks of the GPU-only branches a CPU cannot reach.


def test_gpu_matmuls_counted_in_census():
  hlo = """
ENTRY %main (a: f32[8,8], b: f32[8,8], c: bf16[8,8]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  %b = f32[8,8]{1,0} parameter(1)
  %c = bf16[8,8]{1,0} parameter(2)
  %custom-call.1 = (f32[8,8]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={}
  %custom-call.2 = (f32[8,8]{1,0}, s8[1024]{0}) custom-call(%c, %c), custom_call_target="__cublas$lt$matmul", backend_config={}
  ROOT %dot.3 = f32[8,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, operand_precision={high,high}
}
"""
  census = harness.dot_census(hlo)
  assert census == {("f32", "f32", "f32"): 1, ("bf16", "bf16", "f32"): 1,
                    ("f32", "f32", "f32 (high)"): 1}


def test_device_memory_bounds(monkeypatch):
  monkeypatch.setattr(machine, "device_memory_stats", lambda: None)
  monkeypatch.setattr(machine, "_mem_available", lambda: None)
  assert machine.bounded_bytes(2**30, 0.25) == 2**30
  assert machine.peak_device_memory() is None
  stats = {"bytes_limit": 2**32, "peak_bytes_in_use": 123}
  monkeypatch.setattr(machine, "device_memory_stats", lambda: stats)
  assert machine.bounded_bytes(2**31, 0.25) == 2**30
  assert machine.bounded_bytes(2**20, 0.25) == 2**20
  assert machine.peak_device_memory() == 123


def test_plan_sizes_and_targets():
  cpu = harness.Context(platform="cpu")
  gpu = harness.Context(platform="gpu", bf16_units=True)
  dry_gpu = harness.Context(platform="gpu", bf16_units=True, dry_run=True)
  sizes = dict(full=1, quick=2, dry=3, gpu=4, gpu_quick=5)
  assert cpu.pick(**sizes) == 1
  assert gpu.pick(**sizes) == 4
  assert harness.Context(platform="tpu", quick=True).pick(**sizes) == 5
  assert dry_gpu.pick(**sizes) == 3
  assert gpu.tf32 and not cpu.tf32

  def target():
    return harness.Target("bf16 step ≤ 0.5× f32", 0.9, 0.5, "<=",
                          applies_to=harness.BF16_UNITS)

  assert target().resolve(cpu).status == "not applicable here"
  assert target().resolve(cpu).describe().startswith(
      "not applicable here (no bf16 units): measured 0.9×")
  assert target().resolve(gpu).status == "MISS"
  assert target().resolve(dry_gpu).status == "not judged (dry run)"
  zero = harness.Target("loads nothing", 0.0, 0, "<=", unit=" modules")
  assert zero.resolve(cpu).status == "PASS" and zero.margin is None


def test_forced_gpu_plan_has_bf16_units():
  import jmp_lite.hardware

  hw = jmp_lite.hardware.describe()
  plan = plan_lib.make_plan(hw, "gpu", dry_run=True)
  assert plan.platform == "gpu" and plan.bf16_units
  assert plan.assumed == (hw.platform != "gpu")
  assert plan_lib.make_plan(hw, None, dry_run=False).platform == hw.platform


def test_the_gpu_script_records_the_device_and_splits_the_bench(tmp_path):
  """`bench/gpu.sh` on the machine at hand: its info part runs and records
  itself, an unknown part is refused, and the section names it splits come
  first on each line of ``run.py --list``."""
  script = os.path.join(ROOT, "bench", "gpu.sh")
  env = dict(os.environ, GPU_RESULTS=str(tmp_path), PYTHON=sys.executable,
             JAX_PLATFORMS="cpu")
  proc = subprocess.run(["bash", script, "info"], env=env, capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert (tmp_path / "status.txt").read_text().split()[:2] == ["info", "0"]
  log = (tmp_path / "info.log").read_text()
  assert "jax" in log and "backend cpu" in log
  bad = subprocess.run(["bash", script, "nonsense"], env=env, capture_output=True,
                       text=True, timeout=300, check=False)
  assert bad.returncode == 2 and "unknown part" in bad.stderr
  # The split the script makes of `run.py --list`, done here the same way.
  listed = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run.py"), "--list"],
                          capture_output=True, text=True, timeout=300, check=True,
                          env=env).stdout.split("\n")
  names = [line.split()[0] for line in listed if line.strip()]
  assert set(SECTIONS) <= set(names)


def test_kernel_counts_count_identical_fused_computations_once():
  """XLA compiles one kernel for fused computations that differ only in names;
  the compile section's distinct-kernel column counts them so."""
  import jax
  import jax.numpy as jnp
  from bench.sections.compile_time import kernel_counts
  x = jnp.ones(8)
  same = jax.jit(lambda a, b: (jnp.sin(a) * 2 + 1, jnp.sin(b) * 2 + 1))
  other = jax.jit(lambda a, b: (jnp.sin(a) * 2 + 1, jnp.cos(b) * 3))
  assert kernel_counts(same.lower(x, x).compile().as_text()) == (2, 1)
  assert kernel_counts(other.lower(x, x).compile().as_text()) == (2, 2)
