"""Tests of jmp_lite.optax: with_loss_scale, get_loss_scale, accumulation, clipping."""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite import optax as jo
from jmp_lite.testing import count_compilations
from jmp_lite.testing import assert_trees_bitwise_equal



JIT = pytest.mark.parametrize("jit", [True, False], ids=["jit", "nojit"])


def _maybe_jit(f, jit):
  return jax.jit(f) if jit else f


def _reference_sgd(xs, poisoned, *, lr, scale, period, factor, min_scale, w0):
  """Plain-Python dynamic loss scaling with SGD, for loss = sum(w * x)."""
  w = np.array(w0, np.float32)
  counter, skipped, trajectory = 0, 0, []
  for x, bad in zip(xs, poisoned):
    trajectory.append(scale)
    if bad:  # the scaled gradient overflows
      skipped += 1
      counter = 0
      scale = max(min_scale, scale / factor)
    else:
      w = w + np.float32(-lr) * x  # optax.sgd: updates = -lr * g, then p + u
      counter += 1
      if counter == period:
        counter = 0
        scale = scale * factor
    trajectory[-1] = (trajectory[-1], w.copy())
  return trajectory, skipped, scale


@JIT
def test_matches_plain_python_dynamic_loss_scaling_over_long_overflow_pattern(jit):
  rng = np.random.default_rng(0)
  n, dim, lr = (300 if jit else 40), 5, 0.01
  xs = rng.standard_normal((n, dim)).astype(np.float32)
  poisoned = rng.random(n) < 0.2
  poisoned[15:35] = True  # a long run of overflows hits the floor
  for i in np.flatnonzero(poisoned):
    xs[i, rng.integers(dim)] = [np.inf, -np.inf, np.nan][i % 3]
  w0 = np.ones(dim, np.float32)
  tx = jo.with_loss_scale(
      optax.sgd(lr), jmp_lite.DynamicLossScale(2.0 ** 10, period=7, min_loss_scale=0.5))
  params = {"w": jnp.asarray(w0)}
  opt_state = tx.init(params)

  def step(params, opt_state, x):
    scale = jo.get_loss_scale(opt_state)
    grads = jax.grad(lambda p: scale.scale(jnp.sum(p["w"] * x)))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  step = _maybe_jit(step, jit)
  expected, skipped, final_scale = _reference_sgd(
      xs, poisoned, lr=lr, scale=2.0 ** 10, period=7, factor=2, min_scale=0.5, w0=w0)
  # Jitted, the parameters are those of the same SGD step written plainly in
  # optax and jitted (XLA may fuse `p + -lr * g` into one rounding, as it does
  # for the plain step); eagerly, NumPy's two roundings.
  sgd = optax.sgd(lr)
  plain = jax.jit(lambda p, x: optax.apply_updates(
      p, sgd.update(jax.grad(lambda q: jnp.sum(q["w"] * x))(p), sgd.init(p), p)[0]))
  compiled = []  # by step only, not by the checks around it
  for x, bad, (scale, w) in zip(xs, poisoned, expected):
    assert float(jo.get_loss_scale(opt_state).loss_scale) == scale
    x = jnp.asarray(x)
    want = params["w"] if bad else (plain(params, x)["w"] if jit else w)
    with count_compilations() as now:
      params, opt_state = step(params, opt_state, x)
    compiled += now
    np.testing.assert_array_equal(params["w"], want)
    np.testing.assert_allclose(params["w"], w, rtol=1e-6)  # NumPy's, to an ulp
  state = jo.find_loss_scale_state(opt_state)
  assert int(state.skipped_steps) == skipped == poisoned.sum()
  assert float(state.loss_scale.loss_scale) == final_scale
  if jit:
    assert len(compiled) == 1


def _adam_with_schedule():
  # optax's own schedules mix int32 counts and Python floats, which strict
  # promotion rejects; this one is explicit.
  schedule = lambda count: 1e-2 / (1.0 + count.astype(jnp.float32))
  return optax.chain(optax.scale_by_adam(), optax.scale_by_schedule(schedule),
                     optax.scale(-1.0))


@JIT
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.usefixtures("standard_promotion")
def test_skip_freezes_the_whole_inner_state_and_params_bitwise(jit, bad):
  params = {"w": jnp.array([1.0, -0.0, 0.0, 3.0]), "b": jnp.zeros((2,), jnp.bfloat16)}
  tx = jo.with_loss_scale(_adam_with_schedule(), jmp_lite.DynamicLossScale(2.0 ** 8))
  opt_state = tx.init(params)
  update = _maybe_jit(tx.update, jit)
  good = {"w": jnp.ones(4) * 256, "b": jnp.ones(2, jnp.bfloat16) * 256}
  updates, opt_state = update(good, opt_state, params)
  params = optax.apply_updates(params, updates)
  before = (params, jo.find_loss_scale_state(opt_state).inner_state)
  poisoned = {"w": good["w"].at[2].set(bad), "b": good["b"]}
  updates, opt_state2 = update(poisoned, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  assert_trees_bitwise_equal(new_params, params)
  assert_trees_bitwise_equal(jo.find_loss_scale_state(opt_state2).inner_state, before[1])
  state = jo.find_loss_scale_state(opt_state2)
  assert bool(state.skipped) and int(state.skipped_steps) == 1
  assert float(state.loss_scale.loss_scale) == 2.0 ** 7
  # Schedule count and Adam's count advanced once only (the good step).
  counts = [x for x in jax.tree.leaves(state.inner_state) if x.dtype == jnp.int32]
  assert counts and all(int(c) == 1 for c in counts)


def test_skip_preserves_negative_zero_params():
  params = {"w": jnp.array([-0.0, 0.0])}
  tx = jo.with_loss_scale(optax.sgd(0.1), jmp_lite.StaticLossScale(4.0))
  opt_state = tx.init(params)
  updates, _ = tx.update({"w": jnp.array([jnp.nan, 1.0])}, opt_state, params)
  assert_trees_bitwise_equal(optax.apply_updates(params, updates), params)


@pytest.mark.usefixtures("standard_promotion")
def test_never_applies_non_finite_updates_even_after_many_consecutive_overflows():
  params = {"w": jnp.arange(4.0)}
  # optax.apply_if_finite gives up after max_consecutive_errors; we never do.
  tx = jo.with_loss_scale(optax.adam(0.1), jmp_lite.DynamicLossScale(2.0 ** 15, period=3))
  opt_state = tx.init(params)
  step = jax.jit(tx.update)
  overflow, clean = {"w": jnp.full((4,), jnp.inf, jnp.float32)}, {"w": jnp.ones(4)}
  compiled = []  # by step only, not by apply_updates
  for _ in range(60):
    with count_compilations() as now:
      updates, opt_state = step(overflow, opt_state, params)
    compiled += now
    params = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(params["w"], jnp.arange(4.0))
  chex.assert_tree_all_finite(opt_state)
  state = jo.find_loss_scale_state(opt_state)
  assert int(state.skipped_steps) == 60 and float(state.loss_scale.loss_scale) == 1.0
  with count_compilations() as now:
    for _ in range(6):  # recovers: grows every `period` clean steps
      updates, opt_state = step(clean, opt_state, params)
  compiled += now
  assert float(jo.get_loss_scale(opt_state).loss_scale) == 4.0
  assert len(compiled) == 1


@JIT
def test_clipping_sees_unscaled_gradients(jit):
  rng = np.random.default_rng(1)
  true = {"a": jnp.asarray(rng.standard_normal((7, 3)), jnp.float32),
          "b": jnp.asarray(rng.standard_normal(5) * 10, jnp.float32)}
  scale = 2.0 ** 12
  scaled = jax.tree.map(lambda g: g * scale, true)
  params = jax.tree.map(jnp.zeros_like, true)
  tx = jo.with_loss_scale(optax.sgd(1.0), jmp_lite.StaticLossScale(scale), clip_norm=1.5)
  updates, state = _maybe_jit(tx.update, jit)(scaled, tx.init(params), params)
  ref_tx = optax.chain(optax.clip_by_global_norm(1.5), optax.sgd(1.0))
  ref, _ = ref_tx.update(true, ref_tx.init(params), params)
  chex.assert_trees_all_close(updates, ref, rtol=2e-6)
  np.testing.assert_allclose(optax.tree.norm(updates), 1.5, rtol=1e-6)
  np.testing.assert_allclose(jo.find_loss_scale_state(state).grad_norm,
                             optax.tree.norm(true), rtol=1e-6)


def test_huge_finite_gradients_are_not_mistaken_for_overflow():
  # The squares overflow float32, the values do not: the exact fallback decides.
  grads = {"w": jnp.full((4,), 1e30, jnp.float32)}
  tx = jo.with_loss_scale(optax.sgd(1.0), jmp_lite.NoOpLossScale(), clip_norm=1.0)
  updates, state = tx.update(grads, tx.init(grads), grads)
  state = jo.find_loss_scale_state(state)
  assert not bool(state.skipped)
  np.testing.assert_allclose(state.grad_norm, 2e30, rtol=1e-6)
  np.testing.assert_allclose(updates["w"], -0.5, rtol=1e-6)


def test_updates_come_back_in_param_dtype():
  params = {"w": jnp.ones(3, jnp.float32)}
  grads = {"w": jnp.ones(3, jnp.bfloat16)}
  tx = jo.with_loss_scale(optax.sgd(0.1), jmp_lite.StaticLossScale(2.0))
  updates, state = tx.update(grads, tx.init(params), params)
  assert updates["w"].dtype == jnp.float32
  chex.assert_trees_all_equal_dtypes(state, tx.init(params))


@JIT
def test_accumulation_skips_the_whole_step_when_any_micro_batch_overflows(jit):
  k, lr = 3, 0.1
  params = {"w": jnp.zeros(2)}
  tx = jo.with_loss_scale(optax.sgd(lr), jmp_lite.DynamicLossScale(2.0 ** 4), accumulate_steps=k)
  opt_state = tx.init(params)
  update = _maybe_jit(tx.update, jit)
  micro = [jnp.array([1.0, 2.0]), jnp.array([jnp.inf, 0.0]), jnp.array([3.0, 4.0]),
           jnp.array([1.0, 1.0]), jnp.array([2.0, 2.0]), jnp.array([6.0, 0.0])]
  applied = []
  for i, g in enumerate(micro):
    scale = jo.get_loss_scale(opt_state).loss_scale
    # The scale is fixed within an accumulation; it changes after the skip.
    assert float(scale) == (2.0 ** 4 if i < 3 else 2.0 ** 3)
    updates, opt_state = update({"w": g * scale}, opt_state, params)
    params = optax.apply_updates(params, updates)
    applied.append(np.asarray(updates["w"]))
    state = jo.find_loss_scale_state(opt_state)
    assert int(state.mini_step) == (i + 1) % k
  for i in (0, 1, 2, 3, 4):
    assert not np.any(applied[i]), i  # zero updates until a step completes
  np.testing.assert_allclose(applied[5], -lr * np.array([3.0, 1.0]), rtol=1e-6)
  state = jo.find_loss_scale_state(opt_state)
  assert int(state.skipped_steps) == 1 and not bool(state.skipped)
  # The accumulator was reset with fresh zeros: no NaN carried over.
  assert all(bool(jnp.all(a == 0)) for a in jax.tree.leaves(state.acc_grads))


@JIT
def test_skipped_says_on_every_micro_batch_whether_it_was_dropped(jit):
  """With accumulation, a call that only accumulated left ``skipped`` as the
  last completed step had it: an overflowing micro-batch read False (its
  BatchNorm statistics, selected with it as the README does, were kept:
  NaN in the model for good) and a healthy one after a skipped step read
  True. Now it is this call's: dropped or not. The count of skipped steps
  is unchanged."""
  k = 2
  params = {"w": jnp.zeros(2)}
  tx = jo.with_loss_scale(optax.sgd(0.1), jmp_lite.StaticLossScale(1.0), accumulate_steps=k)
  opt_state = tx.init(params)
  update = _maybe_jit(tx.update, jit)
  bad, good = jnp.array([jnp.inf, 0.0]), jnp.ones(2)
  seen = []
  for g in (good, good, bad, good, good, good):
    _, opt_state = update({"w": g}, opt_state, params)
    state = jo.find_loss_scale_state(opt_state)
    seen.append((int(state.mini_step), bool(state.skipped)))
  # The overflowing micro-batch (call 2) is dropped and skips its step (3);
  # the healthy micro-batch after it (4) is used.
  assert seen == [(1, False), (0, False), (1, True), (0, True), (1, False), (0, False)], seen
  assert int(state.skipped_steps) == 1


@JIT
def test_a_state_restored_past_its_accumulation_ends_it_at_the_next_call(jit):
  """A state saved after 3 micro-batches of accumulate_steps=4, restored
  into accumulate_steps=2 (the same tree: orbax and msgpack accept it):
  ``mini_step == k - 1`` never held again, and no update was ever applied,
  nor a skip counted. Now the next call ends the accumulation, averaged
  over the 4 micro-batches. Oracle: optax.sgd on the mean of the gradients."""
  params = {"w": jnp.zeros(2)}
  grads = [jnp.array([1.0, 2.0]), jnp.array([3.0, 0.0]), jnp.array([2.0, 2.0]),
           jnp.array([6.0, 4.0])]
  make = lambda k: jo.with_loss_scale(optax.sgd(0.5), jmp_lite.StaticLossScale(4.0),
                                      accumulate_steps=k)
  long_tx, short_tx = make(4), make(2)
  opt_state = long_tx.init(params)
  for g in grads[:3]:
    _, opt_state = long_tx.update({"w": g * 4.0}, opt_state, params)
  assert int(jo.find_loss_scale_state(opt_state).mini_step) == 3
  updates, opt_state = _maybe_jit(short_tx.update, jit)({"w": grads[3] * 4.0}, opt_state,
                                                         params)
  state = jo.find_loss_scale_state(opt_state)
  assert int(state.mini_step) == 0 and not bool(state.skipped)
  want, _ = optax.sgd(0.5).update({"w": sum(grads) / 4}, optax.sgd(0.5).init(params))
  np.testing.assert_allclose(updates["w"], want["w"], rtol=1e-6)


def test_composes_with_inject_hyperparams_and_chain():
  params = {"w": jnp.ones(3)}
  tx = optax.inject_hyperparams(
      lambda learning_rate: jo.with_loss_scale(optax.sgd(learning_rate),
                                               jmp_lite.DynamicLossScale(8.0)))(
                                                   learning_rate=0.5)
  # First in the chain: a transformation before it would see scaled
  # gradients (`test_a_loss_scale_chained_after_other_transformations_warns`).
  tx = optax.chain(tx, optax.identity())
  opt_state = tx.init(params)
  assert float(jo.get_loss_scale(opt_state).loss_scale) == 8.0
  updates, opt_state = jax.jit(tx.update)({"w": jnp.ones(3) * 8.0}, opt_state, params)
  np.testing.assert_allclose(updates["w"], -0.5)
  opt_state[0].hyperparams["learning_rate"] = jnp.asarray(0.25)
  updates, _ = jax.jit(tx.update)({"w": jnp.ones(3) * 8.0}, opt_state, params)
  np.testing.assert_allclose(updates["w"], -0.25)


def test_extra_args_reach_the_inner_transformation():
  seen = {}

  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params=None, *, value=None):
    del params
    seen["value"] = value
    return updates, state

  inner = optax.GradientTransformationExtraArgs(init, update)
  tx = jo.with_loss_scale(inner, jmp_lite.NoOpLossScale())
  tx.update({"w": jnp.ones(1)}, tx.init({"w": jnp.ones(1)}), value=3.0)
  assert seen["value"] == 3.0


def test_get_loss_scale_errors():
  with pytest.raises(ValueError, match="found 0"):
    jo.get_loss_scale(optax.sgd(0.1).init({"w": jnp.ones(1)}))
  tx = optax.chain(jo.with_loss_scale(optax.sgd(0.1), jmp_lite.NoOpLossScale()),
                   jo.with_loss_scale(optax.sgd(0.1), jmp_lite.NoOpLossScale()))
  with pytest.raises(ValueError, match="found 2"):
    jo.get_loss_scale(tx.init({"w": jnp.ones(1)}))


@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_scale=2.0), "loss_scale must be a jmp_lite loss scale, got 2.0"),
    (dict(loss_scale=jmp_lite.NoOpLossScale(), clip_norm=0.0), "clip_norm must be > 0 and finite, got 0.0"),
    (dict(loss_scale=jmp_lite.NoOpLossScale(), accumulate_steps=0), "got 0"),
    (dict(loss_scale=jmp_lite.NoOpLossScale(), accumulate_steps=1.5), "got 1.5"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises((TypeError, ValueError), match=match):
    jo.with_loss_scale(optax.sgd(0.1), **kwargs)


def test_eager_update_compiles_once_not_on_every_call():
  """Called outside jit, update runs one jitted step: no compilation after the first call.

  Before, every eager call traced afresh and compiled each of its lax.conds
  again (seconds per call).
  """
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
  grads = jax.tree.map(jnp.ones_like, params)
  tx = jo.with_loss_scale(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0 ** 15), clip_norm=1.0)
  state = tx.init(params)
  updates, state = tx.update(grads, state, params)  # compiles
  with jmp_lite.testing.count_compilations() as compiled:
    for _ in range(3):
      updates, state = tx.update(grads, state, params)
  assert not compiled, len(compiled)
  assert int(jo.find_loss_scale_state(state).skipped_steps) == 0
  # The gradients given are of the scaled loss: the unscaled norm is sqrt(15) / 2**15.
  assert float(jo.find_loss_scale_state(state).grad_norm) == pytest.approx(15 ** 0.5 / 2 ** 15)
  # Python values among the extra arguments reach the inner optimizer as given.
  seen = []
  inner = optax.GradientTransformationExtraArgs(
      lambda p: optax.EmptyState(),
      lambda u, s, p=None, *, value=None: (seen.append(value), (u, s))[1])
  tx = jo.with_loss_scale(inner, jmp_lite.NoOpLossScale())
  tx.update(grads, tx.init(params), params, value=2.5)
  assert seen and all(v == 2.5 and isinstance(v, float) for v in seen)


def test_apply_updates_leaves_a_parameter_with_a_none_update():
  """An Equinox model's updates are None where it holds functions: the
  model could not be updated ("unsupported operand type(s) for +: 'float'
  and 'NoneType'"). Oracle: ``eqx.apply_updates``'s rule (a None update
  leaves the leaf), and the float32 sum rounded once to bfloat16."""
  model = {"act": jax.nn.relu, "w": jnp.ones(3, jnp.bfloat16), "b": None}
  updates = {"act": None, "w": jnp.full(3, 2.0 ** -6, jnp.float32), "b": None}
  out = jo.apply_updates(model, updates)
  assert out["act"] is jax.nn.relu and out["b"] is None
  assert out["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out["w"], np.float32), 1 + 2.0 ** -6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_apply_if_finite_around_the_guard_is_refused(dtype):
  """apply_if_finite checks the scaled gradients and keeps its old state on
  an overflow, the guard's included: the loss scale stayed at 2**125 and
  the steps read as applied (float16 parameters failed inside optax's
  ``cond`` instead). Inside the guard it is fine."""
  tx = jo.with_loss_scale(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0 ** 125))
  params = {"w": jnp.ones(3, dtype)}
  with pytest.raises(ValueError, match="inside optax.apply_if_finite"):
    optax.apply_if_finite(tx, max_consecutive_errors=3).init(params)
  with pytest.raises(ValueError, match="inside optax.apply_if_finite"):
    optax.chain(optax.apply_if_finite(optax.chain(optax.identity(), tx), 3)).init(params)
  jo.with_loss_scale(optax.apply_if_finite(optax.sgd(0.1), 3),
                     jmp_lite.NoOpLossScale()).init(params)


def test_a_loss_scale_chained_after_other_transformations_warns():
  """``optax.chain(clip_by_global_norm(1.0), with_loss_scale(...))`` clipped
  the scaled gradients and then unscaled them: steps 2**15 times too small
  (w moved 3.0 -> 2.9999986, where clip_norm= inside gives 2.95)."""
  import warnings  # pylint: disable=g-import-not-at-top
  params = {"w": jnp.full((4,), 3.0)}
  ls = jmp_lite.DynamicLossScale(2.0 ** 15)
  after = optax.chain(optax.clip_by_global_norm(1.0), jo.with_loss_scale(optax.sgd(0.1), ls))
  with pytest.warns(UserWarning, match="chained after 1 other transformation"):
    jo.get_loss_scale(after.init(params))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    first = optax.chain(jo.with_loss_scale(optax.sgd(0.1), ls), optax.identity())
    jo.get_loss_scale(first.init(params))
    jo.get_loss_scale(jo.with_loss_scale(optax.sgd(0.1), ls, clip_norm=1.0).init(params))
