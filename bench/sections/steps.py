"""Train step time of the same model under each precision variant."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench import harness
from bench import machine
from bench import models
from bench import variants as variants_lib
from bench.harness import BF16_UNITS, Column, SectionResult, Table, Target

NAME = "steps"
TITLE = "Train step time by precision"
DESCRIPTION = (
    "One jitted train step (forward, backward, `optax.adam`, parameters and "
    "optimiser state donated) of the same model on the same batch, for every "
    "variant in `bench/variants.py`. Parameters and Adam state are float32 "
    "in every variant; the variants differ in how the forward and backward "
    "passes are computed. The variants are timed interleaved in one process "
    "and each figure is the median over rounds; ratios are to the f32 step. "
    "`loss` is the first step's loss (all variants compute the same function, "
    "so it should agree to bf16 precision), `grad error` the global relative "
    "error of its gradients against the f32 variant's (not with `--quick` or "
    "`--dry-run`). "
    "`dots` counts the matmuls of the "
    "compiled step by operand dtypes: f32·f32 dots in a bf16 variant are "
    "matmuls XLA ran in float32; `(highest)` / `(high)` is the precision of "
    "a float32 dot (`high`: TF32 allowed). The f32 step is traced under "
    "`jax.default_matmul_precision(\"highest\")`; on a GPU a second float32 "
    "baseline, `f32, TF32 allowed`, is traced under `\"tensorfloat32\"` and "
    "every step gets a ratio to it too. `adam only` is the optimiser update "
    "alone on float32 gradients, a floor under every variant's step. Sizes: "
    "MLP 4 × Dense 1024, batch 256 and a transformer block d_model 256, "
    "seq 128, batch 16 on a CPU; 4 × Dense 4096, batch 2048 and d_model 1024, "
    "seq 512, batch 16 on a GPU. Targets: the bf16 MLP step (jmp_lite, and "
    "the hand-written references) ≤ 0.5× f32 on devices with bf16 matrix "
    "units; jmp_lite's step within 2% of the same step written by hand, on "
    "all hardware.")


def make_step(loss_fn, opt, value_and_grad=jax.value_and_grad):
  def step(params, opt_state, x, y):
    loss, grads = value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return jax.jit(step, donate_argnums=(0, 1))


@jax.jit
def _copy(tree):
  return jax.tree_util.tree_map(jnp.copy, tree)


class _Stepper:
  """A train step that feeds its outputs back in (its inputs are donated)."""

  def __init__(self, step, params, opt_state, x, y):
    self.step, self.x, self.y = step, x, y
    self.params, self.opt_state = params, opt_state

  def __call__(self):
    self.params, self.opt_state, loss = self.step(
        self.params, self.opt_state, self.x, self.y)
    return self.params, self.opt_state, loss


def _relative_error(tree, ref):
  """``|tree - ref| / |ref|`` over all leaves together (global norms)."""
  num = den = 0.0
  for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(ref)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    num += float(np.sum((a - b) ** 2))
    den += float(np.sum(b ** 2))
  return (num / den) ** 0.5


def bench_workload(w: models.Workload, ctx: harness.Context, result: SectionResult):
  ctx.log(f"steps: {w.description}")
  opt = optax.adam(1e-3)
  init_opt = jax.jit(opt.init)
  params0 = w.init(ctx.seed)
  x, y = w.batch(ctx.seed)
  variants = variants_lib.active(ctx)
  steppers, first_loss, grad_err, census, missing = {}, {}, {}, {}, {}
  ref_grads = None
  for v in variants:
    loss_fn = v.make_loss(w)
    if loss_fn is None:
      missing[v.name] = "unavailable: " + (v.unavailable or "no loss function")
      continue
    start = time.perf_counter()
    try:
      params = _copy(params0)
      opt_state = init_opt(params)
      # Compile once; the Compiled object runs the step and shows its HLO.
      # The variant's matmul precision (if any) applies while it is traced.
      with v.precision_scope():
        step = make_step(loss_fn, opt, v.value_and_grad).lower(
            params, opt_state, x, y).compile()
        if not (ctx.quick or ctx.dry_run):  # a compilation more per variant
          loss, grads = jax.jit(v.value_and_grad(loss_fn))(params0, x, y)
          first_loss[v.name] = float(loss)
          ref_grads = ref_grads if ref_grads is not None else grads
          grad_err[v.name] = _relative_error(grads, ref_grads)
      census[v.name] = harness.dot_census(step.as_text())
      stepper = _Stepper(step, params, opt_state, x, y)
      # The first step's loss is the loss at params0 (fails here if XLA
      # cannot run the step).
      loss = float(harness.block(stepper())[2])
      first_loss.setdefault(v.name, loss)
      steppers[v.name] = stepper
      ctx.log(f"steps: {v.name} compiled and run once in "
              f"{time.perf_counter() - start:.1f} s")
    except Exception as e:  # a variant that cannot run is a finding, not a crash
      missing[v.name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
      ctx.log(f"steps: {v.name} failed: {missing[v.name]}")

  grads = _copy(params0)
  adam_only = jax.jit(lambda g, s, p: optax.apply_updates(p, opt.update(g, s, p)[0]))
  adam_state = init_opt(params0)
  thunks = dict(steppers)
  thunks["adam_only"] = lambda: adam_only(grads, adam_state, params0)
  t = harness.measure(thunks, ctx)

  f32 = t["f32"].median
  tf32 = t["f32_tf32"].median if "f32_tf32" in t else None
  columns = [Column("variant", "variant"), Column("ms", "step ms", "ms"),
             Column("vs_f32", "vs f32", "ratio")]
  if ctx.tf32:
    columns.append(Column("vs_tf32", "vs f32 with TF32", "ratio"))
  columns += [Column("loss", "loss", "{:.4f}"),
              Column("grad_err", "grad error vs f32", "{:.1e}"),
              Column("dots", "compiled dots (lhs·rhs→out)"),
              Column("spread", "spread", "pct")]
  table = Table(f"{w.name}: train step (ms) — {w.description}", columns)
  for v in variants:
    if v.name in missing:
      table.add(variant=v.label, dots=missing[v.name])
      continue
    row = dict(variant=v.label, ms=t[v.name].median,
               vs_f32=t[v.name].median / f32, loss=first_loss[v.name],
               grad_err=grad_err.get(v.name),
               dots=harness.format_census(census[v.name]),
               spread=t[v.name].spread)
    if ctx.tf32:
      row["vs_tf32"] = t[v.name].median / tf32 if tf32 else None
    table.add(**row)
  row = dict(variant="adam only (update + apply, f32)", ms=t["adam_only"].median,
             vs_f32=t["adam_only"].median / f32, spread=t["adam_only"].spread)
  if ctx.tf32:
    row["vs_tf32"] = t["adam_only"].median / tf32 if tf32 else None
  table.add(**row)
  table.notes.append(
      f"Parameters: {sum(p.size for p in jax.tree_util.tree_leaves(params0)):,} "
      "float32; loss is softmax cross-entropy in float32 in every variant.")
  if ctx.tf32:
    table.notes.append(
        "Two float32 baselines: `f32` at precision highest (no TF32) and `f32, "
        "TF32 allowed` (precision tensorfloat32: float32 storage, tensor-core "
        "matmuls with a 10-bit mantissa, the GPU default for many users).")
  peak = machine.peak_device_memory()
  if peak is not None:
    table.notes.append(f"Device memory high-water mark after this workload: "
                       f"{harness.human_bytes(peak)}.")
  result.tables.append(table)

  def ratio(name):
    return t[name].median / f32 if name in t else None

  if w.name == "mlp":
    result.targets.append(Target(
        "bf16 MLP train step (jmp_lite wrap) ≤ 0.5× f32", ratio("jmp_lite_wrap"),
        0.5, "<=", applies_to=BF16_UNITS))
    for name in ("hand_bf16", "hand_bf16_vjp"):
      result.targets.append(Target(
          f"bf16 MLP train step ({variants_lib.get(name).label}, the reference "
          "for jmp_lite) ≤ 0.5× f32", ratio(name), 0.5, "<=",
          applies_to=BF16_UNITS))
  for v in variants:
    if v.compare_to:
      value = None
      if v.name in t and v.compare_to in t:
        value = t[v.name].median / t[v.compare_to].median
      result.targets.append(Target(
          f"{w.name} train step: {v.label} within 2% of "
          f"{variants_lib.get(v.compare_to).label}", value, 1.02, "<="))
  result.data[w.name] = {"timings": t, "census": census,
                         "first_loss": first_loss, "unavailable": missing,
                         "peak_device_bytes": peak}


def run(ctx: harness.Context) -> SectionResult:
  result = SectionResult()
  for make in models.WORKLOADS.values():
    bench_workload(make(ctx.size_key), ctx, result)
  return result
