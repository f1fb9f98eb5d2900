"""What checking a step's results costs: the guarded update vs gradients-only checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from bench import harness
from bench import machine
from bench.harness import Column, SectionResult, Table, Target

NAME = "guard"
TITLE = "Guarded update: checking updates, new parameters and new state"
DESCRIPTION = (
    "One whole optimizer step (`with_loss_scale(adam).update` then "
    "`apply_updates`, jitted together, the parameters and the state donated "
    "and fed back in, as a training loop runs it) on 256 M parameters (1 GiB "
    "in float32; fewer if the memory available is under 64 bytes per "
    "parameter: the device's on a GPU, the host's on a CPU; 16 M with "
    "`--quick`) in 100 leaves, with float32 and with bfloat16 parameters "
    "(whose Adam state is float32). Guarded: `jmp_lite.optax."
    "with_loss_scale`, which applies a step only if the gradients, the "
    "updates, the new parameters and the new optimizer state are all finite. "
    "Gradients only: the same transformation with the result checks switched "
    "off (a private factory kept for this measurement), which checks only the "
    "gradients, as loss scalers usually do. Guarded, results checked: the "
    "guard traced with no array counted large enough to be checked on a "
    "second computation of the step (`jmp_lite._checks.COPY_FROM`), so it "
    "checks what the step computed, as it did for every array before. "
    "Reported: time per step, "
    "interleaved, median; XLA's temporary buffers for the step "
    "(`compiled.memory_analysis().temp_size_in_bytes`). Targets, on all "
    "hardware: guarded ≤ 1.15× gradients-only in time, and no more "
    "temporary memory than gradients-only (≤ 1.01×: a few scalars).")

NUM_LEAVES = 100
# The guard as it checked every array before arrays of `_checks.COPY_FROM`
# elements were checked on a copy of the step: on its results.
RESULTS = "guarded, results checked"
SCALE = 2.0 ** 15


def run(ctx: harness.Context) -> SectionResult:
  import jmp_lite
  from jmp_lite import _checks
  from jmp_lite import optax as jo

  # About 53 bytes per parameter are live at the peak (f32 parameters and
  # two Adam moments for each of the three steps, donated and fed back in,
  # the gradients, and XLA's temporaries, up to 13): budget 64 bytes of the
  # device's memory (the host's available memory on a CPU).
  m = 2**20
  count = ctx.pick(full=machine.bounded_bytes(256 * m * 64, 1) // 64,
                   quick=16 * m, dry=m // 4,
                   gpu=machine.bounded_bytes(256 * m * 64, 1) // 64,
                   gpu_quick=machine.bounded_bytes(64 * m * 64, 1) // 64)
  num_leaves = ctx.pick(full=NUM_LEAVES, quick=NUM_LEAVES, dry=8)
  n = count // num_leaves
  table = Table(
      f"One Adam step over {count / 2**20:.3g} M parameters in {num_leaves} leaves",
      [Column("params", "parameters"), Column("path", "checks"),
       Column("ms", "ms per step", "ms"),
       Column("ratio", "vs gradients only", "ratio"),
       Column("spread", "spread", "pct"),
       Column("temp", "XLA temporaries", "bytes")])
  result = SectionResult(tables=[table])
  data = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    keys = jax.random.split(jax.random.PRNGKey(ctx.seed), num_leaves)
    make = jax.jit(lambda k: (jax.random.normal(k, (n,), jnp.float32) * SCALE
                              * 1e-4).astype(dtype))
    grads = [harness.block(make(k)) for k in keys]
    ones = jax.jit(lambda: jnp.ones((n,), dtype))
    # One loss scale each: a step donates its state, the scale's array too.
    txs = {
        "gradients only": jo._with_loss_scale(
            optax.adam(1e-3), jmp_lite.StaticLossScale(SCALE), clip_norm=None,
            accumulate_steps=1, axis_name=None, check_results=False),
        RESULTS: jo.with_loss_scale(optax.adam(1e-3), jmp_lite.StaticLossScale(SCALE)),
        "guarded": jo.with_loss_scale(optax.adam(1e-3), jmp_lite.StaticLossScale(SCALE)),
    }
    fns, carry, temp = {}, {}, {}
    for name, tx in txs.items():
      def step(params, state, grads, tx=tx):
        updates, state = tx.update(grads, state, params)
        return jo.apply_updates(params, updates), state
      params = [harness.block(ones()) for _ in range(num_leaves)]
      carry[name] = (params, tx.init(params))
      # The guard decides how to check while it is traced: the results-checked
      # variant is traced with no array large enough for the copy.
      copy_from = _checks.COPY_FROM
      _checks.COPY_FROM = copy_from if name != RESULTS else float("inf")
      try:
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
            *carry[name], grads).compile()
      finally:
        _checks.COPY_FROM = copy_from
      temp[name] = compiled.memory_analysis().temp_size_in_bytes

      def call(name=name, compiled=compiled, carry=carry, grads=grads):
        carry[name] = compiled(*carry[name], grads)
        return carry[name]
      fns[name] = call
    # The three compute the same step.
    a, b, c = fns["guarded"](), fns["gradients only"](), fns[RESULTS]()
    same = all(bool(jnp.array_equal(x, y)) and bool(jnp.array_equal(x, z))
               for x, y, z in zip(a[0], b[0], c[0]))
    del a, b, c
    t = harness.measure(fns, ctx)
    label = jnp.dtype(dtype).name
    for name in ("gradients only", RESULTS, "guarded"):
      table.add(params=label, path=name, ms=t[name].median,
                ratio=t[name].median / t["gradients only"].median,
                spread=t[name].spread, temp=temp[name])
    ratio = t["guarded"].median / t["gradients only"].median
    result.targets.append(Target(
        f"guarded Adam step (updates, params, state checked) ≤ 1.15× "
        f"gradients-only ({label} params)", ratio, 1.15, "<="))
    memory = temp["guarded"] / max(temp["gradients only"], 1)
    # 1.01: a few scalars more are not memory.
    result.targets.append(Target(
        f"guarded Adam step's XLA temporaries ≤ 1.01× gradients-only's ({label} "
        "params)", memory, 1.01, "<="))
    result.notes.append(f"{label}: the three steps' new params bitwise equal: {same}")
    data[label] = {"timings": t, "ratio": ratio, "bitwise_equal": same,
                   "temp_bytes": temp, "temp_ratio": memory}
    del grads, params, carry, fns
  result.data = data
  return result
