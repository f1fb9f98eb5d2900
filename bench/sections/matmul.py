"""Matrix multiply speed by precision: the hardware fact mixed precision rests on."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax

from bench import harness
from bench.harness import Column, SectionResult, Table

NAME = "matmul"
TITLE = "Matrix multiplies: f32 vs bf16"
DESCRIPTION = (
    "One jitted `lax.dot_general` per cell, on the shapes of the MLP's "
    "layers and of the transformer's MLP: f32 × f32 → f32 (traced under "
    "`jax.default_matmul_precision(\"highest\")`); bf16 × bf16 → bf16 "
    "(what `x @ w` does on bf16 arrays, and what Flax's `dtype=bf16` layers "
    "run); and bf16 × bf16 with f32 accumulation (`preferred_element_type="
    "float32`) rounded to bf16 afterwards. On a GPU, also f32 × f32 → f32 with "
    "TF32 allowed (`\"tensorfloat32\"`), and the bf16 speed-ups relative to "
    "it. Three layouts per shape: `x @ w` "
    "(forward), `g @ wᵀ` (input gradient) and `xᵀ @ g` (weight gradient, "
    "which contracts the leading dimension of its left operand). The dots "
    "columns are what XLA actually compiled: the operand and output dtypes of "
    "every matmul in the optimised HLO (f32·f32 means XLA upcast the bf16 "
    "operands and ran the dot in float32, as XLA:CPU does without bf16 "
    "instructions).")

_NN = ((1,), (0,))  # x[m,k] @ w[k,n]
_NT = ((1,), (1,))  # g[m,n] @ w[k,n]^T
_TN = ((0,), (0,))  # x[m,k]^T @ g[m,n]


def _plain(dims):
  return lambda a, b: lax.dot_general(a, b, (dims, ((), ())))


def _bf16_acc(dims):
  return lambda a, b: lax.dot_general(
      a, b, (dims, ((), ())), preferred_element_type=jnp.float32
  ).astype(jnp.bfloat16)


def _compile(fn, args, precision=None):
  """``jax.jit(fn)`` compiled for ``args``, traced under ``precision``."""
  scope = (jax.default_matmul_precision(precision) if precision
           else contextlib.nullcontext())
  with scope:
    return jax.jit(fn).lower(*args).compile()


def _shapes(ctx: harness.Context):
  # (tokens, in, out). CPU: an MLP layer at batch 256 with widths 1024 and
  # 4096, and the transformer block's MLP (16 x 128 tokens, 256 -> 1024).
  # GPU: the GPU plan's MLP layer (batch 2048, width 4096) and transformer
  # MLP (16 x 512 tokens, 1024 -> 4096).
  return ctx.pick(
      full=[(256, 1024, 1024), (256, 4096, 4096), (4096, 256, 1024)],
      quick=[(64, 256, 256), (256, 512, 512)],
      dry=[(16, 32, 64)],
      gpu=[(2048, 4096, 4096), (8192, 1024, 4096)],
      gpu_quick=[(512, 2048, 2048), (2048, 512, 2048)])


def run(ctx: harness.Context) -> SectionResult:
  columns = [Column("shape", "m × k × n"), Column("layout", "layout"),
             Column("f32", "f32 ms", "ms")]
  if ctx.tf32:
    columns.append(Column("tf32", "f32 TF32 ms", "ms"))
  columns += [Column("bf16", "bf16→bf16 ms", "ms"),
              Column("acc", "bf16 f32-acc ms", "ms"),
              Column("bf16_speedup", "bf16→bf16 speed-up", "ratio"),
              Column("acc_speedup", "f32-acc speed-up", "ratio")]
  if ctx.tf32:
    columns.append(Column("acc_vs_tf32", "f32-acc speed-up vs TF32", "ratio"))
  columns += [Column("acc_gflops", "f32-acc GFLOP/s", "{:.0f}"),
              Column("f32_gflops", "f32 GFLOP/s", "{:.0f}"),
              Column("dots_bf16", "compiled dots (bf16→bf16)"),
              Column("dots", "compiled dots (f32-acc)"),
              Column("spread", "spread", "pct")]
  table = Table("Time per matmul (ms) and speed relative to f32 (>1 is faster)",
                columns)
  result = SectionResult(tables=[table])
  forward = {}
  for m, k, n in _shapes(ctx):
    key_a, key_b = jax.random.split(jax.random.PRNGKey(ctx.seed))
    x = jax.random.normal(key_a, (m, k), jnp.float32)
    w = jax.random.normal(key_b, (k, n), jnp.float32) / k**0.5
    g = jax.random.normal(key_b, (m, n), jnp.float32)
    for layout, dims, (a, b) in (("x @ w", _NN, (x, w)), ("g @ wᵀ", _NT, (g, w)),
                                 ("xᵀ @ g", _TN, (x, g))):
      ab, bb = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
      compiled = {"f32": _compile(_plain(dims), (a, b), "highest"),
                  "bf16": _compile(_plain(dims), (ab, bb)),
                  "acc": _compile(_bf16_acc(dims), (ab, bb))}
      args = {"f32": (a, b), "bf16": (ab, bb), "acc": (ab, bb)}
      if ctx.tf32:
        compiled["tf32"] = _compile(_plain(dims), (a, b), "tensorfloat32")
        args["tf32"] = (a, b)
      t = harness.measure({k_: (lambda f=f, a_=args[k_]: f(*a_))
                           for k_, f in compiled.items()}, ctx)
      census = harness.dot_census(compiled["acc"].as_text())
      census_bf16 = harness.dot_census(compiled["bf16"].as_text())
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
      if ctx.tf32:
        row.update(tf32=t["tf32"].median,
                   acc_vs_tf32=t["tf32"].median / t["acc"].median)
      table.add(**row)
      if layout == "x @ w":
        forward[(m, k, n)] = row
      result.data[f"{m}x{k}x{n} {layout}"] = {
          "timings": t, "census": census, "census_bf16": census_bf16}
  speedups = [r["acc_speedup"] for r in forward.values()]
  best = max(forward.values(), key=lambda r: r["acc_speedup"])
  result.notes.append(
      "bf16 × bf16 with f32 accumulation against f32, forward layout: "
      f"{min(speedups):.2f}×–{max(speedups):.2f}× the speed (best "
      f"{best['acc_speedup']:.2f}× at {best['shape']}); expect ≥ 1.3× with "
      "bf16 matrix units, < 1× without them"
      + ("." if ctx.bf16_units else " (this hardware has none)."))
  if ctx.tf32:
    result.notes.append(
        "Against f32 with TF32 allowed, forward layout: "
        + ", ".join(f"{r['acc_vs_tf32']:.2f}× ({r['shape']})"
                    for r in forward.values()) + ".")
  slower = [r["shape"] for r in forward.values() if r["bf16_speedup"] < 1]
  result.notes.append(
      "A bf16-output matmul slower than f32: "
      + (f"yes at {', '.join(slower)}" if slower else "not on the forward layout")
      + "; bf16→bf16 speed-ups on the forward layout: "
      + ", ".join(f"{r['bf16_speedup']:.2f}× ({r['shape']})" for r in forward.values())
      + ".")
  return result
