"""Compilations over a run whose loss scale changes (issues 2 and 5)."""

from __future__ import annotations

import time

import jax
import jax.monitoring
import jax.numpy as jnp
import optax

from bench import harness
from bench.harness import Column, SectionResult, Table, Target

NAME = "compiles"
TITLE = "Compilations while the loss scale changes"
DESCRIPTION = (
    "A jitted loss-scaled train step (scale the loss, unscale the gradients, "
    "`all_finite`, `adjust`, `select_tree` between the Adam update and the "
    "old state) of a small float32 MLP, run for 50 steps. Every 5th step is "
    "forced to overflow (the loss is multiplied by inf through a traced flag), "
    "so dynamic scales shrink there and grow on every other step "
    "(`period=1`); static scales get a new value each step from a cycle of 16 "
    "(20 steps and a cycle of 4 with `--quick`). "
    "Each scenario uses a fresh `jax.jit` of the same Python step and its own "
    "library (jmp_lite or jmp 0.0.4) for every loss-scale call. Counted: "
    "Python traces of the step, the jit's cache entries, and XLA backend "
    "compilations (any function) during the steps; the wall time of the "
    "steps includes the compilations. Target (issue 5): one compilation.")

NUM_STEPS = 50
OVERFLOW_EVERY = 5
STATIC_VALUES = 16  # distinct values a static scale cycles through

_backend_compiles = [0]
_listening = [False]


def _listen():
  if _listening[0]:
    return

  def on_event(event, duration, **kwargs):
    del duration, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      _backend_compiles[0] += 1

  jax.monitoring.register_event_duration_secs_listener(on_event)
  _listening[0] = True


def _model(seed):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  params = {"w1": jax.random.normal(k1, (32, 64)) / 32**0.5,
            "b1": jnp.zeros(64), "w2": jax.random.normal(k2, (64, 10)) / 8.0,
            "b2": jnp.zeros(10)}
  x = jax.random.normal(k3, (16, 32))
  y = jnp.arange(16) % 10
  return params, x, y


def _loss(params, x, y):
  h = jax.nn.relu(x @ params["w1"] + params["b1"])
  logits = h @ params["w2"] + params["b2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _make_step(lib, opt, traces):
  def step(params, opt_state, loss_scale, x, y, overflow):
    traces[0] += 1

    def scaled_loss(p):
      poison = jnp.where(overflow, jnp.inf, 1.0).astype(jnp.float32)
      return loss_scale.scale(_loss(p, x, y) * poison)

    grads = loss_scale.unscale(jax.grad(scaled_loss)(params))
    finite = lib.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = opt.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = lib.select_tree(
        finite, (new_params, new_opt_state), (params, opt_state))
    return params, opt_state, loss_scale, finite
  return step


def _scenarios(cycle):
  import jmp

  import jmp_lite

  def static(lib):
    return lambda i, prev: lib.StaticLossScale(2.0 ** (i % cycle))

  def dynamic(make):
    return lambda i, prev: make() if prev is None else prev

  # (label, library, loss scale for step i given the previous step's output)
  return [
      ("jmp_lite.DynamicLossScale(2.0**15, period=1)", jmp_lite,
       dynamic(lambda: jmp_lite.DynamicLossScale(2.0**15, period=1))),
      ("jmp_lite.StaticLossScale(v), new v each step", jmp_lite, static(jmp_lite)),
      ("jmp.DynamicLossScale(jnp.float32(2**15), period=1)", jmp,
       dynamic(lambda: jmp.DynamicLossScale(jnp.float32(2**15), period=1))),
      ("jmp.DynamicLossScale(2.0**15, period=1) (Python float)", jmp,
       dynamic(lambda: jmp.DynamicLossScale(2.0**15, period=1))),
      ("jmp.StaticLossScale(v), new v each step", jmp, static(jmp)),
  ]


def run(ctx: harness.Context) -> SectionResult:
  _listen()
  opt = optax.adam(1e-3)
  params0, x, y = _model(ctx.seed)
  num_steps = 20 if ctx.quick else NUM_STEPS
  cycle = 4 if ctx.quick else STATIC_VALUES
  table = Table(
      f"{num_steps} steps, overflow forced every {OVERFLOW_EVERY}th step, "
      f"static scales cycle through {cycle} values",
      [Column("scenario", "loss scale"), Column("traces", "traces", "{}"),
       Column("cache", "jit cache entries", "{}"),
       Column("xla", "XLA compiles", "{}"),
       Column("skipped", "skipped steps", "{}"),
       Column("final", "final scale", "{:.4g}"),
       Column("seconds", "wall time (s)", "{:.2f}")])
  result = SectionResult(tables=[table])
  for label, lib, make_scale in _scenarios(cycle):
    traces = [0]
    step = jax.jit(_make_step(lib, opt, traces))
    params, opt_state = params0, opt.init(params0)
    flags = [jnp.asarray(i % OVERFLOW_EVERY == OVERFLOW_EVERY - 1)
             for i in range(num_steps)]
    harness.block(flags)
    loss_scale, skipped = None, 0
    before = _backend_compiles[0]
    start = time.perf_counter()
    for i in range(num_steps):
      loss_scale = make_scale(i, loss_scale)
      params, opt_state, loss_scale, finite = step(
          params, opt_state, loss_scale, x, y, flags[i])
      skipped += int(not bool(finite))
    harness.block(params)
    seconds = time.perf_counter() - start
    table.add(scenario=label, traces=traces[0], cache=step._cache_size(),
              xla=_backend_compiles[0] - before, skipped=skipped,
              final=float(jnp.asarray(loss_scale.loss_scale)), seconds=seconds)
    if lib.__name__ == "jmp_lite":
      result.targets.append(Target(
          f"one compilation: {label}",
          float(max(traces[0], _backend_compiles[0] - before)), 1, "<=",
          unit=" compile(s)"))
  table.notes.append(
      "traces counts Python executions of the step function (one per "
      "compilation of it); XLA compiles also counts anything else compiled "
      "during the loop (none expected). jit cache entries counts the C++ "
      "dispatch cache, keyed by the arguments' concrete types: jmp's default "
      "NumPy `counter` and the jax.Array that replaces it after one step make "
      "two entries that share one trace and one executable. Dynamic scales start at 2**15, grow "
      "×2 on each finite step and halve on each overflow.")
  return result
