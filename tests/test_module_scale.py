"""`jmp_lite.ModuleLossScale`: each module's backward pass at its own scale.

Oracles: the float32 gradients of the unwrapped Flax model (bitwise, where
the compute dtype is float32 and every scale a power of two), and, in
float16, the same float32 gradients against those of every single global
scale a `jmp_lite.DynamicLossScale` could hold.
"""

import dataclasses

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
import jmp_lite.flax
from jmp_lite._jaxpr import module_scales as ms
from jmp_lite import _scaled_grad
from jmp_lite.testing import count_compilations

F16 = "p=f32,c=f16,o=f32"


class SigmoidBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.sigmoid(nn.Dense(16)(x))


class DeepSigmoid(nn.Module):
  """Vanishing gradients: each block's about 2**-2 of the next one's."""
  depth: int = 10

  @nn.compact
  def __call__(self, x):
    x = nn.sigmoid(nn.Dense(16)(x))
    for _ in range(self.depth):
      x = SigmoidBlock()(x)
    return nn.Dense(4)(x)


class ChainAndResidual(nn.Module):
  """A block's output read directly by the next block (a chain), and values
  read both by a module and by the code around it (a residual sum)."""

  @nn.compact
  def __call__(self, x):
    h = nn.tanh(nn.Dense(16)(x))
    a = SigmoidBlock()(h)
    b = SigmoidBlock()(a)
    shared = nn.Dense(16, name="shared")
    return nn.Dense(4)(shared(b + h) + shared(a))


class _ScanBody(nn.Module):
  @nn.compact
  def __call__(self, c, _):
    return nn.sigmoid(nn.Dense(8)(c)), None


class ScanAndRemat(nn.Module):
  """Modules inside Flax's lifted transforms: a scan over three layers, then
  a rematerialised block."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8)(x)
    h, _ = nn.scan(_ScanBody, variable_axes={"params": 0},
                   split_rngs={"params": True}, length=3)()(h, None)
    return nn.Dense(4)(nn.remat(SigmoidBlock)()(h))


def _data(n=64, d=8, seed=0):
  x = jax.random.normal(jax.random.PRNGKey(seed), (n, d))
  y = jax.random.randint(jax.random.PRNGKey(seed + 1), (n,), 0, 4)
  return x, y


def _loss(apply, x, y):
  def loss(params):
    logits = apply(params, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return loss


def _module_grads(wrapped, x, y):
  """``f(ls, params)``: unscaled gradients and the measurements of one step
  at ``ls`` (compiled once)."""
  run = _scaled_grad.module_scaled_value_and_grad(_loss(wrapped.apply, x, y), 0,
                                                  False, None)

  @jax.jit
  def f(ls, params):
    _, grads, measured = run(ls, params)
    return ls.unscale(grads), measured
  return f


@pytest.mark.parametrize("model", [
    DeepSigmoid(depth=2), ChainAndResidual(),
    pytest.param(ScanAndRemat(), marks=pytest.mark.slow)],
    ids=["chain", "chain_and_residual", "scan_and_remat"])
def test_conversions_are_exact_where_nothing_leaves_the_range(model):
  """Float32 compute, scales from 2**-20 to 2**20: the float32 gradients of
  the unwrapped model, through nesting, a chain, a module called twice and
  a residual sum. Bitwise along a chain on a CPU; where cotangents from
  several consumers add up, or on a GPU, whose XLA orders a bias gradient's
  sum over the batch per program (an H200: 4e-8 apart), a sum may associate
  differently (an ulp)."""
  x, y = _data()
  params = model.init(jax.random.PRNGKey(2), x)
  wrapped = jmp_lite.flax.wrap(model, "p=f32,c=f32,o=f32")
  paths = tuple(p for p in jmp_lite.flax.policy_map(wrapped, x) if p)
  assert len(paths) >= 5 and any(p.endswith("/Dense_0") for p in paths)
  scales = 2.0 ** np.random.RandomState(0).randint(-20, 21, len(paths))
  ls = jmp_lite.ModuleLossScale(2.0 ** 10, paths=paths,
                                compute_dtypes=("float16",) * len(paths),
                                module_scales=scales)
  got, _ = _module_grads(wrapped, x, y)(ls, params)
  want = jax.grad(_loss(model.apply, x, y))(params)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree.leaves(want)):
    assert a.dtype == b.dtype == jnp.float32, path
    a, b = np.asarray(a), np.asarray(b)
    if not isinstance(model, ChainAndResidual) and jax.default_backend() == "cpu":
      np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    else:
      np.testing.assert_allclose(a, b, rtol=0, atol=2.0 ** -21 * np.abs(b).max(),
                                 err_msg=jax.tree_util.keystr(path))


def _lost(got, want) -> int:
  """Elements more than 2**-4 away from the float32 gradient, relatively:
  what float16 holds as a subnormal (few significant bits) or flushes."""
  return sum(int(np.sum(np.abs(np.asarray(a) - np.asarray(b))
                        > 2.0 ** -4 * np.abs(np.asarray(b))))
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


@pytest.mark.slow  # a 16-block model through the engine: ~35 s on 2 cores
def test_a_wide_spread_is_served_better_than_by_any_global_scale():
  """Sixteen sigmoid blocks spread the weight gradients over 2**30: more
  than float16's normal range. Per-module scales lose fewer values than
  the best single scale, and agree with float32 to float16 precision
  elsewhere."""
  x, y = _data()
  model = DeepSigmoid(depth=16)
  params = model.init(jax.random.PRNGKey(2), x)
  want = jax.grad(_loss(model.apply, x, y))(params)
  maxima = [float(np.max(np.abs(g))) for g in jax.tree.leaves(want)]
  assert max(maxima) / min(maxima) > 2.0 ** 30
  wrapped = jmp_lite.flax.wrap(model, F16)

  # Every global scale that keeps the gradients finite.
  loss = _loss(wrapped.apply, x, y)
  global_grad = jax.jit(lambda p, s: jax.tree.map(
      lambda g: g / s, jax.grad(lambda q: loss(q) * s)(p)))
  best = None
  for k in range(-10, 40):
    grads = global_grad(params, jnp.float32(2.0 ** k))
    if all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads)):
      lost = _lost(grads, want)
      best = lost if best is None else min(best, lost)
  assert best is not None

  ls = jmp_lite.ModuleLossScale.create(wrapped, x, min_loss_scale=2.0 ** -24)
  module_grads = _module_grads(wrapped, x, y)
  for _ in range(40):  # the module scales settle on these parameters
    grads, measured = module_grads(ls, params)
    ls = ls.adjust(jmp_lite.all_finite(grads), measured)
  grads, _ = module_grads(ls, params)
  assert bool(jmp_lite.all_finite(grads))
  assert 2 * _lost(grads, want) < best
  scales = np.log2(np.asarray(ls.module_scales))
  assert scales.max() - scales.min() >= 20  # the scales spread out too
  # The blocks' weight gradients (the first layer's cotangent crosses the
  # model's own code at the global scale: see the class docstring).
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads["params"]),
                          jax.tree.leaves(want["params"])):
    if "SigmoidBlock" in jax.tree_util.keystr(path):
      a, b = np.asarray(a), np.asarray(b)
      np.testing.assert_allclose(a, b, rtol=0, atol=2.0 ** -6 * np.abs(b).max(),
                                 err_msg=jax.tree_util.keystr(path))


class TwoBranches(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="small")(x) + nn.Dense(4, name="big")(x) * 1000.0


def test_an_overflow_inside_a_module_backs_off_that_module_alone(standard_promotion):
  x, y = _data()
  model = TwoBranches()
  wrapped = jmp_lite.flax.wrap(model, F16)
  params = model.init(jax.random.PRNGKey(2), x)
  ls = jmp_lite.ModuleLossScale.create(wrapped, x, loss_scale=2.0 ** 4)
  assert ls.paths == ("small", "big")
  # `big`'s weight gradient is ~1000x the other's: at 2**20 it overflows.
  ls = jmp_lite.ModuleLossScale(2.0 ** 4, paths=ls.paths,
                                compute_dtypes=ls.compute_dtypes,
                                module_scales=jnp.array([2.0 ** 10, 2.0 ** 20]))
  state = jmp_lite.TrainState.create(apply_fn=wrapped.apply, params=params,
                                     tx=optax.adam(1e-3), loss_scale=ls)
  new, info = jax.jit(lambda s: s.minimize(_loss(wrapped.apply, x, y)))(state)
  assert bool(info.skipped) and bool(info.nonfinite.grads)
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  after = new.loss_scale
  assert float(after.loss_scale) == 2.0 ** 4  # the global scale is kept
  assert float(after.module_scales[0]) == 2.0 ** 10  # so is the other module's
  assert float(after.module_scales[1]) < 2.0 ** 20
  # ... until a step goes through, the global scale and the other module's
  # kept.
  step = jax.jit(lambda s: s.minimize(_loss(wrapped.apply, x, y)))
  for _ in range(12):
    new, info = step(new)
    if not bool(info.skipped):
      break
    assert float(new.loss_scale.loss_scale) == 2.0 ** 4
    assert float(new.loss_scale.module_scales[0]) == 2.0 ** 10
  assert not bool(info.skipped)


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(32)(nn.gelu(nn.Dense(32)(x)))


class _Nested(nn.Module):
  """A scaled module (the block) whose own code (the gelu) lies between
  scaled submodules, as a Hugging Face GPT-2 MLP's does."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(x + _Block()(x))


def test_an_overflow_in_a_module_s_code_between_its_submodules_is_its_own(
    standard_promotion):
  """The overflow happens in the block's gelu, between its two Dense
  submodules: the inner Dense received it from the block (entering, not
  its own) and sent it back, which counted as entering the block too, so
  no module took it; the global scale halved every step and the block's
  2**24 never moved: every step was skipped. The README's rule says an
  overflow a module makes is that module's: its scale backs off, the
  global scale is kept, and training goes on."""
  x = jax.random.normal(jax.random.PRNGKey(0), (32, 32))
  y = jnp.zeros((32,), jnp.int32)
  model = _Nested()
  wrapped = jmp_lite.flax.wrap(model, F16)
  params = model.init(jax.random.PRNGKey(1), x)
  ls = jmp_lite.ModuleLossScale.create(wrapped, x, loss_scale=2.0 ** 15)
  block = ls.paths.index("_Block_0")
  assert {"_Block_0/Dense_0", "_Block_0/Dense_1"} <= set(ls.paths)
  ls = dataclasses.replace(ls, module_scales=ls.module_scales.at[block].set(2.0 ** 24))
  state = jmp_lite.TrainState.create(apply_fn=wrapped.apply, params=params,
                                     tx=optax.adam(1e-3), loss_scale=ls)
  step = jax.jit(lambda s: s.minimize(_loss(wrapped.apply, x, y)))
  new, info = step(state)
  assert bool(info.skipped)
  assert float(new.loss_scale.loss_scale) == 2.0 ** 15  # the global scale is kept
  assert float(new.loss_scale.module_scales[block]) < 2.0 ** 24
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for _ in range(8):
    new, info = step(new)
    if not bool(info.skipped):
      break
  assert not bool(info.skipped)
  assert float(new.loss_scale.loss_scale) == 2.0 ** 15


@pytest.mark.slow  # the default tier's time: see README, Results
def test_what_a_module_measures_adds_up_over_its_calls():
  x, y = _data(n=8)
  model = ChainAndResidual()
  wrapped = jmp_lite.flax.wrap(model, F16)
  params = model.init(jax.random.PRNGKey(2), x)
  ls = jmp_lite.ModuleLossScale.create(wrapped, x)
  _, measured = _module_grads(wrapped, x, y)(ls, params)
  measured = np.asarray(measured)
  entered = dict(zip(ls.paths, measured[:, ms.ENTER, ms.ELEMENTS]))
  # Outputs are [8, 16]: `shared` is called twice, the blocks once. The
  # first block's output goes only to scaled modules, straight back into
  # its own scale: nothing enters it from the code around it.
  assert entered["shared"] == 2 * 8 * 16
  assert entered["SigmoidBlock_1"] == 8 * 16
  assert entered["SigmoidBlock_0"] == 0
  # The top binade of the summed one-hot maxima is that of the largest.
  tops = np.asarray(ms.top_binade(jnp.asarray(measured[:, ms.INSIDE])))
  assert np.all(np.isfinite(tops))
  assert np.all(measured[:, :, ms.NONFINITE] == 0)


def test_statistics_against_numpy():
  x = np.array([0.0, 3.0, -2.0 ** -20, 2.0 ** -14, np.inf, 6e4], np.float32)
  row = np.asarray(ms.statistics(jnp.asarray(x), np.dtype(np.float16)))
  finite = np.isfinite(x)
  a = np.abs(x[finite])
  assert row[ms.NONFINITE] == np.sum(~finite)
  assert row[ms.NONZERO] == np.sum(a > 0)
  assert row[ms.SUBNORMAL] == np.sum((a > 0) & (a < np.finfo(np.float16).tiny))
  assert row[ms.ELEMENTS] == x.size
  assert float(ms.top_binade(jnp.asarray(row))) == np.floor(np.log2(a.max()))


@pytest.mark.slow  # the default tier's time: see README, Results
def test_a_training_step_compiles_once_and_accumulates(standard_promotion):
  x, y = _data()
  model = DeepSigmoid(depth=1)
  wrapped = jmp_lite.flax.wrap(model, F16)
  params = model.init(jax.random.PRNGKey(2), x)
  ls = jmp_lite.ModuleLossScale.create(wrapped, x)
  state = jmp_lite.TrainState.create(apply_fn=wrapped.apply, params=params,
                                     tx=optax.adam(1e-3), loss_scale=ls,
                                     accumulate_steps=2)
  step = jax.jit(lambda s: s.minimize(_loss(wrapped.apply, x, y)))
  state, _ = step(state)
  assert np.array_equal(np.asarray(state.loss_scale.module_scales),
                        np.asarray(ls.module_scales))  # mid-accumulation
  with count_compilations() as compiled:
    for _ in range(3):
      state, info = step(state)
  assert len(compiled) == 0
  assert not bool(info.skipped)
  assert not np.array_equal(np.asarray(state.loss_scale.module_scales),
                            np.asarray(ls.module_scales))


def test_bad_input_is_refused_clearly(standard_promotion):
  x, y = _data()
  wrapped = jmp_lite.flax.wrap(DeepSigmoid(depth=1), F16)
  with pytest.raises(TypeError, match="Linen model returned by jmp_lite.flax.wrap"):
    jmp_lite.ModuleLossScale.create(DeepSigmoid(), x)
  with pytest.raises(TypeError, match="NNX"):
    jmp_lite.ModuleLossScale.create(
        jmp_lite.flax.wrap(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), F16), x)
  with pytest.raises(ValueError, match="no module of this model computes in float16"):
    jmp_lite.ModuleLossScale.create(
        jmp_lite.flax.wrap(DeepSigmoid(depth=1), "p=f32,c=bf16,o=f32"), x)
  with pytest.raises(ValueError, match=r"\['nope'\] are not modules"):
    jmp_lite.ModuleLossScale.create(wrapped, x, paths=["nope"])
  ls = jmp_lite.ModuleLossScale.create(wrapped, x)
  with pytest.raises(ValueError, match="modules must have shape"):
    ls.adjust(jnp.bool_(True), jnp.zeros((1, 2, ms.WIDTH)))
  with pytest.raises(ValueError, match="margin must be finite and >= 1"):
    jmp_lite.ModuleLossScale(1.0, margin=0.5)
  for field, value in (("factor", 3.0), ("loss_scale", 1000.0)):
    with pytest.raises(ValueError, match=f"{field} must hold powers of two"):
      jmp_lite.ModuleLossScale.create(wrapped, x, **{field: value})
  with pytest.raises(ValueError, match="module_scales must hold powers of two"):
    jmp_lite.ModuleLossScale(1.0, paths=("a",), compute_dtypes=("float16",),
                             module_scales=jnp.array([3.0]))
  with pytest.raises(ValueError, match="module_scales must have shape"):
    jmp_lite.ModuleLossScale(1.0, paths=("a",), compute_dtypes=("float16",),
                             module_scales=jnp.ones(2))
  params = DeepSigmoid(depth=1).init(jax.random.PRNGKey(0), x)
  state = jmp_lite.TrainState.create(apply_fn=wrapped.apply, params=params,
                                     tx=optax.sgd(0.1), loss_scale=ls)
  with pytest.raises(ValueError, match="cannot be combined with telemetry"):
    state.minimize(_loss(wrapped.apply, x, y), telemetry=jmp_lite.Telemetry())


class _Sine(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.sin(x) * 2


class _Features(nn.Module):
  @nn.compact
  def __call__(self, x):
    return _Sine()(x)


def test_a_model_called_on_concrete_inputs_inside_the_step(standard_promotion):
  """A parameter-free wrapped model on concrete inputs is compiled once and
  cached when called eagerly; inside a per-module step it is traced again,
  so that its conversions read this step's scales (no leaked tracer)."""
  features = jmp_lite.flax.wrap(_Features(), F16)
  x = np.ones((4, 3), np.float32)
  ls = jmp_lite.ModuleLossScale.create(features, x)
  assert ls.paths == ("_Sine_0",)
  state = jmp_lite.TrainState.create(apply_fn=features.apply,
                                     params={"w": jnp.ones((3,))},
                                     tx=optax.sgd(0.1), loss_scale=ls)
  loss = lambda p: jnp.sum(p["w"] * features.apply({}, x))
  # Two traces of the step: the second must not reuse the first's.
  for step in (jax.jit(lambda s: s.minimize(loss)), jax.jit(lambda s: s.minimize(loss))):
    state, info = step(state)
    assert not bool(info.skipped)
  want = 1.0 - 2 * 0.1 * 4 * 2 * np.sin(1.0)  # two steps, four rows
  np.testing.assert_allclose(np.asarray(state.params["w"]), want, rtol=1e-3)


def test_value_and_grad_returns_what_the_modules_measured():
  """MindSpore's flow: the same gradients and measurements as the step
  `TrainState.minimize` runs, and an adjust that reads them."""
  x, y = _data()
  model = DeepSigmoid(depth=1)
  wrapped = jmp_lite.flax.wrap(model, F16)
  params = model.init(jax.random.PRNGKey(2), x)
  ls = jmp_lite.ModuleLossScale.create(wrapped, x)
  loss = _loss(wrapped.apply, x, y)
  value, grads, finite, modules = jax.jit(
      lambda p, s: jmp_lite.value_and_grad(loss)(p, loss_scale=s))(params, ls)
  want, measured = _module_grads(wrapped, x, y)(ls, params)
  assert bool(finite) and modules.shape == ls.measure_shape()
  np.testing.assert_array_equal(np.asarray(modules), np.asarray(measured))
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(ls.adjust(finite, modules).module_scales),
                            np.asarray(ls.module_scales))
  # The guard alone has no measurements: it says where to get them.
  tx = jmp_lite.optax.with_loss_scale(optax.sgd(0.1), ls)
  with pytest.raises(ValueError, match="loss_scale_modules="):
    tx.update(grads, tx.init(params), params)
