"""Worker of tests/test_multihost.py: FSDP-style sharding across processes.

Started as 2 processes of 4 CPU devices and, for the reference, 1 process of
8. The devices form a global ("data", "model") mesh of 4 x 2. Parameters and
the whole optimizer state (adam's moments) are sharded over both axes, the
batch over "data"; the loss-scale state stays replicated. The step is
`jmp_lite.TrainState.minimize` under ``jit`` with a bf16 compute dtype, with
an inf written into one row (fed by one process only) at the steps of
``POISONED``.

Each process reports the loss-scale trajectory, the skips and losses, the
sharding of every parameter and optimizer-state leaf, digests of the final
state (gathered), and the collectives of the compiled step
(`jmp_lite.distributed.collectives`): for the policy's float32 reduce dtype,
for a bfloat16 one, and for a step that casts with ``cast_to_compute`` and
calls ``jax.grad`` itself.

Importing this module (pytest's doctest collection does) touches no device.
"""

import hashlib
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for pytest's import
import _data  # noqa: E402  (this directory's shared data)

import jmp_lite
from jmp_lite import distributed
from jmp_lite import testing

N_DEVICES = 8
N_STEPS = 8
BATCH, D_IN, D_HIDDEN, D_OUT = 64, 16, 64, 8
POISONED = {2: (40, 3), 5: (7, 1)}  # step -> (row, column) of an inf
# FSDP over "data" (each weight's first dimension), tensor parallel over
# "model" (the hidden dimension).
SPECS = {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data")}


def _batches():
  return _data.batches(N_STEPS, BATCH, D_IN, D_OUT, POISONED)


def _initial_params():
  return _data.mlp_params(D_IN, D_HIDDEN, D_OUT, w2_scale=8)


loss_fn = _data.mlp_loss


def main():
  testing.initialize_worker()
  warnings.simplefilter("error")
  # Standard dtype promotion, not the suite's strict one: optax's adam
  # computes ``b1 ** count`` (tests/conftest.py, `standard_promotion`).
  assert jax.device_count() == N_DEVICES, jax.devices()

  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  replicated = NamedSharding(mesh, P())
  layout = _data.FsdpLayout(mesh, SPECS, _initial_params(), (BATCH, D_IN))
  sharding_of, feed, local_rows = layout.sharding_of, layout.feed, layout.local_rows
  shape_to_spec = layout.shape_to_spec
  xs, ys = _batches()

  def make_state(policy):
    state = jmp_lite.TrainState.create(
        apply_fn=None, params=_initial_params(), tx=optax.adam(3e-3),
        loss_scale=jmp_lite.DynamicLossScale(jnp.float32(2 ** 15), period=2),
        policy=policy)
    return jax.device_put(state, jax.tree.map(sharding_of, state))

  gather = jax.jit(lambda t: t, out_shardings=replicated)

  def digest(tree):
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(gather(tree))[0]:
      h.update(jax.tree_util.keystr(path).encode())
      h.update(np.asarray(leaf.addressable_data(0)).tobytes())
    return h.hexdigest()

  def specs(tree):
    return {jax.tree_util.keystr(path): str(leaf.sharding.spec)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
            if hasattr(leaf, "sharding")}

  def ops(policy):
    state = make_state(policy)
    step = lambda s, x, y: s.minimize(loss_fn, x, y)
    x, y = feed(xs[0]), feed(ys[0])
    return [[op.kind, op.dtype.name, list(op.shape), op.bytes]
            for op in distributed.collectives(step, state, x, y)]

  def plain_ops(policy):
    params = jax.device_put(_initial_params(), {k: NamedSharding(mesh, s)
                                                for k, s in SPECS.items()})
    grad = lambda p, x, y: jax.grad(lambda p: loss_fn(policy.cast_to_compute(p), x, y))(p)
    return [[op.kind, op.dtype.name, list(op.shape), op.bytes]
            for op in distributed.collectives(grad, params, feed(xs[0]), feed(ys[0]))]

  policy = jmp_lite.get_policy("p=f32,c=bf16,o=f32")
  state = make_state(policy)
  shardings = jax.tree.map(lambda leaf: leaf.sharding, state)
  step = jax.jit(lambda s, x, y: s.minimize(loss_fn, x, y),
                 out_shardings=(shardings, replicated))
  trace = []
  for x, y in zip(xs, ys):
    state, info = step(state, feed(x), feed(y))
    trace.append((float(info.loss_scale), bool(info.skipped), float(info.loss)))
  scales, skipped, losses = (list(t) for t in zip(*trace))

  testing.report_result({
      "process_index": jax.process_index(),
      "local_rows": local_rows.tolist(),
      "scales": scales, "skipped": skipped, "losses": losses,
      "param_specs": specs(state.params),
      "opt_state_specs": specs(state.opt_state),
      "loss_scale_replicated": all(
          leaf.sharding.is_fully_replicated
          for leaf in jax.tree.leaves(state.loss_scale)),
      # Everything in the optimizer state that is not parameter-shaped
      # (counters, the skip flags) is replicated.
      "scalars_replicated": all(
          leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(state.opt_state)
          if np.shape(leaf) not in shape_to_spec),
      "params_digest": digest(state.params),
      "opt_state_digest": digest(state.opt_state),
      "compiles": step._cache_size(),
      "collectives": {
          "f32": ops(policy),
          "bf16": ops(policy.with_reduce_dtype(jnp.bfloat16)),
          "plain": plain_ops(policy)},
  })


if __name__ == "__main__":
  main()
