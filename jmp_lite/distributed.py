"""Data parallelism: gradients reduced across devices in the policy's reduce dtype.

Under ``jax.jit`` with sharded arrays (``NamedSharding``), ``all_finite``,
`jmp_lite.value_and_grad` and `jmp_lite.optax.with_loss_scale` see global
arrays, so the finiteness decision is global and the loss-scale state stays
replicated. The gradient reductions are XLA's partitioner's: it reduces each
product's partial sums in the dtype the product emits. Through the precision
engine (`jmp_lite.value_and_grad` or `jmp_lite.TrainState` with a policy,
`jmp_lite.flax.wrap`, `jmp_lite.autocast`) that is the policy's
``reduce_dtype``; a step that casts with ``policy.cast_to_compute`` and calls
``jax.grad`` itself reduces in the compute dtype. `collectives` lists what a
compiled step communicates, and in which dtype. Under ``shard_map`` and
``pmap`` each device sees its own shard, and two things must be explicit:

* the gradient all-reduce, done here by `reduce_gradients` in
  ``policy.reduce_dtype`` (float32 by default), never in the compute dtype;
* the skip decision, reduced with ``axis_name`` by `jmp_lite.all_finite`,
  `jmp_lite.value_and_grad` and `jmp_lite.optax.with_loss_scale`. After
  `reduce_gradients` it is global already: a NaN on one replica is in the
  average everywhere.

One trap is JAX's own: inside ``shard_map`` (with ``check_vma=True``, the
default), ``jax.grad`` with respect to replicated parameters inserts an
all-reduce (a sum, not a mean) wherever the replicated value meets per-device
data, in whatever dtype the parameters have there: the compute dtype, after
``policy.cast_to_compute``. `mark_varying` turns that off, so the gradients
stay per-device until `reduce_gradients` averages them. Forgetting it is
refused: `reduce_gradients` finds a gradient JAX already summed, even after a
per-device operation made it look per-device again (it reads the trace), and
a skip decision that may differ between devices (``axis_name`` left out) is
refused where it is made::

    def step(params, opt_state, batch):           # inside shard_map
      scale = jmp_lite.optax.get_loss_scale(opt_state)
      loss_fn = lambda p: scale.scale(loss(policy.cast_to_compute(p), batch))
      grads = jax.grad(loss_fn)(mark_varying(params, "data"))
      grads = reduce_gradients(grads, "data", policy=policy)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

from jmp_lite._dtypes import is_floating
from jmp_lite._dtypes import is_low_bit_float
from jmp_lite._dtypes import wide_dtype
from jmp_lite import _hlo
from jmp_lite._hlo import Collective
from jmp_lite._jaxpr.passes import provenance as _provenance
from jmp_lite import _replicas
from jmp_lite._scaling import check_axis_name
from jmp_lite.policy import get_policy
from jmp_lite.policy import Policy

__all__ = (
    "collectives",
    "Collective",
    "mark_varying",
    "reduce_gradients",
    "is_replicated_everywhere",
    "AxisName",
)

T = TypeVar("T")
AxisName = Union[str, Sequence[str]]


def _axes(axis_name: Any, what: str) -> tuple[str, ...]:
  """``axis_name`` as a non-empty tuple of names, or a TypeError showing it."""
  if axis_name is None:
    raise TypeError(f"{what}: axis_name must be a mesh axis name or a non-empty "
                    "tuple of them, got None.")
  name = check_axis_name(axis_name, what)
  return (name,) if isinstance(name, str) else tuple(name)


def mark_varying(tree: T, axis_name: AxisName) -> T:
  """Marks replicated values as per-device, so ``jax.grad`` leaves gradients unreduced.

  Inside ``shard_map``, differentiating with respect to a replicated
  (invariant) argument makes JAX sum the gradient across devices itself, in
  the dtype the value has where it meets sharded data (the compute dtype).
  Differentiate with respect to ``mark_varying(params, axis_name)`` instead,
  then average with `reduce_gradients`. Leaves already varying over an axis,
  and everything under ``pmap`` or ``shard_map(check_vma=False)`` (where
  gradients are per-device anyway), are returned unchanged.

  Args:
    tree: a pytree, typically the parameters.
    axis_name: the mesh axis name, or a tuple of names.

  Raises:
    TypeError: if ``axis_name`` is not a name or a tuple of names.
  """
  axes = _axes(axis_name, "mark_varying")

  def mark(x):
    if not hasattr(x, "dtype"):
      return x
    missing = tuple(a for a in axes if a not in _replicas.varying_axes(x))
    if not missing or not _replicas.tracks_varying(missing):
      return x
    cast = getattr(jax.lax, "pcast", None)
    if cast is not None:
      return cast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # jax < 0.9

  return jax.tree_util.tree_map(mark, tree)


def reduce_gradients(
    grads: T,
    axis_name: AxisName,
    *,
    policy: Optional[Union[Policy, str]] = None,
    mean: bool = True,
) -> T:
  """Averages per-device gradients across mesh axes in ``policy.reduce_dtype``.

  For use inside ``shard_map`` or ``pmap``. Each floating leaf is cast to the
  reduce dtype, all-reduced (``pmean``, or ``psum`` with ``mean=False``) over
  ``axis_name``, and cast to ``policy.param_dtype``; without a policy the
  reduction runs in float32 (float64 for float64 leaves) and each leaf keeps
  its dtype. Non-floating leaves pass through. A non-finite value on any
  device is non-finite in the result on every device, so a finiteness check
  after this call is global.

  Scaled gradients (from ``loss_scale.scale(loss)``) can be reduced as they
  are: averaging never grows a value beyond the largest operand, so it cannot
  overflow where the local gradients did not.

  Args:
    grads: per-device gradients (see `mark_varying` for ``shard_map``).
    axis_name: the mesh axis (for data parallelism, the batch axis), or a
      tuple of axes reduced together.
    policy: a `jmp_lite.Policy` or policy string; its ``reduce_dtype`` is the
      dtype of the all-reduce and its ``param_dtype`` the result's.
    mean: average (the default) or sum.

  Returns:
    ``grads`` reduced over ``axis_name``, identical on every device.

  Raises:
    TypeError: if ``axis_name`` is not a name or tuple of names.
    ValueError: if a floating leaf was already reduced by JAX over one of
      the axes: ``jax.grad`` was taken with respect to replicated parameters
      inside ``shard_map``, so the leaf is invariant there, or was made
      per-device again by an operation after ``jax.grad`` (read from the
      trace under ``jit``). The message names the leaf and the fix,
      `mark_varying`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from jmp_lite.distributed import reduce_gradients
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> grads = jax.device_put(jnp.ones((jax.device_count(), 3), jnp.bfloat16),
    ...                        NamedSharding(mesh, P("data")))
    >>> f = jax.shard_map(
    ...     lambda g: reduce_gradients(g, "data", policy="p=f32,c=bf16,o=f32"),
    ...     mesh=mesh, in_specs=P("data"), out_specs=P())
    >>> f(grads)
    Array([[1., 1., 1.]], dtype=float32)
  """
  axes = _axes(axis_name, "reduce_gradients")
  if policy is not None:
    policy = get_policy(policy)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(grads)
  tracked = None  # probed once, on the first floating leaf

  out = []
  for path, g in leaves:
    if not is_floating(g):
      out.append(g)
      continue
    g = jnp.asarray(g)
    if tracked is None:
      tracked = _replicas.tracks_varying(axes)
    if tracked:
      invariant = [a for a in axes if a not in _replicas.varying_axes(g)]
      if invariant:
        raise ValueError(
            f"reduce_gradients: gradient {jax.tree_util.keystr(path) or '(root)'} "
            f"({g.dtype.name}{list(g.shape)}) is already reduced over "
            f"{tuple(invariant)}: JAX summed it across devices itself, in the "
            "dtype the parameter had where it met sharded data, because it was "
            "differentiated with respect to a replicated value. Differentiate "
            "with respect to jmp_lite.distributed.mark_varying(params, "
            f"{axis_name!r}) instead.")
      for a in axes:
        summed_in = _provenance.summed_by_autodiff(g, a)
        if summed_in is not None:
          raise ValueError(
              f"reduce_gradients: gradient {jax.tree_util.keystr(path) or '(root)'} "
              f"({g.dtype.name}{list(g.shape)}) was already summed over "
              f"{a!r} by JAX, in {jnp.dtype(summed_in).name}, when "
              "jax.grad differentiated a replicated value; an operation "
              "after jax.grad made it per-device again, and reducing it "
              "here would sum it twice. Differentiate with respect to "
              f"jmp_lite.distributed.mark_varying(params, {axis_name!r}).")
    if policy is not None:
      reduce_dtype = policy.reduce_dtype
      out_dtype = g.dtype if is_low_bit_float(g.dtype) else policy.param_dtype
    else:
      reduce_dtype = wide_dtype(g.dtype)
      out_dtype = g.dtype
    r = g.astype(reduce_dtype)
    r = jax.lax.pmean(r, axes) if mean else jax.lax.psum(r, axes)
    out.append(r.astype(out_dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


def is_replicated_everywhere(tree: Any) -> bool:
  """Whether every array leaf holds bitwise-identical data on every device.

  For checking, outside ``jit``, that the loss-scale state (or anything that
  must agree across replicas) did not diverge: compares the raw bytes of each
  addressable shard of each fully replicated leaf and, in a multi-process
  run, a digest of them across processes (every process must call it, as
  any collective). Leaves that are sharded (not fully replicated) make it
  False.
  """
  leaves = [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]
  local_ok = True
  # Per leaf: whether this process holds it, and a digest of its bytes.
  rows = np.zeros((len(leaves), 9), np.uint32)
  for i, leaf in enumerate(leaves):
    if not leaf.sharding.is_fully_replicated:
      local_ok = False
      continue
    blobs = {np.asarray(s.data).tobytes() for s in leaf.addressable_shards}
    if len(blobs) > 1:
      local_ok = False
    elif blobs:
      rows[i, 0] = 1
      rows[i, 1:] = np.frombuffer(hashlib.sha256(blobs.pop()).digest(), np.uint32)
  if jax.process_count() == 1:
    return local_ok
  # Every process takes part in the gather, whatever it found: one that
  # returned early would leave the others waiting in it.
  mine = np.concatenate([np.array([local_ok], np.uint32), rows.ravel()])
  every = np.asarray(multihost_utils.process_allgather(mine))
  if not np.all(every[:, 0]):
    return False
  held = every[:, 1:].reshape(every.shape[0], len(leaves), 9)
  for i in range(len(leaves)):
    digests = held[held[:, i, 0] == 1, i, 1:]
    if len(digests) and np.any(digests != digests[0]):
      return False
  return True


def collectives(fun: Callable[..., Any], *args, **kwargs) -> tuple[Collective, ...]:
  """What ``jax.jit(fun)(*args, **kwargs)`` communicates, as XLA partitioned it.

  Compiles ``fun`` (a function or a ``jax.jit`` of one) for the arguments'
  shardings and reads the program right after XLA's SPMD partitioner: the
  collectives a GPU or TPU runs, each with its dtype and size. (The compiled
  program's own text is after the backend's passes: XLA:CPU sums a bfloat16
  all-reduce in float32.) A collective in a loop body is listed once.

  Args:
    fun: the step, jitted or not.
    *args: its arguments, sharded as they will be.
    **kwargs: its keyword arguments.

  Returns:
    A `Collective` per array each collective moves, in program order.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> import jmp_lite
    >>> from jmp_lite.distributed import collectives
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> x = jax.device_put(jnp.ones((8 * jax.device_count(), 4)),
    ...                    NamedSharding(mesh, P("data")))
    >>> loss = lambda w, x: jnp.mean(x.astype(w.dtype) @ w)
    >>> vg = jmp_lite.value_and_grad(loss, policy="p=f32,c=bf16,o=f32")
    >>> step = lambda w, x: vg(w, x)[1]
    >>> ops = collectives(step, jnp.ones((4, 2)), x)
    >>> # On N > 1 devices: one all-reduce, the weight gradient's, in float32.
    >>> len(ops) == (jax.device_count() > 1), {op.dtype.name for op in ops} <= {"float32"}
    (True, True)
  """
  return _hlo.parse(_hlo.partitioned_hlo(fun, *args, **kwargs))
