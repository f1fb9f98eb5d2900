"""Checks on 8 simulated CPU devices, run by tests/test_distributed.py in a subprocess.

Not collected by the main test run (the name does not start with ``test_``):
the device count is fixed when JAX initialises its backend, so these need a
process of their own, started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``. To run them by hand::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m pytest tests/_multidevice_checks.py -p no:cacheprovider

Importing this module (pytest's doctest collection does) touches no device.
"""

import functools
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jmp_lite
from jmp_lite._jaxpr.passes import provenance as _provenance
from jmp_lite import distributed
from jmp_lite import optax as jo
from jmp_lite.testing import inject_nonfinite

sys.path.insert(0, str(pathlib.Path(__file__).with_name("multihost_workers")))
import _data  # noqa: E402  (the workers' MLP, trained here on one process)

N_DEVICES = 8
BATCH, D_IN, D_HIDDEN, D_OUT = 64, 16, 32, 4
POLICY = jmp_lite.get_policy("p=f32,c=f16,o=f32")
# Rows of the global batch set to inf on these steps: row 13 lives on the
# second data shard only, so one replica overflows.
POISONED = {2: 13, 3: 13, 9: 50}
N_STEPS = 14


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
  if jax.device_count() != N_DEVICES:
    pytest.fail(
        f"expected {N_DEVICES} devices, got {jax.device_count()}: run with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8")


def _mesh(shape, names, auto=True):
  types = (AxisType.Auto if auto else AxisType.Explicit,) * len(shape)
  return jax.make_mesh(shape, names, axis_types=types)


def _params():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  return {"w1": jax.random.normal(k1, (D_IN, D_HIDDEN)) / 4,
          "b1": jax.random.normal(k2, (D_HIDDEN,)) / 4,
          "w2": jax.random.normal(k3, (D_HIDDEN, D_OUT)) / 4}


def _batches():
  rng = np.random.default_rng(0)
  xs = rng.standard_normal((N_STEPS, BATCH, D_IN)).astype(np.float32)
  ys = rng.standard_normal((N_STEPS, BATCH, D_OUT)).astype(np.float32)
  for step, row in POISONED.items():
    xs[step, row, 3] = np.inf
  return xs, ys


_loss = _data.mlp_loss  # computed in whatever dtype the params arrive in


def _loss_scale():
  # 2**20 overflows float16 in the backward pass: the first steps back off
  # on their own, on top of the poisoned ones.
  return jmp_lite.DynamicLossScale(jnp.float32(2 ** 20), period=3)


def _tx():
  return jo.with_loss_scale(optax.sgd(0.05, momentum=0.9), _loss_scale())


def _cached_single_device(run):
  """``run`` on one device, computed once per process (the reference run)."""
  @functools.cache
  def single():
    return run(*_placements("single"))
  return single


def _run_train_state(shard_params, shard_batch):
  """TrainState.minimize for N_STEPS; returns per-step (scale, skipped, loss) and params."""
  state = jmp_lite.TrainState.create(apply_fn=None, params=_params(), tx=optax.sgd(
      0.05, momentum=0.9), loss_scale=_loss_scale(), policy=POLICY)
  state = state.replace(params=shard_params(state.params),
                        opt_state=shard_params(state.opt_state))
  step = jax.jit(lambda s, x, y: s.minimize(_loss, x, y))
  xs, ys = _batches()
  trace = []
  for x, y in zip(xs, ys):
    state, info = step(state, shard_batch(x), shard_batch(y))
    trace.append((float(info.loss_scale), bool(info.skipped), float(info.loss)))
    assert distributed.is_replicated_everywhere(state.loss_scale_state.loss_scale)
    assert distributed.is_replicated_everywhere(
        (info.skipped, info.loss_scale, state.loss_scale_state.skipped_steps))
  return trace, state.params, state


def _run_manual(shard_params, shard_batch):
  """value_and_grad + all_finite + adjust + select_tree, the hand-written step."""
  params = shard_params(_params())
  tx = optax.sgd(0.05, momentum=0.9)
  opt_state = shard_params(tx.init(params))
  loss_scale = _loss_scale()

  @jax.jit
  def step(params, opt_state, loss_scale, x, y):
    loss, grads, finite = jmp_lite.value_and_grad(_loss, policy=POLICY)(
        params, x, y, loss_scale=loss_scale)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp_lite.select_tree(
        finite, (new_params, new_opt_state), (params, opt_state))
    return params, opt_state, loss_scale.adjust(finite), finite, loss

  xs, ys = _batches()
  trace = []
  for x, y in zip(xs, ys):
    used = float(loss_scale.loss_scale)
    params, opt_state, loss_scale, finite, loss = step(
        params, opt_state, loss_scale, shard_batch(x), shard_batch(y))
    trace.append((used, not bool(finite), float(loss)))
    assert distributed.is_replicated_everywhere((loss_scale, finite))
  return trace, params, opt_state


def _check_same_run(single, sharded, natural_overflows=True, atol=2e-4):
  (trace1, params1), (trace8, params8) = single, sharded
  scales1, skipped1, losses1 = zip(*trace1)
  scales8, skipped8, losses8 = zip(*trace8)
  # The loss-scale trajectory and the skip decisions are identical; values
  # differ only by the order of floating-point sums.
  assert scales8 == scales1
  assert skipped8 == skipped1
  assert all(skipped1[s] for s in POISONED)
  if natural_overflows:  # float16 backward passes at 2**20 overflow too
    assert sum(skipped1) > len(POISONED)
  else:
    assert sum(skipped1) == len(POISONED)
  assert len(set(scales1)) > 2  # the scale moved both ways
  np.testing.assert_allclose(losses8, losses1, rtol=2e-3)
  for a, b in zip(jax.tree.leaves(params8), jax.tree.leaves(params1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=atol)
    assert np.isfinite(np.asarray(a)).all()


def _placements(kind, auto=True):
  """(shard_params, shard_batch) for a single device, a data mesh, or data x
  model; ``auto=False``: mesh axes of type Explicit (``jax.make_mesh``'s default)."""
  if kind == "single":
    dev = jax.devices()[0]
    put = lambda t: jax.device_put(t, dev)
    return put, put
  if kind == "data":
    mesh = _mesh((8,), ("data",), auto)
    rep = NamedSharding(mesh, P())
    return (lambda t: jax.device_put(t, rep),
            lambda b: jax.device_put(b, NamedSharding(mesh, P("data"))))
  if kind == "fsdp":  # kernels (and their moments) split along their first axis
    mesh = _mesh((8,), ("data",), auto)

    def split(x):
      spec = P("data") if np.ndim(x) == 2 and np.shape(x)[0] % N_DEVICES == 0 else P()
      return jax.device_put(x, NamedSharding(mesh, spec))
    return (lambda t: jax.tree.map(split, t),
            lambda b: jax.device_put(b, NamedSharding(mesh, P("data"))))
  mesh = _mesh((4, 2), ("data", "model"), auto)
  specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}

  def shard_params(tree):
    def put(path, x):
      names = [getattr(k, "key", None) for k in path]
      name = next((n for n in reversed(names) if n in specs), None)
      spec = specs[name] if name is not None and np.ndim(x) == len(specs[name]) else P()
      return jax.device_put(x, NamedSharding(mesh, spec))
    return jax.tree_util.tree_map_with_path(put, tree)

  return shard_params, lambda b: jax.device_put(b, NamedSharding(mesh, P("data")))


_train_state_one_device = _cached_single_device(_run_train_state)
_manual_one_device = _cached_single_device(_run_manual)


@pytest.mark.parametrize("kind", ["data", "data_x_model"])
def test_jit_sharded_train_state_matches_one_device(kind):
  trace1, params1, _ = _train_state_one_device()
  trace8, params8, state8 = _run_train_state(*_placements(kind))
  _check_same_run((trace1, params1), (trace8, params8))
  if kind == "data_x_model":
    # Parameters stayed sharded over the model axis; the optimizer state too.
    assert params8["w1"].sharding.spec == P(None, "model")
    assert not params8["w1"].sharding.is_fully_replicated


@pytest.mark.parametrize("kind", ["data", "fsdp"])
def test_jit_sharded_train_state_on_explicit_axes_matches_one_device(kind, monkeypatch):
  """On a mesh of Explicit axes the guard's per-element selects broadcast
  their predicate unsharded, and ``lax.select`` refused it against a sharded
  parameter (ShardingTypeError) where plain optax ran. Every array is checked
  on a copy of the step here (`COPY_FROM` = 1), the path that broadcasts."""
  from jmp_lite import _checks
  monkeypatch.setattr(_checks, "COPY_FROM", 1)
  trace1, params1, _ = _train_state_one_device()
  trace8, params8, _ = _run_train_state(*_placements(kind, auto=False))
  _check_same_run((trace1, params1), (trace8, params8))
  if kind == "fsdp":  # parameters and optimizer state stay split
    assert params8["w1"].sharding.spec in (P("data"), P("data", None))
    assert not params8["w1"].sharding.is_fully_replicated


def test_jit_sharded_manual_step_matches_one_device():
  kind = "data"  # data x model is covered by the TrainState test
  trace1, params1, _ = _manual_one_device()
  trace8, params8, _ = _run_manual(*_placements(kind))
  _check_same_run((trace1, params1), (trace8, params8))


def test_jit_poisoned_element_of_a_model_sharded_gradient_skips_everywhere():
  shard_params, _ = _placements("data_x_model")
  params = shard_params(_params())
  tx = _tx()
  opt_state = shard_params(tx.init(params))
  x, y = (jax.device_put(a[0], NamedSharding(_mesh((4, 2), ("data", "model")), P("data")))
          for a in _batches())

  @jax.jit
  def step(params, opt_state, x, y, i):
    scale = jo.get_loss_scale(opt_state)
    grads = jax.grad(lambda p: scale.scale(_loss(p, x, y)))(params)
    # w1 is sharded over "model": its last element lives on one model shard.
    grads = inject_nonfinite(grads, i, at_steps=[1], leaves=["['w1']"],
                             element="random", key=jax.random.key(3))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  before = jax.tree.map(np.asarray, (params, jo.find_loss_scale_state(opt_state).inner_state))
  params2, opt_state2 = step(params, opt_state, x, y, 1)
  state = jo.find_loss_scale_state(opt_state2)
  assert bool(state.skipped)
  after = jax.tree.map(np.asarray, (params2, state.inner_state))
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
    assert a.tobytes() == b.tobytes()
  # Every shard of every device holds the unchanged values.
  for leaf in jax.tree.leaves(params2):
    for shard in leaf.addressable_shards:
      assert np.isfinite(np.asarray(shard.data)).all()
  assert distributed.is_replicated_everywhere(state.loss_scale)


def test_jit_guard_on_sharded_gradients_reduces_with_all_reduce_only():
  """The guard's norm and checks over gradients, params and state sharded on
  8 devices compile to all-reduces of scalars, never an all-gather: a
  reduction XLA's partitioner cannot express as one (a variadic reduce, tried
  for the norm) makes it gather every device's partial results. Both ways of
  checking: on the results (small arrays) and on a copy of the step (arrays
  of `_checks.COPY_FROM` elements), whose result is one device's (to the
  rounding of the norm's sum, which the devices add in another order)."""
  from jmp_lite import _checks
  mesh = _mesh((8,), ("fsdp",))
  put = lambda tree: jax.tree.map(
      lambda a: jax.device_put(a, NamedSharding(mesh, P("fsdp") if a.ndim else P())), tree)
  for shape, copied in (((64, 8), False), ((_checks.COPY_FROM // 64, 64), True)):
    params = {f"w{i}": jnp.full(shape, 0.5) + i for i in range(12)}
    grads = jax.tree.map(lambda a: a * 3.0, params)
    tx = jo.with_loss_scale(optax.adam(1e-3), jmp_lite.DynamicLossScale(2.0 ** 15),
                            clip_norm=1.0)
    opt_state = tx.init(params)

    def step(grads, opt_state, params):
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    with jax.numpy_dtype_promotion("standard"):  # optax's Adam: b1 ** count
      sharded = put((grads, opt_state, params))
      lowered = jax.jit(step).lower(*sharded)
      compiled = lowered.compile()
      new_params, new_state = compiled(*sharded)
      one_device = jax.jit(step)(*jax.device_put((grads, opt_state, params),
                                                   jax.devices()[0]))
    text = compiled.as_text()
    assert text.count("all-reduce(") > 0
    assert text.count("all-gather(") == 0, re.findall(r".*all-gather\(.*", text)[:3]
    assert ("optimization_barrier" in lowered.as_text()) == copied, shape
    assert not bool(jo.find_loss_scale_state(new_state).skipped)
    # The norm is a float32 sum of up to 786,432 squares, which 8 devices add
    # in another order than one: they differ by its rounding (2e-5 relative
    # seen at JAX 0.9.2, about sqrt(n) float32 epsilons). Everything else is
    # held to 1e-6.
    norm = lambda t: jo.find_loss_scale_state(t[1]).grad_norm
    np.testing.assert_allclose(norm((new_params, new_state)), norm(one_device), rtol=1e-4)
    same_norm = lambda t: (t[0], jo.find_loss_scale_state(t[1])._replace(grad_norm=0.0))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                 same_norm((new_params, new_state)), same_norm(one_device))


# ----------------------------------------------------------------- shard_map


def _per_replica(fn, mesh, in_specs):
  """shard_map of ``fn``, whose one output has one element per device."""
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs,
                               out_specs=P(mesh.axis_names)))


def _replica_id(axes):
  """A replica number, unique per device, under shard_map over ``axes``."""
  if len(axes) == 1:
    return jax.lax.axis_index(axes[0])
  return jax.lax.axis_index(axes[0]) * 2 + jax.lax.axis_index(axes[1])


def _mesh_for(axes):
  return _mesh((8,), axes) if len(axes) == 1 else _mesh((4, 2), axes)


AXES = pytest.mark.parametrize("axes", [("data",), ("data", "model")], ids=["1d", "2d"])


@AXES
@pytest.mark.parametrize("api", ["all_finite", "value_and_grad"])
def test_shard_map_one_poisoned_replica_makes_every_replica_skip(api, axes):
  mesh = _mesh_for(axes)
  axis_name = axes if len(axes) > 1 else axes[0]
  x = jax.device_put(jnp.ones((BATCH, D_IN)), NamedSharding(mesh, P(axes)))
  w = jax.device_put(jnp.ones((D_IN, 2)), NamedSharding(mesh, P()))

  def replica(w, x, reduce_over):
    # Only replica 3's shard of the batch overflows.
    x = inject_nonfinite(x, 0, at_steps=[0], value="-inf", enabled=_replica_id(axes) == 3)
    w = distributed.mark_varying(w, axes)  # per-replica gradients, not reduced
    loss = lambda w: jnp.mean(x @ w)
    if api == "all_finite":
      finite = jmp_lite.all_finite(jax.grad(loss)(w), axis_name=reduce_over)
    else:
      _, _, finite = jmp_lite.value_and_grad(loss, axis_name=reduce_over)(
          w, loss_scale=jmp_lite.StaticLossScale(8.0))
    return finite.reshape((1,) * len(axes))

  agree = _per_replica(lambda w, x: replica(w, x, axis_name), mesh, (P(), P(axes)))
  flags = np.asarray(agree(w, x)).ravel()
  assert flags.shape == (8,) and not flags.any()
  # Without axis_name only the poisoned replica sees the overflow: the
  # reduction is what makes them agree. Both answer per device, as asked,
  # typed as varying: DynamicLossScale.adjust refuses such a flag (below).
  alone = _per_replica(lambda w, x: replica(w, x, None), mesh, (P(), P(axes)))
  flags = np.asarray(alone(w, x)).ravel()
  assert flags.sum() == 7 and not flags[3]


@AXES
def test_shard_map_with_loss_scale_one_poisoned_replica_skips_everywhere(axes):
  # ZeRO-style: each replica holds and updates its own shard of the
  # parameters, so gradients are never all-reduced and only axis_name can
  # make the replicas agree.
  mesh = _mesh_for(axes)
  axis_name = axes if len(axes) > 1 else axes[0]
  w = jax.device_put(jnp.ones((8 * 4,)), NamedSharding(mesh, P(axes)))

  def replica(w, reduce_over):
    tx = jo.with_loss_scale(optax.sgd(0.1), jmp_lite.DynamicLossScale(jnp.float32(8.0)),
                            axis_name=reduce_over)
    grads = inject_nonfinite(2 * w, 0, at_steps=[0], enabled=_replica_id(axes) == 3)
    updates, state = tx.update(grads, tx.init(w), w)
    new_w = optax.apply_updates(w, updates)
    return (~state.skipped).reshape(1), new_w

  for check_vma in (True, False):
    f = jax.jit(jax.shard_map(lambda w: replica(w, axis_name), mesh=mesh,
                              in_specs=P(axes), out_specs=(P(axes), P(axes)),
                              check_vma=check_vma))
    finite, new_w = f(w)
    assert np.asarray(finite).sum() == 0
    assert np.asarray(new_w).tobytes() == np.asarray(w).tobytes()
    # Without axis_name only replica 3 would skip, and the replicas would
    # diverge: refused, whether or not JAX tracks what varies.
    alone = jax.jit(jax.shard_map(lambda w: replica(w, None), mesh=mesh,
                                  in_specs=P(axes), out_specs=(P(axes), P(axes)),
                                  check_vma=check_vma))
    with pytest.raises(ValueError, match=r"with_loss_scale: .*Pass axis_name="
                       + re.escape(repr(axis_name))):
      alone(w)


# Under shard_map a device sums its 8 rows of a float16 weight gradient
# before the float32 all-reduce, where one device sums all 64 in float16: the
# sharded run overflows later (legitimately) when the scale is near the
# float16 limit. So this run computes in bfloat16, with the injected
# overflows only.
SHARD_MAP_POLICY = jmp_lite.get_policy("p=f32,c=bf16,o=f32")


def _shard_map_step(mesh, tx, policy=SHARD_MAP_POLICY):
  def step(params, opt_state, x, y):
    scale = jo.get_loss_scale(opt_state)
    loss = lambda p: scale.scale(_loss(policy.cast_to_compute(p), x, y))
    grads = jax.grad(loss)(distributed.mark_varying(params, "data"))
    grads = distributed.reduce_gradients(grads, "data", policy=policy)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                               out_specs=(P(), P())))


def _shard_map_tx(axis_name="data"):
  return jo.with_loss_scale(optax.sgd(0.05, momentum=0.9),
                            jmp_lite.DynamicLossScale(jnp.float32(2 ** 10), period=3),
                            axis_name=axis_name)


def _run_optax(step, tx, put_params, put_batch):
  params = put_params(_params())
  opt_state = put_params(tx.init(params))
  xs, ys = _batches()
  trace = []
  for x, y in zip(xs, ys):
    used = float(jo.get_loss_scale(opt_state).loss_scale)
    params, opt_state = step(params, opt_state, put_batch(x), put_batch(y))
    trace.append((used, bool(jo.find_loss_scale_state(opt_state).skipped), 0.0))
    assert distributed.is_replicated_everywhere(jo.find_loss_scale_state(opt_state))
  return trace, params


def test_shard_map_data_parallel_matches_plain_one_device_run():
  mesh = _mesh((8,), ("data",))
  rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  tx = _shard_map_tx()
  sharded = _run_optax(_shard_map_step(mesh, tx), tx,
                       lambda t: jax.device_put(t, rep), lambda b: jax.device_put(b, data))

  # The reference: the same step with no mesh, on one device.
  tx = _shard_map_tx(axis_name=None)

  @jax.jit
  def plain(params, opt_state, x, y):
    scale = jo.get_loss_scale(opt_state)
    loss = lambda p: scale.scale(_loss(SHARD_MAP_POLICY.cast_to_compute(p), x, y))
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  put = lambda t: jax.device_put(t, jax.devices()[0])
  _check_same_run(_run_optax(plain, tx, put, put), sharded, natural_overflows=False,
                  atol=2e-3)  # bfloat16 sums in a different order


def test_pmap_one_poisoned_replica_makes_every_replica_skip():
  tx = jo.with_loss_scale(optax.sgd(0.1), jmp_lite.DynamicLossScale(jnp.float32(4.0)),
                          axis_name="i")

  def replica(g):
    g = inject_nonfinite(g, 0, at_steps=[0], enabled=jax.lax.axis_index("i") == 5)
    g = distributed.reduce_gradients(g, "i")  # NaN reaches every replica
    _, state = tx.update(g, tx.init(g), g)
    return state.skipped, jmp_lite.all_finite(g), state.loss_scale.loss_scale

  skipped, finite, scale = jax.pmap(replica, axis_name="i")(jnp.ones((8, 3)))
  assert np.asarray(skipped).all() and not np.asarray(finite).any()
  np.testing.assert_array_equal(scale, np.full(8, 2.0, np.float32))


def test_every_array_checked_on_a_copy_of_the_step_under_shard_map_and_pmap(monkeypatch):
  """The two tests above with every array checked on a second computation of
  the step (`jmp_lite._checks.COPY_FROM` = 1; the model's arrays are below
  the real threshold): the copy is traced per device, inside the mapped
  function, its decision is every replica's."""
  from jmp_lite import _checks
  monkeypatch.setattr(_checks, "COPY_FROM", 1)
  test_shard_map_data_parallel_matches_plain_one_device_run()
  test_pmap_one_poisoned_replica_makes_every_replica_skip()


def test_reduce_gradients_averages_in_reduce_dtype_and_returns_param_dtype():
  mesh = _mesh((8,), ("data",))
  grads = jax.device_put(jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3).astype(
      jnp.bfloat16), NamedSharding(mesh, P("data")))
  for policy, mean in [("p=f32,c=bf16", True), ("p=bf16,c=bf16,r=bf16", False)]:
    f = jax.jit(jax.shard_map(
        lambda g: {"g": distributed.reduce_gradients(g, "data", policy=policy, mean=mean),
                   "i": jnp.ones((1,), jnp.int32)},
        mesh=mesh, in_specs=P("data"), out_specs={"g": P(), "i": P("data")}))
    out = f(grads)["g"]
    expected = np.arange(24, dtype=np.float32).reshape(8, 3).sum(0, keepdims=True)
    expected = expected / 8 if mean else expected
    assert out.dtype == jmp_lite.get_policy(policy).param_dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=1e-2)


def test_reduce_gradients_rejects_gradients_jax_already_reduced():
  mesh = _mesh((8,), ("data",))
  x = jax.device_put(jnp.ones((BATCH, D_IN)), NamedSharding(mesh, P("data")))
  params = jax.device_put(_params(), NamedSharding(mesh, P()))

  def step(params, x):
    grads = jax.grad(lambda p: _loss(POLICY.cast_to_compute(p), x, x[:, :D_OUT]))(params)
    return distributed.reduce_gradients(grads, "data", policy=POLICY)

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
  with pytest.raises(ValueError, match=r"\['b1'\].*already reduced over \('data',\).*mark_varying"):
    f(params, x)



def _per_device_one():
  """1.0, typed per-device: what any per-replica operation brings in."""
  return 1.0 + 0.0 * jax.lax.axis_index("data").astype(jnp.float32)


def _bn_loss(params, x, y):
  """`_loss` with the hidden layer normalised by cross-device (synced) stats."""
  h = x.astype(params["w1"].dtype) @ params["w1"] + params["b1"]
  mean = jax.lax.pmean(jnp.mean(h, 0), "data")
  h = jnp.tanh(h - mean)
  return jnp.mean(((h @ params["w2"]).astype(jnp.float32) - y) ** 2)


def _forgot_then(after):
  """Gradients of replicated (unmarked) params, then ``after`` before the reduction."""
  def grads_fn(params, x, y):
    loss = lambda p: _loss(POLICY.cast_to_compute(p), x, y)
    return after(params, x, y, loss)
  return grads_fn


# Each forgets mark_varying, then makes the (already summed) gradients
# per-device again, so that their type no longer shows the sum.
_DEFEATED = {
    "masked": lambda p, x, y, loss: jax.tree.map(
        lambda g: g * _per_device_one(), jax.grad(loss)(p)),
    "local_weight_decay": lambda p, x, y, loss: jax.tree.map(
        lambda g, w: g + 1e-4 * w * _per_device_one(), jax.grad(loss)(p), p),
    "jit_inside": lambda p, x, y, loss: jax.tree.map(
        lambda g: g * _per_device_one(), jax.jit(jax.grad(loss))(p)),
    "remat": lambda p, x, y, loss: jax.tree.map(
        lambda g: g * _per_device_one(), jax.grad(jax.checkpoint(loss))(p)),
    "scan_accumulation": lambda p, x, y, loss: jax.lax.scan(
        lambda acc, xy: (jax.tree.map(jnp.add, acc, jax.grad(
            lambda q: _loss(POLICY.cast_to_compute(q), *xy))(p)), None),
        distributed.mark_varying(jax.tree.map(jnp.zeros_like, p), "data"),
        (x.reshape(2, -1, D_IN), y.reshape(2, -1, D_OUT)))[0],
}

# Correct flows (mark_varying) with the same kinds of operations, and
# reductions inside the backward pass (a synced batch norm): never refused.
_MARKED = {
    "masked": lambda p, x, y, loss: jax.tree.map(
        lambda g: g * _per_device_one(), jax.grad(loss)(distributed.mark_varying(p, "data"))),
    "weight_decay_from_replicated_params": lambda p, x, y, loss: jax.tree.map(
        lambda g, w: g + 1e-4 * w, jax.grad(loss)(distributed.mark_varying(p, "data")), p),
    "clipped_by_global_norm": lambda p, x, y, loss: (lambda g: jax.tree.map(
        lambda a: a / jnp.sqrt(jax.lax.psum(sum(jnp.sum(b * b) for b in jax.tree.leaves(g)),
                                            "data")), g))(
        jax.grad(loss)(distributed.mark_varying(p, "data"))),
    "synced_batch_norm": lambda p, x, y, loss: jax.grad(
        lambda q: _bn_loss(POLICY.cast_to_compute(q), x, y))(distributed.mark_varying(p, "data")),
    "scan_accumulation": lambda p, x, y, loss: (lambda q: jax.lax.scan(
        lambda acc, xy: (jax.tree.map(jnp.add, acc, jax.grad(
            lambda r: _loss(POLICY.cast_to_compute(r), *xy))(q)), None),
        jax.tree.map(jnp.zeros_like, q),
        (x.reshape(2, -1, D_IN), y.reshape(2, -1, D_OUT)))[0])(
            distributed.mark_varying(p, "data")),
}


def _reduced(grads_fn):
  mesh = _mesh((8,), ("data",))
  xs, ys = _batches()
  x = jax.device_put(xs[0], NamedSharding(mesh, P("data")))
  y = jax.device_put(ys[0], NamedSharding(mesh, P("data")))
  params = jax.device_put(_params(), NamedSharding(mesh, P()))

  def step(params, x, y):
    return distributed.reduce_gradients(grads_fn(params, x, y), "data", policy=POLICY)

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                            out_specs=P()))
  return lambda: f(params, x, y)


@pytest.mark.parametrize("after", sorted(_DEFEATED))
def test_reduce_gradients_finds_a_sum_by_jax_after_later_per_device_ops(after):
  run = _reduced(_forgot_then(_DEFEATED[after]))
  with pytest.raises(ValueError, match=r"gradient \['(b1|w1|w2)'\] \(float32\[\d+(, \d+)?\]\) "
                     r"was already summed over 'data' by JAX, in float16.*mark_varying"):
    run()


@pytest.mark.parametrize("flow", sorted(_MARKED))
def test_reduce_gradients_accepts_marked_flows_with_the_same_ops(flow):
  grads = jax.tree.map(np.asarray, _reduced(_forgot_then(_MARKED[flow]))())
  assert all(np.isfinite(g).all() and g.dtype == np.float32 for g in jax.tree.leaves(grads))


def test_what_the_check_prevents_a_defeated_sum_is_eight_times_the_mean(monkeypatch):
  # Oracle: the full batch's gradient on one device. The marked flow gives
  # it; the defeated one, with the check switched off, gives 8 times it.
  xs, ys = _batches()
  full = jax.grad(lambda p: _loss(POLICY.cast_to_compute(p), xs[0], ys[0]))(_params())
  marked = _reduced(_forgot_then(_MARKED["masked"]))()
  monkeypatch.setattr(_provenance, "summed_by_autodiff", lambda g, axis: None)
  defeated = _reduced(_forgot_then(_DEFEATED["masked"]))()
  for want, good, bad in zip(*map(jax.tree.leaves, (full, marked, defeated))):
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(good), want, rtol=2e-2, atol=2e-4)
    np.testing.assert_allclose(np.asarray(bad), 8 * want, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("check_vma", [True, False])
def test_train_state_in_shard_map_without_axis_name_is_refused(check_vma):
  mesh = _mesh((8,), ("data",))
  state = jmp_lite.TrainState.create(
      apply_fn=None, params={"w": jnp.ones((D_IN, 2))}, tx=optax.sgd(0.1),
      loss_scale=jmp_lite.StaticLossScale(2.0), policy="p=f32,c=bf16,o=f32")
  x = jax.device_put(jnp.ones((BATCH, D_IN)), NamedSharding(mesh, P("data")))

  def step(state, x):
    state, info = state.minimize(lambda p: jnp.mean(x.astype(p["w"].dtype) @ p["w"]))
    return state

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                            check_vma=check_vma))
  expected = (r"parameter \['w'\] is replicated over the mesh axes \('data',\).*"
              r"axis_name='data'" if check_vma else
              r"runs inside shard_map with check_vma=False.*\('data',\).*axis_name='data'")
  with pytest.raises(ValueError, match="TrainState.minimize: " + expected):
    f(state, x)


@pytest.mark.parametrize("api", ["value_and_grad", "with_loss_scale"])
def test_without_check_vma_a_missing_axis_name_is_refused(api):
  mesh = _mesh((4, 2), ("data", "model"))
  x = jax.device_put(jnp.ones((BATCH, D_IN)), NamedSharding(mesh, P(("data", "model"))))
  w = jnp.ones((D_IN, 2))

  def step(w, x, axis_name):
    loss = lambda w: jnp.mean(x @ w)
    if api == "value_and_grad":
      return jmp_lite.value_and_grad(loss, axis_name=axis_name)(w)[2]
    tx = jo.with_loss_scale(optax.sgd(0.1), jmp_lite.StaticLossScale(2.0),
                            axis_name=axis_name)
    grads = distributed.reduce_gradients(jax.grad(loss)(w), ("data", "model"))
    return tx.update(grads, tx.init(w), w)[1].skipped

  def run(axis_name):
    return jax.jit(jax.shard_map(lambda w, x: step(w, x, axis_name), mesh=mesh,
                                 in_specs=(P(), P(("data", "model"))), out_specs=P(),
                                 check_vma=False))(w, x)

  assert bool(run(("data", "model"))) == (api == "value_and_grad")
  for partial in (None, "data"):
    with pytest.raises(ValueError, match=api + r": runs inside shard_map with "
                       r"check_vma=False .*axis_name=\('data', 'model'\)"):
      run(partial)


def test_adjust_refuses_a_flag_that_differs_between_devices():
  mesh = _mesh((8,), ("data",))
  scale = jmp_lite.DynamicLossScale(jnp.float32(8.0))

  def step(scale, x):
    local = jmp_lite.all_finite(x)  # this device's rows only
    return scale.adjust(local)

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
  with pytest.raises(ValueError, match=r"DynamicLossScale.adjust: the decision .*"
                     r"all_finite\(grads, axis_name='data'\)"):
    f(scale, jnp.ones((8, 2)))


# ----------------------------------------------------------------------- HLO

_ALL_REDUCE = re.compile(r"=\s*(?P<shape>.*?)\s+all-reduce(?:-start)?\((?P<rest>.*)$")
_ELEMENT = re.compile(r"\b([a-z]+[0-9]+[a-z0-9]*)\[")


def _all_reduces(hlo_text):
  """(element type, promoted?) of each floating operand of each all-reduce in HLO text.

  XLA combines all-reduces into one over a tuple, so one instruction can
  carry several operands.
  """
  found = []
  for line in hlo_text.splitlines():
    m = _ALL_REDUCE.search(line)
    if not m:
      continue
    promoted = re.search(r"to_apply=%[\w.]*_promoted\b", m["rest"]) is not None
    for dtype in _ELEMENT.findall(m["shape"]):
      if dtype.startswith(("f", "bf")):
        found.append((dtype, promoted))
  return found


def _hlo_step(reduce_dtype, mark=True):
  policy = jmp_lite.Policy(jnp.float32, jnp.bfloat16, jnp.float32, reduce_dtype=reduce_dtype)
  mesh = _mesh((8,), ("data",))
  tx = jo.with_loss_scale(optax.sgd(0.1), jmp_lite.DynamicLossScale(jnp.float32(2 ** 15)),
                          axis_name="data")

  def step(params, opt_state, x, y):
    scale = jo.get_loss_scale(opt_state)
    p = distributed.mark_varying(params, "data") if mark else params
    grads = jax.grad(lambda p: scale.scale(_loss(policy.cast_to_compute(p), x, y)))(p)
    if mark:
      grads = distributed.reduce_gradients(grads, "data", policy=policy)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                            out_specs=(P(), P())))
  rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params = jax.device_put(_params(), rep)
  args = (params, jax.device_put(tx.init(params), rep),
          jax.device_put(jnp.ones((BATCH, D_IN)), data),
          jax.device_put(jnp.ones((BATCH, D_OUT)), data))
  return f.lower(*args)


@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_hlo_gradient_all_reduce_dtype_is_the_policy_reduce_dtype(reduce_dtype):
  lowered = _hlo_step(reduce_dtype)
  want = {"float32": "f32", "bfloat16": "bf16"}[reduce_dtype]
  # What jmp_lite emits: one all-reduce per parameter, in reduce_dtype.
  before = _all_reduces(lowered.as_text(dialect="hlo"))
  assert len(before) == 3 and {d for d, _ in before} == {want}, before
  # What runs. XLA's CPU backend has no bfloat16 all-reduce: it sums those
  # in float32 and marks the reducer "_promoted" (TPU and GPU keep bf16).
  after = _all_reduces(lowered.compile().as_text())
  assert len(after) >= 1, after
  for dtype, promoted in after:
    if reduce_dtype == "float32":
      assert dtype == "f32" and not promoted, after
    else:
      assert dtype == "bf16" or (dtype == "f32" and promoted), after


def test_hlo_without_mark_varying_jax_all_reduces_in_the_compute_dtype():
  # Why mark_varying exists: JAX's own gradient all-reduce (for replicated
  # params inside shard_map) runs where the parameter meets the data, in the
  # compute dtype, even with reduce_dtype float32.
  before = _all_reduces(_hlo_step("float32", mark=False).as_text(dialect="hlo"))
  assert "bf16" in {d for d, _ in before}, before


def _jit_sharded_gradient(policy, grad=None):
  mesh = _mesh((8,), ("data",), auto=True)
  data = NamedSharding(mesh, P("data"))
  params = jax.device_put(_params(), NamedSharding(mesh, P()))
  if grad is None:
    grad = lambda p, x, y: jmp_lite.value_and_grad(_loss, policy=policy)(p, x, y)[1]
  return grad, (params, jax.device_put(jnp.ones((BATCH, D_IN)), data),
                jax.device_put(jnp.ones((BATCH, D_OUT)), data))


@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_hlo_jit_sharded_gradient_all_reduce_is_in_reduce_dtype(reduce_dtype):
  # Under plain jit the partitioner all-reduces each gradient's partial sums in
  # the dtype of the op that makes them: value_and_grad(policy=...) runs the
  # engine, whose weight-gradient dots emit reduce_dtype partial sums and
  # whose bias broadcast sums in float32 (see jmp_lite._jaxpr.passes.sink).
  policy = jmp_lite.Policy(jnp.float32, jnp.bfloat16, jnp.float32,
                           reduce_dtype=reduce_dtype)
  grad, args = _jit_sharded_gradient(policy)
  ops = distributed.collectives(grad, *args)
  reductions = [op for op in ops if op.kind in ("all-reduce", "reduce-scatter")]
  # One per parameter (w1, b1, w2), nothing gathered.
  assert len(reductions) == 3 and len(ops) == 3, ops
  assert {op.dtype for op in reductions} == {np.dtype(reduce_dtype)}, ops
  # What runs on CPU: float32, not a promoted bf16 sum, for float32.
  after = _all_reduces(jax.jit(grad).lower(*args).compile().as_text())
  if reduce_dtype == "float32":
    assert after and all(d == "f32" and not promoted for d, promoted in after), after


def test_hlo_jit_sharded_bf16_stored_params_all_reduce_in_float32():
  # p=bf16: no downcast to move past the bias's broadcast, so the engine
  # upcasts the bias exactly before it; its partial sums cross devices in
  # float32, as the weights' (float32 dot outputs) do, and are rounded once.
  # Before, the bias's all-reduce ran in bf16.
  policy = jmp_lite.Policy(jnp.bfloat16, jnp.bfloat16, jnp.float32)
  grad, (params, x, y) = _jit_sharded_gradient(policy)
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  ops = distributed.collectives(grad, params, x, y)
  reductions = [op for op in ops if op.kind in ("all-reduce", "reduce-scatter")]
  assert len(reductions) == 3 and len(ops) == 3, ops
  assert {op.dtype for op in reductions} == {np.dtype(jnp.float32)}, ops
  got = jax.jit(grad)(params, x, y)
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(got))


def test_hlo_jit_sharded_plain_grad_all_reduces_in_the_compute_dtype():
  # The limit the engine removes: jax.grad of a step that casts with
  # cast_to_compute itself gets its gradients all-reduced in bf16.
  policy = jmp_lite.get_policy("p=f32,c=bf16,o=f32")
  plain = lambda p, x, y: jax.grad(lambda p: _loss(policy.cast_to_compute(p), x, y))(p)
  grad, args = _jit_sharded_gradient(policy, plain)
  ops = distributed.collectives(grad, *args)
  assert ops and {op.dtype for op in ops} == {np.dtype(jnp.bfloat16)}, ops


def test_collectives_bytes_halve_with_a_bf16_reduce_dtype():
  f32, bf16 = (_jit_sharded_gradient(jmp_lite.Policy(
      jnp.float32, jnp.bfloat16, jnp.float32, reduce_dtype=r)) for r in (
          jnp.float32, jnp.bfloat16))
  size = lambda ops: sum(op.bytes for op in ops)
  f32_bytes = size(distributed.collectives(*f32[:1], *f32[1]))
  bf16_bytes = size(distributed.collectives(*bf16[:1], *bf16[1]))
  n_params = sum(x.size for x in jax.tree.leaves(_params()))
  assert f32_bytes == 4 * n_params and bf16_bytes == 2 * n_params


def test_train_state_under_shard_map_one_poisoned_replica_skips_everywhere():
  mesh = _mesh((8,), ("data",))
  state = jmp_lite.TrainState.create(
      apply_fn=None, params={"w": jnp.ones((D_IN, 2))}, tx=optax.sgd(0.1),
      loss_scale=jmp_lite.StaticLossScale(2.0), axis_name="data")
  x = jax.device_put(jnp.ones((BATCH, D_IN)), NamedSharding(mesh, P("data")))

  def step(state, x):
    me = jax.lax.axis_index("data")
    # An infinite factor on replica 3 makes its gradients non-finite.
    poison = jnp.where(me == 3, jnp.float32(jnp.inf), jnp.float32(1.0))
    loss = lambda p: jnp.mean(x @ p["w"]) * poison
    state, info = state.minimize(loss)
    return info.skipped.reshape(1)

  skipped = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")),
                                  out_specs=P("data")))(state, x)
  assert np.asarray(skipped).all()


def test_train_state_under_shard_map_reports_the_mean_loss_on_every_replica():
  """Found by a user: ``info.loss`` was each replica's own (varying), so a
  step returning ``info`` with ``out_specs=P()`` failed to trace, where every
  other field is replicated. Oracle: the mean of the replicas' losses,
  computed here from the per-device batches, and the one-device loss."""
  mesh = _mesh((8,), ("data",))
  state = jmp_lite.TrainState.create(
      apply_fn=None, params={"w": jnp.ones((D_IN, 2))}, tx=optax.sgd(0.1),
      loss_scale=jmp_lite.DynamicLossScale(2.0 ** 4), axis_name="data")
  x = jnp.arange(BATCH * D_IN, dtype=jnp.float32).reshape(BATCH, D_IN) / (BATCH * D_IN)
  loss = lambda p, x: jnp.mean((x @ p["w"]) ** 2)

  def step(state, x):
    return state.minimize(loss, x)[1]

  info = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")),
                               out_specs=P()))(
      state, jax.device_put(x, NamedSharding(mesh, P("data"))))
  per_device = [float(loss(state.params, part)) for part in np.split(np.asarray(x), 8)]
  np.testing.assert_allclose(float(info.loss), np.mean(per_device), rtol=1e-6)
  np.testing.assert_allclose(float(info.loss), float(loss(state.params, x)), rtol=1e-6)


@pytest.mark.parametrize("auto", [True, False], ids=["auto", "explicit"])
def test_flax_wrap_under_jit_sharded_batch_matches_one_device(auto):
  # wrap's float32-accumulating weight-gradient dots contract the sharded
  # batch: under explicit axes they must name their output sharding. (The
  # partitioner still all-reduces them after their cast to bf16: see
  # test_hlo_jit_sharded_gradient_all_reduce_is_in_reduce_dtype.)
  import flax.linen as nn
  import jmp_lite.flax

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(D_OUT)(nn.relu(nn.Dense(D_HIDDEN)(x)))

  model = jmp_lite.flax.wrap(Model(), "p=f32,c=bf16,o=f32")
  x = jnp.asarray(_batches()[0][0])
  params = model.init(jax.random.key(0), jnp.ones((1, D_IN)))["params"]
  grad = lambda p, x: jax.grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(p)
  single = jax.jit(grad)(params, x)

  mesh = _mesh((8,), ("data",), auto=auto)
  sharded_x = jax.device_put(x, NamedSharding(mesh, P("data")))
  sharded_p = jax.device_put(params, NamedSharding(mesh, P()))
  with jax.set_mesh(mesh):
    f = jax.jit(grad)
    got = f(sharded_p, sharded_x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(single)):
    assert a.dtype == b.dtype == jnp.float32
    assert a.sharding.is_fully_replicated
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-3)


# ----------------------------------------------------------------- telemetry


def _tapped_loss(params, x, y):
  tap = jmp_lite.telemetry.tap
  h = tap(jnp.tanh(x.astype(params["w1"].dtype) @ params["w1"] + params["b1"]), "hidden")
  out = tap(h @ params["w2"], "out")
  return jnp.mean((out.astype(jnp.float32) - y) ** 2)


@pytest.mark.parametrize("every", [1, 2])
def test_telemetry_under_shard_map_is_reduced_across_devices(every):
  # Oracle: the same step on one device. Forward statistics are the same
  # numbers (max of the per-device maxima, sum of counts); each device's
  # loss is the mean over its 8 rows, so its cotangents are 8x the global
  # mean's, exactly (a power of two).
  telemetry = jmp_lite.Telemetry(every=every, what_if=("e4m3",))
  xs, ys = _batches()
  x, y = xs[0], ys[0]

  def state():
    return jmp_lite.TrainState.create(apply_fn=None, params=_params(),
                                      tx=optax.sgd(0.05), policy=POLICY,
                                      loss_scale=jmp_lite.StaticLossScale(2.0 ** 4))

  single = jax.jit(lambda s, x, y: s.minimize(_tapped_loss, x, y,
                                              telemetry=telemetry)[1].precision)(
      state(), x, y)
  mesh = _mesh((N_DEVICES,), ("data",))
  sharded_state = state().replace(axis_name="data")
  replicated = jax.tree.map(lambda _: P(), sharded_state)
  step = jax.jit(jax.shard_map(
      lambda s, x, y: s.minimize(_tapped_loss, x, y, telemetry=telemetry)[1].precision,
      mesh=mesh, in_specs=(replicated, P("data"), P("data")), out_specs=P()))
  sharded = step(sharded_state, x, y)
  assert bool(sharded.sampled) and list(sharded.modules) == ["hidden", "out"]
  for name in ("hidden", "out"):
    a, b = single.modules[name], sharded.modules[name]
    assert float(a.forward_max) == float(b.forward_max) > 0
    assert int(a.forward_nonfinite) == int(b.forward_nonfinite) == 0
    for d in a.forward_underflow:
      np.testing.assert_allclose(float(b.forward_underflow[d]),
                                 float(a.forward_underflow[d]), rtol=1e-6)
    assert float(b.backward_max) == 8 * float(a.backward_max) > 0


# ----------------------------------------------------------------------- fp8

FP8_POLICY = "p=f32,c=bf16,o=f32"


def _fp8_loss(params, x, y):
  with jax.named_scope("mlp"):
    h = jnp.tanh(x.astype(params["w1"].dtype) @ params["w1"] + params["b1"])
    out = h @ params["w2"]
  return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def _fp8_state(x, y):
  fp8 = jmp_lite.fp8.init(_fp8_loss, _params(), x, y, policy=FP8_POLICY,
                          select="mlp", history_length=4)
  return jmp_lite.TrainState.create(apply_fn=None, params=_params(), tx=optax.sgd(0.05),
                                    policy=FP8_POLICY, fp8=fp8,
                                    loss_scale=jmp_lite.StaticLossScale(2.0 ** 4))


def _newest(state):
  return {k: np.stack([np.asarray(getattr(m, r).amax_history[..., 0])
                       for r in ("lhs", "rhs", "grad")])
          for k, m in state.loss_scale_state.fp8.sites.items()}


def test_fp8_maxima_are_max_reduced_across_devices_under_shard_map():
  # Oracle: the same step on one device. Each device's lhs maximum is that
  # of its rows; the recorded one must be the largest (the one-device
  # value), not a sum or mean. Each device's loss is the mean over its 8
  # rows, so its cotangents are 8x the global mean's, exactly.
  xs, ys = _batches()
  x, y = xs[0], ys[0]
  step = lambda s, x, y: s.minimize(_fp8_loss, x, y)[0]
  single = _newest(jax.jit(step)(_fp8_state(x, y), x, y))
  mesh = _mesh((N_DEVICES,), ("data",))
  sharded_state = _fp8_state(x, y).replace(axis_name="data")
  replicated = jax.tree.map(lambda _: P(), sharded_state)
  sharded = _newest(jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=(replicated, P("data"), P("data")),
      out_specs=replicated))(sharded_state, x, y))
  assert list(sharded) == ["mlp", "mlp#2"]
  per_device = np.abs(x.astype(jnp.bfloat16).astype(np.float32)).reshape(
      N_DEVICES, -1).max(axis=1)
  assert len(set(per_device.tolist())) > 1  # a sum or a mean would differ
  assert sharded["mlp"][0] == single["mlp"][0] == per_device.max()
  for k in single:
    assert sharded[k][1] == single[k][1] > 0  # replicated weights
    assert sharded[k][2] == 8 * single[k][2] > 0


def _fp8_newest_on_one_device_and_sharded(x, y):
  """The newest fp8 maxima of one jitted step on one device, and on a data
  mesh of every device with the batch sharded."""
  step = jax.jit(lambda s, x, y: s.minimize(_fp8_loss, x, y)[0])
  single = _newest(step(_fp8_state(x, y), x, y))
  mesh = _mesh((N_DEVICES,), ("data",))
  with jax.set_mesh(mesh):
    xd = jax.device_put(x, NamedSharding(mesh, P("data")))
    yd = jax.device_put(y, NamedSharding(mesh, P("data")))
    sharded = _newest(step(_fp8_state(x, y), xd, yd))
  for k in single:
    np.testing.assert_array_equal(sharded[k], single[k])
  return single


def test_fp8_maxima_under_jit_with_a_sharded_batch_are_global():
  xs, ys = _batches()
  _fp8_newest_on_one_device_and_sharded(xs[0], ys[0])


def test_fp8_maxima_of_an_overflowing_shard_are_nothing_seen_on_every_layout():
  """An inf in one device's rows: one device reads the step's maxima as
  non-finite and records 0; a sharded maximum dropped that shard's NaN and
  recorded the other devices' finite maxima, so the fp8 state (and every
  later scale) depended on the layout."""
  xs, ys = _batches()
  x = jnp.asarray(xs[0]).at[3, 2].set(jnp.inf)  # row 3: the first shard only
  single = _fp8_newest_on_one_device_and_sharded(x, ys[0])
  assert float(single["mlp#2"][2]) == 0.0  # the output's gradient: nothing seen


def test_kahan_and_accumulation_buffers_are_sharded_as_their_parameters():
  """``jnp.zeros(shape)`` put the whole Kahan compensation and the
  accumulated gradients on device 0 at ``init``, under FSDP a full copy of
  the model on one device; ``optax.adam``'s moments (the oracle) follow the
  parameters' sharding."""
  mesh = _mesh((N_DEVICES,), ("fsdp",))
  spec = NamedSharding(mesh, P("fsdp"))
  params = {"w": jax.device_put(jnp.ones((64, 8), jnp.bfloat16), spec)}
  assert optax.adam(1e-3).init(params)[0].mu["w"].sharding == spec
  kahan = jo.kahan_summation().init(params)
  acc = jo.with_loss_scale(optax.sgd(0.1), jmp_lite.NoOpLossScale(),
                           accumulate_steps=2).init(params)
  for buffer in (kahan.compensation["w"], acc.acc_grads["w"]):
    assert buffer.sharding == spec
    assert buffer.addressable_shards[0].data.shape == (8, 8)


# ------------------------------------------------------- per-module loss scales


def test_module_loss_scale_under_shard_map_sums_what_the_devices_measured():
  # Oracle: the same step on one device. The counts of what each module
  # measured add up over the devices to the one device's; the new parameters
  # are the one device's (each device's loss is the mean over its rows, and
  # the gradients are averaged).
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jmp_lite.flax  # pylint: disable=g-import-not-at-top
  from jmp_lite._jaxpr import module_scales as ms  # pylint: disable=g-import-not-at-top

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(D_OUT)(jnp.tanh(nn.Dense(D_HIDDEN)(x)))

  xs, ys = _batches()
  x, y = xs[0], ys[0]
  wrapped = jmp_lite.flax.wrap(Model(), POLICY)
  params = Model().init(jax.random.PRNGKey(0), x)
  ls = jmp_lite.ModuleLossScale.create(wrapped, x, loss_scale=2.0 ** 4)

  def loss(p, x, y):
    return jnp.mean((wrapped.apply(p, x).astype(jnp.float32) - y) ** 2)

  def measure(p, x, y):
    return jmp_lite.value_and_grad(loss)(p, x, y, loss_scale=ls)[3]

  single = jax.jit(measure)(params, x, y)
  mesh = _mesh((N_DEVICES,), ("data",))
  replicated = jax.tree.map(lambda _: P(), params)
  sharded = jax.jit(jax.shard_map(
      lambda p, x, y: jmp_lite.value_and_grad(loss, axis_name="data")(
          distributed.mark_varying(p, "data"), x, y, loss_scale=ls)[3],
      mesh=mesh, in_specs=(replicated, P("data"), P("data")), out_specs=P()))(
          params, x, y)
  sharded, single = np.asarray(sharded), np.asarray(single)
  for column in (ms.ELEMENTS, ms.NONZERO, ms.NONFINITE):
    np.testing.assert_array_equal(sharded[:, ms.ENTER, column],
                                  single[:, ms.ENTER, column])
  # Inside: the activations' cotangents add up to the one device's; each
  # device measures its own (not yet averaged) weight gradients in full.
  sizes = [sum(np.size(v) for v in jax.tree.leaves(params["params"][path]))
           for path in ls.paths]
  np.testing.assert_array_equal(
      sharded[:, ms.INSIDE, ms.ELEMENTS] - single[:, ms.INSIDE, ms.ELEMENTS],
      (N_DEVICES - 1) * np.asarray(sizes, np.float32))
  assert np.all(sharded[:, :, ms.NONFINITE] == 0)

  def state():
    return jmp_lite.TrainState.create(apply_fn=None, params=params,
                                      tx=optax.sgd(0.05), loss_scale=ls)

  one = jax.jit(lambda s: s.minimize(loss, x, y)[0])(state())
  sharded_state = state().replace(axis_name="data")
  spec = jax.tree.map(lambda _: P(), sharded_state)
  many = jax.jit(jax.shard_map(lambda s, x, y: s.minimize(loss, x, y)[0], mesh=mesh,
                               in_specs=(spec, P("data"), P("data")),
                               out_specs=spec))(sharded_state, x, y)
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(many.params)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("auto", [True, False], ids=["auto", "explicit"])
def test_wrap_on_a_data_mesh_gathers_no_more_than_the_plain_model(auto):
  """The bias add's downcast, moved after the broadcast by `wrap`, broadcast
  to a replicated full-size operand: on a mesh of Explicit axes the backward
  pass all-gathered the whole global batch of cotangents (f32[512, 256]) on
  every device to sum the bias gradient. Oracle: the same model, unwrapped
  at Flax's bf16 dtype, on the same mesh: no all-gather."""
  import flax.linen as nn
  import jmp_lite.flax
  mesh = _mesh((8,), ("data",), auto)
  x = jax.device_put(jnp.ones((512, 64)), NamedSharding(mesh, P("data")))
  params = jax.device_put(nn.Dense(256).init(jax.random.key(0), jnp.ones((1, 64)))["params"],
                          NamedSharding(mesh, P()))

  def gathers(model):
    grad = jax.jit(jax.grad(lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)))
    return grad.lower(params, x).compile().as_text().count(" all-gather(")

  assert gathers(jmp_lite.flax.wrap(nn.Dense(256), "p=f32,c=bf16,o=f32")) == gathers(
      nn.Dense(256, dtype=jnp.bfloat16)) == 0


@pytest.mark.parametrize("length", [16, 8])
def test_fp8_restore_places_leaves_on_the_targets_shardings(tmp_path, length):
  """fp8.restore into an abstract target laid out for the mesh (w1 split
  over 8 devices, the rest replicated): every leaf came back on device 0,
  a whole FSDP model gathered there (and across processes it could not run:
  NumPy cannot read other processes' shards). Oracle: the target's own
  shardings; the values as saved (histories re-laid for a new length)."""
  import jmp_lite.fp8  # pylint: disable=g-import-not-at-top
  mesh = _mesh((8,), ("data",))
  x = jnp.ones((8, D_IN))

  def loss_fn(p, x):
    with jax.named_scope("mlp"):
      return jnp.mean(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"])

  def make(history_length):
    f8 = jmp_lite.fp8.init(loss_fn, _params(), x, select="mlp",
                           history_length=history_length)
    return jmp_lite.TrainState.create(
        apply_fn=None, params=_params(), tx=optax.adam(1e-3), policy="p=f32,c=f16,o=f32",
        fp8=f8, loss_scale=jmp_lite.DynamicLossScale(2.0 ** 12))

  def sharding(path, leaf):
    split = "w1" in jax.tree_util.keystr(path) and leaf.ndim == 2
    return NamedSharding(mesh, P(None, "data") if split else P())

  with jax.numpy_dtype_promotion("standard"):
    state, _ = jax.jit(lambda s: s.minimize(loss_fn, x))(make(16))
  state = jax.tree_util.tree_map_with_path(
      lambda p, l: jax.device_put(l, sharding(p, l)), state)
  restored, target, raw = _data.fp8_restored(str(tmp_path / "ckpt"), state,
                                             lambda: make(length), sharding)
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(restored),
                               jax.tree.leaves(target)):
    assert got.sharding == want.sharding, jax.tree_util.keystr(path)
  assert len(restored.params["w1"].addressable_shards) == 8
  np.testing.assert_array_equal(restored.params["w1"], state.params["w1"])
  # A target made by eval_shape under set_mesh (explicit axes) names an
  # abstract mesh, which device_put refused: placed on the mesh set.
  explicit = _mesh((8,), ("data",), auto=False)
  with jax.set_mesh(explicit):
    abstract = jax.eval_shape(lambda: jax.tree_util.tree_map_with_path(
        lambda p, l: jax.device_put(l, NamedSharding(explicit, sharding(p, l).spec)),
        make(length)))
    assert isinstance(abstract.params["w1"].sharding.mesh, jax.sharding.AbstractMesh)
    again = jmp_lite.fp8.restore(raw, abstract)
  assert again.params["w1"].sharding.spec == P(None, "data")
  assert len(again.params["w1"].addressable_shards) == 8


@pytest.mark.parametrize("scaling", ["delayed", "current", "block"])
def test_fp8_data_parallel_step_on_a_mesh_of_explicit_axes(scaling):
  """fp8 under jit with the batch split over ``jax.make_mesh``'s default
  (explicit) axes: the weight gradients' fp8 products contract the sharded
  batch and raised ShardingTypeError (no output sharding). Oracle: the same
  step on a mesh of Auto axes, which the partitioner lays out itself."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jmp_lite.flax  # pylint: disable=g-import-not-at-top
  import jmp_lite.fp8  # pylint: disable=g-import-not-at-top

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(32)(nn.relu(nn.Dense(64)(x)))

  x = jax.random.normal(jax.random.key(1), (16, 64))
  y = jnp.zeros((16,), jnp.int32)
  policy = "p=f32,c=bf16,o=f32"
  model = jmp_lite.flax.wrap(MLP(), policy, rules={nn.Dense: policy + ",fp8=hybrid"})
  params = model.init(jax.random.key(0), x)["params"]
  loss = lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(
      model.apply({"params": p}, x), y).mean()
  out = {}
  for auto in (True, False):
    mesh = _mesh((8,), ("data",), auto=auto)
    state = jmp_lite.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.sgd(0.5),
        loss_scale=jmp_lite.DynamicLossScale(2.0 ** 15),
        fp8=jmp_lite.fp8.init(loss, params, x, y, scaling=scaling))
    state = jax.device_put(state, NamedSharding(mesh, P()))
    xs, ys = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    with jax.numpy_dtype_promotion("standard"):
      state, info = jax.jit(lambda s, x, y: s.minimize(loss, x, y))(state, xs, ys)
    assert not bool(info.skipped)
    # SGD at 0.5: the step's gradients.
    out[auto] = jax.tree.map(lambda p, q: (p - q) / 0.5, params, state.params)
  # The two partitionings may sum in another order, and bf16 cotangents then
  # round a value or two to the neighbouring bf16 number: a few bf16 ulps of
  # the largest gradient. (A missing all-reduce is off by the 8 devices.)
  for a, b in zip(jax.tree.leaves(out[True]), jax.tree.leaves(out[False])):
    np.testing.assert_allclose(b, a, rtol=0, atol=2.0 ** -6 * float(jnp.max(jnp.abs(a))))
