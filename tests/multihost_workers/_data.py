"""Data shared by the multi-process workers: poisoned batches, an MLP and its loss.

Also imported by tests/_multidevice_checks.py, whose single-process runs
train the same MLP.
"""

import jax.numpy as jnp
import numpy as np


def batches(n_steps, batch, d_in, d_out, poisoned):
  """Random global batches with an inf at ``poisoned[step] = (row, column)``."""
  rng = np.random.default_rng(0)
  xs = rng.standard_normal((n_steps, batch, d_in)).astype(np.float32)
  ys = rng.standard_normal((n_steps, batch, d_out)).astype(np.float32)
  for step, (row, col) in poisoned.items():
    xs[step, row, col] = np.inf
  return xs, ys


def mlp_loss(params, x, y):
  """Mean squared error of `mlp_params`' MLP, computed in the params' dtype."""
  h = jnp.tanh(x.astype(params["w1"].dtype) @ params["w1"] + params["b1"])
  out = (h @ params["w2"]).astype(jnp.float32)
  return jnp.mean((out - y) ** 2)


def mlp_params(d_in, d_hidden, d_out, w2_scale=4):
  rng = np.random.default_rng(1)
  return {"w1": (rng.standard_normal((d_in, d_hidden)) / 4).astype(np.float32),
          "b1": (rng.standard_normal((d_hidden,)) / 4).astype(np.float32),
          "w2": (rng.standard_normal((d_hidden, d_out)) / w2_scale).astype(np.float32)}


class FsdpLayout:
  """Where an FSDP worker's leaves and rows live on ``mesh``.

  ``sharding_of(leaf)``: a parameter-shaped leaf (a parameter, a moment)
  sharded like that parameter in ``specs``, anything else replicated.
  ``local_rows``: the rows of a global batch this process's devices hold.
  ``feed(batch)``: those rows, assembled into one global array.
  """

  def __init__(self, mesh, specs, params, batch_shape):
    import jax  # here, so that importing this module touches no device
    from jax.sharding import NamedSharding, PartitionSpec as P
    self._jax, self._named, self._p = jax, NamedSharding, P
    self.mesh = mesh
    self.shape_to_spec = {np.shape(v): specs[k] for k, v in params.items()}
    self.by_rows = NamedSharding(mesh, P("data"))
    index_map = self.by_rows.addressable_devices_indices_map(tuple(batch_shape))
    self.local_rows = np.unique(np.concatenate(
        [np.arange(batch_shape[0])[idx[0]] for idx in index_map.values()]))

  def sharding_of(self, leaf):
    return self._named(self.mesh, self.shape_to_spec.get(np.shape(leaf), self._p()))

  def feed(self, batch):
    return self._jax.make_array_from_process_local_data(
        self.by_rows, np.ascontiguousarray(batch[self.local_rows]), batch.shape)


def fp8_restored(path, state, make_target, sharding):
  """``state`` saved with orbax at ``path``, restored with no target and
  `jmp_lite.fp8.restore`d into ``make_target()``'s abstract shape laid out
  by ``sharding(path, leaf)``: ``(restored, target)``."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import jmp_lite.fp8  # pylint: disable=g-import-not-at-top
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, state)
  with ocp.StandardCheckpointer() as ckptr:
    raw = ckptr.restore(path)
  target = jax.tree_util.tree_map_with_path(
      lambda p, l: jax.ShapeDtypeStruct(l.shape, l.dtype, sharding=sharding(p, l)),
      jax.eval_shape(make_target))
  return jmp_lite.fp8.restore(raw, target), target, raw
