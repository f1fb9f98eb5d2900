"""The README's table of the bench's CPU targets, rendered from ``bench/results/``.

One row per target the bench checks, one column per CPU class; each cell is
the newest full (not ``--quick``) run of that class that measured the target,
with its status and the results file it comes from. A figure copied by hand
drifts from the run it came from, and two tables that quote the same run can
disagree; this one cannot (``tests/test_readme.py`` fails if the README's copy
differs from what `docs/readme_tables.py` renders).

A run's class is read from the CPU flags it recorded: A has avx512_bf16 (bf16
matrix instructions) and no AMX, B has AVX2 only.
"""

from __future__ import annotations

import re

# (class, what it is, whether a run's CPU flags are of it)
CLASSES = (
    ("A: avx512_bf16", lambda flags: "avx512_bf16" in flags and "amx" not in flags),
    ("B: AVX2 only", lambda flags: "avx512_bf16" not in flags and "amx" not in flags),
)

# The CPU results files read, in bench/results/ (``--quick`` runs are skipped).
FILES = ("avx512_bf16", "avx2-first", "avx2-rest", "engine", "fp8", "fused_clip",
         "guard", "guard-compile", "steps-mlp_ln", "telemetry")

# Each row: what it measures (with its goal and where it applies), then its
# parts, each a label and a pattern matching the target's name in the results
# (the name the bench gives it now; an older name only where it measured the
# same thing).
_ARRAYS = r"worst of \d+–\d+ arrays"
ROWS = (
    ("`all_finite` vs a plain sum-reduce, 1 GiB in 100 leaves (≥ 0.9×; all)", (
        ("float32", r"all_finite (throughput )?≥ 0\.9× (a plain )?sum-reduce \(float32( leaves)?\)"),
        ("bfloat16", r"all_finite (throughput )?≥ 0\.9× (a plain )?sum-reduce \(bfloat16( leaves)?\)"),
    )),
    ("bf16 MLP train step vs f32 (≤ 0.5×; bf16 units)", (
        ("`wrap`", r"(bf16 MLP train step \(jmp_lite wrap\)|MLP: jmp_lite bf16 step) ≤ 0\.5× f32"),
        ("hand-written, f32 accumulation both ways",
         r"bf16 MLP train step \(hand-written bf16, f32 acc \(custom_vjp bwd\), the reference"),
    )),
    ("`wrap` vs the same step written by hand (within 2%; all)", (
        ("MLP", r"mlp train step: jmp_lite wrap .* within 2%"),
        ("transformer", r"transformer train step: jmp_lite wrap .* within 2%"),
        ("MLP + LayerNorm", r"mlp_ln train step: jmp_lite wrap .* within 2%"),
    )),
    ("loss-scaled clipped update on 1 GiB, fused vs the optax chain with the same checks (≤ 1×; all)", (
        ("", r"loss-scaled clipped update: fused time ≤ chained optax \+ the same checks"),
    )),
    ("guarded Adam step vs checking gradients only, 256 M params (≤ 1.15×; all)", (
        ("float32", r"guarded Adam step .* gradients-only \(float32 params\)"),
        ("bfloat16", r"guarded Adam step .* gradients-only \(bfloat16 params\)"),
    )),
    ("the same step's XLA temporaries vs checking gradients only (≤ 1.01×; all)", (
        ("float32", r"guarded Adam step's XLA temporaries .* \(float32 params\)"),
        ("bfloat16", r"guarded Adam step's XLA temporaries .* \(bfloat16 params\)"),
    )),
    ("`TrainState.minimize` trace + lower + compile vs the plain Flax + optax step, worst size (≤ 2×; all)", (
        ("MLP f32", rf"MLP: TrainState\.minimize f32 trace\+lower\+compile ≤ 2× .*{_ARRAYS}"),
        ("MLP bf16", rf"MLP: TrainState\.minimize bf16 trace\+lower\+compile ≤ 2× .*{_ARRAYS}"),
        ("transformer f32", rf"transformer: TrainState\.minimize f32 trace\+lower\+compile ≤ 2× .*{_ARRAYS}"),
        ("transformer bf16", rf"transformer: TrainState\.minimize bf16 trace\+lower\+compile ≤ 2× .*{_ARRAYS}"),
    )),
    ("the same vs Flax's `DynamicScale` step by hand, worst size (≤ 1×; all)", (
        ("MLP f32", rf"MLP: TrainState\.minimize f32 .* under the Flax DynamicScale .*{_ARRAYS}"),
        ("transformer f32", rf"transformer: TrainState\.minimize f32 .* under the Flax DynamicScale .*{_ARRAYS}"),
    )),
    ("reduce ops per parameter array in the compiled `TrainState.minimize` step (≤ 3; all)", (
        ("MLP", rf"MLP: TrainState\.minimize f32 ≤ 3 reduce instructions .*{_ARRAYS}"),
        ("transformer f32", rf"transformer: TrainState\.minimize f32 ≤ 3 reduce .*{_ARRAYS}"),
        ("transformer bf16", rf"transformer: TrainState\.minimize bf16 ≤ 3 reduce .*{_ARRAYS}"),
    )),
    ("compilations over 50 steps with a changing scale (1; all)", (
        ("dynamic", r"(compilations of a loss-scaled train step over 50 steps, |one compilation: )"
                    r"jmp_lite\.DynamicLossScale"),
        ("static, a new value each step",
         r"(compilations of a loss-scaled train step over 50 steps, |one compilation: )"
         r"jmp_lite\.StaticLossScale"),
    )),
    ("transformer residuals kept for the backward pass under `wrap` bf16, vs f32 (≤ 0.55×; all)", (
        ("", r"transformer(: jmp_lite wrap residuals| residuals kept for the backward pass, "
             r"jmp_lite wrap bf16) ≤ 0\.55× f32"),
    )),
    ("`Telemetry` vs off, sampled every 10 steps (≤ 1.10×) and every step (≤ 2×; all)", (
        ("MLP, every 10", r"mlp: Telemetry\(every=10\)"),
        ("MLP, every step", r"mlp: Telemetry\(\) every step"),
        ("transformer, every 10", r"transformer: Telemetry\(every=10\)"),
        ("transformer, every step", r"transformer: Telemetry\(\) every step"),
    )),
    ("fp8 MLP: residuals vs the bf16 step's (≤ 0.6×; all)", (
        ("", r"MLP backward-pass residuals with fp8 .* ≤ 0\.6×"),
    )),
    ("fp8 MLP: every matmul given to XLA multiplies fp8 arrays (all)", (
        ("", r"every matmul given to XLA multiplies fp8 arrays"),
    )),
    ("fp8 MLP train step vs bf16 (≤ 0.9×; fp8 units)", (
        ("", r"MLP train step, bf16 \+ fp8 \(hybrid\) on the Dense layers ≤ 0\.9× bf16"),
    )),
    ("`import jmp_lite` over `import jax` (≤ +0.25 s, neither Flax nor optax loaded; all)", (
        ("seconds", r"`import jmp_lite` costs ≤ `import jax` \+ 0\.25 s"),
        ("modules loaded", r"`import jmp_lite` loads neither flax nor optax"),
    )),
)

_STATUS = {"PASS": "met", "MISS": "**missed**", "not applicable here": "not applicable"}


def _class(run: dict):
  flags = run["meta"]["hardware"]["cpu_flags"]
  return next((name for name, test in CLASSES if test(flags)), None)


def _value(target: dict) -> str:
  value, unit = target["value"], target.get("unit") or ""
  if value is None:
    return "not measured"
  if not unit and "×" in target["name"]:
    unit = "×"
  return f"{value:.3g}{unit}" if unit.strip() else f"{value:.3g}"


def _cell(runs: list, pattern: str):
  """The newest ``(run name, target)`` whose target name matches ``pattern``."""
  found = [(run["meta"]["started"], name, t)
           for name, run in runs for section in run["sections"].values()
           for t in section.get("targets", []) if re.search(pattern, t["name"])]
  return max(found, key=lambda f: f[0])[1:] if found else None


def by_class(*runs_in_order: dict) -> dict:
  """The full runs of `FILES` (given in that order) as ``(name, run)`` pairs, by class."""
  named = [(name, run) for name, run in zip(FILES, runs_in_order)
           if not run["meta"].get("quick")]
  return {c: [(n, r) for n, r in named if _class(r) == c] for c, _ in CLASSES}


def render(*runs_in_order: dict) -> str:
  """The table, from the runs of `FILES` (in that order)."""
  classes = by_class(*runs_in_order)
  lines = ["| what (target; where it applies) | "
           + " | ".join(c for c, _ in CLASSES) + " |",
           "|---" * (1 + len(CLASSES)) + "|"]
  used = {}
  for what, parts in ROWS:
    cells = []
    for c, _ in CLASSES:
      texts, sources = [], []
      for label, pattern in parts:
        hit = _cell(classes[c], pattern)
        if hit is None:
          continue
        name, target = hit
        status = _STATUS.get(target["status"], target["status"])
        texts.append(f"{label + ': ' if label else ''}{_value(target)} ({status})")
        if name not in sources:
          sources.append(name)
        used[name] = dict(classes[c])[name]
      cells.append("; ".join(texts) + (" — " + ", ".join(f"`{s}`" for s in sources)
                                       if sources else "") if texts else "–")
    lines.append(f"| {what} | " + " | ".join(cells) + " |")
  lines.append("")
  lines.append("Runs (`bench/results/<name>.md`, command, start, load average at the start):")
  lines.append("")
  for name in FILES:
    if name in used:
      meta = used[name]["meta"]
      lines.append(f"- `{name}`: `{meta['command']}`, {meta['started']}, "
                   f"{meta['hardware']['cpu_model']} ({_class(used[name])}), load "
                   f"{meta['hardware'].get('loadavg_at_start', 'not recorded')}")
  return "\n".join(lines)
