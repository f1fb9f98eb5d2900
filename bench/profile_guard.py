"""Where a guarded optimizer step's device time goes, kernel by kernel.

The bench's ``guard`` section times the guarded Adam step against the
gradients-only one; this script says why they differ. It compiles three steps
over the same parameters (plain ``optax.adam``, gradients-only, guarded),
times each, records a `jax.profiler` trace of three calls of each and sums the
device's kernel time per kernel kind (XLA's fusion names without their
numbers). On a CPU the trace holds no device kernels; the step times and the
compiled programs' fusion counts are still reported.

    python bench/profile_guard.py --out DIR [--params 268435456] [--leaves 100]

writes ``DIR/profile_guard.md`` and ``DIR/profile_guard.json``. The traces
are left under ``DIR/trace_*`` for Perfetto or TensorBoard.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jmp_lite  # noqa: E402
from jmp_lite import optax as jo  # noqa: E402

SCALE = 2.0 ** 15
CALLS = 3


def _steps():
  ls = jmp_lite.StaticLossScale(SCALE)
  return {
      "plain adam": optax.adam(1e-3),
      # The bench's private factory: the guard with the result checks off.
      "gradients only": jo._with_loss_scale(  # pylint: disable=protected-access
          optax.adam(1e-3), ls, clip_norm=None, accumulate_steps=1,
          axis_name=None, check_results=False),
      "guarded": jo.with_loss_scale(optax.adam(1e-3), ls),
  }


def kernel_time(trace_dir: str) -> dict[str, list[float]]:
  """``{kernel kind: [launches, microseconds]}`` on the device's streams."""
  files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"),
                    recursive=True)
  if not files:
    return {}
  data = json.load(gzip.open(files[0]))
  events = data["traceEvents"] if isinstance(data, dict) else data
  meta = lambda kind: {(e["pid"], e.get("tid")) if kind == "thread_name" else
                       e["pid"]: e["args"]["name"] for e in events
                       if e.get("ph") == "M" and e.get("name") == kind}
  processes, threads = meta("process_name"), meta("thread_name")
  found = collections.defaultdict(lambda: [0, 0.0])
  for e in events:
    if e.get("ph") != "X" or "GPU" not in str(processes.get(e["pid"])):
      continue
    if "Stream" not in str(threads.get((e["pid"], e.get("tid")))):
      continue
    kind = re.sub(r"[._]\d+$", "", e["name"])
    found[kind][0] += 1
    found[kind][1] += e.get("dur", 0.0)
  return dict(found)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--params", type=int, default=256 * 2**20)
  parser.add_argument("--leaves", type=int, default=100)
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  n = args.params // args.leaves
  rows = []
  for dtype in (jnp.float32, jnp.bfloat16):
    keys = jax.random.split(jax.random.PRNGKey(0), args.leaves)
    grads = [(jax.random.normal(k, (n,)) * SCALE * 1e-4).astype(dtype)
             for k in keys]
    params = [jnp.ones((n,), dtype) for _ in range(args.leaves)]
    for name, tx in _steps().items():
      def step(p, s, g, tx=tx):
        updates, s = tx.update(g, s, p)
        return jo.apply_updates(p, updates), s
      state = tx.init(params)
      compiled = jax.jit(step).lower(params, state, grads).compile()
      entry = compiled.as_text().split("ENTRY", 1)[1]
      ops = collections.Counter(re.findall(
          r" (fusion|copy|conditional|custom-call)\(", entry))
      call = lambda c=compiled, p=params, s=state, g=grads: (
          jax.block_until_ready(c(p, s, g)))
      call(), call()
      times = []
      for _ in range(10):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
      label = jnp.dtype(dtype).name
      trace = os.path.join(args.out, f"trace_{label}_{name.replace(' ', '_')}")
      jax.profiler.start_trace(trace, create_perfetto_trace=True)
      for _ in range(CALLS):
        call()
      jax.profiler.stop_trace()
      kernels = {k: [c / CALLS, us / CALLS / 1e3]
                 for k, (c, us) in kernel_time(trace).items()}
      rows.append({"dtype": label, "step": name,
                   "ms": 1e3 * sorted(times)[len(times) // 2],
                   "ops": dict(ops), "kernels": kernels})
      print(rows[-1]["dtype"], name, f"{rows[-1]['ms']:.2f} ms", dict(ops),
            flush=True)
    del grads, params
  with open(os.path.join(args.out, "profile_guard.json"), "w") as f:
    json.dump({"device": str(jax.devices()[0].device_kind),
               "jax": jax.__version__, "params": args.params,
               "leaves": args.leaves, "rows": rows}, f, indent=1)
  lines = [f"# Guarded step profile: {jax.devices()[0].device_kind}, "
           f"{args.params / 2**20:.3g} M parameters in {args.leaves} leaves",
           "", "| params | step | ms per step (wall) | fusions | kernel ms per "
           "step | kernels per step, by kind (launches, ms) |", "|---|---|---|---|---|---|"]
  for r in rows:
    total = sum(ms for _, ms in r["kernels"].values())
    top = sorted(r["kernels"].items(), key=lambda kv: -kv[1][1])[:4]
    kinds = "; ".join(f"`{k}` {c:g}, {ms:.3f}" for k, (c, ms) in top) or "–"
    lines.append(f"| {r['dtype']} | {r['step']} | {r['ms']:.2f} | "
                 f"{r['ops'].get('fusion', 0)} | {total:.3f} | {kinds} |")
  with open(os.path.join(args.out, "profile_guard.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
