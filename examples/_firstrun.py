"""What the examples print before and after training.

Before: the machine, what bf16/f16 can buy on it (bf16 matrix units or not:
on an AVX2-only CPU bf16 steps are *slower* than f32), and a rough estimate of
how long the run will take. The estimate scales timings measured on a
reference machine by this machine's measured matmul speed in each compute
dtype; it is rough (small models are bound by dispatch, not by matmuls), but
it tells a minute from ten.

After: a plain-text table and where the full results went.

Only the standard library is imported here at import time, so an example can
import this module before JAX loads.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from typing import Mapping, Sequence

# The machine the examples' reference timings come from, and its
# `jmp_lite.hardware.measure_matmuls(("float32", "bfloat16", "float16"))`.
REFERENCE_MACHINE = "2-core AMD EPYC, AVX2 only (no avx512_bf16, no AMX), JAX 0.10.2"
REFERENCE_GFLOPS = {"float32": 173.0, "bfloat16": 105.0, "float16": 160.0}


def _compute_dtype(policy_name: str) -> str:
  if "bf16" in policy_name or "fp8" in policy_name:  # fp8 rows compute in bf16
    return "bfloat16"
  if "f16" in policy_name:
    return "float16"
  return "float32"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """``--help`` shows each flag's default; switches that are off say nothing."""

  def _get_help_string(self, action):
    if any(action.default is v for v in (None, False, argparse.SUPPRESS)):
      return action.help
    return super()._get_help_string(action)


# The PyPI names of the optional modules the examples import.
_DISTRIBUTIONS = {"sklearn": "scikit-learn", "tqdm": "tqdm", "matplotlib": "matplotlib"}


def require(*modules: str) -> None:
  """Exits naming the extra to install if one of ``modules`` is missing.

  The examples' data (scikit-learn's digits), progress bars and plots come
  from the ``examples`` extra, which ``pip install -e .`` alone does not
  install.
  """
  missing = [_DISTRIBUTIONS.get(m, m) for m in modules
             if importlib.util.find_spec(m) is None]
  if missing:
    sys.exit(f"{os.path.basename(sys.argv[0]) or 'this example'} needs "
             f"{' and '.join(missing)}, which the project's `examples` extra "
             "installs: pip install -e \".[examples]\" (from the repository root)")


# The --policies help of the examples that compare these three.
THREE_POLICIES = ("comma-separated: f32 (float32), bf16 (bf16 compute, f32 "
                  "params), f16 (f16 compute, f32 params, dynamic loss scale)")


def policy_names(parser, value: str, known) -> list[str]:
  """The names in a --policies value; exits through `parser.error` if unknown."""
  names = [n.strip() for n in value.split(",") if n.strip()]
  unknown = [n for n in names if n not in known]
  if unknown or not names:
    parser.error(f"unknown policies {unknown}; choose from {', '.join(known)}")
  return names


def add_training_arguments(parser, *, steps: int, steps_help: str, batch_size: int,
                           batch_help: str, lr: float, seed_help: str,
                           corpus_bytes: int, corpus_help: str) -> None:
  """The flags every text example shares: steps, batch, learning rate, seed, corpus."""
  parser.add_argument("--steps", type=int, default=steps, help=steps_help)
  parser.add_argument("--batch-size", type=int, default=batch_size, help=batch_help)
  parser.add_argument("--lr", type=float, default=lr,
                      help="AdamW's peak learning rate (warm-up, then cosine decay)")
  parser.add_argument("--seed", type=int, default=0, help=seed_help)
  parser.add_argument("--corpus-bytes", type=int, default=corpus_bytes, help=corpus_help)


def add_precision_arguments(parser, *, telemetry_every: int) -> None:
  """The f16 flags the examples share: calibration and precision telemetry."""
  parser.add_argument("--no-calibrate", action="store_true",
                      help="start f16 runs' loss scale at 2**15 instead of measuring "
                           "it (jmp_lite.calibrate) on the first batch")
  parser.add_argument("--telemetry-every", type=int, default=telemetry_every,
                      help="measure every module's values and cotangents in f16 runs "
                           "every N steps (jmp_lite.Telemetry) and print the last "
                           "table; 0: off")


# How often an underflow-aware loss scale's run measures its cotangents.
UNDERFLOW_EVERY = 10


def f16_start(policy, args, f32_loss, params, *batch, kind="dynamic"):
  """An f16 run's loss scale (calibrated unless --no-calibrate) and telemetry.

  Returns ``(loss_scale, calibration or None, telemetry or None)``; for
  other compute dtypes no scaling and no telemetry. ``kind``: ``"dynamic"``
  (`jmp_lite.DynamicLossScale`, period 200), ``"underflow"``
  (`jmp_lite.UnderflowAwareLossScale`, period 200, with telemetry every
  `UNDERFLOW_EVERY` steps to feed it) or ``"automatic"``
  (`jmp_lite.AutomaticLossScale` with its defaults, telemetry every step).
  """
  import jax  # after argument parsing
  import jax.numpy as jnp
  import jmp_lite

  if policy.compute_dtype != jnp.float16:
    return jmp_lite.NoOpLossScale(), None, None
  every = {"underflow": UNDERFLOW_EVERY, "automatic": 1}.get(kind, args.telemetry_every)
  telemetry = jmp_lite.Telemetry(every=every) if every > 0 else None
  make = {"dynamic": lambda s: jmp_lite.DynamicLossScale(s, period=200),
          "underflow": lambda s: jmp_lite.UnderflowAwareLossScale(s, period=200),
          "automatic": jmp_lite.AutomaticLossScale}[kind]
  if args.no_calibrate:
    return make(2.0 ** 15), None, telemetry
  # The start is measured on the first batch (one float32 pass of the
  # unwrapped model) rather than found by skipping steps from 2**15.
  params32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  calibrated = jmp_lite.calibrate(f32_loss, params32, *batch, policy=policy)
  return make(calibrated.loss_scale), calibrated, telemetry


def print_telemetry(name: str, step: int, stats) -> None:
  """The last sampled telemetry table of a run."""
  if stats is None:
    return
  print(f"\n{name}: precision telemetry at step {step} (jmp_lite.Telemetry; "
        "max |x|, non-finite count, share of non-zero values below the dtype's "
        "smallest normal; backward = scaled cotangents)")
  print(stats.table())


CHAR_LM_CORPUS = "bytes of standard-library source to read (90%% train, 10%% validation)"


def announce(timings: Mapping[str, tuple[float, float]], policies: Sequence[str],
             steps: int, *, what: str = "training", other_s: float = 0.0,
             reference: tuple[str, Mapping[str, float]] = (
                 REFERENCE_MACHINE, REFERENCE_GFLOPS)) -> dict:
  """Prints the hardware notice and a time estimate; returns the probe's figures.

  Args:
    timings: per policy name, (seconds to compile, milliseconds per step)
      measured with the example's defaults on the reference machine.
    policies: the policies about to run (names of `timings`).
    steps: training steps per policy.
    what: what the estimate covers.
    other_s: seconds per policy outside the training steps (evaluation,
      calibration, their compilations), measured on this project's machines;
      when given, the estimate also says how long the run takes in all.
    reference: the machine ``timings`` were measured on, and its matmul
      GFLOP/s per compute dtype (`jmp_lite.hardware.measure_matmuls`):
      `REFERENCE_MACHINE` unless an example measured elsewhere.
  """
  import jmp_lite.hardware  # imports JAX: after argument parsing

  global _ANNOUNCED
  started = _ANNOUNCED = time.perf_counter()
  hardware = jmp_lite.hardware.describe()
  dtypes = sorted({_compute_dtype(p) for p in policies} | {"float32"})
  measured = jmp_lite.hardware.measure_matmuls(dtypes, seconds=0.15)
  total = 0.0
  for name in policies:
    compile_s, step_ms = timings.get(name, max(timings.values()))
    dtype = _compute_dtype(name)
    # Slower matmuls here than on the reference: proportionally longer steps.
    # A floor of 1 ms a step: dispatch and host work do not shrink on a GPU.
    scale = reference[1][dtype] / measured[dtype]
    total += compile_s + steps * max(step_ms * scale, 1.0) / 1e3
  print(hardware.advice(measured))
  busy = _busy()
  if busy:
    print(busy)
  in_all = f", about {_duration(total + other_s * len(policies))} in all" if other_s else ""
  print(f"Estimated {what} time here: about {_duration(total)}{in_all} "
        f"({len(policies)} {'policy' if len(policies) == 1 else 'policies'} × "
        f"{steps} steps; rough: timings from {reference[0]}, scaled by "
        f"this machine's {'/'.join(_short(d) for d in dtypes)} matmul speed, "
        f"measured in {time.perf_counter() - started:.1f} s).\n", flush=True)
  import jax
  return {"hardware": hardware.headline(), "matmul_gflops": measured,
          "estimated_seconds": round(total, 1),
          "estimated_seconds_in_all": round(total + other_s * len(policies), 1),
          "jax": jax.__version__,
          "load_average_start": _load_average()}


# When `announce` started: `write_summary` records the seconds since, the run
# the estimate is for, so that each summary holds both.
_ANNOUNCED = None


def _short(dtype: str) -> str:
  return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(dtype, dtype)


def _load_average():
  """The 1-, 5- and 15-minute load averages, or None where unknown."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


def _busy() -> str:
  """A warning when other work shares the cores (load above the core count)."""
  loads = _load_average()
  if loads is None:  # not available on this platform
    return ""
  load = loads[0]
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  if load <= (cores or 1):
    return ""
  return (f"This machine is busy: load average {load:.1f} on {cores} cores. Other "
          "processes share the CPU, so the run will take longer than estimated.")


def _duration(seconds: float) -> str:
  if seconds < 90:
    return f"{max(5, round(seconds / 5) * 5):.0f} s"
  return f"{seconds / 60:.0f} min"


def table(header: Sequence[str], rows: Sequence[Sequence], file=None) -> None:
  """Prints rows under a header, each column as wide as its widest cell."""
  cells = [list(map(str, header))] + [[_cell(v) for v in row] for row in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
  for i, row in enumerate(cells):
    print("  ".join(c.rjust(w) if j else c.ljust(w)
                    for j, (c, w) in enumerate(zip(row, widths))), file=file or sys.stdout)
    if i == 0:
      print("  ".join("-" * w for w in widths), file=file or sys.stdout)


def _cell(value) -> str:
  if isinstance(value, float):
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
  return str(value)


def write_summary(out_dir, summary: dict) -> str:
  """Writes ``summary`` to ``out_dir/summary.json`` and prints where it went."""
  os.makedirs(out_dir, exist_ok=True)
  # Times depend on what else ran: the load at the end beside the start's.
  summary = {**summary, "load_average_end": _load_average()}
  if _ANNOUNCED is not None and "estimated_seconds" in summary:
    # What the estimate "in all" covers: from the notice to the summary.
    summary["measured_seconds"] = round(time.perf_counter() - _ANNOUNCED, 1)
  path = os.path.join(out_dir, "summary.json")
  with open(path, "w") as f:
    json.dump(summary, f, indent=2)
  print(f"all results: {path}")
  return path
