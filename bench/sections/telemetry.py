"""What precision telemetry costs: off, on every step, sampled."""

from __future__ import annotations

import jax
import optax

from bench import harness
from bench import models
from bench.harness import Column, SectionResult, Table, Target

NAME = "telemetry"
TITLE = "Precision telemetry: its cost when off, sampled and on"
DESCRIPTION = (
    "The jitted `jmp_lite.TrainState.minimize` step of each workload under "
    "`jmp_lite.flax.wrap` (policy `p=f32,c=bf16,o=f32`, Adam, a dynamic loss "
    "scale), timed side by side: without telemetry, with "
    "`Telemetry(every=10)` (each probe's reductions in a `lax.cond`; "
    "each timed call runs 10 steps, so one of them measures) and with "
    "`Telemetry()` (every step measures each module's output and cotangent). "
    "Targets, on all hardware: sampled ≤ 1.10× off (the cost is "
    "amortised), on ≤ 2.0× off (a few reductions over every module output "
    "and cotangent).")

SAMPLE_EVERY = 10


def _steps(w, telemetry, ctx):
  import jmp_lite
  import jmp_lite.flax

  module = jmp_lite.flax.wrap(w.module(None), "p=f32,c=bf16,o=f32")
  x, y = w.batch(ctx.seed)
  state = jmp_lite.TrainState.create(
      apply_fn=module.apply, params=w.init(ctx.seed), tx=optax.adam(1e-3),
      loss_scale=jmp_lite.DynamicLossScale(2.0 ** 15), policy="p=f32,c=bf16,o=f32")

  def loss(params):
    return models.cross_entropy(module.apply({"params": params}, x), y)

  def one(state):
    return state.minimize(loss, telemetry=telemetry)

  @jax.jit
  def run(state):
    # SAMPLE_EVERY steps per call, so that a sampled run measures once.
    state, info = jax.lax.scan(lambda s, _: one(s), state, None, length=SAMPLE_EVERY)
    return state, info.loss

  holder = [state]

  def call():
    holder[0], losses = run(holder[0])
    return losses

  info = jax.eval_shape(one, state)[1]
  return call, 0 if info.precision is None else len(info.precision.layout)


def run(ctx: harness.Context) -> SectionResult:
  import jmp_lite

  result = SectionResult()
  table = Table(
      f"TrainState.minimize, {SAMPLE_EVERY} steps per call",
      [Column("model", "model"), Column("variant", "telemetry"),
       Column("time", f"ms per {SAMPLE_EVERY} steps", "ms"),
       Column("vs_off", "vs off", "ratio"), Column("modules", "modules probed", "{}")])
  result.tables.append(table)
  variants = {"off": None,
              f"every={SAMPLE_EVERY}": jmp_lite.Telemetry(every=SAMPLE_EVERY),
              "every step": jmp_lite.Telemetry()}
  for make in models.WORKLOADS.values():
    w = make(ctx.size_key)
    ctx.log(f"telemetry: {w.description}")
    built = {name: _steps(w, t, ctx) for name, t in variants.items()}
    timings = harness.measure({n: b[0] for n, b in built.items()}, ctx)
    off = timings["off"].median
    for name, (_, modules) in built.items():
      table.add(model=w.name, variant=name, time=timings[name].median,
                vs_off=timings[name].median / off, modules=modules)
      result.data[f"{w.name}/{name}"] = timings[name].to_json()
    result.targets.append(Target(
        f"{w.name}: Telemetry(every={SAMPLE_EVERY}) ≤ 1.10× off",
        timings[f"every={SAMPLE_EVERY}"].median / off, 1.10, "<="))
    result.targets.append(Target(
        f"{w.name}: Telemetry() every step ≤ 2.0× off",
        timings["every step"].median / off, 2.0, "<="))
  table.notes.append(
      "Off is the step as it was before telemetry existed: `minimize` without "
      "`telemetry` builds the same jaxpr.")
  return result
