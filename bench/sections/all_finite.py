"""all_finite throughput vs a plain sum-reduce vs jmp's all_finite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from bench import machine
from bench.harness import Column, SectionResult, Table, Target

NAME = "all_finite"
TITLE = "all_finite throughput"
DESCRIPTION = (
    "Gradients of 1 GiB (64 MiB with `--quick`) in 100 equal leaves on a CPU "
    "(on a GPU 2 GiB, at most a quarter of device memory; 256 MiB with "
    "`--quick`), once as "
    "float32 and once as bfloat16 (same bytes, twice the elements). Each "
    "function is jitted and timed on the same arrays: a plain sum-reduce "
    "(`jnp.sum` of every leaf, summed), `jmp_lite.all_finite`, and jmp 0.0.4's "
    "`all_finite` (`isfinite` + `all` per leaf). Throughput is bytes read per "
    "second. The last column times `jmp_lite.all_finite` on the same tree with "
    "one inf in one leaf: the fast sum is then not finite and the exact second "
    "pass runs (the cost of an overflowing step). Target, on all hardware "
    "(both are memory-bound reductions): jmp_lite ≥ 0.9× the sum-reduce's "
    "throughput.")

NUM_LEAVES = 100


def _leaves(total_bytes: int, dtype, seed: int, num_leaves: int) -> list[jax.Array]:
  n = total_bytes // num_leaves // np.dtype(dtype).itemsize
  make = jax.jit(lambda k: jax.random.normal(k, (n,), jnp.float32).astype(dtype))
  keys = jax.random.split(jax.random.PRNGKey(seed), num_leaves)
  return [harness.block(make(k)) for k in keys]


def _plain_sum(leaves):
  return sum(jnp.sum(x) for x in leaves)


def run(ctx: harness.Context) -> SectionResult:
  import jmp

  import jmp_lite

  mib = 2**20
  total = ctx.pick(full=1024 * mib, quick=64 * mib, dry=mib,
                   gpu=machine.bounded_bytes(2048 * mib, 1 / 4),
                   gpu_quick=machine.bounded_bytes(256 * mib, 1 / 4))
  # Fewer leaves in a dry run: compile time grows with the leaves.
  num_leaves = ctx.pick(full=NUM_LEAVES, quick=NUM_LEAVES, dry=8)
  fns = {
      "sum": jax.jit(_plain_sum),
      "jmp_lite": jax.jit(jmp_lite.all_finite),
      "jmp": jax.jit(jmp.all_finite),
  }
  table = Table(
      f"Throughput over {harness.human_bytes(total)} in {num_leaves} leaves "
      "(GB/s, higher is better)",
      [Column("dtype", "leaves"), Column("sum_gbs", "sum-reduce", "gbs"),
       Column("jmp_lite_gbs", "jmp_lite.all_finite", "gbs"),
       Column("jmp_gbs", "jmp.all_finite", "gbs"),
       Column("jmp_lite_vs_sum", "jmp_lite / sum", "ratio"),
       Column("jmp_vs_sum", "jmp / sum", "ratio"),
       Column("jmp_lite_inf_gbs", "jmp_lite, one inf (exact pass)", "gbs"),
       Column("sum_ms", "sum ms", "ms"), Column("jmp_lite_ms", "jmp_lite ms", "ms"),
       Column("jmp_ms", "jmp ms", "ms"), Column("spread", "spread", "pct")])
  result = SectionResult(tables=[table])
  for dtype in (jnp.float32, jnp.bfloat16):
    name = np.dtype(dtype).name
    ctx.log(f"all_finite: generating {harness.human_bytes(total)} of {name}")
    leaves = _leaves(total, dtype, ctx.seed, num_leaves)
    bad = list(leaves)
    bad[num_leaves // 2] = bad[num_leaves // 2].at[7].set(jnp.inf)
    checks = {k: bool(f(leaves)) for k, f in fns.items() if k != "sum"}
    checks_bad = {k: bool(f(bad)) for k, f in fns.items() if k != "sum"}
    if not all(checks.values()) or any(checks_bad.values()):
      result.notes.append(
          f"WRONG ANSWER ({name}): finite tree -> {checks}, tree with inf -> "
          f"{checks_bad}")
    thunks = {k: (lambda f=f, leaves=leaves: f(leaves)) for k, f in fns.items()}
    thunks["jmp_lite_inf"] = lambda bad=bad: fns["jmp_lite"](bad)
    t = harness.measure(thunks, ctx)
    nbytes = harness.tree_bytes(leaves)
    gbs = {k: nbytes / v.median / 1e9 for k, v in t.items()}
    table.add(dtype=name, sum_gbs=gbs["sum"], jmp_lite_gbs=gbs["jmp_lite"],
              jmp_gbs=gbs["jmp"],
              jmp_lite_vs_sum=gbs["jmp_lite"] / gbs["sum"],
              jmp_vs_sum=gbs["jmp"] / gbs["sum"],
              jmp_lite_inf_gbs=gbs["jmp_lite_inf"],
              sum_ms=t["sum"].median, jmp_lite_ms=t["jmp_lite"].median,
              jmp_ms=t["jmp"].median,
              spread=max(v.spread for v in t.values()))
    result.targets.append(Target(
        f"all_finite throughput ≥ 0.9× a plain sum-reduce ({name} leaves)",
        gbs["jmp_lite"] / gbs["sum"], 0.9, ">="))
    result.data[name] = {"bytes": nbytes, "timings": t}
    del leaves, bad, thunks
  table.notes.append(
      "spread: the widest interquartile range of the row's timings, as ± "
      "around the median.")
  return result
