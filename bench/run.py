"""Runs jmp_lite's benchmarks and writes bench/results/latest.{md,json}.

(``--quick`` writes latest-quick.{md,json} instead.)

Usage (from the repository root):

    python bench/run.py                       # everything, full sizes (~5 min)
    python bench/run.py --quick               # small sizes, a smoke run (~1 min)
    python bench/run.py --only all_finite,steps --repeats 20
    python bench/run.py --list

Sections are registered in bench/sections/__init__.py.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import traceback

_BENCH = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_BENCH)
# Run as a script, Python puts bench/ first on the path, where its module names
# could shadow installed ones; import everything as the `bench` package instead.
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _BENCH:
  sys.path.pop(0)
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from bench import harness  # noqa: E402
from bench.sections import SECTIONS  # noqa: E402


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
      "--out", default=os.path.join(_BENCH, "results"),
      help="output directory (default: bench/results)")
  parser.add_argument(
      "--name", default=None,
      help="output file stem: writes NAME.md and NAME.json (default: latest, "
      "or latest-quick with --quick, so a smoke run never overwrites the "
      "full results)")
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
  return args


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if args.list:
    for name, module in SECTIONS.items():
      print(f"{name:12s} {module.TITLE}")
    return 0
  ctx = harness.Context(
      quick=args.quick,
      repeats=args.repeats or (5 if args.quick else 10),
      min_sample_s=0.005 if args.quick else 0.02,
      seed=args.seed)
  meta = {
      "command": " ".join(["python bench/run.py"] + [shlex.quote(a) for a in argv]),
      "started": harness.now(), "quick": ctx.quick, "repeats": ctx.repeats,
      "sections": args.sections, "hardware": harness.hardware_info(),
  }
  hw = meta["hardware"]
  print(f"{hw['cpu_model']}, {hw['cores']} cores, {hw['cpu_flags']}; "
        f"jax {hw['versions']['jax']} on {hw['backend']}", file=sys.stderr)
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
    except Exception:  # report and go on with the other sections
      error = traceback.format_exc()
      result = harness.SectionResult()
      failed.append(name)
      print(error, file=sys.stderr)
    seconds = time.perf_counter() - t0
    print(f"[{name}] done in {seconds:.0f} s", file=sys.stderr, flush=True)
    results[name] = {"title": module.TITLE, "description": module.DESCRIPTION,
                     "result": result, "error": error, "seconds": seconds}
  meta["seconds"] = time.perf_counter() - start
  meta["loadavg_at_end"] = harness.loadavg()
  os.makedirs(args.out, exist_ok=True)
  stem = args.name or ("latest-quick" if args.quick else "latest")
  md = os.path.join(args.out, stem + ".md")
  harness.write_markdown(md, meta, results)
  harness.write_json(os.path.join(args.out, stem + ".json"), meta, results)
  with open(md) as f:
    print(f.read())
  print(f"Wrote {md} and {stem}.json in {meta['seconds']:.0f} s.", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
