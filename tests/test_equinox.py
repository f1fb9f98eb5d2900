"""Equinox models under jmp_lite, as the README's Equinox recipe writes them.

Oracles: the same model trained in float32 by plain optax (the losses), the
parameters of the step before a skipped one (bitwise), Equinox's own
``filter_jit`` step without autocast, and compile counts.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite.testing import assert_trees_bitwise_equal, count_compilations

POLICY = "p=f32,c=bf16,o=f32"


def _data(n=64, d=8):
  x = jax.random.normal(jax.random.key(1), (n, d))
  w = jax.random.normal(jax.random.key(2), (d, 1))
  return x, jnp.tanh(x @ w)


def _loss(params, static, x, y):
  model = eqx.combine(params, static)
  # The output in the compute dtype: the loss in float32.
  return jnp.mean((jax.vmap(model)(x).astype(jnp.float32) - y) ** 2)


def _train(policy, steps=60, poison_at=None):
  """The README's step: partition, then MindSpore's flow (value_and_grad,
  adjust, select_tree) with the loss scale carried beside the state."""
  model = eqx.nn.MLP(8, 1, 32, 2, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  tx = optax.sgd(0.1)
  opt_state = tx.init(params)
  loss_scale = jmp_lite.DynamicLossScale(2.0 ** 15)
  policy = None if policy is None else jmp_lite.get_policy(policy)

  @eqx.filter_jit
  def step(params, opt_state, loss_scale, x, y, factor):
    if policy is not None:
      x = policy.cast_to_compute(x)  # only the differentiated arguments are cast
    loss, grads, finite = jmp_lite.value_and_grad(
        lambda p: _loss(p, static, x, y) * factor, policy=policy)(
            params, loss_scale=loss_scale)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    params, opt_state = jmp_lite.select_tree(
        finite, (eqx.apply_updates(params, updates), new_opt_state), (params, opt_state))
    return params, opt_state, loss_scale.adjust(finite), loss

  x, y = _data()
  factors = [jnp.float32(1e30 if i == poison_at else 1.0) for i in range(steps)]
  losses, history = [], []
  with count_compilations() as compiles:
    for factor in factors:
      history.append(params)
      params, opt_state, loss_scale, loss = step(params, opt_state, loss_scale, x, y, factor)
      losses.append(float(loss))
  return losses, params, history, loss_scale, compiles


def _plain_f32(steps=60):
  model = eqx.nn.MLP(8, 1, 32, 2, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  tx = optax.sgd(0.1)
  opt_state = tx.init(params)

  @eqx.filter_jit
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(_loss)(params, static, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return eqx.apply_updates(params, updates), opt_state, loss

  x, y = _data()
  losses = []
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state, x, y)
    losses.append(float(loss))
  return losses


def test_an_equinox_mlp_trains_under_a_bf16_policy_as_in_float32():
  want = _plain_f32()
  losses, params, _, _, compiles = _train(POLICY)
  assert want[-1] < 0.5 * want[0]
  np.testing.assert_allclose(losses, want, rtol=0.05)  # bf16 products, f32 sums
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  assert len(compiles) == 1  # the loss scale moves without recompiling


def test_an_overflowing_step_is_skipped_and_keeps_every_parameter():
  losses, params, history, loss_scale, _ = _train("p=f32,c=f16,o=f32", steps=6, poison_at=3)
  after_skip = _train("p=f32,c=f16,o=f32", steps=4, poison_at=3)
  assert_trees_bitwise_equal(after_skip[1], history[3])  # the step before the poison
  assert float(after_skip[3].loss_scale) == 2.0 ** 14  # backed off once
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))
  assert np.isfinite(losses[4:]).all()


def test_batchnorm_state_is_kept_on_a_skipped_step():
  """The forward pass writes ``eqx.nn.State`` before the skip is known: the
  README's recipe selects the old state with the guard's flag."""
  model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, axis_name="batch", mode="batch")
  params, static = eqx.partition(model, eqx.is_inexact_array)
  tx = jmp_lite.optax.with_loss_scale(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0 ** 15))
  opt_state = tx.init(params)

  @eqx.filter_jit
  def step(params, state, opt_state, x):
    def loss_fn(p, state):
      out, new_state = jax.vmap(eqx.combine(p, static), axis_name="batch",
                                in_axes=(0, None), out_axes=(0, None))(x, state)
      return jnp.mean(out ** 2), new_state
    scale = jmp_lite.optax.get_loss_scale(opt_state)
    # with_loss_scale takes the gradients of the scaled loss (it unscales them).
    grads, new_state = jax.grad(lambda p: (lambda l, s: (scale.scale(l), s))(
        *loss_fn(p, state)), has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    state = jmp_lite.select_tree(opt_state.skipped, state, new_state)
    return eqx.apply_updates(params, updates), state, opt_state

  x = jax.random.normal(jax.random.key(0), (16, 4))
  params, state, opt_state = step(params, state, opt_state, x)
  before = state
  params, state, opt_state = step(params, state, opt_state, x.at[0, 0].set(jnp.inf))
  assert bool(opt_state.skipped)
  assert_trees_bitwise_equal(state, before)


def test_a_choice_by_dtype_is_refused_on_a_filtered_equinox_model():
  """``eqx.filter`` leaves None where a leaf is not an array: the refusal of
  a mask by dtype was skipped past them (Kahan applied to nothing)."""
  model = eqx.nn.Sequential([eqx.nn.Lambda(jnp.tanh), eqx.nn.Linear(4, 4, use_bias=False, key=jax.random.key(0))])
  params = eqx.filter(jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x)
                                   else x, model), eqx.is_inexact_array)
  mask = lambda p: jax.tree.map(lambda x: x.dtype == jnp.bfloat16, p)
  inner = optax.chain(optax.sgd(1e-3), optax.masked(jmp_lite.optax.kahan_summation(), mask))
  with pytest.raises(ValueError, match="chooses parameters by dtype"):
    jmp_lite.optax.with_loss_scale(inner, jmp_lite.NoOpLossScale()).init(params)


def test_an_autocast_step_returns_the_equinox_model():
  """autocast took an Equinox model (functions among its leaves) as an
  argument but not as a result: ``filter_jit(autocast(step))`` raised."""
  model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
  x = jnp.ones((3, 4))

  def sgd_step(m, x):
    g = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(m)
    return eqx.apply_updates(m, jax.tree.map(lambda g: -0.1 * g, g))

  want = eqx.filter_jit(sgd_step)(model, x)
  got = eqx.filter_jit(jmp_lite.autocast(sgd_step, jnp.bfloat16))(model, x)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert got.activation is want.activation
  for a, b in zip(jax.tree.leaves(eqx.filter(got, eqx.is_array)),
                  jax.tree.leaves(eqx.filter(want, eqx.is_array))):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-3)
