"""What the guard compiles to, and the inputs it takes or refuses.

The guarded step's reductions are counted in the optimised HLO XLA compiles
(one per distinct shape and check, not one per array), and its results are
checked against plain optax steps and NumPy. Timings live in `bench/`
(section ``compile_time``), not here.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite import optax as jo
from jmp_lite.testing import assert_trees_bitwise_equal, count_compilations
from jaxprs import equations


class _MLP(nn.Module):
  layers: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.layers):
      x = nn.relu(nn.Dense(16)(x))
    return nn.Dense(4)(x)


def _reduce_ops(compiled) -> int:
  return compiled.as_text().count(" reduce(")


@pytest.mark.slow  # compiles steps of up to hundreds of arrays: the heavy tier
@pytest.mark.usefixtures("standard_promotion")  # optax's Adam: b1 ** count
@pytest.mark.parametrize("clip_norm", [None, 1.0])
def test_reductions_do_not_grow_with_the_number_of_arrays(clip_norm):
  """At most 3 reduce ops per parameter array in all, and the guard's own
  (beyond the plain step's, which has one per array from the loss's backward
  pass) under 1.5 per array at 80 arrays, where reducing each array on its
  own took about 16: arrays of a shape are reduced together, 8 at a time
  (`jmp_lite._reduce`)."""
  for layers in (9, 39):
    model = _MLP(layers)
    x = jnp.ones((8, 16))
    params = model.init(jax.random.key(0), x)["params"]
    n = len(jax.tree.leaves(params))
    tx = jo.with_loss_scale(optax.adam(1e-3), jmp_lite.DynamicLossScale(2.0 ** 15),
                            clip_norm=clip_norm)

    def step(params, opt_state):
      scale = jo.get_loss_scale(opt_state)
      grads = jax.grad(lambda p: scale.scale(jnp.mean(model.apply({"params": p}, x) ** 2)))(
          params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return jo.apply_updates(params, updates), opt_state

    def plain(params, opt_state):
      grads = jax.grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)
      updates, opt_state = optax.adam(1e-3).update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    guarded = _reduce_ops(jax.jit(step).lower(params, tx.init(params)).compile())
    baseline = _reduce_ops(jax.jit(plain).lower(
        params, optax.adam(1e-3).init(params)).compile())
    assert guarded <= 3 * n, (n, guarded)
    if n >= 80:
      assert guarded - baseline <= 1.5 * n, (n, guarded, baseline)


def _instructions(compiled) -> int:
  """Instructions in the optimised HLO, fusion bodies included (one per line)."""
  return sum(1 for line in compiled.as_text().splitlines() if " = " in line)


def test_a_decision_read_by_every_array_is_computed_once():
  """`all_finite` + `select_tree` compile to a program linear in the arrays.

  Without the fence in `jmp_lite._reduce`, XLA fused the decision (combined
  from one partial result per 8 arrays) into each array's select: 3,885
  instructions at 100 arrays, 44,301 at 400 (fenced: 1,381 and 5,413).
  """
  def select(n):
    tree = {f"a{i}": jnp.ones((8, 8) if i % 2 else (8,)) for i in range(n)}
    step = lambda new, old: jmp_lite.select_tree(jmp_lite.all_finite(new), new, old)
    return tree, jax.jit(step)

  sizes = {}
  for n in (100, 400):
    tree, step = select(n)
    sizes[n] = _instructions(step.lower(tree, tree).compile())
    old = jax.tree.map(jnp.zeros_like, tree)
    assert_trees_bitwise_equal(step(tree, old), tree)
    bad = dict(tree, a7=tree["a7"].at[3, 1].set(jnp.nan))
    assert_trees_bitwise_equal(step(bad, old), old)
  # Linear: 4x the arrays, at most 4.5x the instructions (it was 11.4x).
  assert sizes[400] <= 4.5 * sizes[100], sizes


@pytest.mark.usefixtures("standard_promotion")
def test_a_zero_size_parameter_trains_beside_the_others():
  """Plain jax.grad takes a (0, 4) parameter; the guard raised 'zero-size array
  to reduction operation max' on every step."""
  params = {"w": jnp.ones(3), "e": jnp.zeros((0, 4))}
  for clip_norm in (None, 1e-3):
    tx = jo.with_loss_scale(optax.adam(0.1), jmp_lite.DynamicLossScale(2.0 ** 15),
                            clip_norm=clip_norm)
    ref = optax.chain(*([optax.clip_by_global_norm(clip_norm)] if clip_norm else []),
                      optax.adam(0.1))
    state, ref_state = tx.init(params), ref.init(params)
    grads = {"w": jnp.array([1.0, -2.0, 3.0]), "e": jnp.zeros((0, 4))}
    scaled = jax.tree.map(lambda g: g * 2.0 ** 15, grads)
    updates, state = tx.update(scaled, state, params)
    want, _ = ref.update(grads, ref_state, params)
    assert not bool(jo.find_loss_scale_state(state).skipped)
    np.testing.assert_allclose(updates["w"], want["w"], rtol=1e-6)
    assert updates["e"].shape == (0, 4)
    # A non-finite gradient elsewhere still skips.
    bad = {"w": jnp.array([1.0, jnp.inf, 3.0]), "e": jnp.zeros((0, 4))}
    updates, state = tx.update(bad, state, params)
    assert bool(jo.find_loss_scale_state(state).skipped)
    assert_trees_bitwise_equal(jo.apply_updates(params, updates), params)


@pytest.mark.usefixtures("standard_promotion")
def test_minimize_takes_integer_and_python_float_leaves():
  """Integer leaves get float0 gradients and stay; Python floats train like
  float32 scalars (jax.grad's own treatment), with one compilation: create
  stores them as float32 and int32 arrays."""
  params = {"w": jnp.ones(3), "step": jnp.int32(7), "c": 2.0}
  state = jmp_lite.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1),
                                     loss_scale=jmp_lite.DynamicLossScale(2.0 ** 15))

  @jax.jit
  def train(state):
    return state.minimize(lambda p: jnp.sum(p["w"] ** 2) * p["c"])

  with count_compilations() as compiled:
    new, info = train(state)
    new, info = train(new)
  assert len(compiled) == 1
  assert not bool(info.skipped) and int(info.stalled) == 0
  assert int(new.params["step"]) == 7 and new.params["step"].dtype == jnp.int32
  assert state.params["c"].dtype == new.params["c"].dtype == jnp.float32
  # Two SGD steps on c * |w|^2 (and on c from |w|^2), from optax itself.
  ref = {"w": jnp.ones(3), "c": jnp.float32(2.0)}
  opt = optax.sgd(0.1)
  opt_state = opt.init(ref)
  for _ in range(2):
    g = jax.grad(lambda p: jnp.sum(p["w"] ** 2) * p["c"])(ref)
    u, opt_state = opt.update(g, opt_state, ref)
    ref = optax.apply_updates(ref, u)
  np.testing.assert_allclose(new.params["w"], ref["w"], rtol=1e-6)
  np.testing.assert_allclose(new.params["c"], ref["c"], rtol=1e-6)


@pytest.mark.usefixtures("standard_promotion")
@pytest.mark.parametrize("mask", [jnp.array([True, False, True]), jnp.array([1, 0, 1])],
                         ids=["bool", "int"])
def test_minimize_takes_a_mask_kept_with_the_parameters(mask):
  """A boolean mask in the parameters gets a float0 gradient and stays (``lax.add``
  has no boolean form: the step raised); the rest trains as optax trains it."""
  loss = lambda p: jnp.sum((p["w"] * p["m"]) ** 2)
  state = jmp_lite.TrainState.create(apply_fn=None, params={"w": jnp.ones(3), "m": mask},
                                     tx=optax.adam(0.1))
  new, info = jax.jit(lambda s: s.minimize(loss))(state)
  assert not bool(info.skipped)
  assert_trees_bitwise_equal(new.params["m"], mask)
  opt = optax.adam(0.1)
  g = jax.grad(loss, allow_int=True)({"w": jnp.ones(3), "m": mask})["w"]
  want = optax.apply_updates(jnp.ones(3), opt.update(g, opt.init(jnp.ones(3)))[0])
  np.testing.assert_allclose(new.params["w"], want, rtol=1e-6)


@pytest.mark.usefixtures("standard_promotion")
@pytest.mark.parametrize("accumulate_steps", [1, 2])
def test_the_optimizer_takes_python_numbers_as_optax_does(accumulate_steps):
  """Parameters given as Python floats (``jax.grad`` takes them) train as in
  optax; the optimizer saw None for them and raised inside adam."""
  params = {"w": 1.5, "v": jnp.ones(2), "n": 3}
  loss = lambda p: p["w"] ** 2 + jnp.sum(p["v"] ** 2)
  grads = jax.grad(loss, allow_int=True)(params)
  tx = jo.with_loss_scale(optax.adam(0.1), jmp_lite.NoOpLossScale(),
                          accumulate_steps=accumulate_steps)
  state = tx.init(params)
  for _ in range(accumulate_steps):
    updates, state = tx.update(grads, state, params)
  ref = optax.adam(0.1)
  plain = {"w": params["w"], "v": params["v"]}
  want, _ = ref.update({"w": grads["w"], "v": grads["v"]}, ref.init(plain), plain)
  got = optax.apply_updates(params, updates)
  np.testing.assert_allclose(got["w"], optax.apply_updates(plain, want)["w"], rtol=1e-6)
  np.testing.assert_allclose(got["v"], optax.apply_updates(plain, want)["v"], rtol=1e-6)
  assert int(got["n"]) == 3


@pytest.mark.parametrize("w", [jnp.asarray(1.5), np.ones(2, np.float32)],
                         ids=["weak_scalar", "numpy"])
def test_create_stores_what_the_step_writes_back(w):
  """A weakly typed or NumPy parameter is stored as the strongly typed
  `jax.Array` the step returns: one compilation, not two."""
  state = jmp_lite.TrainState.create(apply_fn=None, params={"w": w}, tx=optax.sgd(0.1))
  assert isinstance(state.params["w"], jax.Array) and not state.params["w"].weak_type
  step = jax.jit(lambda s: s.minimize(lambda p: jnp.sum(p["w"] ** 2))[0])
  with count_compilations() as compiled:
    step(step(state))
  assert len(compiled) == 1


@pytest.mark.parametrize("clip_norm", [None, 1.0])
def test_unscaled_gradients_just_above_the_smallest_normal_are_kept(clip_norm):
  """Unscaling by 2**16 took ``g * 2**-17`` first, subnormal (flushed to 0)
  for results below twice the smallest normal; the factor at most 1 comes
  second now. Oracle: NumPy's division (exact for a power of two)."""
  scaled = np.array([1e-33, 1.5e-33, 1e-32, 3e-30], np.float32)
  tx = jo.with_loss_scale(optax.sgd(1.0), jmp_lite.DynamicLossScale(2.0 ** 16),
                          clip_norm=clip_norm)
  params = {"w": jnp.zeros(4)}
  updates, _ = jax.jit(tx.update)({"w": jnp.asarray(scaled)}, tx.init(params), params)
  want = scaled.astype(np.float64) / 2.0 ** 16  # far below clip_norm
  assert np.all(np.abs(want) >= np.finfo(np.float32).tiny)
  np.testing.assert_allclose(-np.asarray(updates["w"]), want, rtol=2 ** -22)


@pytest.mark.parametrize("make", [
    lambda v: jmp_lite.StaticLossScale(v),
    lambda v: jmp_lite.DynamicLossScale(v, min_loss_scale=0.0)])
def test_a_subnormal_loss_scale_is_refused(make):
  """1e-39 flushes every gradient to zero: nothing trains and no step is skipped."""
  with pytest.raises(ValueError, match="smallest normal"):
    make(1e-39)
  make(float(np.finfo(np.float32).tiny))  # the smallest normal is fine


def test_multisteps_around_the_guard_is_refused_at_any_depth():
  """Two chains deep, MultiSteps bypassed the refusal; its state is refused
  wherever it comes from."""
  tx = jo.with_loss_scale(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0 ** 15))
  params = {"w": jnp.ones(3)}
  nested = optax.MultiSteps(
      optax.chain(optax.chain(tx, optax.identity()), optax.identity()), every_k_schedule=2)
  with pytest.raises(ValueError, match="accumulate_steps"):
    nested.init(params)
  by_hand = optax.MultiStepsState(
      mini_step=jnp.int32(0), gradient_step=jnp.int32(0),
      inner_opt_state=(tx.init(params),), acc_grads={"w": jnp.zeros(3)}, skip_state=())
  with pytest.raises(ValueError, match="accumulate_steps"):
    jo.get_loss_scale(by_hand)


@pytest.mark.usefixtures("standard_promotion")
@pytest.mark.parametrize("make", [
    lambda: optax.adam(1e-2), lambda: optax.adamw(1e-2, weight_decay=0.1),
    lambda: optax.sgd(1e-2, momentum=0.9), lambda: optax.lion(1e-3),
    lambda: optax.chain(optax.clip(0.5), optax.rmsprop(1e-2))],
    ids=["adam", "adamw", "momentum", "lion", "clip+rmsprop"])
def test_applied_steps_are_the_plain_optax_step(make):
  """Oracle: the same optimizer in a plain jitted optax step, on the unscaled
  gradients (the loss scale is a power of two: unscaling is exact). Applied
  steps match it to float32 rounding: the two programs are fused differently,
  and XLA contracts multiply-adds into FMAs where it fuses, so the last bit
  may differ. Faulted steps leave params and state bitwise unchanged."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=4), jnp.float32)}
  xs = rng.normal(size=(12, 3, 8)).astype(np.float32)
  faults = {3, 4, 9}
  tx = jo.with_loss_scale(make(), jmp_lite.DynamicLossScale(2.0 ** 12, period=2))
  plain_tx = make()

  def loss(p, x):
    return jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2)

  @jax.jit
  def guarded(p, s, x, fault):
    scale = jo.get_loss_scale(s)
    g = jax.grad(lambda q: scale.scale(loss(q, x) * jnp.where(fault, jnp.inf, 1.0)))(p)
    u, s = tx.update(g, s, p)
    return jo.apply_updates(p, u), s

  @jax.jit
  def plain(p, s, x):
    u, s = plain_tx.update(jax.grad(loss)(p, x), s, p)
    return optax.apply_updates(p, u), s

  state, plain_state = tx.init(params), plain_tx.init(params)
  plain_params = params
  for i, x in enumerate(xs):
    new, state = guarded(params, state, x, i in faults)
    if i in faults:
      assert_trees_bitwise_equal(new, params, f"step {i}")
      assert bool(jo.find_loss_scale_state(state).skipped)
    else:
      plain_params, plain_state = plain(plain_params, plain_state, x)
      close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
      jax.tree.map(close, new, plain_params)
      jax.tree.map(close, jo.find_loss_scale_state(state).inner_state, plain_state)
      plain_params = new  # the next step from the same point
    params = new


def _stalling_step(tx, loss_scale):
  @jax.jit
  def step(params, opt_state):
    grads = loss_scale.scale({"w": jnp.full(2, 2e4, jnp.float16), "b": jnp.ones(3)})
    updates, opt_state = tx.update(grads, opt_state, params)
    return jo.apply_updates(params, updates), opt_state
  return step


def test_a_step_that_only_overflows_its_results_does_not_stall_silently():
  """-1e8 onto a float16 parameter: finite gradients, the scale never moves,
  and the same step would be skipped forever. The count is kept, and at the
  limit the compiled step raises, naming the parameter."""
  params = {"w": jnp.ones(2, jnp.float16), "b": jnp.zeros(3)}
  loss_scale = jmp_lite.StaticLossScale(0.5)
  tx = jo.with_loss_scale(optax.sgd(1e4), loss_scale, max_stalled_steps=3)
  step = _stalling_step(tx, loss_scale)
  opt_state = tx.init(params)
  for expected in (1, 2):
    params, opt_state = step(params, opt_state)
    state = jo.find_loss_scale_state(opt_state)
    assert int(state.stalled) == expected and bool(state.skipped)
  with pytest.raises(Exception, match=r"3 steps in a row.*params \+ updates \['w'\]") as err:
    jax.block_until_ready(step(params, opt_state))
  assert "'b'" not in str(err.value).splitlines()[-1]


def test_the_stall_count_resets_and_can_be_unbounded():
  params = {"w": jnp.ones(2, jnp.float16), "b": jnp.zeros(3)}
  loss_scale = jmp_lite.StaticLossScale(0.5)
  tx = jo.with_loss_scale(optax.sgd(1e4), loss_scale, max_stalled_steps=None)
  step = _stalling_step(tx, loss_scale)
  opt_state = tx.init(params)
  for _ in range(5):
    params, opt_state = step(params, opt_state)
  assert int(jo.find_loss_scale_state(opt_state).stalled) == 5
  # An applied step, and a step skipped for its gradients, reset it.
  updates, applied = tx.update({"w": jnp.zeros(2, jnp.float16), "b": jnp.ones(3)},
                               opt_state, params)
  assert not bool(jo.find_loss_scale_state(applied).skipped)
  assert int(jo.find_loss_scale_state(applied).stalled) == 0
  _, nan_step = tx.update({"w": jnp.full(2, jnp.nan, jnp.float16), "b": jnp.ones(3)},
                          opt_state, params)
  assert int(jo.find_loss_scale_state(nan_step).stalled) == 0
  for bad in (0, -1, 2.5, True):
    with pytest.raises(ValueError, match="max_stalled_steps"):
      jo.with_loss_scale(optax.sgd(1.0), loss_scale, max_stalled_steps=bad)


@pytest.mark.usefixtures("standard_promotion")  # optax's Adam: b1 ** count
def test_no_branch_of_the_guard_reads_an_array():
  """The guard's only conditionals are fences around scalar arithmetic: no
  rarely taken branch reads the gradients or the optimizer's results. XLA
  compiles a branch whether or not it runs; the norm's overflow branch (three
  more reductions per group of arrays) was most of the guard's compile time."""
  params = {"w": jnp.ones((8, 4)), "b": jnp.ones(4), "h": jnp.ones(4, jnp.float16)}
  for clip_norm in (None, 1.0):
    tx = jo.with_loss_scale(optax.adam(1e-3), jmp_lite.DynamicLossScale(2.0 ** 15),
                            clip_norm=clip_norm)
    jaxpr = jax.make_jaxpr(tx.update)(params, tx.init(params), params).jaxpr
    conds = [e for e in equations(jaxpr) if e.primitive.name == "cond"]
    assert conds  # the fences
    for eqn in conds:
      for branch in eqn.params["branches"]:
        shapes = {np.shape(v.aval) for e in equations(branch.jaxpr)
                  for v in (*e.invars, *e.outvars) if hasattr(v, "aval")}
        assert shapes <= {()}, (clip_norm, shapes)


def _norm_oracle(grads, scale):
  """Float64 NumPy: the unscaled global norm and whether every value is finite."""
  flat = np.concatenate([np.asarray(g, np.float64).ravel() for g in grads.values()])
  with np.errstate(invalid="ignore"):
    return np.sqrt(np.sum((flat / scale) ** 2)), bool(np.all(np.isfinite(flat)))


@pytest.mark.parametrize("scale", [2.0 ** -20, 0.75, 1.0, 2.0 ** 15, 3.0 * 2 ** 40, 2.0 ** 100])
def test_the_norm_and_finiteness_hold_where_the_squares_overflow(scale):
  """One pass decides finiteness and the norm: scaled gradients whose squares
  overflow float32 (1e25 to 1e36) beside ordinary ones, and NaN or inf among
  them. Oracle: NumPy in float64. The norm to float32 rounding (saturated at
  float32's largest value, where the unscaled norm is beyond it), the update
  clipped to its target norm, and a non-finite value never taken for a large
  one."""
  rng = np.random.default_rng(0)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  cases = {
      "ordinary": {"w": f32(rng.normal(size=(8, 4)) * scale), "b": f32(rng.normal(size=4))},
      "huge": {"w": f32(rng.normal(size=(8, 4)) * 1e25), "b": f32([1e36, -3e35, 1.0, 0.0])},
      "huge and small": {"w": f32(rng.normal(size=(8, 4)) * 1e-3 * scale),
                         "b": f32([2e30, 1e-30, -5.0, 7e29])},
  }
  for name, grads in list(cases.items()):
    for bad in (np.nan, np.inf, -np.inf):
      cases[f"{name} with {bad}"] = dict(grads, b=grads["b"].at[2].set(bad))
  params = {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)}
  tx = jo.with_loss_scale(optax.sgd(1.0), jmp_lite.StaticLossScale(scale), clip_norm=2.0)
  update = jax.jit(tx.update)
  for name, grads in cases.items():
    norm, finite = _norm_oracle(grads, scale)
    updates, state = update(grads, tx.init(params), params)
    state = jo.find_loss_scale_state(state)
    assert bool(state.nonfinite.grads) == (not finite), (name, scale)
    if not finite:
      assert bool(state.skipped), name
      continue
    assert not bool(state.skipped), (name, scale)
    np.testing.assert_allclose(state.grad_norm, min(norm, np.finfo(np.float32).max),
                               rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(optax.tree.norm(updates), min(norm, 2.0), rtol=1e-5,
                               err_msg=name)


def test_results_are_reported_by_what_overflowed():
  """The updates and the new parameters share one reduction (an update that is
  not finite makes ``p + u`` non-finite where ``p`` is finite); each flag is
  still its own. Oracle: NumPy on what each step would write."""
  def run(grad, param, lr=1.0):
    params = {"w": jnp.asarray(param, jnp.float16), "b": jnp.zeros(3)}
    tx = jo.with_loss_scale(optax.sgd(lr), jmp_lite.NoOpLossScale())
    grads = {"w": jnp.asarray(grad, jnp.float32), "b": jnp.ones(3)}
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    return jo.find_loss_scale_state(state).nonfinite

  # sgd: u = -lr * g in float32; p + u rounded to float16.
  nf = run([1.0, 2.0], [1.0, 1.0], lr=1e4)  # p + u = -1e4: finite
  assert not (bool(nf.updates) or bool(nf.params))
  nf = run([1.0, 7.0], [1.0, 1.0], lr=1e4)  # p + u = -7e4: beyond float16
  assert not bool(nf.updates) and bool(nf.params)
  nf = run([1.0, 3e38], [1.0, 1.0], lr=10.0)  # u = -3e39: beyond float32
  assert bool(nf.updates) and bool(nf.params) and not bool(nf.grads)
  nf = run([1.0, 3e38], [1.0, np.inf], lr=10.0)  # only where p was already inf
  assert not (bool(nf.updates) or bool(nf.params))
  nf = run([1.0, 7.0], [np.inf, 1.0], lr=1e4)  # p + u overflows beside an inf p
  assert not bool(nf.updates) and bool(nf.params)
