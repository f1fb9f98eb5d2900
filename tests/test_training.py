"""Tests of jmp_lite.training: value_and_grad, TrainState, checkpoint resume."""

import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization
import orbax.checkpoint as ocp
import pytest

import jmp_lite
from jmp_lite.testing import count_compilations
from jmp_lite.testing import assert_trees_bitwise_equal



JIT = pytest.mark.parametrize("jit", [True, False], ids=["jit", "nojit"])


def _maybe_jit(f, jit):
  return jax.jit(f) if jit else f


def _loss(params, x):
  h = jnp.tanh(x @ params["w1"])
  return jnp.mean((h @ params["w2"]) ** 2)


def _params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w1": jax.random.normal(k1, (4, 8)), "w2": jax.random.normal(k2, (8, 2))}


@JIT
@pytest.mark.parametrize("loss_scale", [jmp_lite.NoOpLossScale(), jmp_lite.StaticLossScale(2.0 ** 10),
                                        jmp_lite.DynamicLossScale(2.0 ** 15)])
def test_value_and_grad_unscales_with_the_scale_used(jit, loss_scale):
  params, x = _params(), jnp.ones((3, 4))
  f = _maybe_jit(lambda p, x, ls: jmp_lite.value_and_grad(_loss)(p, x, loss_scale=ls), jit)
  loss, grads, finite = f(params, x, loss_scale)
  ref_loss, ref_grads = _maybe_jit(jax.value_and_grad(_loss), jit)(params, x)
  assert loss.dtype == jnp.float32 and finite.dtype == jnp.bool_ and finite.shape == ()
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  # Power-of-two scales are exact: only XLA's fusion choices may differ.
  chex.assert_trees_all_close(grads, ref_grads, rtol=1e-6, atol=1e-6)
  assert bool(finite)


def test_value_and_grad_with_policy_computes_in_compute_dtype():
  seen = {}

  def loss_fn(params, x):
    seen["dtypes"] = jax.tree.map(lambda p: p.dtype, params)
    y = x.astype(jnp.bfloat16) @ params["w1"]
    return jnp.sum(y)  # a bf16 loss: returned as f32

  params = _params()
  (loss, aux), grads, finite = jmp_lite.value_and_grad(
      lambda p, x: (loss_fn(p, x), 7), has_aux=True, policy="p=f32,c=bf16,o=f32")(
          params, jnp.ones((2, 4)), loss_scale=jmp_lite.StaticLossScale(64.0))
  assert seen["dtypes"] == {"w1": jnp.bfloat16, "w2": jnp.bfloat16}
  assert loss.dtype == jnp.float32 and aux == 7
  assert jax.tree.map(lambda g: g.dtype, grads) == {"w1": jnp.float32, "w2": jnp.float32}
  np.testing.assert_array_equal(grads["w1"], np.full((4, 8), 2.0, np.float32))
  assert bool(finite)


@pytest.mark.parametrize("policy", [None, "p=f32,c=bf16,o=f32"])
def test_value_and_grad_allows_integer_leaves_as_jax_does(policy):
  """An Equinox model partitioned with ``eqx.is_array`` keeps an int leaf
  among the differentiated ones: ``jax.value_and_grad(allow_int=True)``
  gives it a float0 gradient, and jmp_lite's had no way to ask. Oracle:
  JAX's own, on the float leaf and the float0 one."""
  params = {"w": jnp.full((3,), 2.0), "steps": jnp.int32(4)}
  f = lambda p: jnp.sum(p["w"] ** 2) * 0.5
  want_loss, want = jax.value_and_grad(f, allow_int=True)(params)
  loss, grads, finite = jmp_lite.value_and_grad(f, policy=policy, allow_int=True)(
      params, loss_scale=jmp_lite.StaticLossScale(1024.0))
  assert bool(finite) and float(loss) == float(want_loss)
  np.testing.assert_array_equal(grads["w"], want["w"])
  assert grads["steps"].dtype == want["steps"].dtype == jax.dtypes.float0


def test_value_and_grad_argnums_and_non_finite_flag():
  f = lambda a, b: jnp.sum(a * b)
  _, grads, finite = jmp_lite.value_and_grad(f, argnums=(0, 1))(
      jnp.array([1.0, jnp.inf]), jnp.array([2.0, 3.0]), loss_scale=jmp_lite.StaticLossScale(4.0))
  assert isinstance(grads, tuple) and len(grads) == 2
  assert not bool(finite)


@pytest.mark.parametrize("bad", [jnp.ones(3), jnp.ones((), jnp.int32)])
def test_value_and_grad_rejects_non_scalar_loss(bad):
  with pytest.raises(TypeError, match="floating-point scalar.*shape=\\(3,\\)|dtype=int32"):
    jmp_lite.value_and_grad(lambda p: bad * 1)(jnp.ones(3))


def test_mindspore_flow_matches_reference_and_compiles_once():
  """The docstring's hand-written step, with overflows injected."""
  tx = optax.sgd(0.1)
  params = {"w": jnp.ones(3)}
  opt_state = tx.init(params)
  loss_scale = jmp_lite.DynamicLossScale(2.0 ** 4, period=2)

  @jax.jit
  def train_step(params, opt_state, loss_scale, x):
    loss, grads, finite = jmp_lite.value_and_grad(lambda p: jnp.sum(p["w"] * x))(
        params, loss_scale=loss_scale)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp_lite.select_tree(
        finite, (new_params, new_opt_state), (params, opt_state))
    return params, opt_state, loss_scale, loss

  w, scale, counter = np.ones(3, np.float32), 2.0 ** 4, 0
  compiled = []  # by train_step only, not by the checks around it
  for i in range(20):
    x = np.array([1.0, 2.0, 3.0], np.float32) * (np.inf if i % 5 == 3 else 1.0)
    with count_compilations() as now:
      params, opt_state, loss_scale, _ = train_step(params, opt_state, loss_scale, x)
    compiled += now
    if i % 5 == 3:
      scale, counter = max(1.0, scale / 2), 0
    else:
      w = w + np.float32(-0.1) * x
      counter += 1
      if counter == 2:
        scale, counter = scale * 2, 0
    # XLA may fuse `w - lr * g` into one fused multiply-add: 1 ulp apart.
    np.testing.assert_array_max_ulp(params["w"], w, maxulp=1)
    assert float(loss_scale.loss_scale) == scale
  assert len(compiled) == 1


def _state(loss_scale=None, policy=None, tx=None):
  return jmp_lite.TrainState.create(
      apply_fn=None, params=_params(), tx=tx or optax.adamw(1e-2),
      loss_scale=loss_scale or jmp_lite.DynamicLossScale(2.0 ** 15, period=4),
      policy=policy)


def _train_step(state, x, poison):
  def loss_fn(params):
    params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return _loss(params, x) * poison
  return state.minimize(loss_fn)


@JIT
@pytest.mark.usefixtures("standard_promotion")
def test_train_state_minimize_skips_and_counts(jit):
  state = _state(policy="p=f32,c=bf16,o=f32")
  # A function of its own: jit's compilations of _train_step are shared by
  # every jax.jit(_train_step), here and in other tests.
  step = _maybe_jit(lambda *args: _train_step(*args), jit)
  x, one, inf = jnp.ones((3, 4)), jnp.float32(1.0), jnp.float32(jnp.inf)
  with count_compilations() as compiled:
    state, info = step(state, x, one)
  assert not bool(info.skipped) and float(info.loss_scale) == 2.0 ** 15
  before = state
  with count_compilations() as compiled_again:
    state, info = step(state, x, inf)
  assert bool(info.skipped)
  assert int(state.step) == 2 and int(state.loss_scale_state.skipped_steps) == 1
  assert_trees_bitwise_equal(state.params, before.params)
  assert float(state.loss_scale.loss_scale) == 2.0 ** 14
  assert jax.tree.map(lambda p: p.dtype, state.params) == {"w1": jnp.float32, "w2": jnp.float32}
  if jit:
    assert len(compiled) == 1 and not compiled_again


def test_a_call_that_only_accumulates_skipped_no_step():
  """With ``accumulate_steps=2``, a micro-batch that only accumulates
  reported the last completed step's ``skipped``: counting ``info.skipped``
  over calls gave 2 where ``skipped_steps`` (the oracle) says 1."""
  x = np.ones((4, 3), np.float32)
  bad = x.copy()
  bad[0, 0] = np.inf
  state = jmp_lite.TrainState.create(
      apply_fn=None, params={"w": jnp.ones((3, 1))}, tx=optax.sgd(0.1),
      loss_scale=jmp_lite.DynamicLossScale(2.0 ** 15), accumulate_steps=2)
  step = jax.jit(lambda s, x: s.minimize(lambda p, x: jnp.mean(x @ p["w"]), x))
  reported = []
  for batch in (x, bad, x, x, bad, x):
    state, info = step(state, batch)
    reported.append(bool(info.skipped))
  assert reported == [False, True, False, False, False, True]
  assert sum(reported) == int(state.loss_scale_state.skipped_steps) == 2


def test_train_state_apply_gradients_takes_scaled_gradients():
  state = _state(loss_scale=jmp_lite.StaticLossScale(8.0), tx=optax.sgd(1.0))
  scaled = jax.tree.map(lambda p: jnp.ones_like(p) * 8.0, state.params)
  new = state.apply_gradients(grads=scaled, scaled=True)
  chex.assert_trees_all_close(new.params, jax.tree.map(lambda p: p - 1.0, state.params),
                              rtol=1e-7)  # np.testing.assert_allclose's default
  # Flax's habit, gradients of the plain loss, would step 8 times too short
  # here (2**15 times under the usual dynamic scale): refused, not guessed.
  with pytest.raises(TypeError, match="scaled=True, or let state.minimize"):
    state.apply_gradients(grads=scaled)
  with pytest.raises(TypeError, match="scaled=False"):
    state.apply_gradients(grads=scaled, scaled=False)
  plain = _state(loss_scale=jmp_lite.NoOpLossScale(), tx=optax.sgd(1.0))
  plain.apply_gradients(grads=jax.tree.map(jnp.ones_like, plain.params))  # as Flax's
  with pytest.raises(TypeError, match="pass the function, not its value"):
    state.minimize(jnp.float32(1.0))


def _run(state, n, start=0):
  step = jax.jit(_train_step)
  rng = np.random.default_rng(123)
  xs = rng.standard_normal((40, 3, 4)).astype(np.float32)
  for i in range(start, start + n):
    poison = np.float32(np.inf if i % 7 == 5 else 1.0)
    state, _ = step(state, jnp.asarray(xs[i]), poison)
  return state


@pytest.mark.usefixtures("standard_promotion")
def test_checkpoint_resume_is_bit_exact_in_a_fresh_process(tmp_path):
  straight = _run(_state(), 20)
  half = _run(_state(), 10)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "half", half)
  ckpt.wait_until_finished()
  script = textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {os.path.dirname(__file__)!r})
      import jax, numpy as np, orbax.checkpoint as ocp
      import test_training as t
      like = jax.tree.map(ocp.utils.to_shape_dtype_struct, t._state())
      state = ocp.StandardCheckpointer().restore({str(tmp_path / 'half')!r}, like)
      state = t._run(state, 10, start=10)
      np.savez({str(tmp_path / 'out.npz')!r}, *jax.tree.leaves(state))
  """)
  subprocess.run([sys.executable, "-c", script], check=True)
  resumed = np.load(tmp_path / "out.npz")
  leaves = jax.tree.leaves(straight)
  assert len(resumed.files) == len(leaves)
  assert_trees_bitwise_equal([resumed[f"arr_{i}"] for i in range(len(leaves))], leaves)
  assert int(straight.loss_scale_state.skipped_steps) == 3


@pytest.mark.usefixtures("standard_promotion")
@pytest.mark.parametrize("loss_scale", [
    jmp_lite.DynamicLossScale(2.0 ** 15), jmp_lite.StaticLossScale(8.0), jmp_lite.NoOpLossScale(),
    jmp_lite.UnderflowAwareLossScale(2.0 ** 15)],
                         ids=lambda ls: type(ls).__name__)
def test_flax_serialization_resumes_bit_exact(loss_scale):
  """``flax.serialization.to_bytes``/``from_bytes`` of the whole state, as for
  Flax's own TrainState (the loss scales could not be serialised)."""
  straight = _run(_state(loss_scale=loss_scale), 14)
  saved = serialization.to_bytes(_run(_state(loss_scale=loss_scale), 7))
  template = _state(loss_scale=loss_scale)
  restored = serialization.from_bytes(template, saved)
  assert jax.tree.structure(restored) == jax.tree.structure(template)
  # Leaves: the optimizer functions of two `create` calls differ.
  assert_trees_bitwise_equal(jax.tree.leaves(_run(restored, 7, start=7)),
                             jax.tree.leaves(straight))
  with pytest.raises(ValueError, match=r"DynamicLossScale at \.: the checkpoint has no fields"):
    serialization.from_state_dict(jmp_lite.DynamicLossScale(2.0 ** 15),
                                  serialization.to_state_dict(jmp_lite.StaticLossScale(8.0)))
  # The other way too, as flax.struct refuses unknown fields: a dynamic
  # scale's checkpoint restored into a NoOp (or static) one lost the scale
  # without a word, and float16 training resumed unscaled.
  saved = serialization.to_bytes(_state(loss_scale=jmp_lite.DynamicLossScale(2.0 ** 10)))
  for other in (jmp_lite.NoOpLossScale(), jmp_lite.StaticLossScale(8.0)):
    with pytest.raises(ValueError, match=r"at \./opt_state/loss_scale: the checkpoint has "
                       r"fields the target lacks \['consecutive_hysteresis'"):
      serialization.from_bytes(_state(loss_scale=other), saved)


def test_o1_policy_autocasts_the_whole_differentiated_step():
  policy = jmp_lite.get_policy("O1")
  # Small inputs: tanh stays off saturation, where its bf16 derivative is 0.
  params, x = _params(), jnp.full((3, 4), 0.1, jnp.float32)
  f = lambda p, x: jmp_lite.value_and_grad(_loss, policy=policy)(
      p, x, loss_scale=jmp_lite.StaticLossScale(2.0 ** 10))
  report = jmp_lite.audit(f, params, x, policy=policy)
  dots = report.count(primitive="dot_general")
  # Forward (2) and backward (3: the first layer's input gradient is not
  # needed) matmuls, all in bf16 with float32 accumulation.
  assert dots == report.count(primitive="dot_general", operand_dtype="bf16",
                              accumulation="f32") == 5
  loss, grads, finite = jax.jit(f)(params, x)
  ref_loss, ref_grads = jax.value_and_grad(_loss)(params, x)
  assert bool(finite) and loss.dtype == jnp.float32
  assert jax.tree.map(lambda g: g.dtype, grads) == {"w1": jnp.float32, "w2": jnp.float32}
  np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
  chex.assert_trees_all_close(grads, ref_grads, rtol=5e-2, atol=5e-3)


def test_minimize_refuses_params_that_left_the_policy_param_dtype():
  # E.g. restored from a checkpoint into a bf16 target: training on would
  # keep bf16 master weights without a word.
  state = jmp_lite.TrainState.create(
      apply_fn=None, params={"w": jnp.ones((3, 2)), "b": jnp.zeros((2,))},
      tx=optax.sgd(0.1), policy="p=f32,c=bf16,o=f32")
  loss = lambda p: jnp.sum(p["w"].astype(jnp.float32))
  state.minimize(loss)  # as created: fine
  bad = state.replace(params={**state.params, "w": state.params["w"].astype(jnp.bfloat16)})
  with pytest.raises(TypeError, match=r"TrainState.minimize: parameter \['w'\] is "
                     r"bfloat16\[3, 2\], but the policy keeps parameters in float32"):
    jax.jit(lambda s: s.minimize(loss))(bad)


@pytest.mark.parametrize("telemetry", [None, "ops"])
def test_negative_argnums_name_the_same_argument(telemetry):
  """``argnums=-1`` is the last argument, as in `jax.value_and_grad`: cast to
  the compute dtype and differentiated alike (it failed with telemetry)."""
  def loss(x, w):
    with jax.named_scope("m"):
      return jnp.sum((x @ w) ** 2)

  x, w = jnp.full((2, 3), 1.001), jnp.full((3, 3), 1.001)  # not exact in bf16
  kw = {} if telemetry is None else {"telemetry": jmp_lite.Telemetry(mode=telemetry)}
  one = jmp_lite.StaticLossScale(1.0)
  last, second = (jmp_lite.value_and_grad(loss, argnums=a, policy="p=f32,c=bf16,o=f32",
                                          **kw)(x, w, loss_scale=one) for a in (-1, 1))
  chex.assert_trees_all_equal(last, second)
  plain = jmp_lite.value_and_grad(loss, argnums=1, **kw)(x, w, loss_scale=one)
  assert float(jnp.max(jnp.abs(last[1] - plain[1]))) > 0  # the policy did cast


@pytest.mark.usefixtures("standard_promotion")  # optax's plateau arithmetic
def test_minimize_gives_the_loss_to_optimizers_that_read_it():
  """``optax.contrib.reduce_on_plateau`` (and ``polyak_sgd``) need the loss as
  ``value=``: under `TrainState.minimize` they raised optax's ``missing
  keyword-only argument 'value'``. The oracle is plain optax given the loss
  by hand; a loss that does not improve (learning rate 0) halves the scale
  after ``patience`` steps."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32)
  loss = lambda p, x: jnp.mean((x @ p["w"]) ** 2)
  tx = optax.chain(optax.sgd(0.0), optax.contrib.reduce_on_plateau(patience=2, factor=0.5))
  params = {"w": jnp.ones(4)}
  state = jmp_lite.TrainState.create(apply_fn=None, params=params, tx=tx)
  plain = tx.init(params)
  step = jax.jit(lambda s: s.minimize(loss, x))
  for _ in range(6):
    state, _ = step(state)
    value, grads = jax.value_and_grad(loss)(params, x)
    _, plain = tx.update(grads, plain, params, value=value)
  ours, theirs = state.loss_scale_state.inner_state[1], plain[1]
  # The loss itself to float32 rounding (another program computes it).
  np.testing.assert_allclose(ours.best_value, theirs.best_value, rtol=1e-6)
  assert_trees_bitwise_equal((ours.scale, ours.plateau_count, ours.count),
                             (theirs.scale, theirs.plateau_count, theirs.count))
  assert float(theirs.scale) == 0.25


def test_create_warns_of_parameters_narrower_than_the_wrapped_models():
  """A bf16 checkpoint given to a ``p=f32`` wrapped model trained bf16
  masters with round-to-nearest Adam (the README's pure-bf16 row) without a
  word. With ``policy=``, create casts them; made by the model's init, they
  are right."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import warnings  # pylint: disable=g-import-not-at-top
  import jmp_lite.flax  # pylint: disable=g-import-not-at-top
  model = jmp_lite.flax.wrap(nn.Dense(3), "p=f32,c=bf16,o=f32")
  params = model.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
  half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  with pytest.warns(UserWarning, match=r"2 parameter\(s\) are narrower than the wrapped "
                    r"model's param_dtype float32, e.g. params\['bias'\] is bfloat16"):
    jmp_lite.TrainState.create(apply_fn=model.apply, params=half, tx=optax.sgd(0.1))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jmp_lite.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    state = jmp_lite.TrainState.create(apply_fn=model.apply, params=half, tx=optax.sgd(0.1),
                                       policy="p=f32,c=bf16,o=f32")
  assert state.params["kernel"].dtype == jnp.float32


def test_minimize_refuses_parameters_restored_narrower_than_the_wrapped_models():
  """A bf16 checkpoint restored (msgpack) into a ``p=f32`` wrapped model's
  state, without ``policy=`` (the README's TrainState flow): minimize
  trained bf16 masters without a word, where with ``policy=`` it refused."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jmp_lite.flax  # pylint: disable=g-import-not-at-top

  def make(policy):
    model = jmp_lite.flax.wrap(nn.Dense(3), policy)
    params = model.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
    return model, jmp_lite.TrainState.create(apply_fn=model.apply, params=params,
                                             tx=optax.sgd(0.1))

  _, saved = make("p=bf16,c=bf16,o=f32")
  model, template = make("p=f32,c=bf16,o=f32")
  restored = serialization.from_bytes(template, serialization.to_bytes(saved))
  loss = lambda p: jnp.mean(model.apply({"params": p}, jnp.ones((2, 4))))
  with pytest.raises(TypeError, match=r"parameter \['bias'\] is bfloat16, narrower than "
                     r"the wrapped model's param_dtype float32"):
    jax.jit(lambda s: s.minimize(loss))(restored)
  jax.jit(lambda s: s.minimize(loss))(template)  # as created: trains


@pytest.mark.usefixtures("standard_promotion")  # optax's Adam: b1 ** count
def test_dropped_keeps_an_overflowing_micro_batchs_batch_stats_out():
  """Linen BatchNorm under ``accumulate_steps=2``, statistics selected with
  ``info.dropped``: the micro-batch that overflows float16 (call 2, which
  only accumulates) is dropped with its statistics, the healthy ones are
  kept. ``info.skipped`` (False on such a call, by design: it counts skipped
  steps) kept NaN statistics in the model for good."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jmp_lite.flax  # pylint: disable=g-import-not-at-top

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.BatchNorm(use_running_average=False)(nn.Dense(16)(x))
      return nn.Dense(2)(nn.relu(x))

  model = jmp_lite.flax.wrap(Net(), "p=f32,c=f16,o=f32")
  x, y = jax.random.normal(jax.random.key(1), (32, 8)), jnp.zeros((32, 2))
  variables = model.init(jax.random.key(0), x)
  state = jmp_lite.TrainState.create(
      apply_fn=model.apply, params=variables["params"], tx=optax.adam(1e-3),
      loss_scale=jmp_lite.DynamicLossScale(2.0 ** 10), accumulate_steps=2)

  @jax.jit
  def step(state, stats, x):
    def loss_fn(p):
      out, new = model.apply({"params": p, "batch_stats": stats}, x,
                             mutable=["batch_stats"])
      return jnp.mean((out - y) ** 2), new["batch_stats"]
    state, info = state.minimize(loss_fn, has_aux=True)
    return state, jmp_lite.select_tree(info.dropped, stats, info.aux), info

  stats, seen = variables["batch_stats"], []
  for xb in (x, x, x * 1e5, x, x + 1.0, x):
    before = stats
    state, stats, info = step(state, stats, xb)
    finite = all(bool(jnp.all(jnp.isfinite(s))) for s in jax.tree.leaves(stats))
    changed = any(bool(jnp.any(a != b)) for a, b in zip(jax.tree.leaves(stats),
                                                       jax.tree.leaves(before)))
    seen.append((bool(info.dropped), bool(info.skipped), finite, changed))
  # (dropped, skipped, stats finite, stats changed) per call: the overflow
  # (2) and the step it skips (3) keep the statistics as they were.
  assert seen == [(False, False, True, True), (False, False, True, True),
                  (True, False, True, False), (True, True, True, False),
                  (False, False, True, True), (False, False, True, True)], seen


def test_parameters_a_models_own_rules_store_in_bf16_train():
  """A rule that stores some parameters in bf16 under a ``p=f32`` policy:
  made by the wrapped model's init, they are what it asked for. minimize
  refused them (TypeError) once it checked the policy's param_dtype alone;
  neither create nor minimize may refuse them or warn."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import warnings  # pylint: disable=g-import-not-at-top
  import jmp_lite.flax  # pylint: disable=g-import-not-at-top

  class Net(nn.Module):
    @nn.compact
    def __call__(self, t):
      return nn.Dense(3)(nn.Embed(10, 8)(t))

  model = jmp_lite.flax.wrap(Net(), "p=f32,c=bf16,o=f32",
                             rules={nn.Embed: "p=bf16,c=bf16,o=f32"})
  t = jnp.arange(4)
  params = model.init(jax.random.key(0), t)["params"]
  assert params["Embed_0"]["embedding"].dtype == jnp.bfloat16
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state = jmp_lite.TrainState.create(apply_fn=model.apply, params=params,
                                       tx=optax.sgd(0.1))
  loss = lambda p: jnp.mean(model.apply({"params": p}, t))
  state, _ = jax.jit(lambda s: s.minimize(loss))(state)
  assert state.params["Embed_0"]["embedding"].dtype == jnp.bfloat16


def test_states_created_alike_have_one_structure_and_one_compilation():
  """Found by a user: two ``TrainState.create`` calls with the same optimizer
  object and equal arguments gave different tree structures (the wrapped
  ``tx`` was a new pair of closures each time), so a jitted step compiled
  again for the second, where Flax's own ``TrainState`` compiles once.
  Oracle: Flax's ``TrainState`` given the same ``tx``; and states created
  differently must still differ (each ``tx.init`` makes its own loss scale)."""
  from flax.training import train_state as flax_train_state

  tx = optax.sgd(0.1)
  params = {"w": jnp.ones((3, 2))}

  def make(scale=2.0 ** 15, **kwargs):
    return jmp_lite.TrainState.create(
        apply_fn=None, params=params, tx=kwargs.pop("tx", tx), policy="p=f32,c=bf16,o=f32",
        loss_scale=jmp_lite.DynamicLossScale(scale), clip_norm=1.0, **kwargs)

  flax_a, flax_b = (flax_train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
                    for _ in range(2))
  assert jax.tree.structure(flax_a) == jax.tree.structure(flax_b)
  a, b = make(), make()
  assert jax.tree.structure(a) == jax.tree.structure(b)
  step = jax.jit(lambda s, x: s.minimize(lambda p, x: jnp.sum(x.astype(p["w"].dtype) @ p["w"]), x)[0])
  x = jnp.ones((4, 3))
  with count_compilations() as compiled:
    step(a, x)
    step(b, x)
  assert len(compiled) == 1
  # Made from traced values (inside eval_shape or jit): equal to no other.
  for other in (make(2.0 ** 10), make(tx=optax.sgd(0.1)), make(accumulate_steps=2),
                jax.eval_shape(make), jax.jit(make)()):
    assert jax.tree.structure(other) != jax.tree.structure(a)
  # Each transformation still makes its own initial state.
  assert float(make(2.0 ** 10).tx.init(params).loss_scale.loss_scale) == 2.0 ** 10


def test_transformations_of_the_two_optax_kinds_of_the_same_functions_differ():
  """optax's GradientTransformation and GradientTransformationExtraArgs of the
  same functions compare equal as tuples, but only the second is given the
  update's extra arguments: wrapped alike they compared equal, and a jitted
  update of one ran the other's trace (found in review)."""
  def init(params):
    return optax.EmptyState()

  def update(updates, state, params=None, scale=1.0):
    return jax.tree.map(lambda u: -scale * u, updates), state

  plain = optax.GradientTransformation(init, update)
  extra = optax.GradientTransformationExtraArgs(init, update)
  a, b = (jmp_lite.optax.with_loss_scale(t, jmp_lite.NoOpLossScale()) for t in (plain, extra))
  assert a.update != b.update
  params = {"w": jnp.ones(2)}
  grads = {"w": jnp.ones(2)}
  jax.jit(a.update)(grads, a.init(params), params, scale=3.0)
  got, _ = jax.jit(b.update)(grads, b.init(params), params, scale=3.0)
  np.testing.assert_array_equal(got["w"], [-3.0, -3.0])
