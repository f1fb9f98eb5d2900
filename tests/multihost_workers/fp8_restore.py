"""Worker of tests/test_multihost_checkpoint.py: `jmp_lite.fp8.restore` across processes.

``python fp8_restore.py DIRECTORY LENGTH``, started by
`jmp_lite.testing.run_processes` (2 processes x 2 devices). Every process
builds the same fp8 `jmp_lite.TrainState` (history length 16), lays it out on
a 4-device mesh (``w1`` split over "data", the rest replicated), takes one
step, saves it with ``ocp.StandardCheckpointer``, restores it with no target,
and `jmp_lite.fp8.restore`s that into an abstract target of history length
``LENGTH`` with the same shardings. It reports, per leaf, whether the
restored sharding is the target's, and digests of the saved and restored
parameters (gathered), and of the restored amax histories.

Importing this module (pytest's doctest collection does) touches no device.
"""

import hashlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jmp_lite
import jmp_lite.fp8
from jmp_lite import testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for pytest's import
import _data  # noqa: E402  (this directory's shared helpers)


def loss_fn(p, x):
  with jax.named_scope("mlp"):
    return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])


def _digest(tree):
  gathered = multihost_utils.process_allgather(tree, tiled=True)
  return hashlib.sha256(b"".join(np.asarray(a).tobytes()
                                 for a in jax.tree.leaves(gathered))).hexdigest()


def main(directory, length):
  testing.initialize_worker()
  mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
  params = {"w1": jnp.full((8, 16), 0.1), "w2": jnp.full((16, 4), 0.1)}
  x = jnp.arange(32, dtype=jnp.float32).reshape(4, 8) / 32

  def make(history_length):
    f8 = jmp_lite.fp8.init(loss_fn, params, x, select="mlp", history_length=history_length)
    return jmp_lite.TrainState.create(
        apply_fn=None, params=params, tx=optax.adam(1e-3), policy="p=f32,c=f16,o=f32",
        fp8=f8, loss_scale=jmp_lite.DynamicLossScale(2.0 ** 12))

  def sharding(path, leaf):
    split = "w1" in jax.tree_util.keystr(path) and leaf.ndim == 2
    return NamedSharding(mesh, P(None, "data") if split else P())

  state = jax.tree_util.tree_map_with_path(
      lambda p, l: jax.make_array_from_callback(
          l.shape, sharding(p, l), lambda i, l=l: np.asarray(l)[i]), make(16))
  with jax.numpy_dtype_promotion("standard"):
    state, _ = jax.jit(lambda s: s.minimize(loss_fn, x))(state)
  restored, target, _ = _data.fp8_restored(os.path.join(directory, "state"), state,
                                           lambda: make(length), sharding)
  fp8 = restored.loss_scale_state.fp8
  testing.report_result({
      "same_shardings": all(
          a.sharding == b.sharding for a, b in zip(jax.tree.leaves(restored),
                                                    jax.tree.leaves(target))),
      "w1_shards": len(restored.params["w1"].sharding.device_set),
      "params_saved": _digest(state.params),
      "params_restored": _digest(restored.params),
      "history_length": fp8.history_length,
      "histories": _digest([getattr(m, r).amax_history for m in fp8.sites.values()
                            for r in ("lhs", "rhs", "grad")]),
  })


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
