"""Large arrays are checked on a copy of the step (`jmp_lite._checks.COPY_FROM`).

`with_loss_scale` computes the step once for what it writes and, for arrays
of `COPY_FROM` elements or more, once more from the same inputs behind an
``optimization_barrier`` for its check, so that XLA need not keep the results
in memory for the check. The oracles: plain optax steps (applied steps), the
inputs (skipped steps), the same step checked on its results (every flag and
bit), and XLA's own memory analysis of the unchecked step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite import _checks
from jmp_lite import optax as jo
from jmp_lite.testing import assert_trees_bitwise_equal
from jaxprs import equations

N = _checks.COPY_FROM
SCALE = 2.0


def _params(dtype, big=N):
  return {"big": jnp.linspace(-1.0, 1.0, big, dtype=jnp.float32).astype(dtype),
          "small": jnp.linspace(0.5, -0.5, 8, dtype=jnp.float32).astype(dtype)}


def _grads(params, step, fault=None):
  key = jax.random.key(step)
  grads = {k: (jax.random.normal(jax.random.fold_in(key, i), v.shape) * 0.1).astype(v.dtype)
           for i, (k, v) in enumerate(sorted(params.items()))}
  if fault is not None:
    name, index, value = fault
    grads[name] = grads[name].at[index].set(value)
  return grads


def _barriers(fn, *args) -> int:
  return sum(eqn.primitive.name == "optimization_barrier"
             for eqn in equations(jax.make_jaxpr(fn)(*args).jaxpr))


@pytest.mark.usefixtures("standard_promotion")  # optax's Adam: b1 ** count
def test_only_a_step_with_large_arrays_computes_a_copy():
  tx = jo.with_loss_scale(optax.adam(1e-3), jmp_lite.StaticLossScale(SCALE))
  for big, barriers in ((N, 1), (N - 1, 0)):
    params = _params(jnp.float32, big)
    update = lambda g, s, p: tx.update(g, s, p)
    assert _barriers(update, params, tx.init(params), params) == barriers, big
  # The gradients-only check has no results to check.
  gradients_only = jo._with_loss_scale(  # pylint: disable=protected-access
      optax.adam(1e-3), jmp_lite.StaticLossScale(SCALE), clip_norm=None,
      accumulate_steps=1, axis_name=None, check_results=False)
  params = _params(jnp.float32)
  assert _barriers(gradients_only.update, params, gradients_only.init(params), params) == 0


@pytest.mark.usefixtures("standard_promotion")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_checked_step_needs_no_memory_beyond_the_unchecked_one(dtype, monkeypatch):
  """XLA's temporaries for a donated Adam step over 8 arrays of 2 * COPY_FROM
  elements: the same as the gradients-only step's. Checked on its results,
  the step needs more (the updates and the new state, kept for the check)."""
  params = {f"w{i}": jax.ShapeDtypeStruct((2 * N,), dtype) for i in range(8)}
  ls = jmp_lite.StaticLossScale(SCALE)

  def temp_bytes(tx):
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return jo.apply_updates(params, updates), state
    state = jax.eval_shape(tx.init, params)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  gradients_only = temp_bytes(jo._with_loss_scale(  # pylint: disable=protected-access
      optax.adam(1e-3), ls, clip_norm=None, accumulate_steps=1, axis_name=None,
      check_results=False))
  copied = temp_bytes(jo.with_loss_scale(optax.adam(1e-3), ls))
  monkeypatch.setattr(_checks, "COPY_FROM", 10 ** 12)  # check the results
  on_results = temp_bytes(jo.with_loss_scale(optax.adam(1e-3), ls))
  # XLA:GPU writes the checks' per-element flags of a group of same-shape
  # arrays (a byte per element and flag) before reducing them: on an H200,
  # 527,592 bytes more than gradients-only, under one float32 array of
  # the 8 that checking the results keeps.
  extra = 0 if jax.default_backend() == "cpu" else 2 * N * 4 * 1.01
  assert copied <= gradients_only + extra, (copied, gradients_only)
  # At least one array-sized result per array, kept for the check.
  assert on_results >= gradients_only + 8 * 2 * N * 4, (on_results, gradients_only)


# Unscaled gradients, at steps 1, 3 and 4.
_FAULTS = {
    1: ("big", 5, jnp.nan),   # the gradients: skipped, a dynamic scale halves
    3: ("big", N - 1, 1e4),   # finite, but p - 8e4 overflows float16 there
    4: ("small", 2, -jnp.inf),
}


def _sgd():
  """A step that can overflow a parameter, and a state (the momentum)."""
  return optax.sgd(8.0, momentum=0.5)


def _trajectory(dtype, make_tx, steps=6):
  params = _params(dtype)
  tx = make_tx()
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: (lambda u, s: (jo.apply_updates(p, u), s))(
      *tx.update(g, s, p)))
  out = []
  for t in range(steps):
    scale = jo.get_loss_scale(state)
    grads = scale.scale(_grads(params, t, _FAULTS.get(t)))
    params, state = step(params, state, grads)
    out.append((params, state))
  return out


@pytest.mark.usefixtures("standard_promotion")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_the_copy_decides_as_the_results_do_bit_for_bit(dtype, monkeypatch):
  """Six steps with faults in the gradients and a finite update that
  overflows a float16 parameter: every parameter, state leaf and flag is the
  same bits whether the step is checked on a copy or on its results."""
  make = lambda: jo.with_loss_scale(_sgd(), jmp_lite.DynamicLossScale(SCALE))
  copied = _trajectory(dtype, make)
  monkeypatch.setattr(_checks, "COPY_FROM", 10 ** 12)
  on_results = _trajectory(dtype, make)
  # The gradients' norm is a sum, whose order XLA:GPU chooses per program
  # (the two paths differed in its last bit on an H200): bitwise where XLA
  # keeps one order (the CPU), to float32's rounding elsewhere. It decides
  # nothing here (no clipping).
  norms = lambda run: np.array([float(s.grad_norm) for _, s in run])
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(norms(copied), norms(on_results))
  else:
    np.testing.assert_allclose(norms(copied), norms(on_results), rtol=2.0 ** -20)
  without_norm = lambda run: [(p, s._replace(grad_norm=jnp.zeros_like(s.grad_norm)))
                              for p, s in run]
  assert_trees_bitwise_equal(without_norm(copied), without_norm(on_results))
  skipped = [bool(jo.find_loss_scale_state(s).skipped) for _, s in copied]
  # Step 3 overflows only in float16 (bfloat16 and float32 hold -8e4).
  assert skipped == [False, True, False, dtype == jnp.float16, True, False], skipped


@pytest.mark.usefixtures("standard_promotion")
def test_applied_steps_are_optax_and_skipped_steps_write_nothing():
  """float16 parameters, the optimizer on float32 copies: against optax on
  the unscaled float32 gradients for the applied steps, against the inputs
  for the skipped ones."""
  ls = jmp_lite.StaticLossScale(SCALE)
  tx = jo.with_loss_scale(_sgd(), ls)
  ref = _sgd()
  params = _params(jnp.float16)
  state = tx.init(params)
  ref_state = ref.init(jax.tree.map(lambda p: p.astype(jnp.float32), params))
  update = jax.jit(tx.update)
  for t in range(5):
    grads = _grads(params, t, _FAULTS.get(t))
    updates, new_state = update(ls.scale(grads), state, params)
    new_params = jo.apply_updates(params, updates)
    guard = jo.find_loss_scale_state(new_state)
    wide = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    want_updates, want_state = ref.update(wide, ref_state, params)
    want = optax.apply_updates(params, want_updates)
    overflows = not all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(want))
    grads_finite = all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    if grads_finite and not overflows:
      assert not bool(guard.skipped), t
      assert_trees_bitwise_equal(new_params, want)
      ref_state = want_state
    else:
      assert bool(guard.skipped), t
      assert bool(guard.nonfinite.grads) == (not grads_finite), t
      assert bool(guard.nonfinite.params) == (grads_finite and overflows), t
      assert_trees_bitwise_equal(new_params, params)
      assert_trees_bitwise_equal(new_state.inner_state, state.inner_state)
    params, state = new_params, new_state
  assert int(jo.find_loss_scale_state(state).skipped_steps) == 3  # steps 1, 3 and 4


def test_what_a_step_writes_is_finite_even_where_told_to_apply():
  """The writes of copied arrays hold the check's rule element by element: a
  copy XLA rounded differently from the written values could otherwise let a
  non-finite value through. Smaller arrays follow the step's decision."""
  p = jnp.ones(N, jnp.float16).at[0].set(100.0).at[1].set(jnp.inf)
  u = jnp.zeros(N, jnp.float16).at[0].set(65504.0).at[1].set(1.0).at[2].set(jnp.nan)
  old = jnp.zeros(N, jnp.float32).at[4].set(jnp.inf)
  new = jnp.ones(N, jnp.float32).at[3].set(jnp.inf).at[4].set(jnp.nan)
  small = jnp.full(4, jnp.nan, jnp.float32)
  (u_ok, small_ok), (s_ok,) = _checks.written_where(
      jnp.array(True), {"p": u, "q": small}, {"p": p, "q": jnp.ones(4)}, (new,), (old,))
  want = np.ones(N, bool)
  want[[0, 2]] = False  # 100 + 65504 is inf in float16; NaN
  np.testing.assert_array_equal(u_ok, want)  # [1]: p was inf already
  want = np.ones(N, bool)
  want[3] = False  # [4]: was inf already
  np.testing.assert_array_equal(s_ok, want)
  assert small_ok.shape == () and bool(small_ok)
  (u_ok, _), (s_ok,) = _checks.written_where(
      jnp.array(False), {"p": u, "q": small}, {"p": p, "q": jnp.ones(4)}, (new,), (old,))
  assert not bool(jnp.any(u_ok)) and not bool(jnp.any(s_ok))


@pytest.mark.usefixtures("standard_promotion")
def test_an_optimizer_with_a_callback_runs_it_once_and_is_checked_on_its_results():
  """A second copy of the step would run the inner optimizer's callback
  twice: such a step is checked on its results (and still skips)."""
  calls = []

  def update(updates, state, params=None):
    jax.debug.callback(lambda: calls.append(1))
    return updates, state

  noisy = optax.chain(optax.GradientTransformation(lambda p: optax.EmptyState(), update),
                      _sgd())
  tx = jo.with_loss_scale(noisy, jmp_lite.StaticLossScale(SCALE))
  params = _params(jnp.float16)
  step = jax.jit(tx.update)
  assert _barriers(tx.update, params, tx.init(params), params) == 0
  state = tx.init(params)
  for t in (0, 3):  # step 3 overflows a float16 parameter
    updates, state = step(jmp_lite.StaticLossScale(SCALE).scale(_grads(params, t, _FAULTS.get(t))),
                          state, params)
    jax.effects_barrier()
    assert bool(jo.find_loss_scale_state(state).skipped) == (t == 3)
  assert len(calls) == 2
