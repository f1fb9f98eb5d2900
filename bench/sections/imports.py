"""What importing jmp_lite costs a plain-JAX user, in fresh interpreters."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from bench import harness
from bench.harness import Column, SectionResult, Table, Target

NAME = "imports"
TITLE = "Import time"
DESCRIPTION = (
    "`import jax`, `import jmp_lite`, `import jmp_lite.flax` and `import "
    "jmp_lite.optax`, each in a fresh Python subprocess (the time of the "
    "import statement itself, measured inside the subprocess, without the "
    "interpreter's start-up), in interleaved rounds whose order rotates "
    "(`--repeats`, at most 3 with `--quick`); each figure is the median over "
    "rounds, after one untimed round that warms the file cache (not with "
    "`--quick`). Differences to `import jax` are medians of the per-round "
    "differences, each between two imports run one after the other, which "
    "cancels most of the drift of a shared machine's load. The subprocess "
    "also reports whether Flax and optax "
    "were loaded, and which top-level packages the import brought in beyond "
    "those of `import jax`. Targets, on all hardware: `import jmp_lite` "
    "loads neither Flax nor optax (they are imported by `jmp_lite.flax` and "
    "`jmp_lite.optax` on first use), and costs at most 0.25 s more than "
    "`import jax` (about a third of `import jax` on a 2-core CPU: a plain-JAX "
    "user should not notice it; Flax alone takes longer than that).")

MODULES = ("jax", "jmp_lite", "jmp_lite.flax", "jmp_lite.optax")
BUDGET_S = 0.25

_SCRIPT = """
import json, sys, time
start = time.perf_counter()
import {module}
seconds = time.perf_counter() - start
print(json.dumps({{
    "seconds": seconds,
    "flax": "flax" in sys.modules, "optax": "optax" in sys.modules,
    "packages": sorted({{m.split(".")[0] for m in sys.modules}}),
}}))
"""

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def import_once(module: str) -> dict:
  """Imports ``module`` in a fresh interpreter; its report as a dict."""
  proc = subprocess.run(
      [sys.executable, "-c", _SCRIPT.format(module=module)], cwd=_ROOT,
      capture_output=True, text=True, timeout=300, env=dict(os.environ))
  if proc.returncode != 0:
    raise RuntimeError(f"import {module} failed:\n{proc.stderr[-2000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def run(ctx: harness.Context) -> SectionResult:
  reports: dict[str, list[dict]] = {m: [] for m in MODULES}
  rounds = ctx.pick(full=ctx.repeats, quick=min(ctx.repeats, 3), dry=1)
  for module in ctx.pick(full=MODULES, quick=(), dry=()):  # warm-up, untimed
    import_once(module)
  for r in range(rounds):
    shift = r % len(MODULES)
    for module in MODULES[shift:] + MODULES[:shift]:
      reports[module].append(import_once(module))
  timings = {m: harness.Timing(tuple(x["seconds"] for x in reports[m]), 1)
             for m in MODULES}
  jax_s = timings["jax"].median
  extra_s = {m: statistics.median(a["seconds"] - b["seconds"] for a, b in
                                  zip(reports[m], reports["jax"]))
             for m in MODULES}
  jax_packages = set(reports["jax"][0]["packages"])
  table = Table(
      f"Import time in a fresh interpreter (median of {rounds} rounds)",
      [Column("module", "statement"), Column("s", "seconds", "{:.3f}"),
       Column("extra", "− import jax (s)", "{:+.3f}"),
       Column("flax", "Flax loaded"), Column("optax", "optax loaded"),
       Column("packages", "top-level packages beyond jax's"),
       Column("spread", "spread", "pct")])
  for m in MODULES:
    last = reports[m][-1]
    extra_packages = sorted(set(last["packages"]) - jax_packages)
    table.add(module=f"import {m}", s=timings[m].median,
              extra=extra_s[m],
              flax="yes" if last["flax"] else "no",
              optax="yes" if last["optax"] else "no",
              packages=", ".join(extra_packages) or "none",
              spread=timings[m].spread)
  table.notes.append(
      "The subprocesses inherit this process's environment (JAX_PLATFORMS, "
      "XLA_FLAGS); importing JAX does not initialise a backend.")
  result = SectionResult(tables=[table])
  loaded = [name for name in ("flax", "optax")
            if any(x[name] for x in reports["jmp_lite"])]
  result.targets.append(Target(
      "`import jmp_lite` loads neither flax nor optax", float(len(loaded)), 0,
      "<=", unit=" of them"))
  result.targets.append(Target(
      f"`import jmp_lite` costs ≤ `import jax` + {BUDGET_S} s",
      extra_s["jmp_lite"], BUDGET_S, "<=", unit=" s"))
  if loaded:
    result.notes.append(f"`import jmp_lite` loaded: {', '.join(loaded)}.")
  result.data = {
      "timings": timings, "loaded_by_jmp_lite": loaded, "extra_s": extra_s,
      "import_jax_s": jax_s,
      "median_s": {m: statistics.median(x["seconds"] for x in reports[m])
                   for m in MODULES}}
  return result
