"""Loss-scaled update with clipping: jmp_lite's fused path vs the optax chain."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from bench import harness
from bench import machine
from bench.harness import Column, SectionResult, Table, Target

NAME = "fused_clip"
TITLE = "Unscale + finiteness + clip: fused vs chained"
DESCRIPTION = (
    "One update of `optax.sgd` on 1 GiB (64 MiB with `--quick`; on a GPU "
    "2 GiB, at most an eighth of device memory) of scaled "
    "float32 gradients in 100 leaves. Fused: `jmp_lite.optax.with_loss_scale("
    "sgd, scale, clip_norm=1)`, which computes the unscaled norm and the "
    "finiteness flag in one pass and unscales, clips and applies in another. "
    "Chained: the usual `optax.chain(scale(1/scale), clip_by_global_norm(1), "
    "sgd)` plus `jmp.all_finite` on the unscaled gradients and a `select` "
    "between the update and zeros, as jmp's examples do it. Chained + guard: the "
    "same chain, also checking what the fused path guarantees since every "
    "update is guarded (the updates and the new parameters are finite), with "
    "`jmp_lite.all_finite`. Reported: time per "
    "update, interleaved, median. XLA's cost analysis is not used: it adds up "
    "both branches of every conditional, so it charges the fused path for its "
    "skip branch and its rare exact-check branch, which never run together. "
    "Target, on all hardware: the fused update takes no longer than the "
    "chain with the same guarantees (it reads the gradients fewer times, and "
    "the update is memory-bound); the plain chain is reported beside it.")

NUM_LEAVES = 100
SCALE = 2.0 ** 15


def run(ctx: harness.Context) -> SectionResult:
  import jmp

  import jmp_lite

  mib = 2**20
  total = ctx.pick(full=1024 * mib, quick=64 * mib, dry=mib,
                   gpu=machine.bounded_bytes(2048 * mib, 1 / 8),
                   gpu_quick=machine.bounded_bytes(256 * mib, 1 / 8))
  num_leaves = ctx.pick(full=NUM_LEAVES, quick=NUM_LEAVES, dry=8)
  n = total // num_leaves // 4
  make = jax.jit(lambda k: jax.random.normal(k, (n,), jnp.float32) * SCALE * 1e-4)
  keys = jax.random.split(jax.random.PRNGKey(ctx.seed), num_leaves)
  grads = [harness.block(make(k)) for k in keys]
  params = [jnp.zeros_like(g) for g in grads]
  loss_scale = jmp_lite.StaticLossScale(SCALE)

  fused_tx = jmp_lite.optax.with_loss_scale(optax.sgd(0.1), loss_scale, clip_norm=1.0)
  chain_tx = optax.chain(optax.scale(1 / SCALE), optax.clip_by_global_norm(1.0),
                         optax.sgd(0.1))

  def fused(grads, state, params):
    updates, _ = fused_tx.update(grads, state, params)
    return updates

  def chained(grads, state, params):
    updates, _ = chain_tx.update(grads, state, params)
    finite = jmp.all_finite(jax.tree.map(lambda g: g / SCALE, grads))
    return jax.tree.map(lambda u: jax.lax.select(finite, u, jnp.zeros_like(u)), updates)

  def chained_guarded(grads, state, params):
    updates, _ = chain_tx.update(grads, state, params)
    finite = (jmp.all_finite(jax.tree.map(lambda g: g / SCALE, grads))
              & jmp_lite.all_finite(updates)
              & jmp_lite.all_finite(optax.apply_updates(params, updates)))
    return jax.tree.map(lambda u: jax.lax.select(finite, u, jnp.zeros_like(u)), updates)

  fused_state, chain_state = fused_tx.init(params), chain_tx.init(params)
  jf, jc, jg = jax.jit(fused), jax.jit(chained), jax.jit(chained_guarded)
  got_f, got_c = jf(grads, fused_state, params), jc(grads, chain_state, params)
  err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got_f, got_c))
  del got_f, got_c  # twice the gradients' bytes
  t = harness.measure({"fused": lambda: jf(grads, fused_state, params),
                       "chained": lambda: jc(grads, chain_state, params),
                       "chained + guard": lambda: jg(grads, chain_state, params)}, ctx)
  nbytes = harness.tree_bytes(grads)
  table = Table(
      f"One update over {harness.human_bytes(nbytes)} of gradients in {num_leaves} leaves",
      [Column("path", "path"), Column("ms", "ms per update", "ms"),
       Column("vs_chained", "vs chained", "ratio"),
       Column("gbs", "gradient GB/s", "gbs"),
       Column("spread", "spread", "pct")])
  for name in ("chained", "chained + guard", "fused"):
    table.add(path=name, ms=t[name].median,
              vs_chained=t[name].median / t["chained"].median,
              gbs=nbytes / t[name].median / 1e9, spread=t[name].spread)
  result = SectionResult(tables=[table])
  result.notes.append(f"max |fused - chained| over all updates: {err:.2e}")
  result.targets.append(Target(
      "loss-scaled clipped update: fused time ≤ chained optax + the same checks",
      t["fused"].median / t["chained + guard"].median, 1.0, "<="))
  result.data = {"bytes": nbytes, "timings": t, "max_abs_diff": err}
  return result
