"""The benchmark harness: timing, result tables, hardware facts, HLO checks.

Sections (``bench/sections/*.py``) use four things from here:

* `measure`: times several alternatives *interleaved* in one process (round
  ``r`` runs every alternative once, in a rotating order), after a warm-up that
  compiles them, and returns the median per alternative. On a shared 2-core
  machine the load drifts; interleaving exposes every alternative to the same
  drift, so the ratios stay meaningful even when absolute times move.
* `Table`, `Target` and `SectionResult`: what a section returns; `bench.report`
  renders them. A `Target` names what it measures and the
  `HardwareClass` it applies to; outside that class it is reported as "not
  applicable here" with the measured value, never as a miss.
* `Context.pick`: the size of a section for this run's plan (CPU or GPU/TPU
  sizes; ``--quick``; ``--dry-run``'s tiny sizes).
* `dot_census`: the operand dtypes of every dot in a compiled XLA program,
  which shows where a "bf16" matmul was silently run in float32.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import sys
import time
from collections import Counter
from typing import Any, Callable, Mapping, Optional

import jax
import numpy as np


# ---------------------------------------------------------------------------
# Run context


@dataclasses.dataclass(frozen=True)
class Context:
  """What every section gets: the run's options and its plan.

  Attributes:
    quick: small sizes, for a smoke run.
    repeats: timed rounds per alternative (each figure is their median).
    min_sample_s: a timed sample repeats the call until it lasts this long, so
      that sub-millisecond calls are not dominated by timer resolution.
    seed: PRNG seed for all generated data.
    dry_run: tiny sizes and one round: proves the plan's code paths run, its
      figures mean nothing.
    platform: the platform the plan is made for ("cpu", "gpu" or "tpu"): the
      default backend's, or the one forced with ``--assume-platform``.
    assumed: whether ``platform`` was forced rather than detected.
    bf16_units: whether the plan's hardware has bf16 matrix units (decides
      which targets apply, see `HardwareClass`).
    warmup: untimed calls before timing (`measure`).
  """

  quick: bool = False
  repeats: int = 10
  min_sample_s: float = 0.02
  seed: int = 0
  dry_run: bool = False
  platform: str = "cpu"
  assumed: bool = False
  bf16_units: bool = False
  warmup: int = 2

  @property
  def accelerator(self) -> bool:
    """GPU or TPU plan: larger sizes, device memory bounds."""
    return self.platform in ("gpu", "tpu")

  @property
  def tf32(self) -> bool:
    """Whether the plan adds a float32 baseline with TF32 allowed (GPUs)."""
    return self.platform == "gpu"

  @property
  def size_key(self) -> str:
    """"dry", "quick", "full", "gpu_quick" or "gpu" (GPU and TPU plans)."""
    if self.dry_run:
      return "dry"
    base = "quick" if self.quick else "full"
    if self.accelerator:
      return "gpu_quick" if self.quick else "gpu"
    return base

  def pick(self, *, full: Any, quick: Any, dry: Any, gpu: Any = None,
           gpu_quick: Any = None) -> Any:
    """The size for this run: ``full``/``quick`` on a CPU plan, ``gpu``/
    ``gpu_quick`` on a GPU or TPU plan (falling back to the CPU sizes), ``dry``
    for ``--dry-run`` whatever the plan.

    Every argument is evaluated whatever the plan, so the code computing the
    GPU sizes (e.g. `bounded_bytes`) runs in every dry run.
    """
    sizes = {"full": full, "quick": quick, "dry": dry,
             "gpu": full if gpu is None else gpu,
             "gpu_quick": quick if gpu_quick is None else gpu_quick}
    return sizes[self.size_key]

  def log(self, *msg: Any) -> None:
    print("  ", *msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Timing


@dataclasses.dataclass(frozen=True)
class Timing:
  """Seconds per call of one alternative, over ``len(samples)`` rounds."""

  samples: tuple[float, ...]
  number: int  # calls per sample

  @property
  def median(self) -> float:
    return statistics.median(self.samples)

  @property
  def q1(self) -> float:
    return float(np.percentile(self.samples, 25))

  @property
  def q3(self) -> float:
    return float(np.percentile(self.samples, 75))

  @property
  def spread(self) -> float:
    """Interquartile range relative to the median (0.05 = +-2.5%)."""
    return (self.q3 - self.q1) / self.median if self.median else 0.0

  def to_json(self) -> dict:
    return {"median_s": self.median, "q1_s": self.q1, "q3_s": self.q3,
            "min_s": min(self.samples), "rounds": len(self.samples),
            "calls_per_sample": self.number}


def block(x: Any) -> Any:
  """Waits until every array in ``x`` is computed."""
  return jax.block_until_ready(x)


def _run(fn: Callable[[], Any], number: int) -> float:
  start = time.perf_counter()
  for _ in range(number):
    block(fn())
  return (time.perf_counter() - start) / number


def measure(fns: Mapping[str, Callable[[], Any]], ctx: Context, *,
            repeats: Optional[int] = None,
            warmup: Optional[int] = None) -> dict[str, Timing]:
  """Times zero-argument callables side by side; returns seconds per call.

  Each callable is called ``warmup`` times first (compilation, allocator
  warm-up), then calibrated so that one sample lasts at least
  ``ctx.min_sample_s``. Then, for each of ``repeats`` rounds, every callable
  is sampled once, the order rotating by one each round so that none is
  always first after a pause. A callable may carry state (a train step that
  feeds its output back in), so it is called, never cloned.

  Args:
    fns: name -> zero-argument callable returning arrays to block on.
    ctx: the run context (repeats, minimum sample time).
    repeats: overrides ``ctx.repeats``.
    warmup: untimed calls before calibration (default ``ctx.warmup``).

  Returns:
    name -> `Timing`.
  """
  repeats = repeats or ctx.repeats
  warmup = ctx.warmup if warmup is None else warmup
  names = list(fns)
  number = {}
  for name in names:
    for _ in range(warmup):
      block(fns[name]())
    one = _run(fns[name], 1)
    number[name] = max(1, int(np.ceil(ctx.min_sample_s / max(one, 1e-9))))
  samples: dict[str, list[float]] = {name: [] for name in names}
  for r in range(repeats):
    shift = r % len(names)
    for name in names[shift:] + names[:shift]:
      samples[name].append(_run(fns[name], number[name]))
  return {name: Timing(tuple(samples[name]), number[name]) for name in names}


def tree_bytes(tree: Any) -> int:
  """Total bytes of the array leaves of ``tree`` (shape x itemsize)."""
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype"))


# ---------------------------------------------------------------------------
# HLO inspection


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\w+)\[")
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%[\w.\-]+\s*\((.*)\)\s*->.*\{\s*$")
_PARAM = re.compile(r"([\w.\-]+):\s*(\w+)\[")
_DOT = re.compile(r"=\s*(\w+)\[[^\]]*\]\S*\s+dot\(%([\w.\-]+),\s*%([\w.\-]+)\)")
# A GPU matmul that XLA hands to cuBLAS / cuBLASLt / hipBLASLt: a custom call
# whose output is a tuple (result, workspace) or the result alone.
_GEMM_CALL = re.compile(
    r"=\s*\(?(\w+)\[[^\]]*\]\S*.*?\scustom-call\(%([\w.\-]+),\s*%([\w.\-]+)"
    r".*custom_call_target=\"([^\"]*(?:gemm|[Mm]atmul)[^\"]*)\"")
_PRECISION = re.compile(r"operand_precision=\{(\w+),(\w+)\}")


def dot_list(hlo_text: str) -> list[tuple[str, str, str, str]]:
  """Every matmul of a compiled HLO module: ``(lhs, rhs, out dtype, instruction)``.

  Matmuls are ``dot`` instructions (XLA:CPU; inside fusions on GPUs, e.g.
  Triton GEMMs) and custom calls to a BLAS library (cuBLAS on GPUs). A dot
  carrying a non-default ``operand_precision`` gets it appended to its output
  dtype (``"f32 (high)"``: TF32 allowed; ``"f32 (highest)"``: full float32).
  """
  dots = []
  types: dict[str, str] = {}
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header:  # A new computation: operand names are scoped to it.
      types = dict(_PARAM.findall(header.group(1)))
      continue
    instr = _INSTR.match(line)
    if instr:
      types[instr.group(1)] = instr.group(2)
    dot = _DOT.search(line) or _GEMM_CALL.search(line)
    if dot:
      text = re.sub(r",\s*metadata=.*", "", line.strip())
      out = dot.group(1)
      precision = _PRECISION.search(line)
      if precision and precision.group(1) != "default":
        out = f"{out} ({precision.group(1)})"
      dots.append((types.get(dot.group(2), "?"), types.get(dot.group(3), "?"),
                   out, text))
  return dots


def dot_census(hlo_text: str) -> Counter:
  """Counts the matmuls of a compiled HLO module by ``(lhs, rhs, out)`` dtypes.

  On XLA:CPU a bf16 x bf16 dot that the fast bf16 kernels cannot take (for
  example one contracting the leading dimension of its left operand, the
  weight-gradient layout) is rewritten into converts plus an f32 x f32 dot; the
  census makes that visible: ``{("bf16", "bf16", "f32"): 4, ("f32", "f32",
  "f32"): 4}``. On a GPU it counts the dots and the cuBLAS calls alike.
  """
  return Counter((a, b, o) for a, b, o, _ in dot_list(hlo_text))


def format_census(census: Counter) -> str:
  """``"6 bf16·bf16→f32, 2 f32·f32→f32"``, most frequent first."""
  return ", ".join(f"{n} {a}·{b}→{o}" for (a, b, o), n in census.most_common())


def compiled_text(jitted: Callable, *args: Any) -> str:
  """The optimised HLO of ``jitted`` for these arguments (compiles once more)."""
  return jitted.lower(*args).compile().as_text()


# ---------------------------------------------------------------------------
# Results


@dataclasses.dataclass
class Column:
  key: str
  label: str
  fmt: str = "{}"  # a format string, or "ms", "ratio", "gbs", "bytes"

  def render(self, value: Any) -> str:
    if value is None:
      return "–"
    if isinstance(value, str):
      return value
    if self.fmt == "ms":
      return f"{value * 1e3:.3g}" if value < 1e-3 else f"{value * 1e3:.2f}"
    if self.fmt == "ratio":
      return f"{value:.2f}×" if value >= 0.1 else f"{value:.3f}×"
    if self.fmt == "gbs":
      return f"{value:.1f}"
    if self.fmt == "bytes":
      return human_bytes(value)
    if self.fmt == "pct":
      return f"±{value * 50:.0f}%"  # half the IQR, relative to the median
    return self.fmt.format(value)


@dataclasses.dataclass
class Table:
  """A result table: JSON gets ``rows`` raw, markdown gets them formatted."""

  title: str
  columns: list[Column]
  rows: list[dict] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)

  def add(self, **row: Any) -> None:
    unknown = set(row) - {c.key for c in self.columns}
    if unknown:
      raise KeyError(f"Table {self.title!r} has no columns {sorted(unknown)}")
    self.rows.append(row)

  def markdown(self) -> str:
    lines = [f"#### {self.title}", "",
             "| " + " | ".join(c.label for c in self.columns) + " |",
             "|" + "|".join("---" for _ in self.columns) + "|"]
    for row in self.rows:
      lines.append("| " + " | ".join(c.render(row.get(c.key))
                                     for c in self.columns) + " |")
    lines += [""] + [f"- {n}" for n in self.notes]
    return "\n".join(lines).rstrip() + "\n"

  def to_json(self) -> dict:
    return {"title": self.title,
            "columns": [{"key": c.key, "label": c.label} for c in self.columns],
            "rows": [jsonable(r) for r in self.rows], "notes": self.notes}


@dataclasses.dataclass(frozen=True)
class HardwareClass:
  """The hardware a target is meant for.

  Attributes:
    name: what the report shows in the target's "applies to" column.
    lacking: why a machine outside the class is outside it ("no bf16 units"),
      shown as "not applicable here (...)".
    test: whether the run's plan (its `Context`) belongs to the class.
  """

  name: str
  lacking: str
  test: Callable[["Context"], bool]


ALL_HARDWARE = HardwareClass("all hardware", "", lambda ctx: True)
BF16_UNITS = HardwareClass(
    "devices with bf16 matrix units (avx512_bf16/AMX CPUs, GPUs ≥ sm80, TPUs)",
    "no bf16 units", lambda ctx: ctx.bf16_units)


@dataclasses.dataclass
class Target:
  """A goal: ``value <op> goal`` (e.g. a ratio <= 0.5) on a class of hardware.

  ``name`` says what is measured and the goal ("bf16 MLP train step ≤ 0.5×
  f32"); ``applies_to`` the hardware on which the goal can be met. On other
  hardware the value is still measured and shown, as "not applicable here".
  ``applicable`` and ``judged`` are set by the runner for the run's plan
  (`resolve`): a dry run's figures are shown but not judged.
  """

  name: str
  value: Optional[float]
  goal: float
  op: str  # "<=" or ">="
  unit: str = "×"
  applies_to: HardwareClass = ALL_HARDWARE
  applicable: bool = True
  judged: bool = True

  def resolve(self, ctx: "Context") -> "Target":
    self.applicable = bool(self.applies_to.test(ctx))
    self.judged = not ctx.dry_run
    return self

  @property
  def met(self) -> Optional[bool]:
    if self.value is None:
      return None
    return self.value <= self.goal if self.op == "<=" else self.value >= self.goal

  @property
  def status(self) -> str:
    if not self.applicable:
      return "not applicable here"
    if not self.judged:
      return "not judged (dry run)"
    return {None: "n/a", True: "PASS", False: "MISS"}[self.met]

  @property
  def margin(self) -> Optional[float]:
    """How far from the goal, relative to it: +0.12 = 12% better than needed."""
    if self.value is None or self.goal == 0:
      return None
    rel = (self.goal - self.value) / self.goal
    return rel if self.op == "<=" else -rel

  def _value(self, x: float) -> str:
    return f"{x:.3g}{self.unit}"

  def describe(self) -> str:
    if self.value is None:
      return "not measured"
    value = self._value(self.value)
    goal = f"{self.op} {self._value(self.goal)}"
    if not self.applicable:
      return (f"not applicable here ({self.applies_to.lacking}): measured "
              f"{value} (goal {goal})")
    if not self.judged:
      return f"measured {value} (goal {goal}) at dry-run sizes, one round"
    if self.value == self.goal:
      return f"{value} (goal {goal}): exactly at the goal"
    if self.margin is None:  # a goal of zero
      return f"{value} (goal {goal})"
    word = "better than" if self.margin >= 0 else "short of"
    return f"{value} (goal {goal}): {abs(self.margin) * 100:.0f}% {word} the goal"

  def to_json(self) -> dict:
    return {"name": self.name, "value": self.value, "goal": self.goal,
            "op": self.op, "unit": self.unit, "status": self.status,
            "margin": self.margin, "applies_to": self.applies_to.name,
            "applicable": self.applicable, "judged": self.judged}


@dataclasses.dataclass
class SectionResult:
  tables: list[Table] = dataclasses.field(default_factory=list)
  targets: list[Target] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)
  data: dict = dataclasses.field(default_factory=dict)  # extra, JSON only


def human_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")


def jsonable(x: Any) -> Any:
  if isinstance(x, dict):
    return {str(k): jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [jsonable(v) for v in x]
  if isinstance(x, Timing):
    return x.to_json()
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (np.floating,)):
    return float(x)
  if isinstance(x, (np.bool_,)):
    return bool(x)
  if isinstance(x, Counter):
    return {"·".join(k) if isinstance(k, tuple) else str(k): v for k, v in x.items()}
  if isinstance(x, (str, int, float, bool)) or x is None:
    return x
  return str(x)
