"""The bench's report: the markdown and JSON files `bench/run.py` writes."""

from __future__ import annotations

import datetime
import json
from typing import Mapping

from bench.harness import jsonable
from bench.harness import Target


def _status_line(t: Target) -> str:
  return f"| {t.name} | {t.applies_to.name} | {t.status} | {t.describe()} |"


def sizes_label(meta: dict) -> str:
  plan = meta["plan"]
  size = {"dry": "dry run (tiny sizes, 1 round)", "quick": "quick sizes",
          "full": "full sizes"}[plan["scale"]]
  return f"{size} of the {plan['platform'].upper()} plan"


def write_markdown(path: str, meta: dict, results: Mapping[str, dict]) -> None:
  """Writes the whole run as markdown: header, notice, targets, durations,
  then each section."""
  hw = meta["hardware"]
  v = hw["versions"]
  plan = meta["plan"]
  lines = [
      "# jmp_lite benchmarks", "",
      f"Command: `{meta['command']}`  ",
      f"Run: {meta['started']} ({meta['wall_seconds']:.0f} s), {sizes_label(meta)}, "
      f"{meta['repeats']} interleaved rounds per figure, each figure a median.", "",
      "## Hardware", "",
  ]
  if hw["backend"] != "cpu":
    lines.append(f"- Device: {hw['headline']}")
  lines += [
      f"- CPU: {hw['cpu_model']}, {hw['cores']} cores "
      f"({hw['usable_cores']} usable), {hw['memory_gib']} GiB RAM",
      f"- ISA flags: {hw['cpu_flags']}"
      + (f" (absent: {hw['missing_flags']})" if hw["missing_flags"] else ""),
      f"- Backend: {hw['backend']} ({hw['devices']}"
      + (f", compute capability {hw['compute_capability']}"
         if hw.get("compute_capability") else "")
      + (f", {hw['device_memory_gib']} GiB device memory"
         if hw.get("device_memory_gib") else "")
      + f"); jax {v['jax']}, jaxlib "
      f"{v['jaxlib']}, flax {v['flax']}, optax {v['optax']}, jmp {v['jmp']}, "
      f"jmp_lite {v['jmp_lite']}, Python {v['python']}",
      f"- Load average at start / end: {hw['loadavg_at_start']} / "
      f"{meta['loadavg_at_end']} (other processes share these cores)",
  ]
  if hw["xla_flags"]:
    lines.append(f"- XLA_FLAGS: `{hw['xla_flags']}`")
  lines += ["", "## What mixed precision can buy here", "", "```text",
            meta["notice"].rstrip(), "```", "",
            f"- Plan: {plan['description']}",
            f"- Duration: {meta['estimate']['text']} This run took "
            f"{meta['wall_seconds']:.0f} s in all ({meta['seconds']:.0f} s "
            "in the sections, the rest importing, probing and writing)."]
  targets = [t for r in results.values() for t in r["result"].targets]
  if targets:
    lines += ["", "## Targets", "",
              "| target (what it measures) | applies to | status | measured |",
              "|---|---|---|---|"]
    lines += [_status_line(t) for t in targets]
  est = meta["estimate"]["sections"]
  lines += ["", "## Durations", "",
            "| section | wall time (s) | estimated before the run (s) |",
            "|---|---|---|"]
  for name, r in results.items():
    guess = est.get(name)
    lines.append(f"| `{name}` | {r['seconds']:.1f} | "
                 f"{'–' if guess is None else f'{guess:.0f}'} |")
  lines += ["", f"Probe (one {meta['probe']['size']}² matmul per dtype, "
            "GFLOP/s): " + ", ".join(
                f"{k} {v_:.1f}" for k, v_ in meta["probe"]["gflops"].items())
            + ". The estimates scale reference wall times by the probe's "
            "float32 GFLOP/s; to refresh them, copy these wall times and "
            "the probe figure into `bench/plan.py`."]
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
  out = {"meta": jsonable(meta), "sections": {}}
  for name, r in results.items():
    res = r["result"]
    out["sections"][name] = {
        "title": r["title"], "seconds": r["seconds"], "error": r["error"],
        "tables": [t.to_json() for t in res.tables],
        "targets": [t.to_json() for t in res.targets],
        "notes": res.notes, "data": jsonable(res.data),
    }
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")


def now() -> str:
  return datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
