"""Worker of tests/test_multihost_checkpoint.py: orbax checkpoints across processes.

``python checkpoint.py MODE [DIRECTORY [MESH]]``, started by
`jmp_lite.testing.run_processes`. The model, the data and the step are
``fsdp.py``'s: `jmp_lite.TrainState.minimize` under ``jit`` with a bf16
compute dtype and adam, parameters and adam's moments sharded over a global
("data", "model") mesh (4 x 2 by default, ``MESH`` such as ``1x2`` otherwise),
the batch over "data", an inf written into one row (fed by one process only)
at each step of ``POISONED``. The steps are chosen so that at ``STOP`` the
loss scale differs from its initial value, its growth counter is not zero,
two steps were skipped, and adam's counter (applied steps) differs from the
state's ``step`` (calls): a checkpoint that lost any of them would resume
differently. Modes:

* ``full [DIRECTORY]``: steps ``0 .. N_STEPS - 1``, uninterrupted; with a
  ``DIRECTORY``, every process saves the state with
  ``ocp.StandardCheckpointer`` into ``DIRECTORY/state`` before step ``STOP``,
  and the run goes on (saving only reads the state);
* ``resume DIRECTORY [MESH]``: restores ``DIRECTORY/state`` onto this run's
  mesh, from an abstract target (``jax.eval_shape`` of the initial state,
  with this mesh's shardings), and runs steps ``STOP .. N_STEPS - 1``.

Each process reports the loss-scale trajectory, skips and losses of its
steps, digests of the final state (gathered), per-leaf digests, dtypes and
shardings of the state it saved or restored, and the dtypes orbax stored.

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
import orbax.checkpoint as ocp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for pytest's import
import _data  # noqa: E402  (this directory's shared data)

import jmp_lite
from jmp_lite import testing

N_STEPS = 10
STOP = 6  # the first step of the resumed run
BATCH, D_IN, D_HIDDEN, D_OUT = 64, 16, 64, 8
# step -> (row, column) of an inf; rows 0-31 are fed by process 0, 32-63 by
# process 1. With period=2 the scale goes 2**15 -> 2**14 (step 1) -> 2**13
# (step 2) -> 2**14 (after step 4), and is 2**14 with counter 1 at STOP; after
# it, it grows (step 6, only if the counter survived), backs off (step 7) and
# grows again.
POISONED = {1: (40, 3), 2: (7, 1), 7: (50, 0)}
# FSDP over "data" (each weight's first dimension), tensor parallel over
# "model" (the hidden dimension), as in fsdp.py.
SPECS = {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data")}


def _batches():
  return _data.batches(N_STEPS, BATCH, D_IN, D_OUT, POISONED)


def _initial_params():
  return _data.mlp_params(D_IN, D_HIDDEN, D_OUT, w2_scale=8)


def _initial_state():
  return jmp_lite.TrainState.create(
      apply_fn=None, params=_initial_params(), tx=optax.adam(3e-3),
      loss_scale=jmp_lite.DynamicLossScale(jnp.float32(2 ** 15), period=2),
      policy=jmp_lite.get_policy("p=f32,c=bf16,o=f32"))


loss_fn = _data.mlp_loss


def _name(path):
  """``"opt_state/inner_state/0/count"``: a leaf's path, however it was flattened.

  The live state flattens to attributes and indices (``.opt_state.nonfinite``),
  the checkpoint's metadata to dictionary keys (``['opt_state']['nonfinite']``).
  """
  return "/".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))
                  for k in path)


def main(mode, directory=None, mesh_shape="4x2"):
  testing.initialize_worker()
  warnings.simplefilter("error")
  # Standard dtype promotion, not the suite's strict one: optax's adam
  # computes ``b1 ** count`` (tests/conftest.py, `standard_promotion`).
  shape = tuple(int(n) for n in mesh_shape.split("x"))
  assert jax.device_count() == np.prod(shape), (jax.devices(), shape)

  mesh = jax.make_mesh(shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  replicated = NamedSharding(mesh, P())
  layout = _data.FsdpLayout(mesh, SPECS, _initial_params(), (BATCH, D_IN))
  sharding_of, feed = layout.sharding_of, layout.feed
  xs, ys = _batches()

  gather = jax.jit(lambda t: t, out_shardings=replicated)

  def digest(gathered):
    """sha256 of a gathered tree's leaves, with their names."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(gathered)[0]:
      h.update(_name(path).encode())
      h.update(np.asarray(leaf.addressable_data(0)).tobytes())
    return h.hexdigest()

  def describe(state):
    """The state's values (digests), leaf by leaf, and how each leaf is laid out."""
    # One gather of the whole state: every process then holds every byte.
    gathered = gather(state)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return {
        "params_digest": digest(gathered.params),
        "opt_state_digest": digest(gathered.opt_state),
        "leaf_digests": {_name(path): digest(leaf) for path, leaf
                         in jax.tree_util.tree_flatten_with_path(gathered)[0]},
        "leaves": {_name(path): {
            "dtype": leaf.dtype.name, "weak_type": leaf.weak_type,
            "shape": list(leaf.shape), "spec": str(leaf.sharding.spec),
            "shard_shape": list(leaf.sharding.shard_shape(leaf.shape)),
            "mesh": dict(leaf.sharding.mesh.shape)} for path, leaf in leaves},
        # The loss-scale state and the counters, as numbers.
        "step": int(state.step),
        "loss_scale": float(state.loss_scale.loss_scale),
        "counter": int(state.loss_scale.counter),
        "skipped_steps": int(state.loss_scale_state.skipped_steps),
        "adam_count": int(state.loss_scale_state.inner_state[0].count),
    }

  result = {"process_index": jax.process_index(), "process_count": jax.process_count(),
            "device_count": jax.device_count(), "mesh": list(shape)}
  path = os.path.join(directory, "state") if directory else None
  if mode == "full":
    state = _initial_state()
    state = jax.device_put(state, jax.tree.map(sharding_of, state))
    steps = range(N_STEPS)
  elif mode == "resume":
    # The target: shapes and dtypes from tracing the initial state's
    # construction, shardings of this run's mesh (whatever the mesh and the
    # process count of the run that saved). Its static fields (tx, policy)
    # are those of the restored state.
    abstract = jax.eval_shape(_initial_state)
    target = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding_of(s),
                                       weak_type=s.weak_type), abstract)
    # Every process calls restore: each reads the shards its devices hold.
    with ocp.StandardCheckpointer() as checkpointer:
      state = checkpointer.restore(path, target)
      stored = checkpointer.metadata(path).item_metadata.tree
    result["restored"] = describe(state)
    result["stored_dtypes"] = {
        _name(p): np.dtype(m.dtype).name
        for p, m in jax.tree_util.tree_flatten_with_path(stored)[0]}
    steps = range(STOP, N_STEPS)
  else:
    raise ValueError(f"unknown mode {mode!r}")

  # The state's own tree: a TrainState's treedef holds its tx, which is a
  # new closure for every TrainState.create.
  shardings = jax.tree.map(lambda leaf: leaf.sharding, state)
  step = jax.jit(lambda s, x, y: s.minimize(loss_fn, x, y),
                 out_shardings=(shardings, replicated))
  trace = []
  for i in steps:
    if mode == "full" and i == STOP and path is not None:
      result["saved"] = describe(state)
      # Every process calls save (collectively): each writes the shards its
      # devices own, process 0 the metadata. Saving only reads the state,
      # which trains on as if nothing happened.
      with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)
        checkpointer.wait_until_finished()
    state, info = step(state, feed(xs[i]), feed(ys[i]))
    trace.append((float(info.loss_scale), bool(info.skipped), float(info.loss)))
  scales, skipped, losses = (list(t) for t in zip(*trace))

  result.update({
      "steps": list(steps),
      "scales": scales, "skipped": skipped, "losses": losses,
      "final": describe(state),
      "compiles": step._cache_size(),
  })
  testing.report_result(result)


if __name__ == "__main__":
  main(*sys.argv[1:])
