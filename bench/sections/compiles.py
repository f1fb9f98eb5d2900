"""Compilations over a run whose loss scale changes."""

from __future__ import annotations

import time

import jax
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
    "Python traces of the step, the distinct argument signatures the jit's "
    "dispatch cache is keyed on, and XLA backend compilations (any function, "
    "`jmp_lite.testing.count_compilations`) during the steps; the wall time "
    "of the steps includes the compilations. Target, on all hardware: one "
    "compilation for jmp_lite's loss scales.")

NUM_STEPS = 50
OVERFLOW_EVERY = 5
STATIC_VALUES = 16  # distinct values a static scale cycles through


def signature(args) -> tuple:
  """What ``jax.jit``'s dispatch cache keys a call on, from public API.

  The tree structure (with its static fields, e.g. a loss scale kept as
  auxiliary data) and, per leaf, its Python type (a NumPy array and a
  jax.Array are separate entries), shape, dtype and weak type. Counting the
  distinct signatures of a run's calls gives its number of cache entries.
  """
  leaves, treedef = jax.tree_util.tree_flatten(args)
  out = []
  for x in leaves:
    try:
      aval = jax.typeof(x)
      out.append((type(x).__name__, tuple(aval.shape), str(aval.dtype),
                  bool(getattr(aval, "weak_type", False))))
    except TypeError:  # not an array-like leaf
      out.append((type(x).__name__, repr(x)))
  return (treedef, tuple(out))


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
  from jmp_lite.testing import count_compilations

  opt = optax.adam(1e-3)
  params0, x, y = _model(ctx.seed)
  num_steps = ctx.pick(full=NUM_STEPS, quick=20, dry=2 * OVERFLOW_EVERY)
  cycle = ctx.pick(full=STATIC_VALUES, quick=4, dry=2)
  table = Table(
      f"{num_steps} steps, overflow forced every {OVERFLOW_EVERY}th step, "
      f"static scales cycle through {cycle} values",
      [Column("scenario", "loss scale"), Column("traces", "traces", "{}"),
       Column("cache", "jit cache entries (argument signatures)", "{}"),
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
    skipped, signatures = 0, set()
    # The first scale is made before counting: constructing a scale from a
    # Python float may compile a conversion once per process, not per step.
    loss_scale = make_scale(0, None)
    start = time.perf_counter()
    with count_compilations() as compiled:
      for i in range(num_steps):
        if i:
          loss_scale = make_scale(i, loss_scale)
        args = (params, opt_state, loss_scale, x, y, flags[i])
        signatures.add(signature(args))
        params, opt_state, loss_scale, finite = step(*args)
        skipped += int(not bool(finite))
      harness.block(params)
    seconds = time.perf_counter() - start
    table.add(scenario=label, traces=traces[0], cache=len(signatures),
              xla=len(compiled), skipped=skipped,
              final=float(jnp.asarray(loss_scale.loss_scale)), seconds=seconds)
    if lib.__name__ == "jmp_lite":
      result.targets.append(Target(
          f"compilations of a loss-scaled train step over {num_steps} steps, "
          f"{label}", float(max(traces[0], len(compiled))), 1, "<=",
          unit=" compile(s)"))
  table.notes.append(
      "traces counts Python executions of the step function (one per "
      "compilation of it); XLA compiles also counts anything else compiled "
      "during the loop (none expected). jit cache entries counts the distinct "
      "argument signatures of the calls (tree structure with static fields; "
      "per leaf its type, shape, dtype, weak type), which is what jit's C++ "
      "dispatch cache is keyed on: jmp's default "
      "NumPy `counter` and the jax.Array that replaces it after one step make "
      "two entries that share one trace and one executable. Dynamic scales start at 2**15, grow "
      "×2 on each finite step and halve on each overflow.")
  return result
