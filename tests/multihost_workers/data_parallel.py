"""Worker of tests/test_multihost.py: mixed-precision data parallelism across processes.

Started by `jmp_lite.testing.run_processes`, as 2 processes of 4 CPU devices
and, for the reference, as 1 process of 8. Every process builds the same
global batches and feeds only the rows its own devices hold
(``jax.make_array_from_process_local_data``); the model is trained under
``jit`` over a global ("data",) mesh of all 8 devices, three ways:

* ``train_state``: `jmp_lite.TrainState.minimize`, so `with_loss_scale`;
* ``value_and_grad``: `jmp_lite.value_and_grad`, ``loss_scale.adjust`` and
  `jmp_lite.select_tree` by hand (README, "Loss scaling by hand");
* ``with_loss_scale``: ``jax.grad`` of the scaled loss into
  `jmp_lite.optax.with_loss_scale` (README, "as one optax transformation");
* ``shard_map_train_state`` and ``shard_map_by_hand``: the step inside
  ``shard_map`` with ``axis_name="data"``, by `TrainState.minimize`
  (``check_vma=True``) and by hand with ``check_vma=False``.

It also reports the errors that forgetting ``axis_name`` or `mark_varying`
inside ``shard_map`` raises (traced, not run).

An inf is written into one row of the global input at each step of
``POISONED``; each of those rows lives on one process only. Each process
reports, per flow, the loss-scale trajectory, the skip decisions, the losses,
and the bytes of its copy of the final parameters and optimizer state.

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
from jmp_lite import optax as jo
from jmp_lite import testing

N_DEVICES = 8
N_STEPS = 10
BATCH, D_IN, D_HIDDEN, D_OUT = 64, 16, 32, 4
# step -> (row, column) of the global input set to inf. Rows 0-31 are fed by
# process 0 and rows 32-63 by process 1, so each overflow starts on one
# process only.
POISONED = {3: (45, 2), 6: (10, 7)}


def _batches():
  return _data.batches(N_STEPS, BATCH, D_IN, D_OUT, POISONED)


def _initial_params():
  return _data.mlp_params(D_IN, D_HIDDEN, D_OUT)


def main():
  testing.initialize_worker()  # before anything touches a device
  # The suite's settings (conftest.py, pyproject.toml), in this process too.
  warnings.simplefilter("error")
  jax.config.update("jax_numpy_dtype_promotion", "strict")
  assert jax.device_count() == N_DEVICES, jax.devices()

  policy = jmp_lite.get_policy("p=f32,c=f16,o=f32")
  mesh = jax.make_mesh((N_DEVICES,), ("data",), axis_types=(AxisType.Auto,))
  replicated = NamedSharding(mesh, P())
  by_rows = NamedSharding(mesh, P("data"))

  # The rows of the global batch this process's devices hold, in order.
  index_map = by_rows.addressable_devices_indices_map((BATCH, D_IN))
  starts = sorted({idx[0].start for idx in index_map.values()})
  size = BATCH // N_DEVICES
  local_rows = np.concatenate([np.arange(s, s + size) for s in starts])

  xs, ys = _batches()

  def feed(batch):
    """This process's rows, assembled into one global array."""
    return jax.make_array_from_process_local_data(
        by_rows, np.ascontiguousarray(batch[local_rows]), batch.shape)

  loss_fn = _data.mlp_loss

  def loss_scale():
    # f16 backward passes overflow by themselves once the scale grows past
    # 2**16 or so: the trajectory moves both ways, on top of the poisoned steps.
    return jmp_lite.DynamicLossScale(jnp.float32(2 ** 15), period=2)

  def local(x):
    """This process's copy of a replicated global array, on the host."""
    assert x.sharding.is_fully_replicated, x.sharding
    return np.asarray(x.addressable_data(0))

  def digest(tree):
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      h.update(jax.tree_util.keystr(path).encode())
      h.update(local(leaf).tobytes())
    return h.hexdigest()

  def report(trace, params, opt_state, skipped_steps, compiles):
    scales, skipped, losses = (list(t) for t in zip(*trace)) if trace else ([], [], [])
    return {
        "scales": scales, "skipped": skipped, "losses": losses,
        "skipped_steps": skipped_steps,
        "params": {k: local(v).tobytes().hex() for k, v in params.items()},
        "params_digest": digest(params),
        "opt_state_digest": digest(opt_state),
        # Only this process's devices are visible to it: replicated across
        # them, and the test compares the processes' copies.
        "replicated_locally": distributed.is_replicated_everywhere((params, opt_state)),
        "compiles": compiles,
    }

  def run_train_state():
    state = jmp_lite.TrainState.create(
        apply_fn=None, params=_initial_params(), tx=optax.sgd(0.05, momentum=0.9),
        loss_scale=loss_scale(), policy=policy)
    state = jax.device_put(state, replicated)
    step = jax.jit(lambda s, x, y: s.minimize(loss_fn, x, y))
    trace = []
    for x, y in zip(xs, ys):
      state, info = step(state, feed(x), feed(y))
      # float() and bool() of replicated global arrays, as a user would.
      trace.append((float(info.loss_scale), bool(info.skipped), float(info.loss)))
    return report(trace, state.params, state.opt_state,
                  int(state.loss_scale_state.skipped_steps), step._cache_size())

  def run_value_and_grad():
    params = jax.device_put(_initial_params(), replicated)
    tx = optax.sgd(0.05, momentum=0.9)
    opt_state = jax.device_put(tx.init(params), replicated)
    scale = jax.device_put(loss_scale(), replicated)

    @jax.jit
    def step(params, opt_state, scale, x, y):
      loss, grads, finite = jmp_lite.value_and_grad(loss_fn, policy=policy)(
          params, x, y, loss_scale=scale)
      updates, new_opt_state = tx.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      params, opt_state = jmp_lite.select_tree(
          finite, (new_params, new_opt_state), (params, opt_state))
      return params, opt_state, scale.adjust(finite), finite, loss

    trace, skipped_steps = [], 0
    for x, y in zip(xs, ys):
      used = float(scale.loss_scale)
      params, opt_state, scale, finite, loss = step(
          params, opt_state, scale, feed(x), feed(y))
      trace.append((used, not bool(finite), float(loss)))
      skipped_steps += not bool(finite)
    return report(trace, params, (opt_state, scale), skipped_steps, step._cache_size())

  def run_with_loss_scale():
    params = jax.device_put(_initial_params(), replicated)
    tx = jo.with_loss_scale(optax.sgd(0.05, momentum=0.9), loss_scale())
    opt_state = jax.device_put(tx.init(params), replicated)

    @jax.jit
    def step(params, opt_state, x, y):
      scale = jo.get_loss_scale(opt_state)
      loss = lambda p: scale.scale(loss_fn(policy.cast_to_compute(p), x, y))
      value, grads = jax.value_and_grad(loss)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, value / scale.loss_scale

    trace = []
    for x, y in zip(xs, ys):
      used = float(jo.get_loss_scale(opt_state).loss_scale)
      params, opt_state, loss = step(params, opt_state, feed(x), feed(y))
      trace.append((used, bool(jo.find_loss_scale_state(opt_state).skipped), float(loss)))
    return report(trace, params, opt_state,
                  int(jo.find_loss_scale_state(opt_state).skipped_steps),
                  step._cache_size())

  def run_shard_map(by_hand):
    """The same step inside ``shard_map``: each device sees its own rows.

    ``TrainState`` with ``axis_name`` (``check_vma=True``), or by hand with
    ``check_vma=False``: `mark_varying`, ``jax.grad``, `reduce_gradients` and
    `with_loss_scale` with ``axis_name``.
    """
    if by_hand:
      tx = jo.with_loss_scale(optax.sgd(0.05, momentum=0.9), loss_scale(),
                              axis_name="data")
      carry = jax.device_put((_initial_params(), tx.init(_initial_params())), replicated)

      def replica(carry, x, y):
        params, opt_state = carry
        scale = jo.get_loss_scale(opt_state)
        loss = lambda p: scale.scale(loss_fn(policy.cast_to_compute(p), x, y))
        value, grads = jax.value_and_grad(loss)(distributed.mark_varying(params, "data"))
        grads = distributed.reduce_gradients(grads, "data", policy=policy)
        updates, opt_state = tx.update(grads, opt_state, params)
        info = jo.find_loss_scale_state(opt_state)
        loss = jax.lax.pmean(value / scale.loss_scale, "data")
        return ((optax.apply_updates(params, updates), opt_state),
                (scale.loss_scale, info.skipped, loss))
    else:
      carry = jax.device_put(jmp_lite.TrainState.create(
          apply_fn=None, params=_initial_params(), tx=optax.sgd(0.05, momentum=0.9),
          loss_scale=loss_scale(), policy=policy, axis_name="data"), replicated)

      def replica(state, x, y):
        state, info = state.minimize(loss_fn, x, y)
        return state, (info.loss_scale, info.skipped, jax.lax.pmean(info.loss, "data"))

    step = jax.jit(jax.shard_map(replica, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                 out_specs=P(), check_vma=not by_hand))
    trace = []
    for x, y in zip(xs, ys):
      carry, (used, skipped, loss) = step(carry, feed(x), feed(y))
      trace.append((float(used), bool(skipped), float(loss)))
    params, opt_state = carry if by_hand else (carry.params, carry.opt_state)
    return report(trace, params, opt_state,
                  int(jo.find_loss_scale_state(opt_state).skipped_steps), step._cache_size())

  def refusals():
    """What forgetting ``axis_name`` or `mark_varying` under shard_map raises.

    Traced only: the errors come at trace time, before any collective runs.
    """
    x, y = feed(xs[0]), feed(ys[0])
    params = jax.device_put(_initial_params(), replicated)
    per_device = lambda: 1.0 + 0.0 * jax.lax.axis_index("data").astype(jnp.float32)

    def forgot_axis_name(params, x, y):  # check_vma=False
      tx = jo.with_loss_scale(optax.sgd(0.05), loss_scale())
      grads = jax.grad(lambda p: loss_fn(policy.cast_to_compute(p), x, y))(params)
      grads = distributed.reduce_gradients(grads, "data", policy=policy)
      return tx.update(grads, tx.init(params), params)[0]

    def forgot_mark_varying(params, x, y):  # check_vma=True
      grads = jax.grad(lambda p: loss_fn(policy.cast_to_compute(p), x, y))(params)
      grads = jax.tree.map(lambda g: g * per_device(), grads)  # per-device again
      return distributed.reduce_gradients(grads, "data", policy=policy)

    out = {}
    for name, fn, check_vma in [("forgot_axis_name", forgot_axis_name, False),
                                ("forgot_mark_varying", forgot_mark_varying, True)]:
      f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                out_specs=P(), check_vma=check_vma))
      try:
        f.trace(params, x, y)
        out[name] = None
      except ValueError as e:
        out[name] = str(e).split("\n")[0]
    return out

  testing.report_result({
      # Steps at which this process's own rows held an inf.
      "locally_poisoned": [i for i, x in enumerate(xs)
                           if not np.isfinite(x[local_rows]).all()],
      "process_index": jax.process_index(),
      "process_count": jax.process_count(),
      "device_count": jax.device_count(),
      "local_device_count": jax.local_device_count(),
      "local_rows": local_rows.tolist(),
      "poisoned": {str(k): list(v) for k, v in POISONED.items()},
      "flows": {"train_state": run_train_state(),
                "value_and_grad": run_value_and_grad(),
                "with_loss_scale": run_with_loss_scale(),
                "shard_map_train_state": run_shard_map(by_hand=False),
                "shard_map_by_hand": run_shard_map(by_hand=True)},
      "refusals": refusals(),
  })


if __name__ == "__main__":
  main()
