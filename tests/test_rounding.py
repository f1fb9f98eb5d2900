"""Tests of jmp_lite.rounding: stochastic_round, kahan_summation, with_state_dtype."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite import optax as jo
from jmp_lite.testing import assert_trees_bitwise_equal

JIT = pytest.mark.parametrize("jit", [True, False], ids=["jit", "nojit"])
LOW = pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])


def _maybe_jit(f, jit):
  return jax.jit(f) if jit else f


def _apply(params, updates):
  # bf16 params + f32 updates: standard promotion, as documented.
  with jax.numpy_dtype_promotion("standard"):
    return optax.apply_updates(params, updates)


def _ulp(x, dtype):
  x = jnp.asarray(x, dtype)
  return np.abs(np.asarray(jnp.nextafter(x, jnp.asarray(jnp.inf, dtype)), np.float32)
                - np.asarray(x, np.float32))


@JIT
@LOW
def test_stochastic_round_is_unbiased_and_within_one_ulp(jit, dtype):
  n = 40_000
  base = np.float32(1.0 + 3 * 2.0 ** -7)  # exactly representable in both dtypes
  delta = np.float32(0.3 * float(_ulp(base, dtype)))
  params = {"w": jnp.full((n,), base, dtype)}
  tx = jo.stochastic_round(jax.random.key(1))
  updates, state = _maybe_jit(tx.update, jit)({"w": jnp.full((n,), delta)}, tx.init(params), params)
  assert updates["w"].dtype == jnp.float32
  new = _apply(params, updates)["w"]
  assert new.dtype == dtype
  new32 = np.asarray(new, np.float32)
  exact = np.float32(base + delta)
  # Every draw is one of the two neighbours of the exact value.
  assert np.all(np.abs(new32 - exact) <= _ulp(exact, dtype))
  assert set(np.unique(new32)) <= {float(jnp.asarray(exact, dtype).astype(jnp.float32)),
                                   float(base), float(base + _ulp(base, dtype))}
  # Unbiased: mean within 5 standard errors of the exact sum.
  gap = float(_ulp(base, dtype))
  p = float(delta) / gap
  stderr = gap * np.sqrt(p * (1 - p) / n)
  assert abs(new32.mean() - exact) < 5 * stderr
  # The emitted update lands exactly: p + u == new in float32.
  np.testing.assert_array_equal(
      np.asarray(params["w"], np.float32) + np.asarray(updates["w"]), new32)
  assert not np.array_equal(np.asarray(state.key),
                            np.asarray(jax.random.key_data(jax.random.key(1))))


def test_stochastic_round_is_deterministic_given_the_key_and_skips_f32():
  params = {"w": jnp.ones(64, jnp.bfloat16), "f": jnp.ones(3, jnp.float32)}
  grads = {"w": jnp.full(64, 1e-3), "f": jnp.full(3, 1e-3)}
  tx = jo.stochastic_round(jax.random.key(7))
  u1, s1 = tx.update(grads, tx.init(params), params)
  u2, _ = tx.update(grads, tx.init(params), params)
  u3, _ = tx.update(grads, s1, params)
  np.testing.assert_array_equal(u1["w"], u2["w"])
  assert not np.array_equal(u1["w"], u3["w"])  # the key advanced
  np.testing.assert_array_equal(u1["f"], grads["f"])  # float32 params: untouched


@JIT
@LOW
def test_kahan_tracks_a_long_sum_of_tiny_updates_where_naive_stalls(jit, dtype):
  steps, tiny = 2000, np.float32(1e-4)
  params = {"w": jnp.ones((4,), dtype)}
  naive = dict(params)
  tx = jo.kahan_summation()
  state = tx.init(params)
  update = _maybe_jit(tx.update, jit)
  grads = {"w": jnp.full((4,), tiny)}
  exact = np.float32(1.0)
  for _ in range(steps):
    updates, state = update(grads, state, params)
    params = _apply(params, updates)
    naive = _apply(naive, grads)
    exact = exact + tiny
  got = np.asarray(params["w"], np.float32)
  assert np.all(np.abs(got - exact) <= _ulp(exact, dtype))
  assert state.compensation["w"].dtype == dtype
  if dtype == jnp.bfloat16:  # 1 + 1e-4 rounds back to 1 in bfloat16
    np.testing.assert_array_equal(np.asarray(naive["w"], np.float32), 1.0)


def _kahan_10k(tx, steps=10_000, tiny=1e-4):
  """``steps`` updates of ``tiny`` onto a bfloat16 1.0 (``sgd(1.0)`` of
  ``-tiny`` where ``tx`` has an optimizer first): (params, state)."""
  params = {"w": jnp.ones((4,), jnp.bfloat16)}
  grads = {"w": jnp.full((4,), np.float32(tiny))}

  def body(_, carry):
    params, state = carry
    updates, state = tx.update(grads, state, params)
    return _apply(params, updates), state

  return jax.jit(lambda p, s: jax.lax.fori_loop(0, steps, body, (p, s)))(
      params, tx.init(params))


def _comp(state):
  return next(s for s in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, jo.KahanState))
              if isinstance(s, jo.KahanState)).compensation["w"]


# The exact sum, in float64: 1 + 10,000 float32(1e-4) = 1.99999997..., whose
# nearest bfloat16 is 2.0.
_EXACT_10K = 1.0 + 10_000 * float(np.float32(1e-4))


def test_kahan_float32_compensation_follows_the_float32_sum_over_10k_steps():
  """Found by a user: the docstring promised the float32 sum for the default
  (bfloat16) compensation, which drifts 4 ulps over this run; a float32
  compensation holds it, as now documented."""
  params, state = _kahan_10k(jo.kahan_summation(jnp.float32))
  assert _comp(state).dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(params["w"], np.float64), 2.0)
  total = np.asarray(params["w"], np.float64) + np.asarray(_comp(state), np.float64)
  np.testing.assert_allclose(total, _EXACT_10K, rtol=0, atol=1e-5)


def test_kahan_default_compensation_drifts_as_documented_and_within_its_bound():
  """bfloat16 compensation: each step may lose 2**-9 of the parameter's ulp
  (2**-6 here), so at most n / 512 ulps after n steps; the docstring's run
  ends at 2.03125."""
  params, state = _kahan_10k(jo.kahan_summation())
  assert _comp(state).dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(params["w"], np.float64), 2.03125)
  total = np.asarray(params["w"], np.float64) + np.asarray(_comp(state), np.float64)
  assert np.all(np.abs(total - _EXACT_10K) <= 10_000 / 512 * 2.0 ** -6)


def test_with_state_dtype_keeps_the_compensation_dtype_kahan_was_given():
  """Found by a user: ``with_state_dtype(..., bfloat16)`` stored a
  ``kahan_summation(jnp.float32)`` compensation inside it in bfloat16, and the
  run drifted as the default's does."""
  tx = jo.with_state_dtype(
      optax.chain(optax.sgd(-1.0), jo.kahan_summation(jnp.float32)), jnp.bfloat16)
  assert _comp(tx.init({"w": jnp.ones((4,), jnp.bfloat16)})).dtype == jnp.float32
  params, state = _kahan_10k(tx)
  assert _comp(state).dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(params["w"], np.float64), 2.0)
  # The moments-like state around it is still stored in bfloat16: the
  # default compensation inside takes the parameter's dtype, as outside.
  tx = jo.with_state_dtype(optax.chain(optax.trace(0.0), jo.kahan_summation()),
                           jnp.float16)
  state = tx.init({"w": jnp.ones((4,), jnp.bfloat16)})
  assert state[0].trace["w"].dtype == jnp.float16
  assert _comp(state).dtype == jnp.bfloat16


def test_stochastic_round_tracks_the_same_long_sum_on_average():
  n, steps, tiny = 4096, 500, np.float32(1e-4)
  params = {"w": jnp.ones((n,), jnp.bfloat16)}
  tx = jo.stochastic_round(jax.random.key(3))
  state = tx.init(params)
  update = jax.jit(tx.update)
  grads = {"w": jnp.full((n,), tiny)}
  for _ in range(steps):
    updates, state = update(grads, state, params)
    params = _apply(params, updates)
  mean = float(np.asarray(params["w"], np.float32).mean())
  np.testing.assert_allclose(mean, 1.0 + steps * float(tiny), rtol=2e-3)


@JIT
@pytest.mark.parametrize("inner", [
    lambda: optax.adam(1e-3), lambda: optax.sgd(1e-2, momentum=0.9),
    lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)])
def test_with_state_dtype_keeps_state_dtypes_across_updates(jit, inner):
  params = {"w": jnp.ones((5, 3), jnp.bfloat16), "b": jnp.zeros((3,), jnp.bfloat16)}
  tx = jo.with_state_dtype(inner(), jnp.bfloat16)
  state0 = state = tx.init(params)
  update = _maybe_jit(tx.update, jit)
  with jax.numpy_dtype_promotion("standard"):  # optax's Adam: b1 ** count
    for _ in range(3):
      updates, state = update(jax.tree.map(lambda p: jnp.ones(p.shape, jnp.float32), params),
                              state, params)
  chex.assert_trees_all_equal_dtypes(state, state0)
  arrays = [x for x in jax.tree.leaves(state) if x.ndim >= 1]
  assert arrays and all(x.dtype == jnp.bfloat16 for x in arrays)
  assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(updates))
  # Scalars (inject_hyperparams' hyperparameters) keep the dtype inner gave them.
  scalar_dtypes = lambda s: [x.dtype for x in jax.tree.leaves(s) if x.ndim == 0]
  assert scalar_dtypes(state) == scalar_dtypes(inner().init(params))


def test_with_state_dtype_rejects_non_floating():
  with pytest.raises(ValueError, match="int32"):
    jo.with_state_dtype(optax.sgd(0.1), jnp.int32)


@pytest.mark.parametrize("make", [lambda: jo.stochastic_round(jax.random.key(0)),
                                  lambda: jo.kahan_summation()])
def test_skipped_steps_do_not_advance_the_key_or_change_the_buffer(make):
  params = {"w": jnp.ones(8, jnp.bfloat16)}
  tx = jo.with_loss_scale(optax.chain(optax.sgd(1e-3), make()),
                          jmp_lite.StaticLossScale(2.0))
  state = tx.init(params)
  update = jax.jit(tx.update)
  updates, state = update({"w": jnp.full(8, 2.0, jnp.bfloat16)}, state, params)
  params = _apply(params, updates)
  inner_before = jo.find_loss_scale_state(state).inner_state
  poisoned = {"w": jnp.full(8, 2.0, jnp.bfloat16).at[3].set(jnp.nan)}
  updates, state = update(poisoned, state, params)
  assert bool(jo.find_loss_scale_state(state).skipped)
  assert_trees_bitwise_equal(jo.find_loss_scale_state(state).inner_state, inner_before)
  assert_trees_bitwise_equal(_apply(params, updates), params)


def test_rounding_transforms_need_params():
  for tx in (jo.stochastic_round(jax.random.key(0)), jo.kahan_summation()):
    with pytest.raises(ValueError, match="needs params"):
      tx.update({"w": jnp.ones(1)}, tx.init({"w": jnp.ones(1)}))


@pytest.mark.parametrize("make", [jo.kahan_summation, lambda: jo.stochastic_round(jax.random.key(0))])
def test_parameters_held_in_tuples_get_their_own_updates(make):
  """Kahan split its (update, compensation) pairs with ``isinstance(x,
  tuple)``, which also matched a parameter tree's own tuples: with params
  ``(w, b)``, ``b`` received ``w``'s compensation instead of its update.
  Oracle: the same parameters held in a dict, leaf for leaf."""
  w, b = jnp.ones((2,), jnp.bfloat16), jnp.full((2,), 2.0, jnp.bfloat16)
  g = (jnp.full((2,), 1e-3, jnp.float32), jnp.full((2,), 5.0, jnp.float32))
  tx = make()
  # Keys in the tuple's leaf order: stochastic rounding draws per leaf.
  as_dict, _ = tx.update({"a": g[0], "b": g[1]}, tx.init({"a": w, "b": b}), {"a": w, "b": b})
  as_tuple, _ = tx.update(g, tx.init((w, b)), (w, b))
  assert jax.tree.structure(as_tuple) == jax.tree.structure((w, b))
  assert_trees_bitwise_equal(as_tuple, (as_dict["a"], as_dict["b"]))
  nested = ((w, (b,)), [w])
  updates, _ = tx.update(((g[0], (g[1],)), [g[0]]), tx.init(nested), nested)
  assert jax.tree.structure(updates) == jax.tree.structure(nested)


def _run(tx, params, grad, steps, jit):
  """``steps`` updates of ``tx`` with the constant gradient ``grad`` per leaf."""
  state = tx.init(params)
  update = _maybe_jit(tx.update, jit)
  for _ in range(steps):
    grads = jax.tree.map(lambda p: jnp.full(p.shape, grad, jnp.float32)
                         if jnp.issubdtype(p.dtype, jnp.floating) else p, params)
    updates, state = update(grads, state, params)
    params = _apply(params, updates)
  return params, state


ROUNDERS = pytest.mark.parametrize(
    "rounder", [jo.kahan_summation, lambda: jo.stochastic_round(jax.random.key(0))],
    ids=["kahan", "sr"])


def _tracks_float64(w, steps, lr_times_grad):
  """Oracle: the float64 sum of the updates, within 10% of the total move
  (stochastic rounding's mean over 256 elements is within ~3%); round to
  nearest stalls at 1.0, as each 1e-3 is below half a bfloat16 ulp."""
  exact = 1.0 + steps * lr_times_grad
  got = float(np.mean(np.asarray(w, np.float64)))
  assert abs(got - exact) < 0.1 * steps * lr_times_grad, (got, exact)


@JIT
@ROUNDERS
def test_an_integer_leaf_in_the_params_leaves_rounding_on(rounder, jit):
  """``with_loss_scale`` gives the optimizer inside None for integer leaves,
  so its tree was no longer the stored one and the rounding transforms
  silently took the float32 copies for the parameters: bfloat16 ``w`` stayed
  exactly 1.0."""
  params = {"w": jnp.ones(256, jnp.bfloat16), "n": jnp.zeros((), jnp.int32),
            "on": jnp.array(True)}
  tx = jo.with_loss_scale(optax.chain(optax.sgd(1.0), rounder()), jmp_lite.NoOpLossScale())
  out, _ = _run(tx, params, -1e-3, 100, jit)
  _tracks_float64(out["w"], 100, 1e-3)
  assert out["w"].dtype == jnp.bfloat16 and out["n"].dtype == jnp.int32


@ROUNDERS
@pytest.mark.parametrize("guard", [False, True])
@pytest.mark.parametrize("split", ["masked", "multi_transform"])
def test_rounding_inside_part_of_the_tree_rounds_that_part(rounder, guard, split):
  """Under ``with_loss_scale`` a rounding transform given part of the
  parameters (``optax.masked``, ``optax.multi_transform``) did nothing: the
  part was not the whole stored tree."""
  params = {"w": jnp.ones(64, jnp.bfloat16), "b": jnp.ones(3, jnp.bfloat16)}
  rounded = optax.chain(optax.sgd(1.0), rounder())
  if split == "masked":
    tx = optax.chain(optax.masked(rounded, {"w": True, "b": False}),
                     optax.masked(optax.sgd(1.0), {"w": False, "b": True}))
  else:
    tx = optax.multi_transform({"a": rounded, "b": optax.sgd(1.0)}, {"w": "a", "b": "b"})
  if guard:
    tx = jo.with_loss_scale(tx, jmp_lite.NoOpLossScale())
  out, _ = _run(tx, params, -1e-3, 100, jit=True)
  _tracks_float64(out["w"], 100, 1e-3)
  np.testing.assert_array_equal(np.asarray(out["b"], np.float32), 1.0)  # plain sgd stalls


@pytest.mark.parametrize("split", ["masked", "multi_transform"])
def test_a_choice_by_dtype_inside_the_guard_is_refused(split):
  """The guard's inner optimizer sees float32 copies of 16-bit parameters,
  so "Kahan for the bf16 leaves" by a label or mask reading ``x.dtype``
  selected nothing: the bf16 leaf trained without it and stayed at 1.0
  where plain optax reaches 1.1. Labels computed once from the stored
  parameters and passed as a tree are the way, and match plain optax."""
  params = {"w": jnp.ones(4, jnp.bfloat16), "b": jnp.ones(4, jnp.float32)}
  low = lambda p: jax.tree.map(lambda x: x.dtype == jnp.bfloat16, p)
  label = lambda p: jax.tree.map(lambda x: "low" if x.dtype == jnp.bfloat16 else "high", p)
  kahan = optax.chain(optax.sgd(1e-3), jo.kahan_summation())

  def make(choose):
    if split == "masked":  # (``b`` gets the raw gradient: only ``w`` is checked)
      return optax.masked(kahan, low if choose else low(params))
    return optax.multi_transform({"low": kahan, "high": optax.sgd(1e-3)},
                                 label if choose else label(params))

  with pytest.raises(ValueError, match="chooses parameters by dtype"):
    jo.with_loss_scale(make(True), jmp_lite.NoOpLossScale()).init(params)
  # The oracle: plain optax, its gradients in the parameters' dtypes (optax
  # labels the updates again on every step, by their dtypes).
  tx, p = make(True), params
  state, update = tx.init(p), jax.jit(tx.update)
  for _ in range(100):
    updates, state = update(jax.tree.map(lambda x: jnp.full_like(x, -1.0), p), state, p)
    p = _apply(p, updates)
  guarded, _ = _run(jo.with_loss_scale(make(False), jmp_lite.NoOpLossScale()),
                    params, -1.0, 100, jit=True)
  assert float(p["w"][0]) == float(guarded["w"][0]) == 1.1015625  # Kahan: 1 + 100e-3
  assert guarded["w"].dtype == jnp.bfloat16


def test_a_choice_by_dtype_is_refused_past_none_and_function_leaves():
  """Equinox's filtered models hold None (and a whole model, functions) among
  their leaves. The check paired the parameters' leaves, without the Nones,
  with the copies' leaves, with them: past a None the pairs shifted, so a
  mask by dtype was accepted and Kahan applied to nothing, and a None before
  a function leaf raised a bare ``AttributeError`` at ``init``."""
  mask = lambda p: jax.tree.map(lambda x: x.dtype == jnp.bfloat16, p)
  inner = optax.chain(optax.sgd(1e-3), optax.masked(jo.kahan_summation(), mask))
  for params in ({"a": None, "b": jnp.ones(3, jnp.bfloat16)},
                 {"a": None, "b": jnp.ones(3, jnp.bfloat16), "c": jax.nn.relu}):
    with pytest.raises(ValueError, match="chooses parameters by dtype"):
      jo.with_loss_scale(inner, jmp_lite.NoOpLossScale()).init(params)
  # No choice by dtype: taken, and the step is plain optax's on the array.
  params = {"a": None, "b": jnp.ones(3), "c": jax.nn.relu}
  tx = jo.with_loss_scale(optax.sgd(0.1, momentum=0.9), jmp_lite.NoOpLossScale())
  state = tx.init(params)
  grads = {"a": None, "b": jnp.full(3, 0.5), "c": None}
  # ``eqx.filter(model, eqx.is_array)``: what Equinox passes to ``update``.
  updates, _ = tx.update(grads, state, {"a": None, "b": params["b"], "c": None})
  plain = optax.sgd(0.1, momentum=0.9)
  want, _ = plain.update({"b": grads["b"]}, plain.init({"b": params["b"]}))
  np.testing.assert_array_equal(updates["b"], want["b"])


@ROUNDERS
@pytest.mark.parametrize("guard", [False, True])
def test_rounding_inside_with_state_dtype_rounds_the_stored_params(rounder, guard):
  """``with_state_dtype`` widens the parameters for the optimizer inside: a
  rounding transform there saw float32 parameters and passed the updates
  through, and bfloat16 ``w`` stayed 1.0."""
  params = {"w": jnp.ones(256, jnp.bfloat16)}
  tx = jo.with_state_dtype(optax.chain(optax.sgd(1.0), rounder()), jnp.bfloat16)
  if guard:
    tx = jo.with_loss_scale(tx, jmp_lite.NoOpLossScale())
  out, state = _run(tx, params, -1e-3, 100, jit=True)
  _tracks_float64(out["w"], 100, 1e-3)


def test_with_state_dtype_keeps_a_prng_key_eagerly():
  """Storing the state back cast every leaf, a PRNG key too: eagerly,
  ``NotImplementedError: Cannot call abstract method astype``."""
  params = {"w": jnp.ones(8, jnp.bfloat16)}
  tx = jo.with_state_dtype(optax.chain(optax.sgd(1e-3, momentum=0.9),
                                       jo.stochastic_round(jax.random.key(0))),
                           jnp.bfloat16)
  state = tx.init(params)
  eager = tx.update({"w": jnp.ones(8)}, state, params)
  jitted = jax.jit(tx.update)({"w": jnp.ones(8)}, state, params)
  data = lambda tree: jax.tree.map(
      lambda x: jax.random.key_data(x)
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x, tree)
  assert_trees_bitwise_equal(data(eager), data(jitted))


@pytest.mark.parametrize("dtype", ["bogus", jnp.int32, jnp.bool_])
def test_kahan_refuses_a_compensation_dtype_that_is_not_floating(dtype):
  """``kahan_summation(jnp.bool_)`` added 1 to the parameter on every step;
  ``int32`` stalled it."""
  with pytest.raises(ValueError, match="kahan_summation"):
    jo.kahan_summation(dtype)


def test_with_state_dtype_refuses_none():
  with pytest.raises(ValueError, match="None"):
    jo.with_state_dtype(optax.sgd(0.1), None)


def test_a_narrower_compensation_saturates_instead_of_holding_inf():
  """A float16 compensation of a bfloat16 parameter near 1e8 (whose ulp is
  5e5): the lost part saturates at 65504, it does not become inf."""
  params = {"w": jnp.full(4, 1e8, jnp.bfloat16)}
  tx = jo.kahan_summation(jnp.float16)
  updates, state = tx.update({"w": jnp.full(4, 1e5)}, tx.init(params), params)
  assert np.all(np.isfinite(np.asarray(state.compensation["w"], np.float32)))
  assert np.all(np.isfinite(np.asarray(updates["w"])))


@pytest.mark.parametrize("x", [2.0 ** -126 * (1 + 2 ** -8), 2.0 ** -125 * (1 + 2 ** -8),
                               2.0 ** -100 * (1 + 2 ** -8)])
def test_stochastic_round_is_unbiased_in_the_lowest_binades(x):
  """Halfway between two bfloat16 neighbours near float32's smallest normal:
  the gap (2**-133) is a float32 subnormal, which XLA flushes, and the
  rounding was always to nearest (P(up) = 0 instead of 1/2). Oracle: the
  definition (P(up) = distance to the lower neighbour / gap), binomial
  bounds for 4000 draws."""
  from jmp_lite.rounding import _stochastic_round
  x = np.float32(x)
  keys = jax.random.split(jax.random.key(0), 4000)
  out = np.asarray(jax.jit(jax.vmap(
      lambda k: _stochastic_round(jnp.full((1,), x), jnp.bfloat16, k)))(keys), np.float32)[:, 0]
  assert set(np.unique(out)) <= {np.float32(jnp.bfloat16(x)), np.float32(
      jnp.nextafter(jnp.bfloat16(x), jnp.bfloat16(1)))}
  assert abs(np.mean(out > x) - 0.5) < 4 * np.sqrt(0.25 / 4000)


def test_a_stochastic_rounding_state_round_trips_through_flax_serialization():
  """The README's recipe (``stochastic_round(jax.random.key(0))``) held a
  typed key, which ``flax.serialization.to_bytes`` refuses; the README said
  the optimizer state round-trips through it. Oracle: the run that was not
  interrupted."""
  import flax.serialization
  params = {"w": jnp.ones(64, jnp.bfloat16)}
  tx = jo.with_loss_scale(optax.chain(optax.sgd(1.0), jo.stochastic_round(jax.random.key(0))),
                          jmp_lite.NoOpLossScale())
  _, state = _run(tx, params, -1e-3, 3, jit=True)
  restored = flax.serialization.from_bytes(tx.init(params), flax.serialization.to_bytes(state))
  assert_trees_bitwise_equal(restored, state)
  grads = {"w": jnp.full(64, -1e-3)}
  assert_trees_bitwise_equal(jax.jit(tx.update)(grads, restored, params),
                             jax.jit(tx.update)(grads, state, params))


@ROUNDERS
def test_bad_input_is_named_by_its_path(rounder):
  """Mismatched trees, shapes and dtypes raised JAX's or optax's generic
  errors ("Dict key mismatch", "incompatible shapes"), a Python float
  parameter an AttributeError, and an integer update for a bfloat16
  parameter was accepted."""
  tx = rounder()
  params = {"a": {"w": jnp.ones(4, jnp.bfloat16)}}
  state = tx.init(params)
  cases = [
      ({"a": {"v": jnp.ones(4)}}, params, ValueError, "differ in structure"),
      ({"a": {"w": jnp.ones(3)}}, params, ValueError, r"\['a'\]\['w'\].*\[3\]"),
      ({"a": {"w": jnp.ones(4, jnp.int32)}}, params, TypeError, r"\['a'\]\['w'\] is int32"),
  ]
  for updates, p, error, match in cases:
    with pytest.raises(error, match=match):
      tx.update(updates, state, p)
  if isinstance(state, jo.KahanState):
    with pytest.raises(TypeError, match=r"\['b'\] is 1.5"):
      tx.init({"b": 1.5})
    wrong = tx.init({"a": {"w": jnp.ones(4, jnp.float32)}})  # made for float32 params
    with pytest.raises(ValueError, match=r"compensation \['a'\]\['w'\].*init\(params\)"):
      tx.update({"a": {"w": jnp.ones(4)}}, wrong, params)


@ROUNDERS
def test_inside_apply_if_finite_with_16_bit_updates_the_error_says_what_to_do(rounder):
  """The rounding transforms emit float32 updates; apply_if_finite's skip
  branch returns zeros in the updates' dtype, and with bfloat16 gradients
  its ``cond`` failed with optax's ``cond branches must have equal output
  types``. Float32 gradients are fine, and so is apply_if_finite inside."""
  params = {"w": jnp.ones(4, jnp.bfloat16)}
  outside = optax.apply_if_finite(optax.chain(optax.sgd(1e-3), rounder()), 3)
  state = outside.init(params)
  with pytest.raises(ValueError, match="inside optax.apply_if_finite with bfloat16 updates"):
    jax.jit(outside.update)({"w": jnp.ones(4, jnp.bfloat16)}, state, params)
  jax.jit(outside.update)({"w": jnp.ones(4, jnp.float32)}, state, params)
  inside = optax.chain(optax.apply_if_finite(optax.sgd(1e-3), 3), rounder())
  state, p = inside.init(params), params
  for bad in (False, True, False):
    grads = {"w": jnp.full(4, jnp.nan if bad else -1.0, jnp.bfloat16)}
    updates, state = jax.jit(inside.update)(grads, state, p)
    new = jo.apply_updates(p, updates)
    if bad:  # skipped: nothing moves
      assert_trees_bitwise_equal(new, p)
    p = new
