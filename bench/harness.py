"""The benchmark harness: timing, result tables, hardware facts, HLO checks.

Sections (``bench/sections/*.py``) use four things from here:

* `measure`: times several alternatives *interleaved* in one process (round
  ``r`` runs every alternative once, in a rotating order), after a warm-up that
  compiles them, and returns the median per alternative. On a shared 2-core
  machine the load drifts; interleaving exposes every alternative to the same
  drift, so the ratios stay meaningful even when absolute times move.
* `Table`, `Target` and `SectionResult`: what a section returns. `write_markdown`
  and `write_json` render them.
* `hardware_info`: CPU model, cores, relevant ISA flags, versions, backend.
* `dot_census`: the operand dtypes of every dot in a compiled XLA program,
  which shows where a "bf16" matmul was silently run in float32.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
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
  """What every section gets: the run's options.

  Attributes:
    quick: small sizes, for a smoke run.
    repeats: timed rounds per alternative (each figure is their median).
    min_sample_s: a timed sample repeats the call until it lasts this long, so
      that sub-millisecond calls are not dominated by timer resolution.
    seed: PRNG seed for all generated data.
  """

  quick: bool = False
  repeats: int = 10
  min_sample_s: float = 0.02
  seed: int = 0

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
            repeats: Optional[int] = None, warmup: int = 2) -> dict[str, Timing]:
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
    warmup: untimed calls before calibration.

  Returns:
    name -> `Timing`.
  """
  repeats = repeats or ctx.repeats
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


def dot_list(hlo_text: str) -> list[tuple[str, str, str, str]]:
  """Every dot of a compiled HLO module: ``(lhs, rhs, out dtype, instruction)``."""
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
    dot = _DOT.search(line)
    if dot:
      text = re.sub(r",\s*metadata=.*", "", line.strip())
      dots.append((types.get(dot.group(2), "?"), types.get(dot.group(3), "?"),
                   dot.group(1), text))
  return dots


def dot_census(hlo_text: str) -> Counter:
  """Counts the dots of a compiled HLO module by ``(lhs, rhs, out)`` dtypes.

  On XLA:CPU a bf16 x bf16 dot that the fast bf16 kernels cannot take (for
  example one contracting the leading dimension of its left operand, the
  weight-gradient layout) is rewritten into converts plus an f32 x f32 dot; the
  census makes that visible: ``{("bf16", "bf16", "f32"): 4, ("f32", "f32",
  "f32"): 4}``.
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
            "rows": [_jsonable(r) for r in self.rows], "notes": self.notes}


@dataclasses.dataclass
class Target:
  """A goal from the issues: ``value <op> goal``, e.g. a ratio <= 0.5."""

  name: str
  value: Optional[float]
  goal: float
  op: str  # "<=" or ">="
  unit: str = "×"

  @property
  def met(self) -> Optional[bool]:
    if self.value is None:
      return None
    return self.value <= self.goal if self.op == "<=" else self.value >= self.goal

  @property
  def status(self) -> str:
    return {None: "n/a", True: "PASS", False: "MISS"}[self.met]

  @property
  def margin(self) -> Optional[float]:
    """How far from the goal, relative to it: +0.12 = 12% better than needed."""
    if self.value is None:
      return None
    rel = (self.goal - self.value) / self.goal
    return rel if self.op == "<=" else -rel

  def describe(self) -> str:
    if self.value is None:
      return "not measured"
    value = f"{self.value:.3g}{self.unit}"
    goal = f"{self.op} {self.goal:g}{self.unit}"
    if self.value == self.goal:
      return f"{value} (goal {goal}): exactly at the goal"
    word = "better than" if self.margin >= 0 else "short of"
    return f"{value} (goal {goal}): {abs(self.margin) * 100:.0f}% {word} the goal"

  def to_json(self) -> dict:
    return {"name": self.name, "value": self.value, "goal": self.goal,
            "op": self.op, "status": self.status, "margin": self.margin}


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


def _jsonable(x: Any) -> Any:
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
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


# ---------------------------------------------------------------------------
# Hardware


_FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni",
                      "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_bf16",
                      "amx_tile", "amx_int8", "amx_fp16")


def hardware_info() -> dict:
  """CPU model, core count, ISA flags relevant to bf16, versions, backend."""
  model, flags, arch_flags = platform.processor() or "unknown", set(), ""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model in ("unknown", platform.processor()):
          model = value.strip()
        elif key in ("flags", "Features") and not flags:
          flags = set(value.split())
  except OSError:
    pass
  if flags:
    arch_flags = " ".join(f for f in _FLAGS_OF_INTEREST if f in flags)
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
  try:
    with open("/proc/loadavg") as f:
      load = " ".join(f.read().split()[:3])
  except OSError:
    load = "unknown"
  devices = jax.devices()
  return {
      "cpu_model": model,
      "cores": os.cpu_count(),
      "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
      "cpu_flags": arch_flags or "unknown",
      "missing_flags": " ".join(f for f in _FLAGS_OF_INTEREST if flags and f not in flags),
      "memory_gib": _memory_gib(),
      "platform": platform.platform(),
      "backend": jax.default_backend(),
      "devices": f"{len(devices)} × {devices[0].device_kind}",
      "versions": versions,
      "loadavg_at_start": load,
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


def _memory_gib() -> Optional[float]:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemTotal:"):
          return round(int(line.split()[1]) / 2**20, 1)
  except OSError:
    pass
  return None


def loadavg() -> str:
  try:
    with open("/proc/loadavg") as f:
      return " ".join(f.read().split()[:3])
  except OSError:
    return "unknown"


# ---------------------------------------------------------------------------
# Writers


def _status_line(t: Target) -> str:
  return f"| {t.name} | {t.status} | {t.describe()} |"


def write_markdown(path: str, meta: dict, results: Mapping[str, dict]) -> None:
  """Writes the whole run as markdown: header, targets, then each section."""
  hw = meta["hardware"]
  v = hw["versions"]
  lines = [
      "# jmp_lite benchmarks", "",
      f"Command: `{meta['command']}`  ",
      f"Run: {meta['started']} ({meta['seconds']:.0f} s), "
      f"{'quick sizes' if meta['quick'] else 'full sizes'}, "
      f"{meta['repeats']} interleaved rounds per figure, each figure a median.", "",
      "## Hardware", "",
      f"- CPU: {hw['cpu_model']}, {hw['cores']} cores "
      f"({hw['usable_cores']} usable), {hw['memory_gib']} GiB RAM",
      f"- ISA flags: {hw['cpu_flags']}"
      + (f" (absent: {hw['missing_flags']})" if hw["missing_flags"] else ""),
      f"- Backend: {hw['backend']} ({hw['devices']}); jax {v['jax']}, jaxlib "
      f"{v['jaxlib']}, flax {v['flax']}, optax {v['optax']}, jmp {v['jmp']}, "
      f"jmp_lite {v['jmp_lite']}, Python {v['python']}",
      f"- Load average at start / end: {hw['loadavg_at_start']} / "
      f"{meta['loadavg_at_end']} (other processes share these cores)",
  ]
  if hw["xla_flags"]:
    lines.append(f"- XLA_FLAGS: `{hw['xla_flags']}`")
  targets = [(name, t) for name, r in results.items() for t in r["result"].targets]
  if targets:
    lines += ["", "## Targets", "", "| target | status | measured |", "|---|---|---|"]
    lines += [_status_line(t) for _, t in targets]
  for name, r in results.items():
    lines += ["", f"## {r['title']} (`{name}`, {r['seconds']:.0f} s)", ""]
    if r["description"]:
      lines += [r["description"], ""]
    if r["error"]:
      lines += ["**Section failed:**", "", "```", r["error"].rstrip(), "```"]
      continue
    for table in r["result"].tables:
      lines.append(table.markdown())
    lines += [f"- {n}" for n in r["result"].notes]
  with open(path, "w") as f:
    f.write("\n".join(lines).rstrip() + "\n")


def write_json(path: str, meta: dict, results: Mapping[str, dict]) -> None:
  out = {"meta": _jsonable(meta), "sections": {}}
  for name, r in results.items():
    res = r["result"]
    out["sections"][name] = {
        "title": r["title"], "seconds": r["seconds"], "error": r["error"],
        "tables": [t.to_json() for t in res.tables],
        "targets": [t.to_json() for t in res.targets],
        "notes": res.notes, "data": _jsonable(res.data),
    }
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")


def now() -> str:
  return datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
