"""Matrix multiply speed by precision: the hardware fact mixed precision rests on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from bench import harness
from bench.harness import Column, SectionResult, Table

NAME = "matmul"
TITLE = "Matrix multiplies: f32 vs bf16"
DESCRIPTION = (
    "One jitted `lax.dot_general` per cell, on the shapes of the MLP's "
    "layers and of the transformer's MLP: f32 × f32 → f32; bf16 × bf16 → bf16 "
    "(what `x @ w` does on bf16 arrays, and what Flax's `dtype=bf16` layers "
    "run); and bf16 × bf16 with f32 accumulation (`preferred_element_type="
    "float32`) rounded to bf16 afterwards. Three layouts per shape: `x @ w` "
    "(forward), `g @ wᵀ` (input gradient) and `xᵀ @ g` (weight gradient, "
    "which contracts the leading dimension of its left operand). The dots "
    "columns are what XLA actually compiled: the operand and output dtypes of "
    "every dot in the optimised HLO (f32·f32 means XLA upcast the bf16 "
    "operands and ran the dot in float32).")

_NN = ((1,), (0,))  # x[m,k] @ w[k,n]
_NT = ((1,), (1,))  # g[m,n] @ w[k,n]^T
_TN = ((0,), (0,))  # x[m,k]^T @ g[m,n]


def _f32(dims):
  return jax.jit(lambda a, b: lax.dot_general(a, b, (dims, ((), ()))))


def _bf16_out(dims):
  return jax.jit(lambda a, b: lax.dot_general(a, b, (dims, ((), ()))))


def _bf16_acc(dims):
  return jax.jit(lambda a, b: lax.dot_general(
      a, b, (dims, ((), ())), preferred_element_type=jnp.float32
  ).astype(jnp.bfloat16))


def _shapes(quick: bool):
  if quick:
    return [(64, 256, 256), (256, 512, 512)]
  # (tokens, in, out): MLP layer at batch 256 with widths 1024 and 4096, and
  # the transformer block's MLP (32 x 128 tokens, 256 -> 1024).
  return [(256, 1024, 1024), (256, 4096, 4096), (4096, 256, 1024)]


def run(ctx: harness.Context) -> SectionResult:
  table = Table(
      "Time per matmul (ms) and speed relative to f32 (>1 is faster)",
      [Column("shape", "m × k × n"), Column("layout", "layout"),
       Column("f32", "f32 ms", "ms"), Column("bf16", "bf16→bf16 ms", "ms"),
       Column("acc", "bf16 f32-acc ms", "ms"),
       Column("bf16_speedup", "bf16→bf16 speed-up", "ratio"),
       Column("acc_speedup", "f32-acc speed-up", "ratio"),
       Column("acc_gflops", "f32-acc GFLOP/s", "{:.0f}"),
       Column("f32_gflops", "f32 GFLOP/s", "{:.0f}"),
       Column("dots_bf16", "compiled dots (bf16→bf16)"),
       Column("dots", "compiled dots (f32-acc)"), Column("spread", "spread", "pct")])
  result = SectionResult(tables=[table])
  forward = {}
  for m, k, n in _shapes(ctx.quick):
    key_a, key_b = jax.random.split(jax.random.PRNGKey(ctx.seed))
    x = jax.random.normal(key_a, (m, k), jnp.float32)
    w = jax.random.normal(key_b, (k, n), jnp.float32) / k**0.5
    g = jax.random.normal(key_b, (m, n), jnp.float32)
    for layout, dims, (a, b) in (("x @ w", _NN, (x, w)), ("g @ wᵀ", _NT, (g, w)),
                                 ("xᵀ @ g", _TN, (x, g))):
      ab, bb = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
      fns = {"f32": _f32(dims), "bf16": _bf16_out(dims), "acc": _bf16_acc(dims)}
      args = {"f32": (a, b), "bf16": (ab, bb), "acc": (ab, bb)}
      t = harness.measure({k_: (lambda f=f, a_=args[k_]: f(*a_))
                           for k_, f in fns.items()}, ctx)
      census = harness.dot_census(harness.compiled_text(fns["acc"], ab, bb))
      census_bf16 = harness.dot_census(harness.compiled_text(fns["bf16"], ab, bb))
      flops = 2 * m * k * n
      row = dict(shape=f"{m} × {k} × {n}", layout=layout,
                 f32=t["f32"].median, bf16=t["bf16"].median, acc=t["acc"].median,
                 bf16_speedup=t["f32"].median / t["bf16"].median,
                 acc_speedup=t["f32"].median / t["acc"].median,
                 acc_gflops=flops / t["acc"].median / 1e9,
                 f32_gflops=flops / t["f32"].median / 1e9,
                 dots=harness.format_census(census),
                 dots_bf16=harness.format_census(census_bf16),
                 spread=max(v.spread for v in t.values()))
      table.add(**row)
      if layout == "x @ w":
        forward[(m, k, n)] = row
      result.data[f"{m}x{k}x{n} {layout}"] = {
          "timings": t, "census": census, "census_bf16": census_bf16}
  speedups = [r["acc_speedup"] for r in forward.values()]
  best = max(forward.values(), key=lambda r: r["acc_speedup"])
  result.notes.append(
      "Claim checked: \"bf16 × bf16 with f32 accumulation is ~2.4× faster than "
      f"f32\": measured {min(speedups):.2f}×–{max(speedups):.2f}× on the forward "
      f"layout (best {best['acc_speedup']:.2f}× at {best['shape']}).")
  slower = [r["shape"] for r in forward.values() if r["bf16_speedup"] < 1]
  result.notes.append(
      "Claim checked: \"a bf16-output matmul is slower than f32\": "
      + (f"true at {', '.join(slower)}" if slower else "not observed on the forward layout")
      + "; bf16→bf16 speed-ups on the forward layout: "
      + ", ".join(f"{r['bf16_speedup']:.2f}× ({r['shape']})" for r in forward.values())
      + ".")
  return result
