"""What precision telemetry costs: off, on every step, sampled; at run time
and at compile time."""

from __future__ import annotations

import statistics
import time

import jax
import optax

from bench import harness
from bench import models
from bench.harness import Column, SectionResult, Table, Target

NAME = "telemetry"
TITLE = "Precision telemetry: its cost when off, sampled and on"
DESCRIPTION = (
    "The jitted `jmp_lite.TrainState.minimize` step of each workload (`mlp`: "
    "4 Dense layers; `mlp_ln`: 4 Dense layers with a LayerNorm after each "
    "hidden one; `transformer`: a block of attention, two LayerNorms and an "
    "MLP, a final LayerNorm and a head, the workload with the most modules "
    "to probe) under "
    "`jmp_lite.flax.wrap` (policy `p=f32,c=bf16,o=f32`, Adam, a dynamic loss "
    "scale), timed side by side: without telemetry, with "
    "`Telemetry(every=10)` (each probe's reductions in a `lax.cond`; "
    "each timed call runs 10 steps, so one of them measures) and with "
    "`Telemetry()` (every step measures each module's output and cotangent). "
    "Then the compile time of one step, the same three ways: a fresh Python "
    "function under a fresh `jax.jit`, `jit(step).lower(state, x, y)` (trace "
    "and lower) then `.compile()` (XLA), rounds in rotating order, medians. "
    "Telemetry adds reductions and, when sampled, a `lax.cond` for every "
    "probed module, so its compile time grows with the number of modules: "
    "before a fix it took 29× the plain step's on a 2-layer BERT. "
    "Targets, on all hardware: run time sampled ≤ 1.10× off (the cost is "
    "amortised), on ≤ 2.0× off (a few reductions over every module output "
    "and cotangent); trace+lower+compile, sampled and on, ≤ 3.0× off, so "
    "that the compile-time cost stays bounded.")

SAMPLE_EVERY = 10
COMPILE_GOAL = 3.0
POLICY = "p=f32,c=bf16,o=f32"
# The `jax.monitoring` event JAX records when the persistent compilation cache
# (JAX_COMPILATION_CACHE_DIR) returns an executable instead of compiling it
# (as in the `compile_time` section).
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def _state(module, params):
  """A fresh `jmp_lite.TrainState` of ``module`` (wrapped) over ``params``."""
  import jmp_lite

  return jmp_lite.TrainState.create(
      apply_fn=module.apply, params=params, tx=optax.adam(1e-3),
      loss_scale=jmp_lite.DynamicLossScale(2.0 ** 15), policy=POLICY)


def _steps(w, telemetry, ctx):
  import jmp_lite.flax

  module = jmp_lite.flax.wrap(w.module(None), POLICY)
  x, y = w.batch(ctx.seed)
  state = _state(module, w.init(ctx.seed))

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


def _compile_once(w, telemetry, params, x, y) -> dict:
  """Trace+lower and XLA compile seconds of one step, compiled from scratch.

  The module, the step and its `jax.jit` are new objects on every call, so
  that nothing JAX caches in memory (traces keyed by function, lowerings by
  jaxpr) serves the measurement. The batch is passed as arguments rather
  than closed over: closed-over arrays would be folded into the program as
  constants, which the plain step would pay for as well as telemetry.

  Args:
    w: the `models.Workload`.
    telemetry: a `jmp_lite.Telemetry`, or None for the plain step.
    params: the workload's float32 parameters (shared between calls).
    x, y: the batch.

  Returns:
    ``lower_s``, ``compile_s`` and ``total_s`` in seconds, and ``cached``:
    whether JAX's persistent compilation cache returned the executable (then
    ``compile_s`` is a cache read, not a compilation).
  """
  import jmp_lite.flax

  module = jmp_lite.flax.wrap(w.module(None), POLICY)
  state = _state(module, params)

  def step(state, x, y):
    def loss(p, x, y):
      return models.cross_entropy(state.apply_fn({"params": p}, x), y)
    return state.minimize(loss, x, y, telemetry=telemetry)

  hits = []

  def listener(event, **kwargs):
    del kwargs
    if event == _CACHE_HIT:
      hits.append(event)

  t0 = time.perf_counter()
  lowered = jax.jit(step).lower(state, x, y)
  t1 = time.perf_counter()
  jax.monitoring.register_event_listener(listener)
  try:
    lowered.compile()
  finally:
    jax.monitoring.unregister_event_listener(listener)
  t2 = time.perf_counter()
  return {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0,
          "cached": bool(hits)}


def _compile_times(w, variants, rounds, ctx) -> dict[str, dict]:
  """Median compile figures of one step per telemetry variant.

  Each round compiles every variant once, in an order that rotates from
  round to round, so that a drift in the machine's load (or a first use that
  a warm-up missed) is spread over all of them rather than charged to the
  first. Samples served by the persistent compilation cache are left out of
  the medians whenever a variant has a compiled one: repeating a round
  compiles the same program, which an enabled cache would otherwise answer
  from the second round on.

  Returns:
    variant name -> ``lower_s``, ``compile_s``, ``total_s`` (medians),
    ``samples`` (every sample) and ``cached`` (how many were cache reads).
  """
  params = w.init(ctx.seed)
  x, y = w.batch(ctx.seed)
  harness.block((params, x, y))
  names = list(variants)
  samples: dict[str, list[dict]] = {n: [] for n in names}
  for r in range(rounds):
    shift = r % len(names)
    for name in names[shift:] + names[:shift]:
      samples[name].append(_compile_once(w, variants[name], params, x, y))
  out = {}
  for name, got in samples.items():
    fresh = [s for s in got if not s["cached"]] or got
    out[name] = {k: statistics.median(s[k] for s in fresh)
                 for k in ("lower_s", "compile_s", "total_s")}
    out[name]["samples"] = got
    out[name]["cached"] = sum(s["cached"] for s in got)
  return out


def run(ctx: harness.Context) -> SectionResult:
  import jmp_lite

  result = SectionResult()
  table = Table(
      f"TrainState.minimize, {SAMPLE_EVERY} steps per call",
      [Column("model", "model"), Column("variant", "telemetry"),
       Column("time", f"ms per {SAMPLE_EVERY} steps", "ms"),
       Column("vs_off", "vs off", "ratio"), Column("modules", "modules probed", "{}")])
  compile_table = Table(
      "Trace+lower and XLA compile time of one TrainState.minimize step",
      [Column("model", "model"), Column("variant", "telemetry"),
       Column("lower", "trace+lower s", "{:.2f}"),
       Column("compile", "compile s", "{:.2f}"),
       Column("total", "total s", "{:.2f}"),
       Column("vs_off", "total vs off", "ratio"),
       Column("compile_vs_off", "compile vs off", "ratio")])
  result.tables += [table, compile_table]
  variants = {"off": None,
              f"every={SAMPLE_EVERY}": jmp_lite.Telemetry(every=SAMPLE_EVERY),
              "every step": jmp_lite.Telemetry()}
  # A single compilation moves by tens of percent under a shared machine's
  # load; three rounds give a median at about 1 min per round on a 2-core CPU.
  rounds = ctx.pick(full=3, quick=2, dry=1)
  cached = 0
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

    # After the timings, whose warm-up compiled all three steps (in a scan):
    # first-use costs (imports, one-time set-up) are paid by then.
    compiled = _compile_times(w, variants, rounds, ctx)
    base = compiled["off"]
    ctx.log(f"telemetry: {w.name} compile: " + ", ".join(
        f"{n} {c['total_s']:.1f} s" for n, c in compiled.items()))
    for name, c in compiled.items():
      compile_table.add(model=w.name, variant=name, lower=c["lower_s"],
                        compile=c["compile_s"], total=c["total_s"],
                        vs_off=c["total_s"] / base["total_s"],
                        compile_vs_off=c["compile_s"] / base["compile_s"])
      result.data[f"{w.name}/compile/{name}"] = c
      cached += c["cached"]
    result.targets.append(Target(
        f"{w.name}: trace+lower+compile with Telemetry(every={SAMPLE_EVERY}) "
        f"≤ {COMPILE_GOAL:g}× off",
        compiled[f"every={SAMPLE_EVERY}"]["total_s"] / base["total_s"],
        COMPILE_GOAL, "<="))
    result.targets.append(Target(
        f"{w.name}: trace+lower+compile with Telemetry() ≤ {COMPILE_GOAL:g}× off",
        compiled["every step"]["total_s"] / base["total_s"], COMPILE_GOAL, "<="))
  table.notes.append(
      "Off is the step as it was before telemetry existed: `minimize` without "
      "`telemetry` builds the same jaxpr.")
  each = (f"the median of {rounds} compilations" if rounds > 1
          else "a single compilation")
  compile_table.notes.append(
      f"One step (not the {SAMPLE_EVERY}-step scan timed above), each figure "
      f"{each} from scratch (a fresh function under a fresh `jax.jit`), the "
      "variants in an order rotating from round to round. total vs off: trace+lower+"
      "compile over the plain step's (the targets); compile vs off: XLA's "
      "part alone. Telemetry's cost grows with the modules probed (see the "
      "table above).")
  if cached:
    compile_table.notes.append(
        f"{cached} of the compilations were read from JAX's persistent "
        "compilation cache (JAX_COMPILATION_CACHE_DIR is set) and left out "
        "of the medians where a variant had a compiled sample; a variant "
        "with none shows cache reads, not compilations.")
  return result
