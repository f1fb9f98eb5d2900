"""`jmp_lite.Telemetry`: per-module precision statistics from inside the step.

Oracles, none of them jmp_lite's telemetry code:

* forward values: Flax's own ``capture_intermediates`` on the wrapped model
  (its first record of a module is the output as the module computed it, in
  the module's compute dtype: what telemetry reports), a wrapped layer run
  alone (its float32 output is its float16 output, cast exactly), and NumPy
  over crafted values;
* cotangents: ``jax.grad`` of the rest of the model written out in float32
  (split at the module, or unrolled layer by layer for a scanned stack),
  times the loss scale;
* maxima of float16 values are exact in float32, so they match exactly;
  counts and underflow fractions are recomputed with NumPy
  (``ml_dtypes.finfo(dtype).smallest_normal``);
* the step itself: loss, gradients and parameters with and without
  telemetry compared bitwise, and what its jaxpr holds.

Parameters are drawn with NumPy in the models' layouts (``apply`` rejects any
other): an eager ``init`` compiles every initializer, seconds of the budget.
"""

import collections
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite
import jmp_lite.flax
from jmp_lite._jaxpr import probes as _probes
from jmp_lite.telemetry import tap
from jmp_lite.testing import assert_trees_bitwise_equal
from jmp_lite.testing import count_compilations
from jaxprs import equations

F16 = "p=f32,c=f16,o=f32"
# Cotangents computed in float16 (each product rounded once, to 2**-11
# relative) against float32: the paths here are at most four roundings deep
# backward and four forward; 1e-2 is ~2.5x the worst case 8 * 2**-11, and far
# below a real error (a wrong layer is off by O(1), a lost loss scale by 2**4+).
CT_RTOL = 1e-2


def _normal(seed, *shape, scale=1.0):
  return jnp.asarray(scale * np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _dense(seed, n_in, n_out, *layers, bias=0.1):
  return {"kernel": _normal(seed, *layers, n_in, n_out, scale=n_in ** -0.5),
          "bias": _normal(seed + 1, *layers, n_out, scale=bias)}


def _sq_loss(out):
  return jnp.sum(out.astype(jnp.float32) ** 2)


def _under(x, dtype):
  """NumPy: of the non-zero finite |x|, the fraction below dtype's smallest normal."""
  a = np.abs(np.asarray(x, np.float64)).ravel()
  a = a[np.isfinite(a) & (a > 0)]
  return np.mean(a < float(ml_dtypes.finfo(dtype).smallest_normal)) if a.size else 0.0


@functools.partial(jax.jit, static_argnums=0)  # Linen modules hash by value
def _intermediates(wrapped, params, *args):
  return wrapped.apply({"params": params}, *args, capture_intermediates=True,
                       mutable=["intermediates"])[1]


def _capture(wrapped, params, *args):
  """Flax's record of every module's output: path -> its first record."""
  state = _intermediates(wrapped, params, *args)
  flat = jax.tree_util.tree_flatten_with_path(state["intermediates"],
                                              is_leaf=lambda t: isinstance(t, tuple))[0]
  first = lambda out: np.asarray(out[0] if isinstance(out, tuple) else out)  # (carry, y)
  return {"/".join(k.key for k in path[:-1]): first(records[0]) for path, records in flat}


class Mlp(nn.Module):
  """Explicit submodules, so that the model can be split at a layer."""

  def setup(self):
    self.d0, self.ln, self.d1, self.d2 = nn.Dense(16), nn.LayerNorm(), nn.Dense(16), nn.Dense(4)

  def __call__(self, x):
    return self.d2(self.d1(nn.relu(self.ln(self.d0(x)))))


MODULES = ("d0", "ln", "d1", "d2", "")  # in forward order; "" is the model


@functools.cache
def _mlp():
  """The MLP wrapped in float16, and its step measured (compiled once per process)."""
  model = Mlp()
  x = _normal(1, 8, 8).at[:4].multiply(1e-6)  # rows whose d0 outputs are f16 subnormals
  params = {"d0": _dense(2, 8, 16, bias=0.0), "d1": _dense(4, 16, 16), "d2": _dense(6, 16, 4),
            "ln": {"scale": 1 + _normal(8, 16, scale=0.1), "bias": _normal(9, 16, scale=0.1)}}
  wrapped = jmp_lite.flax.wrap(model, F16)
  loss = lambda p: _sq_loss(wrapped.apply({"params": p}, x))
  vg = jmp_lite.value_and_grad(loss, telemetry=jmp_lite.Telemetry(what_if=("e4m3",)))
  measured = jax.jit(lambda p, scale: vg(p, loss_scale=scale))
  return model, wrapped, params, x, loss, measured


def test_forward_stats_of_a_wrapped_linen_model_are_what_flax_captures():
  _, wrapped, params, x, _, measured = _mlp()
  captured = _capture(wrapped, params, x)
  stats = measured(params, jmp_lite.StaticLossScale(1.0))[3]
  # Each module's parameters (as it computes with them) come just before its output.
  params_of = lambda m: [f"{m}/{n}" for n in (("scale", "bias") if m == "ln" else
                                              ("kernel", "bias"))]
  assert stats.order == tuple(p for m in MODULES for p in (params_of(m) if m else []) + [m])
  for path in MODULES[:-1]:
    for name in params_of(path):  # the parameter cast to the module's compute dtype
      m, value = stats.modules[name], params[path][name.split("/")[1]]
      dtype = "float32" if path == "ln" else "float16"
      assert m.dtype == dtype and float(m.forward_max) == np.max(np.abs(value.astype(dtype)))
  for path in MODULES:
    value, m = captured[path], stats.modules[path]
    want = "float32" if path == "ln" else "float16"  # LayerNorm: a default rule
    assert m.dtype == value.dtype.name == want, path
    assert float(m.forward_max) == np.max(np.abs(value)) and int(m.forward_nonfinite) == 0
    assert set(m.forward_underflow) == {want, "float8_e4m3fn"}
    for dtype in (want, "float8_e4m3fn"):
      np.testing.assert_allclose(m.forward_underflow[dtype], _under(value, dtype),
                                 rtol=1e-6, err_msg=f"{path} {dtype}")
  # Not vacuous: the tiny rows make half of d0's outputs float16 subnormals.
  assert 0.4 < float(stats.modules["d0"].forward_underflow["float16"]) < 0.6


def test_backward_stats_are_the_scaled_cotangent_of_the_module_output():
  model, _, params, x, _, measured = _mlp()

  @jax.jit
  def oracle(params, x):
    """In float32: the model split at a module, the rest a function of its output."""
    apply = lambda method, *a: model.apply({"params": params}, *a, method=method)
    ct_d0 = jax.grad(lambda h: _sq_loss(apply(lambda m, h: m.d2(m.d1(nn.relu(m.ln(h)))), h)))(
        apply(lambda m, x: m.d0(x), x))
    ct_d1 = jax.grad(lambda h: _sq_loss(apply(lambda m, h: m.d2(h), h)))(
        apply(lambda m, x: m.d1(nn.relu(m.ln(m.d0(x)))), x))
    grads = jax.grad(lambda p: _sq_loss(model.apply({"params": p}, x)))(params)
    return ct_d0, ct_d1, 2 * apply(None, x), grads  # d sum(out ** 2) / d out

  ct_d0, ct_d1, ct_out, grads = oracle(params, x)
  small, big = (measured(params, jmp_lite.StaticLossScale(s))[3] for s in (1.0, 2.0 ** 10))
  for scale, stats in ((1.0, small), (2.0 ** 10, big)):
    # A parameter's cotangent is the weight gradient, in the compute dtype.
    for path, ct in (("d1", ct_d1), ("d2", ct_out), ("", ct_out), ("d2/kernel", grads["d2"][
        "kernel"]), ("d1/kernel", grads["d1"]["kernel"]), ("ln/scale", grads["ln"]["scale"])):
      np.testing.assert_allclose(stats.modules[path].backward_max,
                                 scale * np.max(np.abs(ct)), rtol=CT_RTOL, err_msg=path)
      assert int(stats.modules[path].backward_nonfinite) == 0
  # At 2**10, LayerNorm's backward through the tiny rows (1 / their standard
  # deviation, ~1e3) takes d0's cotangent past float16's 65504, and only d0's.
  assert float(np.max(np.abs(ct_d0))) * 2.0 ** 10 > 65504 > float(np.max(np.abs(ct_d0)))
  over = np.abs(ct_d0) * 2.0 ** 10 / 65520  # float16 rounds to inf from 65520
  near = np.sum(np.abs(over - 1) < CT_RTOL)  # within rounding of the threshold
  assert abs(int(big.modules["d0"].backward_nonfinite) - np.sum(over >= 1)) <= near
  assert big.first_nonfinite() == "d0 (backward)" and small.first_nonfinite() is None
  assert all(int(m.forward_nonfinite) == 0 for m in big.modules.values())  # backward only
  # Elsewhere scaling by a power of two is exact in float16.
  for path in ("ln", "d1", "d2", "", "d1/kernel", "d2/kernel"):
    assert float(big.modules[path].backward_max) == 2.0 ** 10 * float(
        small.modules[path].backward_max), path


@functools.cache
def _vg_with_and_without():
  """The MLP's (loss, grads, finite), measured and plain, at a loss scale of 2**10."""
  _, _, params, _, loss, measured = _mlp()
  scale = jmp_lite.StaticLossScale(2.0 ** 10)
  plain = jax.jit(lambda p: jmp_lite.value_and_grad(loss)(p, loss_scale=scale))(params)
  return measured(params, scale)[:3], plain


def test_telemetry_does_not_change_the_loss_or_a_tapped_functions_gradient():
  measured, plain = _vg_with_and_without()
  assert_trees_bitwise_equal(measured[0], plain[0])
  v = _crafted(jnp.float16, "f16")
  plain = jax.jit(jmp_lite.value_and_grad(_tapped_square_sum))(v)
  vg = jax.jit(jmp_lite.value_and_grad(_tapped_square_sum, telemetry=EVERY3))
  for step in (None, 1):  # measured; gated off
    assert_trees_bitwise_equal(vg(v, telemetry_step=step)[:3], plain)


def test_telemetry_does_not_change_value_and_grad():
  assert_trees_bitwise_equal(*_vg_with_and_without())


EVERY3 = jmp_lite.Telemetry(every=3, what_if=("e4m3",))


@functools.cache
def _train(telemetry):
  """Seven jitted TrainState steps of the MLP: (state, infos, compilations)."""
  _, wrapped, params, _, loss, _ = _mlp()
  state = jmp_lite.TrainState.create(apply_fn=wrapped.apply, params=params,
                                     tx=optax.sgd(1e-3), policy=F16,
                                     loss_scale=jmp_lite.DynamicLossScale(2.0 ** 10))
  step = jax.jit(lambda s: s.minimize(loss, telemetry=telemetry))
  infos = []
  with count_compilations() as compiled:
    for _ in range(7):
      state, info = step(state)
      infos.append(info)
  return state, infos, len(compiled)


def _primitive_counts(jaxpr, counts=None):
  counts = collections.Counter() if counts is None else counts
  for eqn in jaxpr.eqns:
    counts[eqn.primitive.name] += 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          _primitive_counts(sub, counts)
  return counts


@pytest.mark.slow  # about 10 s on 2 CPU cores: the heavy tier
def test_sampling_every_k_steps_in_one_compiled_step():
  state, infos, compilations = _train(EVERY3)
  assert compilations == 1
  assert [bool(i.precision.sampled) for i in infos] == [s % 3 == 0 for s in range(7)]
  for s, info in enumerate(infos):
    if s % 3:
      assert not any(np.any(a) for a in jax.tree.leaves(info.precision.modules)), s
      assert info.precision.table() == "(telemetry: this step was not sampled)"
    else:
      assert all(float(info.precision.modules[m].forward_max) > 0 for m in MODULES), s
      # A step is skipped (its gradients are not finite) iff telemetry saw a
      # non-finite value: here backward, at d0 (LayerNorm's 1/std, see above).
      where = info.precision.first_nonfinite()
      assert bool(info.skipped) == (where is not None), (s, where)
      assert where is None or (where.startswith("d0") and where.endswith(" (backward)"))
  assert bool(infos[0].skipped)  # at the initial 2**10
  # The jaxpr: no probe without telemetry (each probe computes one is_finite per
  # side), no `cond` of its own with every=1, some with every=3. (A probe's
  # custom_vjp_call is differentiated away: absent from every step's jaxpr.)
  loss = _mlp()[4]
  counts = {t: _primitive_counts(jax.make_jaxpr(lambda s: s.minimize(loss, telemetry=t))(
      state).jaxpr) for t in (None, jmp_lite.Telemetry(), EVERY3)}
  probes = 2 * len(infos[0].precision.modules)
  assert counts[jmp_lite.Telemetry()]["is_finite"] == counts[None]["is_finite"] + probes
  assert counts[EVERY3]["is_finite"] == counts[None]["is_finite"] + probes
  assert counts[jmp_lite.Telemetry()]["cond"] == counts[None]["cond"]
  assert counts[EVERY3]["cond"] > counts[None]["cond"]
  # value_and_grad counts with telemetry_step=.
  vg = jax.jit(jmp_lite.value_and_grad(_tapped_square_sum, telemetry=EVERY3))
  assert [bool(vg(jnp.ones(3), telemetry_step=s)[3].sampled) for s in (3, 4)] == [True, False]


def test_telemetry_does_not_change_training():
  # Seven steps, sampled (0, 3, 6) and not, the first three skipped for overflow
  # (the scale halving from 2**10 to 2**7): the same parameters, bit for bit.
  (with_t, infos, _), (without, plain_infos, _) = _train(EVERY3), _train(None)
  assert_trees_bitwise_equal(with_t.params, without.params)
  assert_trees_bitwise_equal([(i.loss, i.skipped) for i in infos],
                             [(i.loss, i.skipped) for i in plain_infos])
  assert 0 < sum(bool(i.skipped) for i in infos) < 7
  assert not np.array_equal(with_t.params["d0"]["kernel"], _mlp()[2]["d0"]["kernel"])


def test_overflow_is_localised_forward_and_backward():

  class Blow(nn.Module):  # Not x * 1e5 (a NumPy warning), nor x * 1e3 * 1e2 (XLA: x * inf)

    @nn.compact
    def __call__(self, x):
      return x * 100.0

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(4, name="d1")(Blow(name="blow")(nn.Dense(16, name="d0")(x)))

  x, params = _normal(10, 8, 8, scale=300.0), {"d0": _dense(11, 8, 16), "d1": _dense(13, 16, 4)}
  wrapped = jmp_lite.flax.wrap(Net(), F16)
  vg = jmp_lite.value_and_grad(lambda p: _sq_loss(wrapped.apply({"params": p}, x)),
                               telemetry=jmp_lite.Telemetry())
  stats = jax.jit(vg)(params)[3]
  assert stats.first_nonfinite() == "blow (forward)"
  assert int(stats.modules["d0"].forward_nonfinite) == 0
  # Oracle: d0's float16 output as Flax captures it, times 100 in NumPy.
  h = _capture(wrapped, params, x)["d0"]
  with np.errstate(over="ignore"):
    blown = h * np.float16(100)
  assert h.dtype == blown.dtype == np.float16 and np.isfinite(h).all()
  assert 0 < int(stats.modules["blow"].forward_nonfinite) == np.sum(~np.isfinite(blown)) < h.size
  assert float(stats.modules["blow"].forward_max) == np.max(np.abs(blown[np.isfinite(blown)]))
  # Backward only: at 2**30 the model's own output cotangent is past 65504.
  _, wrapped, params, x, _, measured = _mlp()
  stats = measured(params, jmp_lite.StaticLossScale(2.0 ** 30))[3]
  assert all(int(m.forward_nonfinite) == 0 for m in stats.modules.values())
  assert stats.first_nonfinite() == "(model) (backward)"
  with np.errstate(over="ignore"):  # 2 out 2**30, rounded to the model's float16
    ct = (2.0 ** 31 * _capture(wrapped, params, x)[""].astype(np.float32)).astype(np.float16)
  assert int(stats.modules[""].backward_nonfinite) == np.sum(np.isinf(ct)) > 0


class Block(nn.Module):

  @nn.compact
  def __call__(self, h, _):
    h = nn.Dense(16, name="a")(h)
    return nn.Dense(16, name="b")(jnp.tanh(h)), None


class Stack(nn.Module):
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    block = nn.remat(Block) if self.remat else Block
    stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                    length=3)
    h, _ = stack(name="blocks")(nn.Dense(16, name="inp")(x), None)
    return nn.Dense(4, name="out")(h)


STACK_PARAMS = {"inp": (20, 8, 16), "out": (22, 16, 4),
                "blocks": {"a": (24, 16, 16, 3), "b": (26, 16, 16, 3)}}


@functools.cache
def _stack_stats(remat):
  """Parameters in Stack's layout (a layer axis under blocks), and the stats."""
  params = jax.tree.map(lambda s: _dense(*s), STACK_PARAMS, is_leaf=lambda t: isinstance(t, tuple))
  x = _normal(28, 8, 8)
  loss = lambda p: _sq_loss(jmp_lite.flax.wrap(Stack(remat), F16).apply({"params": p}, x))
  vg = jax.jit(jmp_lite.value_and_grad(loss, telemetry=jmp_lite.Telemetry()))
  return x, params, vg(params, loss_scale=jmp_lite.StaticLossScale(2.0 ** 4))[3]


def test_a_scanned_stack_reports_each_layer_as_the_unrolled_model_does():
  x, params, stats = _stack_stats(False)
  layer = lambda i: jax.tree.map(lambda a: a[i], params["blocks"])
  # Forward oracle: each layer's slice of the parameters, its block wrapped
  # alone (float32 out of float16, exactly), its intermediates captured.
  h = _capture(jmp_lite.flax.wrap(nn.Dense(16), F16), params["inp"], x)[""]
  for i in range(3):
    captured = _capture(jmp_lite.flax.wrap(Block(), F16), layer(i), h, None)
    for name in ("a", "b"):
      assert captured[name].dtype == np.float16
      assert float(stats.modules["blocks/" + name].forward_max[i]) == np.max(
          np.abs(captured[name]))
    h = captured[""]
    assert float(stats.modules["blocks"].forward_max[i]) == np.max(np.abs(h))
  # Backward oracle: float32, unrolled, a zero added to each layer's outputs.
  dense = lambda p, h: nn.Dense(p["kernel"].shape[-1]).apply({"params": p}, h)

  def unrolled(eps_a, eps_b):
    h = dense(params["inp"], x)
    for i in range(3):
      a = dense(layer(i)["a"], h) + eps_a[i]
      h = dense(layer(i)["b"], jnp.tanh(a)) + eps_b[i]
    return _sq_loss(dense(params["out"], h))

  zeros = jnp.zeros((3, 8, 16))
  ct_a, ct_b = jax.jit(jax.grad(unrolled, argnums=(0, 1)))(zeros, zeros)
  for path, ct in (("blocks/a", ct_a), ("blocks/b", ct_b), ("blocks", ct_b)):
    assert stats.modules[path].backward_max.shape == (3,)
    np.testing.assert_allclose(stats.modules[path].backward_max,
                               2.0 ** 4 * np.max(np.abs(ct), axis=(1, 2)), rtol=CT_RTOL)
  # Each layer's slice of a parameter, as the layer computes with it.
  for i in range(3):
    assert float(stats.modules["blocks/a/kernel"].forward_max[i]) == np.max(
        np.abs(layer(i)["a"]["kernel"].astype(jnp.float16)))
  table = stats.table()
  for i in range(3):
    for name in ("blocks/a/kernel", "blocks/a", "blocks/b/bias", "blocks/b", "blocks"):
      assert f"\n{name} (layer {i}) " in table, table
  assert all(f"\n{name} " in table for name in ("inp", "out/kernel", "(model)")), table
  # One row per module or parameter, and per layer: 3 x (a, b, 2 each, blocks), 7 more.
  assert len(table.splitlines()) == 1 + 3 * 7 + 7


def test_remat_inside_scan_changes_no_statistic():
  # As GPT-style models write it: nn.scan over nn.remat(Block).
  remat, plain = _stack_stats(True)[2], _stack_stats(False)[2]
  assert remat.order == plain.order and plain.modules["blocks/a"].forward_max.shape == (3,)
  assert_trees_bitwise_equal(remat.modules, plain.modules)


def _crafted(dtype, what_if):
  """Values of ``dtype``: a third normal, a third around what_if's smallest normal."""
  tiny = float(ml_dtypes.finfo(jmp_lite.policy.parse_dtype(what_if)).smallest_normal)
  rng = np.random.default_rng(0)
  values = np.concatenate([rng.normal(size=64), tiny * 10.0 ** rng.uniform(-3, 1, 64),
                           np.zeros(8), [np.inf, -300.0]])
  rng.shuffle(values)
  return jnp.asarray(values, dtype)


def _tapped_square_sum(v):
  return jnp.sum(jnp.where(jnp.isfinite(v), tap(v, "v"), 0).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("dtype,what_if", [(jnp.float32, "f16"),
                                           (jnp.bfloat16, "float8_e4m3fn")])
def test_what_if_underflow_is_numpys_count(dtype, what_if):
  v = _crafted(dtype, what_if)
  vg = jmp_lite.value_and_grad(_tapped_square_sum,
                               telemetry=jmp_lite.Telemetry(what_if=(what_if,)))
  m = jax.jit(vg)(v)[3].modules["v"]
  target = jmp_lite.policy.parse_dtype(what_if).name
  held = np.asarray(v).astype(np.float64)  # the values as held in dtype
  assert m.dtype == jnp.dtype(dtype).name and set(m.forward_underflow) == {m.dtype, target}
  np.testing.assert_allclose(m.forward_underflow[target], _under(held, target), rtol=1e-6)
  np.testing.assert_allclose(m.forward_underflow[m.dtype], _under(held, dtype), rtol=1e-6)
  assert 0.25 < float(m.forward_underflow[target]) < 0.5
  assert float(m.forward_max) == 300.0 and int(m.forward_nonfinite) == 1
  # The cotangent: 2 v where v is finite, 0 at the inf.
  ct = np.where(np.isfinite(held), 2 * held, 0)
  assert float(m.backward_max) == 600.0 and int(m.backward_nonfinite) == 0
  np.testing.assert_allclose(m.backward_underflow[target], _under(ct, target), rtol=1e-6)


def test_under_jit_the_table_shows_the_what_if_dtype():
  v = jnp.asarray([1.0, 1e-6, 1e-6, 1e-6], jnp.float32)  # 3/4 below float16's normal
  vg = jmp_lite.value_and_grad(lambda v: jnp.sum(tap(v, "v") ** 2),
                               telemetry=jmp_lite.Telemetry(what_if=("f16",)))
  stats = jax.jit(vg)(v)[3]
  # Through jit the dicts come back sorted by key: the held dtype is named.
  assert set(stats.modules["v"].forward_underflow) == {"float32", "float16"}
  header, row = stats.table().splitlines()  # module dtype fwd max nonfin subnormal <f16
  assert header.split()[6] == "<f16" and row.split()[5] == "75%", stats.table()


def test_ops_mode_groups_every_intermediate_by_name_scope():
  w, x = _normal(30, 4, 3), _normal(31, 5, 4)

  def fun(w, x):
    with jax.named_scope("a"):
      h = jnp.tanh(x @ w)
    with jax.named_scope("b"):
      y = h * 3.0
    return jnp.sum(y ** 2)

  vg = jmp_lite.value_and_grad(fun, telemetry=jmp_lite.Telemetry(mode="ops"))
  stats = jax.jit(vg)(w, x)[3]
  assert {"a", "b"} <= set(stats.modules) and stats.order.index("a") < stats.order.index("b")
  z = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  # a: x @ w and tanh of it; b: 3 tanh; cotangents 6 y and 2 y, y = 3 tanh(z).
  np.testing.assert_allclose(stats.modules["a"].forward_max, np.max(np.abs(z)), rtol=1e-6)
  np.testing.assert_allclose(stats.modules["b"].forward_max, 3 * np.max(np.abs(np.tanh(z))),
                             rtol=1e-6)
  np.testing.assert_allclose(stats.modules["a"].backward_max, 18 * np.max(np.abs(np.tanh(z))),
                             rtol=1e-6)


def test_nnx_models_are_reported_by_attribute_path():

  class Net(nnx.Module):

    def __init__(self, rngs):
      self.l1 = nnx.Linear(8, 16, rngs=rngs)
      self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
      return self.l2(nnx.relu(self.l1(x)))

  graphdef, state = nnx.split(nnx.eval_shape(lambda: Net(nnx.Rngs(0))))
  leaves, tree = jax.tree.flatten(state)
  model = nnx.merge(graphdef, jax.tree.unflatten(tree, [
      _normal(40 + i, *a.shape, scale=0.5) for i, a in enumerate(leaves)]))
  x = _normal(32, 8, 8)
  wrapped = jmp_lite.flax.wrap(model, F16)
  graphdef, params, rest = nnx.split(wrapped, nnx.Param, ...)
  loss = lambda p: _sq_loss(nnx.merge(graphdef, p, rest)(x))
  stats = jax.jit(jmp_lite.value_and_grad(loss, telemetry=jmp_lite.Telemetry()))(params)[3]
  assert [p for p in stats.order if p in ("l1", "l2", "")] == ["l1", "l2", ""]
  assert set(stats.order) - {"l1", "l2", ""} == {"l1/kernel", "l1/bias", "l2/kernel", "l2/bias"}
  for layer in ("l1", "l2"):  # the parameter cast to float16, as the layer computes with it
    kernel = getattr(model, layer).kernel.get_value()
    assert float(stats.modules[f"{layer}/kernel"].forward_max) == np.max(
        np.abs(kernel.astype(jnp.float16)))
  # Oracle: each layer wrapped alone, its float32 output its float16 one cast.
  @jax.jit
  def alone(x):
    h = jmp_lite.flax.wrap(model.l1, F16)(x)
    return h, jmp_lite.flax.wrap(model.l2, F16)(nnx.relu(h)), wrapped(x)

  h, out, whole = alone(x)
  np.testing.assert_array_equal(out, whole)
  for path, value in (("l1", h), ("l2", out), ("", out)):
    assert stats.modules[path].dtype == "float16"
    assert float(stats.modules[path].forward_max) == np.max(np.abs(np.asarray(value)))


def test_bad_input_is_named():
  with pytest.raises(ValueError, match=r"every must be an int >= 1, got 0"):
    jmp_lite.Telemetry(every=0)
  with pytest.raises(ValueError, match=r"mode must be one of .*got 'x'"):
    jmp_lite.Telemetry(mode="x")
  with pytest.raises(ValueError, match=r"Telemetry: what_if entry 'int8' is not a floating"):
    jmp_lite.Telemetry(what_if=("int8",))
  with pytest.raises(TypeError, match=r"Telemetry: what_if entry 'bogus' is not a dtype"):
    jmp_lite.Telemetry(what_if=("bogus",))
  # The policy grammar's names: NumPy alone reads "f16" as float128.
  assert jmp_lite.Telemetry(what_if=("f16", "e4m3")).what_if == (
      np.dtype(jnp.float16), np.dtype(jnp.float8_e4m3fn))
  vg = jmp_lite.value_and_grad(_tapped_square_sum, telemetry=EVERY3)
  for step in (1.5, True, jnp.float32(3)):  # 1.5 was taken as an unsampled step
    with pytest.raises(TypeError, match="the step must be an integer"):
      vg(jnp.ones(3), telemetry_step=step)
  with pytest.raises(ValueError, match=r"what_if entry .*int8.* is not a floating dtype"):
    jmp_lite.Telemetry(what_if=(np.int8,))
  with pytest.raises(TypeError, match=r"telemetry must be a jmp_lite.Telemetry.*got 'yes'"):
    jmp_lite.value_and_grad(jnp.sum, telemetry="yes")
  with pytest.raises(TypeError, match=r"name must be a string, got 3"):
    tap(jnp.ones(2), 3)


@pytest.mark.slow  # about 15 s on 2 CPU cores: the heavy tier
@pytest.mark.usefixtures("standard_promotion")  # the corpus model adds f32 to f16
def test_nnx_scan_over_stacked_layers_reports_each_layer():
  # The corpus' NNX model (nnx.scan over nnx.vmap-stacked Linear, BatchNorm,
  # Dropout), in eval mode. Oracle for layer 0's Linear: its float16 output
  # computed by hand from the wrapped model's input layer and layer 0's slice
  # of the stacked parameters.
  import pathlib  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, str(pathlib.Path(__file__).parent))
  from test_wrap_corpus import Config, NnxScanNet  # pylint: disable=g-import-not-at-top
  model = NnxScanNet(Config(), nnx.Rngs(0))
  wrapped = jmp_lite.flax.wrap(model, F16)
  wrapped.eval()
  x = _normal(40, 16, 16)
  graphdef, params, rest = nnx.split(wrapped, nnx.Param, ...)

  def loss(p):
    return _sq_loss(nnx.merge(graphdef, p, rest)(x))

  stats = jax.jit(jmp_lite.value_and_grad(loss, telemetry=jmp_lite.Telemetry()))(params)[3]
  layers = Config().layers
  for path in ("layers", "layers/dense", "layers/bn", "layers/drop"):
    assert np.shape(stats.modules[path].forward_max) == (layers,), path
  assert stats.modules["layers/dense"].dtype == "float16"
  assert stats.modules["layers/bn"].dtype == "float32"  # normalisation kept in f32
  h = nnx.merge(graphdef, params, rest).module.inp
  h16 = (x.astype(jnp.float16) @ h.kernel.get_value().astype(jnp.float16)
         + h.bias.get_value().astype(jnp.float16))
  dense = model.layers.dense
  d0 = (h16 @ dense.kernel.get_value()[0].astype(jnp.float16)
        + dense.bias.get_value()[0].astype(jnp.float16))
  np.testing.assert_allclose(float(stats.modules["inp"].forward_max),
                             float(jnp.max(jnp.abs(h16))), rtol=2e-3)
  np.testing.assert_allclose(float(stats.modules["layers/dense"].forward_max[0]),
                             float(jnp.max(jnp.abs(d0))), rtol=2e-3)
  assert "layers/dense (layer 1)" in stats.table()


def test_op_level_autocast_policy_is_measured_and_unchanged():
  # O1 autocasts the measured function as a whole: the marked value is the
  # tanh autocast keeps in float32, and the step is the plain O1 step.
  def loss(w, x):
    return jnp.sum(tap(jnp.tanh(x @ w), "h") ** 2)

  w, x = _normal(50, 4, 3), _normal(51, 2, 4)
  plain = jax.jit(jmp_lite.value_and_grad(loss, policy="O1"))(w, x)
  value, grads, finite, stats = jax.jit(jmp_lite.value_and_grad(
      loss, policy="O1", telemetry=jmp_lite.Telemetry()))(w, x)
  assert_trees_bitwise_equal((value, grads, finite), plain)
  assert list(stats.modules) == ["h"] and stats.modules["h"].dtype == "float32"
  h = jnp.tanh((x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32))
  np.testing.assert_allclose(float(stats.modules["h"].forward_max),
                             float(jnp.max(jnp.abs(h))), rtol=1e-2)


_NEUTRALITY = r"""
import sys
import flax.linen as nn, jax, jax.numpy as jnp, numpy as np, optax
import jmp_lite, jmp_lite.flax

class M(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    h = h + nn.Dense(16)(h)
    return nn.Dense(4)(h)

m = jmp_lite.flax.wrap(M(), "p=f32,c=bf16,o=f32")
x = jax.random.normal(jax.random.key(0), (8, 16)); y = jnp.arange(8) % 4
params = m.init(jax.random.key(1), x)["params"]
loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(m.apply({"params": p}, x), y).mean()
grads = [jax.jit(lambda p: jmp_lite.value_and_grad(loss, telemetry=t)(
    p, loss_scale=jmp_lite.StaticLossScale(8.0))[1])(params)
         for t in (None, jmp_lite.Telemetry())]
same = all(np.array_equal(a, b) for a, b in zip(*map(jax.tree.leaves, grads)))
print("SAME" if same else "DIFFERENT")
"""


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the measurement is XLA:CPU's")
def test_telemetry_is_bitwise_neutral_without_excess_precision():
  """What the README says: under bf16, a probe's extra reads can change how
  XLA:CPU fuses (and, under its default excess precision, rounds) a sum (the
  same script with the default flags printed DIFFERENT); without excess
  precision the steps are bitwise equal."""
  import os, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  env = dict(os.environ, XLA_FLAGS="--xla_allow_excess_precision=false",
             JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", _NEUTRALITY], env=env, capture_output=True,
                        text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split()[-1] == "SAME"


def test_a_model_without_parameters_on_concrete_inputs_is_measured():
  """The engine caches its trace of a call on concrete arrays; inside a
  telemetry step that trace would hold the marks of an earlier trace (an
  IndexError before). Such a call is traced again there."""

  class Double(nn.Module):
    def __call__(self, x):
      return x * 2.0

  model = jmp_lite.flax.wrap(Double(), "p=f32,c=f16,o=f32")
  x = jnp.ones((2, 3))
  model.init(jax.random.key(0), x)  # a cached trace for these arguments
  model.apply({}, x)
  loss = lambda w: jnp.sum(model.apply({}, x) * w)
  _, _, _, stats = jmp_lite.value_and_grad(loss, telemetry=jmp_lite.Telemetry())(
      jnp.ones(3), loss_scale=jmp_lite.StaticLossScale(1.0))
  assert float(stats.modules[""].forward_max) == 2.0


def test_a_jitted_model_served_from_jaxs_cache_is_measured_again():
  """``jax.jit(model.apply)`` inside the loss: the second telemetry step gets
  JAX's cached trace, with the marks the first one made; they say what they
  mark, so the same rows come back (an IndexError before)."""

  class Gain(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x * self.param("g", nn.initializers.ones, (x.shape[-1],))

  model = jmp_lite.flax.wrap(Gain(), "p=f32,c=f16,o=f32")
  x = jnp.ones((4, 8))
  params = model.init(jax.random.key(0), x)
  forward = jax.jit(model.apply)
  vg = jmp_lite.value_and_grad(lambda p: jnp.sum(forward(p, x)),
                               telemetry=jmp_lite.Telemetry())
  rows = []
  for _ in range(2):
    _, _, _, stats = vg(params, loss_scale=jmp_lite.StaticLossScale(1.0))
    rows.append({k: float(m.forward_max) for k, m in stats.modules.items()})
  assert rows[0] == rows[1] == {"": 1.0, "g": 1.0}


def _elements_written(jaxpr) -> int:
  """What a traced step writes: the elements of every equation's outputs."""
  return sum(int(np.prod(v.aval.shape)) for e in equations(jaxpr) for v in e.outvars
             if hasattr(v.aval, "shape"))


@pytest.mark.parametrize("every", [1, 2])
def test_a_steps_size_grows_linearly_with_its_probes(every):
  """Each probe's share of the carrier was a slice of it, whose transpose pads
  the share's cotangent to the whole carrier: the backward pass added one
  carrier-sized vector per probe, quadratic in the probes (a Hugging Face
  BERT's telemetry step, 2 layers: 127k lines of HLO and 130 s to compile,
  against 2 s without telemetry)."""

  def written(n):
    def loss(x):
      for i in range(n):
        x = tap(jnp.sin(x), f"t{i}")
      return jnp.sum(x)
    vg = jmp_lite.value_and_grad(loss, telemetry=jmp_lite.Telemetry(every=every))
    return _elements_written(jax.make_jaxpr(vg)(jnp.ones(4), telemetry_step=0).jaxpr)

  small, large = written(16), written(64)
  assert large < 4.5 * small, (small, large)  # linear: 4x; it was 11x


def test_a_probe_reads_its_value_in_one_reduction():
  """XLA:CPU compiles a kernel per reduction: the statistics of a value are
  one variadic reduce over it, not one per count (and the value is read
  once)."""
  th = _probes.thresholds(jnp.float16, (jnp.float8_e4m3fn,))
  jaxpr = jax.make_jaxpr(lambda x: _probes.statistics(x, th, view=jnp.float16))(
      jnp.ones((8, 8), jnp.float32)).jaxpr
  reductions = [e.primitive.name for e in equations(jaxpr)
                if e.primitive.name.startswith(("reduce", "argm"))
                and e.primitive.name != "reduce_precision"]
  assert reductions == ["reduce"]


def test_a_steps_statistics_come_back_as_one_array():
  """Each module's statistics were leaves of their own (a slice, a convert
  and a division per module and statistic, each a kernel XLA:CPU compiles:
  870 of a Hugging Face BERT step's 1,560). They are one array of rows;
  ``modules`` reads it, the same under ``jit`` and outside."""

  def loss(x, n):
    for i in range(n):
      x = tap(jnp.sin(x), f"t{i}")
    return jnp.sum(x)

  for n in (3, 12):
    vg = jax.jit(jmp_lite.value_and_grad(functools.partial(loss, n=n),
                                         telemetry=jmp_lite.Telemetry(what_if=("e4m3",))))
    stats = vg(jnp.full(4, 0.5))[3]
    assert len(jax.tree.leaves(stats)) == 5
    assert stats.rows.shape == (n, 2, 4) and stats.order == tuple(f"t{i}" for i in range(n))
    inside = jax.jit(lambda x: {k: m.forward_max for k, m in vg(x)[3].modules.items()})(
        jnp.full(4, 0.5))
    assert {k: float(v) for k, v in inside.items()} == {
        k: float(m.forward_max) for k, m in stats.modules.items()}
    assert set(stats.modules["t0"].forward_underflow) == {"float32", "float8_e4m3fn"}


def test_a_module_applied_on_its_own_inside_the_model_is_named_as_its_callers_child():
  """GPT-2's tied head (transformers 4.49: ``self.lm_head.apply({"params":
  {"kernel": wte.T}}, h)``) has a root scope of its own and the path ():
  its row was merged into the model's own (maxima by max), its kernel's row
  was plain ``kernel``, and a rule for ``lm_head`` did not reach it. Oracle:
  NumPy on the two outputs, computed by hand."""

  class TiedLM(nn.Module):
    def setup(self):
      self.wte = nn.Embed(10, 4)
      self.lm_head = nn.Dense(10, use_bias=False)

    def __call__(self, ids):
      logits = self.lm_head.apply({"params": {"kernel": self.wte.embedding.T}}, self.wte(ids))
      return 0.5 * logits

  ids = jnp.arange(6).reshape(2, 3)
  model = jmp_lite.flax.wrap(TiedLM(), "p=f32,c=f32,o=f32", rules={"lm_head": "p=f32,c=bf16,o=f32"})
  params = model.init(jax.random.key(0), ids)["params"]
  vg = jmp_lite.value_and_grad(lambda p: jnp.sum(model.apply({"params": p}, ids)),
                               telemetry=jmp_lite.Telemetry())
  stats = vg(params)[3]
  assert stats.order == ("wte/embedding", "wte", "lm_head/kernel", "lm_head", "")
  head = np.asarray(TiedLM().apply({"params": params}, ids)) * 2
  head_bf16 = float(np.max(np.abs(np.asarray(jnp.asarray(head, jnp.bfloat16), np.float32))))
  assert stats.modules["lm_head"].dtype == "bfloat16"  # the rule reached it
  np.testing.assert_allclose(float(stats.modules["lm_head"].forward_max), head_bf16, rtol=1e-2)
  np.testing.assert_allclose(float(stats.modules[""].forward_max), head_bf16 / 2, rtol=1e-2)
  assert list(jmp_lite.flax.policy_map(model, ids)) == ["", "wte", "lm_head"]


def test_modules_mode_on_a_function_without_modules_says_so():
  """An Equinox or plain JAX loss has no wrapped module: the table came back
  empty, with nothing to tell it from a model with nothing to report. The
  ``ops`` mode measures it (oracle: the values the function computes)."""
  w, x = jnp.full((4, 3), 2.0), jnp.ones((2, 4))

  def loss(w):
    with jax.named_scope("layer"):
      return jnp.sum(x @ w)

  with pytest.warns(UserWarning, match="mode='ops'"):
    stats = jmp_lite.value_and_grad(loss, telemetry=jmp_lite.Telemetry())(w)[3]
  assert stats.modules == {}
  stats = jmp_lite.value_and_grad(loss, telemetry=jmp_lite.Telemetry(mode="ops"))(w)[3]
  rows = {k: float(m.forward_max) for k, m in stats.modules.items() if "layer" in k}
  assert list(rows.values()) == [48.0]  # x @ w (8 each) and its sum, in one scope


def test_table_percentages_read_as_percentages():
  """Found by a user: a column where every value underflows printed
  ``1e+02%``. A share short of all must not read as all."""
  from jmp_lite.telemetry import _pct
  cases = {None: "-", 0.0: "0%", 1.0: "100%", 0.999: ">99%", 0.994: "99%",
           0.5: "50%", 0.123: "12%", 0.0123: "1.2%", 1e-5: "0.001%"}
  assert {x: _pct(x) for x in cases} == cases
  assert _pct(-0.0) == "0%"
