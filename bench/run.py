"""Runs jmp_lite's benchmarks and writes bench/results/latest.{md,json}.

(``--quick`` writes latest-quick.{md,json}, ``--dry-run`` dry-run.{md,json}.)

Usage (from the repository root):

    python bench/run.py                       # everything, full sizes
    python bench/run.py --quick               # small sizes, a smoke run
    python bench/run.py --only all_finite,steps --repeats 20
    python bench/run.py --dry-run             # tiny sizes, 1 round: do all paths run?
    python bench/run.py --dry-run --assume-platform gpu   # the GPU plan, here
    python bench/run.py --list

Before the sections run, it says what mixed precision can buy on this
hardware and roughly how long the run will take (see bench/plan.py); bench/
README.md gives the durations measured on a 2-core AVX2 CPU.

Sections are registered in bench/sections/__init__.py.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # the wall time a user sees includes the imports

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

_BENCH = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_BENCH)
# Run as a script, Python puts bench/ first on the path, where its module names
# could shadow installed ones; import everything as the `bench` package instead.
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _BENCH:
  sys.path.pop(0)
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402

from bench import harness  # noqa: E402
from bench import machine  # noqa: E402
from bench import plan as plan_lib  # noqa: E402
from bench import report  # noqa: E402
from bench.sections import SECTIONS  # noqa: E402

PLATFORMS = ("cpu", "gpu", "tpu")


def parse_args(argv):
  parser = argparse.ArgumentParser(
      description="Benchmarks jmp_lite against f32, naive Flax bf16, jmp 0.0.4 "
      "and hand-written bf16, on this machine, in one process.")
  parser.add_argument(
      "--only", default="all",
      help="comma-separated sections to run, in registry order (default: all;"
      f" available: {', '.join(SECTIONS)})")
  parser.add_argument(
      "--repeats", type=int, default=None,
      help="timed rounds per figure (median is reported); default 10, 5 with"
      " --quick")
  parser.add_argument("--quick", action="store_true",
                      help="small sizes, for a smoke run")
  parser.add_argument(
      "--dry-run", action="store_true",
      help="tiny sizes and 1 round: runs every code path of the plan (sizes "
      "computed, variants, targets) without measuring anything meaningful")
  parser.add_argument(
      "--assume-platform", choices=PLATFORMS, default=None,
      help="make the plan for this platform (its sizes, variants such as the "
      "TF32 baseline on gpu, and its hardware class's targets) instead of the "
      "default backend's; needs --dry-run unless it is the platform at hand, "
      "since the run still executes on the device at hand")
  parser.add_argument(
      "--out", default=os.path.join(_BENCH, "results"),
      help="output directory (default: bench/results)")
  parser.add_argument(
      "--name", default=None,
      help="output file stem: writes NAME.md and NAME.json (default: latest, "
      "latest-quick with --quick, dry-run[-PLATFORM] with --dry-run, so a "
      "smoke or dry run never overwrites the full results)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--list", action="store_true",
                      help="list the sections and exit")
  args = parser.parse_args(argv)
  if args.only == "all":
    args.sections = list(SECTIONS)
  else:
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
      parser.error(f"unknown section(s) {unknown}; available: {list(SECTIONS)}")
    args.sections = [s for s in SECTIONS if s in wanted]
  if args.repeats is not None and args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  args.parser = parser
  return args


def _stem(args, plan) -> str:
  if args.name:
    return args.name
  if args.dry_run:
    return "dry-run" + (f"-{plan.platform}" if plan.assumed else "")
  return "latest-quick" if args.quick else "latest"


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if args.list:
    for name, module in SECTIONS.items():
      print(f"{name:12s} {module.TITLE}")
    return 0
  if importlib.util.find_spec("jmp") is None:
    # Several sections measure jmp itself: fail once, up front, not in each.
    print("bench/run.py: the bench compares jmp_lite with jmp 0.0.4, which the "
          "dev extra installs: .venv/bin/pip install -e \".[dev]\" (the "
          "README's test command installs it).", file=sys.stderr)
    return 2
  import jmp_lite.hardware

  hw = jmp_lite.hardware.describe()
  if args.assume_platform not in (None, hw.platform) and not args.dry_run:
    args.parser.error(
        f"--assume-platform {args.assume_platform} on a {hw.platform} machine "
        "needs --dry-run: the sections would run the "
        f"{args.assume_platform.upper()} sizes on the {hw.platform.upper()}")
  plan = plan_lib.make_plan(hw, args.assume_platform, args.dry_run)
  if args.dry_run:
    # The figures mean nothing; compile quickly (XLA's LLVM back end at -O0:
    # the HLO, and so the compiled dots, are unchanged). About 3x faster.
    jax.config.update("jax_disable_most_optimizations", True)
  ctx = plan_lib.context(plan, quick=args.quick, repeats=args.repeats,
                         seed=args.seed)
  print(hw.headline(), file=sys.stderr, flush=True)
  print("Probing matmul speed per dtype...", file=sys.stderr, flush=True)
  probe = plan_lib.probe(hw, args.dry_run)
  notice = hw.advice(probe["gflops"])
  estimate = plan_lib.estimate(args.sections, ctx, plan, probe)
  scale = "dry" if ctx.dry_run else "quick" if ctx.quick else "full"
  meta = {
      "command": " ".join(["python bench/run.py"] + [shlex.quote(a) for a in argv]),
      "started": report.now(), "quick": ctx.quick, "repeats": ctx.repeats,
      "sections": args.sections, "hardware": machine.hardware_info(hw),
      "plan": {"platform": plan.platform, "assumed": plan.assumed,
               "bf16_units": plan.bf16_units, "tf32_baseline": ctx.tf32,
               "device_platform": plan.device_platform,
               "dry_run": plan.dry_run, "scale": scale,
               "size_key": ctx.size_key, "description": plan.describe(scale)},
      "notice": notice, "probe": probe, "estimate": estimate,
  }
  print("\n" + notice, file=sys.stderr)
  print(f"Plan: {meta['plan']['description']}", file=sys.stderr)
  print(f"Duration: {estimate['text']}\n", file=sys.stderr, flush=True)
  start = time.perf_counter()
  results = {}
  failed = []
  for name in args.sections:
    module = SECTIONS[name]
    print(f"[{name}] {module.TITLE}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    error = None
    try:
      result = module.run(ctx)
      for target in result.targets:
        target.resolve(ctx)
    except Exception:  # report and go on with the other sections
      error = traceback.format_exc()
      result = harness.SectionResult()
      failed.append(name)
      print(error, file=sys.stderr)
    seconds = time.perf_counter() - t0
    guess = estimate["sections"].get(name)
    print(f"[{name}] done in {seconds:.0f} s"
          + (f" (estimated {guess:.0f} s)" if guess is not None else ""),
          file=sys.stderr, flush=True)
    results[name] = {"title": module.TITLE, "description": module.DESCRIPTION,
                     "result": result, "error": error, "seconds": seconds}
  meta["seconds"] = time.perf_counter() - start
  meta["wall_seconds"] = time.perf_counter() - _T0  # with imports and probe
  meta["loadavg_at_end"] = machine.loadavg()
  os.makedirs(args.out, exist_ok=True)
  stem = _stem(args, plan)
  md = os.path.join(args.out, stem + ".md")
  report.write_markdown(md, meta, results)
  report.write_json(os.path.join(args.out, stem + ".json"), meta, results)
  with open(md) as f:
    print(f.read())
  print(f"Wrote {md} and {stem}.json: sections {meta['seconds']:.0f} s, "
        f"{meta['wall_seconds']:.0f} s in all.", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
